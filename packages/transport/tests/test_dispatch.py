"""Unit tests of the I/O-free server side: Dispatcher and the handler error mapping."""

from __future__ import annotations

from typing import Any

import pytest

import kvdepot.transport as t
from kvdepot.core import InvalidArgumentError
from kvdepot.transport._dispatch import Dispatcher, error_reply_from
from kvdepot.transport.testing import DictHandler


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _ask(d: Dispatcher, identity: bytes, *bodies: Any, request_id: int = 1) -> list[t.Reply]:
    frames = [t.encode_request(t.Request(request_id + i, b)) for i, b in enumerate(bodies)]
    return [t.decode_reply(f) for f in d.dispatch(identity, frames)]


def _hello(client_id: str = "c1") -> t.Hello:
    return t.Hello(t.PROTOCOL_VERSION, client_id)


@pytest.fixture
def clock() -> _Clock:
    return _Clock()


@pytest.fixture
def handler() -> DictHandler:
    return DictHandler()


@pytest.fixture
def disp(handler: DictHandler, clock: _Clock) -> Dispatcher:
    return Dispatcher(handler, clock=clock, peer_timeout=5.0)


def test_requests_before_hello_are_refused(disp: Dispatcher) -> None:
    """A peer that never said Hello gets hello_required and reaches no handler."""
    (reply,) = _ask(disp, b"p", t.Stats())
    assert reply.body == t.ErrorReply("hello_required", reply.body.message)  # type: ignore[union-attr]


def test_version_mismatch_names_both_versions(disp: Dispatcher) -> None:
    """A Hello of another version is refused with both versions in message and fields."""
    (reply,) = _ask(disp, b"p", t.Hello(t.PROTOCOL_VERSION + 1, "c1"))
    body = reply.body
    assert isinstance(body, t.ErrorReply)
    assert body.code == "version_mismatch"
    assert body.fields == {"client_version": t.PROTOCOL_VERSION + 1, "server_version": t.PROTOCOL_VERSION}
    assert not disp.peers


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (t.UnknownLeaseError("x", lease_id=4), "unknown_lease"),
        (InvalidArgumentError("bad", field="n"), "invalid_argument"),
        (t.PoolFullError("full"), "pool_full"),
        (RuntimeError("boom"), "internal"),
        (KeyError("k"), "internal"),
    ],
)
def test_exceptions_become_error_replies(exc: Exception, code: str) -> None:
    """Exceptions with a known code keep it; InvalidArgumentError is invalid_argument; others internal."""
    assert error_reply_from(exc).code == code


def test_handler_exception_and_wrong_reply_type(disp: Dispatcher, handler: DictHandler) -> None:
    """A raising handler and a handler answering with the wrong type both give one error reply."""
    handler._stats = lambda peer, body: t.Pong()  # type: ignore[method-assign]
    handler._clear = lambda peer, body: 1 / 0  # type: ignore[method-assign]
    replies = _ask(disp, b"p", _hello(), t.Stats(), t.Clear(None), t.Ping())
    assert [type(r.body).__name__ for r in replies] == ["HelloReply", "ErrorReply", "ErrorReply", "Pong"]
    assert [r.id for r in replies] == [1, 2, 3, 4]
    assert disp.counters["handler_failures"] == 2


def test_silent_peers_are_gone_once(disp: Dispatcher, handler: DictHandler, clock: _Clock) -> None:
    """expire() reports a peer silent past peer_timeout exactly once, and keeps talking peers."""
    _ask(disp, b"a", _hello("a"))
    _ask(disp, b"b", _hello("b"))
    clock.now += 4.0
    _ask(disp, b"b", t.Ping())
    clock.now += 2.0
    disp.expire()
    disp.expire()
    assert handler.gone == ["a"]
    assert [p.client_id for p in disp.peers.values()] == ["b"]
    assert disp.next_expiry() == pytest.approx(clock.now + 3.0)


def test_end_session_forgets_without_peer_gone(disp: Dispatcher, handler: DictHandler, clock: _Clock) -> None:
    """A peer that ended its session is dropped at once and never reported gone."""
    _ask(disp, b"a", _hello("a"), t.EndSession())
    clock.now += 60
    disp.expire()
    assert handler.gone == []
    assert not disp.peers


def test_auth_secret_is_checked(handler: DictHandler, clock: _Clock) -> None:
    """With a secret, a Hello without it is unauthorized and one with it is welcome."""
    d = Dispatcher(handler, clock=clock, auth_secret="pw")
    (bad,) = _ask(d, b"a", t.Hello(t.PROTOCOL_VERSION, "a", "", "nope"))
    (good,) = _ask(d, b"b", t.Hello(t.PROTOCOL_VERSION, "b", "", "pw"))
    assert isinstance(bad.body, t.ErrorReply)
    assert bad.body.code == "unauthorized"
    assert isinstance(good.body, t.HelloReply)


def test_too_many_frames_in_one_message(disp: Dispatcher) -> None:
    """A message beyond the frame-count bound is answered with a single protocol error."""
    frames = [b"x"] * 5000
    (reply,) = disp.dispatch(b"p", frames)
    body = t.decode_reply(reply).body
    assert isinstance(body, t.ErrorReply)
    assert body.code == "protocol"


