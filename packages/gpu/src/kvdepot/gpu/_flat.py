"""Every layer's blocks as rows of one matrix: one copy call per chunk on CPU, whatever the layout.

The per-group CPU path pays one tensor op (a few microseconds of dispatch each) per plane
group and chunk: 32 ops for a model whose layers are separate tensors. When every
segment of every layer starts a whole number of `row_bytes` past one base address, all
the KV storages are rows of a single matrix laid over the address range they span. A
gather or scatter is then one native row copy per chunk (`_rowcopy.c`: row numbers
computed in C from the block ids and a pattern built once, prefetched reads, streaming
writes, on torch's threads). Without it, a gather is one `index_select` and a scatter one
`numpy.put` (a memcpy per row each), over row numbers from one numpy expression.

The matrix covers the gaps between the storages too; only rows inside the layout's
blocks are ever named, and `plan_copy` has range-checked every block id before a copy.
The layout's tensors, which the copier holds, keep the memory alive.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import math
import os
from typing import Any

import attrs
import numpy as np
import structlog
import torch

from kvdepot.gpu._copy import CopyPlan
from kvdepot.gpu._layout import KVLayout, PlaneGroup, _extent, dtype_of_width, width_of

try:
    from kvdepot.gpu import _rowcopy
except ModuleNotFoundError:  # installed without a C compiler: torch and numpy move the rows
    _rowcopy = None  # type: ignore[assignment]
except ImportError as exc:  # built, but it does not load here (a missing symbol, say)
    structlog.get_logger(__name__).warning("kvdepot.gpu native copy unavailable, copying with torch", error=str(exc))
    _rowcopy = None  # type: ignore[assignment]

# Rows shorter than this make the per-row copy too short to run at memcpy speed; such
# layouts keep the per-group path.
FLAT_MIN_ROW_BYTES = 512
# A scatter whose rows form at most FLAT_RUNS_MAX runs of consecutive rows, or runs of
# FLAT_RUN_MIN_BYTES on average, is one memmove per run (a Python call, ~1 us, each).
FLAT_RUNS_MAX = 16
FLAT_RUN_MIN_BYTES = 256 << 10
# Blocks move through the native row copy (`_rowcopy.c`: row numbers computed in C,
# prefetched reads, streaming writes on scatter, torch's OpenMP threads) when it was
# built, otherwise through torch.index_select and numpy.put or memmove.
FLAT_NATIVE = _rowcopy is not None


@functools.cache
def _shares_torch_openmp() -> bool:
    """Whether the row copy's OpenMP loops run on torch's own OpenMP runtime (and so its thread team).

    They do when the runtime the extension resolved lies in torch's package: torch loaded
    its libgomp.so.1 first and the loader reused it. A runtime from elsewhere (a system
    libgomp beside a torch that bundles a renamed one, an Intel OpenMP preloaded for the
    engine) would bring a second team competing with torch's for the cores.
    """
    ours = _rowcopy.openmp_library() if _rowcopy is not None and _rowcopy.OPENMP else None
    if ours is None or "ATen parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return False
    torch_dir = os.path.dirname(os.path.realpath(torch.__file__))
    return os.path.realpath(ours).startswith((torch_dir + os.sep, torch_dir + ".libs" + os.sep))


# libgomp's thread team does not survive fork(): in a child of a process that ran a
# threaded copy, a parallel region waits forever for threads that are gone (torch's own
# parallel ops in such a child hang the same way). Copies in such a child use one thread.
_forked_after_threads = False
_ran_threads = False


def _after_fork_in_child() -> None:
    global _forked_after_threads  # noqa: PLW0603 - process-wide state, set by the fork hook
    _forked_after_threads = _forked_after_threads or _ran_threads


os.register_at_fork(after_in_child=_after_fork_in_child)


def native_threads() -> int:
    """Threads for one native row copy: torch's intra-op threads when they can be shared, else 1."""
    if _forked_after_threads or not _shares_torch_openmp():
        return 1
    return int(torch.get_num_threads())


@attrs.frozen
class Band:
    """Consecutive planes whose blocks have the same number of rows.

    Row `pattern[p, r] + block_id * block_rows[p, 0]` holds row `r` of `block_id` in plane
    `p` of the band.
    """

    pattern: np.ndarray  # int64 [planes, rows per block]
    block_rows: np.ndarray  # int64 [planes, 1]

    @property
    def num_planes(self) -> int:
        return int(self.pattern.shape[0])

    @property
    def rows_per_block(self) -> int:
        return int(self.pattern.shape[1])

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """[chunks, planes, blocks, rows per block] row numbers of `ids` ([chunks, blocks]), in slot order."""
        rows: np.ndarray = self.pattern[None, :, None, :] + ids[:, None, :, None] * self.block_rows[None, :, :, None]
        return rows


