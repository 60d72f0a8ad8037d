"""Where each block's bytes are in an engine's paged KV cache.

A block is opaque bytes: kvdepot never interprets K, V or heads, it only finds the
byte ranges that hold one block of one layer and moves them whole. Every supported
layout reduces to the same geometry per layer:

    block b, segment s of a layer = bytes [offset + b * block_stride + s * seg_stride, ... + seg_bytes)

with one segment when the block's bytes are one dense range (CPU, flashinfer, MLA) and
two when K and V live apart (flash-attention). Layers that sit in one storage at a
uniform distance from each other form a *plane group* (one view, one Triton launch).
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Mapping
from typing import Any

import attrs
import torch

from kvdepot.gpu._errors import UnsupportedLayoutError

# Names a connector may pass as `backend_hint`, mapped to the layout kinds they allow.
# vLLM's attention backend names are matched case-insensitively. "bhnc" is also what
# newer vLLM (0.26 on) registers for every backend (a logical [B, H, N, C] view per layer,
# K and V packed in the last dimension, in any `KVCacheLayout` order), so each GPU backend
# name accepts it as well as its own historical shape, and a backend named nowhere here
# (TRITON_ATTN, FLEX_ATTENTION, ROCM_ATTN, ...) gets that view alone.
_KINDS_BY_HINT: dict[str, tuple[str, ...]] = {
    "cpu": ("bhnc",),
    "cpu_attn": ("bhnc",),
    "torch_sdpa": ("bhnc",),
    "bhnc": ("bhnc",),
    "flash_attn": ("flash_attn", "bhnc"),
    "flashinfer": ("flashinfer", "bhnc"),
    "mla": ("mla", "bhnc"),
}

# Per kind: tensor rank, the block dimension, the K/V dimension (None: K and V are not
# split outside the block) and the token dimension.
_KIND_DIMS: dict[str, tuple[int, int, int | None, int]] = {
    "bhnc": (4, 0, None, 2),  # [num_blocks, num_kv_heads, block_size, 2 * head_size]
    "flash_attn": (5, 1, 0, 2),  # [2, num_blocks, block_size, num_kv_heads, head_size]
    "flashinfer": (5, 0, 1, 2),  # [num_blocks, 2, block_size, num_kv_heads, head_size]
    "mla": (3, 0, None, 1),  # [num_blocks, block_size, head_size]
}

# Element widths tried for the copy views, widest first. 16 bytes is complex128, the
# widest torch dtype; copies through it are bitwise (tests pin this with NaN patterns).
_WIDTHS = (16, 8, 4, 2, 1)
_DTYPE_OF_WIDTH = {16: torch.complex128, 8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}

FINGERPRINT_VERSION = 1


def _hint_key(hint: str) -> str:
    key = hint.strip().lower()
    return key[: -len("_vllm_v1")] if key.endswith("_vllm_v1") else key


def _normalise_hint(hint: str | None) -> tuple[str, ...] | None:
    if hint is None:
        return None
    key = _hint_key(hint)
    if key in _KINDS_BY_HINT:
        return _KINDS_BY_HINT[key]
    if "mla" in key:  # FLASHMLA, TRITON_MLA, CUTLASS_MLA, FLASHINFER_MLA, ...
        return _KINDS_BY_HINT["mla"]
    return _KINDS_BY_HINT["bhnc"]  # vLLM's one view for every backend since 0.26


def width_of(*values: int) -> int:
    """The widest element size in bytes (16, 8, 4, 2 or 1) that divides every value."""
    for width in _WIDTHS:
        if all(value % width == 0 for value in values):
            return width
    return 1  # pragma: no cover - 1 divides everything


def dtype_of_width(width: int) -> torch.dtype:
    return _DTYPE_OF_WIDTH[width]


def _dense(sizes: list[int], strides: list[int]) -> bool:
    """True when these dimensions cover one gap-free range of elements."""
    expected = 1
    for size, stride in sorted((p for p in zip(sizes, strides, strict=True) if p[0] != 1), key=lambda p: p[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def _disjoint(dims: list[tuple[int, int]], inner: int) -> bool:
    """True when a grid of (size, stride) dims over dense runs of `inner` units never overlaps."""
    extent = inner
    for size, stride in sorted((d for d in dims if d[0] > 1), key=lambda d: d[1]):
        if stride < extent:
            return False
        extent += stride * (size - 1)
    return True


@attrs.frozen
class _LayerGeometry:
    """One layer's blocks, in bytes relative to the start of its storage."""

    storage_ptr: int
    offset: int
    num_blocks: int
    block_stride: int
    num_segments: int
    seg_stride: int
    seg_bytes: int
    tokens: int
    describe: str  # block shape, dim order and split, for the fingerprint


