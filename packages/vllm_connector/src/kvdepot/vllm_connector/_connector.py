"""`KVDepotConnector`: vLLM's KV connector API on top of a kvdepot server.

A thin adapter. The scheduler half (`_scheduler.py`) feeds `kvdepot.core.Planner`; the
worker half (`_worker.py`) moves blocks with `kvdepot.gpu`; both talk to the server
through `kvdepot.transport.CacheClient`.
"""

from __future__ import annotations

import functools
import logging
import shlex
import uuid
from typing import TYPE_CHECKING, Any

from kvdepot.transport import CacheClient
from kvdepot.vllm_connector._compat import check_release, connector_api, recompute_failed_loads, vllm_version
from kvdepot.vllm_connector._groups import ConnectorConfigError
from kvdepot.vllm_connector._health import ServerHealth
from kvdepot.vllm_connector._kv_events import EventAnnouncer
from kvdepot.vllm_connector._meta import KVDepotMetadata, KVDepotStats, make_prom_metrics
from kvdepot.vllm_connector._plugin import announce
from kvdepot.vllm_connector._scheduler import SchedulerSide
from kvdepot.vllm_connector._server import ensure_server
from kvdepot.vllm_connector._setup import ConnectorSetup, layout_name
from kvdepot.vllm_connector._setup import strategy_from_vllm as _worker_strategy
from kvdepot.vllm_connector._worker import WorkerSide

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvdepot.transport import HelloReply, RegisterReply

log = logging.getLogger("vllm.kvdepot")

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
        KVConnectorTransferResults,
        KVConnectorWorkerMetadata,
        SupportsHMA,
    )
else:
    # A vLLM whose connector API lacks something the connector calls is refused here, with the
    # tested range in the message, before anything else of vLLM's is used.
    _base = connector_api()
    KVConnectorBase_V1 = _base.KVConnectorBase_V1
    KVConnectorMetadata = _base.KVConnectorMetadata
    KVConnectorRole = _base.KVConnectorRole
    KVConnectorTransferResults = _base.KVConnectorTransferResults
    KVConnectorWorkerMetadata = _base.KVConnectorWorkerMetadata
    SupportsHMA = _base.SupportsHMA


def _route_structlog_to_stdlib() -> None:
    """Inside vLLM, kvdepot's transport logs through the standard library, so debug lines stay quiet.

    Only when the host process has not configured structlog itself.
    """
    import structlog

    if structlog.is_configured():
        return
    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            structlog.stdlib.add_logger_name,
            structlog.processors.format_exc_info,
            structlog.processors.KeyValueRenderer(key_order=["event"]),
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )


__all__ = ["ConnectorConfigError", "KVDepotConnector", "layout_name"]