@attrs.define(eq=False)
class FlatRows:
    """The KV storages of a layout as one [rows, row_bytes] matrix of host memory."""

    row_bytes: int
    base: int  # address of row 0
    num_rows: int
    bands: tuple[Band, ...]
    _buffer: Any = attrs.field(repr=False)  # a ctypes array over the range; owns nothing
    _layout: KVLayout = attrs.field(repr=False)  # keeps the tensors, and so the memory, alive
    _words: dict[int, torch.Tensor] = attrs.field(factory=dict, repr=False)
    _items: Any = attrs.field(default=None, repr=False)

    @property
    def rows_per_block(self) -> int:
        """Rows of one block over all layers."""
        return sum(band.num_planes * band.rows_per_block for band in self.bands)

    def words(self, width: int) -> torch.Tensor:
        """The matrix as [rows, row_bytes / width] elements of `width` bytes."""
        cached = self._words.get(width)
        if cached is None:
            flat = torch.frombuffer(self._buffer, dtype=torch.uint8)
            cached = self._words[width] = flat.view(dtype_of_width(width)).view(self.num_rows, -1)
        return cached

    def items(self) -> Any:
        """The matrix as a 1-D numpy array of `row_bytes`-byte items."""
        if self._items is None:
            self._items = np.frombuffer(self._buffer, dtype=np.dtype((np.void, self.row_bytes)))
        return self._items

    def index(self, id_lists: list[list[int]]) -> np.ndarray:
        """Row numbers of chunks laid one after another, each in slot order (plane, block, row)."""
        if len(id_lists) > 1 and len({len(ids) for ids in id_lists}) > 1:
            return np.concatenate([self.index([ids]) for ids in id_lists])
        ids = np.asarray(id_lists, dtype=np.int64)  # [chunks, blocks]
        if len(self.bands) == 1:
            rows: np.ndarray = self.bands[0].rows(ids).reshape(-1)
        else:
            rows = np.concatenate([band.rows(ids).reshape(len(ids), -1) for band in self.bands], axis=1).reshape(-1)
        return rows


