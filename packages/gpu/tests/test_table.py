"""The copy table, the paths that read it (native copy, DMA) against the plain-torch reference, on CPU."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdepot.gpu import CpuCopier, KVLayout, ReferenceCopier
from kvdepot.gpu._copy import plan_copy
from kvdepot.gpu._cuda import dma_copy, plane_group_segments
from kvdepot.gpu._table import KV, KV_STEP, LENGTH, SLOT, SLOT_STEP, CopyTables, copy_table, merge_runs
from kvdepot.gpu.testing import LAYOUT_NAMES, block_bytes, build_case, chunk_bytes, random_bytes, snapshot


def layout_of(name: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> tuple[KVLayout, object]:
    case = build_case(name, dtype, seed=seed)
    return KVLayout.from_kv_caches(case.kv, case.block_size, backend_hint=case.hint), case


@pytest.mark.parametrize("name", LAYOUT_NAMES)
def test_table_rows_tile_each_slot_exactly_once(name: str) -> None:
    """Every byte of a slot belongs to exactly one (row, block position), and each row reads inside its layer."""
    layout, case = layout_of(name)
    blocks = 3
    table = copy_table(layout, blocks)
    covered = torch.zeros(table.chunk_bytes, dtype=torch.int32)
    for row in table.rows.tolist():
        assert row[LENGTH] > 0
        for j in range(blocks):
            start = row[SLOT] + j * row[SLOT_STEP]
            covered[start : start + row[LENGTH]] += 1
    assert bool((covered == 1).all())
    spans = [(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in case.kv.values()]
    for row in table.rows.tolist():
        last = row[KV] + (layout.num_blocks - 1) * row[KV_STEP] + row[LENGTH]
        assert any(base <= row[KV] and last <= base + size for base, size in spans)
    assert not table.rows.flags.writeable


def test_tables_are_built_once_per_chunk_size() -> None:
    """A copier's tables are cached per number of blocks in a chunk."""
    layout, _ = layout_of("cpu")
    tables = CopyTables(layout)
    assert tables(4) is tables(4)
    assert tables(4) is not tables(2)
    assert tables(2).chunk_bytes == layout.chunk_bytes(2)


@pytest.mark.parametrize("name", LAYOUT_NAMES)
def test_dma_path_matches_reference(name: str) -> None:
    """Run-by-run copies gather the reference bytes and scatter into named, unskipped blocks only."""
    layout, case = layout_of(name, seed=21)
    tables = CopyTables(layout)
    size = layout.chunk_bytes(4)
    pool = torch.zeros(2 * size, dtype=torch.uint8)
    chunks, offsets = [[1, 2, 3, 7], [8, 9, 10, 11]], [size, 0]
    dma_copy(layout, plan_copy(layout, pool, offsets, chunks, writes_kv=False), pool, tables, to_pool=True)
    for blocks, offset in zip(chunks, offsets, strict=True):
        assert torch.equal(pool[offset : offset + size], chunk_bytes(case, blocks))
    source = random_bytes(size, seed=22)
    before = snapshot(case)
    plan = plan_copy(layout, source, [0], [[4, 5, 6, 0]], skip_blocks=2, writes_kv=True)
    dma_copy(layout, plan, source, tables, to_pool=False)
    slot = source.view(len(case.layers), 4, -1)
    for index, layer in enumerate(case.layers):
        assert torch.equal(block_bytes(case, layer, 6), slot[index, 2])
        assert torch.equal(block_bytes(case, layer, 0), slot[index, 3])
        for block in (1, 2, 3, 4, 5, 7, 8, 9, 10, 11):
            assert torch.equal(block_bytes(case, layer, block), before[(layer, block)])


def test_segment_runs_merge_adjacent_blocks() -> None:
    """Consecutive blocks of a layer-major layout merge into one run per layer for the DMA path."""
    layout, _ = layout_of("shared_layer_major", dtype=torch.float16)
    pool = torch.zeros(layout.chunk_bytes(4), dtype=torch.uint8)
    plan = plan_copy(layout, pool, [0], [[3, 4, 5, 9]], writes_kv=False)
    ((_, _, seg_bytes, kv, slot),) = plane_group_segments(layout, plan, CopyTables(layout), pool.data_ptr())
    runs = merge_runs(kv, slot, seg_bytes)
    assert [n for _, _, n in runs] == [3 * seg_bytes, seg_bytes] * 3
    assert [s for _, s, _ in runs][:2] == [0, 3 * seg_bytes]


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(LAYOUT_NAMES),
    blocks=st.integers(1, 4),
    data=st.data(),
)
def test_native_copy_agrees_with_the_reference(name: str, blocks: int, data: st.DataObject) -> None:
    """For any layout, chunks, ids, skips and slot order, the native copy leaves the pool and the KV cache
    exactly as the plain-torch reference does."""
    chunks = data.draw(st.integers(1, 3))
    ids = data.draw(st.permutations(range(12)))
    id_lists = [ids[c * blocks : (c + 1) * blocks] for c in range(chunks)]
    skips = data.draw(st.lists(st.integers(0, blocks), min_size=chunks, max_size=chunks))
    order = data.draw(st.permutations(range(chunks)))
    results = []
    for copier_type in (CpuCopier, ReferenceCopier):
        layout, case = layout_of(name, seed=5)
        size = layout.chunk_bytes(blocks)
        pool = random_bytes(chunks * size + 8, seed=6)
        offsets = [8 + order[c] * size for c in range(chunks)]
        with copier_type(layout, pool) as copier:
            copier.scatter(offsets, id_lists, skip_blocks=skips)
            copier.gather(id_lists[::-1], offsets[::-1])
        results.append((pool, snapshot(case)))
    (pool_a, kv_a), (pool_b, kv_b) = results
    assert torch.equal(pool_a, pool_b)
    assert all(torch.equal(kv_a[key], kv_b[key]) for key in kv_a)
