"""`open_endpoint`: the server endpoint for an address, whatever its scheme."""

from __future__ import annotations

from typing import Any

from kvdepot.transport._address import MEMORY_SCHEME
from kvdepot.transport._handler import Handler, Waker
from kvdepot.transport._memory import MemoryServerEndpoint
from kvdepot.transport._server import ServerEndpoint


def open_endpoint(
    address: str | None, handler: Handler, *, waker: Waker | None = None, **options: Any
) -> ServerEndpoint:
    """Bind a server endpoint at `address` (None: the default ipc address) serving `handler`.

    ipc:// and tcp:// give a ZMQ `ServerEndpoint`; memory:// gives an in-process endpoint
    with the same interface (for tests and in-process servers). `options` are those of
    `ServerEndpoint`: `max_frame_bytes`, `peer_timeout`, `auth_secret`, `curve_secret_key`,
    `context`, `server_id` (default: a fresh one), `limits` (`PeerLimits`: what one peer's
    flood may cost, ZMQ only), and `on_bad_frame`, told of every frame refused before the
    handler saw it. ``waker``: made before the endpoint, it wakes this
    endpoint's loop from then on (`Waker`).
    """
    memory = address is not None and address.startswith(MEMORY_SCHEME)
    endpoint = (MemoryServerEndpoint if memory else ServerEndpoint)(address, handler, **options)
    if waker is not None:
        waker.connect(endpoint.wake)
    return endpoint
