"""The server's own memory and time stay bounded whatever a client sends (issue: a hardened server).

Each test runs a real `kvdepot serve` process and drives it as a careless or hostile client would.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import zmq

from kvdepot.server import fetch_stats
from kvdepot.transport import PROTOCOL_VERSION, CacheClient
from kvdepot.transport._codec import decode_reply, encode_request
from kvdepot.transport._messages import Hello, HelloReply, Request

pytestmark = pytest.mark.integration

SMALL_POOL = ["--capacity", "4MiB", "--page-size", "1MiB"]
T = 5.0


def test_hellos_with_ever_new_client_ids_keep_one_session(serve):
    """One connection that greets again and again under new client ids (session churn) holds one
    session: each new id replaces the old one's, which is freed."""
    server = serve(*SMALL_POOL)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.address)
    try:
        for i in range(3000):
            sock.send(encode_request(Request(i + 1, Hello(PROTOCOL_VERSION, os.urandom(16).hex(), "churn"))))
            assert sock.poll(int(T * 1000)), "no reply to Hello"
            assert isinstance(decode_reply(sock.recv()).body, HelloReply)
        assert fetch_stats(server.address, timeout=T).clients <= 2  # the churner's last id, and this query
    finally:
        sock.close(0)
        ctx.term()


def test_a_peer_cannot_pose_as_the_servers_own_tier_session(serve, workdir):
    """A Hello under a reserved client id (`kvdepot/...`, the id of the session that pins chunks
    for the write-behind) is refused with a typed error, so the peer cannot end that session; the
    server keeps writing committed chunks to its disk tier."""
    import time

    from kvdepot.transport import RESERVED_CLIENT_PREFIX
    from kvdepot.transport._messages import EndSession, ErrorReply

    server = serve(*SMALL_POOL, "--disk-dir", str(workdir / "disk"), "--disk-capacity", "64MiB")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.address)
    try:
        for i, body in enumerate([Hello(PROTOCOL_VERSION, f"{RESERVED_CLIENT_PREFIX}tiers", "poser"), EndSession()]):
            sock.send(encode_request(Request(i + 1, body)))
            assert sock.poll(int(T * 1000)), "no reply"
            reply = decode_reply(sock.recv()).body
            assert isinstance(reply, ErrorReply)
            assert reply.code == ("invalid_argument" if i == 0 else "hello_required")
    finally:
        sock.close(0)
        ctx.term()
    with CacheClient(server.address, timeout=T) as client:
        client.register("layout", 256, 4096).result(T)
        res = client.reserve("s", [bytes([i]) * 32 for i in range(4)], 4096).result(T)
        client.commit(res.reservation_id).result(T)
    deadline = time.monotonic() + 20
    while fetch_stats(server.address, timeout=T).extra.get("tier:disk:objects") != 4:
        assert time.monotonic() < deadline, "the committed chunks were not written behind"
        time.sleep(0.1)


