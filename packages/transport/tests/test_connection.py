"""The sans-I/O client connection: frames and link events in, events out, no sockets or clocks."""

from __future__ import annotations

from typing import Any

import pytest

import kvdepot.transport as t
from kvdepot.transport._connection import (
    TRANSITIONS,
    Call,
    ClientConnection,
    Input,
    Reconnected,
    Send,
    Settle,
    State,
    next_state,
)


def make(timeout: float = 1.0, heartbeat: float = 10.0) -> ClientConnection:
    return ClientConnection("ipc:///nowhere", "cid", "test", "", timeout, heartbeat, 1 << 20)


def sent(conn: ClientConnection) -> list[t.Request]:
    """The requests in the Send events since the last look (other events are dropped)."""
    return [t.decode_request(c.frame) for e in conn.take_events() if isinstance(e, Send) for c in e.calls]


def hello_reply(server_id: str) -> t.HelloReply:
    return t.HelloReply(t.PROTOCOL_VERSION, "test", server_id)


def register_reply() -> t.RegisterReply:
    return t.RegisterReply(256, t.PoolInfo("shm_file", "/dev/shm/x", 1 << 20), 64)


def reply(conn: ClientConnection, req: t.Request, body: Any, now: float = 0.0) -> None:
    conn.frames_received([t.encode_reply(t.Reply(req.id, body))], now)


def ready(conn: ClientConnection, server_id: str = "srv") -> None:
    conn.link_up(0.0)
    (hello,) = sent(conn)
    assert isinstance(hello.body, t.Hello)
    reply(conn, hello, hello_reply(server_id))
    assert conn.state is State.READY


def call(conn: ClientConnection, body: Any, now: float = 0.0, token: Any = "tok") -> Call:
    out = conn.prepare(body, None, now, token)
    assert isinstance(out, Call)
    return out


def test_every_live_state_can_close_and_closed_is_final() -> None:
    """CLOSE is in the table for every state but CLOSED, and nothing leaves CLOSED."""
    for state in State:
        assert ((state, Input.CLOSE) in TRANSITIONS) == (state is not State.CLOSED)
        assert all(s is not State.CLOSED for s, _ in TRANSITIONS if s is state) or state is not State.CLOSED
    with pytest.raises(AssertionError):
        next_state(State.CLOSED, Input.LINK_UP)


def test_requests_queue_until_the_handshake_then_go_out_in_one_message() -> None:
    """Calls submitted before the server answers Hello are sent together after it, in order."""
    conn = make()
    calls = [call(conn, t.Ping()), call(conn, t.Stats())]
    conn.submit(calls, 0.0)
    assert conn.take_events() == []
    conn.link_up(0.0)
    (hello,) = sent(conn)
    reply(conn, hello, hello_reply("srv"))
    events = conn.take_events()
    assert [type(e) for e in events] == [Send]
    assert [c.id for c in events[0].calls] == [c.id for c in calls]  # type: ignore[union-attr]


def test_replies_are_matched_by_id_and_typed() -> None:
    """Each reply settles its own call; a reply of the wrong type is a RemoteProtocolError."""
    conn = make()
    ready(conn)
    ping, stats = call(conn, t.Ping(), token="p"), call(conn, t.Stats(), token="s")
    conn.submit([ping, stats], 0.0)
    reqs = sent(conn)
    reply(conn, reqs[1], t.Pong())
    reply(conn, reqs[0], t.Pong())
    settles = [e for e in conn.take_events() if isinstance(e, Settle)]
    assert [s.call.token for s in settles] == ["s", "p"]
    assert isinstance(settles[0].error, t.RemoteProtocolError)
    assert isinstance(settles[1].result, t.Pong)
    reply(conn, reqs[0], t.Pong())  # again: late
    assert conn.stats["late_replies"] == 1


def test_deadline_fails_a_call_and_next_timer_says_when() -> None:
    """A call unanswered at its deadline fails with DeadlineExceededError at that time, not before."""
    conn = make(timeout=2.0)
    ready(conn)
    c = call(conn, t.Stats(), now=1.0)
    conn.submit([c], 1.0)
    conn.take_events()
    assert conn.next_timer() == 3.0
    conn.timer(2.9)
    assert not [e for e in conn.take_events() if isinstance(e, Settle)]
    conn.timer(3.0)
    (settle,) = [e for e in conn.take_events() if isinstance(e, Settle)]
    assert isinstance(settle.error, t.DeadlineExceededError)


def test_link_down_fails_calls_in_flight_and_keeps_queued_ones() -> None:
    """A lost connection fails what was sent (TransportBrokenError); what waits is sent after the next Hello."""
    conn = make()
    ready(conn)
    conn.submit([call(conn, t.Stats(), token="inflight")], 0.0)
    conn.take_events()
    conn.link_down()
    assert conn.state is State.CONNECTING
    (settle,) = [e for e in conn.take_events() if isinstance(e, Settle)]
    assert isinstance(settle.error, t.TransportBrokenError)
    conn.submit([call(conn, t.Ping(), token="queued")], 0.0)
    assert conn.take_events() == []
    ready(conn)
    assert conn.stats["reconnects"] == 1


