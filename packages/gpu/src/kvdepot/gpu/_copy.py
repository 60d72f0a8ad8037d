"""Gather blocks into pool slots and scatter them back: validation and the CPU path.

Every argument is checked before any byte moves (`plan_copy`); the copies themselves are
one tensor op per (chunk, plane group): `index_select` into a view of the slot for a
gather and `index_copy_` from it for a scatter, through the widest element type the
alignment allows, so no byte is staged and no Python runs per element.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence
from typing import Any, Protocol, TypeAlias

import attrs
import torch

from kvdepot.gpu._errors import BlockIdError, CopyArgumentError, PoolBoundsError, PoolDtypeError, SlotSizeError
from kvdepot.gpu._layout import KVLayout, dtype_of_width, width_of

BlockIds: TypeAlias = "Sequence[int] | torch.Tensor"


@attrs.frozen
class CopyPlan:
    """A validated gather or scatter: per chunk, its slot offset, block ids and skipped blocks."""

    offsets: tuple[int, ...]
    block_ids: tuple[torch.Tensor, ...]  # int64 CPU, every block of the chunk in slot order
    skips: tuple[int, ...]  # leading blocks of each chunk that are not copied

    def chunks(self) -> Any:
        """(offset, ids, skip, blocks in chunk) for each chunk with something to copy."""
        for offset, ids, skip in zip(self.offsets, self.block_ids, self.skips, strict=True):
            if skip < ids.numel():
                yield offset, ids, skip, ids.numel()


class CopyHandle(Protocol):
    """Completion of one gather or scatter."""

    def done(self) -> bool:
        """True once every byte of the copy has landed; never blocks."""
        ...

    def wait(self) -> None:
        """Block until the copy is complete."""
        ...


@attrs.frozen
class CompletedCopy:
    """The handle of a copy that ran synchronously (the CPU path)."""

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None


def check_pool(pool: Any) -> torch.Tensor:
    """The pool must be a 1-D contiguous uint8 tensor in host memory."""
    if not isinstance(pool, torch.Tensor):
        raise PoolDtypeError(
            f"pool must be a torch.Tensor view of the pool mapping, got {type(pool).__name__}; "
            "use torch.frombuffer(mmap_obj, dtype=torch.uint8).",
            expected="torch.uint8 tensor",
            got=type(pool).__name__,
        )
    if pool.dtype != torch.uint8 or pool.device.type != "cpu" or pool.dim() != 1 or pool.stride(0) != 1:
        raise PoolDtypeError(
            f"pool must be a 1-D contiguous torch.uint8 CPU tensor, got {pool.dtype} on {pool.device} with shape "
            f"{tuple(pool.shape)}; view the whole mapping with torch.frombuffer(mmap_obj, dtype=torch.uint8).",
            expected="1-D contiguous torch.uint8 on cpu",
            got=f"{pool.dtype} {tuple(pool.shape)} on {pool.device}",
        )
    return pool


def _as_ids(chunk: int, ids: Any) -> torch.Tensor:
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise BlockIdError(
                f"chunk {chunk}: block ids must be a 1-D integer tensor or a list of ints, got {ids.dtype} "
                f"{tuple(ids.shape)}.",
                chunk=chunk,
                block_id=None,
                num_blocks=None,
            )
        return ids.to(device="cpu", dtype=torch.int64)
    try:
        values = [operator.index(b) for b in ids]
    except TypeError as exc:
        raise BlockIdError(
            f"chunk {chunk}: block ids must be ints, got {ids!r}.", chunk=chunk, block_id=None, num_blocks=None
        ) from exc
    return torch.tensor(values, dtype=torch.int64)


def plan_copy(
    layout: KVLayout,
    pool: torch.Tensor,
    slot_offsets: Sequence[int],
    block_ids_per_chunk: Sequence[BlockIds],
    *,
    skip_blocks: int | Sequence[int] = 0,
    slot_size: int | None = None,
    writes_kv: bool,
) -> CopyPlan:
    """Check every argument of a gather (`writes_kv=False`) or scatter and normalise it.

    `skip_blocks` is either one count of leading blocks over the chunks taken in order
    (one request's consecutive chunks) or one count per chunk. Skipped blocks are never
    read or written, and their ids are not checked.
    """
    check_pool(pool)
    if len(slot_offsets) != len(block_ids_per_chunk):
        raise CopyArgumentError(
            f"{len(slot_offsets)} slot offsets for {len(block_ids_per_chunk)} chunks; pass one slot per chunk.",
            expected=len(block_ids_per_chunk),
            got=len(slot_offsets),
        )
    ids = [_as_ids(i, chunk) for i, chunk in enumerate(block_ids_per_chunk)]
    skips = _skips(skip_blocks, [t.numel() for t in ids])
    pool_bytes = pool.numel()
    spans = []
    for chunk, (offset, chunk_ids, skip) in enumerate(zip(slot_offsets, ids, skips, strict=True)):
        if chunk_ids.numel() == 0:
            raise SlotSizeError(
                f"chunk {chunk} has no blocks; drop it from the call.", chunk=chunk, expected=None, got=0
            )
        size = chunk_ids.numel() * layout.bytes_per_block
        if slot_size is not None and size != slot_size:
            raise SlotSizeError(
                f"chunk {chunk} holds {chunk_ids.numel()} blocks = {size} bytes but slots are {slot_size} bytes; "
                f"a slot holds exactly {slot_size // max(layout.bytes_per_block, 1)} blocks of this layout "
                "(check the chunk size the server was registered with).",
                chunk=chunk,
                expected=slot_size,
                got=size,
            )
        try:
            start = operator.index(offset)
        except TypeError as exc:
            raise PoolBoundsError(
                f"slot offset of chunk {chunk} must be an int, got {offset!r}.",
                chunk=chunk,
                offset=offset,
                size=size,
                pool_bytes=pool_bytes,
            ) from exc
        if start < 0 or start + size > pool_bytes:
            raise PoolBoundsError(
                f"chunk {chunk}: slot [{start}, {start + size}) is outside the pool of {pool_bytes} bytes; "
                "the pool view must cover the whole mapping and the offset must come from the server.",
                chunk=chunk,
                offset=start,
                size=size,
                pool_bytes=pool_bytes,
            )
        spans.append((start, size, chunk))
        used = chunk_ids[skip:]
        if used.numel():
            low, high = int(used.min()), int(used.max())
            if low < 0 or high >= layout.num_blocks:
                bad = low if low < 0 else high
                raise BlockIdError(
                    f"chunk {chunk}: block id {bad} is out of range [0, {layout.num_blocks}).",
                    chunk=chunk,
                    block_id=bad,
                    num_blocks=layout.num_blocks,
                )
    spans.sort()
    for (start_a, size_a, chunk_a), (start_b, _, chunk_b) in itertools.pairwise(spans):
        if start_b < start_a + size_a:
            raise PoolBoundsError(
                f"slots of chunks {chunk_a} and {chunk_b} overlap at offset {start_b}; every chunk needs its own slot.",
                chunk=chunk_b,
                offset=start_b,
                size=size_a,
                pool_bytes=pool_bytes,
            )
    if writes_kv:
        written = torch.cat([t[s:] for t, s in zip(ids, skips, strict=True)])
        unique = torch.unique(written)
        if unique.numel() != written.numel():
            values, counts = torch.unique(written, return_counts=True)
            bad = int(values[counts > 1][0])
            raise BlockIdError(
                f"block id {bad} would be written twice in one scatter; each engine block takes one chunk's bytes.",
                chunk=None,
                block_id=bad,
                num_blocks=layout.num_blocks,
            )
    return CopyPlan(offsets=tuple(operator.index(o) for o in slot_offsets), block_ids=tuple(ids), skips=tuple(skips))


def _skips(skip_blocks: int | Sequence[int], lengths: list[int]) -> list[int]:
    if isinstance(skip_blocks, bool):
        raise CopyArgumentError("skip_blocks must be an int or a list of ints, got a bool.", got=skip_blocks)
    if isinstance(skip_blocks, int):
        if skip_blocks < 0:
            raise CopyArgumentError(f"skip_blocks must be >= 0, got {skip_blocks}.", got=skip_blocks)
        skips, left = [], skip_blocks
        for n in lengths:
            skips.append(min(left, n))
            left -= skips[-1]
        return skips
    skips = list(skip_blocks)
    if len(skips) != len(lengths) or any(
        isinstance(s, bool) or not isinstance(s, int) or not 0 <= s <= n for s, n in zip(skips, lengths, strict=True)
    ):
        raise CopyArgumentError(
            f"skip_blocks per chunk must be {len(lengths)} ints, each between 0 and its chunk's block count; "
            f"got {skip_blocks!r}.",
            got=skip_blocks,
        )
    return skips


def slot_view(layout: KVLayout, pool: torch.Tensor, group_index: int, offset: int, blocks: int) -> torch.Tensor:
    """The part of a slot that holds one plane group, as [planes, blocks, segments, words]."""
    group = layout.groups[group_index]
    start = offset + layout.plane_offset_in_slot(group.first_plane, blocks)
    size = group.num_planes * blocks * group.plane_block_bytes
    width = width_of(group.max_width, pool.data_ptr() + start, pool.storage_offset() + start)
    words = pool[start : start + size].view(dtype_of_width(width))
    return words.view(group.num_planes, blocks, group.num_segments, group.seg_bytes // width)


def gather_cpu(layout: KVLayout, pool: torch.Tensor, plan: CopyPlan) -> None:
    """Copy the planned blocks of every layer into their slots (CPU tensors)."""
    for offset, ids, _, blocks in plan.chunks():
        for index, group in enumerate(layout.groups):
            dst = slot_view(layout, pool, index, offset, blocks)
            torch.index_select(group.view(_width(dst)), 1, ids, out=dst)


def scatter_cpu(layout: KVLayout, pool: torch.Tensor, plan: CopyPlan) -> None:
    """Copy slots back into the planned blocks, leaving skipped leading blocks alone (CPU tensors)."""
    for offset, ids, skip, blocks in plan.chunks():
        for index, group in enumerate(layout.groups):
            src = slot_view(layout, pool, index, offset, blocks)
            group.view(_width(src)).index_copy_(1, ids[skip:], src[:, skip:])


def _width(view: torch.Tensor) -> int:
    return int(view.element_size())
