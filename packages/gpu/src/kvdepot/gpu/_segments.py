"""Descriptor tables for the CUDA path: one (KV offset, slot offset) pair per copied segment.

A segment is one block's bytes of one layer (or its K or its V half where they are
apart). Both the Triton kernel and the DMA path consume these tables; they are built
with tensor arithmetic, never a Python loop per segment, and tested on CPU.
"""

from __future__ import annotations

import attrs
import torch

from kvdepot.gpu._copy import CopyPlan
from kvdepot.gpu._layout import KVLayout, PlaneGroup, width_of


@attrs.frozen
class SegmentTable:
    """Segments of one plane group, in units of `width`-byte words.

    `kv_offsets[i]` is relative to the start of the group's storage and `slot_offsets[i]`
    to the start of the pool; every segment is `seg_words` words long.
    """

    group: PlaneGroup
    width: int
    seg_words: int
    kv_offsets: torch.Tensor  # int64, CPU
    slot_offsets: torch.Tensor  # int64, CPU

    @property
    def num_segments(self) -> int:
        return int(self.kv_offsets.numel())

    def runs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Merge segments adjacent on both sides: (kv start, slot start, words) per run."""
        n = self.num_segments
        if n == 0:
            empty = torch.empty(0, dtype=torch.int64)
            return empty, empty, empty
        follows = (self.kv_offsets[1:] - self.kv_offsets[:-1] == self.seg_words) & (
            self.slot_offsets[1:] - self.slot_offsets[:-1] == self.seg_words
        )
        starts = torch.cat([torch.ones(1, dtype=torch.bool), ~follows]).nonzero().flatten()
        ends = torch.cat([starts[1:], torch.tensor([n])])
        return self.kv_offsets[starts], self.slot_offsets[starts], (ends - starts) * self.seg_words


def segment_tables(layout: KVLayout, plan: CopyPlan, pool_address: int, *, max_width: int = 8) -> list[SegmentTable]:
    """The segments of every plane group for `plan`, the pool starting at `pool_address`.

    Words are at most `max_width` bytes (Triton has no 16-byte integer); the width is the
    widest that divides every offset and length of the group on both sides.
    """
    tables = []
    for group in layout.groups:
        width = width_of(group.max_width, max_width, pool_address)
        for _, offset, _, _, blocks in plan.chunks():
            width = width_of(width, offset + layout.plane_offset_in_slot(group.first_plane, blocks))
        tables.append(_group_table(layout, group, plan, width))
    return tables


def _group_table(layout: KVLayout, group: PlaneGroup, plan: CopyPlan, width: int) -> SegmentTable:
    planes = torch.arange(group.num_planes, dtype=torch.int64).view(-1, 1, 1)
    segments = torch.arange(group.num_segments, dtype=torch.int64).view(1, 1, -1)
    kv_parts, slot_parts = [], []
    for chunk, offset, _, skip, blocks in plan.chunks():
        used = plan.ids(chunk)[skip:].view(1, -1, 1)
        position = torch.arange(skip, blocks, dtype=torch.int64).view(1, -1, 1)
        kv = group.offset + planes * group.plane_stride + used * group.block_stride + segments * group.seg_stride
        slot_start = offset + layout.plane_offset_in_slot(group.first_plane, blocks)
        slot = slot_start + ((planes * blocks + position) * group.num_segments + segments) * group.seg_bytes
        kv_parts.append(kv.flatten())
        slot_parts.append(slot.flatten())
    empty = torch.empty(0, dtype=torch.int64)
    kv_all = torch.cat(kv_parts) if kv_parts else empty
    slot_all = torch.cat(slot_parts) if slot_parts else empty
    return SegmentTable(
        group=group,
        width=width,
        seg_words=group.seg_bytes // width,
        kv_offsets=kv_all // width,
        slot_offsets=slot_all // width,
    )