def test_link_down_after_a_failed_send_still_fails_what_was_in_flight() -> None:
    """A server killed mid-stream: a send finds no connection (CONNECTING) before ZMQ reports the
    disconnect. The calls sent before are lost all the same: they fail at once, not at their
    deadline; the unsent one waits for the next Hello."""
    conn = make(timeout=10.0)
    ready(conn)
    conn.submit([call(conn, t.Stats(), token="inflight")], 0.0)
    conn.take_events()
    unsent = call(conn, t.Ping(), token="unsent")
    conn.submit([unsent], 0.0)
    (send,) = conn.take_events()
    conn.send_failed(send.calls, 0.0)
    assert conn.state is State.CONNECTING
    conn.link_down()
    (settle,) = [e for e in conn.take_events() if isinstance(e, Settle)]
    assert settle.call.token == "inflight"
    assert isinstance(settle.error, t.TransportBrokenError)
    ready(conn)
    assert [r.id for r in sent(conn)] == [unsent.id]


def test_every_request_of_a_message_the_server_forgot_us_for_is_retried_in_order() -> None:
    """The server dropped our session: every request of the message in flight gets hello_required
    (the first starts the handshake, the others arrive while its Hello is on the way). All of
    them are sent again after the Hello, in their order, before a request made meanwhile."""
    conn = make(timeout=10.0)
    ready(conn)
    calls = [call(conn, t.Stats(), token=f"c{i}") for i in range(3)]
    conn.submit(calls, 0.0)
    requests = sent(conn)
    forgot = t.ErrorReply("hello_required", "send Hello first")
    reply(conn, requests[0], forgot)
    (hello,) = sent(conn)
    assert isinstance(hello.body, t.Hello)
    for req in requests[1:]:
        reply(conn, req, forgot)
    later = call(conn, t.Ping(), token="later")
    conn.submit([later], 0.0)
    assert not [e for e in conn.take_events() if isinstance(e, Settle)]  # nothing failed
    reply(conn, hello, hello_reply("srv"))
    assert [r.id for r in sent(conn)] == [*(c.id for c in calls), later.id]


def test_a_heartbeat_that_finds_the_session_gone_greets_again() -> None:
    """An idle client learns from its heartbeat's hello_required that the server forgot it, and
    says Hello again at once (its next request would otherwise fail on the way)."""
    conn = make(heartbeat=1.0)
    ready(conn)
    conn.timer(5.0)
    (ping,) = sent(conn)
    assert isinstance(ping.body, t.Ping)
    reply(conn, ping, t.ErrorReply("hello_required", "send Hello first"), 5.0)
    (hello,) = sent(conn)
    assert isinstance(hello.body, t.Hello)
    assert conn.state is State.HANDSHAKING


def test_calls_that_waited_for_a_connection_in_vain_are_forgotten() -> None:
    """While no server answers, requests wait in the queue until their deadline; then they fail
    and leave it, so a client whose server is down for long holds no memory for them."""
    conn = make(timeout=1.0)
    calls = [call(conn, t.Stats(), token=i) for i in range(1000)]
    conn.submit(calls, 0.0)
    conn.timer(2.0)
    settled = [e for e in conn.take_events() if isinstance(e, Settle)]
    assert len(settled) == 1000
    assert all(isinstance(e.error, t.DeadlineExceededError) for e in settled)
    assert len(conn._queue) == 0


def test_a_new_server_gets_register_again_and_reconnected_is_reported() -> None:
    """After a restart (new server id) the last Register is repeated before requests flow again."""
    conn = make()
    ready(conn, "one")
    reg = call(conn, t.Register("layout", 256, 4096))
    conn.submit([reg], 0.0)
    (req,) = sent(conn)
    reply(conn, req, register_reply())
    conn.take_events()
    conn.link_down()
    conn.link_up(0.0)
    (hello,) = sent(conn)
    reply(conn, hello, hello_reply("two"))
    assert conn.state is State.HANDSHAKING
    (again,) = sent(conn)
    assert again.body == reg.body
    reply(conn, again, register_reply())
    assert conn.state is State.READY
    assert any(isinstance(e, Reconnected) for e in conn.take_events())


def test_send_failure_requeues_and_retries_the_handshake() -> None:
    """A send that finds no connection keeps its calls, in order, and says Hello again shortly."""
    conn = make(timeout=10.0)
    ready(conn)
    calls = [call(conn, t.Ping()), call(conn, t.Stats())]
    conn.submit(calls, 0.0)
    (send,) = conn.take_events()
    assert isinstance(send, Send)
    conn.send_failed(send.calls, 1.0)
    assert conn.state is State.CONNECTING
    due = conn.next_timer()
    assert due is not None
    assert due == pytest.approx(1.05)
    conn.timer(due)
    (hello,) = sent(conn)
    reply(conn, hello, hello_reply("srv"))
    assert [r.id for r in sent(conn)] == [c.id for c in calls]


def test_security_failure_without_curve_fails_everything_for_good() -> None:
    """A refused secret (or another user's ipc peer) fails queued and later calls with UnauthorizedError."""
    conn = make()
    conn.submit([call(conn, t.Ping())], 0.0)
    conn.security_failed("refused")
    assert conn.state is State.FAILED
    conn.submit([call(conn, t.Stats())], 0.0)
    errors = [e.error for e in conn.take_events() if isinstance(e, Settle)]
    assert len(errors) == 2
    assert all(isinstance(e, t.UnauthorizedError) for e in errors)


def test_heartbeat_goes_out_when_idle() -> None:
    """A ready connection with nothing sent for a heartbeat interval sends a Ping."""
    conn = make(heartbeat=1.0)
    ready(conn)
    assert conn.next_timer() == 1.0
    conn.timer(1.0)
    (ping,) = sent(conn)
    assert isinstance(ping.body, t.Ping)
