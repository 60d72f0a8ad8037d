"""Whether the connector should talk to its server right now.

A server that is gone or stuck must cost requests nothing. The transport notices a dead
server by itself (the connection drops); a stuck one shows only as a request that timed
out. After either, every caller gets "not usable" at once, with no round trip, until the
server answers a ping again: lookups are misses and stores are skipped meanwhile.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvdepot.transport import CacheClient

log = logging.getLogger("vllm.kvdepot")

#: While the server is suspect, a ping goes out at most this often (seconds): one tiny
#: message a second is nothing to a server that came back, and no caller waits for it.
PROBE_INTERVAL_S = 1.0


class ServerHealth:
    """Gates every request to the server on the last thing we learned about it. Thread-safe."""

    def __init__(self, client: CacheClient, *, probe_interval: float = PROBE_INTERVAL_S) -> None:
        self.client = client
        self.probe_interval = probe_interval
        self._lock = threading.Lock()
        self._suspect_since: float | None = None
        self._probe_sent = 0.0
        self._was_usable = True

    def usable(self) -> bool:
        """True when a request to the server can be expected to be answered promptly."""
        usable = self.client.connected and self._suspect_since is None
        if not usable and self.client.connected:
            self._probe()
        if usable != self._was_usable:
            self._was_usable = usable
            if usable:
                log.info("kvdepot server at %s answers again; caching resumes", self.client.address)
            else:
                log.warning(
                    "kvdepot server at %s is unreachable; requests run uncached until it answers",
                    self.client.address,
                )
        return usable

    def report_timeout(self) -> None:
        """A request to the server timed out: stop waiting on it until a ping succeeds."""
        with self._lock:
            if self._suspect_since is None:
                self._suspect_since = time.monotonic()

    def _probe(self) -> None:
        now = time.monotonic()
        with self._lock:
            if self._suspect_since is None or now - self._probe_sent < self.probe_interval:
                return
            self._probe_sent = now
        try:
            future: Future[Any] = self.client.ping()
        except Exception:  # closed: stays suspect
            return
        future.add_done_callback(self._on_pong)

    def _on_pong(self, future: Future[Any]) -> None:
        if not future.cancelled() and future.exception() is None:
            with self._lock:
                self._suspect_since = None
