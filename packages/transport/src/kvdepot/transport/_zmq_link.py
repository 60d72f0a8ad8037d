"""The ZMQ link of a client connection: a DEALER socket plus a monitor of its connection.

Everything here runs on the I/O loop (`_io.IOLoop`): two tasks read the socket and its
monitor and report to the connection's driver (`_client.Connection`), which sends through
`send`. The sockets are pyzmq's `zmq.asyncio` sockets; nothing else touches them.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

import structlog
import zmq
from zmq.utils.monitor import parse_monitor_message

from kvdepot.transport._io import IOLoop
from kvdepot.transport._peercred import ZAP_DOMAIN
from kvdepot.transport._server import HARD_LIMIT_FACTOR, PLAIN_USER

if TYPE_CHECKING:
    from kvdepot.transport._client import Connection

log = structlog.get_logger(__name__)

# Reconnect quickly after a server restart, backing off to once a second.
RECONNECT_IVL_MS = 50
RECONNECT_IVL_MAX_MS = 1000
# Messages queued per socket before sends fail (they then wait for the next connection).
SEND_HWM = 100_000

_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


class ZmqLink:
    """A DEALER socket whose identity is the client id, watched through a socket monitor."""

    def __init__(self, conn: Connection, loop: IOLoop) -> None:
        self._conn = conn
        self._loop = loop
        self._sock: Any = None  # zmq.asyncio.Socket
        self._monitor: Any = None
        self._tasks: list[asyncio.Task[None]] = []

    def open(self) -> None:
        conn = self._conn
        sock = self._loop.async_context.socket(zmq.DEALER)
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
        self._monitor = sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILED
        )
        sock.connect(conn.address)
        self._sock = sock
        loop = self._loop.loop
        self._tasks = [loop.create_task(self._read()), loop.create_task(self._watch())]

    def send(self, frames: list[bytes]) -> bool:
        """Sends one message; False if no server is connected (nothing was sent)."""
        if self._sock is None:
            return False
        sent = self._sock.send_multipart(frames, zmq.NOBLOCK)  # a done future (NOBLOCK)
        return sent.exception() is None

    async def _read(self) -> None:
        sock, conn = self._sock, self._conn
        while True:
            frames = await sock.recv_multipart()
            try:
                conn.on_frames(frames)
            except Exception:  # the link must outlive one bad reply
                log.exception("client_reply_handling_failed", address=conn.address)

    async def _watch(self) -> None:
        monitor, conn = self._monitor, self._conn
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())["event"]
            try:
                self._on_event(event)
            except Exception:
                log.exception("client_link_event_failed", address=conn.address, zmq_event=event)

    def _on_event(self, event: int) -> None:
        conn = self._conn
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            conn.on_link_up()
        elif event == zmq.EVENT_DISCONNECTED:
            conn.on_link_down()
        elif event & _HANDSHAKE_FAILED:
            conn.on_security_failure(int(event))

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._tasks = []
        if self._sock is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._sock.disable_monitor()
            self._sock.close(0)
            self._sock = None
        if self._monitor is not None:
            self._monitor.close(0)
            self._monitor = None
