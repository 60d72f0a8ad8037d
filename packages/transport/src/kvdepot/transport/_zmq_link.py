"""The ZMQ link of a client connection: a DEALER socket plus a monitor of its connection."""

from __future__ import annotations

import contextlib
import math
import os
import select
import threading
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvdepot.transport._io import IOLoop
from kvdepot.transport._peercred import ZAP_DOMAIN
from kvdepot.transport._server import HARD_LIMIT_FACTOR, PLAIN_USER

if TYPE_CHECKING:
    from kvdepot.transport._client import Connection

# Reconnect quickly after a server restart, backing off to once a second.
RECONNECT_IVL_MS = 50
RECONNECT_IVL_MAX_MS = 1000
# Replies read per wake-up before timers are checked again.
MAX_RECV_PER_WAKE = 1024
SEND_HWM = 100_000
# A caller blocked on its reply reads the socket itself for at most this long; a slower
# reply (or one the I/O thread settles: a deadline, a disconnect) is left to the I/O thread.
WAIT_ON_CALLER_S = 0.05

# Plain ints: zmq's enum members cost a Python-level __and__ on every use in the hot path.
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_NOBLOCK = int(zmq.NOBLOCK)
_HANDSHAKE_FAILED = (
    int(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
    | int(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
    | int(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
)


class ZmqLink:
    """A DEALER socket whose identity is the client id, watched through a socket monitor.

    Any thread may send, holding the connection's lock, so the I/O thread does not poll
    the socket itself (that would race with those sends): it polls the socket's ZMQ_FD and
    reads under the lock. ZMQ_FD only signals edges, so whoever touches the socket checks
    ZMQ_EVENTS afterwards and makes sure pending replies get read.

    A thread blocked on a reply reads it itself (`wait`): one wake-up per round trip, as
    with a bare socket, instead of the I/O thread's and then the caller's.
    """

    def __init__(self, conn: Connection, loop: IOLoop) -> None:
        self._conn = conn
        self._loop = loop
        self._sock: zmq.Socket[Any] | None = None
        self._fd: int | None = None
        self._monitor: zmq.Socket[Any] | None = None
        self._poller: select.poll | None = None  # for `wait`: the socket's fd and _wake_fd
        self._wake_fd: int | None = None  # wakes the thread in `wait` when another touched the socket
        self._waiter: int | None = None  # the thread reading replies in `wait` (guarded by the connection lock)

    def open(self) -> None:
        sock = self._loop.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # never queue on a connection that is not up
        sock.setsockopt(zmq.ROUTING_ID, self._conn.client_id.encode())
        sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
        sock.setsockopt(zmq.MAXMSGSIZE, self._conn.max_frame_bytes * HARD_LIMIT_FACTOR)
        sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        sock.setsockopt(zmq.RCVHWM, SEND_HWM)
        if self._conn.curve_server_key is None and self._conn.auth_secret and self._conn.address.startswith("tcp://"):
            sock.setsockopt(zmq.PLAIN_USERNAME, PLAIN_USER.encode())  # the server checks it in the handshake
            sock.setsockopt(zmq.PLAIN_PASSWORD, self._conn.auth_secret.encode())
        if self._conn.curve_server_key is not None:
            public, secret = zmq.curve_keypair()  # an ephemeral key pair per client
            sock.setsockopt(zmq.CURVE_SERVERKEY, self._conn.curve_server_key)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
        if self._conn.address.startswith("ipc://"):
            self._loop.check_ipc_peers()  # the server must be this user's or root's (SO_PEERCRED)
            sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        self._monitor = sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILED
        )
        sock.connect(self._conn.address)
        self._sock = sock
        self._fd = sock.getsockopt(zmq.FD)
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._poller = select.poll()
        self._poller.register(self._fd, select.POLLIN)
        self._poller.register(self._wake_fd, select.POLLIN)
        self._loop.add_reader(self._fd, self._readable)
        self._loop.add_reader(self._monitor, self._monitor_event)

    def send(self, frames: list[bytes]) -> bool:
        """Sends one message (caller holds the connection lock); False if no server is connected."""
        sock = self._sock
        if sock is None:
            return False
        try:
            if len(frames) == 1:
                sock.send(frames[0], _NOBLOCK)
            else:
                sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            return False
        finally:
            # The send may have eaten the fd's edge: make sure pending replies get read.
            waiter = self._waiter
            if waiter is None:
                if int(sock.getsockopt(_EVENTS)) & _POLLIN:
                    self._loop.call_soon(self._readable)
            elif waiter != threading.get_ident():
                self._wake_waiter()  # it reads them; its poll may not see the fd again
        return True

    def _readable(self) -> None:
        conn = self._conn
        with conn._lock:
            if self._waiter is not None:
                self._wake_waiter()  # the socket is the waiting thread's now; let it read
            elif not self._read_locked():
                self._loop.call_soon(self._readable)  # more to read; let timers run first
        conn.settle_ready()

    def nudge(self) -> None:
        """Wakes the thread waiting in `wait`, if it is not this one, to look at its future."""
        waiter = self._waiter
        if waiter is not None and waiter != threading.get_ident():
            self._wake_waiter()

    def _wake_waiter(self) -> None:
        if self._wake_fd is not None:
            os.eventfd_write(self._wake_fd, 1)

    def _read_locked(self) -> bool:
        """Reads up to MAX_RECV_PER_WAKE replies; True when none are left."""
        conn = self._conn
        sock = self._sock
        for _ in range(MAX_RECV_PER_WAKE):
            if sock is None or not int(sock.getsockopt(_EVENTS)) & _POLLIN:
                return True
            conn._on_frames_locked(sock.recv_multipart(_NOBLOCK))
            sock = self._sock
        return False

    def wait(self, future: Future[Any], timeout: float | None) -> float | None:
        """Reads replies on this thread until `future` is done; returns the time left of `timeout`.

        One thread per connection at a time does this, for at most WAIT_ON_CALLER_S; the
        socket's fd is muted in the I/O loop meanwhile, so the loop neither wakes for the
        reply nor competes for the GIL. Other waiters, and whatever is left afterwards, are
        served by the I/O thread as usual. While this thread waits, nobody else reads the
        socket: a thread whose send may have eaten the fd's edge, or the I/O loop, wakes
        it through `_wake_fd` instead.
        """
        conn = self._conn
        me = threading.get_ident()
        start = time.monotonic()
        with conn._lock:
            fd, poller, wake_fd = self._fd, self._poller, self._wake_fd
            if fd is None or poller is None or self._waiter not in (None, me):
                return timeout
            # A done-callback run by this very wait may wait on another reply: nobody else
            # reads the muted socket, so that inner wait goes on until its future is done
            # (the I/O thread still settles deadlines and disconnects, and nudges it).
            nested = self._waiter == me
            self._waiter = me
            if not nested:
                self._loop.mute(fd, True)
        window = math.inf if nested else WAIT_ON_CALLER_S
        end = start + (window if timeout is None else min(timeout, window))
        try:
            while True:
                with conn._lock:
                    if self._fd != fd:
                        break  # closed
                    self._read_locked()  # also before the first poll: ZMQ_FD only signals edges
                conn.settle_ready()  # callbacks run here, without the lock
                if future.done():
                    break
                left = end - time.monotonic()
                if left <= 0:
                    break
                for ready, _ in poller.poll(min(left, WAIT_ON_CALLER_S) * 1000):
                    if ready == wake_fd:
                        with contextlib.suppress(BlockingIOError):
                            os.eventfd_read(wake_fd)
        finally:
            if not nested:
                with conn._lock:
                    self._waiter = None
                    sock = self._sock
                    if self._fd == fd and sock is not None:  # else closed meanwhile; the fd may be reused
                        self._loop.mute(fd, False)
                        # replies for others (with none in flight, only late ones: they can wait)
                        if conn._inflight and int(sock.getsockopt(_EVENTS)) & _POLLIN:
                            self._loop.call_soon(self._readable)
                    elif wake_fd is not None:
                        os.close(wake_fd)  # close() left it to us
        return None if timeout is None else max(0.0, start + timeout - time.monotonic())

    def _monitor_event(self) -> None:
        while self._monitor is not None:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._conn.on_connected()
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self._conn.on_disconnected()
            elif event["event"] & _HANDSHAKE_FAILED:
                self._conn.on_security_failure(int(event["event"]))

    def close(self) -> None:
        if self._fd is not None:
            self._loop.remove_reader(self._fd)
            self._fd = None
            self._poller = None
        if self._wake_fd is not None:
            if self._waiter is None:
                os.close(self._wake_fd)
            else:  # the waiting thread polls it: wake it; it closes the fd on its way out
                os.eventfd_write(self._wake_fd, 1)
            self._wake_fd = None
        if self._sock is not None:
            self._sock.disable_monitor()
            self._sock.close(0)
            self._sock = None
        if self._monitor is not None:
            self._loop.remove_reader(self._monitor)
            self._monitor.close(0)
            self._monitor = None
