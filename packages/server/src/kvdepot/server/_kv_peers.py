"""What one tcp peer of the KV-events PUB port may send: ``send_bytes`` in all.

libzmq keeps every subscription a peer sends until that peer disconnects: a PUB socket in its
trie; an XPUB in manual mode, which applies only the server's chosen ones, still in a copy of its
own (``_manual_subscriptions``, kept to announce unsubscriptions when the peer leaves). No
socket option bounds either, and a subscription message carries nothing that names its
connection. So the server bounds what a tcp peer may send in all: a subscriber sends a greeting
and a few subscriptions, some hundred bytes. Each time the publisher refuses a subscription, every
connection of the port that has received more than ``send_bytes`` (the kernel's count, TCP_INFO's
``tcpi_bytes_received``) is shut down: libzmq sees it end, lets go of its subscriptions, and
counts it disconnected. A subscriber cut off reconnects by itself, and sees a gap it can replay.

The port's connections are found among the process's open files (``/proc/self/fd``): the
sockets whose local end is the port and that have a peer (the listening socket has none). Each
is looked at on a duplicate of its descriptor, so one that libzmq closes meanwhile, and whose
number is reused, is never touched unless it is again one of the port's connections.
ipc endpoints need no bound: only the server's own user can connect to them.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
from collections.abc import Iterator
from typing import Any

from kvdepot.transport import get_logger

log = get_logger(__name__)

#: What a tcp peer of the PUB port may send in all (bytes): a subscriber's greeting and
#: subscriptions take some hundred; ZMTP heartbeats, if a subscriber turns them on, some ten bytes each.
DEFAULT_SEND_BYTES = 16 << 10
_TCP_ESTABLISHED = 1
_BYTES_RECEIVED = 128  # offset of tcpi_bytes_received (u64) in Linux's struct tcp_info (since 4.1)


class PeerBudget:
    """The connections of the tcp listener on ``port``, each allowed ``send_bytes`` (see the
    module's docstring); `enforce()` from the publisher's thread."""

    def __init__(self, port: int, send_bytes: int = DEFAULT_SEND_BYTES) -> None:
        self.port = port
        self.send_bytes = send_bytes
        self.cut = 0  # connections shut down for sending more
        self._unsupported = False

    def enforce(self) -> None:
        """Shut down every connection of the port that has sent more than ``send_bytes``."""
        if self._unsupported:
            return
        try:
            fds = [int(name) for name in os.listdir("/proc/self/fd")]
        except OSError as exc:
            self._give_up(f"cannot list open files: {exc.strerror}")
            return
        for fd in fds:
            with _duplicate(fd) as sock:
                ends = _ends(sock)
                if sock is None or ends is None or ends[0][1] != self.port:
                    continue
                try:
                    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
                    if len(info) < _BYTES_RECEIVED + 8:
                        self._give_up("the kernel reports no tcpi_bytes_received")
                        return
                    received = struct.unpack_from("=Q", info, _BYTES_RECEIVED)[0]
                    if info[0] == _TCP_ESTABLISHED and received > self.send_bytes:
                        sock.shutdown(socket.SHUT_RDWR)
                        self.cut += 1
                        log.warning("kv_events_peer_cut", peer=str(ends[1]), sent=received, limit=self.send_bytes)
                except OSError as exc:
                    log.warning("kv_events_peer_check_failed", error=exc.strerror)

    def _give_up(self, reason: str) -> None:
        self._unsupported = True
        log.warning("kv_events_peer_bytes_unbounded", reason=reason)


@contextlib.contextmanager
def _duplicate(fd: int) -> Iterator[socket.socket | None]:
    """A socket on a duplicate of ``fd`` (None if it is no socket now); closing it leaves ``fd`` open."""
    try:
        copy = os.dup(fd)
    except OSError:  # closed meanwhile, or no descriptor left
        yield None
        return
    try:
        sock = socket.socket(fileno=copy)
    except OSError:  # no socket (the copy is not closed with it then)
        os.close(copy)
        yield None
        return
    try:
        yield sock
    finally:
        sock.close()


def _ends(sock: socket.socket | None) -> tuple[Any, Any] | None:
    if sock is None or sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return None
    try:
        return sock.getsockname(), sock.getpeername()
    except OSError:
        return None
