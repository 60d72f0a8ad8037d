"""Prometheus metrics: the same figures as `kvdepot stats`, read from a snapshot at scrape time.

The server loop publishes an immutable `MetricsSnapshot` now and then; the HTTP thread of
prometheus-client only reads the latest one, so a scrape never walks the index while the
loop changes it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import attrs
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvdepot.core import salt_label
from kvdepot.server._errors import ServerArgumentError
from kvdepot.server._results import IndexStats

# Peers named one by one in the bad-frames metric; the rest add up under "other", so that a
# peer inventing new identities cannot grow the metric without bound.
MAX_PEER_LABELS = 64


# cache_salt series in /metrics: the salts holding the most bytes, the rest summed as "other".
# Labels are digests: a salt is a tenant's secret, and /metrics is readable by every local user.
MAX_SALT_LABELS = 64


def _largest_salts(stats: IndexStats) -> dict[str, tuple[int, int]]:
    """(bytes, chunks) per label for the `MAX_SALT_LABELS` salts holding the most bytes, plus "other"."""
    top = stats.largest_salts(MAX_SALT_LABELS)
    out = {salt_label(salt): (stats.salt_bytes[salt], stats.salt_chunks.get(salt, 0)) for salt in top}
    if stats.salt_count > len(top):  # every byte and chunk belongs to a salt: the rest is the others'
        listed_bytes = sum(stats.salt_bytes[salt] for salt in top)
        listed_chunks = sum(stats.salt_chunks.get(salt, 0) for salt in top)
        out["other"] = (stats.used_bytes - listed_bytes, stats.chunks - listed_chunks)
    return out


@attrs.frozen
class MetricsSnapshot:
    stats: IndexStats
    transport: dict[str, int]
    bad_frames_by_peer: dict[str, int]
    tiers: dict[str, str | int | float | bool | None] = attrs.field(factory=dict)  # `tier:KIND:FIGURE`


class BadFrameCounter:
    """Bad frames per peer label, bounded to `MAX_PEER_LABELS` labels plus "other"."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}

    def add(self, peer: str) -> None:
        if peer not in self._counts and len(self._counts) >= MAX_PEER_LABELS:
            peer = "other"
        self._counts[peer] = self._counts.get(peer, 0) + 1

    def snapshot(self) -> dict[str, int]:
        return dict(self._counts)


class _Collector:
    """A prometheus-client collector (duck-typed: `collect()`), reading the latest snapshot."""

    def __init__(self) -> None:
        self.snapshot: MetricsSnapshot | None = None

    def collect(self) -> Iterator[Any]:
        snap = self.snapshot
        if snap is None:
            return
        s = snap.stats
        for name, value, doc in (
            ("capacity_bytes", s.capacity_bytes, "Bytes of the shared pool usable for chunks."),
            ("used_bytes", s.used_bytes, "Bytes of the pool held by chunks (committed or pending)."),
            ("page_size_bytes", s.page_size, "Size of one allocation page of the pool."),
            ("pages_free", s.pages_free, "Pages of the pool that hold no chunk."),
            ("chunks", s.chunks, "Committed chunks."),
            ("pending_chunks", s.pending_chunks, "Chunks reserved by clients, not yet committed."),
            (
                "quarantined_chunks",
                s.quarantined_chunks,
                "Slots of reservations that expired or whose client left, held for one more reservation TTL.",
            ),
            ("leased_chunks", s.leased_chunks, "Chunks pinned by at least one lease."),
            ("leases", s.leases, "Live leases."),
            ("reservations", s.reservations, "Live reservations."),
            ("clients", s.clients, "Clients with a session (the server's own ids apart)."),
        ):
            yield GaugeMetricFamily(f"kvdepot_{name}", doc, value=value)
        for name, value, doc in (
            ("hits", s.hits, "Chunk keys found by lookups."),
            ("misses", s.misses, "Chunk keys looked up and not found."),
            ("stored_bytes", s.bytes_stored, "Bytes of chunks committed."),
            ("loaded_bytes", s.bytes_loaded, "Bytes of chunks handed out by lookups."),
            ("evictions", s.evictions, "Chunks evicted to make room."),
            ("expired_leases", s.expired_leases, "Leases that ended by expiry, not release."),
            ("expired_reservations", s.expired_reservations, "Reservations that expired uncommitted."),
            ("full_reserves", s.full_reserves, "Reserves that could not place every key."),
        ):
            yield CounterMetricFamily(f"kvdepot_{name}", doc, value=value)
        doc = " (label: salt_label(cache_salt); the largest 64, the rest as 'other')"
        salt_bytes = GaugeMetricFamily("kvdepot_salt_used_bytes", "Bytes held per cache_salt" + doc, labels=["salt"])
        salt_chunks = GaugeMetricFamily("kvdepot_salt_chunks", "Committed chunks per cache_salt" + doc, labels=["salt"])
        for label, (used, chunks) in _largest_salts(s).items():
            salt_bytes.add_metric([label], used)
            salt_chunks.add_metric([label], chunks)
        yield salt_bytes
        yield salt_chunks
        quota = GaugeMetricFamily("kvdepot_salt_quota_bytes", "Quota per cache_salt" + doc, labels=["salt"])
        for salt, limit in sorted(s.quotas.items(), key=lambda item: -item[1])[:MAX_SALT_LABELS]:
            quota.add_metric([salt_label(salt)], limit)
        yield quota
        transport = CounterMetricFamily(
            "kvdepot_transport_events", "Transport counters (requests, errors, bad frames, ...).", labels=["event"]
        )
        for event, value in snap.transport.items():
            transport.add_metric([event], value)
        yield transport
        bad = CounterMetricFamily("kvdepot_bad_frames", "Malformed or oversized frames per peer.", labels=["peer"])
        for peer, value in snap.bad_frames_by_peer.items():
            bad.add_metric([peer], value)
        yield bad
        tiers = GaugeMetricFamily(
            "kvdepot_tier",
            "Figures of each tier below RAM (hits, misses, bytes_read, bytes_written, write_queue, errors, "
            "corrupt, late, used_bytes, objects, up, ...).",
            labels=["tier", "figure"],
        )
        for name, figure_value in snap.tiers.items():
            _, kind, figure = name.split(":", 2)
            if figure == "state":
                tiers.add_metric([kind, "up"], float(figure_value == "up"))
            elif isinstance(figure_value, int | float) and not isinstance(figure_value, bool):
                tiers.add_metric([kind, figure], figure_value)
        yield tiers


class Metrics:
    """The server's Prometheus registry and, when started, its HTTP endpoint on 127.0.0.1."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._collector = _Collector()
        self.registry.register(self._collector)
        self._http: Any = None
        self._thread: threading.Thread | None = None
        self.url: str | None = None

    def publish(self, snapshot: MetricsSnapshot) -> None:
        self._collector.snapshot = snapshot

    def serve(self, port: int, host: str = "127.0.0.1") -> str:
        """Start the HTTP endpoint; port 0 picks a free one. Returns the metrics URL."""
        try:
            self._http, self._thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise ServerArgumentError(
                f"cannot serve metrics on {host}:{port} ({exc.strerror}); choose another --metrics-port "
                "or pass --no-metrics",
                port=port,
            ) from exc
        self.url = f"http://{host}:{self._http.server_port}/metrics"
        return self.url

    def close(self) -> None:
        if self._http is not None:
            with contextlib.suppress(Exception):
                self._http.shutdown()
                self._http.server_close()
            self._http = None
