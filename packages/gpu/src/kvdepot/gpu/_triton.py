"""A Triton kernel that copies a step's chunks between a paged KV cache and pool slots, in one launch.

On CUDA the pool mapping is registered with cudaHostRegister, so the GPU reads and writes
it directly (zero-copy over PCIe/NVLink-C2C). The kernel reads the layout's copy table
(`_table.py`), kept on the device, and each chunk's block ids and slot offset, one small
host-to-device copy per call: every layer, segment, block and chunk of a gather or scatter
is one launch, with no host work per layer or per block. Under `TRITON_INTERPRET=1` the
same kernel runs on CPU tensors, which is how it is tested.

Triton is optional: `available()` says whether it can be imported.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import torch

# Words each program copies. 1024 words of 8 bytes is 8 KiB in flight per program, enough
# to hide PCIe latency with a few programs per SM without spilling.
TILE_WORDS = 1024

# Programs of one launch, by default: each copies a tile at a time, in turn. Each holds a
# share of one SM for as long as the copy runs, taken from the engine's kernels; enough of
# them keep the PCIe link busy.
PROGRAMS = 16

# Columns of a kernel table row, every one in words: (KV offset from the base, KV step per
# block id, slot offset from the chunk's slot, slot step per block position, length).
ROW_COLUMNS = 5

_KERNELS: dict[bool, Any] = {}


def available() -> bool:
    """True when Triton can be imported (the `triton` extra is installed)."""
    return importlib.util.find_spec("triton") is not None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _kernel() -> Any:
    """The jitted kernel, built on first use (Triton reads TRITON_INTERPRET when it jits)."""
    mode = _interpreting()
    kernel = _KERNELS.get(mode)
    if kernel is None:
        import triton
        import triton.language as tl

        def copy_blocks(  # type: ignore[no-untyped-def]  # noqa: PLR0917
            base, rows, ids, slots, skips, row_count, blocks, tiles, work, TO_POOL: tl.constexpr, TILE: tl.constexpr,
        ):  # fmt: skip
            # Work item ((c * blocks + j) * row_count + r) * tiles + t copies tile t of table row r's
            # segment of block ids[c, j] (chunk c, block position j); positions before the chunk's
            # skip copy nothing. Each program takes every num_programs-th item.
            for item in range(tl.program_id(0), work, tl.num_programs(0)):
                tile = item % tiles
                program = item // tiles
                r = program % row_count
                position = program // row_count  # c * blocks + j
                c = position // blocks
                j = position % blocks
                row = rows + r * 5
                kv = tl.load(row) + tl.load(ids + position) * tl.load(row + 1)
                slot = tl.load(slots + c) + tl.load(row + 2) + j * tl.load(row + 3)
                words = tile * TILE + tl.arange(0, TILE)
                length = tl.where(j >= tl.load(skips + c), tl.load(row + 4), 0)
                mask = words < length
                if TO_POOL:
                    tl.store(base + slot + words, tl.load(base + kv + words, mask=mask), mask=mask)
                else:
                    tl.store(base + kv + words, tl.load(base + slot + words, mask=mask), mask=mask)

        kernel = triton.jit(copy_blocks)
        _KERNELS[mode] = kernel
    return kernel


class DevicePointer:
    """A raw device-accessible address that Triton accepts in place of a tensor.

    Used for the pool: host memory registered with cudaHostRegister is addressable from
    the GPU at the same virtual address (unified addressing), but torch has no CUDA
    tensor for it.
    """

    def __init__(self, address: int, dtype: torch.dtype) -> None:
        self.address = address
        self.dtype = dtype

    def data_ptr(self) -> int:
        return self.address


def copy_blocks(
    base: Any, rows: torch.Tensor, ids: torch.Tensor, slots: torch.Tensor, skips: torch.Tensor, *,
    blocks: int, tile_words: int, to_pool: bool, programs: int,
) -> None:  # fmt: skip
    """Launch one gather (`to_pool`) or scatter of `slots.numel()` chunks of `blocks` blocks each.

    `base` is the pool's first word (a word-view tensor on CPU, a `DevicePointer` on CUDA);
    every offset is in words from it, KV addresses included. `rows` is the int64 kernel
    table [rows, ROW_COLUMNS]; `ids` the chunks' block ids, chunk after chunk; `slots` each
    chunk's slot offset and `skips` its leading blocks that are not copied. `tile_words`
    is the longest row's length in words. All four tensors are on the device the kernel
    runs on. At most `programs` programs run (0: one per tile), each taking tiles in turn.
    """
    chunks, row_count = int(slots.numel()), int(rows.shape[0])
    if chunks == 0 or row_count == 0 or tile_words == 0:
        return
    tiles = -(-tile_words // TILE_WORDS)
    work = row_count * chunks * blocks * tiles
    grid = (min(work, programs) if programs > 0 else work,)
    _kernel()[grid](base, rows, ids, slots, skips, row_count, blocks, tiles, work, TO_POOL=to_pool, TILE=TILE_WORDS)
