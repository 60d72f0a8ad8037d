"""The per-layer tensors real vLLM registers with a connector are recognised and copied exactly."""

from __future__ import annotations

import pytest
import torch

from kvdepot.gpu import KVLayout, gather, scatter

pytestmark = pytest.mark.vllm

LAYERS, BLOCKS = 3, 10


def _views(layout_name: str, spec_kind: str) -> dict[str, torch.Tensor]:
    interface = pytest.importorskip("vllm.v1.kv_cache_interface")
    layouts = pytest.importorskip("vllm.v1.kv_cache_layout")
    if spec_kind == "mla":
        spec = interface.MLAAttentionSpec(block_size=32, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    else:
        spec = interface.FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    layout = getattr(layouts.KVCacheLayout, layout_name)
    page = spec.page_size_bytes
    layer_stride, block_stride = (BLOCKS * page, page) if layout.is_layer_compact else (page, LAYERS * page)
    tensor = interface.KVCacheTensor(
        size=LAYERS * BLOCKS * page,
        layers=[f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)],
        layer_stride=layer_stride,
        block_stride=block_stride,
    )
    raw = torch.randint(-128, 128, (LAYERS * BLOCKS * page,), dtype=torch.int8)
    views = interface.create_kv_cache_views(raw, spec, BLOCKS, layout, tensor)
    return dict(zip(tensor.layers, views, strict=True))


@pytest.mark.parametrize(("layout_name", "spec_kind"), [("LBHNC", "full"), ("LBNHC", "full"), ("BLHNC", "full"),
                                                        ("LBHNC", "mla")])  # fmt: skip
def test_vllm_views_round_trip(layout_name: str, spec_kind: str) -> None:
    """vLLM's layer views form one plane group, and a gather then scatter moves each block's memory bytes exactly."""
    kv = _views(layout_name, spec_kind)
    layout = KVLayout.from_kv_caches(kv, 32, backend_hint="FLASHMLA" if spec_kind == "mla" else "CPU_ATTN")
    assert (layout.num_blocks, layout.block_size, layout.num_layers, len(layout.groups)) == (BLOCKS, 32, LAYERS, 1)

    def block(name: str, b: int) -> bytes:
        x = kv[name][b]
        perm = sorted(range(x.dim()), key=lambda d: -x.stride(d))
        return x.permute(perm).contiguous().view(torch.uint8).numpy().tobytes()

    before = {(n, b): block(n, b) for n in kv for b in range(BLOCKS)}
    pool = torch.zeros(layout.chunk_bytes(2), dtype=torch.uint8)
    gather(layout, [[7, 2]], pool, [0])
    assert pool.numpy().tobytes() == b"".join(before[(n, b)] for n in kv for b in (7, 2))
    scatter(layout, pool, [0], [[0, 9]])
    for n in kv:
        assert block(n, 0) == before[(n, 7)]
        assert block(n, 9) == before[(n, 2)]
        assert all(block(n, b) == before[(n, b)] for b in range(1, 9))


# -- every layout vLLM 0.33's CUDA backends allocate ---------------------------------------------
#
# vLLM 0.33 gives every attention backend the same logical per-layer view, [blocks, heads, tokens,
# content] with K and V packed in the content (2 * head_size; MLA: one latent of 576), over one
# allocation whose physical order is a `KVCacheLayout` (`vllm/v1/kv_cache_layout.py`). Backends
# name the layouts their kernels take (`AttentionBackend.supported_kv_cache_layouts`: FlashInfer's
# trtllm kernels take head-major interiors, HND; its others and FlashAttention, Triton and the MLA
# backends take any), and `create_kv_cache_views` builds the views from `KVCacheTensor` offsets
# and strides, kernel blocks split out of engine blocks where the backend asks for smaller ones.
# Each case here is built by those functions, at an interior offset of a larger allocation (two
# groups overlaid, or another tensor first), and copied by every path that runs on a CPU.
# With no backend's declaration vLLM picks LBNHC; the two layouts with heads outside the block
# (LHBNC, BHLNC: a block is one range per head) come only from ROCm backends or an explicit
# VLLM_KV_CACHE_LAYOUT, and kvdepot refuses them at start rather than copy them.

BACKENDS = {
    # name: (spec kind, backend hint, layouts its kernels take in 0.33)
    "FLASH_ATTN": ("full", "FLASH_ATTN", None),
    "TRITON_ATTN": ("full", "TRITON_ATTN", None),
    "FLASHINFER_HND": ("full", "FLASHINFER", ("LBHNC", "BLHNC")),
    "FLASHINFER_NHD": ("full", "FLASHINFER", ("LBNHC", "BLNHC")),
    "FLASHMLA": ("mla", "FLASHMLA", None),
}
ALL_LAYOUTS = ("LBNHC", "LBHNC", "BLNHC", "BLHNC")  # the block-dense ones, in vLLM's default preference
HEADS_OUTSIDE_THE_BLOCK = ("LHBNC", "BHLNC")
CASES = [(backend, layout) for backend, (_kind, _hint, takes) in BACKENDS.items() for layout in (takes or ALL_LAYOUTS)]
ENGINE_BLOCK = 32
PADDING = 4096 + 128  # the tensor's first byte lies this far into the allocation


