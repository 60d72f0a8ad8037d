"""The client's protocol state, without I/O: frames and link events in, events out.

`ClientConnection` knows the handshake (Hello, then Register again if the server lost us),
request/reply matching by id, deadlines, heartbeats and what a lost connection does to the
requests in flight. It never touches a socket, a clock, a thread or a future: the caller
passes `now`, feeds it what happened (`link_up`, `frames_received`, `timer`, ...) and acts
on `take_events()`: `Send` these frames, `Settle` this call, `Reconnected`. Everything that
moves the connection between states lives in this file, in `TRANSITIONS`.
"""

from __future__ import annotations

import enum
import heapq
import itertools
from collections import deque
from typing import Any

import attrs

from kvdepot.transport._codec import HARD_LIMIT_FACTOR, decode_reply, encode
from kvdepot.transport._errors import (
    CODE_HELLO_REQUIRED,
    CODE_UNAUTHORIZED,
    DeadlineExceededError,
    HelloRequiredError,
    LocalProtocolError,
    RemoteError,
    RemoteProtocolError,
    TransportBrokenError,
    TransportClosedError,
    TransportError,
    remote_error,
)
from kvdepot.transport._messages import (
    PROTOCOL_VERSION,
    REPLY_FOR,
    ErrorReply,
    Hello,
    HelloReply,
    Ping,
    Register,
    RegisterReply,
    Request,
    RequestBody,
)

# After a send finds no connection while the link reports one, say Hello again this soon (s).
HANDSHAKE_RETRY_S = 0.05
# A batch of more frames than the server accepts in one message is split.
MAX_FRAMES_PER_SEND = 4096
# Answered calls stay in the deadline heap until they surface; rebuild it past this slack.
HEAP_SLACK = 1024


class State(enum.Enum):
    """Where a client connection stands."""

    CONNECTING = "connecting"  # no server (yet, or any more); requests queue
    HANDSHAKING = "handshaking"  # Hello (and maybe Register again) sent; requests queue
    READY = "ready"  # requests go out at once
    FAILED = "failed"  # the server refused us for good (version, secret); requests fail
    CLOSED = "closed"  # closed by its owner; requests fail


class Input(enum.Enum):
    """What can happen to a client connection."""

    LINK_UP = "link_up"  # the link reached a server
    LINK_DOWN = "link_down"  # the link lost it
    HANDSHAKE_DONE = "handshake_done"  # Hello (and Register) answered
    HANDSHAKE_RETRY = "handshake_retry"  # Hello or Register timed out, or the server forgot us
    SEND_FAILED = "send_failed"  # the link had no connection for a send
    REFUSED = "refused"  # the server refused the handshake (version, secret)
    CLOSE = "close"


S, In = State, Input

#: The whole state machine; a pair missing here is a bug (`next_state` asserts).
TRANSITIONS: dict[tuple[State, Input], State] = {
    (S.CONNECTING, In.LINK_UP): S.HANDSHAKING,
    (S.CONNECTING, In.LINK_DOWN): S.CONNECTING,
    (S.CONNECTING, In.HANDSHAKE_RETRY): S.HANDSHAKING,  # a send found no connection; the link says up
    (S.CONNECTING, In.REFUSED): S.FAILED,  # the security handshake failed before any Hello
    (S.HANDSHAKING, In.LINK_UP): S.HANDSHAKING,
    (S.HANDSHAKING, In.LINK_DOWN): S.CONNECTING,
    (S.HANDSHAKING, In.HANDSHAKE_DONE): S.READY,
    (S.HANDSHAKING, In.HANDSHAKE_RETRY): S.HANDSHAKING,
    (S.HANDSHAKING, In.SEND_FAILED): S.CONNECTING,
    (S.HANDSHAKING, In.REFUSED): S.FAILED,
    (S.READY, In.LINK_UP): S.READY,
    (S.READY, In.LINK_DOWN): S.CONNECTING,
    (S.READY, In.HANDSHAKE_RETRY): S.HANDSHAKING,  # the server restarted or forgot our session
    (S.READY, In.SEND_FAILED): S.CONNECTING,
    (S.FAILED, In.LINK_UP): S.FAILED,
    (S.FAILED, In.LINK_DOWN): S.FAILED,
    (S.FAILED, In.SEND_FAILED): S.FAILED,
}
for _state in (S.CONNECTING, S.HANDSHAKING, S.READY, S.FAILED):
    TRANSITIONS[_state, In.CLOSE] = S.CLOSED


