"""Subscriptions to the `--kv-events` PUB port are bounded: only prefixes of the topic are kept,
whatever a peer sends, against a real `kvdepot serve` process."""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq

from kvdepot.server import ServerProcess
from kvdepot.server.testing import free_port
from kvdepot.transport import CacheClient

pytestmark = pytest.mark.integration

T = 10.0
CHUNK = 16 * 1024 - 64  # one 16 KiB slot
TOPIC = b"kv@node:test@kvdepot"
#: Distinct subscriptions the flood sends, each as long as the socket takes (no shared prefix).
FLOOD = 20_000
FLOOD_BYTES = 240
#: What the server's RSS may grow by while the flooding peer is still connected (it used to keep
#: every subscription in libzmq's trie: about 45 bytes a byte, some 200 MiB for this flood).
RSS_BOUND = 48 << 20


@pytest.fixture
def zctx() -> Iterator[zmq.Context]:
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@contextlib.contextmanager
def events_server(workdir: Path, port: int) -> Iterator[ServerProcess]:
    """A server publishing KV events under `TOPIC` on tcp `port`."""
    server = ServerProcess(
        f"ipc://{workdir}/kvd.sock",
        capacity="8MiB",
        args=[
            *("--page-size", "1MiB", "--pool-dir", str(workdir), "--no-metrics"),
            *("--kv-events", f"tcp://127.0.0.1:{port}", "--kv-events-topic", TOPIC.decode()),
        ],
        log_path=workdir / "server.log",
    )
    with server:
        yield server


def wait_for(predicate: Callable[[], bool], timeout: float = T) -> bool:
    deadline = time.monotonic() + timeout
    while not (value := predicate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def refused(server: ServerProcess) -> int:
    """Subscriptions the server refused (0 where it counts none)."""
    return server.stats(T).extra.get("kv_events_subscriptions_refused", 0)


def subscriber(ctx: zmq.Context, port: int, *prefixes: bytes) -> zmq.Socket:
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    for prefix in prefixes:
        sock.setsockopt(zmq.SUBSCRIBE, prefix)
    sock.connect(f"tcp://127.0.0.1:{port}")
    return sock


def commit(client: CacheClient, key: str) -> None:
    res = client.reserve("s", [hashlib.sha256(key.encode()).digest()], CHUNK).result(T)
    if res.slots:  # none while the pool is full of chunks still being committed
        client.commit(res.reservation_id).result(T)


def received(server: ServerProcess, subs: list[zmq.Socket], tag: str) -> list[bool]:
    """Commit chunks until the first of `subs` gets an event (its subscription has reached the
    server), then a few more; whether each of `subs` got one."""
    got = [False] * len(subs)
    with CacheClient(server.address, timeout=T) as client:
        client.register("layout", 256, CHUNK).result(T)
        for i in range(200):
            commit(client, f"{tag}-{i}")
            if subs[0].poll(50):
                break
        else:
            pytest.fail("a subscriber of the topic got no event")
        for j in range(5):
            commit(client, f"{tag}-more-{j}")
    for k, sub in enumerate(subs):
        got[k] = bool(sub.poll(500))
        if got[k]:
            topic, seq, payload = sub.recv_multipart()
            assert (topic, len(seq)) == (TOPIC, 8)
            assert payload
    return got


def test_a_flood_of_distinct_subscriptions_is_refused_and_the_servers_memory_stays_bounded(short_tmp, zctx):
    """20,000 distinct 240-byte subscriptions from one peer while events flow: they are refused and
    counted, and the peer is disconnected once past its bytes (the PUB socket used to keep them
    all in its trie, about 200 MiB, for as long as the peer stayed); the server's RSS grows by
    less than `RSS_BOUND`, and a subscriber of the topic still gets events."""
    port = free_port()
    with events_server(short_tmp, port) as server:
        assert server.pid is not None
        before = rss(server.pid)
        files = len(os.listdir(f"/proc/{server.pid}/fd"))
        flood = zctx.socket(zmq.XSUB)
        flood.setsockopt(zmq.LINGER, 0)
        flood.setsockopt(zmq.SNDHWM, 0)  # the whole flood waits in its queue: no send is dropped
        flood.connect(f"tcp://127.0.0.1:{port}")
        for i in range(FLOOD):
            flood.send(b"\1" + i.to_bytes(4, "big") + os.urandom(FLOOD_BYTES - 4))
        with CacheClient(server.address, timeout=T) as client:
            client.register("layout", 256, CHUNK).result(T)
            for i in range(2000):  # events, until the peer is cut off (each batch sent took in subscriptions)
                commit(client, f"flood-{i}")
                if i % 50 == 0 and server.stats(T).extra.get("kv_events_subscribers_cut", 0):
                    break
        grown = rss(server.pid) - before
        assert grown < RSS_BOUND, f"the server grew {grown >> 20} MiB for {FLOOD} subscriptions"
        extra = server.stats(T).extra
        assert extra["kv_events_subscriptions_refused"] >= 1
        assert extra["kv_events_subscribers_cut"] >= 1
        assert len(os.listdir(f"/proc/{server.pid}/fd")) <= files + 8  # looking for the peers leaks none
        assert received(server, [subscriber(zctx, port, TOPIC)], "flood") == [True]
        assert server.alive()


def test_subscribers_of_a_prefix_of_the_topic_get_events_and_others_none(short_tmp, zctx):
    """The empty subscription, a prefix of the topic and the topic itself are kept (as vLLM's
    subscribers send them); a subscription longer than the topic, or beside it, is refused and
    counted; an unsubscription of the topic is applied for the peer that sent it."""
    port = free_port()
    with events_server(short_tmp, port) as server:
        subs = [subscriber(zctx, port, TOPIC), subscriber(zctx, port, b""), subscriber(zctx, port, b"kv@")]
        subs += [subscriber(zctx, port, TOPIC + b"-other"), subscriber(zctx, port, b"zz")]
        assert received(server, subs, "prefix") == [True, True, True, False, False]
        assert wait_for(lambda: refused(server) >= 2)
        # An XSUB filters nothing itself: what it gets is what the server sends it.
        leaves = zctx.socket(zmq.XSUB)
        leaves.setsockopt(zmq.LINGER, 0)
        leaves.connect(f"tcp://127.0.0.1:{port}")
        leaves.send(b"\1" + TOPIC)
        assert received(server, [subs[0], leaves], "before") == [True, True]
        leaves.send(b"\0" + TOPIC)
        quiet_rounds = 0
        for i in range(50):  # until the unsubscription has reached the server: then nothing more
            while leaves.poll(0):
                leaves.recv_multipart()
                quiet_rounds = -1
            quiet_rounds += 1
            if quiet_rounds == 5:
                break
            received(server, [subs[0]], f"after-{i}")
        else:
            pytest.fail("an unsubscribed peer kept getting events")
