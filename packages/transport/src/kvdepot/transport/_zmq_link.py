"""The ZMQ link of a client connection: a DEALER socket plus a monitor of its connection.

Everything here runs on the I/O loop (`_io.IOLoop`): the loop watches each socket's ZMQ_FD
with `add_reader`, and the link reports to the connection's driver (`_client.Connection`),
which sends through `send`. Nothing else touches the sockets.

ZMQ_FD is edge-triggered: any call on the socket (a send included) may consume the
notification of a message that has already arrived. So the link reads until the socket
says EAGAIN whenever its FD fires, and again right after every send; a reply can never sit
unread until the next heartbeat. (pyzmq's `zmq.asyncio` sockets leave this to their own
bookkeeping, which has open reports of multi-second stalls.)
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from kvdepot.transport._codec import HARD_LIMIT_FACTOR
from kvdepot.transport._io import IOLoop
from kvdepot.transport._log import get_logger
from kvdepot.transport._peercred import PLAIN_USER, ZAP_DOMAIN

if TYPE_CHECKING:
    from kvdepot.transport._client import Connection

log = get_logger(__name__)

# Reconnect quickly after a server restart, backing off to once a second.
RECONNECT_IVL_MS = 50
RECONNECT_IVL_MAX_MS = 1000
# Messages queued per socket before sends fail (they then wait for the next connection).
SEND_HWM = 100_000
# Messages read in one turn of the loop before other work (timers, other sockets) runs.
READS_PER_TURN = 256

_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


class ZmqLink:
    """A DEALER socket whose identity is the client id, watched through a socket monitor."""

    def __init__(self, conn: Connection, loop: IOLoop) -> None:
        self._conn = conn
        self._loop = loop
        self._sock: zmq.Socket[Any] | None = None
        self._monitor: zmq.Socket[Any] | None = None
        self._fds: list[int] = []
        self._read_due = False  # a read of the socket is scheduled on the loop

    def open(self) -> None:
        conn = self._conn
        sock = self._loop.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # never queue on a connection that is not up
        sock.setsockopt(zmq.ROUTING_ID, conn.client_id.encode())
        sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
        sock.setsockopt(zmq.MAXMSGSIZE, conn.max_frame_bytes * HARD_LIMIT_FACTOR)
        sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        sock.setsockopt(zmq.RCVHWM, SEND_HWM)
        if conn.curve_server_key is None and conn.auth_secret and conn.address.startswith("tcp://"):
            sock.setsockopt(zmq.PLAIN_USERNAME, PLAIN_USER.encode())  # the server checks it in the handshake
            sock.setsockopt(zmq.PLAIN_PASSWORD, conn.auth_secret.encode())
        if conn.curve_server_key is not None:
            public, secret = zmq.curve_keypair()  # an ephemeral key pair per client
            sock.setsockopt(zmq.CURVE_SERVERKEY, conn.curve_server_key)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
        if conn.address.startswith("ipc://"):
            self._loop.check_ipc_peers()  # the server must be this user's or root's (SO_PEERCRED)
            sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILED)
        sock.connect(conn.address)
        self._sock, self._monitor = sock, monitor
        loop = self._loop.loop
        self._fds = [sock.FD, monitor.FD]
        loop.add_reader(self._fds[0], self._read)
        loop.add_reader(self._fds[1], self._watch)
        self._read_soon()
        loop.call_soon(self._watch)

    def send(self, frames: list[bytes]) -> bool:
        """Sends one message; False if no server is connected (nothing was sent)."""
        sock = self._sock
        if sock is None:
            return False
        try:
            sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            return False
        finally:
            self._read_soon()  # the send may have taken the FD's edge for a waiting reply
        return True

    def _read_soon(self) -> None:
        if not self._read_due:
            self._read_due = True
            self._loop.loop.call_soon(self._read)

    def _read(self) -> None:
        """Hands the connection every reply that has arrived, until the socket says EAGAIN."""
        self._read_due = False
        conn = self._conn
        for _ in range(READS_PER_TURN):
            sock = self._sock
            if sock is None:
                return
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                conn.on_frames(frames)
            except Exception:  # the link must outlive one bad reply
                log.exception("client_reply_handling_failed", address=conn.address)
        self._read_soon()  # more may wait: after the loop's other work

    def _watch(self) -> None:
        """Reports the monitor's events, until it says EAGAIN."""
        while (monitor := self._monitor) is not None:
            try:
                event = parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))["event"]
            except zmq.Again:
                return
            try:
                self._on_event(event)
            except Exception:
                log.exception("client_link_event_failed", address=self._conn.address, zmq_event=event)

    def _on_event(self, event: int) -> None:
        conn = self._conn
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            conn.on_link_up()
        elif event == zmq.EVENT_DISCONNECTED:
            conn.on_link_down()
        elif event & _HANDSHAKE_FAILED:
            conn.on_security_failure(int(event))

    def close(self) -> None:
        loop = self._loop.loop
        for fd in self._fds:
            loop.remove_reader(fd)
        self._fds = []
        sock, monitor = self._sock, self._monitor
        self._sock = self._monitor = None
        if sock is not None:
            with contextlib.suppress(zmq.ZMQError):
                sock.disable_monitor()
            sock.close(0)
        if monitor is not None:
            monitor.close(0)
