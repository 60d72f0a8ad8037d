"""CPU gather and scatter against the plain-torch reference, on every layout, and their typed errors."""

from __future__ import annotations

import mmap
import os
import tempfile

import pytest
import torch

import kvdepot.gpu
from kvdepot.core import KVDepotError
from kvdepot.gpu import (
    BlockIdError,
    CopierClosedError,
    CopyArgumentError,
    CpuCopier,
    CudaCopier,
    KVLayout,
    NativeCopyError,
    PoolBoundsError,
    PoolDtypeError,
    ReferenceCopier,
    SlotSizeError,
    _copier,
    gather,
    scatter,
)
from kvdepot.gpu.testing import DTYPES, Case, block_bytes, build_case, chunk_bytes, random_bytes, snapshot

FILL = 0xA5  # pool bytes outside every slot must keep this value


@pytest.fixture(autouse=True, params=["native", "native-1", "reference"])
def method(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run every copy test through the CPU copier's native copy (on torch's threads, and on one) and
    through the plain-torch reference copier, which every test checks against the independent
    per-tensor reference of kvdepot.gpu.testing."""
    if request.param == "native-1":
        monkeypatch.setattr(_copier, "native_threads", lambda: 1)
    if request.param == "reference":  # what gather, scatter and open_copier below open
        real = _copier.open_copier
        monkeypatch.setattr(_copier, "open_copier", lambda *a, **kw: real(*a, **{**kw, "method": "reference"}))
    return str(request.param)


def open_copier(layout: KVLayout, pool: torch.Tensor) -> CpuCopier | ReferenceCopier:
    """The copier of the test's method."""
    copier = _copier.open_copier(layout, pool)
    assert isinstance(copier, (CpuCopier, ReferenceCopier))
    return copier


def layout_of(case: Case) -> KVLayout:
    return KVLayout.from_kv_caches(case.kv, case.block_size, backend_hint=case.hint)


def filled_pool(nbytes: int) -> torch.Tensor:
    return torch.full((nbytes,), FILL, dtype=torch.uint8)


def test_gather_matches_reference(case: Case) -> None:
    """Gathered slot bytes equal the reference, and pool bytes outside the slots are untouched."""
    layout = layout_of(case)
    size = layout.chunk_bytes(4)
    pool = filled_pool(6 * size + 64)
    chunks = [[7, 0, 3, 11], [2, 2, 9, 5], [4, 5, 1, 2]]  # out of order, a repeated block, runs of two
    offsets = [3 * size + 64, 16, 5 * size]  # slots out of order, gaps between them
    before = snapshot(case)
    gather(layout, chunks, pool, offsets, slot_size=size)
    for blocks, offset in zip(chunks, offsets, strict=True):
        assert torch.equal(pool[offset : offset + size], chunk_bytes(case, blocks))
    outside = torch.ones(pool.numel(), dtype=torch.bool)
    for offset in offsets:
        outside[offset : offset + size] = False
    assert bool((pool[outside] == FILL).all())
    assert all(torch.equal(block_bytes(case, *key), value) for key, value in before.items())


def test_scatter_writes_named_blocks_and_nothing_else(case: Case) -> None:
    """Scattered blocks equal their slot's bytes; skipped leading blocks and blocks not named are untouched."""
    layout = layout_of(case)
    size = layout.chunk_bytes(3)
    pool = random_bytes(3 * size, seed=99)
    chunks = [[4, 5, 1], [6, 7, 10]]
    offsets = [2 * size, 0]
    before = snapshot(case)
    pool_before = pool.clone()
    scatter(layout, pool, offsets, chunks, skip_blocks=1, slot_size=size)
    assert torch.equal(pool, pool_before)
    written = {}
    for blocks, offset in zip(chunks, offsets, strict=True):
        slot = pool[offset : offset + size].view(len(case.layers), 3, -1)
        for position, block in enumerate(blocks):
            for index, layer in enumerate(case.layers):
                written[(layer, block)] = (position, slot[index, position])
    for key, old in before.items():
        now = block_bytes(case, *key)
        if key in written and key[1] != 4:  # block 4 leads the request: skipped
            assert torch.equal(now, written[key][1]), key
        else:
            assert torch.equal(now, old), key


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ["cpu", "flash_attn", "shared_block_major", "mla", "kernel_blocks_flash"])
def test_round_trip_reproduces_bytes_exactly(name: str, dtype: torch.dtype) -> None:
    """Gather from some blocks then scatter into others reproduces the original bytes bit for bit."""
    case = build_case(name, dtype, seed=7)
    layout = layout_of(case)
    size = layout.chunk_bytes(4)
    pool = filled_pool(2 * size)
    source = [[0, 1, 2, 3], [8, 5, 6, 7]]
    target = [[11, 10, 9, 4], [3, 2, 1, 0]]
    before = snapshot(case)
    with open_copier(layout, pool) as copier:
        assert copier.gather(source, [0, size], slot_size=size).done()
        assert copier.scatter([size, 0], target[::-1], slot_size=size).done()
    for layer in case.layers:
        for src_chunk, dst_chunk in zip(source, target, strict=True):
            for src, dst in zip(src_chunk, dst_chunk, strict=True):
                assert torch.equal(block_bytes(case, layer, dst), before[(layer, src)])


