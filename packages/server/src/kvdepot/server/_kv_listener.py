"""The KV-events publisher's tcp listeners (PUB and replay): `kvdepot.transport.CappedListener`,
whose errors say which flag of `kvdepot serve` to fix."""

from __future__ import annotations

from typing import Any

import zmq

from kvdepot.server._errors import ServerArgumentError
from kvdepot.transport import CappedListener as _CappedListener
from kvdepot.transport import TransportError


class CappedListener(_CappedListener):
    """A capped tcp listener of the KV-events publisher; `ServerArgumentError` where it cannot listen."""

    def __init__(self, context: zmq.Context[Any], sock: zmq.Socket[Any], endpoint: str, cap: int, name: str) -> None:
        try:
            super().__init__(context, sock, endpoint, cap, name)
        except TransportError as exc:
            reason = exc.fields.get("reason", exc.message)
            raise ServerArgumentError(f"cannot publish KV events on {endpoint}: {reason}", endpoint=endpoint) from exc
