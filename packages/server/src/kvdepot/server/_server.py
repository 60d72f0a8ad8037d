"""The daemon: pool + index + handler behind a transport endpoint, with one poll loop.

Loop: poll the endpoint (which calls the handler) -> expire leases and reservations ->
publish a stats snapshot for the metrics thread now and then. `stop()` is safe from signal
handlers and other threads; `close()` removes the socket and the shared memory.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from kvdepot.core import INDEX_ENTRY_BYTES, SlotIndexWriter, index_entries
from kvdepot.server._collector import Collector
from kvdepot.server._disk_tier import DiskTier
from kvdepot.server._errors import PoolError, ServerArgumentError
from kvdepot.server._file_limit import cache_connections
from kvdepot.server._handler import CacheHandler
from kvdepot.server._index import ChunkIndex
from kvdepot.server._kept_pool import KeptLayout, kept_layout, open_pool, remove_abandoned_pools
from kvdepot.server._kv_publisher import KVEventPublisher
from kvdepot.server._label_key import server_labeler
from kvdepot.server._metrics import (
    MAX_SALT_LABELS,
    BadFrameCounter,
    ChunkChanges,
    Metrics,
    MetricsSnapshot,
    RequestLatency,
    SaltLookups,
)
from kvdepot.server._metrics_http import HTTPLimits, ListenerFigures
from kvdepot.server._pool import (
    SHM_DIR,
    SharedPool,
    SlotHeaders,
    default_pool_dir,
    pool_dir_free_bytes,
    remove_stale_pools,
)
from kvdepot.server._ranking import SaltRanking
from kvdepot.server._remote_tier import RemoteTier
from kvdepot.server._server_config import ServerConfig
from kvdepot.server._settings_file import SettingsFile
from kvdepot.server._slabs import SlabAllocator
from kvdepot.server._tiering import TierSet
from kvdepot.server._tiers import Tier
from kvdepot.server._units import format_size
from kvdepot.server._version import __version__
from kvdepot.transport import CappedListener, ServerEndpoint, Waker, default_address, get_logger, open_endpoint

log = get_logger(__name__)

__all__ = ["CacheServer", "ServerConfig", "default_capacity"]  # ServerConfig: re-exported from _server_config

# Longest wait in one poll: how late at most a lease or reservation expires, and how often
# the stop flag is looked at when nothing arrives.
POLL_INTERVAL = 0.05
# How often the loop publishes figures for the metrics thread (seconds).
SNAPSHOT_INTERVAL = 0.5
# With more salts than /metrics labels, the largest are worked out (O(salts)) this often (seconds).
METRIC_SALT_RANKING_S = 5.0
# The default capacity is this fraction of the memory the kernel says is available ...
DEFAULT_CAPACITY_FRACTION = 0.5
# ... and never more than this fraction of the free space of the pool's filesystem.
SHM_FRACTION = 0.9


def available_memory() -> int:
    """MemAvailable from /proc/meminfo in bytes (0 if unreadable)."""
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def default_capacity(pool_dir: Path | None = None, reclaimable: int = 0) -> int:
    """Half the available memory, bounded by 90% of the free space under /dev/shm; `reclaimable`
    bytes of the pool directory (a kept pool's file, replaced) count as free, and as available
    memory when the directory is the shared-memory one."""
    shm = int((pool_dir_free_bytes(pool_dir) + reclaimable) * SHM_FRACTION)
    in_memory = reclaimable if (pool_dir or default_pool_dir()) == default_pool_dir() == SHM_DIR else 0
    mem = int((available_memory() + in_memory) * DEFAULT_CAPACITY_FRACTION) or shm
    return min(mem, shm)


class CacheServer:
    """One kvdepot server: `CacheServer(config)` binds and maps; `serve_forever()`; `close()`."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        pool_dir = Path(config.pool_dir) if config.pool_dir else default_pool_dir()
        for path in remove_stale_pools(pool_dir):
            log.info("stale_pool_removed", path=str(path))
        for path in remove_abandoned_pools(pool_dir):
            log.info("abandoned_pool_removed", path=str(path))
        address = config.address or default_address()
        kept = kept_layout(pool_dir, address) if config.keep_pool else None
        capacity, page_size = _pool_layout(config, pool_dir, kept)
        self.allocator = SlabAllocator(capacity, page_size)  # validates capacity vs page size
        #: How /metrics, Stats to a peer that may not be the owner, logs and engines' KV events name a salt.
        self.labeler = server_labeler(config.label_key_file)
        self.metrics = Metrics(health=self.health, label=self.labeler)
        self.bad_frames = BadFrameCounter()
        self.latency = RequestLatency()
        self.salt_lookups = SaltLookups(self.labeler)
        self.chunk_changes = ChunkChanges()
        #: When the loop last turned (monotonic; None: not yet), for /healthz.
        self.heartbeat: float | None = None
        self.started_at = time.monotonic()
        self._stop = threading.Event()
        self._closed = False
        #: Why the server stopped by itself (None while serving, or after `stop()`).
        self.failure: str | None = None
        #: Full garbage collections on the loop's schedule; `kvdepot serve` takes them over.
        self.collector = Collector(time.monotonic)
        # Each part is built from the ones before it, and closed in the reverse order, whether
        # the server closes or a later part fails to build.
        with contextlib.ExitStack() as parts:
            kept_pool = open_pool(
                pool_dir,
                address,
                self.allocator.capacity,
                self.allocator.page_size,
                keep=config.keep_pool,
                fresh=config.fresh_pool,
            )
            self.pool = kept_pool.pool
            parts.callback(self.pool.close)
            # A new kept pool is kept once the server is up: a start that fails leaves nothing behind.
            self.pool.keep = not kept_pool.fresh
            # Engines on the node find committed chunks here without a round trip (`HelloReply.slot_index`).
            self.slot_index_pool, self.slot_index = self._open_slot_index(pool_dir, parts)
            headers = SlotHeaders(self.pool.buffer, slot_index=self.slot_index)
            parts.callback(headers.close)
            self.index = ChunkIndex(
                self.allocator,
                lease_ttl=config.lease_ttl,
                reservation_ttl=config.reservation_ttl,
                default_quota=config.default_quota,
                session_ttl=float("inf"),  # liveness comes from the endpoint's peer_gone
                headers=headers,
                events=True,
            )
            settings = SettingsFile(config.settings_file)
            for salt, max_bytes in settings.load_quotas().items():  # before anyone can store
                self.index.set_quota(salt, max_bytes)
            #: What the server took back from its kept pool (nothing for a pool that is not kept).
            self.adoption, self.journal = kept_pool.adopt_into(self.index, headers, time.monotonic())
            if self.journal is not None:
                parts.callback(self.journal.close)
                parts.callback(self._forget_journal_unless_kept)
            self._metric_salts = SaltRanking(self.index, METRIC_SALT_RANKING_S)
            parts.callback(self.metrics.close)
            waker = Waker()
            self.tiers = self._open_tiers(config, waker, parts)
            self.kv_events = self._open_kv_events(config, parts)
            server_id = uuid.uuid4().hex
            self.handler = CacheHandler(
                self.index,
                pool_path=str(self.pool.path),
                pool_size=self.pool.size,
                slot_index=None
                if self.slot_index_pool is None
                else (str(self.slot_index_pool.path), self.slot_index_pool.size, self.tiers is None),
                chunk_size=config.chunk_size,
                server_id=server_id,
                tiers=self.tiers,
                extra_stats=self._extra_stats,
                client_connected=self._client_connected,
                admin_allowed=not ((config.address or "").startswith("tcp://") and not config.auth_secret),
                labeler=self.labeler,
                consumers=(self.chunk_changes, *(() if self.kv_events is None else (self.kv_events,))),
                timed=self.latency.observe,
                looked_up=self.salt_lookups.add,
                settings=settings,
            )
            self.endpoint = self._open_endpoint(config, waker, server_id, parts)
            self._publish()
            self.pool.keep = self.journal is not None
            self._parts = parts.pop_all()

    def _open_slot_index(
        self, pool_dir: Path, parts: contextlib.ExitStack
    ) -> tuple[SharedPool | None, SlotIndexWriter | None]:
        """The pool's slot index (closed with `parts`), or none when its file cannot be made (the
        pool took the room): engines then ask the server for every lookup, as before."""
        try:
            pool = SharedPool.create(INDEX_ENTRY_BYTES * index_entries(self.pool.size), pool_dir, suffix=".index")
        except PoolError as exc:
            log.warning("slot_index_unavailable", reason=exc.message, effect="every lookup waits for the server")
            return None, None
        parts.callback(pool.close)
        writer = SlotIndexWriter(pool.buffer)
        parts.callback(writer.close)
        return pool, writer

    def _forget_journal_unless_kept(self) -> None:
        """A new kept pool whose server never came up is not kept: its journal goes with it."""
        if self.journal is not None and not self.pool.keep:
            self.journal.path.unlink(missing_ok=True)

    def _open_kv_events(self, config: ServerConfig, parts: contextlib.ExitStack) -> KVEventPublisher | None:
        """The RAM tier's KV-event publisher that `config` asks for (closed with `parts`), or None."""
        if config.kv_events is None:
            return None
        kv_events = KVEventPublisher(
            config.kv_events,
            replay_endpoint=config.kv_events_replay,
            topic=config.kv_events_topic,
            max_connections=config.kv_events_max_connections,
            subscriber_bytes=config.kv_events_subscriber_bytes,
            subscriber_send_bytes=config.kv_events_subscriber_send_bytes,
            replay_bytes=config.kv_events_replay_bytes,
            replay_page_bytes=config.kv_events_replay_page_bytes,
        )
        parts.callback(kv_events.close)
        self.metrics.registry.register(kv_events.collector())
        return kv_events

    def _open_endpoint(
        self, config: ServerConfig, waker: Waker, server_id: str, parts: contextlib.ExitStack
    ) -> ServerEndpoint:
        """The cache endpoint (closed with `parts`), then the metrics endpoint beside it, if asked."""
        kwargs: dict[str, Any] = {"auth_secret": config.auth_secret, "limits": config.peer_limits}
        if config.peer_timeout is not None:
            kwargs["peer_timeout"] = config.peer_timeout
        metrics_limits = config.metrics_limits
        if config.metrics_port is not None:  # clamped once: the cache's cap leaves room for it
            metrics_limits = metrics_limits.within_file_limit()
        if (config.address or "").startswith("tcp://"):
            kwargs["max_connections"] = _cache_cap(config, metrics_limits)
        endpoint = open_endpoint(
            config.address,
            self.handler,
            waker=waker,
            server_id=server_id,
            on_bad_frame=lambda bad: self.bad_frames.add(bad.peer),
            **kwargs,
        )
        parts.callback(endpoint.close)
        if (listener := endpoint.listener) is not None:
            self.metrics.add_listener("cache", lambda: _figures(listener))
        parts.callback(self.collector.give_back)
        if config.metrics_port is not None:
            try:
                self.metrics.serve(config.metrics_port, config.metrics_host, metrics_limits)
            except ServerArgumentError as exc:
                if config.metrics_required:
                    raise
                log.warning("metrics_unavailable", reason=exc.message)
        return endpoint

    @property
    def address(self) -> str:
        return str(self.endpoint.address)

    @property
    def metrics_url(self) -> str | None:
        return self.metrics.url

    def summary(self) -> dict[str, Any]:
        """What the start banner shows."""
        return {
            "address": self.address,
            "capacity": self.allocator.capacity,
            "page_size": self.allocator.page_size,
            "pages": self.allocator.num_pages,
            "pool": str(self.pool.path),
            "metrics": self.metrics_url,
            "kv_events": self.kv_events.endpoint if self.kv_events is not None else None,
            "chunk_size": self.config.chunk_size,
            "server_id": self.endpoint.server_id,
            "version": __version__,
            "pid": os.getpid(),
        }

    # -- loop -----------------------------------------------------------------------------

    def serve_forever(self) -> None:
        """Serve until `stop()`; then close everything."""
        try:
            last_snapshot = 0.0
            while not self._stop.is_set():
                self.endpoint.poll_once(POLL_INTERVAL)
                if self.tiers is not None:
                    for answer in self.tiers.run():
                        self.endpoint.send_deferred(answer.deferred, self.handler.answer(answer))
                self.handler.flush_events()
                if not self.pool.intact():
                    self.failure = f"the pool file {self.pool.path} was truncated under the server"
                    log.error("pool_truncated", path=str(self.pool.path), reason="stopping: its slots are gone")
                    break
                now = self.heartbeat = time.monotonic()
                gone = self.index.expire(now)
                if gone.leases or gone.reservations:
                    log.info("expired", leases=gone.leases, reservations=gone.reservations, chunks=gone.chunks)
                if now - last_snapshot >= SNAPSHOT_INTERVAL:
                    self._publish()
                    last_snapshot = now
                self.collector.run(now)
        finally:
            self.close()

    def health(self) -> str | None:
        """Why the server is not serving now, or None while it is: its loop turned in the last
        `config.health_stall` seconds and its pool is mapped and whole (any thread: /healthz)."""
        if self.failure is not None:
            return self.failure
        if self._stop.is_set():
            return "the server is stopping"
        try:
            intact = self.pool.intact()
        except OSError:  # unmapped by close() meanwhile
            intact = False
        if not intact:
            return f"the pool {self.pool.path} is unmapped or truncated"
        if self.heartbeat is None:
            return "the loop has not started"
        if (idle := time.monotonic() - self.heartbeat) > self.config.health_stall:
            return f"the loop has not turned for {idle:.1f} s"
        return None

    def stop(self) -> None:
        """Ask `serve_forever` to return soon; safe from signal handlers and other threads."""
        self._stop.set()
        self.endpoint.stop()

    def close(self) -> None:
        """Stop serving, remove the socket and the pool file (a kept pool's stays). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._parts.close()
        log.info("server_stopped", address=self.address, pool=str(self.pool.path))

    def __enter__(self) -> CacheServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- figures --------------------------------------------------------------------------

    def _extra_stats(self) -> dict[str, str | int | float | bool | None]:
        extra: dict[str, str | int | float | bool | None] = {
            "pool_path": str(self.pool.path),
            "slot_index_path": None if self.slot_index_pool is None else str(self.slot_index_pool.path),
            # chunks whose group was full: lookups ask the server
            "slot_index_dropped": None if self.slot_index is None else self.slot_index.dropped,
            "server_version": __version__,
            "uptime_s": round(time.monotonic() - self.started_at, 3),
        }
        for name, value in self.endpoint.counters.items():
            extra[f"transport_{name}"] = value
        if (listener := self.endpoint.listener) is not None:
            extra["cache_connections"] = listener.connections
            extra["cache_max_connections"] = listener.cap
            for reason, count in listener.refused.items():
                extra[f"cache_refused_{reason}"] = count
        if self.tiers is not None:
            extra.update(self.tiers.stats())
        if self.kv_events is not None:
            extra.update(self.kv_events.figures())
        extra["changes_next"] = self.handler.changes.next
        extra.update(self._pool_figures())
        return extra

    def _pool_figures(self) -> dict[str, str | int | float | bool | None]:
        """The kept pool's: whether it is kept, what the start took back, what the journal missed."""
        adoption = self.adoption
        figures: dict[str, str | int | float | bool | None] = {
            "pool_kept": self.journal is not None,
            "pool_adopted_chunks": adoption.chunks,
            "pool_adopted_bytes": adoption.bytes,
            "pool_adopted_pending": adoption.pending,
            "pool_adopt_seconds": round(adoption.seconds, 3),
            "pool_fresh_reason": adoption.fresh or None,
        }
        for why, count in adoption.dropped.items():
            figures[f"pool_dropped_{why}"] = count
        if self.journal is not None:
            figures["pool_journal_written"] = self.journal.written
            figures["pool_journal_behind"] = self.journal.behind
            figures["pool_journal_dropped"] = self.journal.dropped
            figures["pool_journal_failed"] = self.journal.failed
        return figures

    def _open_tiers(self, config: ServerConfig, waker: Waker, parts: contextlib.ExitStack) -> TierSet | None:
        """The tiers below RAM that `config` asks for (disk first, then remote), or None; each is
        closed with `parts` (the tier set closes them all once it is built)."""
        tiers: list[Tier] = []
        with contextlib.ExitStack() as opened:
            if config.disk_dir is not None:
                if config.disk_capacity is None:  # half its free space (the tier counts its own files as free)
                    config.disk_dir.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                disk = DiskTier(config.disk_dir, config.disk_capacity, quota_of=self.index.quota_of)
                tiers.append(opened.enter_context(disk))
            if config.remote_url is not None:
                remote = RemoteTier(
                    config.remote_url,
                    password_file=config.remote_password_file,
                    password_env=config.remote_password_env,
                    prefix=config.remote_prefix,
                    ttl=config.remote_ttl,
                    ssl_ca_certs=str(config.remote_ca_file) if config.remote_ca_file is not None else None,
                    quota_of=self.index.quota_of,
                )
                tiers.append(opened.enter_context(remote))
            if not tiers:
                return None
            tier_set = TierSet(
                tiers,
                self.index,
                self.pool.buffer,
                wake=waker.wake,
                read_deadline=config.tier_deadline,
                read_deadline_per_chunk=config.tier_deadline_per_chunk,
                label=self.labeler,
            )
            opened.pop_all()  # the tier set closes them now
        parts.callback(tier_set.close)
        return tier_set

    def _client_connected(self, client: str) -> bool:
        return any(peer.client_id == client for peer in self.endpoint.peers)

    def _publish(self) -> None:
        tiers = {k: v for k, v in self.tiers.stats().items() if k.startswith("tier:")} if self.tiers else {}
        listed = self._metric_salts.listed(MAX_SALT_LABELS, time.monotonic())
        snapshot = MetricsSnapshot(
            self.index.stats(listed),
            self.endpoint.counters,
            self.bad_frames.snapshot(),
            tiers,
            self.latency.snapshot(),
            self.salt_lookups.snapshot(),
            self.chunk_changes.snapshot(),
        )
        self.metrics.publish(snapshot)


def _pool_layout(config: ServerConfig, pool_dir: Path, kept: KeptLayout | None) -> tuple[int, int | None]:
    """The pool's capacity and page size (None: the allocator's default). A kept pool's file is
    this server's to map again (or to replace): its bytes count as free, and a start that names
    no capacity or page size takes the ones it was made with."""
    reclaimable = kept.file_bytes if kept is not None else 0
    if config.capacity is not None:
        capacity = config.capacity
    elif kept is not None and not config.fresh_pool:
        capacity = kept.capacity
    else:
        capacity = default_capacity(pool_dir, reclaimable)
    page_size = config.page_size
    if page_size is None and kept is not None and not config.fresh_pool and capacity == kept.capacity:
        page_size = kept.page_size
    free = pool_dir_free_bytes(pool_dir) + reclaimable
    if capacity > free:  # before anything is built: the allocator's tables grow with capacity
        raise ServerArgumentError(
            f"--capacity {format_size(capacity)} is more than the {format_size(free)} free in {pool_dir}; "
            "lower --capacity (or make the shared-memory filesystem larger)",
            capacity=capacity,
            free=free,
        )
    return capacity, page_size


def _cache_cap(config: ServerConfig, metrics_limits: HTTPLimits) -> int:
    """The tcp cache endpoint's connection cap: `config.max_connections`, within what the file limit
    leaves after the metrics endpoint's and the KV-events tcp ports' caps."""
    reserved = metrics_limits.max_connections if config.metrics_port is not None else 0
    if config.kv_events is not None:
        ports = [config.kv_events, config.kv_events_replay]
        reserved += config.kv_events_max_connections * sum(1 for port in ports if (port or "").startswith("tcp://"))
    return cache_connections(config.max_connections, reserved)


def _figures(listener: CappedListener) -> ListenerFigures:
    """The cache listener's figures for /metrics (``full``: times it reached its cap)."""
    return ListenerFigures(listener.connections, listener.cap, listener.refused)
