"""`KVDepotConnector`: vLLM's KV connector API on top of a kvdepot server.

A thin adapter. The scheduler half (`_scheduler.py`) feeds `kvdepot.core.Planner`; the
worker half (`_worker.py`) moves blocks with `kvdepot.gpu`; both talk to the server
through `kvdepot.transport.CacheClient`.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import shlex
import uuid
from typing import TYPE_CHECKING, Any

from kvdepot.core import Namespace, ParallelStrategy
from kvdepot.transport import CacheClient, default_address
from kvdepot.vllm_connector._compat import check_release, connector_api, vllm_version
from kvdepot.vllm_connector._config import ConnectorConfig
from kvdepot.vllm_connector._groups import (
    CacheGroup,
    ConnectorConfigError,
    cache_groups,
    layout_part,
    unserved_layers,
)
from kvdepot.vllm_connector._health import ServerHealth
from kvdepot.vllm_connector._identity import model_identity
from kvdepot.vllm_connector._kv_events import EventAnnouncer
from kvdepot.vllm_connector._meta import KVDepotMetadata, KVDepotStats, make_prom_metrics
from kvdepot.vllm_connector._plugin import announce
from kvdepot.vllm_connector._scheduler import SchedulerSide
from kvdepot.vllm_connector._server import ensure_server
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


def layout_name(vllm_config: VllmConfig, groups: tuple[CacheGroup, ...] = ()) -> str:
    """The KV layout as both halves derive it from the config alone (part of every key).

    Everything a user or an upgrade can change about a block's bytes: device, dtypes, shape,
    parallel layout, the attention backend asked for, vLLM's KV-cache layout setting and
    vLLM's version, on a CPU the attention's instruction set, and the KV-cache groups of a
    hybrid or sliding-window model. What the
    worker then measures on its tensors goes to the server as the layout's fingerprint, and
    the server refuses a second fingerprint under one name.
    """
    from vllm.platforms import current_platform

    import vllm

    model, cache, parallel = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    return "|".join(
        str(part)
        for part in (
            current_platform.device_type,
            model.dtype,
            cache.cache_dtype,
            f"L{model.get_num_layers(parallel)}",
            f"H{model.get_num_kv_heads(parallel)}",
            f"D{model.get_head_size()}",
            f"B{cache.block_size}",
            f"mla{int(model.use_mla)}",
            f"tp{parallel.tensor_parallel_size}",
            f"pp{parallel.pipeline_parallel_size}",
            f"attn={getattr(backend, 'name', backend) or 'auto'}",
            f"kvlayout={os.environ.get('VLLM_KV_CACHE_LAYOUT') or 'auto'}",
            f"vllm={getattr(vllm, '__version__', '')}",
            *filter(None, [_cpu_attention_isa(vllm_config), layout_part(groups)]),
        )
    )


def _cpu_attention_isa(vllm_config: VllmConfig) -> str | None:
    """On a CPU, the machine and the instruction set vLLM's attention uses (``isa=x86_64-amx``):
    the order of the bytes within a block follows it (AMX tiles differ from the vector
    kernels), so nodes of different CPUs sharing a tier must not share chunks. None elsewhere."""
    from vllm.platforms import current_platform

    if current_platform.device_type != "cpu":
        return None
    model, cache = vllm_config.model_config, vllm_config.cache_config
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(model.dtype, cache.block_size, model.get_head_size(), cache.cache_dtype)
    except Exception:  # another vLLM, or a combination its CPU attention refuses anyway
        isa = "unknown"
    return f"isa={platform.machine()}-{isa}"


class KVDepotConnector(KVConnectorBase_V1, SupportsHMA):
    """Stores computed KV chunks in a kvdepot server and loads hits instead of recomputing."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        announce()  # the plugin's own log line, held back until vLLM's logging is set up
        check_release(vllm_version())
        _route_structlog_to_stdlib()
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        # Refuses layer types it cannot serve (Mamba state, ...) before anything starts.
        self.groups = cache_groups(kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        self.kv_role = str(ktc.kv_role)
        cache = vllm_config.cache_config
        parallel = vllm_config.parallel_config
        self.config = ConnectorConfig.from_extra_config(
            ktc.kv_connector_extra_config,
            lmcache_backend=getattr(cache, "kv_offloading_backend", None) == "lmcache",
            offloading_gib=getattr(cache, "kv_offloading_size", None),
        )
        for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
            if getattr(parallel, name, 1) > 1:
                raise ConnectorConfigError(
                    f"kvdepot does not support {name} > 1 yet (got {getattr(parallel, name)}): its chunks would "
                    f"map to the wrong blocks. Run with {name}=1, or without the kvdepot connector.",
                    setting=name,
                )
        block_size = cache.block_size
        if self.config.chunk_size % block_size:
            raise ConnectorConfigError(
                f"kvdepot.chunk_size {self.config.chunk_size} is not a multiple of the engine's block size "
                f"{block_size}; set kvdepot.chunk_size to a multiple of {block_size}",
                chunk_size=self.config.chunk_size,
                block_size=block_size,
            )
        use_mla = bool(vllm_config.model_config.use_mla)
        if role == KVConnectorRole.WORKER:
            strategy = _worker_strategy(parallel.tensor_parallel_size, parallel.pipeline_parallel_size, use_mla)
        else:
            strategy = ParallelStrategy.from_config(
                parallel.world_size, 0, parallel.tensor_parallel_size, parallel.pipeline_parallel_size, use_mla
            )
        address = self.config.address or default_address()
        if self.config.start_server:
            ensure_server(address, capacity=self.config.capacity, timeout=self.config.timeout)
        self.client = CacheClient(
            address,
            timeout=self.config.timeout,
            heartbeat_interval=self.config.heartbeat_interval,
            client_name=f"vllm-{role.name.lower()}-{strategy.rank}-{uuid.uuid4().hex[:8]}",
            auth_secret=self.config.auth or None,
            on_reconnect=self._on_reconnect,
        )
        _check_server(self.client, self.config.timeout)
        self.health = ServerHealth(self.client)
        name = layout_name(vllm_config, self.groups)
        if role == KVConnectorRole.SCHEDULER:
            if ktc.kv_load_failure_policy != "recompute":
                # A cache miss is never an error: a failed load is recomputed, never turned
                # into a failed request. Said once, so a user who chose "fail" knows why.
                log.warning(
                    "kvdepot sets kv_load_failure_policy=recompute (was %r): a load from a cache that fails is "
                    "recomputed, never turned into a failed request",
                    ktc.kv_load_failure_policy,
                )
                ktc.kv_load_failure_policy = "recompute"
            namespace = Namespace(model=model_identity(vllm_config), layout=name, kv_world_size=strategy.kv_world_size)
            # What a router needs to key prompts as this engine does (`kvdepot query`, docs/core.md).
            log.info(
                "kvdepot: chunk keys use namespace model=%r layout=%r kv_world_size=%d chunk_size=%d; "
                "ask a server what it holds of a prompt with: kvdepot query --model %s --layout %s "
                "--kv-world-size %d --chunk-size %d --tokens ...",
                namespace.model,
                namespace.layout,
                namespace.kv_world_size,
                self.config.chunk_size,
                shlex.quote(namespace.model),
                shlex.quote(namespace.layout),
                namespace.kv_world_size,
                self.config.chunk_size,
            )
            self._scheduler = SchedulerSide(
                namespace,
                block_size=block_size,
                chunk_size=self.config.chunk_size,
                client=self.client,
                lookup_timeout=self.config.lookup_timeout,
                health=self.health,
                groups=self.groups,
                events=self._event_announcer(vllm_config, block_size),
                loads=ktc.kv_role != "kv_producer",
                stores=ktc.kv_role != "kv_consumer" or self.config.consumer_stores,
                producer=ktc.kv_role == "kv_producer",
                handoff_timeout=self.config.handoff_timeout,
                # The test knob that keeps loads in flight makes every load asynchronous.
                sync_load_bytes=0 if self.config.load_delay else self.config.sync_load_bytes,
            )
        else:
            self._worker = WorkerSide(
                client=self.client,
                health=self.health,
                strategy=strategy,
                chunk_size=self.config.chunk_size,
                block_size=block_size,
                layout_name=name,
                model=str(vllm_config.model_config.model),
                backend_hint=_backend_name(vllm_config),
                fail_loads=self.config.fail_loads,
                load_delay=self.config.load_delay,
                prefault_pool=self.config.prefault_pool,
                load_step_share=self.config.load_step_share,
                groups=self.groups,
                num_blocks=kv_cache_config.num_blocks,
                pin_s=self.config.handoff_pin if ktc.kv_role == "kv_producer" else 0.0,
                before_commit=_store_gate(self.config.store_gate),
                skip_layers=unserved_layers(kv_cache_config),
            )
        log.info(
            "kvdepot connector (%s, %s) using server %s, chunk size %d tokens, KV-cache groups: %s",
            role.name.lower(),
            ktc.kv_role,
            address,
            self.config.chunk_size,
            ", ".join(group.describe() for group in self.groups),
        )

    def _event_announcer(self, vllm_config: VllmConfig, block_size: int) -> EventAnnouncer | None:
        """What kvdepot holds, in the engine's KV events, where the engine publishes them."""
        events_config = getattr(vllm_config, "kv_events_config", None)
        if events_config is None or not events_config.enable_kv_cache_events:
            return None
        log.info("kvdepot: the engine's KV events also announce the chunks it can load from kvdepot (medium CPU)")
        return EventAnnouncer(
            self.client, block_size=block_size, chunk_size=self.config.chunk_size, num_groups=len(self.groups)
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


def _worker_strategy(tp_size: int, pp_size: int, use_mla: bool) -> ParallelStrategy:
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group

    tp_rank = get_tp_group().rank_in_group
    pp_rank = get_pp_group().rank_in_group
    return ParallelStrategy.from_config(tp_size * pp_size, pp_rank * tp_size + tp_rank, tp_size, pp_size, use_mla)


def _backend_name(vllm_config: VllmConfig) -> str | None:
    try:
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backend

        return str(get_current_attn_backend(vllm_config).get_name())
    except Exception:
        return None


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
