"""The bounds of `kvdepot proxy`, what it refuses, and what it counts in its /metrics.

Every request the proxy answers itself is a `ProxyRefusal`: a typed error with the HTTP
status the client gets and the reason /metrics counts it under. The proxy holds few things a
client can grow: client connections (`max_connections`, each with a deadline for its request's
head and for its idle time: `_proxy_listener.py`), requests in flight (`max_requests`) and the
request bodies it holds while it re-encodes them for the prefill and the decode server
(`max_body` each, `max_body_total` in all). A client past a bound gets its answer at once (413
or 503, with ``Retry-After``), and the proxy keeps serving everyone else.
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager

import attrs
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from kvdepot.core import InvalidArgumentError, KVDepotError

#: The largest request body accepted: a prompt of about a million token ids as JSON.
DEFAULT_MAX_BODY = 8 << 20
#: The request bodies held at once, counted `BODY_COPIES` times each.
DEFAULT_MAX_BODY_TOTAL = 512 << 20
#: Requests in flight at once; a streamed answer holds its request until its last byte.
DEFAULT_MAX_REQUESTS = 256
#: A request holds its body up to three times: as received, and re-encoded for the prefill and
#: the decode server. It is counted so from the moment it arrives until the decode server has it.
BODY_COPIES = 3
#: Seconds a client may take to send its request body (past them: 408).
DEFAULT_BODY_TIMEOUT_S = 30.0
#: Client connections open at once. Each costs a file descriptor and a few KiB; a client needs one
#: per request in flight, so this is twice `DEFAULT_MAX_REQUESTS`.
DEFAULT_MAX_CONNECTIONS = 512
#: Seconds from a connection's accept, or from the first byte of its next request, to the end of
#: that request's head. A client sends its head at once; one dripping bytes is cut off here.
DEFAULT_HEADER_TIMEOUT_S = 10.0
#: Seconds a keep-alive connection may stay idle between two requests.
DEFAULT_KEEPALIVE_TIMEOUT_S = 15.0
#: File descriptors kept for all but client connections, besides one per request in flight (its
#: connection to a vLLM server): the listening socket, the event loop's, standard streams, logs.
RESERVED_FILES = 64
#: Seconds a refused client is told to wait (``Retry-After``) before it asks again.
RETRY_AFTER_S = 1

# What a raw query string may hold: printable ASCII, no space, no fragment.
_QUERY = re.compile(r"[\x21-\x22\x24-\x7e]*")
# Characters a path segment keeps as they are when it is encoded again (RFC 3986 pchar).
_SEGMENT_SAFE = "!$&'()*+,;=:@"


class ProxyRefusal(KVDepotError):
    """A request the proxy answers itself with `status`, counted in /metrics under `reason`."""

    status = 400
    reason = "bad_request"


class BodyTooLargeError(ProxyRefusal):
    """The request body is larger than `--max-body`."""

    status = 413
    reason = "body_too_large"


class BusyError(ProxyRefusal):
    """`--max-requests` requests are in flight already."""

    status = 503
    reason = "busy"


class BodyBudgetError(ProxyRefusal):
    """The request bodies held already leave no room for this one under `--max-body-total`."""

    status = 503
    reason = "body_budget"


class BodyTimeoutError(ProxyRefusal):
    """The client took longer than `--body-timeout` seconds to send its request body."""

    status = 408
    reason = "body_timeout"


class BadJSONError(ProxyRefusal):
    """The request body is not a JSON object, or nests too deep to read."""

    reason = "bad_json"


class BadPathError(ProxyRefusal):
    """A passthrough path with dot or empty segments, an escaped slash, or an odd query."""

    reason = "bad_path"


class NotUnderV1Error(ProxyRefusal):
    """A passthrough path that is not under ``/v1/`` once its escapes are decoded."""

    status = 404
    reason = "bad_path"


REFUSAL_REASONS = ("body_too_large", "busy", "body_budget", "body_timeout", "bad_json", "bad_path")
#: Why the proxy closed a client connection itself: at the connection cap (a 503, unread), its
#: request's head not whole by its deadline (a 408), idle past the keep-alive timeout.
CLOSE_REASONS = ("full", "header_timeout", "idle")


@attrs.frozen
class ProxyLimits:
    """The proxy's bounds (`kvdepot proxy --max-body`, `--max-body-total`, `--max-requests`,
    `--max-connections`, `--header-timeout`, `--keepalive-timeout`)."""

    max_body: int = DEFAULT_MAX_BODY
    max_body_total: int = DEFAULT_MAX_BODY_TOTAL
    max_requests: int = DEFAULT_MAX_REQUESTS
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    header_timeout: float = DEFAULT_HEADER_TIMEOUT_S
    keepalive_timeout: float = DEFAULT_KEEPALIVE_TIMEOUT_S

    def __attrs_post_init__(self) -> None:
        for name in ("max_body", "max_body_total", "max_requests", "max_connections"):
            if getattr(self, name) < 1:
                raise InvalidArgumentError(f"{name} must be at least 1", name=name)
        for name in ("header_timeout", "keepalive_timeout"):
            if not getattr(self, name) > 0:
                raise InvalidArgumentError(f"{name} must be more than 0 seconds", name=name)
        if self.max_body_total < BODY_COPIES * self.max_body:
            raise InvalidArgumentError(
                f"max_body_total ({self.max_body_total}) must hold one body of max_body ({self.max_body})"
                f" {BODY_COPIES} times",
                name="max_body_total",
            )

    def within_file_limit(self, soft: int) -> ProxyLimits:
        """These limits with `max_connections` capped where a soft file limit of `soft` descriptors needs it.

        Every request in flight holds a connection to a vLLM server besides its client's, and
        `RESERVED_FILES` are kept for the rest, so a full proxy never runs out of descriptors.
        """
        room = soft - RESERVED_FILES - self.max_requests
        if room < 1:
            raise InvalidArgumentError(
                f"the file limit ({soft} descriptors) leaves no room for client connections beside"
                f" {self.max_requests} requests in flight and {RESERVED_FILES} reserved: lower --max-requests"
                " or raise the limit (ulimit -n)",
                name="max_requests",
            )
        return self if self.max_connections <= room else attrs.evolve(self, max_connections=room)


class ProxyMetrics:
    """The proxy's Prometheus figures, in a registry of its own (served at its /metrics)."""

    def __init__(self, limits: ProxyLimits) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvdepot_proxy_requests", "Requests admitted, by route.", ["route"], registry=r)
        self.refused = Counter(
            "kvdepot_proxy_refused", "Requests the proxy answered itself, by reason.", ["reason"], registry=r
        )
        self.in_flight = Gauge("kvdepot_proxy_requests_in_flight", "Requests in flight now.", registry=r)
        self.connections = Gauge("kvdepot_proxy_connections", "Client connections open now.", registry=r)
        self.connections_closed = Counter(
            "kvdepot_proxy_connections_closed",
            "Client connections the proxy closed itself, by reason (full: refused at the cap, unread).",
            ["reason"],
            registry=r,
        )
        self.body_bytes = Gauge(
            "kvdepot_proxy_body_bytes_held", "Request-body bytes held now (each body counted 3 times).", registry=r
        )
        self.upstream_errors = Counter(
            "kvdepot_proxy_upstream_errors",
            "vLLM servers that failed or did not answer a request, by role.",
            ["server"],
            registry=r,
        )
        self.cut_streams = Counter(
            "kvdepot_proxy_cut_streams", "Answers a server cut midway, passed on to the client as cut.", registry=r
        )
        self.clients_gone = Counter(
            "kvdepot_proxy_clients_gone", "Clients that left before their answer was passed back.", registry=r
        )
        limit = Gauge("kvdepot_proxy_limit", "The proxy's bounds.", ["name"], registry=r)
        for name, value in attrs.asdict(limits).items():
            limit.labels(name).set(value)
        for reason in REFUSAL_REASONS:
            self.refused.labels(reason)
        for reason in CLOSE_REASONS:
            self.connections_closed.labels(reason)
        for server in ("prefill", "decode"):
            self.upstream_errors.labels(server)
        for route in ("completion", "passthrough"):
            self.requests.labels(route)

    def render(self) -> bytes:
        text: bytes = generate_latest(self.registry)
        return text


