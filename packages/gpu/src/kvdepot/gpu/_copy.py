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


@attrs.define
class CopyPlan:
    """A validated gather or scatter: per chunk, its slot offset, block ids and skipped blocks."""

    offsets: tuple[int, ...]
    block_lists: tuple[list[int], ...]  # every block of each chunk, in slot order
    skips: tuple[int, ...]  # leading blocks of each chunk that are not copied
    _tensors: dict[int, torch.Tensor] = attrs.field(factory=dict, repr=False)

    def ids(self, chunk: int) -> torch.Tensor:
        """The block ids of `chunk` as an int64 CPU tensor (built on first use)."""
        tensor = self._tensors.get(chunk)
        if tensor is None:
            tensor = self._tensors[chunk] = torch.tensor(self.block_lists[chunk], dtype=torch.int64)
        return tensor

    def runs(self, chunk: int, limit: int) -> list[tuple[int, int, int]] | None:
        """(slot position, first block id, length) of each run of consecutive ids copied in `chunk`.

        None as soon as there are more than `limit` runs (fragmented chunks stop early).
        """
        ids, skip = self.block_lists[chunk], self.skips[chunk]
        runs: list[tuple[int, int, int]] = []
        position, first, length = skip, -2, 0
        for block in ids[skip:] if skip else ids:
            if block == first + length:
                length += 1
                continue
            if length:
                if len(runs) >= limit:
                    return None
                runs.append((position, first, length))
                position += length
            first, length = block, 1
        if length:
            if len(runs) >= limit:
                return None
            runs.append((position, first, length))
        return runs

    def chunks(self) -> Any:
        """(chunk index, offset, id list, skip, blocks in chunk) for each chunk with something to copy."""
        for chunk, (offset, ids, skip) in enumerate(zip(self.offsets, self.block_lists, self.skips, strict=True)):
            if skip < len(ids):
                yield chunk, offset, ids, skip, len(ids)


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


def _bad_ids(chunk: int, ids: Any) -> BlockIdError:
    return BlockIdError(
        f"chunk {chunk}: block ids must be a list of ints or a 1-D integer tensor, got {ids!r}.",
        chunk=chunk,
        block_id=None,
        num_blocks=None,
    )


def _as_ids(chunk: int, ids: Any) -> list[int]:
    """Block ids as a list of Python ints (bools, floats and strings are refused)."""
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise _bad_ids(chunk, ids)
        return list(ids.tolist())
    values = ids if isinstance(ids, list) else list(ids)
    if set(map(type, values)) <= {int}:  # the common case, checked in C
        return values
    try:
        if any(isinstance(v, bool) for v in values):
            raise TypeError("bool")
        return [operator.index(v) for v in values]  # numpy integers and other int-likes
    except TypeError as exc:
        raise _bad_ids(chunk, ids) from exc


