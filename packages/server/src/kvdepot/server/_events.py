"""What happened in the index, as a stream: the index queues events, the loop takes them.

The index never calls out. Each method that makes a chunk visible or takes one away queues
one event per chunk; the server's loop takes them with `ChunkIndex.take_events()` after every
request (and after every pass of its own work) and hands them to whoever consumes them: the
tiers' write-behind today, the KV events that routers read next. As vLLM's offloading manager
hands out its `take_events()`, so nothing that consumes them runs inside an index method.

Events name a chunk by (salt, key), never by slot: a consumer that needs its bytes asks the
index for them, and gets nothing when the chunk has gone meanwhile.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import attrs

#: The tier an event happened in. The index is the RAM tier's; the tiers below have their own.
RAM = "ram"


@attrs.frozen(slots=True)
class ChunkChange:
    """Something that happened to chunk ``key`` of ``salt`` (``length`` payload bytes) in ``tier``."""

    salt: str
    key: bytes
    length: int
    tier: str = attrs.field(default=RAM, kw_only=True)


@attrs.frozen(slots=True)
class Committed(ChunkChange):
    """The chunk became visible: ``client`` committed it (the tiers' own session for one read back).
    ``pinned``: with a pin (a prefill engine's handoff): the tiers write it ahead of the others."""

    client: str
    pinned: bool = False


@attrs.frozen(slots=True)
class Evicted(ChunkChange):
    """The chunk gave way to another one, or to its salt's quota."""


@attrs.frozen(slots=True)
class Cleared(ChunkChange):
    """The chunk was removed by a Clear request."""


IndexEvent = Committed | Evicted | Cleared


class EventConsumer(Protocol):
    """What takes the index's events after each request (loop thread), in the order they
    happened: the change log, the tiers, the metrics, the KV event publisher."""

    def take(self, events: Sequence[IndexEvent]) -> None: ...
