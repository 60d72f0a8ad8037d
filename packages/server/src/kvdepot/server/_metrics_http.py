"""The HTTP endpoint of /metrics and /healthz: a listener any local user can reach, so bounded.

No thread per connection. One selector thread accepts connections and reads each request's
head (request line and headers) without blocking; a head that is complete goes to a small
pool of worker threads, which answer it and close the connection. So an idle or slow peer
costs one file descriptor and at most `max_header_bytes` of memory, never a thread, and:

- at most `max_connections` connections are open at once. At the cap, a new connection
  displaces the oldest one still sending its head (a request that is complete is never
  dropped for a newer one); with none to displace it gets a 503 and is closed;
- a head must be complete within `request_deadline` seconds of the accept, however the peer
  spreads its bytes (408 past it);
- a head is at most `max_header_bytes` long (431 past it), and a request with a body gets 400.

Every connection dropped is counted by reason (`REFUSAL_REASONS`) for /metrics.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import errno
import io
import resource
import selectors
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler
from typing import Any

import attrs
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from kvdepot.transport import get_logger

log = get_logger(__name__)

# Connections open at once: a Prometheus and a probe or two need a handful; the rest is slack
# for scrapes that overlap. Each costs one file descriptor and at most a header's bytes.
DEFAULT_MAX_CONNECTIONS = 64
# Seconds from the accept to the end of the request's head. A scraper sends its head at once;
# a peer dripping a header line every few seconds is cut off here, not kept by each read.
DEFAULT_REQUEST_DEADLINE_S = 5.0
# Bytes of request line and headers together. A scrape's head is a few hundred bytes.
DEFAULT_MAX_HEADER_BYTES = 16 * 1024
# Threads that answer complete requests. Answers are a scrape or a health check: milliseconds.
HTTP_WORKERS = 4
# Seconds a worker may spend writing one answer to a peer that does not read it.
WRITE_TIMEOUT_S = 10.0
# How often the selector thread looks at its stop flag: the longest `close()` waits for it.
POLL_INTERVAL_S = 0.1
# Accepts per turn of the selector loop, so that reads are not starved by a connect flood.
ACCEPT_BATCH = 64
RECV_SIZE = 4096
# The endpoint uses at most this fraction of the process's file limit, whatever the flag says:
# the cache socket, the pool, the tiers and the KV-event sockets need the rest first.
FILE_LIMIT_SHARE = 1 / 8

#: Why a connection was dropped: the cap with nothing to displace, displaced by a newer one,
#: past the deadline, past the header bytes, with a body, accept failing for want of file
#: descriptors, an answer the peer did not read in `WRITE_TIMEOUT_S`.
REFUSAL_REASONS = ("full", "displaced", "deadline", "header_bytes", "body", "files", "write_timeout")

_ERRNO_OUT_OF_FILES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_HEAD_ENDS = (b"\r\n\r\n", b"\n\n")


def _canned(status: str, body: str) -> bytes:
    """A whole HTTP/1.0 reply sent without a worker (one non-blocking send, best effort)."""
    data = f"{body}\n".encode()
    head = (
        f"HTTP/1.0 {status}\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {len(data)}\r\n"
        "Connection: close\r\nCache-Control: no-store\r\n\r\n"
    )
    return head.encode() + data


_FULL = _canned("503 Service Unavailable", "the metrics endpoint is at its connection cap; try again")
_TIMEOUT = _canned("408 Request Timeout", "the request's head did not arrive within the deadline")
_TOO_LARGE = _canned("431 Request Header Fields Too Large", "the request line and headers are too long")


@attrs.frozen
class HTTPLimits:
    """The bounds of the metrics endpoint (`kvdepot serve --metrics-*` flags)."""

    max_connections: int = DEFAULT_MAX_CONNECTIONS
    request_deadline: float = DEFAULT_REQUEST_DEADLINE_S
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES

    def within_file_limit(self) -> HTTPLimits:
        """These limits with the connection cap at most `FILE_LIMIT_SHARE` of the soft file limit."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            return self
        share = max(1, int(soft * FILE_LIMIT_SHARE))
        if self.max_connections <= share:
            return self
        log.warning("metrics_connections_capped", asked=self.max_connections, cap=share, file_limit=soft)
        return attrs.evolve(self, max_connections=share)


