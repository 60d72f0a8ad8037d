"""Who is at the other end of an ipc socket: the peer's user, checked in ZMQ's handshake.

On a Unix socket libzmq reads the peer's credentials (SO_PEERCRED) and passes them to the
ZAP handler of the socket's context, in the address field, as ``host:uid:gid:pid``. On ipc
the server and the client both set `ZAP_DOMAIN` on their socket and run `PeerUserCheck` in
their context, which lets in only a peer of the same user or root. So a client never talks
to a server of another user, even one that took over the socket path after the client
checked its directory; and a server refuses a client of another user before any of its
messages is read. Where libzmq reports no credentials (not Linux), the check lets the peer in
and the socket directory's permissions are the only guard.

On tcp with a shared secret, both ends authenticate with ZMQ PLAIN as the user `PLAIN_USER`.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import zmq

from kvdepot.transport._log import get_logger

log = get_logger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_DOMAIN = b"kvdepot-ipc"
# The user name of ZMQ PLAIN authentication on tcp with a shared secret (the secret is the password).
PLAIN_USER = "kvdepot"


def peer_uid(address: bytes) -> int | None:
    """The user id in a ZAP request's address for a Unix-socket peer, or None if it has none."""
    parts = address.split(b":")
    if len(parts) != 4 or not parts[1].isdigit():
        return None
    return int(parts[1])


class PeerUserCheck:
    """A ZAP handler for one ZMQ context that lets in peers of this user or root, on a thread.

    `refused` counts the peers turned away. `close()` before the context is terminated.
    """

    def __init__(self, context: zmq.Context[Any], role: str) -> None:
        self.role = role  # "server" or "client", for the log
        self.allowed = {os.geteuid(), 0}
        self.refused = 0
        self._sock = context.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(ZAP_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kvdepot-{role}-peercred", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        sock = self._sock
        while not self._stop.is_set():
            if not sock.poll(100):
                continue
            request = sock.recv_multipart()
            version, request_id, _domain, address = request[:4]
            uid = peer_uid(address)
            if uid is None or uid in self.allowed:
                sock.send_multipart([version, request_id, b"200", b"OK", b"", b""])
                continue
            self.refused += 1
            log.warning("peer_refused", role=self.role, peer_uid=uid, reason="another user's ipc peer")
            sock.send_multipart([version, request_id, b"400", b"peer of another user", b"", b""])
        sock.close(0)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(5)
