"""The peers of `soak_bench.py`: hostile local users of every listener `kvdepot serve` opens (the
cache socket, the metrics port, the KV-events PUB and replay ports), each run as a process in a
session of its own, and the good side's small clients (a /metrics scraper, a client that connects
afresh again and again). Issue 45's findings, by number, name what each attacker repeats."""

from __future__ import annotations

import contextlib
import os
import random
import resource
import select
import socket
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import zmq

from kvdepot.transport import PROTOCOL_VERSION, CacheClient, TransportError
from kvdepot.transport._codec import decode_reply, encode_request
from kvdepot.transport._dispatch import MAX_FRAMES_PER_MESSAGE
from kvdepot.transport._messages import (
    MAX_CHANGES_PER_REPLY,
    Changes,
    Hello,
    Lookup,
    LookupItem,
    Register,
    Request,
    Reserve,
    Stats,
)

Context = zmq.Context[zmq.Socket[bytes]]
Socket = zmq.Socket[bytes]
T = 10.0
#: Idle tcp connections to the metrics port and to the KV-events PUB port (finding 1): more than
#: systemd's default soft file limit (1,024), which the finding's server had.
IDLE_CONNECTIONS = 1100
#: Connections dripping a header line every `DRIP_S` (finding 5: 500 held 500 threads for 25 s).
DRIP_CONNECTIONS = 300
DRIP_S = 3.0
#: Connections each sending a head of `FAT_HEAD_BYTES` that never ends (finding 5: forty 6.4 MB).
FAT_CONNECTIONS = 40
FAT_HEAD_BYTES = 6_400_000
HEAD = b"GET /metrics HTTP/1.1\r\n"
DRIP_LINE = b"X-Drip: 1\r\n"
FAT_LINE = b"X-Fill: " + b"b" * 60_000 + b"\r\n"
#: New tcp connections a holder opens per second at most, in place of those the server closed
#: (a holder keeps connections open; it is not a connection flood).
REOPEN_PER_S = 500
ROUND_S = 0.5
#: Replay peers that ask "from 0" again and again and never read (finding 3: ten added 1,253 MiB).
REPLAY_DEAF_PEERS = 10
#: Parts of an unfinished replay message, and their size (finding 3: 4 x 64 MiB held 256 MiB).
BIG_PARTS, BIG_PART_BYTES = 4, 64 << 20
#: Subscriptions of `BIG_SUB_BYTES` on the PUB socket (finding 3: six 16 MiB topics held 96 MiB).
BIG_SUBS, BIG_SUB_BYTES = 6, 16 << 20
#: Subscribers of everything that never read (finding 4: three added 126 MiB).
DEAF_SUBSCRIBERS = 3
#: Frames a one-byte flooder sends on one connection before it takes a new one (finding 7).
ONE_BYTE_FRAMES_PER_PEER = 200_000


@dataclass(frozen=True)
class Targets:
    """The server's listeners."""

    address: str  # the cache socket (ipc)
    metrics_port: int
    pub_port: int
    replay_port: int

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"


# -- the cache socket ------------------------------------------------------------------------------


def _dealer(ctx: Context, address: str, *, sndhwm: int | None = 0) -> Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if sndhwm is not None:
        sock.setsockopt(zmq.SNDHWM, sndhwm)
    sock.connect(address)
    return sock


def _hello(i: int = 0) -> bytes:
    return encode_request(Request(i + 1, Hello(PROTOCOL_VERSION, os.urandom(16).hex(), "hostile")))


