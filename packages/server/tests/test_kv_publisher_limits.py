"""The `--kv-events` publisher is bounded against a hostile local user: connections per tcp port,
bytes kept for replay (none without a replay endpoint), bytes per replay answer, the size of what
a peer may send, against a real `kvdepot serve` process."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq

from kvdepot.server import ServerProcess
from kvdepot.server._cli import BUILTIN_COMMANDS, build_parser
from kvdepot.server._kv_publisher import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_REPLAY_BYTES,
    DEFAULT_REPLAY_PAGE_BYTES,
    DEFAULT_SUBSCRIBER_BYTES,
    END_SEQ,
    MAX_BATCH_BYTES,
    MAX_BATCH_EVENTS,
    MEDIUM,
    OWNER,
    REPLAY_PAGE_BATCHES,
    BlockStored,
    EventBatch,
    KVEventPublisher,
)
from kvdepot.server.testing import free_port
from kvdepot.transport import CacheClient

pytestmark = pytest.mark.integration

T = 10.0
CHUNK = 16 * 1024 - 64  # one 16 KiB slot
# A file limit the server cannot raise: old servers aborted once tcp peers of the PUB port had it.
HARD_NOFILE = 256
_LIMITED = (
    "import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_NOFILE, ({n}, {n})); "
    "sys.argv[0] = 'kvdepot'; runpy.run_module('kvdepot.server', run_name='__main__', alter_sys=True)"
)


# A peer that subscribes to a 1 MiB topic over tcp, then waits (reconnecting no sooner than a minute).
_BIG_SUBSCRIBER = (
    "import sys, zmq; s = zmq.Context().socket(zmq.XSUB); s.setsockopt(zmq.RECONNECT_IVL, 60000); "
    "s.connect('tcp://127.0.0.1:{port}'); s.send(b'\\1' + b'x' * (1 << 20)); sys.stdin.read()"
)


class LimitedServer(ServerProcess):
    """`kvdepot serve` with a hard file limit of `HARD_NOFILE`."""

    def command(self) -> list[str]:
        command = super().command()
        return [sys.executable, "-c", _LIMITED.format(n=HARD_NOFILE), *command[3:]]


@contextlib.contextmanager
def events_server(workdir: Path, *args: str, limited: bool = False) -> Iterator[ServerProcess]:
    kind = LimitedServer if limited else ServerProcess
    server = kind(
        f"ipc://{workdir}/kvd.sock",
        capacity="8MiB",
        args=["--page-size", "1MiB", "--pool-dir", str(workdir), "--no-metrics", "--log-format", "json", *args],
        log_path=workdir / "server.log",
    )
    with server:
        yield server


def replay_server(workdir: Path, *args: str) -> contextlib.AbstractContextManager[ServerProcess]:
    """A server publishing KV events with a replay endpoint, both on ipc in `workdir`."""
    return events_server(
        workdir, "--kv-events", f"ipc://{workdir}/ev", "--kv-events-replay", f"ipc://{workdir}/rp", *args
    )


def commit_each(client: CacheClient, tag: str, n: int) -> None:
    """`n` chunks committed one by one: about one KV-event batch each."""
    client.register("layout", 256, CHUNK).result(T)
    for i in range(n):
        res = client.reserve("s", [hashlib.sha256(f"{tag}-{i}".encode()).digest()], CHUNK).result(T)
        if res.slots:
            client.commit(res.reservation_id).result(T)


def wait_for(predicate, timeout: float = T):
    deadline = time.monotonic() + timeout
    while not (value := predicate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


@pytest.fixture
def zctx() -> Iterator[zmq.Context]:
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def ask(sock: zmq.Socket, start: int) -> list[list[bytes]]:
    """One replay request from `start`: the page's messages up to and with the end marker."""
    sock.send_multipart([b"", start.to_bytes(8, "big")])
    got = []
    while True:
        assert sock.poll(int(T * 1000)), "the replay endpoint did not answer"
        got.append(sock.recv_multipart())
        if got[-1][2] == END_SEQ:
            return got


