# ruff: noqa: PT017, PT018, S106
# (a conformance suite outside pytest: plain asserts carry the checks, and secrets are test values)
"""Test support: test doubles (`DictHandler`, `MemoryServerEndpoint`), transport pairs, raw
peers, and the `check_transport` conformance suite.

Every transport (ZMQ over ipc or tcp, in memory) must pass `check_transport(make_pair)`,
where `make_pair()` returns a fresh, unstarted `TransportPair`. Each check is also in
`CHECKS`, so a test module can parametrize over them and see each result on its own::

    @pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
    def test_memory_transport(check):
        check(MemoryPair)
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

import zmq

from kvdepot.transport._cache_client import CacheClient
from kvdepot.transport._codec import encode
from kvdepot.transport._dict_handler import DictHandler
from kvdepot.transport._endpoints import open_endpoint
from kvdepot.transport._errors import (
    DeadlineExceededError,
    InternalServerError,
    NotRegisteredError,
    TransportBrokenError,
    UnauthorizedError,
    UnknownReservationError,
)
from kvdepot.transport._handler import Handler
from kvdepot.transport._memory import MemoryRawPeer, MemoryServerEndpoint
from kvdepot.transport._messages import (
    PROTOCOL_VERSION,
    ErrorReply,
    Hello,
    Ping,
    Pong,
    QuotaReply,
    Reply,
    Request,
    SetQuota,
    Stats,
    StatsReply,
)
from kvdepot.transport._server import ServerEndpoint

__all__ = [
    "CHECKS",
    "DictHandler",
    "MemoryPair",
    "MemoryServerEndpoint",
    "RawPeer",
    "TransportPair",
    "ZmqPair",
    "check_transport",
    "hello_frame",
    "key",
    "wait_until",
]

# Receives in checks never wait longer than this (seconds).
RECV_TIMEOUT = 5.0


class RawPeer(Protocol):
    """A bare peer sending raw frames, for feeding a server bad input."""

    def send(self, frames: list[bytes]) -> None: ...

    def recv(self, timeout: float) -> list[bytes] | None: ...

    def close(self) -> None: ...


def key(i: int, tag: str = "") -> bytes:
    """A 32-byte chunk key for tests."""
    import hashlib

    return hashlib.sha256(f"{tag}:{i}".encode()).digest()


def hello_frame(request_id: int, client_id: str, version: int = PROTOCOL_VERSION, auth: str = "") -> bytes:
    """An encoded Hello request."""
    return encode(Request(request_id, Hello(version, client_id, "raw", auth)))


def wait_until(predicate: Callable[[], bool], timeout: float = RECV_TIMEOUT, interval: float = 0.01) -> bool:
    """Polls `predicate` until it holds or `timeout` passes; returns its last value."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return predicate()
        time.sleep(interval)
    return True


def _reply(frame: bytes) -> Reply:
    from kvdepot.transport._codec import decode_reply

    return decode_reply(frame)


class TransportPair:
    """A server address plus ways to serve it, restart it, and reach it (clients, raw peers)."""

    address: str

    def __init__(self) -> None:
        self.endpoint: ServerEndpoint | None = None
        self._thread: threading.Thread | None = None
        self._clients: list[CacheClient] = []
        self._raws: list[RawPeer] = []

    def start_server(self, handler: Handler, **kwargs: Any) -> ServerEndpoint:
        """Binds a server endpoint at `address` and serves it in a background thread."""
        endpoint = open_endpoint(self.address, handler, **kwargs)
        self.address = endpoint.address  # tcp port 0 resolves here; restarts reuse the port
        self.endpoint = endpoint
        self._thread = threading.Thread(target=endpoint.serve_forever, name="kvdepot-test-server", daemon=True)
        self._thread.start()
        return endpoint

    def stop_server(self) -> None:
        """Stops and closes the server (clients stay, and will reconnect to the next one)."""
        if self.endpoint is not None:
            self.endpoint.close()
            if self._thread is not None:
                self._thread.join(RECV_TIMEOUT)
            self.endpoint = None

    def client(self, **kwargs: Any) -> CacheClient:
        """A CacheClient of this address, closed with the pair."""
        kwargs.setdefault("timeout", RECV_TIMEOUT)
        client = CacheClient(self.address, **kwargs)
        self._clients.append(client)
        return client

    def raw_peer(self) -> RawPeer:
        """A bare peer of this address."""
        raise NotImplementedError

    def close(self) -> None:
        """Closes every client, raw peer and the server."""
        for client in self._clients:
            client.close(end_session=False)
        for raw in self._raws:
            raw.close()
        self.stop_server()

    def __enter__(self) -> TransportPair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _ZmqRawPeer:
    def __init__(self, address: str) -> None:
        self._ctx: zmq.Context[Any] = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTING_ID, os.urandom(16).hex().encode())
        self._sock.connect(address)

    def send(self, frames: list[bytes]) -> None:
        self._sock.send_multipart(frames)

    def recv(self, timeout: float) -> list[bytes] | None:
        if not self._sock.poll(int(timeout * 1000)):
            return None
        return list(self._sock.recv_multipart())

    def close(self) -> None:
        self._sock.close(0)
        self._ctx.term()


