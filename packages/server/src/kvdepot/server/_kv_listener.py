"""A cap on the connections of the KV-events publisher's tcp listeners (the PUB and replay ports).

libzmq has no connection cap, and every connection costs the server a file descriptor: plain
tcp connections that never speak ZMTP fill the process's file table, and then libzmq aborts the
whole server on the next ipc accept (``Too many open files (src/ipc_listener.cpp:297)``). A ZAP
handler cannot help: it is asked only after a peer's greeting, and a silent connection never
sends one.

So the server makes the listening socket itself and hands it to libzmq (``ZMQ_USE_FD``), counts
the connections libzmq accepts and closes (a socket monitor: ``EVENT_ACCEPTED``,
``EVENT_DISCONNECTED``), and while a listener is at its cap attaches a socket filter that drops
every incoming packet of the listening socket: new connections' SYNs go unanswered (a client
sees a connect that does not complete, and libzmq's clients retry by themselves), and no file
descriptor is spent on them. Below the cap the filter comes off. A connection accepted in the
moment before the filter is on inherits it, never completes its handshake, and is closed after
`HANDSHAKE_S`, as every silent connection is.

ipc endpoints need no cap: their directory is owner-only, so only the server's own user (who
could stop the server anyway) can connect. The filter is Linux's (``SO_ATTACH_FILTER``); where
the kernel refuses it, the listener logs once and counts, uncapped.
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct
import threading
from typing import Any

import structlog
import zmq

from kvdepot.server._errors import ServerArgumentError

log = structlog.get_logger(__name__)

#: Seconds a connection may take for ZMTP's handshake before libzmq closes it (libzmq's default
#: is 30): a silent connection holds a slot of the cap no longer than this.
HANDSHAKE_S = 5.0
#: Pending connections the kernel queues for libzmq's accept (libzmq's default is 100): what the
#: cap can overshoot by before its filter is on.
LISTEN_BACKLOG = 16
_SO_ATTACH_FILTER = 26
_SO_DETACH_FILTER = 27
_BPF_RET_K = 0x06  # classic BPF "return k": k = 0 keeps no byte of the packet (drops it)
_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
_monitor_ids = iter(range(1 << 62))


def _tcp_listening_socket(endpoint: str) -> socket.socket:
    """A listening tcp socket bound where ``tcp://HOST:PORT`` says (``*`` for every address)."""
    host, sep, port = endpoint.removeprefix("tcp://").rpartition(":")
    if not sep or not (port.isdigit() or port == "*"):
        raise ServerArgumentError(f"cannot publish KV events on {endpoint}: give tcp://HOST:PORT", endpoint=endpoint)
    host = "0.0.0.0" if host == "*" else host.strip("[]")  # noqa: S104 - what libzmq's "*" binds
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, 0 if port == "*" else int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise ServerArgumentError(f"cannot publish KV events on {endpoint}: {exc}", endpoint=endpoint) from exc
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as libzmq: a restart rebinds at once
        sock.bind(address)
        sock.listen(LISTEN_BACKLOG)
    except OSError as exc:
        sock.close()
        raise ServerArgumentError(f"cannot publish KV events on {endpoint}: {exc.strerror}", endpoint=endpoint) from exc
    return sock


class CappedListener:
    """One ZMQ socket's tcp listener, with at most `cap` connections (see the module's docstring).

    `bind()` instead of the socket's own; the owner calls `on_monitor_event` with each message
    of `monitor` (one thread), and `close()` after the ZMQ socket is closed."""

    def __init__(self, context: zmq.Context[Any], sock: zmq.Socket[Any], endpoint: str, cap: int, name: str) -> None:
        self.name = name
        self.cap = cap
        self.connections = 0  # open now (accepted, not yet closed)
        self.full = 0  # times the listener reached its cap and began refusing
        self._filtered = False
        self._listener = _tcp_listening_socket(endpoint)
        self._drop = ctypes.create_string_buffer(struct.pack("HBBI", _BPF_RET_K, 0, 0, 0))
        self._lock = threading.Lock()
        address = f"inproc://kvdepot-kv-events-monitor-{next(_monitor_ids)}"
        try:
            sock.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_S * 1000))
            sock.monitor(address, _EVENTS)
            self.monitor: zmq.Socket[Any] = context.socket(zmq.PAIR)
            # No high-water mark: a lost event would leave the count wrong for good. Events come
            # no faster than connections, which the cap stops.
            self.monitor.setsockopt(zmq.RCVHWM, 0)
            self.monitor.setsockopt(zmq.LINGER, 0)
            self.monitor.connect(address)
            fd = os.dup(self._listener.fileno())  # libzmq closes its copy with the ZMQ socket
            sock.setsockopt(zmq.USE_FD, fd)
            try:
                sock.bind(endpoint)
            except zmq.ZMQError:
                os.close(fd)
                raise
        except zmq.ZMQError as exc:
            self._listener.close()
            raise ServerArgumentError(f"cannot publish KV events on {endpoint}: {exc}", endpoint=endpoint) from exc

    def on_monitor_event(self, frames: list[bytes]) -> None:
        """Count a connection accepted or closed, and open or close the door (monitor thread)."""
        event = struct.unpack_from("=H", frames[0])[0]  # (event, value) and the endpoint: the event is enough
        with self._lock:
            if event == zmq.EVENT_ACCEPTED:
                self.connections += 1
            elif event == zmq.EVENT_DISCONNECTED:
                self.connections = max(0, self.connections - 1)
            if self.connections >= self.cap and not self._filtered:
                self._set_filter(True)
                self.full += 1
                log.warning("kv_events_listener_full", listener=self.name, connections=self.connections)
            elif self.connections < self.cap and self._filtered:
                self._set_filter(False)
                log.info("kv_events_listener_open", listener=self.name, connections=self.connections)

    def _set_filter(self, drop: bool) -> None:
        try:
            if drop:
                program = struct.pack("HL", 1, ctypes.addressof(self._drop))
                self._listener.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER, program)
            else:
                self._listener.setsockopt(socket.SOL_SOCKET, _SO_DETACH_FILTER, 0)
        except OSError as exc:
            log.warning("kv_events_listener_filter_failed", listener=self.name, error=exc.strerror)
        self._filtered = drop

    def close(self) -> None:
        """Close the monitor and the listening socket (after the ZMQ socket, which stopped using it)."""
        self.monitor.close(linger=0)
        self._listener.close()
