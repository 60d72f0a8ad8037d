"""One client's connection to a server: handshake, futures, deadlines, heartbeats, reconnects.

`Connection` is driven by the shared I/O thread (`_io.IOLoop`); `submit` and `close` are
the only methods other threads call. The bytes move through a link: `ZmqLink` (DEALER) or
the in-memory link of `_memory`.

States: connecting -> handshaking (Hello, then Register again if the server lost us)
-> ready -> (disconnected) connecting ... ; failed (version or secret refused); closed.
User requests wait in a queue until the connection is ready, and fail at their deadline.
"""

from __future__ import annotations

import itertools
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from typing import Any

import structlog

from kvdepot.transport._address import MEMORY_SCHEME, check_ipc_trusted, default_address, ipc_path
from kvdepot.transport._codec import DEFAULT_MAX_FRAME_BYTES, decode_reply, encode
from kvdepot.transport._errors import (
    CODE_UNAUTHORIZED,
    DeadlineExceededError,
    HelloRequiredError,
    RemoteError,
    RemoteProtocolError,
    TransportBrokenError,
    TransportClosedError,
    TransportError,
    remote_error,
)
from kvdepot.transport._io import IOLoop
from kvdepot.transport._link import Link
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
from kvdepot.transport._server import HARD_LIMIT_FACTOR

log = structlog.get_logger(__name__)


# A client gives up on a reply after this long unless told otherwise: long enough for a
# loaded server, short enough that "nothing is listening" surfaces within seconds.
DEFAULT_TIMEOUT = 5.0
# Pings keep the server's view of us alive; the server's peer timeout is 10 s.
DEFAULT_HEARTBEAT_INTERVAL = 1.0
# After a send finds no connection while the link reports one, say Hello again this soon (s).
HANDSHAKE_RETRY_S = 0.05
# Deadline queues are kept per distinct timeout value; past this many, empty ones are dropped.
MAX_DEADLINE_QUEUES = 8
# A batch of more frames than the server accepts in one message is split.
MAX_FRAMES_PER_SEND = 4096

ReconnectCallback = Callable[[HelloReply, "RegisterReply | None"], None]


class ReplyFuture(Future[Any]):
    """The future of one request. A thread blocked in `result` or `exception` reads the
    reply itself where the link allows (ZMQ), rather than wait for the I/O thread to."""

    def __init__(self, conn: Connection) -> None:
        super().__init__()
        self._conn = conn

    def result(self, timeout: float | None = None) -> Any:
        if not self.done():
            timeout = self._conn.wait(self, timeout)
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self.done():
            timeout = self._conn.wait(self, timeout)
        return super().exception(timeout)


class Call:
    """One request in flight: its frame, future and deadline."""

    __slots__ = ("answered", "body", "deadline", "frame", "future", "id", "internal", "timeout")

    def __init__(  # noqa: PLR0917
        self, conn: Connection, request_id: int, body: RequestBody, frame: bytes, timeout: float, internal: bool
    ) -> None:
        self.id = request_id
        self.body = body
        self.frame = frame
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.future: Future[Any] = ReplyFuture(conn)
        self.internal = internal
        self.answered = False  # its reply was read; the future is settled outside the lock


def _nothing() -> None:
    """A no-op to wake the I/O thread."""


def _settle(future: Future[Any], result: Any = None, exc: BaseException | None = None) -> None:
    try:
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass  # settled already, or cancelled by its owner


