"""The chunk index's records: one per chunk, reservation, lease and client session."""

from __future__ import annotations

from collections.abc import Callable

import attrs

from kvdepot.server._chunk_state import ChunkState


@attrs.define(eq=False)
class Entry:
    """A chunk in a slot (``offset`` is the slot's header); `state` moves by `_chunk_state`'s table."""

    salt: str
    key: bytes
    offset: int
    length: int
    slot_size: int
    owner: str = ""  # the client that stored it: its bytes count toward that client's fair share
    state: ChunkState = ChunkState.FREE
    leases: int = 0  # live leases holding it: LEASED exactly while > 0
    used: int = 0  # stamp of the last use (commit, reserve hit, end of the last lease)


@attrs.define(eq=False)
class Reservation:
    id: int
    client: str
    salt: str
    deadline: float
    pending: dict[int, Entry]  # position in the Reserve keys -> entry still PENDING
    #: The index's clears counted when it was made: a clear of its salt since voids its commit.
    generation: int = 0


@attrs.define(eq=False)
class Lease:
    id: int
    client: str
    deadline: float
    entries: list[Entry]
    #: Called with its id when it ends (the pins' book forgets a pin); None for most leases.
    ended: Callable[[int], None] | None = None


@attrs.define(eq=False)
class Session:
    client: str
    name: str
    last_seen: float
    chunk_bytes: int | None = None
    pending_bytes: int = 0
    reservations: set[int] = attrs.field(factory=set)
    leases: set[int] = attrs.field(factory=set)