def next_state(state: State, event: Input) -> State:
    """The state after `event`; a pair missing from `TRANSITIONS` is a bug in this file."""
    new = TRANSITIONS.get((state, event))
    assert new is not None, f"a client connection cannot take {event.value!r} in state {state.value!r}"
    return new


@attrs.define(eq=False)
class Call:
    """One request: its frame, deadline, and the caller's token (a future) for `Settle`."""

    id: int
    body: RequestBody
    frame: bytes
    timeout: float
    deadline: float
    token: Any = None  # None for the connection's own requests (Hello, Register, Ping)
    done: bool = False  # settled, or answered (own requests)


@attrs.frozen
class Send:
    """Send these calls' frames as one message; report `send_failed` if there is no connection."""

    calls: list[Call]


@attrs.frozen
class Settle:
    """The call is over: settle its token with `result`, or with `error` if that is not None."""

    call: Call
    result: Any = None
    error: BaseException | None = None


@attrs.frozen
class Note:
    """Something worth a log line: `name` is the event name, `level` a structlog method."""

    level: str
    name: str
    fields: dict[str, Any]


@attrs.frozen
class Reconnected:
    """The handshake after a reconnect is done (Register was repeated if the server lost it)."""

    hello: HelloReply
    register: RegisterReply | None


Event = Send | Settle | Reconnected | Note