class KVDepotConnector(KVConnectorBase_V1, SupportsHMA):
    """Stores computed KV chunks in a kvdepot server and loads hits instead of recomputing."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        """vLLM's constructor: reads its config into a `ConnectorSetup` (nothing connects before
        that has refused what kvdepot cannot serve), then wires the half of ``role`` to a server."""
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        announce()  # the plugin's own log line, held back until vLLM's logging is set up
        check_release(vllm_version())
        _route_structlog_to_stdlib()
        self.setup = setup = ConnectorSetup.from_vllm_config(
            vllm_config, role, kv_cache_config, worker_strategy=_worker_strategy
        )
        self.groups, self.kv_role, self.config = setup.groups, setup.kv_role, setup.config
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self.client = _connect(setup, self._on_reconnect)
        self.health = ServerHealth(self.client)
        if setup.scheduler:
            recompute_failed_loads(vllm_config.kv_transfer_config)
            self._scheduler = _scheduler_side(setup, self.client, self.health)
        else:
            self._worker = _worker_side(setup, self.client, self.health)
        log.info(
            "kvdepot connector (%s, %s) using server %s, chunk size %d tokens, KV-cache groups: %s",
            setup.role,
            setup.kv_role,
            setup.address,
            setup.config.chunk_size,
            ", ".join(group.describe() for group in setup.groups),
        )

    def _on_reconnect(self, hello: HelloReply, register: RegisterReply | None) -> None:
        if self._worker is not None:
            self._worker.on_reconnect(hello, register)

    @property
    def requires_kv_delivery(self) -> bool:
        """True for a ``kv_producer`` (a prefill engine hands its chunks to a decode engine): vLLM then
        recomputes a request preempted while its hand-off is pending rather than let it finish with
        blocks the preemption freed. False otherwise: for a cache, a dropped store is a later miss."""
        return self.kv_role == "kv_producer"

    # -- scheduler side ------------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self._scheduler is not None:
            self._scheduler.kv_cache_manager = kv_cache_manager

    def on_new_request(self, request: Request) -> None:
        assert self._scheduler is not None
        self._scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks.get_block_ids(), num_external_tokens)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[Any, int]:
        """kvdepot's hits by source for `vllm:prompt_tokens_cached_by_source`: the server's RAM
        is ``host``, its disk tier ``disk``; vLLM has no source for a remote store, so the
        remote tier's are ``external_unspecified``."""
        assert self._scheduler is not None
        from vllm.v1.metrics.cache_hit_source import CacheHitSource

        named = {"host": CacheHitSource.HOST, "disk": CacheHitSource.DISK}
        out: dict[Any, int] = {}
        for kind, tokens in self._scheduler.hit_sources(request, num_external_tokens).items():
            source = named.get(kind, CacheHitSource.EXTERNAL_UNSPECIFIED)
            out[source] = out.get(source, 0) + tokens
        return out

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._scheduler is not None
        self._scheduler.update_connector_output(connector_output)

    def take_events(self) -> Iterable[KVCacheEvent]:
        events = self._scheduler.events if self._scheduler is not None else None
        return events.take() if events is not None else ()

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    # -- worker side ---------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Every step, before its forward pass (vLLM starts asynchronous loads only after it)."""
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            assert isinstance(connector_metadata, KVDepotMetadata)
            self._worker.step_started(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVDepotMetadata)
        self._worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: the request waits in vLLM until get_finished reports them

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        return  # stores are whole-model copies made in wait_for_save

    def wait_for_save(self) -> None:
        """The step's end (Model Runner V2 with a speculator: `finalize_step`): the step's stores
        read their blocks now, before vLLM may hand any of them on."""
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVDepotMetadata)
        self._worker.wait_for_save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self._worker is not None
        return self._worker.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Like `get_finished`, and the loads that failed: vLLM recomputes those requests.

        With one full-attention KV-cache group a failed load is reported block by block
        (`get_block_ids_with_load_errors`), so vLLM keeps what loaded before the first
        failed block. Block ids are per group in a hybrid model, and a sliding window cut
        back to the first failed block would reach into blocks vLLM already dropped (its
        null block), so there the failed requests are reported, and vLLM recomputes each of
        them from its start.
        """
        assert self._worker is not None
        sending, recving = self._worker.get_finished(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()),
            finished_recving=set(recving or ()),
            failed_recving=self._worker.take_failed_requests(),
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_failed_blocks() if self._worker is not None else set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker.take_worker_meta() if self._worker is not None else None

    # -- sleep mode (vLLM 0.33+; 0.32 has no such hooks and never calls them) ------------

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any = None) -> bool:
        """True: the workers end their copies before vLLM releases the KV cache, and resume after."""
        return True

    def unregister_kv_caches(self) -> None:
        """Before sleep (or a discard of the KV cache): every copy in flight ends; none starts until restored."""
        if self._worker is not None:
            self._worker.suspend()

    def restore_kv_caches(self) -> None:
        """After wake-up: vLLM's sleep backends give the KV cache back at the same addresses."""
        if self._worker is not None:
            self._worker.resume()

    # -- both ----------------------------------------------------------------------------

    def reset_cache(self) -> bool:
        """After it, no request of this engine can hit anything stored before (new weights)."""
        return self._scheduler.reset() if self._scheduler is not None else True

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._worker is not None:
            return self._worker.take_stats()
        if self._scheduler is not None and not self._scheduler.stats.is_empty():
            stats, self._scheduler.stats = self._scheduler.stats, KVDepotStats()
            return stats
        return None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVDepotStats.from_data(data) if data is not None else KVDepotStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> Any:
        return make_prom_metrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.shutdown()
        if self._worker is not None:
            self._worker.shutdown()
        self.client.close()


