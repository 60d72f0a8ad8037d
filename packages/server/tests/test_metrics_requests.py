"""Request latency histograms and per-salt lookups in /metrics: bounded, cumulative, and fed by the loop."""

from __future__ import annotations

import time
import urllib.request

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvdepot.core import SaltLabeler
from kvdepot.server import ChunkIndex, SlabAllocator
from kvdepot.server._events import RAM, Cleared, Committed, Evicted
from kvdepot.server._metrics import (
    CHANGES,
    LATENCY_BUCKETS,
    MAX_SALT_LABELS,
    MAX_TRACKED_SALTS,
    ChunkChanges,
    Metrics,
    MetricsSnapshot,
    RequestLatency,
    SaltLookups,
)
from kvdepot.server._results import LookupOutcome
from kvdepot.server._tiering import TIER_CLIENT
from kvdepot.transport import CacheClient

T = 5.0
CHUNK = 960
LABEL = SaltLabeler(bytes(range(32)))  # a server's labeler


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _scrape(latency: RequestLatency | None = None, lookups: SaltLookups | None = None) -> dict:
    metrics = Metrics(label=LABEL)
    index = ChunkIndex(SlabAllocator(8 * 4096, 4096))
    latency_figures = latency.snapshot() if latency else {}
    lookup_figures = lookups.snapshot() if lookups else {}
    metrics.publish(MetricsSnapshot(index.stats(), {}, {}, {}, latency_figures, lookup_figures))
    return _samples(generate_latest(metrics.registry).decode())


def test_latency_histograms_are_cumulative_per_request_type():
    """Each request type is a histogram: cumulative buckets up to +Inf, a count and a sum; lookups,
    reserves and commits are there from the start, at zero."""
    latency = RequestLatency()
    latency.observe("Lookup", 30e-6)
    latency.observe("Lookup", 2e-3)
    latency.observe("Lookup", 5.0)
    latency.observe("EndSession", 1e-6)
    samples = _scrape(latency)
    bucket = "kvdepot_request_duration_seconds_bucket"
    assert samples[(bucket, (("le", "2.5e-05"), ("request", "lookup")))] == 0
    assert samples[(bucket, (("le", "5e-05"), ("request", "lookup")))] == 1
    assert samples[(bucket, (("le", "0.0025"), ("request", "lookup")))] == 2
    assert samples[(bucket, (("le", str(LATENCY_BUCKETS[-1])), ("request", "lookup")))] == 2
    assert samples[(bucket, (("le", "+Inf"), ("request", "lookup")))] == 3
    assert samples[("kvdepot_request_duration_seconds_count", (("request", "lookup"),))] == 3
    # the sum of the three durations fed in above (given values, not a clock reading)
    fed = 30e-6 + 2e-3 + 5.0
    assert samples[("kvdepot_request_duration_seconds_sum", (("request", "lookup"),))] == pytest.approx(fed)
    assert samples[("kvdepot_request_duration_seconds_count", (("request", "end_session"),))] == 1
    for request in ("reserve", "commit"):
        assert samples[(bucket, (("le", "+Inf"), ("request", request)))] == 0


def test_salt_lookups_are_labelled_by_digest_and_bounded():
    """Per-salt hits and misses carry the salt's keyed digest; past MAX_TRACKED_SALTS salts no more are
    counted one by one, and /metrics names the MAX_SALT_LABELS with the most keys looked up."""
    lookups = SaltLookups(LABEL)
    keys = [b"k" * 32] * 4
    lookups.add([("busy", keys)] * 3, [LookupOutcome(3, 1, [])] * 3)
    for i in range(MAX_TRACKED_SALTS + 10):
        lookups.add([(f"tenant-secret-{i}", keys[:1])], [LookupOutcome(0, 0, [])])
    figures = lookups.snapshot()
    assert len(figures) == MAX_SALT_LABELS
    assert figures[LABEL("busy")] == (9, 3)
    samples = _scrape(lookups=lookups)
    assert samples[("kvdepot_salt_hits_total", (("salt", LABEL("busy")),))] == 9
    assert samples[("kvdepot_salt_misses_total", (("salt", LABEL("busy")),))] == 3
    assert not [key for key in samples if "tenant-secret" in str(key)]
    lookups.add([(f"tenant-secret-{MAX_TRACKED_SALTS + 5}", keys * 100)], [LookupOutcome(0, 0, [])])
    assert LABEL(f"tenant-secret-{MAX_TRACKED_SALTS + 5}") not in lookups.snapshot()