@attrs.frozen
class ListenerFigures:
    """What /metrics shows of one listener: open connections, its cap, drops by reason."""

    connections: int
    max_connections: int
    refused: Mapping[str, int]


@attrs.define
class _Pending:
    """A connection whose head is still arriving (selector thread only)."""

    sock: socket.socket
    peer: Any
    deadline: float
    head: bytearray = attrs.field(factory=bytearray)
    closing: bool = False  # answered (408/431) and shut for writing: its input is drained, then closed


class HTTPEndpoint:
    """The endpoint: `HTTPEndpoint(address, registry, health, limits)` binds; `serve_forever()`
    in a thread; `shutdown()` from another; `figures()` from any thread."""

    def __init__(
        self,
        address: tuple[str, int],
        registry: CollectorRegistry,
        health: Callable[[], str | None],
        limits: HTTPLimits,
    ) -> None:
        self.registry = registry
        self.health = health
        self.limits = limits
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind(address)
            self._listener.listen(max(128, limits.max_connections))
            self._listener.setblocking(False)
        except OSError:
            self._listener.close()
            raise
        self.server_port: int = self._listener.getsockname()[1]
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._accepting = True
        self._resume_accept = 0.0
        self._pending: collections.OrderedDict[int, _Pending] = collections.OrderedDict()  # by accept time
        self._answering = 0
        self._lock = threading.Lock()  # `_answering` and `_refused`, touched by the workers too
        self._refused = dict.fromkeys(REFUSAL_REASONS, 0)
        self._workers = concurrent.futures.ThreadPoolExecutor(HTTP_WORKERS, thread_name_prefix="kvdepot-metrics")
        self._stop = threading.Event()

    def figures(self) -> ListenerFigures:
        with self._lock:
            return ListenerFigures(
                self._answering + len(self._pending), self.limits.max_connections, dict(self._refused)
            )

    def refuse(self, reason: str) -> None:
        with self._lock:
            self._refused[reason] += 1

    # -- the selector thread ------------------------------------------------------------------

    def serve_forever(self) -> None:
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                timeout = POLL_INTERVAL_S
                if self._pending:
                    timeout = max(0.0, min(timeout, next(iter(self._pending.values())).deadline - now))
                accept = False
                for key, _ in self._selector.select(timeout):
                    if key.fileobj is self._listener:
                        accept = True
                    else:
                        self._read_guarded(key.data)
                # reads before accepts: a head that has arrived completes before anyone is displaced
                if accept:
                    self._accept()
                self._expire(time.monotonic())
        finally:
            for pending in list(self._pending.values()):
                self._drop(pending)
            self._selector.close()
            self._listener.close()
            self._workers.shutdown(wait=False, cancel_futures=True)

    def shutdown(self) -> None:
        """Ask `serve_forever` to close every socket and return (any thread; join it to wait)."""
        self._stop.set()

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                sock, peer = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in _ERRNO_OUT_OF_FILES:  # the connection stays queued; try again later
                    self.refuse("files")
                    self._pause_accepting()
                    return
                continue  # one connection gone before its accept (ECONNABORTED, ...): the next
            sock.setblocking(False)
            with self._lock:
                busy = self._answering + len(self._pending)
            if busy >= self.limits.max_connections:
                if not self._pending:
                    self.refuse("full")
                    self._send_once(sock, _FULL)
                    sock.close()
                    continue
                oldest = next(iter(self._pending.values()))
                if not oldest.closing:
                    self.refuse("displaced")
                self._drop(oldest)
            pending = _Pending(sock, peer, time.monotonic() + self.limits.request_deadline)
            self._pending[sock.fileno()] = pending
            self._selector.register(sock, selectors.EVENT_READ, pending)

    def _pause_accepting(self) -> None:
        """Out of file descriptors: leave the listener alone for one poll interval (no busy loop)."""
        if self._accepting:
            self._selector.unregister(self._listener)
            self._accepting = False
        self._resume_accept = time.monotonic() + POLL_INTERVAL_S

    def _read_guarded(self, pending: _Pending) -> None:
        """`_read`, where a failure drops that connection only, never the endpoint."""
        try:
            self._read(pending)
        except Exception:
            log.exception("metrics_request_failed", peer=str(pending.peer))
            if pending.sock.fileno() in self._pending:
                self._drop(pending)

    def _read(self, pending: _Pending) -> None:
        try:
            data = pending.sock.recv(RECV_SIZE)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # the peer closed (or reset) before its head was complete
            self._drop(pending)
            return
        if pending.closing:
            return  # answered already: what it still sends is read and thrown away
        start = max(0, len(pending.head) - 3)
        pending.head += data
        limit = self.limits.max_header_bytes
        for mark in _HEAD_ENDS:
            end = pending.head.find(mark, start)
            if end >= 0 and end + len(mark) <= limit:
                self._unregister(pending)
                head = bytes(pending.head[: end + len(mark)])
                with self._lock:
                    self._answering += 1
                self._workers.submit(self._answer, pending.sock, pending.peer, head)
                return
        if len(pending.head) >= limit:
            self.refuse("header_bytes")
            self._close_with(pending, _TOO_LARGE)

    def _expire(self, now: float) -> None:
        if not self._accepting and now >= self._resume_accept:
            self._selector.register(self._listener, selectors.EVENT_READ)
            self._accepting = True
        while self._pending:
            oldest = next(iter(self._pending.values()))
            if oldest.deadline > now:
                return
            if not oldest.closing:  # a closing one has had its answer and its time to read it
                self.refuse("deadline")
                self._send_once(oldest.sock, _TIMEOUT)
            self._drop(oldest)

    def _close_with(self, pending: _Pending, reply: bytes) -> None:
        """Answer `reply`, shut the connection for writing, and keep reading (and discarding) what
        the peer still sends until it closes or the deadline: closing at once with its bytes unread
        would reset the connection, and the peer might not see the reply."""
        pending.closing = True
        pending.head = bytearray()
        try:
            pending.sock.send(reply)
            pending.sock.shutdown(socket.SHUT_WR)
        except OSError:
            self._drop(pending)

    def _unregister(self, pending: _Pending) -> None:
        del self._pending[pending.sock.fileno()]
        self._selector.unregister(pending.sock)

    def _drop(self, pending: _Pending) -> None:
        self._unregister(pending)
        pending.sock.close()

    @staticmethod
    def _send_once(sock: socket.socket, reply: bytes) -> None:
        """One non-blocking send of a short reply: best effort, never a wait."""
        with contextlib.suppress(OSError):
            sock.send(reply)

    # -- the workers --------------------------------------------------------------------------

    def _answer(self, sock: socket.socket, peer: Any, head: bytes) -> None:
        try:
            sock.settimeout(WRITE_TIMEOUT_S)
            _RequestHandler(head, sock, peer, self)
        except TimeoutError:
            self.refuse("write_timeout")
        except OSError:
            pass  # the peer left before its answer was written
        except Exception:
            log.exception("metrics_request_failed", peer=str(peer))
        finally:
            sock.close()
            with self._lock:
                self._answering -= 1


