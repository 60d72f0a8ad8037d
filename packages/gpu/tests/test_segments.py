"""Segment tables and the DMA path (one copy_ per contiguous run), checked on CPU tensors."""

from __future__ import annotations

import pytest
import torch

from kvdepot.gpu import KVLayout
from kvdepot.gpu._copier import dma_copy
from kvdepot.gpu._copy import plan_copy
from kvdepot.gpu._segments import segment_tables
from kvdepot.gpu.testing import LAYOUT_NAMES, block_bytes, build_case, chunk_bytes, random_bytes, snapshot


@pytest.mark.parametrize("name", LAYOUT_NAMES)
def test_dma_path_matches_reference(name: str) -> None:
    """Run-by-run copies gather the reference bytes and scatter into named, unskipped blocks only."""
    case = build_case(name, torch.float32, seed=21)
    layout = KVLayout.from_kv_caches(case.kv, case.block_size, backend_hint=case.hint)
    size = layout.chunk_bytes(4)
    pool = torch.zeros(2 * size, dtype=torch.uint8)
    chunks, offsets = [[1, 2, 3, 7], [8, 9, 10, 11]], [size, 0]
    dma_copy(layout, plan_copy(layout, pool, offsets, chunks, writes_kv=False), pool, to_pool=True)
    for blocks, offset in zip(chunks, offsets, strict=True):
        assert torch.equal(pool[offset : offset + size], chunk_bytes(case, blocks))
    source = random_bytes(size, seed=22)
    before = snapshot(case)
    dma_copy(
        layout, plan_copy(layout, source, [0], [[4, 5, 6, 0]], skip_blocks=2, writes_kv=True), source, to_pool=False
    )
    slot = source.view(len(case.layers), 4, -1)
    for index, layer in enumerate(case.layers):
        assert torch.equal(block_bytes(case, layer, 6), slot[index, 2])
        assert torch.equal(block_bytes(case, layer, 0), slot[index, 3])
        for block in (1, 2, 3, 4, 5, 7, 8, 9, 10, 11):
            assert torch.equal(block_bytes(case, layer, block), before[(layer, block)])


def test_segment_runs_merge_adjacent_blocks() -> None:
    """Consecutive blocks of a layer-major layout merge into one run per layer for the DMA path."""
    case = build_case("shared_layer_major", torch.float16)
    layout = KVLayout.from_kv_caches(case.kv)
    pool = torch.zeros(layout.chunk_bytes(4), dtype=torch.uint8)
    plan = plan_copy(layout, pool, [0], [[3, 4, 5, 9]], writes_kv=False)
    (table,) = segment_tables(layout, plan, pool.data_ptr())
    _, slot_starts, lengths = table.runs()
    assert lengths.tolist() == [3 * table.seg_words, table.seg_words] * 3
    assert slot_starts.tolist()[:2] == [0, 3 * table.seg_words]