class ClientConnection:
    """The protocol state of one client of one server (see the module docstring)."""

    def __init__(  # noqa: PLR0917 - the client's options, passed through once
        self,
        address: str,
        client_id: str,
        client_name: str,
        auth_secret: str,
        timeout: float,
        heartbeat_interval: float,
        max_frame_bytes: int,
        curve: bool = False,
    ) -> None:
        self.address = address
        self.client_id = client_id
        self.client_name = client_name
        self.auth_secret = auth_secret
        self.timeout = timeout
        self.heartbeat_interval = heartbeat_interval
        self.max_frame_bytes = max_frame_bytes
        self.curve = curve
        self.state = State.CONNECTING
        self.ever_connected = False
        self.server_id: str | None = None
        self.hello_reply: HelloReply | None = None
        self.security_failure: str | None = None  # why the last ZMQ security handshake failed
        self.stats = {"late_replies": 0, "bad_replies": 0, "reconnects": 0}
        self._ids = itertools.count(1)
        self._failure: RemoteError | None = None
        self._register: Register | None = None  # the last Register, repeated after a server restart
        self._lost_session = False
        self._retried = 0  # calls put back at the front of the queue for the handshake under way
        self._link_up = False
        self._retry_at = 0.0
        self._last_sent = 0.0
        self._queue: deque[Call] = deque()  # waiting for READY
        self._inflight: dict[int, Call] = {}
        self._deadlines: list[tuple[float, int, Call]] = []  # a heap; done calls are dropped lazily
        self._events: list[Event] = []

    # -- the caller's requests -----------------------------------------------------------

    def prepare(self, body: RequestBody, timeout: float | None, now: float, token: Any) -> Call | Settle:
        """A call for `body`, encoded now; or the `Settle` of its encoding error (nothing to send)."""
        timeout = self.timeout if timeout is None else timeout
        call = Call(next(self._ids), body, b"", timeout, now + timeout, token)
        try:
            call.frame = encode(Request(call.id, body), max_frame_bytes=self.max_frame_bytes)
        except TransportError as exc:
            return Settle(call, error=exc)
        except Exception as exc:  # a field of the wrong type: our caller's mistake
            name = type(body).__name__
            return Settle(call, error=LocalProtocolError(f"cannot encode {name}: {exc}", request=name))
        return call

    def submit(self, calls: list[Call], now: float) -> None:
        """Sends prepared calls as one message when READY; queues them before; fails them after."""
        for call in calls:
            heapq.heappush(self._deadlines, (call.deadline, call.id, call))
        if self.state is S.READY:
            self._send(calls, now)
        elif self.state is S.FAILED:
            for call in calls:
                self._settle(call, error=self._failed_error())
        elif self.state is S.CLOSED:
            for call in calls:
                self._settle(call, error=self.closed_error())
        else:
            self._queue.extend(calls)

    def take_events(self) -> list[Event]:
        """What to do, in order, since the last call."""
        events, self._events = self._events, []
        return events

    # -- what the link reports -----------------------------------------------------------

    def link_up(self, now: float) -> None:
        """The link reached a server: say Hello before anything else."""
        self._link_up = True
        if self.state is S.CONNECTING:
            self._handshake(In.LINK_UP, now)

    def link_down(self) -> None:
        """The link lost its server: requests in flight fail now, queued ones wait."""
        self._link_up = False
        was = self.state
        self.state = next_state(was, In.LINK_DOWN)
        # A send that found no connection moves READY to CONNECTING before ZMQ reports the
        # disconnect: what was sent before it is lost all the same, and fails now.
        if was not in (S.HANDSHAKING, S.READY) and not self._inflight:
            return
        calls, self._inflight = list(self._inflight.values()), {}
        self._note("info", "client_disconnected", failed=sum(c.token is not None for c in calls))
        for call in calls:
            if call.token is None:
                call.done = True
                continue
            name = type(call.body).__name__
            self._settle(
                call,
                error=TransportBrokenError(
                    f"lost the connection to the kvdepot server at {self.address} while {name}"
                    " was in flight; it may or may not have run",
                    address=self.address,
                    request=name,
                ),
            )

    def send_failed(self, calls: list[Call], now: float) -> None:
        """The link had no connection for these calls (nothing was sent): they wait for the next one."""
        for call in calls:
            self._inflight.pop(call.id, None)
        self._queue.extendleft(reversed([c for c in calls if c.token is not None and not c.done]))
        self.state = next_state(self.state, In.SEND_FAILED)
        self._retry_at = now + HANDSHAKE_RETRY_S

    def security_failed(self, message: str) -> None:
        """The link's security handshake failed: with CURVE the reason only goes into deadline
        errors; else (a secret or another user's ipc peer) every request fails now."""
        self.security_failure = message
        if self.curve or self.ever_connected or self.state in (S.FAILED, S.CLOSED):
            return
        self._fail(CODE_UNAUTHORIZED, message, {})

    def frames_received(self, frames: list[bytes], now: float) -> None:
        """Reply frames from the server."""
        for frame in frames:
            try:
                reply = decode_reply(frame, max_frame_bytes=self.max_frame_bytes * HARD_LIMIT_FACTOR)
            except TransportError as exc:
                self.stats["bad_replies"] += 1
                self._note("warning", "bad_reply_received", error=str(exc))
                continue
            call = self._inflight.pop(reply.id, None)
            if call is None:
                self.stats["late_replies"] += 1
                continue
            if call.token is None:
                call.done = True
                self._on_own_reply(call, reply.body, now)
            else:
                self._on_reply(call, reply.body, now)

    def timer(self, now: float) -> None:
        """Fails calls past their deadline, retries a handshake, sends a heartbeat when due."""
        if self.state is S.CONNECTING and self._link_up and now >= self._retry_at:
            self._handshake(In.HANDSHAKE_RETRY, now)
        heap = self._deadlines
        expired = False
        while heap and (heap[0][2].done or heap[0][0] <= now):
            call = heapq.heappop(heap)[2]
            if not call.done:
                self._expire(call, now)
                expired = True
        if expired and self._queue:  # calls that waited for a connection in vain hold no memory
            self._queue = deque(c for c in self._queue if not c.done)
        if len(heap) > 2 * (len(self._inflight) + len(self._queue)) + HEAP_SLACK:
            self._compact()
        if self.state is S.READY and now - self._last_sent >= self.heartbeat_interval:
            self._send_own(Ping(), now)

    def _compact(self) -> None:
        """Drops done calls from the deadline heap (answered calls leave it only lazily)."""
        self._deadlines = [entry for entry in self._deadlines if not entry[2].done]
        heapq.heapify(self._deadlines)

    def _expire(self, call: Call, now: float) -> None:
        """`call` reached its deadline unanswered."""
        self._inflight.pop(call.id, None)
        if call.token is not None:
            self._settle(call, error=self._deadline_error(call))
            return
        call.done = True
        if isinstance(call.body, (Hello, Register)) and self.state is S.HANDSHAKING:
            self._handshake(In.HANDSHAKE_RETRY, now)  # try the handshake again

    def next_timer(self) -> float | None:
        """When `timer` should run next, or None if nothing is due."""
        heap = self._deadlines
        while heap and heap[0][2].done:
            heapq.heappop(heap)
        due = [heap[0][0]] if heap else []
        if self.state is S.CONNECTING and self._link_up:
            due.append(self._retry_at)
        elif self.state is S.READY:
            due.append(self._last_sent + self.heartbeat_interval)
        return min(due, default=None)

    def close(self) -> None:
        """Fails everything pending with TransportClosedError; later requests fail so too."""
        if self.state is S.CLOSED:
            return
        self.state = next_state(self.state, In.CLOSE)
        calls = list(self._inflight.values()) + list(self._queue)
        self._inflight.clear()
        self._queue.clear()
        self._deadlines.clear()
        for call in calls:
            if call.token is not None:
                self._settle(call, error=self.closed_error())

    def closed_error(self) -> TransportClosedError:
        """The error of a request made to, or pending in, a closed client."""
        return TransportClosedError(f"the client of {self.address} is closed", address=self.address)

    # -- internals -----------------------------------------------------------------------

    def _settle(self, call: Call, result: Any = None, error: BaseException | None = None) -> None:
        call.done = True
        self._events.append(Settle(call, result, error))

    def _note(self, level: str, name: str, **fields: Any) -> None:
        self._events.append(Note(level, name, {"address": self.address, **fields}))

    def _send(self, calls: list[Call], now: float) -> None:
        self._last_sent = now
        for start in range(0, len(calls), MAX_FRAMES_PER_SEND):
            chunk = [c for c in calls[start : start + MAX_FRAMES_PER_SEND] if not c.done]
            for call in chunk:
                self._inflight[call.id] = call
                if isinstance(call.body, Register) and call.token is not None:
                    self._register = call.body
            if chunk:
                self._events.append(Send(chunk))

    def _send_own(self, body: RequestBody, now: float) -> None:
        call_id = next(self._ids)
        frame = encode(Request(call_id, body), max_frame_bytes=self.max_frame_bytes)
        call = Call(call_id, body, frame, self.timeout, now + self.timeout)
        heapq.heappush(self._deadlines, (call.deadline, call.id, call))
        self._send([call], now)

    def _handshake(self, event: Input, now: float) -> None:
        if self.ever_connected:
            self.stats["reconnects"] += 1
        self.ever_connected = True
        self.state = next_state(self.state, event)
        self._note("debug", "client_connected")
        self._send_own(Hello(PROTOCOL_VERSION, self.client_id, self.client_name, self.auth_secret), now)

    def _fail(self, code: str, message: str, fields: dict[str, Any]) -> None:
        """The server refused this client for good: every queued and later request fails so."""
        self._failure = remote_error(code, message, fields)
        self.state = next_state(self.state, In.REFUSED)
        for call in self._queue:
            self._settle(call, error=self._failed_error())
        self._queue.clear()

    def _failed_error(self) -> RemoteError:
        assert self._failure is not None
        exc = self._failure
        return remote_error(exc.code, exc.message, exc.fields)

    def _on_reply(self, call: Call, body: Any, now: float) -> None:
        if isinstance(body, ErrorReply):
            exc = remote_error(body.code, body.message, body.fields)
            if isinstance(exc, HelloRequiredError) and self.state in (S.READY, S.HANDSHAKING):
                # The server restarted or forgot us; the request never ran: retry it after Hello.
                # The rest of its message gets the same answer while that Hello is on its way:
                # those go after it, in the order they were sent, before anything queued since.
                self._lost_session = True
                if self.state is S.READY:
                    self._retried = 0
                    self._handshake(In.HANDSHAKE_RETRY, now)
                self._queue.insert(min(self._retried, len(self._queue)), call)
                self._retried += 1
                return
            self._settle(call, error=exc)
        elif isinstance(body, REPLY_FOR[type(call.body)]):
            self._settle(call, body)
        else:
            error = RemoteProtocolError(
                f"the server answered {type(call.body).__name__} with {type(body).__name__}",
                request=type(call.body).__name__,
                reply=type(body).__name__,
            )
            self._settle(call, error=error)

    def _on_own_reply(self, call: Call, body: Any, now: float) -> None:
        if self.state is S.READY and isinstance(body, ErrorReply) and body.code == CODE_HELLO_REQUIRED:
            self._lost_session = True  # a heartbeat found that the server forgot us: greet it again
            self._handshake(In.HANDSHAKE_RETRY, now)
            return
        if self.state is not S.HANDSHAKING:
            return  # a Pong, or a handshake reply that a reconnect made stale
        if isinstance(call.body, Hello):
            self._on_hello_reply(body, now)
        elif isinstance(call.body, Register):
            if isinstance(body, ErrorReply):
                self._note("warning", "reregister_failed", code=body.code, message=body.message)
            self._become_ready(body if isinstance(body, RegisterReply) else None, now, reconnected=True)

    def _on_hello_reply(self, body: Any, now: float) -> None:
        if isinstance(body, ErrorReply):
            if body.code != "hello_required":  # cannot happen for Hello; ignore rather than loop
                self._note("error", "client_handshake_refused", code=body.code, message=body.message)
                self._fail(body.code, body.message, body.fields)
            return
        if not isinstance(body, HelloReply):
            return
        lost = (self.server_id is not None and body.server_id != self.server_id) or self._lost_session
        self.server_id = body.server_id
        self.hello_reply = body
        self._lost_session = False
        if lost and self._register is not None:
            self._send_own(self._register, now)
        else:
            self._become_ready(None, now, reconnected=lost)

    def _become_ready(self, register_reply: RegisterReply | None, now: float, *, reconnected: bool) -> None:
        self.state = next_state(self.state, In.HANDSHAKE_DONE)
        calls = [c for c in self._queue if not c.done]
        self._queue.clear()
        self._send(calls, now)
        if reconnected:
            self._note("info", "client_reconnected", server_id=self.server_id)
        if reconnected and self.hello_reply is not None:
            self._events.append(Reconnected(self.hello_reply, register_reply))

    def _deadline_error(self, call: Call) -> DeadlineExceededError:
        name = type(call.body).__name__
        if self.security_failure is not None and not self.ever_connected:
            message = f"no reply from {self.address} within {call.timeout:g} s: {self.security_failure}"
        elif not self.ever_connected or self.server_id is None:
            message = (
                f"no kvdepot server answered at {self.address} within {call.timeout:g} s;"
                f" start one with `kvdepot serve --address {self.address}`, or check the address"
            )
        else:
            message = (
                f"the kvdepot server at {self.address} did not answer {name} within {call.timeout:g} s;"
                " it may be overloaded, stuck or gone"
            )
        return DeadlineExceededError(message, address=self.address, timeout=call.timeout, request=name)