class ZmqPair(TransportPair):
    """A ZMQ address: a fresh ipc socket in a private temp directory unless given one."""

    def __init__(self, address: str | None = None) -> None:
        super().__init__()
        if address is None:
            import tempfile

            address = f"ipc://{tempfile.mkdtemp(prefix='kvt-')}/kvdepot.sock"
        self.address = address

    def raw_peer(self) -> RawPeer:
        raw = _ZmqRawPeer(self.address)
        self._raws.append(raw)
        return raw


class MemoryPair(TransportPair):
    """A fresh memory:// address."""

    def __init__(self) -> None:
        super().__init__()
        self.address = f"memory://test-{uuid.uuid4().hex}"

    def raw_peer(self) -> RawPeer:
        raw = MemoryRawPeer(self.address, os.urandom(16).hex().encode())
        self._raws.append(raw)
        return raw


MakePair = Callable[[], TransportPair]


# --- the checks -------------------------------------------------------------------------


def check_ordering(make_pair: MakePair) -> None:
    """Pipelined requests of one client run in submission order and each future gets its own reply."""
    with make_pair() as pair:
        pair.start_server(DictHandler())
        client = pair.client()
        futures = [client.set_quota(f"s{i:03d}", i) for i in range(200)]
        for i, fut in enumerate(futures):
            quotas = fut.result(RECV_TIMEOUT).quotas
            assert len(quotas) == i + 1, f"reply {i} saw {len(quotas)} quotas: out of order"
            assert quotas[f"s{i:03d}"] == i


def check_one_reply_per_request(make_pair: MakePair) -> None:
    """A message of N frames, good and bad mixed, gets one message of N replies with matching ids."""
    with make_pair() as pair:
        pair.start_server(DictHandler())
        raw = pair.raw_peer()
        raw.send([hello_frame(1, "raw-one")])
        hello = raw.recv(RECV_TIMEOUT)
        assert hello is not None and len(hello) == 1
        good = encode(Request(10, Ping()))
        frames = [
            good,
            b"\xff\x00garbage",
            encode(Request(12, Stats())),
            good[:-1],
            encode(Reply(14, Pong())),  # a reply where a request belongs
        ]
        raw.send(frames)
        replies = raw.recv(RECV_TIMEOUT)
        assert replies is not None, "no reply to a mixed message"
        assert len(replies) == len(frames), f"{len(frames)} requests got {len(replies)} replies"
        decoded = [_reply(f) for f in replies]
        assert decoded[0].id == 10 and isinstance(decoded[0].body, Pong)
        assert isinstance(decoded[1].body, ErrorReply) and decoded[1].body.code == "protocol"
        assert decoded[2].id == 12 and isinstance(decoded[2].body, StatsReply)
        assert isinstance(decoded[3].body, ErrorReply) and decoded[3].body.code == "protocol"
        assert decoded[4].id == 14 and isinstance(decoded[4].body, ErrorReply)
        assert raw.recv(0.05) is None, "more replies than requests"


def check_deadlines(make_pair: MakePair) -> None:
    """No server, or a reply held back, fails the future at its deadline with a clear error."""
    with make_pair() as pair:
        lonely = pair.client(timeout=0.3)
        try:
            lonely.ping().result(RECV_TIMEOUT)
            raise AssertionError("a ping with no server succeeded")
        except DeadlineExceededError as exc:
            assert pair.address in str(exc) and "kvdepot serve" in str(exc), str(exc)
        handler = DictHandler()
        handler.gate = threading.Event()
        pair.start_server(handler)
        client = pair.client(timeout=0.3)
        assert isinstance(client.ping().result(RECV_TIMEOUT), Pong)
        try:
            client.stats().result(RECV_TIMEOUT)
            raise AssertionError("a held-back reply arrived before its deadline")
        except DeadlineExceededError as exc:
            assert exc.request == "Stats"
        handler.gate.set()
        assert isinstance(client.ping().result(RECV_TIMEOUT), Pong), "the server stopped answering"
        assert wait_until(lambda: client.counters["late_replies"] >= 1), "the late reply was not dropped"


