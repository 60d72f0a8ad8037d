"""The change log behind `Changes`: the RAM tier's changes, numbered from 1, kept in a bounded ring.

Pure unit tests (no sockets): the log is fed index events as `CacheHandler.flush_events` feeds
it, and read as `CacheHandler._changes` reads it.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvdepot.core import SLOT_HEADER_BYTES
from kvdepot.server import ChunkIndex, SlabAllocator
from kvdepot.server._change_log import ChangeLog
from kvdepot.server._events import Cleared, Committed, Evicted
from kvdepot.transport import Change, ChangesReply

SERVER = "server-1"


def k(i: int) -> bytes:
    return i.to_bytes(32, "big")


def committed(salt: str, i: int, **kw) -> Committed:
    return Committed(salt, k(i), 100, "engine", **kw)


def test_a_fresh_log_numbers_from_one_and_since_zero_says_where_it_stands():
    log = ChangeLog(SERVER, capacity=8)
    assert log.next == 1
    assert log.read(0, ["s"], 10) == ChangesReply([], 1)
    log.take([committed("s", 1), committed("s", 2), committed("s", 3)])
    assert log.next == 4
    # since=0 gives no changes, only the number to go on from
    assert log.read(0, ["s"], 10) == ChangesReply([], 4)
    # since=1 gives all three, in the order they happened
    assert log.read(1, ["s"], 10) == ChangesReply(
        [Change(True, 0, k(1)), Change(True, 0, k(2)), Change(True, 0, k(3))], 4
    )
    # asking from `next` gives nothing, and is not lost
    assert log.read(4, ["s"], 10) == ChangesReply([], 4)


def test_committed_is_stored_and_evicted_or_cleared_is_not():
    log = ChangeLog(SERVER, capacity=8)
    log.take([committed("s", 1), Evicted("s", k(1), 100), committed("s", 2), Cleared("s", k(2), 100)])
    reply = log.read(1, ["s"], 10)
    assert [(c.stored, c.key) for c in reply.changes] == [(True, k(1)), (False, k(1)), (True, k(2)), (False, k(2))]
    assert reply.next == 5
    assert not reply.lost


def test_only_the_salts_asked_are_told_by_their_index_in_the_request():
    log = ChangeLog(SERVER, capacity=16)
    log.take([committed("a", 1), committed("b", 2), committed("c", 3), Evicted("a", k(1), 100), committed("b", 4)])
    reply = log.read(1, ["c", "a"], 100)
    assert reply.changes == [Change(True, 1, k(1)), Change(True, 0, k(3)), Change(False, 1, k(1))]
    assert reply.next == 6  # the other salts' changes are passed over, not left for later
    assert log.read(1, ["zzz"], 100) == ChangesReply([], 6)
    assert log.read(1, [], 100) == ChangesReply([], 6)
    # the same key under another salt is another chunk: salts never see each other's changes
    assert [c.key for c in log.read(1, ["b"], 100).changes] == [k(2), k(4)]


def test_limit_pages_and_next_goes_on_from_where_a_page_stopped():
    log = ChangeLog(SERVER, capacity=64)
    log.take([committed("s", i) for i in range(10)])
    seen, since, pages = [], 1, 0
    while since < log.next:
        reply = log.read(since, ["s"], 3)
        assert not reply.lost
        assert len(reply.changes) <= 3
        assert reply.next > since  # progress on every page
        seen += [c.key for c in reply.changes]
        since = reply.next
        pages += 1
    assert seen == [k(i) for i in range(10)]
    assert pages == 4  # 3 + 3 + 3 + 1
    assert since == 11
    assert log.read(since, ["s"], 3) == ChangesReply([], 11)


def test_a_page_of_other_salts_changes_still_moves_on():
    """A reader of a quiet salt on a busy server is not stuck: a page with none of its changes
    still gives a later `next`."""
    log = ChangeLog(SERVER, capacity=64)
    log.take([committed("busy", i) for i in range(20)] + [committed("quiet", 99)])
    since, found = 1, []
    for _ in range(30):
        reply = log.read(since, ["quiet"], 4)
        assert not reply.lost
        found += reply.changes
        if reply.next == since:
            break
        since = reply.next
    assert found == [Change(True, 0, k(99))]
    assert since == log.next == 22


def test_a_reader_behind_the_kept_window_is_told_it_lost_changes():
    log = ChangeLog(SERVER, capacity=4)
    log.take([committed("s", i) for i in range(1, 11)])  # changes 1..10, head 11
    assert log.next == 11
    # the last 4 (7..10) are kept, the oldest of them included
    assert log.read(7, ["s"], 100) == ChangesReply([Change(True, 0, k(i)) for i in range(7, 11)], 11)
    assert log.read(9, ["s"], 100) == ChangesReply([Change(True, 0, k(9)), Change(True, 0, k(10))], 11)
    # one before the window, and the very first: gone
    assert log.read(6, ["s"], 100) == ChangesReply([], 11, lost=True)
    assert log.read(1, ["s"], 100) == ChangesReply([], 11, lost=True)
    # a reader told it lost changes starts again from `next`, and keeps up from there
    log.take([committed("s", 11)])
    assert log.read(11, ["s"], 100) == ChangesReply([Change(True, 0, k(11))], 12)


def test_a_full_ring_keeps_exactly_capacity_changes():
    log = ChangeLog(SERVER, capacity=4)
    log.take([committed("s", i) for i in range(1, 5)])  # exactly full: 1..4
    assert log.read(1, ["s"], 100).changes == [Change(True, 0, k(i)) for i in range(1, 5)]
    log.take([committed("s", 5)])  # 1 is overwritten
    assert log.read(1, ["s"], 100).lost
    assert log.read(2, ["s"], 100).changes == [Change(True, 0, k(i)) for i in range(2, 6)]


def test_a_number_this_log_never_gave_is_lost():
    """`since` past the numbering (a client that knew a server with more changes: a restart)."""
    log = ChangeLog(SERVER, capacity=8)
    log.take([committed("s", 1), committed("s", 2)])
    assert log.read(4, ["s"], 10) == ChangesReply([], 3, lost=True)
    assert log.read(1000, ["s"], 10) == ChangesReply([], 3, lost=True)
    assert not log.read(3, ["s"], 10).lost  # `next` itself is fine


def test_a_number_of_another_server_instance_is_lost():
    log = ChangeLog(SERVER, capacity=8)
    log.take([committed("s", 1), committed("s", 2)])
    assert log.read(1, ["s"], 10, server_id="server-0") == ChangesReply([], 3, lost=True)
    assert log.read(1, ["s"], 10, server_id=SERVER).changes == [Change(True, 0, k(1)), Change(True, 0, k(2))]
    assert log.read(1, ["s"], 10, server_id="").changes == [Change(True, 0, k(1)), Change(True, 0, k(2))]
    # since=0 of another instance: where this one stands, no changes
    assert log.read(0, ["s"], 10, server_id="server-0") == ChangesReply([], 3)


def test_events_of_the_tiers_below_ram_are_not_ram_changes():
    log = ChangeLog(SERVER, capacity=8)
    log.take(
        [
            committed("s", 1, tier="disk"),
            Evicted("s", k(2), 100, tier="remote"),
            Cleared("s", k(3), 100, tier="disk"),
        ]
    )
    assert log.next == 1
    log.take([committed("s", 4, tier="disk"), committed("s", 5), Evicted("s", k(6), 100, tier="disk")])
    assert log.next == 2
    assert log.read(1, ["s"], 10) == ChangesReply([Change(True, 0, k(5))], 2)


def test_the_log_holds_no_more_than_its_capacity_however_many_changes():
    log = ChangeLog(SERVER, capacity=16)
    for i in range(1000):
        log.take([committed("s", i)])
    assert len(log._ring) == 16
    assert log.next == 1001
    assert log.read(1001 - 16, ["s"], 100).changes == [Change(True, 0, k(i)) for i in range(1000 - 16, 1000)]


_events = st.lists(
    st.tuples(
        st.sampled_from(["commit", "evict", "clear"]),
        st.sampled_from(["a", "b", "c"]),
        st.integers(0, 5),
        st.sampled_from(["ram", "ram", "disk"]),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(
    events=_events,
    capacity=st.integers(1, 12),
    since=st.integers(0, 50),
    limit=st.integers(1, 10),
    salts=st.lists(st.sampled_from(["a", "b", "c"]), unique=True, max_size=3),
)
def test_paging_from_any_kept_number_gives_exactly_the_changes_since_then(events, capacity, since, limit, salts):
    """Against a model: the RAM changes numbered 1.., the last `capacity` kept; paging from
    `since` to the head gives the wanted salts' changes in order, or `lost` when they are gone;
    `span` (the work charged for a read) is the number of changes each read went past."""
    log = ChangeLog(SERVER, capacity=capacity)
    made = {"commit": Committed, "evict": Evicted, "clear": Cleared}
    batch = []
    for kind, salt, i, tier in events:
        if kind == "commit":
            batch.append(Committed(salt, k(i), 1, "engine", tier=tier))
        else:
            batch.append(made[kind](salt, k(i), 1, tier=tier))
    log.take(batch)
    ram = [(isinstance(e, Committed), e.salt, e.key) for e in batch if e.tier == "ram"]
    head = len(ram) + 1
    assert log.next == head
    reply = log.read(since, salts, limit)
    if since == 0:
        assert reply == ChangesReply([], head)
        assert log.span(since, limit) == 0
        return
    if since < max(1, head - capacity) or since > head:
        assert reply == ChangesReply([], head, lost=True)
        assert log.span(since, limit) == 0
        return
    expected = [Change(stored, salts.index(salt), key) for stored, salt, key in ram[since - 1 :] if salt in salts]
    got = []
    for _ in range(head + 1):
        assert not reply.lost
        assert len(reply.changes) <= limit
        assert log.span(since, limit) == reply.next - since <= limit
        assert log.span(since, limit, "another-server") == 0
        got += reply.changes
        if reply.next == head:
            break
        assert reply.next > since
        since = reply.next
        reply = log.read(since, salts, limit)
    assert reply.next == head
    assert got == expected


# -- fed by a real index ------------------------------------------------------------------

PAGE = 4096
SLOT = 1024
CHUNK = SLOT - SLOT_HEADER_BYTES


def test_commits_evictions_and_clears_of_a_real_index_become_numbered_changes():
    """What `flush_events` does: the index's `take_events()` fed to the log, request by request."""
    index = ChunkIndex(SlabAllocator(PAGE, PAGE), max_client_pending_bytes=PAGE, events=True)  # 4 slots
    index.register("engine", CHUNK, now=0.0)
    log = ChangeLog(SERVER)

    def store(salt: str, keys: list[bytes]) -> None:
        out = index.reserve("engine", salt, keys, CHUNK, 0.0)
        index.commit("engine", out.reservation_id, None, 0.0)
        log.take(index.take_events())

    start = log.read(0, ["a", "b"], 100).next
    assert start == 1
    store("a", [k(1), k(2)])
    store("b", [k(1), k(3)])  # the page is full
    reply = log.read(start, ["a", "b"], 100)
    assert reply == ChangesReply(
        [Change(True, 0, k(1)), Change(True, 0, k(2)), Change(True, 1, k(1)), Change(True, 1, k(3))], 5
    )
    assert log.read(start, ["b"], 100).changes == [Change(True, 0, k(1)), Change(True, 0, k(3))]

    store("b", [k(4)])  # the oldest chunk (a's first) gives way
    reply = log.read(5, ["a", "b"], 100)
    assert reply == ChangesReply([Change(False, 0, k(1)), Change(True, 1, k(4))], 7)

    assert index.clear("a") == (1, False)
    log.take(index.take_events())
    reply = log.read(7, ["a", "b"], 100)
    assert reply == ChangesReply([Change(False, 0, k(2))], 8)
    assert log.read(7, ["b"], 100) == ChangesReply([], 8)

    # a reservation, an abort and a reserve of keys already held change nothing that is visible
    out = index.reserve("engine", "b", [k(1), k(9)], CHUNK, 0.0)
    index.abort("engine", out.reservation_id)
    log.take(index.take_events())
    assert log.next == 8