def _spec(kind: str, block_size: int, heads: int = 4, head_size: int = 64) -> object:
    interface = pytest.importorskip("vllm.v1.kv_cache_interface")
    if kind == "mla":
        return interface.MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    return interface.FullAttentionSpec(
        block_size=block_size, num_kv_heads=heads, head_size=head_size, dtype=torch.bfloat16
    )


def _vllm_033_views(kind: str, layout_name: str, *, kernel_block: int | None = None, **spec: int) -> dict:
    """The layer views vLLM 0.33 registers with a connector for this layout, at an interior offset."""
    interface = pytest.importorskip("vllm.v1.kv_cache_interface")
    layouts = pytest.importorskip("vllm.v1.kv_cache_layout")
    engine_spec = _spec(kind, ENGINE_BLOCK, **spec)
    layout = getattr(layouts.KVCacheLayout, layout_name)
    # The strides vLLM's KV-cache planning gives the tensor (`kv_cache_planning.py`).
    layer_stride, block_stride, *_ = interface.compute_layout_strides(engine_spec, BLOCKS, LAYERS, layout)
    tensor = interface.KVCacheTensor(
        size=PADDING + LAYERS * BLOCKS * engine_spec.page_size_bytes,
        layers=[f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)],
        layer_stride=layer_stride,
        block_stride=block_stride,
        offset=PADDING,
    )
    raw = torch.randint(-128, 128, (tensor.size,), dtype=torch.int8, generator=torch.Generator().manual_seed(5))
    views = interface.create_kv_cache_views(raw, engine_spec, BLOCKS, layout, tensor, kernel_block)
    return dict(zip(tensor.layers, views, strict=True))


def _bits(x: torch.Tensor) -> torch.Tensor:
    """A block's values as integers of the same width: bf16 NaN patterns compare as what they are."""
    return x.view(torch.int16) if x.element_size() == 2 else x.view(torch.uint8)


def _round_trip_every_path(kv: dict, engine_block: int, hint: str) -> None:
    """Gather two chunks, then scatter them into other blocks, by the reference (plain torch indexing)
    and by the native copy: both fill the slots alike, and the scattered blocks hold exactly the
    gathered ones, bit for bit, read through vLLM's own views; no other block changes."""
    from kvdepot.gpu import open_copier

    layout = KVLayout.from_kv_caches(kv, engine_block, backend_hint=hint)
    assert (layout.num_blocks, layout.block_size, layout.num_layers) == (BLOCKS, engine_block, LAYERS)
    per_block = next(iter(kv.values())).shape[0] // BLOCKS  # kernel blocks in an engine block
    size = layout.chunk_bytes(2)
    sources, targets = [[7, 2], [5, 0]], [[1, 9], [3, 4]]
    pools = {}
    for method in ("reference", "auto"):
        before = {name: _bits(view).clone() for name, view in kv.items()}
        pool = torch.zeros(2 * size, dtype=torch.uint8)
        with open_copier(layout, pool, method=method, register=False) as copier:
            copier.gather(sources, [0, size], slot_size=size).wait()
            copier.scatter([0, size], targets, slot_size=size).wait()
        pools[method] = pool
        moved = {t: s for ts, ss in zip(targets, sources, strict=True) for t, s in zip(ts, ss, strict=True)}
        for name, view in kv.items():
            after = _bits(view)
            for block in range(BLOCKS):
                want = before[name][moved.get(block, block) * per_block : (moved.get(block, block) + 1) * per_block]
                assert torch.equal(after[block * per_block : (block + 1) * per_block], want), (method, name, block)
        for name, view in kv.items():  # the next path starts from the same bytes
            _bits(view).copy_(before[name])
    assert torch.equal(pools["reference"], pools["auto"])


@pytest.mark.parametrize(("backend", "layout_name"), CASES, ids=[f"{b}-{lay}" for b, lay in CASES])
def test_every_layout_of_vllm_033s_cuda_backends_round_trips_bit_exact(backend: str, layout_name: str) -> None:
    """Each layout a vLLM 0.33 CUDA backend may get, with vLLM's packed K|V content, at an interior
    offset, with the non-contiguous layer views of block-outermost layouts."""
    kind, hint, _takes = BACKENDS[backend]
    _round_trip_every_path(_vllm_033_views(kind, layout_name), ENGINE_BLOCK, hint)


@pytest.mark.parametrize("layout_name", HEADS_OUTSIDE_THE_BLOCK)
def test_a_layout_with_heads_outside_the_block_is_refused_at_start(layout_name: str) -> None:
    """LHBNC and BHLNC spread a block over one range per head: kvdepot refuses them with a typed
    error when the worker registers its KV cache (the connector then fails at start, saying so),
    never copies them wrong."""
    from kvdepot.gpu import UnsupportedLayoutError

    with pytest.raises(UnsupportedLayoutError, match="not one dense range"):
        KVLayout.from_kv_caches(_vllm_033_views("full", layout_name), ENGINE_BLOCK, backend_hint="FLASH_ATTN")


