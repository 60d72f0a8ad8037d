"""The real CUDA path: CudaCopier against the plain-torch reference. Skipped without a CUDA device."""

from __future__ import annotations

import concurrent.futures

import pytest
import torch

from kvdepot.gpu import CudaCopier, KVLayout, compute_event, open_copier
from kvdepot.gpu._triton import available as triton_available
from kvdepot.gpu.testing import LAYOUT_NAMES, Case, block_bytes, build_case, chunk_bytes, random_bytes, snapshot

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

METHODS = ["dma", "triton"] if triton_available() else ["dma"]


def _host_pool(nbytes: int) -> torch.Tensor:
    return torch.full((nbytes,), 0xA5, dtype=torch.uint8)


def _warm_up(copier: CudaCopier, case: Case) -> None:
    """Run once, before a test's timed part, what it times: a first Triton launch compiles, and CUDA
    loads a kernel lazily at its first use, which can synchronize the device and hide a missing wait."""
    copier.gather([[3, 4]], [0]).wait()
    copier.scatter([0], [[3, 4]]).wait()
    for t in case.kv.values():
        t[3:5].fill_(0.25)  # not a value any test expects: the blocks must be written again to pass
    torch.cuda._sleep(1)
    torch.cuda.synchronize()


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", LAYOUT_NAMES)
def test_cuda_gather_and_scatter_match_reference(name: str, method: str) -> None:
    """Gathered slots equal the reference; scattered blocks equal their slots; skipped and unnamed blocks stay."""
    case = build_case(name, torch.bfloat16, seed=31, device="cuda")
    layout = KVLayout.from_kv_caches(case.kv, case.block_size, backend_hint=case.hint)
    size = layout.chunk_bytes(3)
    pool = _host_pool(3 * size)
    with CudaCopier(layout, pool, method=method) as copier:
        assert copier.method == method
        chunks, offsets = [[9, 2, 4], [0, 11, 3]], [2 * size, 0]
        copier.gather(chunks, offsets, slot_size=size).wait()
        for blocks, offset in zip(chunks, offsets, strict=True):
            assert torch.equal(pool[offset : offset + size], chunk_bytes(case, blocks).cpu())
        pool[size : 2 * size] = random_bytes(size, seed=32)
        before = snapshot(case)
        handle = copier.scatter([size], [[5, 6, 7]], skip_blocks=1, slot_size=size)
        handle.wait_stream()
        handle.wait()
        assert handle.done()
    slot = pool[size : 2 * size].view(len(case.layers), 3, -1)
    for index, layer in enumerate(case.layers):
        assert torch.equal(block_bytes(case, layer, 5), before[(layer, 5)])
        assert torch.equal(block_bytes(case, layer, 6).cpu(), slot[index, 1])
        assert torch.equal(block_bytes(case, layer, 7).cpu(), slot[index, 2])
        for block in (0, 1, 2, 3, 4, 8, 9, 10, 11):
            assert torch.equal(block_bytes(case, layer, block), before[(layer, block)])