def dealer(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def disconnected(sock: zmq.Socket) -> bool:
    """Whether the server closed `sock`'s one connection (it sends nothing back, so a receive
    sees no message; the socket's peer count drops to none): polled by a send that fails."""
    deadline = time.monotonic() + T
    while time.monotonic() < deadline:
        try:
            sock.send(b"\1", zmq.NOBLOCK) if sock.type == zmq.XSUB else sock.send_multipart([b"", b""], zmq.NOBLOCK)
        except zmq.Again:  # no connected peer takes it: the connection is gone
            return True
        time.sleep(0.05)
    return False


# -- connections ------------------------------------------------------------------------------


def test_silent_tcp_connections_to_the_pub_port_stop_at_the_cap_and_the_server_lives(short_tmp):
    """More plain tcp connections to the KV-events PUB port than the server's file limit allows
    (it used to take them all, and libzmq aborted the server at the next ipc client): the port
    takes at most its cap, the rest wait unanswered, an ipc cache client is served, and the
    listener counts that it was full; once they close, a subscriber connects again."""
    cap = 32
    port = free_port()
    with events_server(
        short_tmp, "--kv-events", f"tcp://127.0.0.1:{port}", "--kv-events-max-connections", str(cap), limited=True
    ) as server:
        flood = []
        try:
            for _ in range(HARD_NOFILE + 64):
                sock = socket.socket()
                sock.setblocking(False)
                assert sock.connect_ex(("127.0.0.1", port)) in (0, errno.EINPROGRESS)
                flood.append(sock)
            assert wait_for(lambda: server.stats(T).extra["kv_events_pub_full"] >= 1)
            with CacheClient(server.address, timeout=T) as client:
                client.ping()
            assert server.alive()
            extra = server.stats(T).extra
            # the cap, and what libzmq accepted in the moment before the filter was on: never the flood
            assert cap <= extra["kv_events_pub_connections"] < len(flood)
        finally:
            for sock in flood:
                sock.close()
        assert wait_for(lambda: server.stats(T).extra["kv_events_pub_connections"] == 0)
        ctx = zmq.Context()
        try:
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
            sub.connect(f"tcp://127.0.0.1:{port}")
            assert monitor.poll(int(T * 1000)), "a subscriber could not connect once the flood ended"
            monitor.close(0)
            sub.close(0)
        finally:
            ctx.term()


# -- replay -----------------------------------------------------------------------------------


def test_a_replay_from_zero_gets_one_bounded_page_and_the_next_from_where_it_got_to(short_tmp, zctx):
    """200 batches kept; "from 0" gets one page of at most `--kv-events-replay-page` bytes (and at
    most `REPLAY_PAGE_BATCHES` batches), then the end marker (it used to get all 200); asking
    again from the number after a page's last gives the rest, every batch once."""
    page_bytes = 2048
    with replay_server(
        short_tmp,
        "--kv-events-replay-page",
        str(page_bytes),
    ) as server:
        with CacheClient(server.address, timeout=T) as client:
            commit_each(client, "a", 200)
        assert wait_for(lambda: server.stats(T).extra["kv_events_sent"] >= 200)
        total = server.stats(T).extra["kv_events_batches"]
        sock = dealer(zctx, f"ipc://{short_tmp}/rp")
        first = ask(sock, 0)
        assert first[-1] == [b"", b"", END_SEQ, b""]
        page = first[:-1]
        assert 1 <= len(page) <= REPLAY_PAGE_BATCHES
        # a busy publisher gathers more events per batch: one batch past the bound still goes alone
        assert sum(len(frames[3]) for frames in page) <= page_bytes or len(page) == 1
        seen = [int.from_bytes(frames[2], "big") for frames in page]
        while True:
            more = ask(sock, seen[-1] + 1)[:-1]
            if not more:
                break
            seen += [int.from_bytes(frames[2], "big") for frames in more]
        assert seen == list(range(total))
        sock.close(0)
        assert server.stats(T).extra["kv_events_replay_pages"] >= total // REPLAY_PAGE_BATCHES


def test_a_peer_that_asks_again_and_again_without_reading_gets_no_more_and_others_are_served(short_tmp, zctx):
    """Thousands of "from 0" requests from a peer that never reads: once its queue is full its
    requests are refused (counted as unread) instead of each queueing another copy of the buffer;
    a good peer's replay is still answered."""
    with replay_server(short_tmp) as server:
        with CacheClient(server.address, timeout=T) as client:
            commit_each(client, "b", 100)
        assert wait_for(lambda: server.stats(T).extra["kv_events_sent"] >= 100)
        greedy = dealer(zctx, f"ipc://{short_tmp}/rp")
        greedy.setsockopt(zmq.RCVHWM, 1)
        greedy.setsockopt(zmq.RCVBUF, 4096)
        for _ in range(5000):
            greedy.send_multipart([b"", (0).to_bytes(8, "big")])
        assert wait_for(lambda: server.stats(T).extra["kv_events_replay_refused_unread"] > 0)
        good = dealer(zctx, f"ipc://{short_tmp}/rp")
        assert len(ask(good, 0)) > 1
        assert server.alive()


def test_an_oversized_replay_frame_disconnects_its_peer_and_replay_goes_on(short_tmp, zctx):
    """A 1 MiB frame to the replay endpoint (no limit used to hold it whole): the server drops
    that peer's connection, stays up, and answers a good replay request."""
    with replay_server(short_tmp) as server:
        with CacheClient(server.address, timeout=T) as client:
            commit_each(client, "c", 3)
        bad = zctx.socket(zmq.DEALER)
        bad.setsockopt(zmq.LINGER, 0)
        bad.setsockopt(zmq.RECONNECT_IVL, 60_000)
        bad.setsockopt(zmq.IMMEDIATE, 1)  # nothing queued without a connection
        bad.setsockopt(zmq.SNDTIMEO, int(T * 1000))
        bad.connect(f"ipc://{short_tmp}/rp")
        bad.send_multipart([b"", b"\0" * (1 << 20)])
        assert disconnected(bad), "the server kept the connection of a peer that sent 1 MiB"
        assert server.alive()
        good = dealer(zctx, f"ipc://{short_tmp}/rp")
        assert ask(good, 0)[-1][2] == END_SEQ


def test_an_oversized_subscription_disconnects_its_subscriber(short_tmp, zctx):
    """A 1 MiB subscription (the PUB socket used to keep it, for as long as the peer stayed): the
    server drops that subscriber's connection while the peer is still there, and a subscriber of
    the topic still gets events. (The peer runs in a process of its own: libzmq's XSUB crashes
    when it closes a socket whose 1 MiB subscription was refused.)"""
    port = free_port()
    with events_server(short_tmp, "--kv-events", f"tcp://127.0.0.1:{port}") as server:
        bad = subprocess.Popen([sys.executable, "-c", _BIG_SUBSCRIBER.format(port=port)], stdin=subprocess.PIPE)
        try:
            # It connected (the server may cut it before a look finds it open). A readiness wait:
            # the peer's own start (importing zmq) is slow on a loaded machine.
            assert wait_for(lambda: server.stats(T).extra["kv_events_pub_accepted"] == 1, timeout=6 * T)
            assert wait_for(lambda: server.stats(T).extra["kv_events_pub_connections"] == 0), (
                "the server kept a 1 MiB subscription"
            )
            assert bad.poll() is None  # the peer did not leave by itself
        finally:
            bad.kill()
            bad.wait()
        good = zctx.socket(zmq.SUB)
        good.setsockopt(zmq.LINGER, 0)
        good.setsockopt(zmq.SUBSCRIBE, b"kv@")
        good.connect(f"tcp://127.0.0.1:{port}")
        with CacheClient(server.address, timeout=T) as client:
            client.register("layout", 256, CHUNK).result(T)
            for i in range(100):  # until the subscription has reached the server
                res = client.reserve("s", [hashlib.sha256(f"d-{i}".encode()).digest()], CHUNK).result(T)
                client.commit(res.reservation_id).result(T)
                if good.poll(100):
                    break
            else:
                pytest.fail("a subscriber of the topic got no event")
        assert server.alive()


# -- memory kept ------------------------------------------------------------------------------


def test_without_a_replay_endpoint_nothing_is_kept_for_replay(short_tmp):
    """`--kv-events` alone: batches are published and none is kept (every batch used to be)."""
    with events_server(short_tmp, "--kv-events", f"ipc://{short_tmp}/ev") as server:
        with CacheClient(server.address, timeout=T) as client:
            commit_each(client, "e", 50)
        assert wait_for(lambda: server.stats(T).extra["kv_events_sent"] >= 50)
        assert server.stats(T).extra["kv_events_replay_buffer_bytes"] == 0


def test_the_replay_buffer_keeps_at_most_its_bytes_the_newest_batches(short_tmp, zctx):
    """`--kv-events-replay-bytes 4KiB` and 200 batches: at most 4 KiB are kept, the newest, and a
    replay from 0 starts past the ones let go."""
    with replay_server(
        short_tmp,
        "--kv-events-replay-bytes",
        "4KiB",
    ) as server:
        with CacheClient(server.address, timeout=T) as client:
            commit_each(client, "f", 200)
        assert wait_for(lambda: server.stats(T).extra["kv_events_sent"] >= 200)
        extra = server.stats(T).extra
        assert 0 < extra["kv_events_replay_buffer_bytes"] <= 4096
        page = ask(dealer(zctx, f"ipc://{short_tmp}/rp"), 0)[:-1]
        assert int.from_bytes(page[0][2], "big") > 0
        assert int.from_bytes(page[-1][2], "big") <= extra["kv_events_batches"] - 1


def test_a_subscriber_that_does_not_read_holds_at_most_its_bytes(short_tmp):
    """The PUB high-water mark is `--kv-events-subscriber-bytes` in full batches, and a full batch
    fits `MAX_BATCH_BYTES` (it used to be 100,000 batches)."""
    full = EventBatch(time.time(), [BlockStored([b"\xff" * 32], None, [], 0, None, MEDIUM, None, OWNER)] * 256)
    assert MAX_BATCH_EVENTS <= 256
    assert len(msgspec.msgpack.encode(full)) <= MAX_BATCH_BYTES
    publisher = KVEventPublisher(f"ipc://{short_tmp}/ev", topic="t", subscriber_bytes=1 << 20)
    try:
        assert publisher._pub.getsockopt(zmq.SNDHWM) == (1 << 20) // MAX_BATCH_BYTES
    finally:
        publisher.close()


# -- flags and /metrics ------------------------------------------------------------------------


def test_the_flags_default_to_the_publishers_bounds():
    args = build_parser(BUILTIN_COMMANDS).parse_args(["serve"])
    assert args.kv_events_max_connections == DEFAULT_MAX_CONNECTIONS
    assert args.kv_events_subscriber_bytes == DEFAULT_SUBSCRIBER_BYTES
    assert args.kv_events_replay_bytes == DEFAULT_REPLAY_BYTES
    assert args.kv_events_replay_page == DEFAULT_REPLAY_PAGE_BYTES


def test_metrics_show_the_publishers_bounds_and_counters(short_tmp):
    """/metrics of a server with KV events on tcp: connections and full counts per listener (as
    every listener's, `kvdepot_listener_*`), refused subscriptions, replay refusals by reason, the
    replay buffer's bytes, and each bound's value."""
    server = ServerProcess(
        f"ipc://{short_tmp}/kvd.sock",
        capacity="8MiB",
        args=[
            "--page-size",
            "1MiB",
            "--pool-dir",
            str(short_tmp),
            "--metrics-port",
            str(free_port()),
            "--kv-events",
            f"tcp://127.0.0.1:{free_port()}",
            "--kv-events-replay",
            f"tcp://127.0.0.1:{free_port()}",
            "--kv-events-subscriber-send-bytes",
            "24KiB",
        ],
    )
    metrics_port = int(server.args[server.args.index("--metrics-port") + 1])
    with server, urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=T) as resp:
        text = resp.read().decode()
    for line in (
        'kvdepot_listener_connections{listener="kv_events_pub"} 0.0',
        'kvdepot_listener_connections{listener="kv_events_replay"} 0.0',
        f'kvdepot_listener_max_connections{{listener="kv_events_pub"}} {float(DEFAULT_MAX_CONNECTIONS)}',
        'kvdepot_listener_refused_total{listener="kv_events_pub",reason="full"} 0.0',
        'kvdepot_listener_refused_total{listener="kv_events_replay",reason="full"} 0.0',
        'kvdepot_listener_refused_total{listener="kv_events_pub",reason="handshake"} 0.0',
        "kvdepot_kv_events_subscriptions_refused_total 0.0",
        "kvdepot_kv_events_subscribers_cut_total 0.0",
        'kvdepot_kv_events_replay_refused_total{reason="unread"} 0.0',
        "kvdepot_kv_events_replay_buffer_bytes 0.0",
    ):
        assert line in text.splitlines(), line
    # the names before every listener was a kvdepot_listener_*
    assert "kvdepot_kv_events_connections" not in text
    assert "kvdepot_kv_events_listener_full" not in text
    values = {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line.startswith("kvdepot_kv_events_limit")
    }
    assert values['kvdepot_kv_events_limit{limit="max_connections"}'] == DEFAULT_MAX_CONNECTIONS
    assert values['kvdepot_kv_events_limit{limit="replay_bytes"}'] == DEFAULT_REPLAY_BYTES
    assert values['kvdepot_kv_events_limit{limit="subscriber_send_bytes"}'] == 24 << 10  # the flag reaches it
