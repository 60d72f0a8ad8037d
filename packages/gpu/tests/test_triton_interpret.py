"""The Triton segment kernel, run on CPU by Triton's interpreter, against the plain-torch reference."""

from __future__ import annotations

import pytest
import torch

from kvdepot.gpu import KVLayout
from kvdepot.gpu._copy import plan_copy
from kvdepot.gpu._cuda import KernelTables, pool_words, triton_copy
from kvdepot.gpu._table import CopyTables
from kvdepot.gpu.testing import LAYOUT_NAMES, block_bytes, build_case, chunk_bytes, random_bytes, snapshot

pytest.importorskip("triton")

FILL = 0x5A

pytestmark = pytest.mark.usefixtures("triton_interpreter")


@pytest.mark.parametrize("name", LAYOUT_NAMES)
def test_kernel_gather_and_scatter_match_reference(name: str) -> None:
    """The kernel writes the reference bytes into slots, and back into named blocks only, skipping leaders."""
    case = build_case(name, torch.float16, seed=11)
    layout = KVLayout.from_kv_caches(case.kv, case.block_size, backend_hint=case.hint)
    tables = KernelTables(layout, CopyTables(layout))
    size = layout.chunk_bytes(3)
    pool = torch.full((3 * size,), FILL, dtype=torch.uint8)
    chunks, offsets = [[9, 2, 4], [0, 11, 3]], [2 * size, 0]
    plan = plan_copy(layout, pool, offsets, chunks, writes_kv=False)
    triton_copy(plan, pool.data_ptr(), lambda width: pool_words(pool, width), tables, to_pool=True)
    for blocks, offset in zip(chunks, offsets, strict=True):
        assert torch.equal(pool[offset : offset + size], chunk_bytes(case, blocks))
    assert bool((pool[size : 2 * size] == FILL).all())

    source = random_bytes(3 * size, seed=12)
    before = snapshot(case)
    targets = [[5, 6, 7], [8, 1, 10]]
    plan = plan_copy(layout, source, offsets, targets, skip_blocks=[1, 0], writes_kv=True)
    triton_copy(plan, source.data_ptr(), lambda width: pool_words(source, width), tables, to_pool=False)
    for blocks, offset, skip in zip(targets, offsets, (1, 0), strict=True):
        slot = source[offset : offset + size].view(len(case.layers), 3, -1)
        for position, block in enumerate(blocks):
            for index, layer in enumerate(case.layers):
                expected = before[(layer, block)] if position < skip else slot[index, position]
                assert torch.equal(block_bytes(case, layer, block), expected), (layer, block)
    untouched = {0, 2, 3, 4, 9, 11, 5}
    for layer in case.layers:
        for block in untouched:
            assert torch.equal(block_bytes(case, layer, block), before[(layer, block)])


@pytest.mark.parametrize("programs", [1, 3, 0])
@pytest.mark.parametrize("name", LAYOUT_NAMES)
def test_one_call_with_chunks_of_two_sizes_and_skips_matches_reference(name: str, programs: int) -> None:
    """A step's last chunk can be shorter: the kernel runs once per chunk size, each with its own table,
    and fills the same slot bytes as the reference copier; a scatter with skips writes only the rest.
    However many programs share the tiles (0: one per tile), each tile is copied."""
    from kvdepot.gpu import open_copier

    case = build_case(name, torch.float16, seed=13)
    layout = KVLayout.from_kv_caches(case.kv, case.block_size, backend_hint=case.hint)
    tables = KernelTables(layout, CopyTables(layout))
    long, short = layout.chunk_bytes(3), layout.chunk_bytes(2)
    chunks, offsets = [[9, 2, 4], [5, 1], [0, 11, 3]], [0, long, long + short]
    pool = torch.full((2 * long + short,), FILL, dtype=torch.uint8)
    reference = pool.clone()
    with open_copier(layout, reference, method="reference") as copier:
        for ids, offset in zip(chunks, offsets, strict=True):
            copier.gather([ids], [offset], slot_size=layout.chunk_bytes(len(ids))).wait()
    plan = plan_copy(layout, pool, offsets, chunks, writes_kv=False)
    triton_copy(plan, pool.data_ptr(), lambda width: pool_words(pool, width), tables, to_pool=True, programs=programs)
    assert torch.equal(pool, reference)

    before = snapshot(case)
    targets = [[6, 7, 8], [10, 0], [2, 3, 11]]
    plan = plan_copy(layout, pool, offsets, targets, skip_blocks=[0, 1, 2], writes_kv=True)
    triton_copy(plan, pool.data_ptr(), lambda width: pool_words(pool, width), tables, to_pool=False, programs=programs)
    for ids, skip, source in zip(targets, (0, 1, 2), chunks, strict=True):
        for position, (block, origin) in enumerate(zip(ids, source, strict=True)):
            for layer in case.layers:
                expected = before[(layer, block)] if position < skip else before[(layer, origin)]
                assert torch.equal(block_bytes(case, layer, block), expected), (layer, block, position)
