"""A chunk's state machine: one table from (state, event) to the next state.

Everything that moves a chunk between states lives in this file. A pair that is not in the
table raises `InvalidTransitionError`: the index asked for a move its own rules forbid (a
leased chunk evicted, a chunk committed twice), which is a bug, never a silent no-op.

Life of a chunk::

    FREE --reserve--> PENDING --commit--> COMMITTED --lease--> LEASED
     ^ ^                 |                  |  ^                 |
     | +------abort------+                  |  +----unlease------+
     +--------------remove (evict, clear)---+

A chunk is LEASED while at least one lease holds it: the first lease moves it there, the end
of the last one moves it back (`Entry.leases` counts them).
"""

from __future__ import annotations

import enum

from kvdepot.core import InvalidTransitionError


class ChunkState(enum.Enum):
    """Where a chunk stands in the index."""

    FREE = "free"  # not in the index: before its reserve, after its slot was given back
    PENDING = "pending"  # reserved and being written; lookups do not see it
    COMMITTED = "committed"  # visible to lookups, no lease: the eviction order holds it
    LEASED = "leased"  # visible, held by at least one lease: never evicted or cleared

    # Members are singletons, so identity hashing is exact; Enum's own hashes the name in
    # Python, which made every table lookup on the index's hot paths cost a microsecond.
    __hash__ = object.__hash__


class ChunkEvent(enum.Enum):
    """What can happen to a chunk."""

    RESERVE = "reserve"  # a slot was placed for it
    COMMIT = "commit"  # its writer committed it
    ABORT = "abort"  # its reservation was aborted, expired or its client left
    LEASE = "lease"  # a lookup took the first lease on it
    UNLEASE = "unlease"  # its last lease was released or expired
    REMOVE = "remove"  # evicted or cleared

    __hash__ = object.__hash__  # as ChunkState's


S, E = ChunkState, ChunkEvent

#: The whole state machine.
TRANSITIONS: dict[tuple[ChunkState, ChunkEvent], ChunkState] = {
    (S.FREE, E.RESERVE): S.PENDING,
    (S.PENDING, E.COMMIT): S.COMMITTED,
    (S.PENDING, E.ABORT): S.FREE,
    (S.COMMITTED, E.LEASE): S.LEASED,
    (S.COMMITTED, E.REMOVE): S.FREE,
    (S.LEASED, E.UNLEASE): S.COMMITTED,
}

#: States whose chunk pins its page: the page cannot be emptied for a slot of another size.
PINNED = frozenset({S.PENDING, S.LEASED})
#: States whose chunk lookups see (and the salt's chunk count includes).
VISIBLE = frozenset({S.COMMITTED, S.LEASED})
#: States a chunk in the index can be in.
LIVE = (S.PENDING, S.COMMITTED, S.LEASED)


#: Per (state, event) in the table: the next state, and how the move changes the chunks that
#: pin their page and those lookups see (+1, 0 or -1), so that the index adds instead of asking.
MOVES: dict[tuple[ChunkState, ChunkEvent], tuple[ChunkState, int, int]] = {
    (old, event): (new, (new in PINNED) - (old in PINNED), (new in VISIBLE) - (old in VISIBLE))
    for (old, event), new in TRANSITIONS.items()
}


def next_state(state: ChunkState, event: ChunkEvent) -> ChunkState:
    """The state after ``event``, or `InvalidTransitionError` if the table has no such move."""
    return move(state, event)[0]


def move(state: ChunkState, event: ChunkEvent) -> tuple[ChunkState, int, int]:
    """`MOVES[state, event]`, or `InvalidTransitionError` if the table has no such move."""
    try:
        return MOVES[state, event]
    except KeyError:
        raise InvalidTransitionError(
            f"a {state.value} chunk cannot take event {event.value!r}; this is a bug in the chunk index",
            state=state.value,
            event=event.value,
        ) from None