def _frames(ctx: Context, address: str, kind: str, end: float, rng: random.Random) -> None:
    """The first six: random and mutated frames, unread replies, unterminated multipart messages,
    Hello churn."""
    sock = _dealer(ctx, address)
    key = os.urandom(32)
    valid = [
        _hello(),
        encode_request(Request(2, Register("hostile", 256, 1000))),
        encode_request(Request(3, Lookup([LookupItem("s", [key] * 64)]))),
        encode_request(Request(4, Reserve("s", [key], 1000))),
    ]
    if kind == "deaf":
        sock.send(_hello())
    n = 0
    try:
        while time.monotonic() < end:
            n += 1
            if kind == "fuzz":
                frame = bytearray(rng.choice(valid))
                for _ in range(rng.randint(1, 4)):
                    frame[rng.randrange(len(frame))] = rng.randrange(256)
                sock.send_multipart([bytes(frame), rng.randbytes(rng.randint(0, 64))])
                while sock.poll(0):
                    sock.recv_multipart()
            elif kind == "deaf":  # requests whose replies are never read
                sock.send(encode_request(Request(n + 1, Stats())))
                if n % 1000 == 0:
                    time.sleep(0.01)
            elif kind == "multipart":  # parts of a message that never ends, on new connections
                for _ in range(8):
                    sock.send(rng.randbytes(1 << 20), zmq.SNDMORE)
                sock.close(0)
                sock = _dealer(ctx, address, sndhwm=None)
                time.sleep(0.05)
            elif kind == "churn":  # Hello under a new client id, again and again
                sock.send(_hello(n))
                if sock.poll(1000):
                    sock.recv_multipart()
    finally:
        sock.close(0)


def _salts(address: str, end: float, rng: random.Random) -> None:
    """Stores under ever new salts."""
    with CacheClient(address, timeout=5.0) as client:
        client.register("hostile-salts", 256, 960).result(5)
        while time.monotonic() < end:
            with client.batch() as batch:
                futures = [batch.reserve(f"s-{rng.random()}", [os.urandom(32)], 960) for _ in range(64)]
            with client.batch() as batch:
                for future in futures:
                    with contextlib.suppress(TransportError):
                        batch.commit(future.result(5).reservation_id)


