"""Prometheus metrics: the same figures as `kvdepot stats`, read from a snapshot at scrape time.

The server loop publishes an immutable `MetricsSnapshot` now and then; the HTTP thread only
reads the latest one, so a scrape never walks the index while the loop changes it. The same
HTTP server answers `/healthz`: 200 while the server says it is healthy, 503 and why not.
"""

from __future__ import annotations

import bisect
import heapq
import re
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from kvdepot.server._errors import ServerArgumentError
from kvdepot.server._events import RAM, Cleared, Committed, IndexEvent
from kvdepot.server._label_key import random_labeler
from kvdepot.server._metrics_http import HTTPEndpoint, HTTPLimits, ListenerFigures
from kvdepot.server._results import IndexStats, LookupOutcome
from kvdepot.transport import RESERVED_CLIENT_PREFIX, get_logger

log = get_logger(__name__)

# Peers named one by one in the bad-frames metric; the rest add up under "other", so that a
# peer inventing new identities cannot grow the metric without bound.
MAX_PEER_LABELS = 64


# cache_salt series in /metrics: the salts holding the most bytes, the rest summed as "other".
# Labels are keyed digests (the server's `SaltLabeler`): a salt is a tenant's secret, and /metrics
# is readable by every local user.
MAX_SALT_LABELS = 64
# Salts whose lookups are counted one by one: the first this many looked up since the start (a
# client inventing salts cannot grow the server's memory); /metrics names the MAX_SALT_LABELS of
# them with the most keys looked up. Lookups of later salts count in the totals only.
MAX_TRACKED_SALTS = 1024
# Upper bounds (seconds) of the request-latency buckets: the loop answers most requests in tens
# of microseconds; a lookup of thousands of keys takes a millisecond or so; past 10 ms every
# client of the server waits behind it.
LATENCY_BUCKETS = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3)
# Requests whose latency series exist from the start, at zero: the dashboard's latency panels.
TIMED_FROM_START = ("Lookup", "Reserve", "Commit")


def _largest_salts(stats: IndexStats, label: Callable[[str], str]) -> dict[str, tuple[int, int]]:
    """(bytes, chunks) per label for the `MAX_SALT_LABELS` salts holding the most bytes, plus "other"."""
    top = stats.largest_salts(MAX_SALT_LABELS)
    out = {label(salt): (stats.salt_bytes[salt], stats.salt_chunks.get(salt, 0)) for salt in top}
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
    #: request label -> (count per bucket of LATENCY_BUCKETS and +Inf, not cumulative; sum of seconds)
    latency: dict[str, tuple[tuple[int, ...], float]] = attrs.field(factory=dict)
    #: salt label -> (hits, misses)
    salt_lookups: dict[str, tuple[int, int]] = attrs.field(factory=dict)
    #: (change, tier) -> (chunks, bytes), from the index's event stream
    chunk_changes: dict[tuple[str, str], tuple[int, int]] = attrs.field(factory=dict)


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


class RequestLatency:
    """Seconds the loop spent on each request, per request type, as histogram buckets (loop thread)."""

    def __init__(self, kinds: Sequence[str] = TIMED_FROM_START) -> None:
        self._counts: dict[str, list[int]] = {}
        self._sums: dict[str, float] = {}
        for kind in kinds:
            self._start(kind)

    def _start(self, kind: str) -> list[int]:
        counts = self._counts[kind] = [0] * (len(LATENCY_BUCKETS) + 1)
        self._sums[kind] = 0.0
        return counts

    def observe(self, kind: str, seconds: float) -> None:
        """One request of type `kind` (its class name: the protocol's few) took `seconds`."""
        counts = self._counts.get(kind) or self._start(kind)
        counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self._sums[kind] += seconds

    def snapshot(self) -> dict[str, tuple[tuple[int, ...], float]]:
        return {_snake(kind): (tuple(counts), self._sums[kind]) for kind, counts in self._counts.items()}