@attrs.define
class BodyHold:
    """Body bytes counted against `max_body_total` until `release`."""

    _admission: Admission
    nbytes: int

    def resize(self, body_bytes: int) -> None:
        """Count a body of `body_bytes` instead (BodyBudgetError, holding nothing, where it does not fit)."""
        self.release()
        self.nbytes = self._admission.take_bytes(BODY_COPIES * body_bytes)

    def release(self) -> None:
        self._admission.give_bytes(self.nbytes)
        self.nbytes = 0


class Admission:
    """Requests in flight and body bytes held, against the limits (one event loop's state)."""

    def __init__(self, limits: ProxyLimits, metrics: ProxyMetrics) -> None:
        self.limits = limits
        self.metrics = metrics
        self.in_flight = 0
        self.held_bytes = 0

    @contextmanager
    def request(self, route: str) -> Iterator[None]:
        """One request in flight while the block runs; BusyError where `max_requests` are already."""
        if self.in_flight >= self.limits.max_requests:
            raise BusyError(f"the proxy has {self.in_flight} requests in flight, its most (--max-requests)")
        self.in_flight += 1
        self.metrics.in_flight.set(self.in_flight)
        self.metrics.requests.labels(route).inc()
        try:
            yield
        finally:
            self.in_flight -= 1
            self.metrics.in_flight.set(self.in_flight)

    def hold(self, body_bytes: int) -> BodyHold:
        """Count a body of `body_bytes` as held (BODY_COPIES times); BodyBudgetError where it does not fit."""
        return BodyHold(self, self.take_bytes(BODY_COPIES * body_bytes))

    def take_bytes(self, nbytes: int) -> int:
        if self.held_bytes + nbytes > self.limits.max_body_total:
            raise BodyBudgetError(
                f"the proxy holds {self.held_bytes} bytes of request bodies; this one needs {nbytes} more"
                f" and the most is {self.limits.max_body_total} (--max-body-total)"
            )
        self.held_bytes += nbytes
        self.metrics.body_bytes.set(self.held_bytes)
        return nbytes

    def give_bytes(self, nbytes: int) -> None:
        self.held_bytes -= nbytes
        self.metrics.body_bytes.set(self.held_bytes)


