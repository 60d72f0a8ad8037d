"""Server endpoints: a poll loop that feeds requests to a handler and sends the replies.

`ServerEndpoint(address, handler)` binds a ZMQ ROUTER for ipc:// and tcp:// addresses;
`open_endpoint(address, handler)` (`_endpoints.py`) also takes memory:// addresses. Either
way: `poll_once(timeout)`, `serve_forever()`, `stop()` (from any thread) and `close()`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any

import attrs
import zmq

from kvdepot.transport._address import (
    MEMORY_SCHEME,
    check_bind,
    check_not_in_use,
    default_address,
    ipc_path,
    prepare_ipc_dir,
    secure_ipc_socket,
)
from kvdepot.transport._capped_listener import CappedListener
from kvdepot.transport._codec import DEFAULT_MAX_FRAME_BYTES, HARD_LIMIT_FACTOR
from kvdepot.transport._dispatch import DEFAULT_PEER_TIMEOUT, MAX_FRAMES_PER_MESSAGE, Dispatcher
from kvdepot.transport._errors import LocalProtocolError, TransportClosedError, TransportError
from kvdepot.transport._flood import BAD_MUTE_S, FRAME_OVERHEAD, BadFrames, MemoryTrim, PeerLimits
from kvdepot.transport._handler import BadFrame, Deferred, Handler, PeerInfo
from kvdepot.transport._log import get_logger
from kvdepot.transport._messages import ReplyBody
from kvdepot.transport._peercred import PLAIN_USER, ZAP_DOMAIN, PeerUserCheck

log = get_logger(__name__)

# Plain ints: zmq's enum members cost a Python-level __and__ on every use in the hot path.
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE_NOBLOCK = int(zmq.SNDMORE) | int(zmq.NOBLOCK)

# Messages handled per poll, and seconds spent handling them, before timers and stop requests
# are checked again: a flood of requests delays neither a stop nor an expiry by more than this.
MAX_MESSAGES_PER_POLL = 256
POLL_BUDGET_S = 0.05
# Reply messages queued for one peer that has not read them. A client has far fewer requests in
# flight than this; a peer whose queue is full is dropped (its session ends). The messages queued
# from a peer are bounded by `PeerLimits.queue` (`_flood.py`).
SEND_HWM = 1024
# Bytes of replies queued for one peer that has not read them, besides its latest reply messages.
# ZMQ counts messages, not bytes, and one message may hold thousands of replies: a peer that sent
# 128 KB of Stats requests in a few messages and never read made the server hold 338 MiB. A
# client reads its replies as they come (its ZMQ I/O thread does, whatever its Python threads
# do), so what waits for it is one step's replies at most; a peer past this is dropped.
MAX_UNREAD_BYTES = 4 << 20
# ZMQ does not say what a peer has read: one reply message in each this many bytes sent to a
# peer is sent zero-copy with a tracker, which is done once ZMQ has written it out (and so every
# message before it). Rare enough to cost nothing per reply, often enough to keep the count close.
TRACK_BYTES = 256 << 10
# A peer dropped because its replies went unread is not heard for this long (seconds): what it
# sends meanwhile is discarded unread (counted as `unread_discarded`), so a peer that never reads
# costs the loop a receive per message, not a decode, an answer and a log line.
UNREAD_MUTE_S = 1.0
# Muted peers remembered at most; past this, those whose time is up are forgotten. The same
# bound for the peers whose unread replies are counted: past it, those with none tracked.
MAX_MUTED = 4096
# The ZAP handler's own logger: quiet, the endpoint logs what matters.
_zap_log = logging.getLogger("kvdepot.transport.zap")
_zap_log.setLevel(logging.WARNING)
# tcp connections a tcp endpoint takes at once (`CappedListener`): a node's engines need one each
# (a handful to a few dozen), and each costs a file descriptor. Past it new connections wait
# unanswered; ipc endpoints are owner-only and uncapped.
MAX_CONNECTIONS = 256
# Poll at least this often so peer expiry runs even when nobody talks (seconds).
MAX_POLL_INTERVAL = 1.0
# Peer expiry is checked at most this often (seconds), keeping the per-message cost flat.
EXPIRY_CHECK_INTERVAL = 0.1
# Two polls further apart than this (seconds) mean the server itself did not run between them
# (a poll waits at most MAX_POLL_INTERVAL): its peers are not taken for gone for that silence.
STALL_S = 3.0


@attrs.define
class _Unread:
    """The reply bytes sent to one peer that ZMQ may still hold (it has not written them out)."""

    total: int = 0  # every byte below
    tail: int = 0  # sent since the last tracked message
    tracked: deque[tuple[zmq.MessageTracker, int]] = attrs.Factory(deque)  # (tracker, bytes up to it)

    def settle(self) -> None:
        """Forgets the bytes up to every tracked message ZMQ has written out."""
        tracked = self.tracked
        while tracked and tracked[0][0].done:
            self.total -= tracked.popleft()[1]

    def older(self) -> int:
        """Unread bytes besides the latest tracked message, which ZMQ keeps until it sends another."""
        return self.total - self.tracked[-1][1] if self.tracked else self.total


class _EndpointBase:
    """Poll-loop logic shared by the ZMQ and in-memory endpoints."""

    address: str

    def __init__(
        self,
        handler: Handler,
        *,
        max_frame_bytes: int,
        peer_timeout: float,
        auth_secret: str | None,
        on_bad_frame: Callable[[BadFrame], None] | None,
        server_id: str | None = None,
    ) -> None:
        self.dispatcher = Dispatcher(
            handler,
            clock=time.monotonic,
            max_frame_bytes=max_frame_bytes,
            peer_timeout=peer_timeout,
            auth_secret=auth_secret,
            on_bad_frame=on_bad_frame,
        )
        self.server_id = server_id or uuid.uuid4().hex
        self._stopping = threading.Event()
        self._closed = False
        self._serving = threading.Lock()
        self._expire_at = 0.0
        self._last_poll = 0.0  # when poll_once last ran (monotonic; 0: never)

    @property
    def counters(self) -> dict[str, int]:
        """Requests, errors, bad frames and gone peers seen so far (a copy)."""
        return dict(self.dispatcher.counters)

    @property
    def peers(self) -> list[PeerInfo]:
        """The greeted peers currently considered alive."""
        return list(self.dispatcher.peers.values())

    def poll_once(self, timeout: float | None = 0.0) -> int:
        """Waits up to `timeout` seconds (None: until a message or the next peer expiry), handles
        what arrived, expires silent peers, and returns the number of messages handled."""
        if self._closed:
            raise TransportClosedError(f"the endpoint at {self.address} is closed")
        now = time.monotonic()
        if self._last_poll and now - self._last_poll > STALL_S:
            log.warning("server_stalled", seconds=round(now - self._last_poll, 1), peers=len(self.dispatcher.peers))
            self.dispatcher.forgive()
        self._last_poll = now
        if now >= self._expire_at:
            self.dispatcher.expire()
            due = self.dispatcher.next_expiry()
            slack = min(self.dispatcher.peer_timeout, MAX_POLL_INTERVAL)
            self._expire_at = now + slack if due is None else max(due, now + EXPIRY_CHECK_INTERVAL)
        wait = MAX_POLL_INTERVAL if timeout is None else timeout
        return self._poll(max(0.0, min(wait, self._expire_at - now)))

    def serve_forever(self) -> None:
        """Polls until `stop()` or `close()` is called (from any thread), then closes."""
        with self._serving:
            try:
                while not self._stopping.is_set():
                    self.poll_once(None)
            finally:
                self._close_now()

    def send_deferred(self, deferred: Deferred, body: ReplyBody) -> None:
        """Answer a request the handler deferred (loop thread only); nothing if its peer is gone."""
        if not self._closed:
            self._send(deferred.identity, [self.dispatcher.encode_deferred(deferred, body)])

    def wake(self) -> None:
        """Ends the loop's current wait early (any thread): work for the loop is waiting."""
        self._wake()

    def _send(self, identity: bytes, frames: list[bytes]) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        """Asks `serve_forever` to return; safe from any thread and from signal handlers."""
        self._stopping.set()
        self._wake()

    def close(self) -> None:
        """Stops serving and releases the socket. Waits for a running `serve_forever` to end."""
        self.stop()
        if self._serving.acquire(timeout=5.0):
            try:
                self._close_now()
            finally:
                self._serving.release()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # implemented by the transports
    def _poll(self, wait: float) -> int:
        raise NotImplementedError

    def _wake(self) -> None:
        raise NotImplementedError

    def _close_now(self) -> None:
        raise NotImplementedError


