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
#: What reading one change costs of a message's work budget (`kvdepot.transport.MAX_MESSAGE_BYTES`),
#: in bytes: as much as a key of a lookup (32 bytes), whose cost to the loop it about matches
#: (100-170 ns a change read, 100-150 ns a key that misses). So a message of `changes` frames
#: reads at most 131,072 changes (tens of ms, not the seconds of 4,096 frames of 16,384 each),
#: and an engine's poll (a `changes` of at most 4,096 per 1,024 salts) costs 128 KiB a frame.
CHANGE_WORK_BYTES = 32


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

    def span(self, since: int, limit: int, server_id: str = "") -> int:
        """How many changes `read` reads for these arguments (its work), in O(1)."""
        if since == 0 or not self._kept(since, server_id):
            return 0
        return min(self._next, since + limit) - since

    def _kept(self, since: int, server_id: str) -> bool:
        """Whether the changes from ``since`` on are all here (``since`` of this instance, not too old)."""
        return max(1, self._next - self.capacity) <= since <= self._next and server_id in ("", self.server_id)

    def read(self, since: int, salts: Sequence[str], limit: int, server_id: str = "") -> ChangesReply:
        """Changes ``since`` .. up to ``limit`` later of ``salts`` (see `kvdepot.transport.Changes`)."""
        if since == 0:
            return ChangesReply([], self._next)
        if not self._kept(since, server_id):
            return ChangesReply([], self._next, lost=True)
        count = self.span(since, limit, server_id)
        wanted = {salt: i for i, salt in enumerate(salts)}
        out = []
        for number in range(since, since + count):
            entry = self._ring[number % self.capacity]
            assert entry is not None
            stored, salt, key = entry
            if (index := wanted.get(salt)) is not None:
                out.append(Change(stored, index, key))
        return ChangesReply(out, since + count)