def passthrough_target(raw_target: str) -> str:
    """The path and query to ask a decode server for, from a request's raw target.

    Only a normalised path under ``/v1/`` passes: each segment's percent-escapes are decoded, and
    a dot segment, an empty one (but a trailing slash), an escaped slash or backslash, or a control
    character is refused. The path is encoded again from its segments, so nothing between here and
    the decode server can read it as another path.
    """
    path, sep, query = raw_target.partition("?")
    try:
        segments = [urllib.parse.unquote(seg, errors="strict") for seg in path.split("/")]
    except UnicodeDecodeError:
        raise BadPathError(f"the path {path!r} has escapes that are not UTF-8") from None
    if len(segments) < 3 or segments[0] != "" or segments[1] != "v1":
        raise NotUnderV1Error(f"the proxy passes only paths under /v1/ to a decode server, not {path!r}")
    for i, seg in enumerate(segments[2:], start=2):
        if seg in (".", "..") or (seg == "" and i < len(segments) - 1):
            raise BadPathError(f"the path {path!r} has a dot or empty segment")
        if "/" in seg or "\\" in seg or not seg.isprintable():
            raise BadPathError(f"the path {path!r} has an escaped slash, a backslash or a control character")
    if not _QUERY.fullmatch(query):
        raise BadPathError("the query string has characters a URL cannot carry")
    return "/".join(urllib.parse.quote(seg, safe=_SEGMENT_SAFE) for seg in segments) + sep + query
