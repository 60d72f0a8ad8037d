"""A cap on the connections of a ZMQ socket's tcp listener.

libzmq has no connection cap, and every connection costs the process a file descriptor: plain
tcp connections that never speak ZMTP fill the process's file table. Then libzmq aborts the
whole process on the next ipc accept (``Too many open files (src/ipc_listener.cpp:297)``), or a
tcp listener spins on its failing accept and locks every new client out. A ZAP handler cannot
help: it is asked only after a peer's greeting, and a silent connection never sends one.

So the listening socket is made here and handed to libzmq (``ZMQ_USE_FD``). A socket monitor
counts the connections libzmq accepts and closes (``EVENT_ACCEPTED``, ``EVENT_DISCONNECTED``).
While the listener is at its cap, a socket filter drops every incoming packet of the listening
socket. New connections' SYNs go unanswered: a client sees a connect that does not complete,
and libzmq's clients retry by themselves. No file descriptor is spent on them. Below the cap the
filter comes off. Connections already open are other sockets, so the filter never touches them.
A connection accepted in the moment before the filter is on inherits it, never completes its
handshake, and is closed after `HANDSHAKE_S`, as every silent connection is.

ipc endpoints need no cap: their directory is owner-only, so only the process's own user (who
could stop it anyway) can connect. The filter is Linux's (``SO_ATTACH_FILTER``); where the
kernel refuses it, the listener logs once and counts, uncapped.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import struct
import threading
from typing import Any

import zmq

from kvdepot.transport._errors import LocalProtocolError, TransportClosedError
from kvdepot.transport._log import get_logger

log = get_logger(__name__)

#: Seconds a connection may take for ZMTP's handshake before libzmq closes it (libzmq's default
#: is 30): a silent connection holds a slot of the cap no longer than this.
HANDSHAKE_S = 5.0
#: Pending connections the kernel queues for libzmq's accept (libzmq's default is 100): what the
#: cap can overshoot by before its filter is on.
LISTEN_BACKLOG = 16
#: How often a listener's own counting thread (`start`) looks at its stop flag (seconds).
WATCH_POLL_S = 0.1
#: Why a listener dropped connections, for the owner's figures: ``full``, the times it reached its
#: cap and began refusing new connections (the refused ones are never seen: their SYNs are
#: dropped); ``handshake``, connections that ended before ZMTP's handshake was done (closed
#: after `HANDSHAKE_S` of silence, refused for a wrong secret or bad greeting, or left by the peer).
REFUSAL_REASONS = ("full", "handshake")
_SO_ATTACH_FILTER = 26
_SO_DETACH_FILTER = 27
_BPF_RET_K = 0x06  # classic BPF "return k": k = 0 keeps no byte of the packet (drops it)
_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
# Not EVENT_ACCEPT_FAILED: a listener out of file descriptors fails its accept in a tight loop, and
# one event per failure would queue faster than they are read.
_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILED
_monitor_ids = iter(range(1 << 62))


def _cannot_listen(endpoint: str, reason: str) -> TransportClosedError:
    return TransportClosedError(f"cannot listen on {endpoint}: {reason}", endpoint=endpoint, reason=reason)


def tcp_listening_socket(endpoint: str) -> socket.socket:
    """A listening tcp socket bound where ``tcp://HOST:PORT`` says (``*`` for every address).

    `LocalProtocolError` for an endpoint that is not one, `TransportClosedError` where it cannot
    listen (both with fields `endpoint` and `reason`)."""
    host, sep, port = endpoint.removeprefix("tcp://").rpartition(":")
    if not sep or not (port.isdigit() or port == "*"):
        raise LocalProtocolError(
            f"cannot listen on {endpoint}: give tcp://HOST:PORT", endpoint=endpoint, reason="give tcp://HOST:PORT"
        )
    host = "0.0.0.0" if host == "*" else host.strip("[]")  # noqa: S104 - what libzmq's "*" binds
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, 0 if port == "*" else int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except OSError as exc:  # a host name that does not resolve
        raise LocalProtocolError(f"cannot listen on {endpoint}: {exc}", endpoint=endpoint, reason=str(exc)) from exc
    try:
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise _cannot_listen(endpoint, exc.strerror or str(exc)) from exc
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as libzmq: a restart rebinds at once
        sock.bind(address)
        sock.listen(LISTEN_BACKLOG)
    except OSError as exc:
        sock.close()
        raise _cannot_listen(endpoint, exc.strerror or str(exc)) from exc
    return sock


class CappedListener:
    """One ZMQ socket's tcp listener, with at most `cap` connections (see the module's docstring).

    Made instead of the socket's own ``bind()``, after the socket's other options are set. The
    owner either calls `on_monitor_event` with each message of `monitor` (from one thread of
    its own), or calls `start()` once, and the listener counts in a thread of its own. `close()`
    after the ZMQ socket is closed (and before its context is terminated)."""

    def __init__(self, context: zmq.Context[Any], sock: zmq.Socket[Any], endpoint: str, cap: int, name: str) -> None:
        self.name = name
        self.cap = cap
        self.connections = 0  # open now (accepted, not yet closed)
        self.accepted = 0  # accepted so far (a connection closed between two looks still counts)
        self.full = 0  # times the listener reached its cap and began refusing
        self.handshake_failed = 0  # connections closed in or for their handshake
        self._filtered = False
        self._listener = tcp_listening_socket(endpoint)
        self._drop = ctypes.create_string_buffer(struct.pack("HBBI", _BPF_RET_K, 0, 0, 0))
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        address = f"inproc://kvdepot-listener-monitor-{next(_monitor_ids)}"
        try:
            self.monitor: zmq.Socket[Any] = context.socket(zmq.PAIR)
        except zmq.ZMQError as exc:
            self._listener.close()
            raise _cannot_listen(endpoint, str(exc)) from exc
        try:
            sock.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_S * 1000))
            sock.monitor(address, _EVENTS)
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
            self.monitor.close(linger=0)
            self._listener.close()
            raise _cannot_listen(endpoint, str(exc)) from exc

    @property
    def refused(self) -> dict[str, int]:
        """What the listener dropped so far, by reason (`REFUSAL_REASONS`)."""
        return {"full": self.full, "handshake": self.handshake_failed}

    def on_monitor_event(self, frames: list[bytes]) -> None:
        """Count a connection accepted or closed, and open or close the door (one thread)."""
        event = struct.unpack_from("=H", frames[0])[0]  # (event, value) and the endpoint: the event is enough
        with self._lock:
            if event == zmq.EVENT_ACCEPTED:
                self.connections += 1
                self.accepted += 1
            elif event == zmq.EVENT_DISCONNECTED:
                self.connections = max(0, self.connections - 1)
            elif event & _HANDSHAKE_FAILED:
                self.handshake_failed += 1
            if self.connections >= self.cap and not self._filtered:
                self._set_filter(True)
                self.full += 1
                log.warning("listener_filled", listener=self.name, connections=self.connections, cap=self.cap)
            elif self.connections < self.cap and self._filtered:
                self._set_filter(False)
                log.info("listener_reopened", listener=self.name, connections=self.connections, cap=self.cap)

    def start(self) -> None:
        """Count in a thread of the listener's own, until `close()`."""
        assert self._thread is None, "a listener is started once"
        self._thread = threading.Thread(target=self._watch, name=f"kvdepot-{self.name}-listener", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        monitor = self.monitor
        while not self._stop.is_set():
            if monitor.poll(int(WATCH_POLL_S * 1000)):
                with contextlib.suppress(zmq.Again):
                    while True:
                        self.on_monitor_event(monitor.recv_multipart(zmq.NOBLOCK))

    def _set_filter(self, drop: bool) -> None:
        try:
            if drop:
                program = struct.pack("HL", 1, ctypes.addressof(self._drop))
                self._listener.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER, program)
            else:
                self._listener.setsockopt(socket.SOL_SOCKET, _SO_DETACH_FILTER, 0)
        except OSError as exc:
            log.warning("listener_filter_refused", listener=self.name, error=exc.strerror)
        self._filtered = drop

    def close(self) -> None:
        """Stop counting, close the monitor and the listening socket (after the ZMQ socket, which
        stopped using it)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.monitor.close(linger=0)
        self._listener.close()
