"""A flood of frames that are not requests against a real `kvdepot serve` (issue 45, finding 7): what
it costs is bounded per peer, the memory goes back once its peers leave, and a good client is
answered in between, not after every flood frame queued before its request."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from kvdepot.server import ServerProcess
from kvdepot.transport import CacheClient
from kvdepot.transport._dispatch import MAX_FRAMES_PER_MESSAGE
from kvdepot.transport._flood import MAX_BAD_FRAMES

pytestmark = pytest.mark.integration

T = 10.0
#: How long an outcome is waited for: on the code before the fix, the server answered a flood's
#: queue (a thousand messages per peer) frame by frame long after the peers had gone.
OUTCOME_S = 90.0
PEERS = 4
#: Messages of `MAX_FRAMES_PER_MESSAGE` one-byte frames each peer sends: 2.4 M frames in all, held
#: at 64 bytes or more apiece by libzmq while queued (about 150 MiB).
MESSAGES = 150
#: How far above its RSS before the flood the server may stay once the flood's peers left: the
#: flood's queues at their bound (16 messages per peer, 16 MiB for these four), with room to spare.
#: The code before the fix kept 65-110 MiB of a smaller flood for good.
RSS_BOUND = 32 << 20


@pytest.fixture
def server(short_tmp: Path) -> Iterator[ServerProcess]:
    args = ["--no-metrics", "--page-size", "1MiB", "--pool-dir", str(short_tmp)]
    with ServerProcess(f"ipc://{short_tmp}/kvd.sock", capacity="8MiB", args=args) as proc:
        yield proc


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _wait_until(predicate, timeout: float = OUTCOME_S) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


@contextlib.contextmanager
def _flooders(address: str) -> Iterator[list[zmq.Socket]]:
    """Raw DEALERs that send no Hello; what they send queues on their side until the server takes it."""
    ctx = zmq.Context()
    socks = []
    try:
        for _ in range(PEERS):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.connect(address)
            socks.append(sock)
        yield socks
    finally:
        for sock in socks:
            sock.close(0)
        ctx.term()


def _drain(socks: list[zmq.Socket]) -> None:
    """Reads what the server answered the flooders (they read their replies: only the flood is hostile)."""
    for sock in socks:
        while sock.poll(0):
            sock.recv_multipart()


def _taken_in(extra: dict, before: dict) -> int:
    """Messages the server took in since `before`: handled, or discarded unread."""
    names = ("transport_messages", "transport_bad_discarded", "transport_unread_discarded")
    return sum(extra.get(name, 0) - before.get(name, 0) for name in names)


def test_a_flood_of_one_byte_frames_is_bounded_per_peer_and_its_memory_goes_back(server):
    """Four raw peers each send 150 messages of 4,096 one-byte frames (2.4 M frames: about 150 MiB
    while libzmq queues them) and read their replies. Each peer is muted once it passes the
    bad-frame bound (counted in `peers_muted`, its messages in `bad_discarded`), and once the peers
    have closed and a good client is answered, the server's RSS comes back within `RSS_BOUND` of
    where it was before the flood, the freed memory given back to the system (`memory_trims`)."""
    with CacheClient(server.address, timeout=T) as good:
        good.ping().result(T)
        before = good.stats().result(T).extra
        rss_before = _rss(server.pid)
        message = [b"\x00"] * MAX_FRAMES_PER_MESSAGE
        with _flooders(server.address) as socks:
            for _ in range(MESSAGES):
                for sock in socks:
                    sock.send_multipart(message)
                _drain(socks)

            def taken() -> bool:
                _drain(socks)
                return _taken_in(good.stats().result(OUTCOME_S).extra, before) >= PEERS * MESSAGES

            assert _wait_until(taken), "the server did not take the flood in"
        good.ping().result(OUTCOME_S)
        assert _wait_until(lambda: good.stats().result(T).extra.get("transport_memory_trims")), (
            "the server did not give memory back"
        )
        assert _wait_until(lambda: _rss(server.pid) - rss_before < RSS_BOUND), (
            f"the server kept {(_rss(server.pid) - rss_before) >> 20} MiB more than before the flood"
        )
        extra = good.stats().result(T).extra
    assert extra["transport_peers_muted"] >= PEERS
    assert extra["transport_bad_discarded"] > 0


def test_a_good_client_is_answered_between_the_flood_messages_of_each_peer(server):
    """While four raw peers keep the server's queue full of messages of 4,096 one-byte frames, a
    good client's requests are answered, each after at most one flood message per peer, of which
    the server answers at most `MAX_BAD_FRAMES` + 1 frames: a peer past the bound is read and
    dropped, not answered frame by frame (before, every frame of every message queued ahead was
    decoded and answered: 16,384 per turn of four peers, and a ping waited up to 1.7 s)."""
    message = [b"\x00"] * MAX_FRAMES_PER_MESSAGE
    with CacheClient(server.address, timeout=OUTCOME_S) as good, _flooders(server.address) as socks:
        good.ping().result(T)
        for _ in range(8):  # the server's queue for each peer (16 messages) and the socket's fill
            for sock in socks:
                sock.send_multipart(message)
        handled = []
        last = good.stats().result(OUTCOME_S).extra["transport_requests"]
        for _ in range(8):
            for sock in socks:
                sock.send_multipart(message)
            _drain(socks)
            now = good.stats().result(OUTCOME_S).extra["transport_requests"]
            handled.append(now - last - 1)  # less the Stats request itself
            last = now
        good.ping().result(OUTCOME_S)
    assert max(handled) <= PEERS * (MAX_BAD_FRAMES + 1), f"flood frames answered between two requests: {handled}"


def test_flood_bounds_are_flags_and_zero_is_refused(short_tmp):
    """`--peer-queue`, `--max-bad-frames` and `--trim-after` are `kvdepot serve` flags; 0 is a usage error."""
    import subprocess
    import sys

    for flag in ("--peer-queue", "--max-bad-frames", "--trim-after"):
        command = [sys.executable, "-m", "kvdepot.server", "serve", "--address", f"ipc://{short_tmp}/x.sock",
                   "--no-metrics", "--pool-dir", str(short_tmp), flag, "0"]  # fmt: skip
        proc = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
        assert proc.returncode == 2, proc.stderr
        assert flag in proc.stderr
        assert "unrecognized" not in proc.stderr
        assert "must be" in proc.stderr