@attrs.define(eq=False)
class PlaneGroup:
    """Consecutive layers in one storage, a uniform `plane_stride` apart, copied by one op.

    The group's bytes for plane p, block b, segment s start at
    `offset + p * plane_stride + b * block_stride + s * seg_stride` in its storage.
    """

    source: torch.Tensor  # one layer tensor of the group, keeps the storage alive
    first_plane: int
    num_planes: int
    offset: int
    plane_stride: int
    block_stride: int
    num_segments: int
    seg_stride: int
    seg_bytes: int
    num_blocks: int
    max_width: int
    _views: dict[int, Any] = attrs.field(factory=dict, repr=False)

    @property
    def plane_block_bytes(self) -> int:
        """Bytes of one block of one layer of this group."""
        return self.num_segments * self.seg_bytes

    def base(self, width: int) -> torch.Tensor:
        """The whole storage as a flat tensor of `width`-byte elements."""
        storage = self.source.untyped_storage()
        flat = torch.empty(0, dtype=torch.uint8, device=self.source.device).set_(storage)
        usable = flat.numel() - flat.numel() % width
        return flat[:usable].view(dtype_of_width(width))

    def view(self, width: int) -> torch.Tensor:
        """A [planes, blocks, segments, seg_bytes / width] view of the group's blocks."""
        assert self.max_width % width == 0
        cached = self._views.get(width)
        if cached is None:
            cached = self.base(width).as_strided(
                (self.num_planes, self.num_blocks, self.num_segments, self.seg_bytes // width),
                (
                    max(self.plane_stride, width) // width,
                    self.block_stride // width,
                    max(self.seg_stride, width) // width,
                    1,
                ),
                self.offset // width,
            )
            self._views[width] = cached
        return cached


@attrs.define(eq=False)
class KVLayout:
    """The KV cache of one engine worker: block geometry of every layer, and the tensors.

    Build it with `KVLayout.from_kv_caches`. A chunk of `n` blocks occupies
    `chunk_bytes(n)` bytes in its pool slot, in this order: layer (in the order of the
    `kv_caches` dict, aliases dropped), then block (in the order the caller lists them),
    then the block's bytes in the engine's memory order (K before V where they are apart).
    """

    kind: str
    backend: str  # the normalised backend hint, "" when none was given
    num_blocks: int
    block_size: int
    dtype: torch.dtype
    device: torch.device
    layer_names: tuple[str, ...]
    aliases: Mapping[str, str]
    plane_bytes: tuple[int, ...]
    groups: tuple[PlaneGroup, ...]
    plane_prefix: tuple[int, ...] = attrs.field(init=False, repr=False)
    _describe: tuple[str, ...] = attrs.field(repr=False)

    def __attrs_post_init__(self) -> None:
        prefix, total = [], 0
        for size in self.plane_bytes:
            prefix.append(total)
            total += size
        self.plane_prefix = tuple(prefix)

    @property
    def num_layers(self) -> int:
        """Distinct layers (layers that alias another layer's tensor are counted once)."""
        return len(self.layer_names)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block summed over all layers."""
        return sum(self.plane_bytes)

    def chunk_bytes(self, blocks_per_chunk: int) -> int:
        """The size of a pool slot that holds `blocks_per_chunk` blocks of every layer."""
        if isinstance(blocks_per_chunk, bool) or not isinstance(blocks_per_chunk, int) or blocks_per_chunk <= 0:
            raise UnsupportedLayoutError(
                f"blocks_per_chunk must be a positive int, got {blocks_per_chunk!r}; "
                "pass chunk_size // layout.block_size.",
                layer=None,
                shapes=None,
                strides=None,
                hint=None,
            )
        return blocks_per_chunk * self.bytes_per_block

    def fingerprint(self) -> str:
        """A stable string naming everything the bytes of a chunk depend on besides tokens.

        Two workers whose fingerprints are equal store identical bytes for identical
        tokens, so the string belongs in the chunk-key namespace (`Namespace.layout`).
        It includes the backend hint: backends may arrange K and V differently inside
        identically shaped blocks, so caches of different backends are never mixed.
        """
        geometry = self._describe[0] if len(set(self._describe)) == 1 else ",".join(self._describe)
        text = (
            f"kvdepot-layout-v{FINGERPRINT_VERSION};kind={self.kind};backend={self.backend or 'none'};"
            f"dtype={str(self.dtype).removeprefix('torch.')};"
            f"layers={self.num_layers};block_tokens={self.block_size};block={geometry};"
            f"bytes_per_block={self.bytes_per_block}"
        )
        if len(text) > 200:  # keep the namespace field short for models with many uneven layers
            digest = hashlib.sha256(text.encode()).hexdigest()[:32]
            text = text[: text.index(";block=")] + f";block=sha256:{digest};bytes_per_block={self.bytes_per_block}"
        return text

    def plane_offset_in_slot(self, plane: int, blocks_in_chunk: int) -> int:
        """Byte offset of layer `plane`'s blocks inside a slot of `blocks_in_chunk` blocks."""
        return blocks_in_chunk * self.plane_prefix[plane]

    @classmethod
    def from_kv_caches(
        cls,
        kv_caches: Mapping[str, torch.Tensor],
        block_size: int | None = None,
        *,
        backend_hint: str | None = None,
    ) -> KVLayout:
        """Describe the KV cache from the per-layer tensors the engine registers.

        `block_size` is the engine's block size in tokens; when the tensors hold smaller
        kernel blocks that tile an engine block densely, they are merged into engine blocks.
        `backend_hint` is the attention backend's name (e.g. vLLM's `CPU_ATTN`,
        `FLASH_ATTN`, `FLASHINFER`, `FLASHMLA`); shapes that fit more than one layout
        need it. Anything not recognised raises `UnsupportedLayoutError`.
        """
        return _build(kv_caches, block_size, backend_hint)


def _fail(
    message: str, kv_caches: Mapping[str, Any], hint: str | None, layer: str | None = None
) -> UnsupportedLayoutError:
    shapes = {
        name: tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for name, t in kv_caches.items()
    }
    strides = {name: tuple(t.stride()) if isinstance(t, torch.Tensor) else None for name, t in kv_caches.items()}
    some = list(shapes.items())[:4]
    return UnsupportedLayoutError(
        f"{message} (layers {len(shapes)}, first shapes {some}, first strides {list(strides.items())[:4]}, "
        f"backend_hint={hint!r}). Pass backend_hint= with the engine's attention backend name, or add the "
        "layout to kvdepot.gpu (see docs/gpu.md, 'Adding a layout').",
        layer=layer,
        shapes=shapes,
        strides=strides,
        hint=hint,
    )


def _pick_kind(t: torch.Tensor, allowed: tuple[str, ...] | None) -> str | None:
    candidates = [kind for kind, dims in _KIND_DIMS.items() if dims[0] == t.dim()]
    if allowed is not None:
        candidates = [kind for kind in candidates if kind in allowed]
    if t.dim() == 5:  # K/V dim: size 2 at dim 0 (flash-attn) or dim 1 (flashinfer)
        candidates = [k for k in candidates if t.shape[_KIND_DIMS[k][2] or 0] == 2]
    return candidates[0] if len(candidates) == 1 else None


def _geometry(t: torch.Tensor, kind: str, block_size: int | None) -> _LayerGeometry | str:
    """The block geometry of one layer tensor, or a reason why it is not supported."""
    _, block_dim, kv_dim, token_dim = _KIND_DIMS[kind]
    if any(s <= 0 for s, n in zip(t.stride(), t.shape, strict=True) if n > 1):
        return "zero or negative strides"
    elem = t.element_size()
    rest = [d for d in range(t.dim()) if d not in (block_dim, kv_dim)]
    sizes = [t.shape[d] for d in rest]
    strides = [t.stride(d) for d in rest]
    if not _dense(sizes, strides):
        return "a block's bytes are not one dense range"
    seg_elems = math.prod(sizes)
    segments, seg_stride = 1, seg_elems
    if kv_dim is not None:
        segments, seg_stride = t.shape[kv_dim], t.stride(kv_dim)
        if segments == 2 and seg_stride == seg_elems:  # K and V adjacent: one dense range
            segments, seg_elems = 1, 2 * seg_elems
    num_blocks, block_stride, tokens = t.shape[block_dim], t.stride(block_dim), t.shape[token_dim]
    order = sorted(rest, key=lambda d: -t.stride(d))
    describe = f"{list(sizes)}order{[rest.index(d) for d in order]}x{segments}"
    if block_size is not None and block_size != tokens:
        if block_size % tokens or num_blocks % (block_size // tokens):
            return f"block_size {block_size} is not a whole number of {tokens}-token kernel blocks"
        ratio = block_size // tokens
        if block_stride != seg_elems:
            return f"kernel blocks of {tokens} tokens do not tile an engine block of {block_size} densely"
        num_blocks, block_stride, seg_elems, tokens = (
            num_blocks // ratio,
            block_stride * ratio,
            seg_elems * ratio,
            block_size,
        )
        describe += f"kernel{ratio}"
    if not _disjoint([(num_blocks, block_stride), (segments, seg_stride)], seg_elems):
        return "blocks overlap each other"
    return _LayerGeometry(
        storage_ptr=t.untyped_storage().data_ptr(),
        offset=t.storage_offset() * elem,
        num_blocks=num_blocks,
        block_stride=block_stride * elem,
        num_segments=segments,
        seg_stride=seg_stride * elem if segments > 1 else 0,
        seg_bytes=seg_elems * elem,
        tokens=tokens,
        describe=describe,
    )


def _build(kv_caches: Mapping[str, torch.Tensor], block_size: int | None, hint: str | None) -> KVLayout:
    if not isinstance(kv_caches, Mapping) or not kv_caches:
        raise _fail("kv_caches must be a non-empty dict of layer name to tensor", {}, hint)
    allowed = _normalise_hint(hint)
    if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0):
        raise _fail(f"block_size must be a positive int, got {block_size!r}", kv_caches, hint)

    kind: str | None = None
    names: list[str] = []
    aliases: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}
    tensors: list[torch.Tensor] = []
    geometries: list[_LayerGeometry] = []
    for name, t in kv_caches.items():
        if not isinstance(t, torch.Tensor):
            raise _fail(f"layer {name!r} is a {type(t).__name__}, not a torch.Tensor", kv_caches, hint, name)
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device)
        if key in seen:  # a layer that reuses another layer's KV cache (cross-layer sharing)
            aliases[name] = seen[key]
            continue
        layer_kind = _pick_kind(t, allowed)
        if layer_kind is None:
            unnamed = hint is not None and _hint_key(hint) not in _KINDS_BY_HINT and "mla" not in _hint_key(hint)
            why = (
                f" (backend_hint {hint!r} is not one kvdepot names, so it takes vLLM's [B, H, N, C] view only; "
                f"named: {sorted(_KINDS_BY_HINT)} or any *MLA* name)"
                if unnamed
                else ""
            )
            raise _fail(
                f"layer {name!r}: shape {tuple(t.shape)} fits no single known layout{why}", kv_caches, hint, name
            )
        if kind is not None and layer_kind != kind:
            raise _fail(f"layer {name!r} is {layer_kind} but earlier layers are {kind}", kv_caches, hint, name)
        kind = layer_kind
        geometry = _geometry(t, layer_kind, block_size)
        if isinstance(geometry, str):
            raise _fail(f"layer {name!r} ({layer_kind}): {geometry}", kv_caches, hint, name)
        if tensors:
            first = tensors[0]
            if t.dtype != first.dtype or t.device != first.device:
                raise _fail(f"layer {name!r} has {t.dtype} on {t.device}, layer 0 {first.dtype} on {first.device}",
                            kv_caches, hint, name)  # fmt: skip
            if geometry.num_blocks != geometries[0].num_blocks or geometry.tokens != geometries[0].tokens:
                raise _fail(f"layer {name!r} has another block count or block size than layer 0", kv_caches, hint, name)
        seen[key] = name
        names.append(name)
        tensors.append(t)
        geometries.append(geometry)
    assert kind is not None

    groups = _group(tensors, geometries)
    _check_groups_disjoint(groups, kv_caches, hint)
    return KVLayout(
        kind=kind,
        backend=_hint_key(hint) if hint is not None else "",
        num_blocks=geometries[0].num_blocks,
        block_size=geometries[0].tokens,
        dtype=tensors[0].dtype,
        device=tensors[0].device,
        layer_names=tuple(names),
        aliases=aliases,
        plane_bytes=tuple(g.num_segments * g.seg_bytes for g in geometries),
        groups=tuple(groups),
        describe=tuple(g.describe for g in geometries),
    )