def _snake(name: str) -> str:
    """`EndSession` -> `end_session`."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


class SaltLookups:
    """Keys found and not found by lookups, per salt, for at most `MAX_TRACKED_SALTS` salts (loop thread),
    named by ``label`` (the server's labeler; default: a key of its own)."""

    def __init__(self, label: Callable[[str], str] | None = None) -> None:
        self._counts: dict[str, list[int]] = {}  # salt -> [hits, misses]
        self._labels: dict[str, str] = {}
        self._label = label if label is not None else random_labeler()

    def add(self, items: Sequence[tuple[str, Sequence[bytes]]], outcomes: Sequence[LookupOutcome]) -> None:
        """Count a lookup's answer: per item, its hits and the keys past them."""
        for (salt, keys), outcome in zip(items, outcomes, strict=True):
            counts = self._counts.get(salt)
            if counts is None:
                if len(self._counts) >= MAX_TRACKED_SALTS:
                    continue
                counts = self._counts[salt] = [0, 0]
                self._labels[salt] = self._label(salt)
            counts[0] += outcome.num_hits
            counts[1] += len(keys) - outcome.num_hits

    def snapshot(self) -> dict[str, tuple[int, int]]:
        """(hits, misses) per label of the `MAX_SALT_LABELS` salts with the most keys looked up."""
        salts: Iterator[str] | list[str] = iter(self._counts)
        if len(self._counts) > MAX_SALT_LABELS:
            salts = heapq.nlargest(MAX_SALT_LABELS, self._counts, key=lambda salt: sum(self._counts[salt]))
        return {self._labels[salt]: (self._counts[salt][0], self._counts[salt][1]) for salt in salts}


#: What `ChunkChanges` calls each event: a commit by a client, a chunk the server's own session
#: read back from a tier below RAM, an eviction, a clear.
CHANGES = ("committed", "read_back", "evicted", "cleared")


class ChunkChanges:
    """Chunks and bytes per change and tier, counted from the index's event stream (loop thread):
    one consumer of `take_events()` beside the tiers and the KV event publisher."""

    def __init__(self) -> None:
        self._counts: dict[tuple[str, str], list[int]] = {(change, RAM): [0, 0] for change in CHANGES}

    def take(self, events: Sequence[IndexEvent]) -> None:
        for event in events:
            if isinstance(event, Committed):
                change = "read_back" if event.client.startswith(RESERVED_CLIENT_PREFIX) else "committed"
            else:
                change = "cleared" if isinstance(event, Cleared) else "evicted"
            counts = self._counts.setdefault((change, event.tier), [0, 0])
            counts[0] += 1
            counts[1] += event.length

    def snapshot(self) -> dict[tuple[str, str], tuple[int, int]]:
        return {key: (chunks, size) for key, (chunks, size) in self._counts.items()}


class _Collector:
    """A prometheus-client collector (duck-typed: `collect()`), reading the latest snapshot."""

    def __init__(self, label: Callable[[str], str]) -> None:
        self.label = label
        self.snapshot: MetricsSnapshot | None = None
        #: listener name -> its figures now (read at scrape time, from the HTTP thread)
        self.listeners: dict[str, Callable[[], ListenerFigures]] = {}

    def collect(self) -> Iterator[Any]:
        yield from self._listeners()
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
            ("pins_refused", s.pins_refused, "Commits whose pin (pin_s) was refused: committed unpinned."),
            ("pins_refused_share", s.pins_refused_share, "Pins refused: their salt held its share of the pins."),
            ("pins_ended_early", s.pins_ended_early, "Pins of a salt past its share ended for another salt."),
        ):
            yield CounterMetricFamily(f"kvdepot_{name}", doc, value=value)
        doc = " (label: the server's keyed label of cache_salt; the largest 64, the rest as 'other')"
        salt_bytes = GaugeMetricFamily("kvdepot_salt_used_bytes", "Bytes held per cache_salt" + doc, labels=["salt"])
        salt_chunks = GaugeMetricFamily("kvdepot_salt_chunks", "Committed chunks per cache_salt" + doc, labels=["salt"])
        for label, (used, chunks) in _largest_salts(s, self.label).items():
            salt_bytes.add_metric([label], used)
            salt_chunks.add_metric([label], chunks)
        yield salt_bytes
        yield salt_chunks
        quota = GaugeMetricFamily("kvdepot_salt_quota_bytes", "Quota per cache_salt" + doc, labels=["salt"])
        for salt, limit in sorted(s.quotas.items(), key=lambda item: -item[1])[:MAX_SALT_LABELS]:
            quota.add_metric([self.label(salt)], limit)
        yield quota
        doc = " (label: the server's keyed label of cache_salt; the 64 salts with the most keys looked up)"
        salt_hits = CounterMetricFamily(
            "kvdepot_salt_hits", "Chunk keys found by lookups per cache_salt" + doc, labels=["salt"]
        )
        salt_misses = CounterMetricFamily(
            "kvdepot_salt_misses", "Chunk keys looked up and not found per cache_salt" + doc, labels=["salt"]
        )
        for label, (hits, misses) in snap.salt_lookups.items():
            salt_hits.add_metric([label], hits)
            salt_misses.add_metric([label], misses)
        yield salt_hits
        yield salt_misses
        changes = CounterMetricFamily(
            "kvdepot_chunk_changes",
            "Chunks that changed, by change (committed by a client, read_back from a tier below RAM, "
            "evicted, cleared) and tier.",
            labels=["change", "tier"],
        )
        change_bytes = CounterMetricFamily(
            "kvdepot_chunk_change_bytes",
            "Payload bytes of the chunks in kvdepot_chunk_changes.",
            labels=["change", "tier"],
        )
        for (change, tier), (chunks, size) in snap.chunk_changes.items():
            changes.add_metric([change, tier], chunks)
            change_bytes.add_metric([change, tier], size)
        yield changes
        yield change_bytes
        latency = HistogramMetricFamily(
            "kvdepot_request_duration_seconds",
            "Seconds the server's loop spent on a request, by request type: from the handler's start to its "
            "reply (a lookup's wait for the tiers below RAM is not in it).",
            labels=["request"],
        )
        for request, (counts, seconds) in snap.latency.items():
            cumulative, buckets = 0, []
            for bound, count in zip((*LATENCY_BUCKETS, float("inf")), counts, strict=True):
                cumulative += count
                buckets.append((floatToGoString(bound), cumulative))
            latency.add_metric([request], buckets, seconds)
        yield latency
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

    def _listeners(self) -> Iterator[Any]:
        if not self.listeners:
            return
        labels = ["listener"]
        connections = GaugeMetricFamily("kvdepot_listener_connections", "Open connections per listener.", labels=labels)
        cap = GaugeMetricFamily("kvdepot_listener_max_connections", "Connection cap per listener.", labels=labels)
        refused = CounterMetricFamily(
            "kvdepot_listener_refused",
            "Connections a listener dropped, by reason (full: at its cap; displaced: an unfinished request "
            "closed for a newer connection; deadline; header_bytes; body; files: no file descriptor left; "
            "write_timeout: an answer not read). The KV-events listeners (kv_events_pub, kv_events_replay) "
            "refuse by a socket filter and cannot see the connections it turns away: their full is the times "
            "the listener reached its cap and began refusing, not connections refused.",
            labels=["listener", "reason"],
        )
        for name, figures_of in self.listeners.items():
            figures = figures_of()
            connections.add_metric([name], figures.connections)
            cap.add_metric([name], figures.max_connections)
            for reason, count in figures.refused.items():
                refused.add_metric([name, reason], count)
        yield connections
        yield cap
        yield refused


