"""The chunk index: two-phase store, leased lookups, eviction, quotas and sessions."""

from __future__ import annotations

import pytest

from kvdepot.core import SLOT_HEADER_BYTES
from kvdepot.server import (
    ChunkIndex,
    NotRegisteredError,
    ServerArgumentError,
    SlabAllocator,
    TooManyError,
    UnknownReservationError,
)
from kvdepot.server._holds import QUARANTINE_CLIENT

PAGE = 4096
SLOT = 1024  # four slots per page
CHUNK = SLOT - SLOT_HEADER_BYTES  # a slot holds its header and the chunk


def make_index(pages: int = 2, **kwargs) -> ChunkIndex:
    kwargs.setdefault("max_client_pending_bytes", pages * PAGE)
    index = ChunkIndex(SlabAllocator(pages * PAGE, PAGE), **kwargs)
    for client in ("a", "b"):
        index.register(client, CHUNK, now=0.0)
    return index


def k(i: int) -> bytes:
    return i.to_bytes(32, "big")


def store(index: ChunkIndex, keys: list[bytes], salt: str = "", client: str = "a", now: float = 0.0):
    out = index.reserve(client, salt, keys, CHUNK, now)
    if out.reservation_id:
        index.commit(client, out.reservation_id, None, now)
    return out


def test_reserved_chunk_is_invisible_until_commit():
    """Lookups do not see a pending chunk; after commit they do, at the reserved slot."""
    index = make_index()
    out = index.reserve("a", "", [k(1)], CHUNK, 0.0)
    assert out.slots == [(0, SLOT_HEADER_BYTES, CHUNK)]  # the chunk's bytes, after its header
    assert not out.full
    assert index.lookup("b", [("", [k(1)])], 0.0)[0].num_hits == 0
    assert index.commit("a", out.reservation_id, None, 0.0) == 1
    hit = index.lookup("b", [("", [k(1)])], 0.0)[0]
    assert (hit.num_hits, hit.slots) == (1, [(SLOT_HEADER_BYTES, CHUNK)])
    index.check()


def test_reserve_skips_keys_present_or_pending():
    """Keys committed or pending elsewhere come back in `present` and get no slot."""
    index = make_index()
    store(index, [k(1)])
    pending = index.reserve("b", "", [k(2)], CHUNK, 0.0)
    out = index.reserve("a", "", [k(1), k(2), k(3)], CHUNK, 0.0)
    assert out.present == [0, 1]
    assert [s[0] for s in out.slots] == [2]
    assert pending.reservation_id != out.reservation_id
    index.check()


def test_lookup_returns_longest_committed_prefix():
    """A lookup stops at the first key that is missing or pending."""
    index = make_index()
    store(index, [k(1), k(2), k(4)])
    index.reserve("b", "", [k(3)], CHUNK, 0.0)
    res = index.lookup("a", [("", [k(1), k(2), k(3), k(4)]), ("", [k(9), k(1)])], 0.0)
    assert [r.num_hits for r in res] == [2, 0]
    assert res[1].lease_id == 0
    assert index.stats().hits == 2
    assert index.stats().misses == 4


def test_salts_never_share_chunks():
    """The same key under another salt is a different chunk: a miss, and stored separately."""
    index = make_index()
    store(index, [k(1)], salt="tenant-a")
    assert index.lookup("b", [("tenant-b", [k(1)])], 0.0)[0].num_hits == 0
    out = index.reserve("b", "tenant-b", [k(1)], CHUNK, 0.0)
    assert out.present == []
    assert len(out.slots) == 1


def test_commit_of_part_keeps_the_rest_pending():
    """Committing some indices leaves the others pending in the same reservation."""
    index = make_index()
    out = index.reserve("a", "", [k(1), k(2)], CHUNK, 0.0)
    assert index.commit("a", out.reservation_id, [1], 0.0) == 1
    assert index.stats().pending_chunks == 1
    assert index.commit("a", out.reservation_id, None, 0.0) == 1
    with pytest.raises(UnknownReservationError):
        index.commit("a", out.reservation_id, None, 0.0)
    index.check()