def check_peer_death(make_pair: MakePair) -> None:
    """Silent peers are reported gone once; live ones and those that ended their session are not."""
    with make_pair() as pair:
        handler = DictHandler()
        pair.start_server(handler, peer_timeout=0.5)
        live = pair.client(heartbeat_interval=0.1)
        leaving = pair.client(heartbeat_interval=0.1)
        dying = pair.client(heartbeat_interval=0.1)
        for c in (live, leaving, dying):
            c.ping().result(RECV_TIMEOUT)
        raw = pair.raw_peer()
        raw.send([hello_frame(1, "raw-silent")])
        assert raw.recv(RECV_TIMEOUT) is not None
        leaving.end_session().result(RECV_TIMEOUT)
        dying.close(end_session=False)
        assert wait_until(lambda: {"raw-silent", dying.client_id} <= set(handler.gone)), handler.gone
        time.sleep(0.6)  # longer than peer_timeout: the heartbeating client must still be alive
        assert live.client_id not in handler.gone
        assert leaving.client_id not in handler.gone, "a peer that ended its session was reported gone"
        assert handler.gone.count(dying.client_id) == 1


def check_reconnection(make_pair: MakePair) -> None:
    """After a server restart the client says Hello and Register again by itself and keeps working."""
    with make_pair() as pair:
        first = DictHandler()
        pair.start_server(first)
        reconnects: list[Any] = []
        client = pair.client(timeout=2.0, on_reconnect=lambda h, r: reconnects.append((h, r)))
        client.register("layout-a", 256, 4096).result(RECV_TIMEOUT)
        assert client.lookup([("s", [key(1)])]).result(RECV_TIMEOUT).results[0].num_hits == 0
        pair.stop_server()
        second = DictHandler()
        pair.start_server(second)
        assert wait_until(lambda: bool(reconnects)), "on_reconnect was not called"
        reply = client.lookup([("s", [key(1)])]).result(RECV_TIMEOUT)  # needs the re-Register
        assert reply.results[0].num_hits == 0
        assert second.seen_types(client.client_id)[:2] == ["Hello", "Register"], second.seen_types()
        assert second.registered[client.client_id].layout == "layout-a"
        hello_reply, register_reply = reconnects[-1]
        assert hello_reply.server_id == second.server_id and register_reply is not None


def check_broken_in_flight(make_pair: MakePair) -> None:
    """A request in flight when the server goes away fails with TransportBrokenError at once."""
    with make_pair() as pair:
        endpoint = open_endpoint(pair.address, DictHandler())  # polled by hand, never answers Stats
        try:
            client = CacheClient(endpoint.address, timeout=30.0)
            hello = client.ping()
            deadline = time.monotonic() + RECV_TIMEOUT
            while not hello.done() and time.monotonic() < deadline:
                endpoint.poll_once(0.05)
            assert isinstance(hello.result(0), Pong)
            fut: Future[Any] = client.stats()
            time.sleep(0.1)  # let it reach the server's queue
        finally:
            endpoint.close()
        try:
            fut.result(RECV_TIMEOUT)
        except TransportBrokenError as exc:
            assert endpoint.address in str(exc)
        else:
            raise AssertionError("a request survived its server")
        finally:
            client.close(end_session=False)


def check_bad_frames(make_pair: MakePair) -> None:
    """Oversized, malformed, wrong-version and un-greeted frames get typed errors; others are unaffected."""
    with make_pair() as pair:
        endpoint = pair.start_server(DictHandler(), max_frame_bytes=4096)
        good = pair.client()
        good.ping().result(RECV_TIMEOUT)
        raw = pair.raw_peer()

        def ask(frame: bytes) -> Reply:
            raw.send([frame])
            got = raw.recv(RECV_TIMEOUT)
            assert got is not None and len(got) == 1, "no single reply to a bad frame"
            return _reply(got[0])

        before = endpoint.counters["bad_frames"]
        first = ask(encode(Request(3, Ping())))
        assert isinstance(first.body, ErrorReply) and first.body.code == "hello_required"
        mismatch = ask(hello_frame(4, "raw-x", version=PROTOCOL_VERSION + 98))
        assert isinstance(mismatch.body, ErrorReply) and mismatch.body.code == "version_mismatch"
        assert str(PROTOCOL_VERSION + 98) in mismatch.body.message and str(PROTOCOL_VERSION) in mismatch.body.message
        big = ask(encode(Request(7, SetQuota("x" * 900, 1))) + b"\x00" * 5000)
        assert big.id == 7 and isinstance(big.body, ErrorReply) and big.body.code == "too_large"
        junk = ask(os.urandom(64))
        assert isinstance(junk.body, ErrorReply) and junk.body.code == "protocol"
        assert endpoint.counters["bad_frames"] >= before + 2
        assert isinstance(good.ping().result(RECV_TIMEOUT), Pong), "a good client suffered from a bad one"


