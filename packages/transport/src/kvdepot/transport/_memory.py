"""The in-memory transport: `memory://NAME` addresses, for tests and in-process servers.

Frames are still encoded and decoded with the codec, and the same `Dispatcher` and
`Connection` logic runs, so everything but the socket is exercised. A server binds a name
in a process-wide registry; clients of that name connect when it appears and see a
disconnect when it closes, just as over ZMQ.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvdepot.transport._address import MEMORY_SCHEME
from kvdepot.transport._codec import DEFAULT_MAX_FRAME_BYTES
from kvdepot.transport._dispatch import DEFAULT_PEER_TIMEOUT
from kvdepot.transport._errors import LocalProtocolError
from kvdepot.transport._handler import BadFrame, Handler
from kvdepot.transport._server import MAX_MESSAGES_PER_POLL, ServerEndpoint

if TYPE_CHECKING:
    from kvdepot.transport._client import Connection
    from kvdepot.transport._io import IOLoop

_lock = threading.Lock()
_servers: dict[str, MemoryServerEndpoint] = {}
_waiting: dict[str, set[_Peer]] = {}


class _Peer:
    """What a memory server needs of a connected peer: an identity and a way to reply."""

    identity: bytes
    name: str

    def deliver(self, frames: list[bytes]) -> None:
        raise NotImplementedError

    def server_up(self, server: MemoryServerEndpoint) -> None:
        raise NotImplementedError

    def server_down(self) -> None:
        raise NotImplementedError


def _attach(peer: _Peer) -> None:
    with _lock:
        server = _servers.get(peer.name)
        if server is None:
            _waiting.setdefault(peer.name, set()).add(peer)
        else:
            server.links.add(peer)
    if server is not None:
        peer.server_up(server)


def _detach(peer: _Peer, server: MemoryServerEndpoint | None) -> None:
    with _lock:
        _waiting.get(peer.name, set()).discard(peer)
        if server is not None:
            server.links.discard(peer)


class MemoryServerEndpoint(ServerEndpoint):
    """A server endpoint bound to `memory://NAME` in this process; same interface as ZMQ's."""

    def __init__(
        self,
        address: str | None,
        handler: Handler,
        *,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        peer_timeout: float = DEFAULT_PEER_TIMEOUT,
        auth_secret: str | None = None,
        curve_secret_key: bytes | None = None,  # nothing travels on a wire: ignored
        context: Any = None,
        on_bad_frame: Callable[[BadFrame], None] | None = None,
        server_id: str | None = None,
        limits: Any = None,  # a flood's bounds are the ZMQ socket's: ignored
    ) -> None:
        if not address or not address.startswith(MEMORY_SCHEME):
            raise LocalProtocolError(f"a memory endpoint needs a memory://NAME address, not {address!r}")
        super(ServerEndpoint, self).__init__(
            handler,
            max_frame_bytes=max_frame_bytes,
            peer_timeout=peer_timeout,
            auth_secret=auth_secret,
            on_bad_frame=on_bad_frame,
            server_id=server_id,
        )
        self.address = address
        self.name = address[len(MEMORY_SCHEME) :]
        self._inbox: deque[tuple[_Peer, list[bytes]]] = deque()
        self._cond = threading.Condition()
        self.links: set[_Peer] = set()
        with _lock:
            if self.name in _servers:
                raise LocalProtocolError(f"{address} is already bound in this process", address=address)
            _servers[self.name] = self
            waiting = _waiting.pop(self.name, set())
            self.links |= waiting
        for peer in waiting:
            peer.server_up(self)

    def submit(self, peer: _Peer, frames: list[bytes]) -> None:
        """A message from `peer` (any thread)."""
        with self._cond:
            self._inbox.append((peer, frames))
            self._cond.notify()

    def _poll(self, wait: float) -> int:
        with self._cond:
            if not self._inbox and not self._stopping.is_set():
                self._cond.wait(wait)
            batch = [self._inbox.popleft() for _ in range(min(len(self._inbox), MAX_MESSAGES_PER_POLL))]
        for peer, frames in batch:
            replies = self.dispatcher.dispatch(peer.identity, frames)
            if replies:  # none when every request of the message was deferred
                peer.deliver(replies)
        return len(batch)

    def _send(self, identity: bytes, frames: list[bytes]) -> None:
        peer = next((p for p in self.links if p.identity == identity), None)
        if peer is not None:
            peer.deliver(frames)

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _close_now(self) -> None:
        if self._closed:
            return
        self._closed = True
        with _lock:
            if _servers.get(self.name) is self:
                del _servers[self.name]
            links = list(self.links)
            self.links.clear()
            for peer in links:
                _waiting.setdefault(self.name, set()).add(peer)
        for peer in links:
            peer.server_down()


class MemoryLink(_Peer):
    """The client side of a memory connection; what the server delivers hops onto the I/O loop."""

    def __init__(self, conn: Connection, loop: IOLoop) -> None:
        self._conn = conn
        self._loop = loop
        self.identity = conn.client_id.encode()
        self.name = conn.address[len(MEMORY_SCHEME) :]
        self._server: MemoryServerEndpoint | None = None
        self._closed = False

    def open(self) -> None:
        _attach(self)

    def send(self, frames: list[bytes]) -> bool:
        server = self._server
        if server is None:
            return False
        server.submit(self, list(frames))
        return True

    def close(self) -> None:
        self._closed = True
        _detach(self, self._server)
        self._server = None

    def deliver(self, frames: list[bytes]) -> None:
        self._loop.call_soon(self._deliver, frames)

    def _deliver(self, frames: list[bytes]) -> None:
        if not self._closed:
            self._conn.on_frames(frames)

    def server_up(self, server: MemoryServerEndpoint) -> None:
        self._loop.call_soon(self._up, server)

    def _up(self, server: MemoryServerEndpoint) -> None:
        if not self._closed:
            self._server = server
            self._conn.on_link_up()

    def server_down(self) -> None:
        self._loop.call_soon(self._down)

    def _down(self) -> None:
        if not self._closed:
            self._server = None
            self._conn.on_link_down()


class MemoryRawPeer(_Peer):
    """A bare peer that sends raw frames and reads raw replies: for tests of bad input."""

    def __init__(self, address: str, identity: bytes) -> None:
        import queue

        self.name = address[len(MEMORY_SCHEME) :]
        self.identity = identity
        self._replies: queue.SimpleQueue[list[bytes]] = queue.SimpleQueue()
        self._server: MemoryServerEndpoint | None = None
        _attach(self)

    def send(self, frames: list[bytes]) -> None:
        """Sends one message of raw frames (dropped while no server is bound)."""
        if self._server is not None:
            self._server.submit(self, list(frames))

    def recv(self, timeout: float) -> list[bytes] | None:
        """The next reply message, or None after `timeout` seconds."""
        import queue

        try:
            return self._replies.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self) -> None:
        """Detaches from the server."""
        _detach(self, self._server)
        self._server = None

    def deliver(self, frames: list[bytes]) -> None:
        self._replies.put(frames)

    def server_up(self, server: MemoryServerEndpoint) -> None:
        self._server = server

    def server_down(self) -> None:
        self._server = None