class Connection:
    """The protocol state of one client, on top of a link."""

    def __init__(
        self,
        address: str | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL,
        client_name: str = "",
        auth_secret: str | None = None,
        curve_server_key: bytes | None = None,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        on_reconnect: ReconnectCallback | None = None,
    ) -> None:
        self.address = address or default_address()
        path = ipc_path(self.address)
        if path is not None:
            check_ipc_trusted(path)
        self.curve_server_key = curve_server_key
        self.security_failure: str | None = None  # why the last ZMQ security handshake failed
        self.timeout = timeout
        self.heartbeat_interval = heartbeat_interval
        self.client_name = client_name
        self.client_id = secrets.token_hex(16)
        self.max_frame_bytes = max_frame_bytes
        self.on_reconnect = on_reconnect
        self.auth_secret = auth_secret or ""  # the shared secret this client presents
        self._ids = itertools.count(1)
        self._loop = IOLoop.shared()
        self._closed = False
        self._closed_event = threading.Event()
        # Everything below is guarded by _lock: the I/O thread holds it while it works, and a
        # submitting thread takes it to send directly when the connection is ready (no hop).
        self._lock = threading.RLock()
        self._handed_over = 0  # submissions on their way to the I/O thread (keeps order)
        self.state = "connecting"
        self.ever_connected = False
        self.server_id: str | None = None
        self.hello_reply: HelloReply | None = None
        self._failure: RemoteError | None = None
        self._register: Register | None = None
        self._lost_session = False
        self._queue: deque[Call] = deque()
        self._inflight: dict[int, Call] = {}
        # Replies read under the lock, settled after it is released (callbacks may wait).
        self._ready: deque[tuple[Future[Any], Any, BaseException | None]] = deque()
        self._deadlines: dict[float, deque[Call]] = {}
        self._last_sent = 0.0
        self._link_up = False  # the link says a server is connected
        self._retry_at = 0.0  # when to say Hello again after a send found no connection
        self.stats = {"late_replies": 0, "bad_replies": 0, "reconnects": 0}
        self._link: Link = self._make_link()
        self._loop.call_soon(self._open)

    def _make_link(self) -> Link:
        if self.address.startswith(MEMORY_SCHEME):
            from kvdepot.transport._memory import MemoryLink

            return MemoryLink(self, self._loop)
        from kvdepot.transport._zmq_link import ZmqLink

        return ZmqLink(self, self._loop)

    # -- any thread ----------------------------------------------------------------------

    def prepare(self, body: RequestBody, timeout: float | None = None) -> Call:
        """A call for `body` (encoded now, in the caller's thread); submit it with `submit`."""
        request_id = next(self._ids)
        frame = b""
        call = Call(self, request_id, body, frame, self.timeout if timeout is None else timeout, internal=False)
        try:
            call.frame = encode(Request(request_id, body), max_frame_bytes=self.max_frame_bytes)
        except TransportError as exc:
            call.future.set_exception(exc)
        except Exception as exc:  # a field of the wrong type: our caller's mistake
            from kvdepot.transport._errors import LocalProtocolError

            call.future.set_exception(
                LocalProtocolError(f"cannot encode {type(body).__name__}: {exc}", request=type(body).__name__)
            )
        return call

    def submit(self, calls: Sequence[Call]) -> None:
        """Sends prepared calls, in one message when the connection is ready."""
        self.submit_live([c for c in calls if not c.future.done()])

    def submit_live(self, live: list[Call]) -> None:
        """`submit` for calls whose futures are known not to be done."""
        if self._closed:
            for call in live:
                _settle(call.future, exc=self._closed_error())
            return
        if not live:
            return
        with self._lock:
            if self.state == "ready" and not self._handed_over and not self._queue:
                self._track(live)
                self._send(live)  # straight onto the socket from this thread
                sent = True
            else:
                self._handed_over += 1
                sent = False
        if sent:  # the I/O loop may be asleep until later than these deadlines
            self._loop.wake_by(min(call.deadline for call in live) if len(live) > 1 else live[0].deadline)
            return
        self._loop.call_soon(self._enqueue, live)

    def wait(self, future: Future[Any], timeout: float | None) -> float | None:
        """Lets the calling thread read replies until `future` is done (see `ReplyFuture`)."""
        if self.state != "ready" or self._loop.in_loop():
            return timeout
        return self._link.wait(future, timeout)

    def close(self, timeout: float = 1.0) -> None:
        """Fails what is pending with TransportClosedError and closes the link."""
        if self._closed:
            return
        self._closed = True
        if self._loop.in_loop():
            self._close_io()
        else:
            self._loop.call_soon(self._close_io)
            self._closed_event.wait(timeout)

    def _closed_error(self) -> TransportClosedError:
        return TransportClosedError(f"the client of {self.address} is closed", address=self.address)

    # -- I/O thread: requests ------------------------------------------------------------

    def _open(self) -> None:
        with self._lock:
            self._loop.add_timers(self)
            self._link.open()

    def _track(self, calls: list[Call]) -> None:
        for call in calls:
            dq = self._deadlines.get(call.timeout)
            if dq is None:
                dq = self._deadlines[call.timeout] = deque()
            dq.append(call)

    def _enqueue(self, calls: list[Call]) -> None:
        with self._lock:
            self._handed_over -= 1
            self._enqueue_locked(calls)
        self.settle_ready()

    def _enqueue_locked(self, calls: list[Call]) -> None:
        if self.state == "closed":
            for call in calls:
                self._settle_later(call.future, exc=self._closed_error())
            return
        self._track(calls)
        if self.state == "failed":
            for call in calls:
                self._settle_later(call.future, exc=self._failed_error())
        elif self.state == "ready":
            if self._queue:
                self._flush()
            self._send(calls)
        else:
            self._queue.extend(calls)

    def _send(self, calls: list[Call]) -> None:
        for start in range(0, len(calls), MAX_FRAMES_PER_SEND):
            chunk = calls[start : start + MAX_FRAMES_PER_SEND]
            for call in chunk:
                self._inflight[call.id] = call
                if isinstance(call.body, Register) and not call.internal:
                    self._register = call.body
            if not self._link.send([c.frame for c in chunk]):
                # no connection under us: nothing was sent; wait for the next one
                for call in calls[start:]:
                    self._inflight.pop(call.id, None)
                self._queue.extendleft(reversed([c for c in calls[start:] if not c.internal]))
                self._set_connecting()
                self._retry_at = time.monotonic() + HANDSHAKE_RETRY_S
                if not self._loop.in_loop():
                    self._loop.call_soon(_nothing)  # the I/O thread re-reads its timers
                return
        self._last_sent = time.monotonic()

    def _send_internal(self, body: RequestBody) -> None:
        call = Call(self, next(self._ids), body, b"", self.timeout, internal=True)
        call.frame = encode(Request(call.id, body), max_frame_bytes=self.max_frame_bytes)
        self._deadlines.setdefault(call.timeout, deque()).append(call)
        self._send([call])

    def _flush(self) -> None:
        calls = [c for c in self._queue if not c.future.done()]
        self._queue.clear()
        if calls:
            self._send(calls)

    def _failed_error(self) -> RemoteError:
        assert self._failure is not None
        exc = self._failure
        return remote_error(exc.code, exc.message, exc.fields)

    # -- I/O thread: link events ---------------------------------------------------------

    def on_connected(self) -> None:
        """The link reached a server: say Hello before anything else."""
        with self._lock:
            self._on_connected_locked()

    def _on_connected_locked(self) -> None:
        self._link_up = True
        if self.state not in ("connecting",):
            return
        if self.ever_connected:
            self.stats["reconnects"] += 1
        self.ever_connected = True
        self.state = "handshaking"
        log.debug("client_connected", address=self.address)
        self._send_internal(Hello(PROTOCOL_VERSION, self.client_id, self.client_name, self.auth_secret))

    def on_security_failure(self, event: int) -> None:
        """The ZMQ security handshake failed: with CURVE, the reason goes into the deadline errors;
        else the server checks a secret (PLAIN) and every request fails with `UnauthorizedError`."""
        log.warning("client_security_handshake_failed", address=self.address, zmq_event=event)
        if self.curve_server_key is not None:
            self.security_failure = (
                "the ZMQ security handshake with the server failed; check that the client's curve_server_key"
                " is the server's public key and that both sides use CURVE"
            )
            return
        if self.address.startswith("ipc://"):
            self.security_failure = (
                f"the peer at {self.address} runs as another user, or refused this one (each side of an ipc"
                " connection accepts only its own user or root)"
            )
        else:
            self.security_failure = (
                f"the kvdepot server at {self.address} refused the connection's security handshake: it checks a "
                f"shared secret (this client's is {'wrong' if self.auth_secret else 'missing'}; pass the server's as "
                "auth_secret) or uses CURVE (pass its public key as curve_server_key)"
            )
        with self._lock:
            if not self.ever_connected and self.state not in ("failed", "closed"):
                self._fail_locked(CODE_UNAUTHORIZED, self.security_failure, {})
        self.settle_ready()

    def _fail_locked(self, code: str, message: str, fields: dict[str, Any]) -> None:
        """The server refused this client for good: every queued and later request fails so."""
        self._failure = remote_error(code, message, fields)
        self.state = "failed"
        for call in self._queue:
            self._settle_later(call.future, exc=self._failed_error())
        self._queue.clear()

    def on_disconnected(self) -> None:
        """The link lost its server: requests in flight fail now, queued ones wait."""
        with self._lock:
            self._on_disconnected_locked()
        self.settle_ready()

    def _on_disconnected_locked(self) -> None:
        self._link_up = False
        if self.state in ("closed", "failed", "connecting"):
            return
        self._set_connecting()
        calls = list(self._inflight.values())
        self._inflight.clear()
        for call in calls:
            if not call.internal:
                error = TransportBrokenError(
                    f"lost the connection to the kvdepot server at {self.address} while {type(call.body).__name__}"
                    " was in flight; it may or may not have run",
                    address=self.address,
                    request=type(call.body).__name__,
                )
                self._settle_later(call.future, exc=error)
        log.info("client_disconnected", address=self.address, failed=sum(not c.internal for c in calls))

    def _set_connecting(self) -> None:
        if self.state in ("handshaking", "ready"):
            self.state = "connecting"

    def on_frames(self, frames: list[bytes]) -> None:
        """Reply frames from the server."""
        with self._lock:
            self._on_frames_locked(frames)
        self.settle_ready()

    def _settle_later(self, future: Future[Any], result: Any = None, exc: BaseException | None = None) -> None:
        """Queues a future's outcome (lock held); `settle_ready` applies it once the lock is released."""
        self._ready.append((future, result, exc))

    def settle_ready(self) -> None:
        """Settles the futures of replies read so far; call it without holding the lock.

        Done-callbacks run here, on the thread that read the replies, and may block or wait
        on other replies without holding up the I/O thread or other callers.
        """
        ready = self._ready
        if not ready:
            return
        while ready:
            try:
                future, result, exc = ready.popleft()  # another thread may be settling too
            except IndexError:
                break
            _settle(future, result, exc)
        self._link.nudge()  # one of them may be what a thread waiting in `wait` waits for

    def _on_frames_locked(self, frames: list[bytes]) -> None:
        for frame in frames:
            try:
                reply = decode_reply(frame, max_frame_bytes=self.max_frame_bytes * HARD_LIMIT_FACTOR)
            except TransportError as exc:
                self.stats["bad_replies"] += 1
                log.warning("bad_reply_received", address=self.address, error=str(exc))
                continue
            call = self._inflight.pop(reply.id, None)
            if call is None:
                self.stats["late_replies"] += 1
                continue
            call.answered = True
            if call.internal:
                self._on_internal_reply(call, reply.body)
            else:
                self._on_reply(call, reply.body)

    def _on_reply(self, call: Call, body: Any) -> None:
        if isinstance(body, ErrorReply):
            exc = remote_error(body.code, body.message, body.fields)
            if isinstance(exc, HelloRequiredError) and self.state == "ready":
                # the server restarted or forgot us; the request never ran: retry after Hello
                self._lost_session = True
                self.state = "connecting"
                call.answered = False
                self._queue.appendleft(call)
                self.on_connected()
                return
            self._settle_later(call.future, exc=exc)
        elif isinstance(body, REPLY_FOR[type(call.body)]):
            self._settle_later(call.future, body)
        else:
            error = RemoteProtocolError(
                f"the server answered {type(call.body).__name__} with {type(body).__name__}",
                request=type(call.body).__name__,
                reply=type(body).__name__,
            )
            self._settle_later(call.future, exc=error)

    def _on_internal_reply(self, call: Call, body: Any) -> None:
        _settle(call.future, body)
        if isinstance(call.body, Hello) and self.state == "handshaking":
            self._on_hello_reply(body)
        elif isinstance(call.body, Register) and self.state == "handshaking":
            if isinstance(body, ErrorReply):
                log.warning("reregister_failed", address=self.address, code=body.code, message=body.message)
            self._become_ready(body if isinstance(body, RegisterReply) else None, reconnected=True)

    def _on_hello_reply(self, body: Any) -> None:
        if isinstance(body, ErrorReply):
            if body.code == "hello_required":
                return  # cannot happen for Hello; ignore rather than loop
            log.error("client_handshake_refused", address=self.address, code=body.code, message=body.message)
            self._fail_locked(body.code, body.message, body.fields)
            return
        if not isinstance(body, HelloReply):
            return
        new_server = self.server_id is not None and body.server_id != self.server_id
        lost = new_server or self._lost_session
        self.server_id = body.server_id
        self.hello_reply = body
        self._lost_session = False
        if lost and self._register is not None:
            self._send_internal(self._register)
        else:
            self._become_ready(None, reconnected=lost)

    def _become_ready(self, register_reply: RegisterReply | None, *, reconnected: bool) -> None:
        self.state = "ready"
        self._flush()
        if reconnected:
            log.info("client_reconnected", address=self.address, server_id=self.server_id)
            if self.on_reconnect is not None and self.hello_reply is not None:
                try:
                    self.on_reconnect(self.hello_reply, register_reply)
                except Exception:
                    log.exception("on_reconnect_callback_failed")

    # -- I/O thread: timers --------------------------------------------------------------

    def next_timer(self) -> float | None:
        """The earliest deadline or heartbeat due."""
        with self._lock:
            return self._next_timer_locked()

    def _next_timer_locked(self) -> float | None:
        due: float | None = None
        if len(self._deadlines) > MAX_DEADLINE_QUEUES:  # callers used many distinct timeouts
            for timeout in [k for k, dq in self._deadlines.items() if not dq]:
                del self._deadlines[timeout]
        if self.state == "connecting" and self._link_up:
            due = self._retry_at
        for dq in self._deadlines.values():
            while dq and (dq[0].answered or dq[0].future.done()):
                dq.popleft()
            if dq and (due is None or dq[0].deadline < due):
                due = dq[0].deadline
        if self.state == "ready":
            beat = self._last_sent + self.heartbeat_interval
            if due is None or beat < due:
                due = beat
        return due

    def on_timer(self, now: float) -> None:
        """Fails calls past their deadline and sends a heartbeat when one is due."""
        with self._lock:
            self._on_timer_locked(now)
        self.settle_ready()

    def _on_timer_locked(self, now: float) -> None:
        if self.state == "connecting" and self._link_up and now >= self._retry_at:
            self._on_connected_locked()  # a send found no connection although the link is up
        for dq in list(self._deadlines.values()):  # a retried Hello below may add a queue
            while dq and (dq[0].answered or dq[0].future.done() or dq[0].deadline <= now):
                call = dq.popleft()
                if call.answered or call.future.done():
                    continue
                self._inflight.pop(call.id, None)
                if call.internal:
                    call.future.cancel()
                    if isinstance(call.body, (Hello, Register)) and self.state == "handshaking":
                        self.state = "connecting"  # try the handshake again
                        self.on_connected()
                    continue
                self._settle_later(call.future, exc=self._deadline_error(call))
        if self.state == "ready" and now - self._last_sent >= self.heartbeat_interval:
            self._send_internal(Ping())

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

    def _close_io(self) -> None:
        with self._lock:
            self._close_io_locked()
        self.settle_ready()
        self._closed_event.set()

    def _close_io_locked(self) -> None:
        self.state = "closed"
        calls = list(self._inflight.values()) + list(self._queue)
        self._inflight.clear()
        self._queue.clear()
        self._deadlines.clear()
        for call in calls:
            self._settle_later(call.future, exc=self._closed_error())
        self._loop.remove_timers(self)
        self._link.close()