def fill_change_log(address: str) -> int:
    """Commits one-byte chunks until the change log holds more than a `changes` reads at most (the
    pool evicts as it fills); the numbering's head."""
    with CacheClient(address, timeout=T) as client:
        client.register("hostile-changes", 256, 1).result(T)
        for _ in range(2 * MAX_CHANGES_PER_REPLY // 1024):
            res = client.reserve("", [os.urandom(32) for _ in range(1024)], 1).result(T)
            client.commit(res.reservation_id).result(T)
        return int(client.changes(0, [""]).result(T).next)


def _changes(ctx: Context, address: str, end: float) -> None:
    """Finding 2: messages of 4,096 `changes` frames, each asking for the most changes (16,384)
    of a change log that holds more than that (`fill_change_log`); the replies are read."""
    limit = MAX_CHANGES_PER_REPLY
    with CacheClient(address, timeout=T) as client:
        head = int(client.changes(0, [""]).result(T).next)
    sock = _dealer(ctx, address, sndhwm=None)
    try:
        sock.send(_hello())
        if not sock.poll(int(T * 1000)):
            return
        decode_reply(sock.recv())
        request = Changes(max(1, head - limit), ["not-a-tenant"], limit=limit)
        frames = [encode_request(Request(i + 2, request)) for i in range(MAX_FRAMES_PER_MESSAGE)]
        while time.monotonic() < end:
            sock.send_multipart(frames)
            if sock.poll(int(max(0.0, end - time.monotonic()) * 1000) + 1000):
                sock.recv_multipart()
    finally:
        sock.close(0)


def _one_byte(ctx: Context, address: str, end: float) -> None:
    """Finding 7: one-byte requests as fast as the server takes them (messages of 4,096 one-byte
    frames, and one-byte messages), replies never read; a new connection every
    `ONE_BYTE_FRAMES_PER_PEER` frames."""
    many = [b"\0"] * MAX_FRAMES_PER_MESSAGE
    while time.monotonic() < end:
        sock = _dealer(ctx, address, sndhwm=None)
        sock.setsockopt(zmq.SNDTIMEO, 500)
        sent = 0
        try:
            while sent < ONE_BYTE_FRAMES_PER_PEER and time.monotonic() < end:
                sock.send_multipart(many)
                for _ in range(64):
                    sock.send(b"\0")
                sent += len(many) + 64
        except zmq.Again:  # the server stopped reading this peer: a new one
            pass
        finally:
            sock.close(0)


# -- tcp listeners: the metrics port, the PUB port ------------------------------------------------


def _hold_tcp(port: int, end: float, count: int, *, head: bytes = b"", drip: bytes = b"", fat: bytes = b"") -> None:
    """`count` tcp connections to `port`, each sending `head` once, then `drip` every `DRIP_S`,
    or `fat` until `FAT_HEAD_BYTES`; those the server closes are replaced (at most
    `REOPEN_PER_S` a second)."""
    conns: dict[int, list[Any]] = {}  # fd: [socket, bytes sent, last drip]
    poller = select.poll()
    tokens, last = float(count), time.monotonic()
    while time.monotonic() < end:
        tokens = min(float(count), tokens + (time.monotonic() - last) * REOPEN_PER_S)
        last = time.monotonic()
        for _ in range(min(int(tokens), count - len(conns))):
            tokens -= 1
            sock = socket.socket()
            sock.setblocking(False)
            sock.connect_ex(("127.0.0.1", port))
            conns[sock.fileno()] = [sock, -1, 0.0]
            poller.register(sock, select.POLLIN)
        now = time.monotonic()
        for state in list(conns.values()):
            sock = state[0]
            with contextlib.suppress(OSError):  # not connected yet, or its buffer is full
                if state[1] < 0:
                    if head:
                        sock.send(head)
                    state[1] = len(head)
                elif fat and state[1] < FAT_HEAD_BYTES:
                    while state[1] < FAT_HEAD_BYTES:
                        state[1] += sock.send(fat)
                elif drip and now - state[2] >= DRIP_S:
                    sock.send(drip)
                    state[2] = now
        for fd, _ in poller.poll(ROUND_S * 1000):  # an answer (408, 431, 503) or a close
            poller.unregister(fd)
            conns.pop(fd)[0].close()
    for state in conns.values():
        state[0].close()


def _pub(end: float, port: int) -> None:
    """Finding 1 and 4: subscribers of everything that never read, and idle tcp connections to the
    PUB port."""
    ctx = zmq.Context()
    subs = []
    for _ in range(DEAF_SUBSCRIBERS):
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{port}")
        subs.append(sub)
    _hold_tcp(port, end, IDLE_CONNECTIONS)
    for sub in subs:
        sub.close(0)
    ctx.term()


def _big_subscriptions(end: float, port: int) -> None:
    """Finding 3: 16 MiB subscriptions, sent again on every reconnection. The process ends without
    closing them: libzmq's XSUB crashes closing a socket whose subscription was refused."""
    ctx = zmq.Context()
    for i in range(BIG_SUBS):
        sock = ctx.socket(zmq.XSUB)
        sock.setsockopt(zmq.RECONNECT_IVL, 1000)
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send(b"\1" + bytes([i]) * BIG_SUB_BYTES)
    time.sleep(max(0.0, end - time.monotonic()))
    os._exit(0)


def _replay_deaf(ctx: Context, end: float, port: int) -> None:
    """Finding 3: "from 0" replay requests, again and again, from peers that never read."""
    socks = []
    for _ in range(REPLAY_DEAF_PEERS):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 1)
        sock.setsockopt(zmq.RCVBUF, 4096)
        sock.connect(f"tcp://127.0.0.1:{port}")
        socks.append(sock)
    request = [b"", (0).to_bytes(8, "big")]
    while time.monotonic() < end:
        for sock in socks:
            for _ in range(100):
                with contextlib.suppress(zmq.Again):
                    sock.send_multipart(request, zmq.NOBLOCK)
        time.sleep(0.05)
    for sock in socks:
        sock.close(0)


def _replay_big(ctx: Context, end: float, port: int) -> None:
    """Finding 3: unfinished multipart replay messages of 4 x 64 MiB, on new connections."""
    part = memoryview(bytearray(BIG_PART_BYTES))
    while time.monotonic() < end:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{port}")
        with contextlib.suppress(zmq.Again):
            for _ in range(BIG_PARTS):
                sock.send(part, zmq.SNDMORE | zmq.NOBLOCK, copy=False)
        time.sleep(0.5)
        sock.close(0)


