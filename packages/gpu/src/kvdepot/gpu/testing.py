"""Test helpers: engine-shaped KV caches and a plain-torch reference for where each block's bytes are.

The reference reads blocks by plain indexing of the engine's tensors, independently of
`KVLayout`, so connector tests can check copies against it too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

NUM_BLOCKS = 12
HEADS = 2
HEAD = 8
TOKENS = 4
LAYERS = 3


@dataclass
class Case:
    """A KV cache as an engine would register it, and how to read a block independently."""

    name: str
    kv: dict[str, torch.Tensor]
    kind: str  # which reference slicing applies
    hint: str | None = None
    block_size: int | None = None
    ratio: int = 1  # kernel blocks per engine block
    aliases: dict[str, str] = field(default_factory=dict)

    @property
    def layers(self) -> list[str]:
        return [n for n in self.kv if n not in self.aliases]

    @property
    def num_blocks(self) -> int:
        t = next(iter(self.kv.values()))
        return int(t.shape[1 if self.kind == "flash_attn" else 0]) // self.ratio


def memory_order_bytes(x: torch.Tensor) -> torch.Tensor:
    """The bytes of a dense tensor in the order they sit in memory."""
    perm = sorted(range(x.dim()), key=lambda d: -x.stride(d))
    return x.permute(perm).contiguous().reshape(-1).view(torch.uint8)


def block_bytes(case: Case, layer: str, block: int) -> torch.Tensor:
    """Reference: one engine block of one layer, read by plain indexing of the engine's tensor."""
    t = case.kv[layer]
    parts = []
    for kernel_block in range(block * case.ratio, (block + 1) * case.ratio):
        if case.kind == "flash_attn":
            parts += [memory_order_bytes(t[0, kernel_block]), memory_order_bytes(t[1, kernel_block])]
        else:
            parts.append(memory_order_bytes(t[kernel_block]))
    if case.kind == "flash_attn" and case.ratio > 1:  # K of every kernel block, then V
        parts = parts[0::2] + parts[1::2]
    return torch.cat(parts)


def chunk_bytes(case: Case, blocks: list[int]) -> torch.Tensor:
    """Reference: a chunk's slot bytes, layer-major, then block, then the block's bytes."""
    return torch.cat([block_bytes(case, layer, b) for layer in case.layers for b in blocks])


def snapshot(case: Case) -> dict[tuple[str, int], torch.Tensor]:
    return {(layer, b): block_bytes(case, layer, b).clone() for layer in case.layers for b in range(case.num_blocks)}


def random_bytes(numel_bytes: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (numel_bytes,), dtype=torch.uint8, generator=gen)


def _typed(nbytes: int, dtype: torch.dtype, seed: int, device: str) -> torch.Tensor:
    return random_bytes(nbytes, seed).to(device).view(dtype)


def build_case(name: str, dtype: torch.dtype, seed: int = 0, device: str = "cpu") -> Case:
    """One of `LAYOUT_NAMES`, filled with random bytes (NaN and infinity patterns included)."""
    el = torch.tensor([], dtype=dtype).element_size()
    b, h, n, d, layers = NUM_BLOCKS, HEADS, TOKENS, HEAD, LAYERS
    if name == "cpu":
        kv = {
            f"model.layers.{i}.attn": _typed(b * h * n * 2 * d * el, dtype, seed + i, device).view(b, h, n, 2 * d)
            for i in range(layers)
        }
        return Case(name, kv, "bhnc", hint="CPU_ATTN")
    if name == "flash_attn":
        kv = {
            f"layers.{i}": _typed(2 * b * n * h * d * el, dtype, seed + i, device).view(2, b, n, h, d)
            for i in range(layers)
        }
        return Case(name, kv, "flash_attn", hint="FLASH_ATTN")
    if name == "flashinfer":
        kv = {
            f"layers.{i}": _typed(b * 2 * n * h * d * el, dtype, seed + i, device).view(b, 2, n, h, d)
            for i in range(layers)
        }
        return Case(name, kv, "bhnc", hint="FLASHINFER")
    if name == "mla":
        kv = {
            f"layers.{i}": _typed(b * n * 3 * d * el, dtype, seed + i, device).view(b, n, 3 * d) for i in range(layers)
        }
        return Case(name, kv, "bhnc", hint="FLASHMLA")
    if name == "shared_layer_major":  # one storage, each layer a contiguous region (vLLM LBHNC)
        buf = _typed(layers * b * h * n * 2 * d * el, dtype, seed, device).view(layers, b, h, n, 2 * d)
        return Case(name, {f"l{i}": buf[i] for i in range(layers)}, "bhnc", hint="cpu")
    if name == "shared_block_major":  # one storage, layers interleaved inside each block (vLLM BLHNC)
        buf = _typed(layers * b * h * n * 2 * d * el, dtype, seed, device).view(b, layers, h, n, 2 * d)
        return Case(name, {f"l{i}": buf[:, i] for i in range(layers)}, "bhnc")
    if name == "shared_permuted":  # logical [B, H, N, C] over physical [L, B, N, H, C] (vLLM LBNHC)
        buf = _typed(layers * b * n * h * 2 * d * el, dtype, seed, device).view(layers, b, n, h, 2 * d)
        return Case(name, {f"l{i}": buf[i].transpose(1, 2) for i in range(layers)}, "bhnc")
    if name == "shared_flash":  # flash-attention layers carved from one storage
        buf = _typed(layers * 2 * b * n * h * d * el, dtype, seed, device).view(layers, 2, b, n, h, d)
        return Case(name, {f"l{i}": buf[i] for i in range(layers)}, "flash_attn", hint="flash_attn")
    if name == "aliased":  # cross-layer KV sharing: two names, one tensor
        case = build_case("cpu", dtype, seed, device)
        case.kv["model.layers.3.attn"] = case.kv["model.layers.1.attn"]
        case.aliases = {"model.layers.3.attn": "model.layers.1.attn"}
        return case
    if name == "kernel_blocks":  # engine blocks of 8 tokens held as two 4-token kernel blocks
        kv = {
            f"l{i}": _typed(2 * b * h * n * 2 * d * el, dtype, seed + i, device).view(2 * b, h, n, 2 * d)
            for i in range(layers)
        }
        return Case(name, kv, "bhnc", block_size=2 * n, ratio=2)
    if name == "kernel_blocks_flash":
        kv = {
            f"l{i}": _typed(2 * 2 * b * n * h * d * el, dtype, seed + i, device).view(2, 2 * b, n, h, d)
            for i in range(layers)
        }
        return Case(name, kv, "flash_attn", hint="FLASH_ATTN", block_size=2 * n, ratio=2)
    if name == "odd_width":  # a block of 3 * 2 bytes: only 2-byte words fit
        kv = {
            f"l{i}": _typed(b * 1 * 1 * 3 * 2, torch.float16, seed + i, device).view(b, 1, 1, 3) for i in range(layers)
        }
        return Case(name, kv, "bhnc")
    raise AssertionError(name)


LAYOUT_NAMES = [
    "cpu",
    "flash_attn",
    "flashinfer",
    "mla",
    "shared_layer_major",
    "shared_block_major",
    "shared_permuted",
    "shared_flash",
    "aliased",
    "kernel_blocks",
    "kernel_blocks_flash",
    "odd_width",
]

DTYPES = [torch.float32, torch.bfloat16, torch.float16] + [
    getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name)
]