def test_one_message_carries_a_bounded_amount_of_requests(disp: Dispatcher, monkeypatch: pytest.MonkeyPatch) -> None:
    """Frames past MAX_MESSAGE_BYTES of one message are answered too_large, each with its own id, and
    not run; the first frame always runs, and the next message starts afresh."""
    ping = t.Ping()
    size = len(t.encode_request(t.Request(10, ping)))
    monkeypatch.setattr("kvdepot.transport._dispatch.MAX_MESSAGE_BYTES", 2 * size)
    (hello,) = _ask(disp, b"p", _hello())
    assert isinstance(hello.body, t.HelloReply)
    replies = _ask(disp, b"p", ping, ping, ping, ping, request_id=10)
    assert [r.id for r in replies] == [10, 11, 12, 13]
    codes = [getattr(r.body, "code", "ok") for r in replies]
    assert codes == ["ok", "ok", "too_large", "too_large"]
    assert [getattr(r.body, "code", "ok") for r in _ask(disp, b"p", ping, request_id=20)] == ["ok"]


def test_one_message_builds_a_bounded_amount_of_replies(disp: Dispatcher, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the replies built for one message pass MAX_MESSAGE_BYTES, its remaining frames are answered
    too_large and not run, however small the requests: a batch of small requests asking for large
    replies cannot make the server build one huge reply message."""
    _ask(disp, b"p", _hello())
    (stats,) = disp.dispatch(b"p", [t.encode_request(t.Request(2, t.Stats()))])
    request = len(t.encode_request(t.Request(10, t.Stats())))
    assert len(stats) > 2 * request  # a reply larger than its request
    monkeypatch.setattr("kvdepot.transport._dispatch.MAX_MESSAGE_BYTES", 2 * len(stats))
    replies = _ask(disp, b"p", *[t.Stats()] * 4, request_id=10)
    assert [r.id for r in replies] == [10, 11, 12, 13]
    assert [getattr(r.body, "code", "ok") for r in replies] == ["ok", "ok", "too_large", "too_large"]


class _WorkHandler(DictHandler):
    """A DictHandler whose Changes requests cost a message's budget in proportion to their limit."""

    def __init__(self) -> None:
        super().__init__()
        self.handled: list[str] = []

    def work(self, body: Any) -> int:
        return body.limit if isinstance(body, t.Changes) else 0

    def handle(self, peer: t.PeerInfo, body: Any) -> Any:
        self.handled.append(type(body).__name__)
        if isinstance(body, t.Changes):
            return t.ChangesReply([], body.since)
        return super().handle(peer, body)


def test_a_request_is_charged_the_work_its_handler_names(clock: _Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    """A handler's `work` is charged to its message's budget besides the request's bytes: requests
    past the budget are answered too_large unhandled (counted as work_refused), the first frame
    always runs, and a cheap request after the refused ones still runs."""
    handler = _WorkHandler()
    disp = Dispatcher(handler, clock=clock, peer_timeout=5.0)
    monkeypatch.setattr("kvdepot.transport._dispatch.MAX_MESSAGE_BYTES", 10_000)
    _ask(disp, b"p", _hello())
    handler.handled.clear()
    costly = t.Changes(1, ["s"], limit=4_000)
    replies = _ask(disp, b"p", t.Changes(1, ["s"], limit=6_000), t.Ping(), costly, t.Ping(), request_id=10)
    assert [getattr(r.body, "code", "ok") for r in replies] == ["ok", "ok", "too_large", "ok"]
    assert handler.handled == ["Changes"]  # Ping is the dispatcher's own
    assert replies[2].id == 12
    assert replies[2].body.fields["work"] == 4_000
    replies = _ask(disp, b"p", costly, costly, costly, request_id=20)
    assert [getattr(r.body, "code", "ok") for r in replies] == ["ok", "ok", "too_large"]
    assert disp.counters["work_refused"] == 2
    assert disp.counters["too_large"] == 2
    replies = _ask(disp, b"p", t.Changes(1, ["s"], limit=16_000), t.Ping(), request_id=30)
    assert [getattr(r.body, "code", "ok") for r in replies] == ["ok", "too_large"]  # the first runs, whatever it costs


def test_bad_frames_are_reported_to_the_subscriber(handler: DictHandler, clock: _Clock) -> None:
    """Each refused frame reaches `on_bad_frame` with the peer's label, the reason and the size."""
    seen: list[t.BadFrame] = []
    d = Dispatcher(handler, clock=clock, on_bad_frame=seen.append)
    _ask(d, b"peer-1", _hello("c1"))
    d.dispatch(b"peer-1", [b"\xc1garbage"])
    d.dispatch(b"peer-2", [])
    assert seen == [t.BadFrame("c1", "malformed", 8), t.BadFrame(b"peer-2".hex(), "frame_count", 0)]
    assert d.counters["bad_frames"] == 2


def test_a_failing_bad_frame_subscriber_does_not_break_the_reply(handler: DictHandler, clock: _Clock) -> None:
    """A subscriber that raises is logged; the peer still gets its typed error reply."""

    def broken(event: t.BadFrame) -> None:
        raise RuntimeError("boom")

    d = Dispatcher(handler, clock=clock, on_bad_frame=broken)
    (reply,) = d.dispatch(b"peer-1", [b"\xc1garbage"])
    assert isinstance(t.decode_reply(reply).body, t.ErrorReply)