def test_foreign_reservation_and_lease_cannot_be_used():
    """A client cannot commit, abort or release what another client holds."""
    index = make_index()
    out = index.reserve("a", "", [k(1)], CHUNK, 0.0)
    with pytest.raises(UnknownReservationError):
        index.commit("b", out.reservation_id, None, 0.0)
    assert index.abort("b", out.reservation_id) == 0
    index.commit("a", out.reservation_id, None, 0.0)
    lease = index.lookup("a", [("", [k(1)])], 0.0)[0].lease_id
    assert index.release("b", [lease]) == 0
    assert index.release("a", [lease, lease]) == 1


def test_abort_frees_slots():
    """Aborting a reservation gives its slots back and the keys can be reserved again."""
    index = make_index()
    out = index.reserve("a", "", [k(1), k(2)], CHUNK, 0.0)
    assert index.abort("a", out.reservation_id) == 2
    assert index.stats().used_bytes == 0
    assert len(index.reserve("b", "", [k(1)], CHUNK, 0.0).slots) == 1
    index.check()


def test_lru_evicts_least_recently_used_unleased():
    """When the pool is full, the chunk used longest ago goes first; a lookup refreshes a chunk."""
    index = make_index(pages=1)
    store(index, [k(i) for i in range(4)])
    index.release("a", [index.lookup("a", [("", [k(0)])], 0.0)[0].lease_id])
    out = store(index, [k(10)])
    assert not out.full
    hits = {i: index.lookup("a", [("", [k(i)])], 0.0)[0].num_hits for i in (0, 1, 2, 3, 10)}
    assert hits == {0: 1, 1: 0, 2: 1, 3: 1, 10: 1}
    assert index.stats().evictions == 1
    index.check()


def test_full_pool_of_leased_chunks_says_full_and_never_overwrites():
    """With every chunk leased, reserve places nothing, says full, and the leased bytes stay put."""
    index = make_index(pages=1)
    store(index, [k(i) for i in range(4)])
    leased = index.lookup("b", [("", [k(i) for i in range(4)])], 0.0)[0]
    assert leased.num_hits == 4
    out = index.reserve("a", "", [k(10), k(11)], CHUNK, 0.0)
    assert out.full
    assert out.slots == []
    assert out.reservation_id == 0
    again = index.lookup("a", [("", [k(i) for i in range(4)])], 0.0)[0]
    assert again.slots == leased.slots
    index.release("b", [leased.lease_id])
    assert index.reserve("a", "", [k(10)], CHUNK, 0.0).full
    index.release("a", [again.lease_id])
    assert not index.reserve("a", "", [k(10)], CHUNK, 0.0).full
    index.check()


def test_partial_placement_places_a_prefix():
    """When only some keys fit, the first ones get slots and `full` is set."""
    index = make_index(pages=1)
    out = index.reserve("a", "", [k(i) for i in range(6)], CHUNK, 0.0)
    assert [s[0] for s in out.slots] == [0, 1, 2, 3]
    assert out.full
    assert index.stats().full_reserves == 1


def test_other_class_takes_a_whole_page_by_eviction():
    """A chunk of a new size evicts a whole page of unleased chunks of another size."""
    index = make_index(pages=1)
    store(index, [k(i) for i in range(4)])
    index.register("c", 3000, 0.0)
    out = index.reserve("c", "", [k(20)], 3000, 0.0)
    assert len(out.slots) == 1
    assert not out.full
    assert index.stats().evictions == 4
    index.check()


