"""The link under a `Connection`: what moves its frames to and from one server."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Protocol


class Link(Protocol):
    """Moves frames between a Connection and one server.

    `open` and `close` run on the I/O thread; `send` on any thread holding the connection lock.
    """

    def open(self) -> None: ...

    def send(self, frames: list[bytes]) -> bool: ...

    def wait(self, future: Future[Any], timeout: float | None) -> float | None:
        """Helps `future` along on the calling thread, if the link can; returns the time left."""
        ...

    def nudge(self) -> None:
        """Wakes a thread waiting in `wait` (not this one) to look at its future again."""
        ...

    def close(self) -> None: ...