class _Registry(CollectorRegistry):  # type: ignore[misc]  # prometheus-client is untyped
    """The server's registry: a collector registered with listeners of its own (``listeners``:
    name -> figures, as the KV-events publisher's) has them shown with the server's others, as
    ``kvdepot_listener_*{listener=name}``."""

    def __init__(self, collector: _Collector) -> None:
        super().__init__(auto_describe=False)
        self._listeners = collector.listeners

    def register(self, collector: Any) -> None:
        super().register(collector)
        listeners: Mapping[str, Callable[[], ListenerFigures]] = getattr(collector, "listeners", {})
        if listeners is not self._listeners:
            self._listeners.update(listeners)


def _healthy() -> str | None:
    return None


class Metrics:
    """The server's Prometheus registry and, when started, its HTTP endpoint on 127.0.0.1.

    ``health`` says why the server is not healthy (None: it is); `/healthz` asks it on every
    request, from the HTTP thread. ``label`` names salts (the server's labeler; default: a key of
    its own)."""

    def __init__(self, health: Callable[[], str | None] = _healthy, label: Callable[[str], str] | None = None) -> None:
        self._collector = _Collector(label if label is not None else random_labeler())
        self.registry = _Registry(self._collector)
        self.registry.register(self._collector)
        self.health = health
        self._http: HTTPEndpoint | None = None
        self._thread: threading.Thread | None = None
        self.url: str | None = None

    def publish(self, snapshot: MetricsSnapshot) -> None:
        self._collector.snapshot = snapshot

    def add_listener(self, name: str, figures: Callable[[], ListenerFigures]) -> None:
        """Show a listener's connections and drops in /metrics (`kvdepot_listener_*{listener=name}`)."""
        self._collector.listeners[name] = figures

    def serve(self, port: int, host: str = "127.0.0.1", limits: HTTPLimits | None = None) -> str:
        """Start the HTTP endpoint; port 0 picks a free one. Returns the metrics URL."""
        limits = (limits or HTTPLimits()).within_file_limit()
        try:
            http = HTTPEndpoint((host, port), self.registry, self.health, limits)
        except OSError as exc:
            raise ServerArgumentError(
                f"cannot serve metrics on {host}:{port} ({exc.strerror}); choose another --metrics-port "
                "or pass --no-metrics",
                port=port,
            ) from exc
        self._http = http
        self.add_listener("metrics", http.figures)
        self._thread = threading.Thread(target=http.serve_forever, name="kvdepot-metrics", daemon=True)
        self._thread.start()
        netloc = f"[{host}]" if ":" in host else host
        self.url = f"http://{netloc}:{http.server_port}/metrics"
        return self.url

    def close(self) -> None:
        http, thread, self._http, self._thread = self._http, self._thread, None, None
        if http is not None:
            http.shutdown()
        if thread is not None:
            thread.join()
