"""The chunk state table: every move it allows, and an error for every move it does not."""

from __future__ import annotations

import itertools

import pytest

from kvdepot.core import SLOT_HEADER_BYTES, InvalidTransitionError
from kvdepot.server import ChunkIndex, SlabAllocator
from kvdepot.server._chunk_state import PINNED, TRANSITIONS, VISIBLE, ChunkEvent, ChunkState, next_state

S, E = ChunkState, ChunkEvent
CHUNK = 1024 - SLOT_HEADER_BYTES


def test_table_is_the_life_of_a_chunk():
    """A chunk is reserved, committed, leased and unleased, then removed; abort frees a pending one."""
    assert TRANSITIONS == {
        (S.FREE, E.RESERVE): S.PENDING,
        (S.PENDING, E.COMMIT): S.COMMITTED,
        (S.PENDING, E.ABORT): S.FREE,
        (S.COMMITTED, E.LEASE): S.LEASED,
        (S.COMMITTED, E.REMOVE): S.FREE,
        (S.LEASED, E.UNLEASE): S.COMMITTED,
    }


@pytest.mark.parametrize(("state", "event"), [p for p in itertools.product(S, E) if p not in TRANSITIONS])
def test_moves_missing_from_the_table_raise(state: ChunkState, event: ChunkEvent):
    """A pair missing from the table is an error naming the state and the event, not a no-op."""
    with pytest.raises(InvalidTransitionError) as info:
        next_state(state, event)
    assert (info.value.state, info.value.event) == (state.value, event.value)


def test_leased_and_pending_chunks_pin_their_page_and_only_committed_ones_are_seen():
    """Pending and leased chunks pin their page; lookups see committed and leased ones."""
    assert frozenset({S.PENDING, S.LEASED}) == PINNED
    assert frozenset({S.COMMITTED, S.LEASED}) == VISIBLE


def test_index_moves_a_chunk_through_the_table():
    """Reserve, commit, lookup and release move the index's entry through the states in order."""
    index = ChunkIndex(SlabAllocator(8192, 4096))
    index.register("a", CHUNK, now=0.0)
    key = bytes(32)
    out = index.reserve("a", "", [key], CHUNK, 0.0)
    entry = index.chunks.entries["", key]
    assert entry.state is S.PENDING
    index.commit("a", out.reservation_id, None, 0.0)
    assert entry.state is S.COMMITTED
    (first,) = index.lookup("a", [("", [key])], 0.0)
    (second,) = index.lookup("a", [("", [key])], 0.0)
    assert (entry.state, entry.leases) == (S.LEASED, 2)
    index.release("a", [first.lease_id])
    assert entry.state is S.LEASED
    index.release("a", [second.lease_id])
    assert entry.state is S.COMMITTED
    assert index.clear() == (1, False)
    assert entry.state is S.FREE
    index.check()


def test_evicting_a_leased_chunk_is_refused_by_the_table():
    """A bug that tried to evict a leased chunk raises instead of freeing a slot in use."""
    index = ChunkIndex(SlabAllocator(8192, 4096))
    index.register("a", CHUNK, now=0.0)
    out = index.reserve("a", "", [bytes(32)], CHUNK, 0.0)
    index.commit("a", out.reservation_id, None, 0.0)
    index.lookup("a", [("", [bytes(32)])], 0.0)
    with pytest.raises(InvalidTransitionError):
        index.chunks.evict(index.chunks.entries["", bytes(32)])
