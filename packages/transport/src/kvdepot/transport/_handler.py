"""What a server plugs into an endpoint: a `Handler`, the `PeerInfo` it is handed, and the
`BadFrame` events it may subscribe to."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from kvdepot.transport._messages import ReplyBody, RequestBody


@dataclass(slots=True, eq=False)
class PeerInfo:
    """One connected client as the server endpoint knows it.

    `client_id` is the client's random id from Hello and the key to use for per-client
    state; it stays the same across reconnects of that client. `last_seen` is the
    endpoint's monotonic clock at the last frame received from it.
    """

    client_id: str
    client_name: str = ""
    protocol_version: int = 0
    identity: bytes = b""
    connected_at: float = 0.0
    last_seen: float = 0.0
    requests: int = field(default=0)


@dataclass(slots=True, eq=False)
class Deferred:
    """A reply the handler gives later: `handle` returns `Deferred()`, the endpoint sends nothing
    for that request yet, and the server answers it with `endpoint.send_deferred(deferred, body)`
    from the endpoint's loop thread (once per deferred). Clients match replies by request id, so
    a deferred reply may come after replies to later requests."""

    identity: bytes = b""
    request_id: int = 0
    request: type | None = None


class Waker:
    """Ends a server loop's wait early, from any thread: work for the loop is waiting.

    Made before the endpoint, so that the handler's collaborators (which the endpoint needs
    first) can be given it in their constructors; `open_endpoint(..., waker=waker)` connects
    it. A wake before that is kept, and delivered when it is connected."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._target: Callable[[], None] | None = None
        self._held = False  # woken before it was connected

    def wake(self) -> None:
        with self._lock:
            target = self._target
            if target is None:
                self._held = True
                return
        target()

    def connect(self, target: Callable[[], None]) -> None:
        """Deliver every wake to ``target`` (the endpoint's own), once; `open_endpoint` calls it."""
        with self._lock:
            if self._target is not None:
                raise RuntimeError("this waker is connected to an endpoint already")
            self._target, held = target, self._held
        if held:
            target()


@dataclass(frozen=True, slots=True)
class BadFrame:
    """A frame the endpoint refused before any handler saw it (the peer sent garbage).

    Endpoints report each one to their `on_bad_frame` callback, on the loop thread.
    """

    peer: str  # the peer's client id once it said Hello, else its transport identity in hex
    reason: str  # "frame_count", "too_large" or "malformed"
    size: int  # bytes of the frame (for "frame_count": frames in the message)


class Handler(Protocol):
    """The server side of the protocol, called from the endpoint's poll loop thread only.

    `handle` gets every request body of a greeted peer, Hello included (the endpoint has
    already checked its version and secret), and returns the reply body: the matching
    `*Reply` struct, or an `ErrorReply`. An exception becomes an `ErrorReply` whose code is
    the exception's `code` attribute when it has one (raise `UnknownLeaseError(...)` and
    friends), `invalid_argument` for an `InvalidArgumentError`, and `internal` otherwise.

    `peer_gone` is called once when a greeted peer stays silent past the endpoint's
    `peer_timeout`; reclaim its leases and reservations there. A peer that ended its session
    with EndSession is forgotten without a `peer_gone` call.

    A handler may also have a method `work(body) -> int`: the bytes of its message's budget
    (`MAX_MESSAGE_BYTES`) a request uses beyond its own frame, for requests whose work grows
    past their size. The endpoint asks it before `handle`, and a request past what is left of
    its message's budget (unless it is the message's first) is answered `too_large` unhandled.
    """

    def handle(self, peer: PeerInfo, body: RequestBody) -> ReplyBody | Deferred: ...

    def peer_gone(self, peer: PeerInfo) -> None: ...