@pytest.mark.parametrize(("backend", "layout_name"), [("FLASHINFER_HND", "LBHNC"), ("FLASHMLA", "LBNHC")])
def test_kernel_blocks_split_from_engine_blocks_round_trip_bit_exact(backend: str, layout_name: str) -> None:
    """FlashInfer (at most 64 tokens) and FlashMLA (64) split larger engine blocks into kernel blocks:
    the views hold twice the blocks, half as long; kvdepot copies whole engine blocks of them."""
    kind, hint, _takes = BACKENDS[backend]
    kv = _vllm_033_views(kind, layout_name, kernel_block=ENGINE_BLOCK // 2)
    assert next(iter(kv.values())).shape[0] == 2 * BLOCKS
    _round_trip_every_path(kv, ENGINE_BLOCK, hint)


@pytest.mark.parametrize("layout_name", ["LBNHC", "BLNHC"])
def test_the_packed_layout_that_corrupted_lmcache_0_5_2_round_trips_bit_exact(layout_name: str) -> None:
    """LMCache 0.5.2 silently restored wrong KV from vLLM's packed layout (LMCache#4463, dynamo#14416):
    FlashAttention, 2 KV heads of 128, so a layer view [blocks, 2, tokens, 256] reads the same as
    [blocks, tokens, K/V, heads x head] once its token-major strides are sorted, and a copy that
    trusts the shape splits K from V in the wrong place. kvdepot moves each block's bytes whole:
    every K and V value comes back where vLLM's own view has it."""
    kv = _vllm_033_views("full", layout_name, heads=2, head_size=128)
    view = next(iter(kv.values()))
    assert tuple(view.shape[1:]) == (2, ENGINE_BLOCK, 256)
    assert view.stride(1) < view.stride(2)  # token-major interior: heads inside each token
    _round_trip_every_path(kv, ENGINE_BLOCK, "FLASH_ATTN")
    # K and V of one token and head, by vLLM's indexing, after a gather and a scatter to block 1:
    from kvdepot.gpu import gather, scatter

    layout = KVLayout.from_kv_caches(kv, ENGINE_BLOCK, backend_hint="FLASH_ATTN")
    k_before, v_before = view[6, 1, 3, :128].clone(), view[6, 1, 3, 128:].clone()
    pool = torch.zeros(layout.chunk_bytes(1), dtype=torch.uint8)
    gather(layout, [[6]], pool, [0])
    scatter(layout, pool, [0], [[1]])
    assert torch.equal(_bits(view[1, 1, 3, :128]), _bits(k_before))
    assert torch.equal(_bits(view[1, 1, 3, 128:]), _bits(v_before))


@pytest.mark.parametrize(
    ("backend", "layout_name", "kernel_block"),
    [("FLASH_ATTN", "LBNHC", None), ("FLASHINFER_HND", "BLHNC", None), ("FLASHMLA", "LBNHC", ENGINE_BLOCK // 2)],
)
def test_the_cuda_kernel_run_by_tritons_interpreter_fills_the_slots_as_the_reference(
    backend: str, layout_name: str, kernel_block: int | None, triton_interpreter: None
) -> None:
    """The CUDA path's Triton kernel, run on the CPU by Triton's interpreter, gathers vLLM 0.33's
    views into the same slot bytes as the plain-torch reference, and scatters them back whole."""
    from kvdepot.gpu import open_copier
    from kvdepot.gpu._copy import plan_copy
    from kvdepot.gpu._cuda import KernelTables, pool_words, triton_copy
    from kvdepot.gpu._table import CopyTables

    kind, hint, _takes = BACKENDS[backend]
    kv = _vllm_033_views(kind, layout_name, kernel_block=kernel_block)
    layout = KVLayout.from_kv_caches(kv, ENGINE_BLOCK, backend_hint=hint)
    size = layout.chunk_bytes(2)
    reference = torch.zeros(size, dtype=torch.uint8)
    with open_copier(layout, reference, method="reference") as copier:
        copier.gather([[7, 2]], [0], slot_size=size).wait()
    pool = torch.zeros(size, dtype=torch.uint8)
    tables = KernelTables(layout, CopyTables(layout))
    plan = plan_copy(layout, pool, [0], [[7, 2]], writes_kv=False)
    triton_copy(plan, pool.data_ptr(), lambda width: pool_words(pool, width), tables, to_pool=True)
    assert torch.equal(pool, reference)
    before = {name: _bits(view).clone() for name, view in kv.items()}
    plan = plan_copy(layout, pool, [0], [[1, 9]], writes_kv=True)
    triton_copy(plan, pool.data_ptr(), lambda width: pool_words(pool, width), tables, to_pool=False)
    per_block = next(iter(kv.values())).shape[0] // BLOCKS
    for name, view in kv.items():
        for target, source in ((1, 7), (9, 2)):
            got = _bits(view)[target * per_block : (target + 1) * per_block]
            assert torch.equal(got, before[name][source * per_block : (source + 1) * per_block])