def test_a_server_counts_its_requests_and_each_salts_lookups(make_server):
    """Requests to a real server show up in its /metrics: a lookup's hits and misses under its salt,
    and one latency observation per request of each type."""
    server = make_server(metrics_port=0)
    with CacheClient(server.address, timeout=T) as client:
        client.register("layout", 256, CHUNK).result(T)
        res = client.reserve("tenant", [b"a" * 32, b"b" * 32], CHUNK).result(T)
        client.commit(res.reservation_id).result(T)
        (hit,) = client.lookup([("tenant", [b"a" * 32, b"b" * 32, b"c" * 32])]).result(T).results
        assert hit.num_hits == 2
    label = (("salt", server.labeler("tenant")),)
    samples = _scrape_when(server, lambda s: ("kvdepot_salt_hits_total", label) in s)
    assert samples[("kvdepot_salt_misses_total", label)] == 1
    assert samples[("kvdepot_salt_hits_total", label)] == 2
    for request in ("register", "reserve", "commit", "lookup"):
        assert samples[("kvdepot_request_duration_seconds_count", (("request", request),))] == 1, request


def _scrape_when(server, ready) -> dict:
    """The server's /metrics once `ready(samples)` holds (the loop publishes now and then)."""
    deadline = time.monotonic() + 10
    while True:
        assert server.metrics_url is not None
        with urllib.request.urlopen(server.metrics_url, timeout=T) as resp:
            samples = _samples(resp.read().decode())
        if ready(samples):
            return samples
        assert time.monotonic() < deadline, "the server never published the figures awaited"
        time.sleep(0.05)


def test_chunk_changes_count_the_index_event_stream():
    """Commits by clients and by the tiers' own session, evictions and clears: one series each,
    at zero from the start, chunks and bytes apart."""
    changes = ChunkChanges()
    assert changes.snapshot() == {(change, RAM): (0, 0) for change in CHANGES}
    changes.take(
        [
            Committed("s", b"a", 100, client="engine"),
            Committed("s", b"b", 50, client=TIER_CLIENT),
            Evicted("s", b"a", 100),
            Cleared("s", b"b", 50),
            Cleared("s", b"c", 7, tier="disk"),
        ]
    )
    figures = changes.snapshot()
    assert figures[("committed", RAM)] == (1, 100)
    assert figures[("read_back", RAM)] == (1, 50)
    assert figures[("evicted", RAM)] == (1, 100)
    assert figures[("cleared", RAM)] == (1, 50)
    assert figures[("cleared", "disk")] == (1, 7)


def test_a_server_counts_commits_evictions_and_clears_from_its_event_stream(make_server):
    """A real server's /metrics: three chunks committed, two evicted by a quota, one cleared."""
    server = make_server(metrics_port=0)
    keys = [bytes([i]) * 32 for i in range(3)]
    with CacheClient(server.address, timeout=T) as client:
        client.register("layout", 256, CHUNK).result(T)
        res = client.reserve("tenant", keys, CHUNK).result(T)
        client.commit(res.reservation_id).result(T)
        held = client.stats().result(T).used_bytes  # three slots
        client.set_quota("tenant", held // 3).result(T)  # one slot: one chunk stays
        assert client.clear_all("tenant") == 1

    def series(change: str) -> tuple[str, tuple[tuple[str, str], ...]]:
        return ("kvdepot_chunk_changes_total", (("change", change), ("tier", RAM)))

    samples = _scrape_when(server, lambda s: s.get(series("cleared")) == 1)
    assert samples[series("committed")] == 3
    assert samples[series("evicted")] == 2
    assert samples[series("read_back")] == 0
    committed_bytes = ("kvdepot_chunk_change_bytes_total", (("change", "committed"), ("tier", RAM)))
    assert samples[committed_bytes] == 3 * CHUNK