def _same_shape(a: _LayerGeometry, b: _LayerGeometry) -> bool:
    return (a.storage_ptr, a.block_stride, a.num_segments, a.seg_stride, a.seg_bytes) == (
        b.storage_ptr,
        b.block_stride,
        b.num_segments,
        b.seg_stride,
        b.seg_bytes,
    )


def _group(tensors: list[torch.Tensor], geometries: list[_LayerGeometry]) -> list[PlaneGroup]:
    """Merge runs of layers that one strided view can address into plane groups."""
    groups: list[PlaneGroup] = []
    start = 0
    while start < len(geometries):
        first = geometries[start]
        end = start + 1
        plane_stride = 0
        while end < len(geometries) and _same_shape(first, geometries[end]):
            step = geometries[end].offset - geometries[end - 1].offset
            if step <= 0 or (plane_stride and step != plane_stride):
                break
            dims = [
                (end - start + 1, step),
                (first.num_blocks, first.block_stride),
                (first.num_segments, first.seg_stride),
            ]
            if not _disjoint(dims, first.seg_bytes):
                break
            plane_stride = step
            end += 1
        num_planes = end - start
        groups.append(
            PlaneGroup(
                source=tensors[start],
                first_plane=start,
                num_planes=num_planes,
                offset=first.offset,
                plane_stride=plane_stride,
                block_stride=first.block_stride,
                num_segments=first.num_segments,
                seg_stride=first.seg_stride,
                seg_bytes=first.seg_bytes,
                num_blocks=first.num_blocks,
                max_width=width_of(
                    first.storage_ptr, first.offset, plane_stride, first.block_stride, first.seg_stride, first.seg_bytes
                ),
            )
        )
        start = end
    return groups


def _extent(group: PlaneGroup) -> tuple[int, int, int]:
    last = (
        group.offset
        + (group.num_planes - 1) * group.plane_stride
        + (group.num_blocks - 1) * group.block_stride
        + (group.num_segments - 1) * group.seg_stride
        + group.seg_bytes
    )
    return group.source.untyped_storage().data_ptr(), group.offset, last


def _check_groups_disjoint(groups: list[PlaneGroup], kv_caches: Mapping[str, torch.Tensor], hint: str | None) -> None:
    """Layers in one storage that no single view covers must not share bytes."""
    spans = sorted(_extent(g) for g in groups)
    for (ptr_a, _, end_a), (ptr_b, start_b, _) in itertools.pairwise(spans):
        if ptr_a == ptr_b and start_b < end_a:
            raise _fail("layers share one storage and their byte ranges interleave or overlap", kv_caches, hint)
