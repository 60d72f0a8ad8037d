"""What the connector reads of vLLM's config, before anything connects: one `ConnectorSetup`.

`KVDepotConnector.__init__` (vLLM calls it with ``(vllm_config, role, kv_cache_config)``) builds
a `ConnectorSetup` with `ConnectorSetup.from_vllm_config` and then only wires: it connects to
the server and builds the half of its role from the setup's fields. The reading refuses what
kvdepot cannot serve (layer types, context parallelism, a chunk size that is not a multiple of
the block size) before any socket opens, and writes nothing back to vLLM's config
(`_compat.recompute_failed_loads` does, once, at the connector's construction).
"""

from __future__ import annotations

import os
import platform
from typing import TYPE_CHECKING, Any

import attrs

from kvdepot.core import Namespace, ParallelStrategy
from kvdepot.transport import default_address
from kvdepot.vllm_connector._config import ConnectorConfig
from kvdepot.vllm_connector._groups import (
    CacheGroup,
    ConnectorConfigError,
    cache_groups,
    layout_part,
    unserved_layers,
)
from kvdepot.vllm_connector._identity import model_identity

if TYPE_CHECKING:
    from collections.abc import Callable

    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

#: vLLM's parallel settings kvdepot cannot serve above 1 (its chunks would map to the wrong blocks).
UNSUPPORTED_PARALLEL = ("decode_context_parallel_size", "prefill_context_parallel_size")


@attrs.frozen
class ConnectorSetup:
    """Everything one connector (the scheduler's, or one worker's) takes from vLLM's config, checked."""

    #: "scheduler" or "worker" (vLLM's `KVConnectorRole`, by name).
    role: str
    #: vLLM's ``kv_role``: ``kv_both``, ``kv_producer`` (a prefill engine) or ``kv_consumer``.
    kv_role: str
    config: ConnectorConfig
    groups: tuple[CacheGroup, ...]
    block_size: int
    strategy: ParallelStrategy
    #: The server's address: ``kvdepot.address``, else the local default.
    address: str
    #: The KV layout's name (`layout_name`), part of every key.
    layout: str
    #: vLLM's model name, as the worker registers it.
    model: str
    #: The engine's blocks, which every group's KV-cache tensors must have.
    num_blocks: int | None
    #: Layers of groups vLLM does not let an offloader store: never copied.
    skip_layers: frozenset[str]
    #: The engine publishes KV events (``--kv-events-config``): kvdepot announces its chunks in them.
    kv_events: bool
    #: The scheduler's key namespace; None on a worker.
    namespace: Namespace | None = None
    #: The attention backend vLLM picked, to read the KV layout by; None on the scheduler, or unknown.
    backend_hint: str | None = None

    @classmethod
    def from_vllm_config(
        cls,
        vllm_config: VllmConfig,
        role: Any,
        kv_cache_config: KVCacheConfig,
        *,
        worker_strategy: Callable[[int, int, bool], ParallelStrategy] | None = None,
    ) -> ConnectorSetup:
        """Read and check vLLM's config for a connector of ``role`` (vLLM's `KVConnectorRole`).

        ``worker_strategy(tp_size, pp_size, use_mla)``: a worker's strategy, with its own ranks;
        None reads them from vLLM's parallel state (`strategy_from_vllm`). Raises
        `ConnectorConfigError` for anything kvdepot cannot serve, layer types first (before any
        other part of the config is read).
        """
        groups = cache_groups(kv_cache_config)  # refuses Mamba state and the like, first
        ktc, cache, parallel = vllm_config.kv_transfer_config, vllm_config.cache_config, vllm_config.parallel_config
        config = ConnectorConfig.from_extra_config(
            ktc.kv_connector_extra_config,
            lmcache_backend=getattr(cache, "kv_offloading_backend", None) == "lmcache",
            offloading_gib=getattr(cache, "kv_offloading_size", None),
        )
        _check_parallel(parallel)
        _check_chunk_size(config.chunk_size, cache.block_size)
        name = str(role.name).lower()
        scheduler = name == "scheduler"
        use_mla = bool(vllm_config.model_config.use_mla)
        tp_size, pp_size = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        if scheduler:  # rank 0's
            strategy = ParallelStrategy.from_config(parallel.world_size, 0, tp_size, pp_size, use_mla)
        else:
            strategy = (worker_strategy or strategy_from_vllm)(tp_size, pp_size, use_mla)
        layout = layout_name(vllm_config, groups)
        events_config = getattr(vllm_config, "kv_events_config", None)
        return cls(
            role=name,
            kv_role=str(ktc.kv_role),
            config=config,
            groups=groups,
            block_size=cache.block_size,
            strategy=strategy,
            address=config.address or default_address(),
            layout=layout,
            model=str(vllm_config.model_config.model),
            num_blocks=getattr(kv_cache_config, "num_blocks", None),
            skip_layers=unserved_layers(kv_cache_config),
            kv_events=events_config is not None and bool(events_config.enable_kv_cache_events),
            namespace=(
                Namespace(model=model_identity(vllm_config), layout=layout, kv_world_size=strategy.kv_world_size)
                if scheduler
                else None
            ),
            backend_hint=None if scheduler else _backend_name(vllm_config),
        )

    @property
    def scheduler(self) -> bool:
        return self.role == "scheduler"

    @property
    def producer(self) -> bool:
        """A prefill engine: it hands its chunks to a decode engine."""
        return self.kv_role == "kv_producer"

    @property
    def loads(self) -> bool:
        return self.kv_role != "kv_producer"

    @property
    def stores(self) -> bool:
        return self.kv_role != "kv_consumer" or self.config.consumer_stores

    @property
    def pin_s(self) -> float:
        """How long the server keeps each store's chunks from eviction: a producer's, until looked up."""
        return self.config.handoff_pin if self.producer else 0.0

    @property
    def sync_load_bytes(self) -> int:
        """The test knob that keeps loads in flight makes every load asynchronous."""
        return 0 if self.config.load_delay else self.config.sync_load_bytes


def _check_parallel(parallel: Any) -> None:
    for name in UNSUPPORTED_PARALLEL:
        if getattr(parallel, name, 1) > 1:
            raise ConnectorConfigError(
                f"kvdepot does not support {name} > 1 yet (got {getattr(parallel, name)}): its chunks would "
                f"map to the wrong blocks. Run with {name}=1, or without the kvdepot connector.",
                setting=name,
            )


def _check_chunk_size(chunk_size: int, block_size: int) -> None:
    if chunk_size % block_size:
        raise ConnectorConfigError(
            f"kvdepot.chunk_size {chunk_size} is not a multiple of the engine's block size "
            f"{block_size}; set kvdepot.chunk_size to a multiple of {block_size}",
            chunk_size=chunk_size,
            block_size=block_size,
        )


def strategy_from_vllm(tp_size: int, pp_size: int, use_mla: bool) -> ParallelStrategy:
    """This worker's strategy, its ranks read from vLLM's parallel state (set up in an engine's workers only)."""
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