@pytest.mark.parametrize("capacity", ["99999TiB", "9" * 400])
def test_an_impossible_capacity_is_refused_at_once_with_a_message(workdir, capacity):
    """A capacity beyond the shared-memory filesystem, or a number too large to be one, exits 2 at once
    with a message naming the flag, before anything is built."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvdepot.server",
            "serve",
            "--address",
            f"ipc://{workdir}/s.sock",
            "--capacity",
            capacity,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert "--capacity" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_tiny_chunks_cannot_grow_the_server_past_a_bound(serve):
    """A client that registers 1-byte chunks gets slots of at least MIN_SLOT_BYTES, so the number of
    chunks (and the server's memory for them) is bounded by the pool's size."""
    from kvdepot.server import MIN_SLOT_BYTES

    server = serve(*SMALL_POOL)
    with CacheClient(server.address, timeout=T) as client:
        reply = client.register("tiny", 256, 1).result(T)
        assert reply.chunk_size == 256  # accepted, but each chunk takes a whole minimal slot
        for _ in range(64):  # the pool holds at most a few thousand: well before 64 Ki, it evicts
            res = client.reserve("", [os.urandom(32) for _ in range(1024)], 1).result(T)
            client.commit(res.reservation_id).result(T)
        stats = client.stats().result(T)
    assert stats.chunks <= stats.capacity_bytes // MIN_SLOT_BYTES


def test_a_truncated_pool_stops_the_server_with_a_message(serve):
    """When someone truncates the pool file under a live server, the server stops serving it (exit 1,
    a logged reason) instead of leasing slots that would kill its clients with SIGBUS."""
    server = serve(*SMALL_POOL)
    with CacheClient(server.address, timeout=T) as client:
        pool = client.register("layout", 256, 1000).result(T).pool
        os.truncate(pool.path, 0)
        assert server.proc.wait(10) == 1
    assert "truncated" in server.read_log()


def test_many_salts_keep_stats_small(serve):
    """With thousands of salts, `kvdepot stats` still answers: the salts holding the most bytes are
    listed, and all are counted."""
    server = serve("--capacity", "32MiB")
    with CacheClient(server.address, timeout=T) as client:
        client.register("layout", 256, 1000).result(T)
        salts = [f"tenant-{i}" for i in range(5000)]
        with client.batch() as batch:
            reserves = [batch.reserve(salt, [b"\x01" * 32], 1000) for salt in salts]
        with client.batch() as batch:
            for future in reserves:
                batch.commit(future.result(T).reservation_id)
        stats = client.stats().result(T)
    assert stats.extra["salts"] == 5000
    assert len(stats.salt_bytes) == 1000
    proc = subprocess.run(
        [sys.executable, "-m", "kvdepot.server", "stats", "--address", server.address],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr


@contextlib.contextmanager
def _deaf_peer(address: str) -> Iterator[zmq.Socket]:
    """A raw peer that said Hello and never reads a reply: its replies pile up on the server's side."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt(zmq.RCVBUF, 4096)
    sock.connect(address)
    try:
        sock.send(encode_request(Request(1, Hello(PROTOCOL_VERSION, os.urandom(16).hex(), "deaf"))))
        yield sock
    finally:
        sock.close(0)
        ctx.term()


def test_a_peer_that_never_reads_its_replies_is_dropped_and_memory_stays_bounded(serve):
    """A peer that sends requests without reading a reply costs the server a bounded amount of replies:
    it is dropped when its queue is full, another client is served meanwhile, and a stop is prompt."""
    import signal
    import time

    from kvdepot.transport._messages import Stats

    server = serve(*SMALL_POOL)
    with CacheClient(server.address, timeout=T) as client:  # many salts: each Stats reply is ~40 KiB
        client.register("layout", 256, 960).result(T)
        with client.batch() as batch:
            reserves = [batch.reserve(f"tenant-{i}", [b"\x01" * 32], 960) for i in range(1000)]
        with client.batch() as batch:
            for future in reserves:
                batch.commit(future.result(T).reservation_id)
    rss_before = server.rss()
    with _deaf_peer(server.address) as sock:
        for i in range(20_000):  # 20,000 x ~40 KiB = 800 MB of replies if nothing bounded them
            sock.send(encode_request(Request(i + 2, Stats())))
        with CacheClient(server.address, timeout=T) as good:
            assert good.stats().result(T).chunks == 1000  # served while the flood is handled
        deadline = time.monotonic() + 60
        while "peer_dropped" not in server.read_log():
            assert time.monotonic() < deadline, "the peer that never reads was not dropped"
            time.sleep(0.2)
        growth = server.rss() - rss_before
        assert growth < 160 << 20, f"the server grew by {growth >> 20} MiB for replies nobody read"
        with CacheClient(server.address, timeout=T) as good:
            extra = good.stats().result(T).extra
        # Once dropped, the peer is muted a while: the rest of its flood is discarded unread,
        # not answered and logged message by message.
        assert extra["transport_unread_discarded"] > 10_000
        assert server.read_log().count("peer_dropped") < 20
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(10) == 0  # a hang guard: a clean exit, whatever the peer left queued


def test_unread_batched_replies_are_bounded_in_bytes_not_messages(serve, wait_until):
    """A peer that sends Stats requests a thousand to a message and never reads (each message asked
    for 37 MiB of replies: 128 KB of requests grew the server by 338 MiB) is dropped at
    MAX_UNREAD_BYTES: the server's memory stays within a few MiB of that, its session is forgotten,
    and a good client is served and finds what it stored before."""
    from kvdepot.transport._messages import Stats

    per_message, messages = 1000, 8
    server = serve(*SMALL_POOL)
    keys = [bytes([i % 256, i // 256]) * 16 for i in range(1000)]
    with CacheClient(server.address, timeout=T) as good:  # many salts: each Stats reply is ~37 KiB
        good.register("layout", 256, 960).result(T)
        with good.batch() as batch:
            reserves = [batch.reserve(f"tenant-{i}", [key], 960) for i, key in enumerate(keys)]
        with good.batch() as batch:
            for future in reserves:
                batch.commit(future.result(T).reservation_id)
        before = good.stats().result(T).extra
        rss_before = server.rss()
        with _deaf_peer(server.address) as sock:
            for m in range(messages):
                sock.send_multipart(
                    [encode_request(Request(2 + m * per_message + i, Stats())) for i in range(per_message)]
                )

            def received() -> int:
                """Stats frames of the peer the server took in: handled, refused, or in discarded messages."""
                extra = good.stats().result(T).extra
                delta = {name: extra[f"transport_{name}"] - before[f"transport_{name}"] for name in
                         ("requests", "too_large", "unread_discarded")}  # fmt: skip
                return delta["requests"] + delta["too_large"] + per_message * delta["unread_discarded"]

            assert wait_until(lambda: received() >= messages * per_message, 60), "the flood was not taken in"
            growth = server.rss() - rss_before
            stats = good.stats().result(T)
            (found,) = good.lookup([("tenant-7", [keys[7]])]).result(T).results
    # MAX_UNREAD_BYTES (4 MiB) and the last reply messages queued before the drop, with room to spare
    assert growth < 64 << 20, f"the server grew by {growth >> 20} MiB for replies nobody read"
    assert stats.extra["transport_peers_dropped"] >= 1
    assert "peer_dropped" in server.read_log()
    assert stats.clients == 1  # the dropped peer's session is gone; the good client's lives
    assert found.num_hits == 1
    assert stats.chunks == 1000


def test_over_tcp_a_peer_without_the_secret_gets_nothing_through(workdir):
    """With a shared secret on tcp, the handshake checks it: a peer without it cannot make the server
    buffer anything (48 MiB of frames leave its memory flat), while a client with it is served."""
    import signal
    import socket
    import time

    secret = workdir / "secret"
    secret.write_text("s3cret\n")
    secret.chmod(0o600)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    command = [sys.executable, "-m", "kvdepot.server", "serve", "--address", address, "--no-metrics",
               "--capacity", "4MiB", "--auth-secret-file", str(secret), "--pool-dir", str(workdir)]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ctx = zmq.Context()
    try:
        with CacheClient(address, timeout=20.0, auth_secret="s3cret") as owner:
            assert owner.stats().result(20).capacity_bytes > 0
            rss_before = _rss(proc.pid)
            intruder = ctx.socket(zmq.DEALER)
            intruder.setsockopt(zmq.LINGER, 0)
            intruder.setsockopt(zmq.SNDTIMEO, 2000)
            intruder.connect(address)
            try:
                for _ in range(6):
                    with contextlib.suppress(zmq.Again):  # once the handshake failed, there is no pipe at all
                        intruder.send(os.urandom(8 << 20), zmq.SNDMORE)  # never terminated
                time.sleep(2)
                assert not intruder.poll(100)
                assert _rss(proc.pid) - rss_before < 24 << 20
                assert owner.stats().result(T).capacity_bytes > 0  # the owner is still served
            finally:
                intruder.close(0)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)
        ctx.term()


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def test_default_quota_flag_bounds_a_salt_without_its_own(serve):
    """`kvdepot serve --default-quota` limits every salt that has no quota of its own."""
    server = serve(*SMALL_POOL, "--default-quota", "128KiB")
    with CacheClient(server.address, timeout=T) as client:
        client.register("layout", 256, 64 * 1024 - 64).result(T)
        for _ in range(8):
            res = client.reserve("tenant", [os.urandom(32)], 64 * 1024 - 64).result(T)
            client.commit(res.reservation_id).result(T)
        assert client.stats().result(T).salt_bytes == {"tenant": 128 * 1024}


def test_a_client_switching_to_fresh_salts_cannot_evict_another_clients_share(serve):
    """Fair shares hold across salts: a client that stores under ever new salts (each within the
    default quota) evicts its own oldest chunks once it holds its share of the pool, never the chunks
    another live client keeps within its own share."""
    server = serve(*SMALL_POOL, "--default-quota", "256KiB")
    chunk = 64 * 1024 - 64  # one 64 KiB slot: 64 of them fill the 4 MiB pool
    with CacheClient(server.address, timeout=T) as good, CacheClient(server.address, timeout=T) as greedy:
        for client in (good, greedy):
            client.register("layout", 256, chunk).result(T)
        good.set_quota("good", 1 << 20).result(T)  # its own quota, above the default
        kept = [os.urandom(32) for _ in range(16)]  # a quarter of the pool, under a half share
        res = good.reserve("good", kept, chunk).result(T)
        assert len(res.slots) == 16
        good.commit(res.reservation_id).result(T)
        for i in range(200):  # three times the pool, four chunks per fresh salt
            res = greedy.reserve(f"fresh-{i}", [os.urandom(32) for _ in range(4)], chunk).result(T)
            greedy.commit(res.reservation_id).result(T)
        (hit,) = good.lookup([("good", kept)]).result(T).results
        assert hit.num_hits == 16  # every chunk of the good client is still there
        good.release([hit.lease_id]).result(T)
        stats = good.stats().result(T)
    assert stats.used_bytes <= stats.capacity_bytes
    assert stats.salt_bytes["good"] == 16 * 64 * 1024


def test_a_huge_clear_is_split_so_other_clients_are_served_in_between(serve):
    """Clear removes at most CLEAR_SLICE chunks per request and says whether more are left;
    CacheClient.clear_all repeats it, and a lookup sent meanwhile by another client is answered."""
    from kvdepot.server import CLEAR_SLICE

    server = serve("--capacity", "64MiB", "--page-size", "1MiB")
    total = 3 * CLEAR_SLICE // 2
    with CacheClient(server.address, timeout=T) as admin, CacheClient(server.address, timeout=T) as other:
        admin.register("tiny", 256, 1).result(T)
        other.register("tiny", 256, 1).result(T)
        for start in range(0, total, 4096):
            res = admin.reserve("", [os.urandom(32) for _ in range(min(4096, total - start))], 1).result(T)
            admin.commit(res.reservation_id).result(T)
        assert admin.stats().result(T).chunks == total
        first = admin.clear().result(T)
        assert (first.removed, first.more) == (CLEAR_SLICE, True)
        assert other.lookup([("", [os.urandom(32)])]).result(T).results[0].num_hits == 0  # served between
        assert admin.clear_all() == total - CLEAR_SLICE
        assert admin.stats().result(T).chunks == 0