def test_nan_and_infinity_bit_patterns_survive_the_widest_words() -> None:
    """Signalling NaNs, payload NaNs and infinities move unchanged through the 16-byte word path."""
    case = build_case("shared_layer_major", torch.float32)
    layout = layout_of(case)
    assert layout.groups[0].max_width == 16
    patterns = torch.tensor([0x7FF0000000000001, 0x7FF8DEADBEEF0001, -0x10000000000001, 0x7FF0000000000000],
                            dtype=torch.int64)  # fmt: skip
    for t in case.kv.values():
        flat = t.view(torch.int64).view(-1)
        flat.copy_(patterns.repeat(flat.numel() // 4))
    before = snapshot(case)
    size = layout.chunk_bytes(2)
    pool = filled_pool(size)
    gather(layout, [[1, 2]], pool, [0])
    scatter(layout, pool, [0], [[5, 6]])
    for layer in case.layers:
        assert torch.equal(block_bytes(case, layer, 5), before[(layer, 1)])
        assert torch.equal(block_bytes(case, layer, 6), before[(layer, 2)])


def test_skip_counts_leading_blocks_across_chunks(make_case) -> None:
    """An int skip_blocks covers the first chunks in order; a list gives one count per chunk."""
    case = make_case("cpu", torch.float16)
    layout = layout_of(case)
    size = layout.chunk_bytes(2)
    pool = random_bytes(2 * size, seed=3)
    before = snapshot(case)
    scatter(layout, pool, [0, size], [[0, 1], [2, 3]], skip_blocks=3)
    layer = case.layers[0]
    assert all(torch.equal(block_bytes(case, layer, b), before[(layer, b)]) for b in (0, 1, 2))
    assert not torch.equal(block_bytes(case, layer, 3), before[(layer, 3)])
    case = make_case("cpu", torch.float16)
    layout = layout_of(case)
    before = snapshot(case)
    scatter(layout, pool, [0, size], [[0, 1], [2, 3]], skip_blocks=[2, 1])
    assert all(torch.equal(block_bytes(case, layer, b), before[(layer, b)]) for b in (0, 1, 2))
    assert torch.equal(block_bytes(case, layer, 3), pool[size : 2 * size].view(3, 2, -1)[0, 1])


def test_block_ids_may_be_integer_tensors(make_case) -> None:
    """Block ids given as an int32 tensor copy the same bytes as a list."""
    case = make_case("flash_attn", torch.float16)
    layout = layout_of(case)
    size = layout.chunk_bytes(3)
    pool = filled_pool(size)
    gather(layout, [torch.tensor([5, 1, 8], dtype=torch.int32)], pool, [0])
    assert torch.equal(pool, chunk_bytes(case, [5, 1, 8]))


@pytest.mark.integration
def test_round_trip_through_a_shared_memory_mapping(make_case) -> None:
    """A pool viewed from a real owner-only shared-memory mapping works the same as a tensor."""
    case = make_case("shared_block_major", torch.bfloat16)
    layout = layout_of(case)
    size = layout.chunk_bytes(4)
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.NamedTemporaryFile(dir=folder, prefix="kvdepot-gpu-test-") as f:
        os.chmod(f.name, 0o600)
        f.truncate(2 * size + 4096)
        with mmap.mmap(f.fileno(), 2 * size + 4096) as mapping:
            pool = torch.frombuffer(mapping, dtype=torch.uint8)
            before = snapshot(case)
            gather(layout, [[1, 2, 3, 4]], pool, [4096], slot_size=size)
            assert bytes(mapping[4096 : 4096 + size]) == chunk_bytes(case, [1, 2, 3, 4]).numpy().tobytes()
            scatter(layout, pool, [4096], [[8, 9, 10, 11]], slot_size=size)
            del pool
    for layer in case.layers:
        for src, dst in zip((1, 2, 3, 4), (8, 9, 10, 11), strict=True):
            assert torch.equal(block_bytes(case, layer, dst), before[(layer, src)])


BAD_CALLS = {
    "slot size": (SlotSizeError, {"slot_size": 1}),
    "id too large": (BlockIdError, {"chunks": [[0, 1], [2, 12]]}),
    "negative id": (BlockIdError, {"chunks": [[0, 1], [-1, 2]]}),
    "float ids": (BlockIdError, {"chunks": [[0, 1], [2.0, 3.0]]}),
    "float tensor ids": (BlockIdError, {"chunks": [[0, 1], torch.tensor([2.0, 3.0])]}),
    "pool dtype": (PoolDtypeError, {"pool": "float32"}),
    "pool not a tensor": (PoolDtypeError, {"pool": "bytes"}),
    "pool 2-D": (PoolDtypeError, {"pool": "2d"}),
    "pool too small": (PoolBoundsError, {"offsets": [0, 10**9]}),
    "negative offset": (PoolBoundsError, {"offsets": [-1, 4096]}),
    "overlapping slots": (PoolBoundsError, {"offsets": [0, 16]}),
    "offsets count": (CopyArgumentError, {"offsets": [0]}),
    "empty chunk": (SlotSizeError, {"chunks": [[0, 1], []]}),
}


@pytest.mark.parametrize("direction", ["gather", "scatter"])
@pytest.mark.parametrize("bad", sorted(BAD_CALLS))
def test_bad_arguments_raise_before_any_byte_moves(make_case, direction: str, bad: str) -> None:
    """Each bad argument raises its typed error, and neither the pool nor the KV cache changed."""
    case = make_case("cpu", torch.float16)
    layout = layout_of(case)
    size = layout.chunk_bytes(2)
    pool = random_bytes(4 * size, seed=5)
    error, changes = BAD_CALLS[bad]
    chunks = changes.get("chunks", [[0, 1], [2, 3]])
    offsets = changes.get("offsets", [0, 2 * size])
    slot_size = changes.get("slot_size", size)
    pool_arg = {"float32": pool.view(torch.float32), "bytes": b"x", "2d": pool.view(4, -1)}.get(
        changes.get("pool", ""), pool
    )
    pool_before, kv_before = pool.clone(), snapshot(case)
    if direction == "gather":
        call = lambda: gather(layout, chunks, pool_arg, offsets, slot_size=slot_size)  # noqa: E731
    else:
        call = lambda: scatter(layout, pool_arg, offsets, chunks, slot_size=slot_size)  # noqa: E731
    with pytest.raises(error) as info:
        call()
    assert isinstance(info.value, KVDepotError)
    assert torch.equal(pool, pool_before)
    assert all(torch.equal(block_bytes(case, *key), value) for key, value in kv_before.items())


def test_scatter_refuses_a_block_written_twice(make_case) -> None:
    """Two chunks naming the same destination block is an error (a gather may read a block twice)."""
    case = make_case("cpu", torch.float16)
    layout = layout_of(case)
    size = layout.chunk_bytes(2)
    pool = random_bytes(2 * size, seed=1)
    with pytest.raises(BlockIdError, match="written twice") as info:
        scatter(layout, pool, [0, size], [[0, 1], [1, 2]])
    assert info.value.block_id == 1
    scatter(layout, pool, [0, size], [[0, 1], [1, 2]], skip_blocks=[0, 1])  # the repeat is skipped: fine


def test_skipped_ids_are_not_checked(make_case) -> None:
    """Ids of skipped blocks are never touched, so they are not range-checked either."""
    case = make_case("cpu", torch.float16)
    layout = layout_of(case)
    pool = random_bytes(layout.chunk_bytes(2), seed=1)
    scatter(layout, pool, [0], [[-1, 3]], skip_blocks=1)
    with pytest.raises(BlockIdError):
        scatter(layout, pool, [0], [[-1, 3]])


@pytest.mark.parametrize("skip", [-1, True, [1], [3, 0], "2"])
def test_bad_skip_is_refused(make_case, skip) -> None:
    """skip_blocks must be a non-negative int, or one count per chunk no larger than the chunk."""
    case = make_case("cpu", torch.float16)
    layout = layout_of(case)
    size = layout.chunk_bytes(2)
    pool = random_bytes(2 * size, seed=1)
    with pytest.raises(CopyArgumentError):
        scatter(layout, pool, [0, size], [[0, 1], [2, 3]], skip_blocks=skip)


def test_closed_copier_refuses_work(make_case) -> None:
    """A copier used after close raises CopierClosedError."""
    case = make_case("cpu", torch.float16)
    layout = layout_of(case)
    pool = filled_pool(layout.chunk_bytes(1))
    copier = open_copier(layout, pool)
    copier.close()
    with pytest.raises(CopierClosedError):
        copier.gather([[0]], [0])


def test_cuda_copier_refuses_a_cpu_cache(make_case) -> None:
    """CudaCopier on a CPU layout is a typed error, raised before CUDA is touched; open_copier picks CpuCopier."""
    case = make_case("cpu", torch.float16)
    layout = layout_of(case)
    pool = filled_pool(layout.chunk_bytes(1))
    with pytest.raises(CopyArgumentError, match="CUDA KV cache"):
        CudaCopier(layout, pool)
    assert isinstance(kvdepot.gpu.open_copier(layout, pool), CpuCopier)
    assert isinstance(kvdepot.gpu.open_copier(layout, pool, method="reference"), ReferenceCopier)


def test_layers_apart_with_gaps_between_them() -> None:
    """Layers in several storages, with gaps between them and blocks of 8 bytes or 4 KiB, copy exactly."""
    shape = (12, 2, 16, 64)  # [blocks, heads, tokens, 2 * head] fp16: 4 KiB blocks per layer
    layer_bytes = 12 * 4096
    whole = random_bytes(7 * layer_bytes, seed=5)  # one buffer, gaps between the layers
    kv = {
        f"layers.{i}": whole[at * layer_bytes :][:layer_bytes].view(torch.float16).view(shape)
        for i, at in enumerate([0, 3, 5, 6])
    }
    tiny = {f"layers.{i}": random_bytes(12 * 8, seed=i).view(torch.float16).view(12, 1, 1, 4) for i in range(3)}
    for caches in (kv, tiny):
        layout = KVLayout.from_kv_caches(caches, backend_hint="CPU_ATTN")
        assert len(layout.groups) > 1
        size = layout.chunk_bytes(3)
        pool = filled_pool(2 * size)
        expected = torch.cat([t[[9, 2, 3]].reshape(-1).view(torch.uint8) for t in caches.values()])
        with open_copier(layout, pool) as copier:
            copier.gather([[9, 2, 3]], [size]).wait()
            assert torch.equal(pool[size:], expected)
            copier.scatter([size], [[0, 1, 11]]).wait()
        for t in caches.values():
            assert torch.equal(t[[0, 1, 11]].view(torch.int16), t[[9, 2, 3]].view(torch.int16))


def test_chunks_in_adjacent_slots(case: Case) -> None:
    """Chunks whose slots follow each other land where
    the reference says; a chunk with skipped blocks among them keeps its leading blocks."""
    layout = layout_of(case)
    size = layout.chunk_bytes(2)
    pool = filled_pool(5 * size)
    gather(layout, [[1, 2], [3, 4], [5, 0]], pool, [size, 2 * size, 3 * size], slot_size=size)
    for blocks, offset in zip([[1, 2], [3, 4], [5, 0]], [size, 2 * size, 3 * size], strict=True):
        assert torch.equal(pool[offset : offset + size], chunk_bytes(case, blocks))
    assert bool((pool[:size] == FILL).all())
    assert bool((pool[4 * size :] == FILL).all())
    before = snapshot(case)
    targets = [[6, 7], [8, 9], [10, 11]]
    scatter(layout, pool, [0, size, 2 * size], targets, skip_blocks=[0, 0, 1], slot_size=size)
    sources = {6: None, 7: None, 8: 1, 9: 2, 11: 4}  # 10 is skipped; slot 0 holds FILL bytes
    for layer in case.layers:
        assert torch.equal(block_bytes(case, layer, 10), before[(layer, 10)])
        for target, source in sources.items():
            if source is None:
                assert bool((block_bytes(case, layer, target) == FILL).all())
            else:
                assert torch.equal(block_bytes(case, layer, target), before[(layer, source)]), (layer, target)
    assert all(torch.equal(block_bytes(case, *key), before[key]) for key in before if key[1] < 6)


def test_layers_of_different_sizes() -> None:
    """Layers whose blocks differ in size (table rows of different lengths) gather and scatter exactly."""
    shapes = [(12, 2, 16, 64), (12, 4, 16, 64), (12, 2, 16, 64)]  # fp16: 4, 8 and 4 KiB per block
    sizes = [12 * 2 * 16 * 64 * 2, 12 * 4 * 16 * 64 * 2, 12 * 2 * 16 * 64 * 2]
    whole = random_bytes(sum(sizes) + 4096, seed=11)
    kv, at = {}, 0
    for i, (shape, size) in enumerate(zip(shapes, sizes, strict=True)):
        kv[f"layers.{i}"] = whole[at : at + size].view(torch.float16).view(shape)
        at += size + (4096 if i == 0 else 0)  # a gap after the first layer
    layout = KVLayout.from_kv_caches(kv, backend_hint="CPU_ATTN")
    size = layout.chunk_bytes(3)
    pool = filled_pool(2 * size)

    def expected(blocks: list[int]) -> torch.Tensor:
        return torch.cat([t[blocks].reshape(-1).view(torch.uint8) for t in kv.values()])

    before = expected([9, 2, 3]).clone()
    with open_copier(layout, pool) as copier:
        copier.gather([[9, 2, 3], [4, 5, 6]], [0, size]).wait()
        assert torch.equal(pool[:size], before)
        assert torch.equal(pool[size:], expected([4, 5, 6]))
        copier.scatter([0], [[0, 1, 11]], skip_blocks=1).wait()
    assert torch.equal(expected([1, 11]), expected([2, 3]))
    assert not torch.equal(expected([0]), expected([9]))


def test_describe_names_the_copy_path(method: str) -> None:
    """A copier says how it copies, for the connector's log: the native copy and its threads, or the reference."""
    layout = KVLayout.from_kv_caches({"l": torch.zeros((8, 4, 16, 64), dtype=torch.float16)}, backend_hint="CPU_ATTN")
    with open_copier(layout, filled_pool(1 << 16)) as copier:
        text = copier.describe()
    if method == "reference":
        assert text == "cpu: plain-torch reference copy (slow)"
    else:
        assert text == f"cpu: native block copy by copy table, {_copier.native_threads()} threads"


def test_a_missing_native_copy_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the native copy a CPU copier refuses to open and says how to get it; the reference still opens."""
    monkeypatch.setattr(_copier, "_rowcopy", None)
    monkeypatch.setattr(_copier, "_NATIVE_IMPORT_ERROR", "No module named 'kvdepot.gpu._rowcopy'", raising=False)
    layout = KVLayout.from_kv_caches({"l": torch.zeros((8, 4, 16, 64), dtype=torch.float16)}, backend_hint="CPU_ATTN")
    with pytest.raises(NativeCopyError, match="C compiler") as info:
        kvdepot.gpu.open_copier(layout, filled_pool(1 << 16))
    assert isinstance(info.value, KVDepotError)
    assert "_rowcopy" in info.value.cause
    assert isinstance(kvdepot.gpu.open_copier(layout, filled_pool(1 << 16), method="reference"), ReferenceCopier)


def test_a_copy_of_no_chunks_does_nothing() -> None:
    """A gather or scatter of no chunks is a no-op (an empty scatter raised a bare IndexError)."""
    kv = torch.randn(4, 2, 4, 8)
    before = kv.clone()
    copier = open_copier(KVLayout.from_kv_caches({"l0": kv}), torch.zeros(1024, dtype=torch.uint8))
    copier.gather([], []).wait()
    copier.scatter([], []).wait()
    assert torch.equal(kv, before)