class _RequestHandler(BaseHTTPRequestHandler):
    """GET /metrics (and /, as prometheus-client served it) and GET /healthz; anything else is 404.

    Reads the request from its head, already in memory; writes the answer to the socket."""

    server: HTTPEndpoint  # type: ignore[assignment]

    def __init__(self, head: bytes, sock: socket.socket, peer: Any, server: HTTPEndpoint) -> None:
        self._head = head
        super().__init__(sock, peer, server)  # type: ignore[arg-type]

    def setup(self) -> None:
        self.connection = self.request
        self.rfile = io.BytesIO(self._head)
        self.wfile = self.connection.makefile("wb")

    def parse_request(self) -> bool:
        if not super().parse_request():
            return False
        if self.headers.get("Content-Length", "0").strip() != "0" or "Transfer-Encoding" in self.headers:
            self.server.refuse("body")
            self.send_error(400, "kvdepot's metrics endpoint accepts no request body")
            return False
        return True

    def do_GET(self) -> None:
        path = urllib.parse.urlsplit(self.path).path
        if path in ("/metrics", "/"):
            self._reply(200, CONTENT_TYPE_LATEST, generate_latest(self.server.registry))
        elif path == "/healthz":
            reason = self.server.health()
            self._reply(200 if reason is None else 503, "text/plain; charset=utf-8", f"{reason or 'ok'}\n".encode())
        else:
            self._reply(404, "text/plain; charset=utf-8", b"not found: kvdepot serves /metrics and /healthz\n")

    def _reply(self, status: int, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        """Not on stderr: a scrape every few seconds is no event."""
