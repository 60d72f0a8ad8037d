"""The plain-torch copy: the tests' oracle, and the only fallback.

One indexing expression per chunk and plane group, on any device torch has: gather is
`slot[:, :] = kv[:, ids]`, scatter `kv[:, ids] = slot[:, :]` over byte views of the
layer's blocks. Slow (it stages the indexed blocks in a temporary), obviously right, and
independent of the copy table that the fast paths read.
"""

from __future__ import annotations

import torch

from kvdepot.gpu._copy import CopyPlan
from kvdepot.gpu._layout import KVLayout


def reference_copy(layout: KVLayout, pool: torch.Tensor, plan: CopyPlan, *, to_slot: bool) -> None:
    """Run `plan` as a gather (`to_slot`) or a scatter, with torch indexing only."""
    for offset, ids, skip in plan.chunks():
        blocks = len(ids)
        for group in layout.groups:
            kv = group.view(1)  # [planes, num_blocks, segments, seg_bytes] bytes of the group's layers
            start = offset + layout.plane_offset_in_slot(group.first_plane, blocks)
            slot = pool[start : start + group.num_planes * blocks * group.plane_block_bytes]
            slot = slot.view(group.num_planes, blocks, group.num_segments, group.seg_bytes)[:, skip:]
            index = torch.tensor(ids[skip:], dtype=torch.int64, device=kv.device)
            if to_slot:
                slot.copy_(kv[:, index])
            else:
                kv[:, index] = slot.to(kv.device)
