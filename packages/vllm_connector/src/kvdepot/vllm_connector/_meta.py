"""What travels between the connector's halves inside vLLM: plain dataclasses of bytes and ints.

vLLM carries the scheduler's metadata to every worker and the workers' metadata back,
through its own executor; nothing here goes over kvdepot's wire.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvdepot.vllm_connector._compat import connector_api

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata
else:  # checked first: a vLLM without what the connector needs is refused with the tested range
    KVConnectorMetadata = connector_api().KVConnectorMetadata
    KVConnectorWorkerMetadata = connector_api().KVConnectorWorkerMetadata


@dataclass
class LoadOp:
    """Scatter leased chunks into a request's blocks (the first ``skip_blocks`` stay untouched).

    The worker copies it on its own thread and reports it in `get_finished` (done or failed);
    vLLM keeps the request waiting and its blocks out of the prefix cache until then.
    Each slot's header must name its chunk (``salt``, ``keys``) before and after the copy.
    Blocks that are vLLM's null block (outside a sliding window) are not written either.
    """

    req_id: str
    server_id: str
    slots: list[list[int]]  # per KV rank: pool offsets of the chunks, in order
    block_ids: list[list[int]]  # per KV-cache group: blocks_per_chunk blocks per chunk, in order
    skip_blocks: int
    num_tokens: int
    slot_bytes: int = 0  # each slot's length, as the server said: checked against the worker's chunk size
    salt: str = ""
    keys: list[list[bytes]] = field(default_factory=list)  # per KV rank: the chunk each slot must hold
    #: Loaded before the step's forward pass (vLLM counts its tokens computed and schedules the rest
    #: in this step): copied in `start_load_kv`, never reported in `get_finished`; a failure is
    #: reported by its blocks (`get_block_ids_with_load_errors`), and vLLM recomputes them.
    sync: bool = False


@dataclass
class StoreOp:
    """Gather a request's full chunks into the pool under their keys."""

    req_id: str
    salt: str
    keys: list[list[bytes]]  # per KV rank
    block_ids: list[list[int]]  # per KV-cache group: blocks_per_chunk blocks per chunk, in order
    first_chunk: int = 0  # the request's chunk the first key is (a skipped store is planned again from it)


@dataclass
class KVDepotMetadata(KVConnectorMetadata):
    """One engine step's work for every worker.

    ``stores`` read their blocks within this step (`_stores.py`): nothing of a request is held
    past it. ``idle``: the step computes no tokens (every request waits, e.g. for its load), so
    a worker may wait for this step's loads and report them from this very step.
    """

    loads: list[LoadOp] = field(default_factory=list)
    stores: list[StoreOp] = field(default_factory=list)
    idle: bool = False


@dataclass
class KVDepotWorkerMetadata(KVConnectorWorkerMetadata):
    """Which finished loads failed, on any worker (vLLM reports the finished ones itself); the
    bytes of hits a worker copied into its KV cache since its last report, and the seconds those
    copies took: the rate that bounds the synchronous loads (`_sync_budget.py`); and the stores a
    worker skipped because their slots came too late, by request: the first chunk skipped."""

    failed: set[str] = field(default_factory=set)
    copied_bytes: int = 0
    copied_s: float = 0.0
    skipped: dict[str, int] = field(default_factory=dict)

    @property
    def copy_rate(self) -> float:
        """Bytes per second of the copies reported; infinite when none was timed."""
        return self.copied_bytes / self.copied_s if self.copied_bytes and self.copied_s > 0 else float("inf")

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KVDepotWorkerMetadata)
        # The workers copy side by side and the step waits for the slowest: its figures stand.
        slower = min((self, other), key=lambda meta: meta.copy_rate)
        skipped = dict(self.skipped)
        for req_id, chunk in other.skipped.items():
            skipped[req_id] = min(chunk, skipped.get(req_id, chunk))
        return KVDepotWorkerMetadata(self.failed | other.failed, slower.copied_bytes, slower.copied_s, skipped)


#: Counters reported through vLLM's connector stats (summed over workers and steps).
STAT_COUNTERS = (
    "lookups",
    "lookups_from_index",
    "lookup_hit_tokens",
    "lookup_misses_timeout",
    "lookup_misses_server_down",
    "loaded_tokens",
    "loaded_bytes",
    "load_failures",
    "sync_share_waits",
    "stored_chunks",
    "stored_bytes",
    "store_skipped",
    "store_late",
    "store_again",
    "handoff_polls",
    "handoff_timeouts",
)


@dataclass
class KVDepotStats(KVConnectorStats):
    """Connector counters, plus lookup latency as a sum and a count."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        data: dict[str, float] = dict.fromkeys(STAT_COUNTERS, 0)
        data["lookup_seconds_sum"] = 0.0
        self.data = data

    def add(self, name: str, value: float = 1) -> None:
        self.data[name] = self.data.get(name, 0) + value

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            if isinstance(value, int | float):
                self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: v for k, v in self.data.items() if k != "lookup_seconds_sum"}
        lookups = self.data.get("lookups", 0)
        out["lookup_ms_avg"] = round(1000 * self.data.get("lookup_seconds_sum", 0.0) / lookups, 3) if lookups else 0.0
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())

    @classmethod
    def from_data(cls, data: dict[str, Any] | None) -> KVDepotStats:
        return cls(data=dict(data or {}))


#: Prometheus counters the connector exports through vLLM's metrics endpoint: name -> help.
PROM_COUNTERS = {
    "lookup_hit_tokens": "Tokens found in kvdepot by lookups",
    "loaded_bytes": "Bytes loaded from kvdepot into the KV cache",
    "stored_bytes": "Bytes stored from the KV cache into kvdepot",
    "load_failures": "Loads from kvdepot that failed and were recomputed",
    "store_skipped": "Stores skipped because the kvdepot server had not reserved their slots in time",
    "store_again": "Skipped stores planned again while their requests still held the blocks",
    "lookups": "Lookups answered by kvdepot",
    "lookup_seconds_sum": "Seconds spent waiting for kvdepot lookups",
}


def make_prom_metrics(
    vllm_config: Any, metric_types: dict[type, type], labelnames: list[str], per_engine: dict[int, list[object]]
) -> Any:
    """vLLM's Prometheus hook: one counter per figure, per engine."""
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

    class KVDepotPromMetrics(KVConnectorPromMetrics):
        def __init__(self) -> None:
            super().__init__(vllm_config, metric_types, labelnames, per_engine)
            self._counters = {
                name: {
                    idx: self._counter_cls(
                        name=f"vllm:kvdepot_{name}", documentation=doc, labelnames=labelnames
                    ).labels(*values)
                    for idx, values in per_engine.items()
                }
                for name, doc in PROM_COUNTERS.items()
            }

        def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
            for name, per_engine_counter in self._counters.items():
                value = transfer_stats_data.get(name, 0)
                if value and engine_idx in per_engine_counter:
                    per_engine_counter[engine_idx].inc(value)

    return KVDepotPromMetrics()
