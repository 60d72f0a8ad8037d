"""What a copy moves: one copy table per layout and chunk geometry, read by every copy path.

A chunk of `blocks` blocks fills its slot layer by layer, then block by block (see
`KVLayout`). The table has one row per layer and segment (a segment is a block's bytes of
one layer, or its K or V half where they lie apart):

    (kv, kv_step, slot, slot_step, length)

Block `ids[j]` of the row is the `length` bytes at address `kv + ids[j] * kv_step`, and
its place in the slot starts `slot + j * slot_step` bytes past the slot's first byte. The
CPU path hands the table to the native copy as is; the CUDA path expands it into one
(KV offset, slot offset) pair per copied segment for the Triton kernel or the DMA copies.
"""

from __future__ import annotations

import attrs
import numpy as np
import torch

from kvdepot.gpu._layout import KVLayout, PlaneGroup, width_of

KV, KV_STEP, SLOT, SLOT_STEP, LENGTH = range(5)


@attrs.frozen(eq=False)
class Part:
    """The table rows of one plane group: one storage, one segment length."""

    group: PlaneGroup
    start: int  # first table row
    stop: int  # one past the last
    width: int  # the widest word (at most 8 bytes) dividing every offset, step and length on both sides


@attrs.frozen(eq=False)
class CopyTable:
    """The copy table of a layout for chunks of `blocks` blocks."""

    blocks: int
    chunk_bytes: int
    rows: np.ndarray  # int64 [rows, 5], C-contiguous; `kv` is an address in the KV cache's memory
    parts: tuple[Part, ...]

    def segments(self, part: Part, ids: list[int], skip: int, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(KV offsets from the part's storage start, pool offsets) in bytes of every segment of
        `part` that a chunk with block `ids` in the slot at pool `offset` copies, skipping `skip`."""
        rows = torch.tensor(self.rows[part.start : part.stop])
        kept = torch.tensor(ids[skip:], dtype=torch.int64)
        positions = torch.arange(skip, len(ids), dtype=torch.int64)
        storage = part.group.source.untyped_storage().data_ptr()
        kv = rows[:, KV, None] - storage + kept[None, :] * rows[:, KV_STEP, None]
        slot = offset + rows[:, SLOT, None] + positions[None, :] * rows[:, SLOT_STEP, None]
        return kv.flatten(), slot.flatten()


class CopyTables:
    """The copy tables of one layout, each built on first use of its chunk size."""

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self._tables: dict[int, CopyTable] = {}

    def __call__(self, blocks: int) -> CopyTable:
        table = self._tables.get(blocks)
        if table is None:
            table = self._tables[blocks] = copy_table(self.layout, blocks)
        return table


def copy_table(layout: KVLayout, blocks: int) -> CopyTable:
    """The table of `layout` for chunks of `blocks` blocks (copiers build it once per chunk size)."""
    rows: list[tuple[int, int, int, int, int]] = []
    parts = []
    for group in layout.groups:
        start = len(rows)
        storage = group.source.untyped_storage().data_ptr()
        for plane in range(group.num_planes):
            slot = layout.plane_offset_in_slot(group.first_plane + plane, blocks)
            for segment in range(group.num_segments):
                kv = storage + group.offset + plane * group.plane_stride + segment * group.seg_stride
                rows.append((kv, group.block_stride, slot + segment * group.seg_bytes, group.plane_block_bytes,
                             group.seg_bytes))  # fmt: skip
        slots = [value for row in rows[start:] for value in row[SLOT:]]
        parts.append(Part(group, start, len(rows), width_of(group.max_width, 8, *slots)))
    table = np.ascontiguousarray(np.array(rows, dtype=np.int64).reshape(-1, 5))
    table.flags.writeable = False
    return CopyTable(blocks, layout.chunk_bytes(blocks), table, tuple(parts))


def merge_runs(kv: torch.Tensor, slot: torch.Tensor, length: int) -> list[tuple[int, int, int]]:
    """(KV start, slot start, length) of each run of segments that follow each other on both sides."""
    if kv.numel() == 0:
        return []
    follows = (kv[1:] - kv[:-1] == length) & (slot[1:] - slot[:-1] == length)
    starts = torch.cat([torch.ones(1, dtype=torch.bool), ~follows]).nonzero().flatten()
    ends = torch.cat([starts[1:], torch.tensor([kv.numel()])])
    return list(zip(kv[starts].tolist(), slot[starts].tolist(), ((ends - starts) * length).tolist(), strict=True))