def _connect(setup: ConnectorSetup, on_reconnect: Callable[[HelloReply, RegisterReply | None], None]) -> CacheClient:
    """A client of the setup's server (started first where configured), once it answers."""
    config = setup.config
    if config.start_server:
        ensure_server(setup.address, capacity=config.capacity, timeout=config.timeout)
    client = CacheClient(
        setup.address,
        timeout=config.timeout,
        heartbeat_interval=config.heartbeat_interval,
        client_name=f"vllm-{setup.role}-{setup.strategy.rank}-{uuid.uuid4().hex[:8]}",
        auth_secret=config.auth or None,
        on_reconnect=on_reconnect,
    )
    _check_server(client, config.timeout)
    return client


def _scheduler_side(setup: ConnectorSetup, client: CacheClient, health: ServerHealth) -> SchedulerSide:
    namespace, config = setup.namespace, setup.config
    assert namespace is not None  # the scheduler's setup has one
    # What a router needs to key prompts as this engine does (`kvdepot query`, docs/core.md).
    log.info(
        "kvdepot: chunk keys use namespace model=%r layout=%r kv_world_size=%d chunk_size=%d; "
        "ask a server what it holds of a prompt with: kvdepot query --model %s --layout %s "
        "--kv-world-size %d --chunk-size %d --tokens ...",
        namespace.model,
        namespace.layout,
        namespace.kv_world_size,
        config.chunk_size,
        shlex.quote(namespace.model),
        shlex.quote(namespace.layout),
        namespace.kv_world_size,
        config.chunk_size,
    )
    return SchedulerSide(
        namespace,
        block_size=setup.block_size,
        chunk_size=config.chunk_size,
        client=client,
        lookup_timeout=config.lookup_timeout,
        health=health,
        groups=setup.groups,
        events=_event_announcer(setup, client),
        loads=setup.loads,
        stores=setup.stores,
        producer=setup.producer,
        handoff_timeout=config.handoff_timeout,
        sync_load_bytes=setup.sync_load_bytes,
        sync_load_share=config.sync_load_share,
        slot_index=config.slot_index,
    )


def _event_announcer(setup: ConnectorSetup, client: CacheClient) -> EventAnnouncer | None:
    """What kvdepot holds, in the engine's KV events, where the engine publishes them."""
    if not setup.kv_events:
        return None
    log.info("kvdepot: the engine's KV events also announce the chunks it can load from kvdepot (medium CPU)")
    return EventAnnouncer(
        client, block_size=setup.block_size, chunk_size=setup.config.chunk_size, num_groups=len(setup.groups)
    )


def _worker_side(setup: ConnectorSetup, client: CacheClient, health: ServerHealth) -> WorkerSide:
    config = setup.config
    return WorkerSide(
        client=client,
        health=health,
        strategy=setup.strategy,
        chunk_size=config.chunk_size,
        block_size=setup.block_size,
        layout_name=setup.layout,
        model=setup.model,
        backend_hint=setup.backend_hint,
        fail_loads=config.fail_loads,
        load_delay=config.load_delay,
        prefault_pool=config.prefault_pool,
        load_step_share=config.load_step_share,
        groups=setup.groups,
        num_blocks=setup.num_blocks,
        pin_s=setup.pin_s,
        before_commit=_store_gate(config.store_gate),
        skip_layers=setup.skip_layers,
    )


def _check_server(client: CacheClient, timeout: float) -> None:
    """Fail at start, within the timeout, when nothing answers at the address."""
    try:
        client.ping().result(timeout=timeout + 1)
    except Exception as exc:
        client.close(end_session=False)
        raise ConnectorConfigError(
            f"no kvdepot server answers at {client.address}: {exc}. Start one with "
            f"`kvdepot serve --address {client.address}`, or set kvdepot.start_server=true.",
            address=client.address,
        ) from exc


def _store_gate(path: str | None) -> Callable[[], None] | None:
    """``kvdepot.test.store_gate``: the test hook `testing.wait_for_gate` on ``path``; None (no hook) unless set."""
    if path is None:
        return None
    from kvdepot.vllm_connector.testing import wait_for_gate  # testing only: that module imports pytest

    return functools.partial(wait_for_gate, path)