def plan_copy(
    layout: KVLayout,
    pool: torch.Tensor,
    slot_offsets: Sequence[int],
    block_ids_per_chunk: Sequence[BlockIds],
    *,
    skip_blocks: int | Sequence[int] = 0,
    slot_size: int | None = None,
    writes_kv: bool,
    check: bool = True,
) -> CopyPlan:
    """Check every argument of a gather (`writes_kv=False`) or scatter and normalise it.

    `skip_blocks` is either one count of leading blocks over the chunks taken in order
    (one request's consecutive chunks) or one count per chunk. Skipped blocks are never
    read or written, and their ids are not checked. `check=False` skips the pool checks
    (for copiers, which check their pool once).
    """
    if check:
        check_pool(pool)
    if len(slot_offsets) != len(block_ids_per_chunk):
        raise CopyArgumentError(
            f"{len(slot_offsets)} slot offsets for {len(block_ids_per_chunk)} chunks; pass one slot per chunk.",
            expected=len(block_ids_per_chunk),
            got=len(slot_offsets),
        )
    ids = [_as_ids(i, chunk) for i, chunk in enumerate(block_ids_per_chunk)]
    skips = _skips(skip_blocks, [len(t) for t in ids])
    pool_bytes = pool.numel()
    spans = []
    for chunk, (offset, chunk_ids, skip) in enumerate(zip(slot_offsets, ids, skips, strict=True)):
        if not chunk_ids:
            raise SlotSizeError(
                f"chunk {chunk} has no blocks; drop it from the call.", chunk=chunk, expected=None, got=0
            )
        size = len(chunk_ids) * layout.bytes_per_block
        if slot_size is not None and size != slot_size:
            raise SlotSizeError(
                f"chunk {chunk} holds {len(chunk_ids)} blocks = {size} bytes but slots are {slot_size} bytes; "
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
        used = chunk_ids[skip:] if skip else chunk_ids
        if used:
            low, high = min(used), max(used)
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
        written = [b for t, s in zip(ids, skips, strict=True) for b in t[s:]] if len(ids) > 1 else ids[0][skips[0] :]
        if len(set(written)) != len(written):
            seen: set[int] = set()
            bad = next(b for b in written if b in seen or seen.add(b))  # type: ignore[func-returns-value]
            raise BlockIdError(
                f"block id {bad} would be written twice in one scatter; each engine block takes one chunk's bytes.",
                chunk=None,
                block_id=bad,
                num_blocks=layout.num_blocks,
            )
    return CopyPlan(
        offsets=tuple(operator.index(o) for o in slot_offsets),
        block_lists=tuple(ids),
        skips=tuple(skips),
    )


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


def slot_view(
    layout: KVLayout,
    pool: torch.Tensor,
    group_index: int,
    offset: int,
    blocks: int,
    *,
    width: int | None = None,
    max_width: int = 16,
) -> torch.Tensor:
    """The part of a slot that holds one plane group, as [planes, blocks, segments, words].

    Words are `width` bytes, or the widest up to `max_width` that the group and the slot's
    address allow.
    """
    group = layout.groups[group_index]
    start = offset + layout.plane_offset_in_slot(group.first_plane, blocks)
    size = group.num_planes * blocks * group.plane_block_bytes
    if width is None:
        width = width_of(group.max_width, max_width, pool.data_ptr() + start, pool.storage_offset() + start)
    words = pool[start : start + size].view(dtype_of_width(width))
    return words.view(group.num_planes, blocks, group.num_segments, group.seg_bytes // width)


# A chunk whose blocks form at most this many runs of consecutive ids is copied with one
# strided `copy_` per run (memcpy speed, ~5 us of dispatch each; scatters, and gathers
# that cannot use rows); more fragmented chunks use one index op per plane group, paid in
# C. Runs of at least RUN_COPY_MIN_BYTES are always worth a `copy_` of their own.
RUN_COPY_MAX_RUNS = 4
RUN_COPY_MIN_BYTES = 1 << 20

# Word size for gathers over contiguous rows: torch's `index_select` copies whole rows of
# a contiguous source with memcpy for these widths (measured: complex128 words miss it).
GATHER_ROW_MAX_WIDTH = 8


def _run_limit(copied_blocks: int, group_bytes_per_block: int) -> int:
    """The most runs for which one copy_ per run beats an index op, for one plane group."""
    return max(RUN_COPY_MAX_RUNS, copied_blocks * group_bytes_per_block // RUN_COPY_MIN_BYTES)


def gather_cpu(layout: KVLayout, pool: torch.Tensor, plan: CopyPlan) -> None:
    """Copy the planned blocks of every layer into their slots (CPU tensors).

    Where segments are rows of a contiguous matrix, one `index_select` over rows (torch
    copies each row with memcpy, on every thread; measured at or above a plain memcpy of
    the same bytes); else one strided `copy_` per run of consecutive blocks, or one
    `index_select` over a strided view for fragmented chunks.
    """
    for chunk, offset, _, _, blocks in plan.chunks():
        runs: list[tuple[int, int, int]] | None = None
        for index, group in enumerate(layout.groups):
            if group.rows_addressable:
                dst = slot_view(layout, pool, index, offset, blocks, max_width=GATHER_ROW_MAX_WIDTH)
                width = _width(dst)
                rows = dst.view(-1, group.seg_bytes // width)
                torch.index_select(group.rows(width), 0, group.row_index(plan.ids(chunk)), out=rows)
                continue
            limit = _run_limit(blocks, group.num_planes * group.plane_block_bytes)
            runs = plan.runs(chunk, limit)
            if runs is not None:
                dst = slot_view(layout, pool, index, offset, blocks, width=1)
                src = group.view(1)
                for position, first, length in runs:
                    dst[:, position : position + length].copy_(src[:, first : first + length])
            else:
                dst = slot_view(layout, pool, index, offset, blocks)
                torch.index_select(group.view(_width(dst)), 1, plan.ids(chunk), out=dst)


def scatter_cpu(layout: KVLayout, pool: torch.Tensor, plan: CopyPlan) -> None:
    """Copy slots back into the planned blocks, leaving skipped leading blocks alone (CPU tensors).

    A few runs of consecutive blocks: one strided `copy_` per run. Fragmented chunks,
    where segments are rows of a contiguous matrix: one `numpy.put` of whole rows (numpy
    moves each `seg_bytes` item with memcpy, where torch's `index_copy_` copies word by
    word); else one `index_copy_` over a strided view.
    """
    for chunk, offset, _, skip, blocks in plan.chunks():
        for index, group in enumerate(layout.groups):
            if group.rows_addressable:
                runs = plan.runs(chunk, RUN_COPY_MAX_RUNS)  # a few long runs: copy_ is multi-threaded
            else:
                runs = plan.runs(chunk, _run_limit(blocks - skip, group.num_planes * group.plane_block_bytes))
            if runs is not None:
                src = slot_view(layout, pool, index, offset, blocks, width=1)
                dst = group.view(1)
                for position, first, length in runs:
                    dst[:, first : first + length].copy_(src[:, position : position + length])
            elif group.rows_addressable:
                src = slot_view(layout, pool, index, offset, blocks, width=1)
                items = _as_items(src, group.seg_bytes)
                rows = group.row_index(plan.ids(chunk)[skip:]).numpy()
                if skip:  # the kept blocks of each plane are contiguous in the slot, not across planes
                    per_plane = rows.size // group.num_planes
                    for plane in range(group.num_planes):
                        part = rows[plane * per_plane : (plane + 1) * per_plane]
                        numpy_put(group.row_items(), part, items[plane, skip * group.num_segments :])
                else:
                    numpy_put(group.row_items(), rows, items.reshape(-1))
            else:
                src = slot_view(layout, pool, index, offset, blocks)
                group.view(_width(src)).index_copy_(1, plan.ids(chunk)[skip:], src[:, skip:])


def _as_items(view: torch.Tensor, seg_bytes: int) -> Any:
    """A [planes, blocks, segments, seg_bytes] uint8 slot view as [planes, blocks * segments] numpy items."""
    import numpy as np

    planes = view.shape[0]
    return view.numpy().view(np.dtype((np.void, seg_bytes))).reshape(planes, -1)


def numpy_put(target: Any, rows: Any, items: Any) -> None:
    """target[rows] = items for 1-D item arrays: a memcpy per item in numpy's C loop."""
    import numpy as np

    np.put(target, rows, items, mode="clip")  # ids were range-checked by plan_copy


def _width(view: torch.Tensor) -> int:
    return int(view.element_size())
