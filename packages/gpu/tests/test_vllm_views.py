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
