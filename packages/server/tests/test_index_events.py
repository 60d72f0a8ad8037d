"""The index's event stream: what happened, queued for `take_events()`, never a call out."""

from __future__ import annotations

import attrs

from kvdepot.core import SLOT_HEADER_BYTES
from kvdepot.server import ChunkIndex, SlabAllocator
from kvdepot.server._events import Cleared, Committed, Evicted

PAGE = 4096
SLOT = 1024
CHUNK = SLOT - SLOT_HEADER_BYTES


def make_index(pages: int = 1, **kwargs) -> ChunkIndex:
    index = ChunkIndex(SlabAllocator(pages * PAGE, PAGE), max_client_pending_bytes=pages * PAGE, **kwargs)
    index.register("a", CHUNK, now=0.0)
    return index


def k(i: int) -> bytes:
    return i.to_bytes(32, "big")


def store(index: ChunkIndex, keys: list[bytes], salt: str = "") -> None:
    out = index.reserve("a", salt, keys, CHUNK, 0.0)
    index.commit("a", out.reservation_id, None, 0.0)


def test_each_chunk_a_commit_makes_visible_is_one_event_in_order_then_the_queue_is_empty():
    index = make_index(events=True)
    out = index.reserve("a", "s", [k(1), k(2), k(3)], CHUNK, 0.0)
    assert index.take_events() == []  # a reservation is not visible: nothing to tell
    index.commit("a", out.reservation_id, [2, 0], 0.0)
    assert index.take_events() == [Committed("s", k(3), CHUNK, "a"), Committed("s", k(1), CHUNK, "a")]
    assert index.take_events() == []
    index.abort("a", out.reservation_id)  # the pending chunk never was visible
    assert index.take_events() == []


def test_evictions_and_clears_say_which_chunk_left_and_why():
    index = make_index(events=True)
    store(index, [k(i) for i in range(4)])  # the page is full
    index.take_events()
    store(index, [k(9)])  # the oldest chunk gives way
    assert index.take_events() == [Evicted("", k(0), CHUNK), Committed("", k(9), CHUNK, "a")]
    index.set_quota("", 3 * SLOT)  # the salt over its quota gives up its oldest
    assert index.take_events() == [Evicted("", k(1), CHUNK)]
    assert index.clear() == (3, False)
    assert sorted(e.key for e in index.take_events() if isinstance(e, Cleared)) == [k(2), k(3), k(9)]
    index.check()


def test_events_name_chunks_per_salt_and_never_their_slots():
    """A salt's events carry its salt and key only: consumers see no other salt's chunks through
    another's events, and nothing of where a chunk lies in the pool."""
    index = make_index(events=True)
    store(index, [k(1)], salt="tenant-a")
    store(index, [k(1)], salt="tenant-b")
    events = index.take_events()
    assert [(e.salt, e.key) for e in events] == [("tenant-a", k(1)), ("tenant-b", k(1))]
    fields = {"salt", "key", "length", "client", "tier", "pinned"}
    assert all({f.name for f in attrs.fields(type(e))} == fields for e in events)


def test_an_index_made_without_events_queues_none():
    """An index whose maker never takes events (a test, a benchmark) keeps none."""
    index = make_index()
    store(index, [k(i) for i in range(6)])
    index.clear()
    assert index.take_events() == []
