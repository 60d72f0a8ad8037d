"""The RAM tier's changes, numbered: what engines that publish KV events ask for (`Changes`).

Fed on the loop from the index's event stream (`CacheHandler.flush_events`). Each chunk that
becomes visible (a commit, a read-back) or goes (an eviction, a clear) gets the next number,
starting at 1 for each server instance. The log keeps the last `CHANGE_LOG_SIZE`; older ones are
dropped, and an asker that falls that far behind is told so (`ChangesReply.lost`) and must ask
what the server holds (`Query`). So a client that never asks holds nothing on the server: the
log's memory is bounded by its size whoever reads it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvdepot.server._events import RAM, ChunkChange, Committed
from kvdepot.transport import Change, ChangesReply

#: Changes kept: at most about 15 MiB of log (the keys are mostly the index's own), which at the
#: few thousand commits a second of a busy node is a minute of history for a client that polls
#: every few engine steps.
CHANGE_LOG_SIZE = 1 << 17


class ChangeLog:
    """The last ``capacity`` changes of the RAM tier (loop thread only)."""

    def __init__(self, server_id: str = "", capacity: int = CHANGE_LOG_SIZE) -> None:
        self.server_id = server_id
        self.capacity = capacity
        self._ring: list[tuple[bool, str, bytes] | None] = [None] * capacity
        self._next = 1  # the number the next change gets

    @property
    def next(self) -> int:
        return self._next

    def take(self, events: Iterable[ChunkChange]) -> None:
        for event in events:
            if event.tier != RAM:
                continue
            self._ring[self._next % self.capacity] = (isinstance(event, Committed), event.salt, event.key)
            self._next += 1

    def read(self, since: int, salts: Sequence[str], limit: int, server_id: str = "") -> ChangesReply:
        """Changes ``since`` .. up to ``limit`` later of ``salts`` (see `kvdepot.transport.Changes`)."""
        head = self._next
        if since == 0:
            return ChangesReply([], head)
        oldest = max(1, head - self.capacity)
        if since < oldest or since > head or server_id not in ("", self.server_id):
            return ChangesReply([], head, lost=True)
        wanted = {salt: i for i, salt in enumerate(salts)}
        end = min(head, since + limit)
        out = []
        for number in range(since, end):
            entry = self._ring[number % self.capacity]
            assert entry is not None
            stored, salt, key = entry
            if (index := wanted.get(salt)) is not None:
                out.append(Change(stored, index, key))
        return ChangesReply(out, end)
