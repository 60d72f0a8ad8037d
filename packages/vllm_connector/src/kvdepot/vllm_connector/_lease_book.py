"""The scheduler's leases on the server: their release to the instance that granted them.

The planner holds each lease as a pair, the server instance that granted it and its id there
(`kvdepot.core.Planner.take_leases`), and hands back the pairs to release. The book gives back
those of the instance still serving, and drops the others: a restarted server's leases died
with it. A lookup reply nobody waits for any more is released when it lands, on the
transport's settler thread (`release_on_arrival`); the book keeps no state for it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvdepot.transport import CacheClient

log = logging.getLogger("vllm.kvdepot.scheduler")


class LeaseBook:
    """Gives leases back to the server instance that granted them."""

    def __init__(self, client: CacheClient, kv_world_size: int) -> None:
        self.client = client
        self.kv_world_size = kv_world_size

    def release(self, leases: Sequence[tuple[str, int]]) -> None:
        """Give back ``leases`` (server instance, lease id), those of the instance still serving."""
        if not leases:
            return
        current = self.client.server_id
        ids = [lease for server_id, lease in leases if server_id == current]
        if ids and current:
            self._send(ids, current)

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
