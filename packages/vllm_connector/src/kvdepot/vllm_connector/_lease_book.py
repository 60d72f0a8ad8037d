"""The scheduler's leases on the server: the handles the planner holds for them, and their release.

The planner sees lease handles unique across server instances; each names the server that
granted it, so a lease is never released to a restarted server (its leases died with it).
Handles are made on the engine's scheduler thread and released there, or on the transport's
settler thread for a lookup reply nobody waits for any more: hence the lock.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Iterable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvdepot.transport import CacheClient

log = logging.getLogger("vllm.kvdepot.scheduler")


class LeaseBook:
    """Lease handles for `kvdepot.core.Planner`, and their release to the server that granted them."""

    def __init__(self, client: CacheClient, kv_world_size: int) -> None:
        self.client = client
        self.kv_world_size = kv_world_size
        self._handles = itertools.count(1)
        self._leases: dict[int, tuple[str, int]] = {}
        self._lock = threading.Lock()

    def handle(self, server_id: str, lease_id: int) -> int:
        """A handle for lease ``lease_id`` of server ``server_id`` (0: no lease)."""
        if not lease_id:
            return 0
        handle = next(self._handles)
        with self._lock:
            self._leases[handle] = (server_id, lease_id)
        return handle

    def release(self, handles: Iterable[int]) -> None:
        """Give back the leases behind ``handles``, those of the server instance still serving."""
        current = self.client.server_id
        with self._lock:
            owned = [self._leases.pop(h) for h in handles if h in self._leases]
        leases = [lease for server_id, lease in owned if server_id == current]
        if leases and current:
            self._send(leases, current)

    def release_on_arrival(self, future: Future[Any], first: int, server_id: str) -> None:
        """Release whatever leases a lookup reply nobody waits for any more brings when it
        arrives: its results ``first`` to ``first + kv_world_size``."""
        world = self.kv_world_size

        def release(done: Future[Any]) -> None:  # runs on the transport's settler thread
            try:
                leases = [r.lease_id for r in done.result().results[first : first + world] if r.lease_id]
            except Exception:
                return
            if leases and server_id == self.client.server_id:
                self._send(leases, server_id)

        future.add_done_callback(release)

    def _send(self, leases: list[int], server_id: str) -> None:
        try:
            self.client.release(leases, server_id=server_id)
        except Exception as exc:  # the server expires them by itself
            log.warning("kvdepot could not release %d leases (they will expire): %s", len(leases), exc)