@pytest.mark.parametrize("method", METHODS)
def test_gather_is_ordered_after_the_compute_stream(method: str) -> None:
    """A gather queued right after a kernel that writes the blocks sees the written bytes."""
    case = build_case("shared_layer_major", torch.float16, device="cuda")
    layout = KVLayout.from_kv_caches(case.kv)
    pool = _host_pool(layout.chunk_bytes(2))
    with CudaCopier(layout, pool, method=method) as copier:
        _warm_up(copier, case)
        torch.cuda._sleep(50_000_000)  # keep the compute stream busy so an unordered copy would read early
        for t in case.kv.values():
            t[3:5].fill_(1.5)
        copier.gather([[3, 4]], [0]).wait()
    expected = torch.full((pool.numel() // 2,), 1.5, dtype=torch.float16)
    assert torch.equal(pool.view(torch.float16), expected)


@pytest.mark.parametrize("method", METHODS)
def test_a_gather_from_another_thread_waits_for_the_engines_own_stream(method: str) -> None:
    """An engine computes on a stream of its own, and the connector copies from another thread,
    whose current stream is another one: with an event the engine's thread recorded
    (`compute_event`) as `after`, the gather still sees what the engine's kernels wrote."""
    case = build_case("shared_layer_major", torch.float16, device="cuda")
    layout = KVLayout.from_kv_caches(case.kv)
    pool = _host_pool(layout.chunk_bytes(2))
    engine = torch.cuda.Stream()
    with CudaCopier(layout, pool, method=method) as copier, concurrent.futures.ThreadPoolExecutor(1) as other:
        _warm_up(copier, case)
        with torch.cuda.stream(engine):
            torch.cuda._sleep(50_000_000)  # keep the engine's stream busy so an unordered copy would read early
            for t in case.kv.values():
                t[3:5].fill_(1.5)
            after = compute_event(layout.device)
        other.submit(lambda: copier.gather([[3, 4]], [0], after=after).wait()).result()
    expected = torch.full((pool.numel() // 2,), 1.5, dtype=torch.float16)
    assert torch.equal(pool.view(torch.float16), expected)


@pytest.mark.parametrize("method", METHODS)
def test_a_gather_given_an_earlier_event_reads_the_blocks_before_they_are_written(method: str) -> None:
    """The control of the two tests above: the same gather, told to wait only for an event recorded
    before the compute stream's writes, reads the old bytes. So those tests fail if the copier
    ever stops waiting for the compute stream (their sleep is long enough to show it)."""
    case = build_case("shared_layer_major", torch.float16, device="cuda")
    layout = KVLayout.from_kv_caches(case.kv)
    pool = _host_pool(layout.chunk_bytes(2))
    with CudaCopier(layout, pool, method=method) as copier:
        _warm_up(copier, case)
        before = chunk_bytes(case, [3, 4]).cpu()
        pool.fill_(0xA5)  # so a gather that copied nothing cannot pass for one that read early
        too_early = compute_event(layout.device)
        torch.cuda._sleep(50_000_000)
        for t in case.kv.values():
            t[3:5].fill_(1.5)
        copier.gather([[3, 4]], [0], after=too_early).wait()
    assert torch.equal(pool, before)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("ordered", [True, False], ids=["wait_stream", "control"])
def test_the_compute_stream_reads_scattered_blocks_only_after_wait_stream(method: str, ordered: bool) -> None:
    """A forward pass queued after `handle.wait_stream()` reads what the scatter wrote, even while
    the side stream is still busy; without it (the control) it reads the blocks as they were."""
    case = build_case("shared_layer_major", torch.float16, device="cuda")
    layout = KVLayout.from_kv_caches(case.kv)
    size = layout.chunk_bytes(2)
    pool = _host_pool(size)
    with CudaCopier(layout, pool, method=method) as copier:
        _warm_up(copier, case)
        pool.view(torch.float16).fill_(2.5)
        copier.scatter([0], [[6, 7]]).wait()  # the blocks now hold 2.5
        torch.cat([t[6:8].flatten() for t in case.kv.values()])  # load the kernels the timed part uses
        for t in case.kv.values():
            t[6:8].fill_(0.5)
        with torch.cuda.stream(copier.stream):
            torch.cuda._sleep(50_000_000)  # the side stream is busy: the scatter below lands late
        handle = copier.scatter([0], [[6, 7]])
        if ordered:
            handle.wait_stream()
        seen = torch.cat([t[6:8].flatten() for t in case.kv.values()])  # the "forward pass" on the compute stream
        handle.wait()
    assert torch.all(seen == (2.5 if ordered else 0.5))


def test_completion_is_observable_without_blocking() -> None:
    """done() answers at once while the copy waits behind busy compute, and turns true after wait()."""
    case = build_case("cpu", torch.float16, device="cuda")
    layout = KVLayout.from_kv_caches(case.kv)
    pool = _host_pool(layout.chunk_bytes(1))
    with open_copier(layout, pool) as copier:
        copier.gather([[0]], [0]).wait()  # compile this shape first: a compile inside the sleep would outlast it
        torch.cuda._sleep(200_000_000)
        handle = copier.gather([[0]], [0])
        assert handle.done() is False
        handle.wait()
        assert handle.done() is True


def test_registration_is_undone_on_close_and_optional() -> None:
    """The pool is registered once and unregistered by close; without registration copies still work."""
    case = build_case("flash_attn", torch.float16, device="cuda")
    layout = KVLayout.from_kv_caches(case.kv, backend_hint="FLASH_ATTN")
    pool = _host_pool(layout.chunk_bytes(2))
    copier = CudaCopier(layout, pool)
    assert copier.registered
    copier.close()
    assert not copier.registered
    again = CudaCopier(layout, pool)  # registering twice would fail if close had not unregistered
    assert again.registered
    again.close()
    with CudaCopier(layout, pool, register=False) as plain:
        assert plain.method == "dma"
        plain.gather([[1, 2]], [0]).wait()
    assert torch.equal(pool, chunk_bytes(case, [1, 2]).cpu())
