"""The proxy's listening socket: client connections capped, and none kept idle or half-sent.

aiohttp reads each connection itself and bounds neither how many are open nor how long a
request's head may take: a local user could open thousands of idle connections, or send a head
a byte every few seconds, each holding a file descriptor and memory. So `kvdepot proxy` opens
its listening socket itself and puts a `Connection` between each accepted socket and aiohttp's
protocol:

- at most `max_connections` are open at once. Past them a new connection gets a 503 before a
  byte of it is read, and is closed; aiohttp never sees it;
- a connection waits for a request's head (HEAD), runs a request (BUSY), or is kept alive
  between requests (IDLE). A head must be whole within `header_timeout` of the accept, or of
  its first byte after an idle time, however its bytes are spread: one deadline per head, never
  reset by a read (a 408, then closed). An idle connection is closed after `keepalive_timeout`.
  A request's body and answer have their own bounds (`--body-timeout`, `--timeout`).

The application's middleware (`ConnectionGuard.middleware`) tells each connection when a
request's head is whole (its handler starts) and when its handler ends. Every connection closed
here is counted by reason in /metrics (`CLOSE_REASONS`).
"""

from __future__ import annotations

import asyncio
import enum
import signal
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import structlog
from aiohttp import web

from kvdepot.vllm_connector._proxy_guard import RETRY_AFTER_S, ProxyLimits, ProxyMetrics

log = structlog.get_logger("kvdepot.proxy")

#: Connections waiting to be accepted (aiohttp's own default).
BACKLOG = 128


def _canned(status: str, body: str, *headers: str) -> bytes:
    """A whole answer written without aiohttp, before the connection is closed."""
    data = f"{body}\n".encode()
    lines = [f"HTTP/1.1 {status}", "Content-Type: text/plain; charset=utf-8", f"Content-Length: {len(data)}"]
    return "\r\n".join([*lines, "Connection: close", *headers, "", ""]).encode() + data


FULL_ANSWER = _canned(
    "503 Service Unavailable",
    "the proxy has as many connections open as it keeps (--max-connections); try again",
    f"Retry-After: {RETRY_AFTER_S}",
)
HEAD_TIMEOUT_ANSWER = _canned("408 Request Timeout", "the request's head did not arrive within --header-timeout")


class State(enum.Enum):
    """What a connection waits for: a request's head, its handler's end, or the next request."""

    HEAD = "head"
    BUSY = "busy"
    IDLE = "idle"


class Connection(asyncio.Protocol):
    """One client connection: aiohttp's protocol inside, once admitted, and a deadline in each state but BUSY."""

    def __init__(self, guard: ConnectionGuard, make_inner: Callable[[], asyncio.Protocol]) -> None:
        self._guard = guard
        self._make_inner = make_inner
        self._inner: asyncio.Protocol | None = None
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self.state = State.HEAD

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        if not self._guard.admit(self, transport):
            self._close(FULL_ANSWER)  # unread; aiohttp never sees it
            return
        self._inner = self._make_inner()
        self._inner.connection_made(transport)
        self._wait(State.HEAD, self._guard.limits.header_timeout)

    def data_received(self, data: bytes) -> None:
        if self._inner is None:
            return
        if self.state is State.IDLE:  # the next request's first bytes: its head's deadline starts now
            self._wait(State.HEAD, self._guard.limits.header_timeout)
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return None if self._inner is None else self._inner.eof_received()

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timer()
        if self._inner is None:
            return
        assert self._transport is not None
        self._guard.forget(self._transport)
        self._inner.connection_lost(exc)

    def request_started(self) -> None:
        """A request's head is whole and its handler runs: no deadline until it ends."""
        self._stop_timer()
        self.state = State.BUSY

    def request_ended(self) -> None:
        """The handler ended: the connection is idle until the next request's first byte."""
        if self._transport is not None and not self._transport.is_closing():
            self._wait(State.IDLE, self._guard.limits.keepalive_timeout)

    def _wait(self, state: State, seconds: float) -> None:
        self._stop_timer()
        self.state = state
        self._timer = asyncio.get_running_loop().call_later(seconds, self._expire)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self._timer = None
        if self.state is State.HEAD:
            self._guard.count_close("header_timeout")
            self._close(HEAD_TIMEOUT_ANSWER)
        else:
            self._guard.count_close("idle")
            self._close(None)

    def _close(self, answer: bytes | None) -> None:
        """Close with `answer` written first where it fits; a peer that does not read it is cut off."""
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        if answer is not None and not transport.get_write_buffer_size():
            transport.write(answer)
        if transport.get_write_buffer_size():
            transport.abort()  # close() would keep the socket until the peer read what is pending
        else:
            transport.close()


class ConnectionGuard:
    """The client connections of one listening socket: at most `limits.max_connections`, each with its deadlines."""

    def __init__(self, limits: ProxyLimits, metrics: ProxyMetrics) -> None:
        self.limits = limits
        self.metrics = metrics
        self._open: dict[asyncio.BaseTransport, Connection] = {}
        self._full = False  # logged once each time the cap is reached

    def protocol(self, make_inner: Callable[[], asyncio.Protocol]) -> Callable[[], Connection]:
        """The protocol factory of the listening socket, for aiohttp's protocol factory `make_inner`."""
        return lambda: Connection(self, make_inner)

    def admit(self, connection: Connection, transport: asyncio.BaseTransport) -> bool:
        """Count `connection` as open; False, counted as refused, where `max_connections` are open already."""
        if len(self._open) >= self.limits.max_connections:
            self.count_close("full")
            if not self._full:
                self._full = True
                log.warning(
                    "connections_full",
                    max_connections=self.limits.max_connections,
                    then="new connections get a 503 and are closed until some close (--max-connections)",
                )
            return False
        self._open[transport] = connection
        self.metrics.connections.set(len(self._open))
        return True

    def forget(self, transport: asyncio.BaseTransport) -> None:
        self._open.pop(transport, None)
        self.metrics.connections.set(len(self._open))
        self._full = self._full and len(self._open) >= self.limits.max_connections

    def count_close(self, reason: str) -> None:
        self.metrics.connections_closed.labels(reason).inc()

    def middleware(self) -> Any:
        """The application's middleware that tells each connection when its requests start and end."""

        @web.middleware
        async def track(
            request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
        ) -> web.StreamResponse:
            connection = self._open.get(request.transport) if request.transport is not None else None
            if connection is None:  # an application served some other way (make_app in a test)
                return await handler(request)
            connection.request_started()
            try:
                return await handler(request)
            finally:
                connection.request_ended()

        return track


GUARD = web.AppKey("kvdepot_proxy_guard", ConnectionGuard)


async def serve(app: web.Application, host: str, port: int, **log_fields: Any) -> None:
    """Serve `app` (from `make_app`) on host:port behind its `ConnectionGuard`, until SIGINT or SIGTERM.

    OSError where the address cannot be listened on.
    """
    guard = app[GUARD]
    limits = guard.limits
    # aiohttp's own keep-alive close stays as a backstop that never comes before the guard's deadlines.
    runner = web.AppRunner(app, access_log=None, keepalive_timeout=limits.header_timeout + limits.keepalive_timeout)
    await runner.setup()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        assert runner.server is not None
        listener = await loop.create_server(guard.protocol(runner.server), host, port, backlog=BACKLOG)
        try:
            log.info("proxy_listening", url=f"http://{host}:{port}", **log_fields, **attrs.asdict(limits))
            await stop.wait()
        finally:
            listener.close()
    finally:
        await runner.cleanup()