#: Every hostile kind, and the finding of issue 45 it repeats (none: the cache socket's own).
KINDS = {
    "fuzz": "", "deaf": "", "multipart": "", "churn": "", "salts": "",
    "changes": "2", "one-byte": "7", "metrics-idle": "1", "metrics-drip": "5", "metrics-fat": "5",
    "pub": "1, 4", "pub-big-sub": "3", "replay-deaf": "3", "replay-big": "3",
}  # fmt: skip
#: The attack: one process per entry.
ATTACK = [
    "fuzz", "fuzz", "deaf", "multipart", "churn", "salts", "changes", "changes", "changes", "one-byte",
    "one-byte", "metrics-idle", "metrics-drip", "metrics-fat", "pub", "pub-big-sub", "replay-deaf", "replay-big",
]  # fmt: skip


def hostile(kind: str, targets: Targets, seconds: float, seed: int, cpus: set[int] | None = None) -> None:
    """One hostile peer of `kind` for `seconds`, in a session of its own (another user's process:
    not in the good client's scheduling group), on `cpus` if given."""
    os.setsid()
    if cpus:
        os.sched_setaffinity(0, cpus)
    resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
    rng = random.Random(seed)
    end = time.monotonic() + seconds
    ctx = zmq.Context()
    runs: dict[str, Callable[[], None]] = {
        "salts": lambda: _salts(targets.address, end, rng),
        "changes": lambda: _changes(ctx, targets.address, end),
        "one-byte": lambda: _one_byte(ctx, targets.address, end),
        "metrics-idle": lambda: _hold_tcp(targets.metrics_port, end, IDLE_CONNECTIONS),
        "metrics-drip": lambda: _hold_tcp(targets.metrics_port, end, DRIP_CONNECTIONS, head=HEAD, drip=DRIP_LINE),
        "metrics-fat": lambda: _hold_tcp(targets.metrics_port, end, FAT_CONNECTIONS, head=HEAD, fat=FAT_LINE),
        "pub": lambda: _pub(end, targets.pub_port),
        "pub-big-sub": lambda: _big_subscriptions(end, targets.pub_port),
        "replay-deaf": lambda: _replay_deaf(ctx, end, targets.replay_port),
        "replay-big": lambda: _replay_big(ctx, end, targets.replay_port),
    }
    try:
        runs.get(kind, lambda: _frames(ctx, targets.address, kind, end, rng))()
    except (TransportError, zmq.ZMQError, OSError):  # the server refused it: that is its job
        time.sleep(max(0.0, end - time.monotonic()))
    finally:
        ctx.destroy(linger=0)


# -- the good side's small clients ---------------------------------------------------------------


@dataclass
class Tally:
    """Round trips of one kind of good request: their times, failures and the first failure."""

    times: list[float] = field(default_factory=list)
    failures: int = 0
    first_failure: str = ""

    def time(self, fn: Callable[[], object]) -> None:
        start = time.perf_counter()
        try:
            fn()
        except Exception as exc:  # a good client's failure is a figure
            self.failures += 1
            self.first_failure = self.first_failure or f"{type(exc).__name__}: {exc}"[:200]
        else:
            self.times.append(time.perf_counter() - start)


def _scrape(url: str) -> None:
    with urllib.request.urlopen(url, timeout=5) as resp:
        if resp.status != 200 or b"kvdepot_capacity_bytes" not in resp.read():
            raise RuntimeError(f"/metrics answered {resp.status} without the figures")


def connect_afresh(address: str) -> None:
    """A new cache client connects, says Hello and pings."""
    with CacheClient(address, timeout=5.0) as client:
        client.ping().result(5)


def good_side(targets: Targets, seconds: float, conn: Connection) -> None:
    """Beside the good cache client: a /metrics scraper (every 0.25 s) and a client that connects
    afresh over ipc (every 0.5 s); their tallies are sent on `conn`."""
    end = time.monotonic() + seconds
    scrapes, fresh = Tally(), Tally()

    def loop(tally: Tally, fn: Callable[[], None], pause: float) -> None:
        while time.monotonic() < end:
            tally.time(fn)
            time.sleep(pause)

    threads = [
        threading.Thread(target=loop, args=(scrapes, lambda: _scrape(targets.metrics_url), 0.25)),
        threading.Thread(target=loop, args=(fresh, lambda: connect_afresh(targets.address), 0.5)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    conn.send({"scrapes": scrapes, "fresh": fresh})
    conn.close()