def test_taking_a_page_for_another_class_evicts_a_bounded_number_of_chunks():
    """However small the chunks a client stored, a page holds at most MAX_SLOTS_PER_PAGE of them,
    so one request that needs a page for another size class evicts no more than that."""
    from kvdepot.server._slabs import MAX_SLOTS_PER_PAGE

    page = 8 << 20
    index = ChunkIndex(SlabAllocator(2 * page, page), max_client_pending_bytes=2 * page)
    index.register("tiny", CHUNK, 0.0)
    keys = [k(i) for i in range(2 * MAX_SLOTS_PER_PAGE)]  # two pages of 1-byte chunks
    for start in range(0, len(keys), 1024):
        store(index, keys[start : start + 1024], client="tiny")
    stats = index.stats()
    assert (stats.chunks, stats.pages_free, stats.evictions) == (2 * MAX_SLOTS_PER_PAGE, 0, 0)  # both pages full
    index.register("big", 64 << 10, 0.0)
    out = index.reserve("big", "", [k(10**6)], 64 << 10, 0.0)
    assert len(out.slots) == 1
    assert index.stats().evictions == MAX_SLOTS_PER_PAGE
    index.check()


def test_other_class_cannot_take_a_page_with_a_leased_chunk():
    """A page that holds one leased chunk is never reclaimed for another size class."""
    index = make_index(pages=1)
    store(index, [k(i) for i in range(4)])
    index.lookup("a", [("", [k(2)])], 0.0)
    index.register("c", 3000, 0.0)
    assert index.reserve("c", "", [k(20)], 3000, 0.0).full
    assert index.lookup("b", [("", [k(2)])], 0.0)[0].num_hits == 1
    index.check()