def flat_rows(layout: KVLayout, *, min_row_bytes: int | None = None) -> FlatRows | None:
    """The layout as one row matrix; None where rows would be under `min_row_bytes`, or off the CPU."""
    if layout.device.type != "cpu" or not layout.groups:
        return None
    extents = [_extent(g) for g in layout.groups]  # (storage address, first byte, one past the last)
    starts = [ptr + first for ptr, first, _ in extents]
    base = min(starts)
    row = 0
    for group, start in zip(layout.groups, starts, strict=True):
        row = math.gcd(row, start - base, group.seg_bytes, group.block_stride if group.num_blocks > 1 else 0)
        row = math.gcd(row, group.plane_stride if group.num_planes > 1 else 0)
        row = math.gcd(row, group.seg_stride if group.num_segments > 1 else 0)
    if row < (FLAT_MIN_ROW_BYTES if min_row_bytes is None else min_row_bytes):
        return None
    end = max(ptr + last for ptr, _, last in extents)
    num_rows = (end - base) // row
    bands: list[Band] = []
    patterns: list[np.ndarray] = []
    strides: list[np.ndarray] = []
    for group, start in zip(layout.groups, starts, strict=True):
        pattern, block_rows = _group_pattern(group, (start - base) // row, row)
        if patterns and pattern.shape[1] != patterns[-1].shape[1]:
            bands.append(Band(np.concatenate(patterns), np.concatenate(strides)))
            patterns, strides = [], []
        patterns.append(pattern)
        strides.append(block_rows)
    bands.append(Band(np.concatenate(patterns), np.concatenate(strides)))
    buffer = (ctypes.c_uint8 * (num_rows * row)).from_address(base)
    return FlatRows(row, base, num_rows, tuple(bands), buffer, layout)


def _group_pattern(group: PlaneGroup, first_row: int, row: int) -> tuple[np.ndarray, np.ndarray]:
    """([planes, rows per block] rows of block 0, [planes, 1] rows between blocks) of one group."""
    planes = np.arange(group.num_planes, dtype=np.int64)[:, None, None] * (group.plane_stride // row)
    segments = np.arange(group.num_segments, dtype=np.int64)[None, :, None] * (group.seg_stride // row)
    sub_rows = np.arange(group.seg_bytes // row, dtype=np.int64)[None, None, :]
    pattern = (first_row + planes + segments + sub_rows).reshape(group.num_planes, -1)
    block_rows = np.full((group.num_planes, 1), group.block_stride // row, dtype=np.int64)
    return pattern, block_rows


def _adjacent(plan: CopyPlan, chunk_bytes: int, skipped: bool) -> list[tuple[int, list[list[int]], int]]:
    """The plan's chunks as (offset, id lists, skip) runs whose slots follow each other in the pool.

    With `skipped`, a chunk with leading blocks skipped stands alone, with its skip (its rows
    are not one contiguous part of its slot); chunks skipped entirely are left out.
    """
    out: list[tuple[int, list[list[int]], int]] = []
    end: int | None = None
    for offset, ids, skip in zip(plan.offsets, plan.block_lists, plan.skips, strict=True):
        if skipped and skip >= len(ids):
            continue
        alone = skipped and skip > 0
        if not alone and out and offset == end:
            out[-1][1].append(ids)
        else:
            out.append((offset, [ids], skip if alone else 0))
        end = None if alone else offset + len(ids) * chunk_bytes
    return out


def copy_flat_native(flat: FlatRows, pool_address: int, pool_bytes: int, plan: CopyPlan, *, to_slot: bool) -> None:
    """Gather (`to_slot`) or scatter the plan's chunks through the native row copy: one call per chunk
    and band, which computes the rows from the block ids, prefetches a gather's rows ahead, writes a
    scatter with streaming stores and shares the rows among torch's threads."""
    global _ran_threads  # noqa: PLW0603 - process-wide state read by the fork hook
    row, base, num_rows = flat.row_bytes, flat.base, flat.num_rows
    threads = native_threads()
    _ran_threads = _ran_threads or threads > 1
    for offset, ids, skip in zip(plan.offsets, plan.block_lists, plan.skips, strict=True):
        kept = ids[skip:] if skip else ids
        if not kept:
            continue
        at = offset  # byte offset of the band's part of the slot
        for band in flat.bands:
            per_plane = len(ids) * band.rows_per_block
            first = at + skip * band.rows_per_block * row  # skipped blocks lead every plane
            _rowcopy.copy_blocks(
                base, num_rows, pool_address + first, (pool_bytes - first) // row, kept, band.pattern,
                band.block_rows, per_plane, row, to_slot, not to_slot, threads,
            )  # fmt: skip
            at += band.num_planes * per_plane * row


def gather_flat(flat: FlatRows, pool: torch.Tensor, plan: CopyPlan) -> None:
    """Copy every layer's rows of each chunk's blocks into its slot: one native row copy per chunk,
    or without it one `index_select` per chunk or run of chunks whose slots follow each other (a
    memcpy per row, on every torch thread)."""
    address = pool.data_ptr()
    if FLAT_NATIVE:
        copy_flat_native(flat, address, pool.numel(), plan, to_slot=True)
        return
    row = flat.row_bytes
    block_bytes = flat.rows_per_block * row
    for offset, id_lists, _ in _adjacent(plan, block_bytes, skipped=False):
        index = flat.index(id_lists)
        width = width_of(row, 8, flat.base, address + offset)
        dst = pool[offset : offset + index.size * row].view(dtype_of_width(width)).view(index.size, row // width)
        torch.index_select(flat.words(width), 0, torch.from_numpy(index), out=dst)


def scatter_flat(flat: FlatRows, pool_bytes: np.ndarray, plan: CopyPlan) -> None:
    """Copy each slot's rows into its chunk's blocks past the first `skip` (`pool_bytes`: the pool as numpy).

    One native row copy per chunk, with streaming stores (no read of each destination line
    first). Without it, chunks whose slots follow each other go together; rows that
    continue each other on both sides are merged into runs; a chunk of a few long runs is
    one `memmove` per run, any other chunk one `numpy.put` of all its rows (a memcpy per
    row; torch's index_copy_ copies word by word). With leading blocks skipped, each
    plane's kept rows are contiguous in the slot but the planes are not: one `numpy.put`
    per plane.
    """
    pool_address = pool_bytes.ctypes.data
    if FLAT_NATIVE:
        copy_flat_native(flat, pool_address, pool_bytes.size, plan, to_slot=False)
        return
    row = flat.row_bytes
    block_bytes = flat.rows_per_block * row
    target = flat.items()
    item = np.dtype((np.void, row))
    for offset, id_lists, skip in _adjacent(plan, block_bytes, skipped=True):
        ids = id_lists[0]
        if not skip:
            rows = flat.index(id_lists)
            if not _copy_runs(flat, rows, pool_address + offset):
                source = pool_bytes[offset : offset + rows.size * row].view(item)
                np.put(target, rows, source, mode="clip")  # ids were range-checked by plan_copy
            continue
        blocks = len(ids)
        source = pool_bytes[offset : offset + blocks * block_bytes].view(item)
        kept = np.asarray([ids[skip:]], dtype=np.int64)
        at = 0
        for band in flat.bands:
            per_plane = blocks * band.rows_per_block
            plane_rows = band.rows(kept).reshape(band.num_planes, -1)
            for plane in range(band.num_planes):
                start = at + plane * per_plane + skip * band.rows_per_block
                np.put(target, plane_rows[plane], source[start : at + (plane + 1) * per_plane], mode="clip")
            at += band.num_planes * per_plane


def _copy_runs(flat: FlatRows, rows: np.ndarray, slot_address: int) -> bool:
    """Slot rows into KV rows `rows` as one memmove per run of consecutive rows; False if too fragmented."""
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    runs = len(breaks) + 1
    if runs > FLAT_RUNS_MAX and rows.size * flat.row_bytes // runs < FLAT_RUN_MIN_BYTES:
        return False
    row, base = flat.row_bytes, flat.base
    bounds = [0, *breaks.tolist(), rows.size]
    for start, end in itertools.pairwise(bounds):
        ctypes.memmove(base + int(rows[start]) * row, slot_address + start * row, (end - start) * row)
    return True
