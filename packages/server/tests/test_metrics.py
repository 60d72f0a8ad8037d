"""Prometheus metrics carry the stats figures and bad frames per peer, with bounded labels."""

from __future__ import annotations

import urllib.request

from prometheus_client import generate_latest

from kvdepot.core import SaltLabeler
from kvdepot.server import ChunkIndex, SlabAllocator
from kvdepot.server._metrics import MAX_PEER_LABELS, BadFrameCounter, Metrics, MetricsSnapshot

LABEL = SaltLabeler(bytes(range(32)))  # a server's labeler


def test_metrics_text_has_figures_and_bad_frames_per_peer():
    """A scrape shows capacity, use, per-salt bytes and bad frames per peer."""
    index = ChunkIndex(SlabAllocator(8 * 4096, 4096))
    index.register("a", 960, 0.0)
    out = index.reserve("a", "tenant", [b"k" * 32], 960, 0.0)  # a slot of 1024 with its header
    index.commit("a", out.reservation_id, None, 0.0)
    bad = BadFrameCounter()
    bad.add("peer-1")
    bad.add("peer-1")
    metrics = Metrics(label=LABEL)
    metrics.publish(MetricsSnapshot(index.stats(), {"requests": 5}, bad.snapshot()))
    text = generate_latest(metrics.registry).decode()
    assert "kvdepot_capacity_bytes 32768.0" in text
    assert f'kvdepot_salt_used_bytes{{salt="{LABEL("tenant")}"}} 1024.0' in text
    assert 'kvdepot_bad_frames_total{peer="peer-1"} 2.0' in text
    assert 'kvdepot_transport_events_total{event="requests"} 5.0' in text


def test_bad_frame_labels_are_bounded():
    """Peers beyond the label bound are counted under "other"."""
    bad = BadFrameCounter()
    for i in range(MAX_PEER_LABELS + 10):
        bad.add(f"p{i}")
    snap = bad.snapshot()
    assert len(snap) == MAX_PEER_LABELS + 1
    assert snap["other"] == 10


def test_metrics_served_over_http_on_loopback():
    """The metrics endpoint answers on 127.0.0.1."""
    index = ChunkIndex(SlabAllocator(8 * 4096, 4096))
    metrics = Metrics(label=LABEL)
    metrics.publish(MetricsSnapshot(index.stats(), {}, {}))
    url = metrics.serve(0)
    try:
        assert url.startswith("http://127.0.0.1:")
        with urllib.request.urlopen(url, timeout=5) as resp:
            assert b"kvdepot_used_bytes" in resp.read()
    finally:
        metrics.close()


def test_real_server_counts_bad_frames_per_peer_in_metrics(make_server, tmp_path):
    """Garbage sent over a real ipc socket shows up per peer in the scraped metrics."""
    import re
    import time

    import zmq

    server = make_server(address=f"ipc://{tmp_path}/m.sock", metrics_port=0)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, b"garbage-peer")
    sock.connect(server.address)
    try:
        sock.send_multipart([b"\xc1not msgpack"] * 3)
        assert sock.poll(5000)
        assert len(sock.recv_multipart()) == 3
    finally:
        sock.close(0)
        ctx.term()
    pattern = re.compile(r'kvdepot_bad_frames_total\{peer="([0-9a-f]+)"\} 3\.0')
    deadline = time.monotonic() + 5
    while True:
        with urllib.request.urlopen(server.metrics_url, timeout=5) as resp:
            match = pattern.search(resp.read().decode())
        if match or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert match, "bad frames of the peer never showed up in the metrics"
    assert bytes.fromhex(match.group(1)) == b"garbage-peer"


def test_salt_series_are_bounded_and_labelled_by_digest():
    """Thousands of salts give MAX_SALT_LABELS series plus "other", labelled by digest: /metrics, which
    every local user may read, never shows a tenant's salt."""
    from kvdepot.server._metrics import MAX_SALT_LABELS

    index = ChunkIndex(SlabAllocator(8 << 20, 1 << 20))
    index.register("a", 960, 0.0)
    for i in range(3000):
        out = index.reserve("a", f"tenant-secret-{i}", [b"k" * 32], 960, 0.0)
        index.commit("a", out.reservation_id, None, 0.0)
    index.set_quota("tenant-secret-7", 1 << 20)
    metrics = Metrics(label=LABEL)
    metrics.publish(MetricsSnapshot(index.stats(), {}, {}))
    text = generate_latest(metrics.registry).decode()
    assert "tenant-secret" not in text
    series = [line for line in text.splitlines() if line.startswith("kvdepot_salt_used_bytes{")]
    assert len(series) == MAX_SALT_LABELS + 1
    assert f'kvdepot_salt_quota_bytes{{salt="{LABEL("tenant-secret-7")}"}} 1.048576e+06' in text
    other = next(line for line in series if 'salt="other"' in line)
    assert float(other.split()[-1]) == (3000 - MAX_SALT_LABELS) * 1024


def test_metrics_have_each_tier_below_ram():
    """Each tier's figures are a `kvdepot_tier` series labelled by tier and figure; its state is `up`."""
    index = ChunkIndex(SlabAllocator(8 * 4096, 4096))
    tiers = {"tier:disk:hits": 3, "tier:disk:state": "up", "tier:remote:state": "down", "tier:remote:capacity": None}
    metrics = Metrics(label=LABEL)
    metrics.publish(MetricsSnapshot(index.stats(), {}, {}, tiers))
    text = generate_latest(metrics.registry).decode()
    assert 'kvdepot_tier{figure="hits",tier="disk"} 3.0' in text
    assert 'kvdepot_tier{figure="up",tier="disk"} 1.0' in text
    assert 'kvdepot_tier{figure="up",tier="remote"} 0.0' in text
    assert 'figure="capacity"' not in text