def slot_pages(index: ChunkIndex, salt: str, keys: list[bytes]) -> set[int]:
    """The pages that hold `keys` now (looked up and released at once, which refreshes them)."""
    (out,) = index.lookup("a", [(salt, keys)], 0.0)
    index.release("a", [out.lease_id])
    return {offset // PAGE for offset, _ in out.slots}


def present(index: ChunkIndex, keys: list[bytes], salt: str = "") -> list[bool]:
    """Which keys are stored, without refreshing or leasing them."""
    return [(salt, key) in index.chunks.entries for key in keys]


def test_other_class_spares_a_page_with_a_chunk_committed_just_now():
    """A reserve of another size reclaims the page whose chunks are all old, not the page that
    holds the oldest chunk next to one committed a moment ago."""
    index = make_index(pages=4)
    store(index, [k(i) for i in range(16)])  # page 0: k0-k3, page 1: k4-k7, ...
    store(index, [k(100)])  # evicts k0 alone and takes its slot in page 0
    assert present(index, [k(0), k(100)]) == [False, True]
    index.register("c", 3000, 0.0)
    out = index.reserve("c", "", [k(200)], 3000, 0.0)
    assert [offset // PAGE for _, offset, _ in out.slots] == [1]
    assert present(index, [k(100), k(1), k(2), k(3)]) == [True] * 4
    assert present(index, [k(i) for i in range(4, 8)]) == [False] * 4
    assert index.stats().evictions == 1 + 4
    index.check()


def test_other_class_spares_a_page_with_a_chunk_looked_up_just_now():
    """A lookup (then release) makes its chunk's page the most recent one: another size class
    reclaims the next page instead, even though the refreshed page holds the oldest chunks."""
    index = make_index(pages=3)
    store(index, [k(i) for i in range(12)])
    index.release("a", [index.lookup("a", [("", [k(1)])], 0.0)[0].lease_id])
    index.register("c", 3000, 0.0)
    out = index.reserve("c", "", [k(200)], 3000, 0.0)
    assert [offset // PAGE for _, offset, _ in out.slots] == [1]
    assert present(index, [k(i) for i in range(4)]) == [True] * 4
    assert present(index, [k(i) for i in range(4, 8)]) == [False] * 4
    index.check()


def test_page_with_fresh_chunks_goes_when_every_other_page_is_fresher():
    """Pages are ranked by their most recently used chunk: the page refreshed first is reclaimed."""
    index = make_index(pages=2)
    store(index, [k(i) for i in range(8)])
    assert slot_pages(index, "", [k(6)]) == {1}  # page 1 is now the more recent page...
    assert slot_pages(index, "", [k(2)]) == {0}  # ...until page 0 is used after it
    index.register("c", 3000, 0.0)
    out = index.reserve("c", "", [k(200)], 3000, 0.0)
    assert [offset // PAGE for _, offset, _ in out.slots] == [1]
    assert present(index, [k(i) for i in range(8)]) == [True] * 4 + [False] * 4
    index.check()


def test_same_size_chunk_goes_alone_unless_a_whole_page_is_older():
    """The oldest chunk of the needed size is evicted alone, but a page of another size whose
    chunks are all older than it is reclaimed instead."""
    index = make_index(pages=3)
    index.register("c", 3000, 0.0)
    store(index, [k(i) for i in range(4)])  # page 0
    out = index.reserve("c", "", [k(50)], 3000, 0.0)  # page 1, one slot
    index.commit("c", out.reservation_id, None, 0.0)
    index.close_session("c", 0.0)  # gone: its chunk counts toward nobody's fair share of the pool
    store(index, [k(i) for i in range(4, 8)])  # page 2
    store(index, [k(100)])
    assert present(index, [k(0), k(1), k(50), k(100)]) == [False, True, True, True]
    assert index.stats().evictions == 1
    slot_pages(index, "", [k(1), k(2), k(3)])  # now k(50) is older than everything of page 0
    out = store(index, [k(101)])
    assert [offset // PAGE for _, offset, _ in out.slots] == [1]
    assert present(index, [k(50), k(1), k(4), k(100)]) == [False, True, True, True]
    assert index.stats().evictions == 2
    index.check()


def test_quota_evicts_own_chunks_first():
    """A salt at its quota evicts its own oldest chunk, never another salt's."""
    index = make_index(pages=2)
    store(index, [k(1)], salt="other")
    index.set_quota("t", 2 * SLOT)
    store(index, [k(1), k(2)], salt="t")
    out = store(index, [k(3)], salt="t")
    assert not out.full
    stats = index.stats()
    assert stats.per_salt["t"].bytes == 2 * SLOT
    assert index.lookup("a", [("t", [k(1)])], 0.0)[0].num_hits == 0
    assert index.lookup("a", [("other", [k(1)])], 0.0)[0].num_hits == 1
    index.check()


def test_lowering_a_quota_evicts_down_to_it():
    """Setting a quota below current use evicts the salt's unleased chunks down to the quota."""
    index = make_index(pages=2)
    store(index, [k(i) for i in range(4)], salt="t")
    assert index.set_quota("t", SLOT) == {"t": SLOT}
    assert index.stats().per_salt["t"].chunks == 1
    assert index.set_quota("t", None) == {}


def test_expired_reservation_frees_slots():
    """A reservation not committed by its deadline expires; its slots stay out of everyone's
    reach for one more TTL (a copy into them may still land), then return."""
    index = make_index(reservation_ttl=5.0)
    out = index.reserve("a", "", [k(1)], CHUNK, 0.0)
    assert index.expire(4.0).reservations == 0
    assert index.expire(5.0).reservations == 1
    with pytest.raises(UnknownReservationError):
        index.commit("a", out.reservation_id, None, 6.0)
    assert index.stats().used_bytes == SLOT
    index.expire(10.0)
    assert index.stats().used_bytes == 0
    index.check()


def test_a_late_copy_into_an_expired_reservation_never_lands_in_another_chunk():
    """The slots of a reservation that expired (or whose client left) are not handed to anyone
    for one more TTL: a copy still under way lands in them, never in a chunk another client
    committed meanwhile, which every reader's check would pass."""
    for end in ("expired", "session ended"):
        index = make_index(reservation_ttl=5.0, pages=1)
        (_, late, _), *_ = index.reserve("a", "", [k(1)], CHUNK, 0.0).slots
        if end == "expired":
            index.expire(5.0)
        else:
            index.close_session("a", 5.0)
        slots = index.reserve("b", "", [k(i) for i in range(2, 40)], CHUNK, 6.0).slots
        assert slots
        assert late not in {offset for _, offset, _ in slots}
        index.expire(10.0)  # one more TTL: the slot returns
        assert late in {offset for _, offset, _ in index.reserve("b", "", [k(99)], CHUNK, 10.0).slots}
        index.check()


def test_the_stats_show_quarantined_slots_apart_from_clients_and_their_pending_chunks():
    """The quarantine's slots are neither pending chunks nor a client's, nor is its session a client."""
    index = make_index(reservation_ttl=5.0)
    index.reserve("a", "", [k(1), k(2)], CHUNK, 0.0)
    index.reserve("b", "", [k(3)], CHUNK, 0.0)
    index.close_session("a", 1.0)
    stats = index.stats()
    assert (stats.pending_chunks, stats.quarantined_chunks, stats.reservations, stats.clients) == (1, 2, 1, 1)
    index.expire(6.0)  # a's slots leave the quarantine, b's reservation expires into it
    stats = index.stats()
    assert (stats.pending_chunks, stats.quarantined_chunks, stats.reservations) == (0, 1, 0)
    index.check()


def test_expired_lease_makes_chunk_evictable_again():
    """A lease never released expires and its chunk can be evicted again."""
    index = make_index(pages=1, lease_ttl=5.0, session_ttl=100.0)
    store(index, [k(i) for i in range(4)])
    index.lookup("b", [("", [k(i) for i in range(4)])], 0.0)
    assert index.reserve("a", "", [k(9)], CHUNK, 1.0).full
    index.expire(5.0)
    assert index.stats().leases == 0
    assert not index.reserve("a", "", [k(9)], CHUNK, 6.0).full


def test_silent_client_is_reclaimed():
    """A client with no request for longer than the session TTL loses its leases and reservations."""
    index = make_index(session_ttl=10.0)
    store(index, [k(1)])
    index.lookup("b", [("", [k(1)])], 0.0)
    index.reserve("b", "", [k(2)], CHUNK, 0.0)
    index.touch("a", 9.0)
    gone = index.expire(11.0)
    assert (gone.leases, gone.reservations) == (1, 1)
    assert index.clients() == ["a", QUARANTINE_CLIENT]  # which holds b's reservation's slots one more TTL
    index.touch("a", 70.0)
    index.expire(72.0)
    stats = index.stats()
    assert (stats.leases, stats.reservations, stats.pending_chunks) == (0, 0, 0)
    index.check()


def test_closing_a_session_reclaims_everything():
    """EndSession or disconnect returns all of a client's leases and reservations."""
    index = make_index()
    store(index, [k(1)])
    index.lookup("b", [("", [k(1)])], 0.0)
    index.reserve("b", "", [k(2), k(3)], CHUNK, 0.0)
    gone = index.close_session("b", 0.0)
    assert (gone.leases, gone.reservations, gone.chunks) == (1, 1, 2)
    assert index.close_session("b", 0.0).leases == 0
    index.check()


def test_stores_need_registration_and_lookups_a_session():
    """Reserve needs Register; a lookup needs only a session (a scheduler never registers a layout)."""
    index = make_index()
    index.touch("x", 0.0)
    assert index.lookup("x", [("", [k(1)])], 0.0)[0].num_hits == 0
    with pytest.raises(NotRegisteredError):
        index.lookup("nobody", [("", [k(1)])], 0.0)
    with pytest.raises(NotRegisteredError) as info:
        index.reserve("x", "", [k(1)], CHUNK, 0.0)
    assert info.value.code == "not_registered"


def test_clear_keeps_leased_and_pending():
    """Clear removes committed unleased chunks only."""
    index = make_index()
    store(index, [k(1), k(2)], salt="s")
    store(index, [k(1)], salt="t")
    index.lookup("a", [("s", [k(1)])], 0.0)
    index.reserve("a", "s", [k(3)], CHUNK, 0.0)
    assert index.clear("s") == (1, False)
    assert index.clear() == (1, False)
    assert index.stats().chunks == 1
    index.check()


def test_per_client_lease_limit(monkeypatch):
    """One client cannot hold more leases than the per-client limit."""
    monkeypatch.setattr("kvdepot.server._sessions.MAX_LEASES_PER_CLIENT", 2)
    index = make_index()
    store(index, [k(1)])
    index.lookup("a", [("", [k(1)])], 0.0)
    index.lookup("a", [("", [k(1)])], 0.0)
    with pytest.raises(TooManyError):
        index.lookup("a", [("", [k(1)])], 0.0)


def test_one_client_cannot_fill_the_pool_with_pending_slots():
    """A client's uncommitted reservations stop at its share of the pool; others can still store."""
    index = ChunkIndex(SlabAllocator(2 * PAGE, PAGE), max_client_pending_bytes=3 * SLOT)
    index.register("a", CHUNK, 0.0)
    index.register("b", CHUNK, 0.0)
    out = index.reserve("a", "", [k(i) for i in range(8)], CHUNK, 0.0)
    assert len(out.slots) == 3
    assert out.full
    assert len(index.reserve("b", "", [k(20), k(21)], CHUNK, 0.0).slots) == 2
    index.commit("a", out.reservation_id, None, 0.0)
    assert len(index.reserve("a", "", [k(30)], CHUNK, 0.0).slots) == 1
    index.check()


def test_several_clients_together_cannot_pin_the_whole_pool_as_pending():
    """Each client's pending bound (half the pool) does not add up to the whole pool: all clients
    together stop at three quarters, past which a client still gets a sixteenth of its own, so a
    well-behaved client can still store."""
    index = ChunkIndex(SlabAllocator(8 * PAGE, PAGE))
    for client in ("x", "y", "good"):
        index.register(client, CHUNK, 0.0)
    first = index.reserve("x", "", [k(i) for i in range(100)], CHUNK, 0.0)
    second = index.reserve("y", "", [k(i) for i in range(100, 200)], CHUNK, 0.0)
    assert len(first.slots) == 16  # half of 32 slots
    assert len(second.slots) == 8  # three quarters in all
    assert second.full
    stored = store(index, [k(300 + i) for i in range(4)], client="good")
    assert len(stored.slots) == 2  # 2 KiB of 32
    assert len(store(index, [k(400)], client="good").slots) == 1  # committed: its share is free again
    index.check()


def test_leases_of_all_clients_together_are_bounded(monkeypatch):
    """Past MAX_LEASES live leases in all, a lookup is refused with a typed error until some end."""
    monkeypatch.setattr("kvdepot.server._sessions.MAX_LEASES", 3)
    index = make_index()
    store(index, [k(1)])
    for client in ("a", "b", "a"):
        index.lookup(client, [("", [k(1)])], 0.0)
    with pytest.raises(TooManyError, match="leases"):
        index.lookup("b", [("", [k(1)])], 0.0)
    index.check()


def test_a_default_quota_bounds_every_salt_without_its_own():
    """With a default quota, a salt with no quota of its own evicts its own chunks at that bound, never
    another salt's; a salt's own quota replaces the default."""
    index = make_index(pages=4, default_quota=2 * SLOT)
    store(index, [k(1)], salt="victim")
    for i in range(10):  # a tenant storing much under one fresh salt
        store(index, [k(100 + i)], salt="greedy")
    assert index.stats().per_salt["greedy"].bytes == 2 * SLOT
    assert index.lookup("a", [("victim", [k(1)])], 0.0)[0].num_hits == 1
    index.set_quota("big", 4 * SLOT)
    for i in range(4):
        store(index, [k(200 + i)], salt="big")
    assert index.stats().per_salt["big"].bytes == 4 * SLOT
    index.check()


def test_sessions_are_bounded_and_an_ended_one_frees_its_place():
    """Past MAX_SESSIONS live sessions a new client is refused with a typed error; a known client
    is still served, and once a session ends a new client gets its place."""
    from kvdepot.server import MAX_SESSIONS, TooManyError

    index = make_index()
    for i in range(MAX_SESSIONS - 2):
        index.touch(f"c{i}", 0.0)
    with pytest.raises(TooManyError):
        index.touch("one-too-many", 0.0)
    index.touch("a", 1.0)  # a known client is still served
    index.close_session("c0", 0.0)
    index.touch("one-too-many", 1.0)
    assert index.stats().clients == MAX_SESSIONS


def test_a_client_past_its_fair_share_evicts_its_own_chunks_whatever_the_salt():
    """With two live clients holding chunks, each may fill half the pool before its own oldest
    chunks go; fresh salts do not help it reach the other's. A client that left counts for nobody."""
    index = make_index(pages=2)  # 8 slots: a share of 4 each
    store(index, [k(i) for i in range(3)], salt="b-salt", client="b")
    for i in range(20):
        store(index, [k(100 + i)], salt=f"fresh-{i}", client="a")
        index.check()
    assert present(index, [k(i) for i in range(3)], salt="b-salt") == [True] * 3
    assert index.stats().used_bytes == index.allocator.capacity  # free slots go to anyone; only eviction is shared
    index.close_session("b", 0.0)
    for i in range(20, 30):
        store(index, [k(100 + i)], salt=f"fresh-{i}", client="a")
    assert present(index, [k(i) for i in range(3)], salt="b-salt") == [False] * 3
    index.check()


def test_a_reserve_never_evicts_a_chunk_it_reports_present():
    """The chunks a reserve finds stored are reported present (the client skips writing them),
    so placing the later keys of the same call must not evict them: under a quota, and under
    the pool's own LRU."""
    index = make_index(pages=2)
    store(index, [k(0)], salt="s")
    index.set_quota("s", SLOT)  # room for this one chunk only
    out = index.reserve("a", "s", [k(0), k(1)], CHUNK, 1.0)
    assert out.present == [0]
    assert out.slots == []  # k(1) would need k(0)'s room
    assert index.prefix_lengths([("s", [k(0)])]) == [1]
    index = make_index(pages=1)  # four slots
    store(index, [k(0), k(1)])
    store(index, [k(2), k(3)])
    out = index.reserve("a", "", [k(i) for i in range(6)], CHUNK, 1.0)
    assert out.present == [0, 1, 2, 3]
    assert index.prefix_lengths([("", [k(i) for i in range(4)])]) == [4]
    index.check()


def test_a_reserve_that_can_place_nothing_evicts_nothing_for_its_quota():
    """When no slot of the size asked for can be had (the only page holds another size class and a
    leased chunk), the salt's chunks are not evicted to make quota room for it."""
    index = ChunkIndex(SlabAllocator(PAGE, PAGE))
    index.register("b", 1000, 0.0)  # 1088-byte slots
    index.register("a", 500, 0.0)  # 1024-byte slots
    for i, salt in [(1, "s"), (2, "s"), (3, "other")]:
        out = index.reserve("b", salt, [k(i)], 1000, float(i))
        index.commit("b", out.reservation_id, None, float(i))
    index.lookup("b", [("other", [k(3)])], 4.0)  # a lease pins the page
    index.set_quota("s", 2200)
    out = index.reserve("a", "s", [k(9)], 500, 5.0)
    assert out.full
    assert out.slots == []
    assert index.chunks.evictions == 0
    index.check()


def test_client_ids_using_their_floor_never_pin_more_than_seven_eighths_of_the_pool():
    """Past the global bound on pending bytes each client still gets a small floor, but all of
    them together stop at 7/8 of the pool: any number of client ids that never commit cannot
    pin every slot."""
    index = ChunkIndex(SlabAllocator(64 * PAGE, PAGE))
    for n in range(12):
        client = f"hog{n}"
        index.register(client, CHUNK, 0.0)
        i = 0
        while index.reserve(client, "", [k(n * 10_000 + i)], CHUNK, 0.0).slots:
            i += 1
    assert index.sessions.pending_bytes <= index.allocator.capacity * 7 // 8
    index.check()


def test_a_reserve_of_another_chunk_size_than_registered_is_refused():
    """Each slot size costs the allocator a class: a client may reserve only the chunk size it
    registered (the server's memory would otherwise grow with every size a peer names)."""
    index = make_index()
    with pytest.raises(ServerArgumentError, match="registered with"):
        index.reserve("a", "", [k(1)], CHUNK - 1, 0.0)


def test_a_commit_with_a_pin_keeps_its_chunks_until_the_pin_ends_and_no_longer_than_the_bound():
    """Chunks committed with `pin_s` cannot be evicted until that many seconds have passed (the
    pin is a lease of the server's own session); a pin past `MAX_PIN_S` is cut to it."""
    from kvdepot.server._holds import MAX_PIN_S, PIN_CLIENT

    def evictable() -> int:
        return len(index.policy.evictable("s", 10))

    index = make_index(pages=16)  # pins may hold a quarter of it: room for these three
    out = index.reserve("a", "s", [k(1), k(2)], CHUNK, 0.0)
    assert index.commit("a", out.reservation_id, None, 0.0, pin_s=5.0) == 2
    out = index.reserve("a", "s", [k(3)], CHUNK, 0.0)
    assert index.commit("a", out.reservation_id, None, 0.0, pin_s=10 * MAX_PIN_S) == 1
    assert evictable() == 0
    assert index.stats().leases == 2
    index.expire(4.9)
    assert evictable() == 0
    index.expire(5.0)
    assert evictable() == 2  # the first pin ended; the second holds
    index.expire(MAX_PIN_S)
    assert evictable() == 3
    assert index.stats().leases == 0
    assert PIN_CLIENT.startswith("kvdepot/")
    index.check()


def test_a_reservation_made_before_a_clear_of_its_salt_commits_nothing():
    """A store under way when its salt is cleared (reserved before, committed after) is dropped:
    the clear removes what was stored before it. Other salts' reservations commit."""
    index = make_index()
    gone = index.reserve("a", "s", [k(1)], CHUNK, 0.0)
    kept = index.reserve("a", "t", [k(2)], CHUNK, 0.0)
    index.clear("s")
    assert index.commit("a", gone.reservation_id, None, 0.0) == 0
    assert index.commit("a", kept.reservation_id, None, 0.0) == 1
    after = index.reserve("a", "s", [k(1)], CHUNK, 0.0)
    assert index.commit("a", after.reservation_id, None, 0.0) == 1  # stored after the clear: it stays
    index.clear()
    late = index.reserve("a", "t", [k(3)], CHUNK, 0.0)
    assert index.commit("a", late.reservation_id, None, 0.0) == 1
    assert index.stats().chunks == 1
    index.check()


def test_a_clear_ends_the_pins_of_its_salt_and_pins_keep_to_their_share_of_the_pool():
    from kvdepot.server._holds import MAX_PINNED_SHARE

    index = make_index(pages=4)
    pinned = index.reserve("a", "s", [k(1)], CHUNK, 0.0)
    index.commit("a", pinned.reservation_id, None, 0.0, pin_s=30.0)
    other = index.reserve("a", "t", [k(1)], CHUNK, 0.0)
    index.commit("a", other.reservation_id, None, 0.0, pin_s=30.0)
    assert index.clear("s") == (1, False)  # its pin ended with the clear
    assert index.stats().leases == 1  # t's pin holds
    # Pins stop at their share of the pool: the rest commit unpinned.
    budget = int(MAX_PINNED_SHARE * index.allocator.capacity)
    keys = [k(100 + i) for i in range(2 * budget // CHUNK)]
    for key in keys:
        out = index.reserve("b", "u", [key], CHUNK, 0.0)
        if out.reservation_id:
            index.commit("b", out.reservation_id, None, 0.0, pin_s=30.0)
    assert index.stats().pins_refused > 0
    assert index.holds.pins.pinned_bytes <= budget
    index.clear()
    assert index.stats().leases == 0
    assert index.holds.pins.pinned_bytes == 0
    index.check()