class ServerEndpoint(_EndpointBase):
    """A ZMQ ROUTER endpoint (ipc:// or tcp://); `open_endpoint` picks the class for an address.

    ipc sockets get a 0o700 directory and a 0o600 file; tcp binds other than loopback need
    `auth_secret`, which every client must then present in its Hello. `curve_secret_key`
    (a Z85 key from `zmq.curve_keypair()`) additionally encrypts every connection, so the
    secret and the traffic cannot be read off the network. `on_bad_frame` is told of every
    frame refused before the handler (on the loop thread). `limits` bound what a peer's flood
    costs (`PeerLimits`: its queue, its frames that are not requests) and give the memory a
    flood leaves free back to the system. A tcp endpoint takes at most `max_connections`
    connections at once (`CappedListener`; None: no cap), and `listener` has its figures.
    """

    #: The tcp listener's cap and counts (None: an ipc endpoint, or no cap).
    listener: CappedListener | None = None

    def __init__(
        self,
        address: str | None,
        handler: Handler,
        *,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        peer_timeout: float = DEFAULT_PEER_TIMEOUT,
        auth_secret: str | None = None,
        curve_secret_key: bytes | None = None,
        context: zmq.Context[Any] | None = None,
        on_bad_frame: Callable[[BadFrame], None] | None = None,
        server_id: str | None = None,
        limits: PeerLimits | None = None,
        max_connections: int | None = MAX_CONNECTIONS,
    ) -> None:
        address = address or default_address()
        if address.startswith(MEMORY_SCHEME):
            raise LocalProtocolError(
                f"{address} is an in-memory address; open it with open_endpoint(address, handler)", address=address
            )
        check_bind(address, authenticated=bool(auth_secret))
        super().__init__(
            handler,
            max_frame_bytes=max_frame_bytes,
            peer_timeout=peer_timeout,
            auth_secret=auth_secret,
            on_bad_frame=on_bad_frame,
            server_id=server_id,
        )
        self._own_context = context is None
        self._context = context or zmq.Context()
        self._ipc = ipc_path(address)
        if self._ipc is not None:
            prepare_ipc_dir(self._ipc)
            check_not_in_use(self._ipc)
        sock = self._context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting client takes over its identity
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full or gone peer raises, instead of a silent drop
        sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes * HARD_LIMIT_FACTOR)
        sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        self.limits = limits = limits or PeerLimits()
        sock.setsockopt(zmq.RCVHWM, limits.queue)
        self._authenticator: Any = None
        self._peer_check: PeerUserCheck | None = None
        if self._ipc is not None and self._own_context:
            # Only this user's (and root's) processes get a message through (SO_PEERCRED, in ZAP).
            self._peer_check = PeerUserCheck(self._context, "server")
            sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        if curve_secret_key is not None:
            # CURVE encrypts the connection; clients need the matching public key
            # (zmq.curve_public(secret)). Who may talk is still decided by auth_secret.
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.CURVE_SECRETKEY, curve_secret_key)
        elif auth_secret and address.startswith("tcp://"):
            # The secret is checked in ZMQ's handshake (PLAIN, through a ZAP handler), so a peer
            # without it never gets a message through, and libzmq buffers nothing of its;
            # Hello checks it again.
            from zmq.auth.thread import ThreadAuthenticator

            self._authenticator = ThreadAuthenticator(self._context, log=_zap_log)
            self._authenticator.start()
            self._authenticator.configure_plain(domain="*", passwords={PLAIN_USER: auth_secret})
            sock.setsockopt(zmq.PLAIN_SERVER, 1)
        try:
            if address.startswith("tcp://") and max_connections is not None:
                self.listener = CappedListener(self._context, sock, address, max_connections, "cache")
            else:
                sock.bind(address)
        except (zmq.ZMQError, TransportError) as exc:
            sock.close(0)
            if isinstance(exc, TransportError):
                raise
            raise TransportClosedError(f"cannot bind {address}: {exc}", address=address) from exc
        if self.listener is not None:
            self.listener.start()
        if self._ipc is not None:
            secure_ipc_socket(self._ipc)
        self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT) if address.startswith("tcp://") else address
        self._sock = sock
        self._muted: dict[bytes, tuple[float, str]] = {}  # identity -> (until when, counter of its discards)
        self._bad = BadFrames(limits.bad_frames, MAX_MUTED)
        self._trim = MemoryTrim(limits.trim_after, self.dispatcher.counters)
        for name in ("bad_discarded", "peers_muted"):
            self.dispatcher.counters[name] = 0
        self._unread: dict[bytes, _Unread] = {}  # identity -> the replies it may not have read
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        # A plain poll on the socket's ZMQ_FD (edge-signalled: ZMQ_EVENTS is checked before
        # sleeping) and the wake pipe; cheaper per wake-up than zmq_poll.
        self._poller = select.poll()
        self._poller.register(int(sock.getsockopt(zmq.FD)), select.POLLIN)
        self._poller.register(self._wake_r, select.POLLIN)
        log.info("endpoint_bound", address=self.address, server_id=self.server_id)

    def _poll(self, wait: float) -> int:
        sock = self._sock
        if not int(sock.getsockopt(_EVENTS)) & _POLLIN:  # sleep only when nothing is queued
            for fd, _ in self._poller.poll(wait * 1000):
                if fd == self._wake_r:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._wake_r, 4096)
        handled = 0
        now = time.monotonic()
        budget_end = now + POLL_BUDGET_S
        counters = self.dispatcher.counters
        trim = self._trim
        while handled < MAX_MESSAGES_PER_POLL and int(sock.getsockopt(_EVENTS)) & _POLLIN:
            msg = sock.recv_multipart(_NOBLOCK)
            handled += 1
            trim.taken += sum(map(len, msg)) + FRAME_OVERHEAD * len(msg)
            if len(msg) >= 2 and not (self._muted and self._muted_now(msg[0], now)):
                # ROUTER always prefixes the identity; else nothing to answer
                bad = counters["bad_frames"]
                allowed = self._bad.allowed(msg[0], now)
                self._reply(msg[0], self.dispatcher.dispatch(msg[0], msg[1:], bad_allowed=allowed))
                if counters["bad_frames"] != bad:
                    self._bad_frames(msg, counters["bad_frames"] - bad, now)
            now = time.monotonic()
            if now > budget_end:
                break
        if not handled and trim.due():  # quiet after a flood: give back what it left free
            trim.run()
        return handled

    def _bad_frames(self, msg: list[bytes], bad: int, now: float) -> None:
        """Counts a message's bad frames against its peer; mutes a peer past `PeerLimits.bad_frames`."""
        if len(msg) - 1 > MAX_FRAMES_PER_MESSAGE:  # refused whole, counted once: every frame was bad
            bad = len(msg) - 1
        if self._bad.add(msg[0], bad, now):
            reason = f"more than {self._bad.limit} frames that are not requests in {BAD_MUTE_S:g} s"
            log.warning("peer_muted", peer=msg[0].hex(), reason=reason, muted_s=BAD_MUTE_S)
            self.dispatcher.counters["peers_muted"] += 1
            self.dispatcher.drop(msg[0])
            self._mute(msg[0], BAD_MUTE_S, "bad_discarded")

    def _muted_now(self, identity: bytes, now: float) -> bool:
        """Whether a message from `identity` is discarded: its replies went unread lately, or it
        sent frames that are not requests."""
        muted = self._muted.get(identity)
        if muted is None:
            return False
        if now < muted[0]:
            self.dispatcher.counters[muted[1]] += 1
            return True
        del self._muted[identity]
        return False

    def _send(self, identity: bytes, frames: list[bytes]) -> None:
        self._reply(identity, frames)

    def _reply(self, identity: bytes, replies: list[bytes]) -> None:
        if not replies:
            return  # every request of the message was deferred
        unread = self._unread.get(identity)
        if unread is None:
            unread = self._unread_of(identity)
        else:
            unread.settle()
            if unread.older() > MAX_UNREAD_BYTES:
                self._drop(identity, f"{unread.total} bytes of replies unread")
                return
        sock = self._sock
        try:
            sock.send(identity, _SNDMORE_NOBLOCK)  # raises before anything is queued
        except zmq.Again:  # the peer does not read its replies: drop it and what it holds
            self._drop(identity, f"{SEND_HWM} replies unread")
            return
        except zmq.ZMQError:  # EHOSTUNREACH: the peer disconnected; its reply has nobody to go to
            return
        size = len(replies[-1])
        for frame in replies[:-1]:
            sock.send(frame, _SNDMORE_NOBLOCK)
            size += len(frame)
        unread.total += size
        unread.tail += size
        if unread.tail < TRACK_BYTES:
            sock.send(replies[-1], _NOBLOCK)
            return
        last = zmq.Frame(replies[-1], copy=False, track=True)
        sock.send(last, _NOBLOCK, copy=False)
        unread.tracked.append((last.tracker, unread.tail))
        unread.tail = 0

    def _unread_of(self, identity: bytes) -> _Unread:
        """A fresh count for a peer not sent to before; forgets those with nothing tracked past MAX_MUTED."""
        if len(self._unread) >= MAX_MUTED:
            self._unread = {peer: unread for peer, unread in self._unread.items() if unread.tracked}
        unread = self._unread[identity] = _Unread()
        return unread

    def _drop(self, identity: bytes, reason: str) -> None:
        """Drops a peer that does not read its replies: its session ends and it is muted a while."""
        log.warning("peer_dropped", peer=identity.hex(), reason=reason, muted_s=UNREAD_MUTE_S)
        self.dispatcher.counters["peers_dropped"] += 1
        self.dispatcher.drop(identity)
        self._mute(identity, UNREAD_MUTE_S, "unread_discarded")

    def _mute(self, identity: bytes, seconds: float, counter: str) -> None:
        """Discards what `identity` sends for `seconds`, counting each message as `counter`."""
        now = time.monotonic()
        if len(self._muted) >= MAX_MUTED:
            self._muted = {peer: muted for peer, muted in self._muted.items() if muted[0] > now}
        if len(self._muted) < MAX_MUTED:
            self._muted[identity] = (now + seconds, counter)

    def _wake(self) -> None:
        if self._closed:
            return  # the pipe's descriptors may already belong to someone else
        with contextlib.suppress(OSError):  # a full pipe means it is awake already
            os.write(self._wake_w, b"x")

    def _close_now(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._sock.close(0)
        if self.listener is not None:
            self.listener.close()  # after its ZMQ socket, before the context
        if self._authenticator is not None:
            self._authenticator.stop()
        if self._peer_check is not None:
            self._peer_check.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
        if self._own_context:
            self._context.term()
        if self._ipc is not None:
            with contextlib.suppress(OSError):
                self._ipc.unlink()
        log.info("endpoint_closed", address=self.address)