def check_concurrency(make_pair: MakePair) -> None:
    """Many threads on one shared client and on their own clients all get their own answers."""
    with make_pair() as pair:
        pair.start_server(DictHandler())
        shared = pair.client()
        errors: list[BaseException] = []

        def work(t: int) -> None:
            try:
                own = pair.client() if t % 2 else shared
                for j in range(60):
                    quotas = own.set_quota(f"t{t}-{j}", j).result(RECV_TIMEOUT).quotas
                    assert quotas[f"t{t}-{j}"] == j
                with own.batch() as batch:
                    futs = [batch.get_quotas() for _ in range(5)]
                assert all(isinstance(f.result(RECV_TIMEOUT), QuotaReply) for f in futs)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(4 * RECV_TIMEOUT)
        assert not errors, errors[:3]
        assert len(shared.get_quotas().result(RECV_TIMEOUT).quotas) == 8 * 60


def check_typed_errors(make_pair: MakePair) -> None:
    """Handler failures reach the caller as typed errors with their fields."""
    with make_pair() as pair:
        handler = DictHandler()
        pair.start_server(handler)
        client = pair.client()
        try:
            client.lookup([("s", [key(1)])]).result(RECV_TIMEOUT)
            raise AssertionError("lookup before register succeeded")
        except NotRegisteredError:
            pass
        client.register("l", 256, 4096).result(RECV_TIMEOUT)
        try:
            client.commit(424242).result(RECV_TIMEOUT)
            raise AssertionError("commit of an unknown reservation succeeded")
        except UnknownReservationError as exc:
            assert exc.reservation_id == 424242
        handler._stats = None  # type: ignore[assignment,method-assign]  # calling None raises TypeError
        try:
            client.stats().result(RECV_TIMEOUT)
            raise AssertionError("a failing handler produced a result")
        except InternalServerError as exc:
            assert "TypeError" in str(exc)
        reserve = client.reserve("s", [key(1), key(2)], 4096).result(RECV_TIMEOUT)
        assert [s.index for s in reserve.slots] == [0, 1]
        assert client.commit(reserve.reservation_id).result(RECV_TIMEOUT).committed == 2
        hits = client.lookup([("s", [key(1), key(2), key(3)]), ("other", [key(1)])]).result(RECV_TIMEOUT)
        assert [r.num_hits for r in hits.results] == [2, 0]


def check_auth(make_pair: MakePair) -> None:
    """A server with a shared secret refuses clients without it and serves those with it."""
    with make_pair() as pair:
        pair.start_server(DictHandler(), auth_secret="s3cret")
        stranger = pair.client(timeout=2.0)
        try:
            stranger.ping().result(RECV_TIMEOUT)
            raise AssertionError("a client without the secret was served")
        except UnauthorizedError:
            pass
        friend = pair.client(auth_secret="s3cret")
        assert isinstance(friend.ping().result(RECV_TIMEOUT), Pong)


def check_batch(make_pair: MakePair) -> None:
    """A batch travels as one message and every request in it gets its own reply."""
    with make_pair() as pair:
        endpoint = pair.start_server(DictHandler())
        client = pair.client()
        client.ping().result(RECV_TIMEOUT)
        before = endpoint.counters
        with client.batch() as batch:
            a = batch.set_quota("a", 1)
            b = batch.set_quota("b", 2)
            c = batch.get_quotas()
        assert a.result(RECV_TIMEOUT).quotas == {"a": 1}
        assert b.result(RECV_TIMEOUT).quotas == {"a": 1, "b": 2}
        assert c.result(RECV_TIMEOUT).quotas == {"a": 1, "b": 2}
        after = endpoint.counters
        assert after["requests"] - before["requests"] >= 3
        assert after["messages"] - before["messages"] < after["requests"] - before["requests"]


CHECKS: list[Callable[[MakePair], None]] = [
    check_ordering,
    check_one_reply_per_request,
    check_deadlines,
    check_peer_death,
    check_reconnection,
    check_broken_in_flight,
    check_bad_frames,
    check_concurrency,
    check_typed_errors,
    check_auth,
    check_batch,
]


def check_transport(make_pair: MakePair) -> None:
    """Runs every check against fresh pairs from `make_pair`; raises AssertionError on the first failure."""
    for check in CHECKS:
        check(make_pair)
