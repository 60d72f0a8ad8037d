"""The tiers wired to the index (`TierSet`), without a server process: pins, write-behind, read-through.

The tier is a real `DiskTier` in a temporary directory; the pool is a plain bytearray with real
slot headers; the loop's part (`run`) is called by the test.
"""

from __future__ import annotations

import time

from kvdepot.server import ChunkIndex, DiskTier, SlabAllocator
from kvdepot.server._pool import SlotHeaders
from kvdepot.server._tier_read import ReadState
from kvdepot.server._tiering import ClearAnswer, TierSet

PAGE = 64 * 1024
CHUNK = 4096 - 64  # one 4 KiB slot
SLOTS = 2 * PAGE // 4096


class SlowDisk(DiskTier):
    """A real disk tier whose every chunk read takes ``delay`` seconds longer (a sick device)."""

    delay = 0.0
    probe_delay = 0.0  # and every probe (which chunks it holds)

    def _read_one(self, ref, buf):
        time.sleep(self.delay)
        return super()._read_one(ref, buf)

    def lengths(self, refs, *, timeout=None):
        time.sleep(self.probe_delay)
        self.__dict__.setdefault("asked", []).append(len(refs))
        return super().lengths(refs, timeout=timeout)


class LoopTiers(TierSet):
    """The tiers as the server's loop runs them: `run` answers the lookups they are done with
    from the index (into ``answers``), and hands the index's events to the write-behind."""

    def __init__(self, *args, answers: list, **kw):
        super().__init__(*args, **kw)
        self.answers = answers

    def run(self):
        for answer in super().run():
            if isinstance(answer, ClearAnswer):  # a Clear's answer: what the tiers did
                self.answers.append(answer.cleared)
                continue
            self.answers.append(self.index.lookup(answer.client, answer.items, time.monotonic()))
        self.take(self.index.take_events())
        return []


def make(tmp_path, answers: list, index_kw: dict | None = None, **kw):
    pool = memoryview(bytearray(2 * PAGE))
    index = ChunkIndex(
        SlabAllocator(2 * PAGE, PAGE),
        headers=SlotHeaders(pool),
        max_client_pending_bytes=2 * PAGE,
        events=True,
        **(index_kw or {}),
    )
    tiers = LoopTiers([SlowDisk(tmp_path / "disk", 1 << 24)], index, pool, wake=lambda: None, answers=answers, **kw)
    index.register("a", CHUNK, 0.0)
    return pool, index, tiers


def store(tiers: TierSet, client: str, keys: list[bytes]) -> int:
    """Store ``keys`` as a client's Reserve and Commit requests do, the commit's events handed to
    the tiers after it (as the server's handler does after each request)."""
    index, pool = tiers.index, tiers.pool
    out = index.reserve(client, "", keys, CHUNK, 0.0)
    for i, offset, length in out.slots:
        pool[offset : offset + length] = keys[i] * (length // len(keys[i]))
    committed = index.commit(client, out.reservation_id, None, 0.0) if out.reservation_id else 0
    tiers.take(index.take_events())
    return committed


def on_disk_only(tiers: TierSet, index: ChunkIndex, pool, n: int) -> list[bytes]:
    """Store ``n`` chunks, wait until the disk tier holds them, and empty RAM."""
    keys = [bytes([i + 1]) * 32 for i in range(n)]
    store(tiers, "a", keys)
    settle(tiers, lambda: tiers.tiers[0].stats().objects == n and index.stats().leased_chunks == 0)
    index.clear()
    return keys


def settle(tiers: TierSet, until, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        tiers.run()
        if until():
            return
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_committed_chunk_stays_pinned_until_copied_for_the_tier(tmp_path):
    """Until the writer copied a chunk (and the loop ran), it cannot be evicted; afterwards it can,
    and it is on disk."""
    answers: list = []
    _pool, index, tiers = make(tmp_path, answers)
    try:
        keys = [bytes([i]) * 32 for i in range(SLOTS)]
        assert store(tiers, "a", keys) == SLOTS  # the pool is full, every chunk pinned
        assert index.stats().leased_chunks == SLOTS
        assert not index.reserve("a", "", [b"\xff" * 32], CHUNK, 0.0).slots  # nothing may go
        settle(tiers, lambda: index.stats().leased_chunks == 0)
        assert index.reserve("a", "", [b"\xff" * 32], CHUNK, 0.0).slots  # now the oldest may
        settle(tiers, lambda: tiers.tiers[0].stats().objects == SLOTS)
        index.check()
    finally:
        tiers.close()


def test_a_lookup_that_misses_ram_is_answered_from_the_disk_tier(tmp_path):
    """A deferred lookup is answered once the tier read is done, with the chunks back in RAM and
    their bytes intact; keys the tier lacks end the prefix."""
    answers: list = []
    pool, index, tiers = make(tmp_path, answers)
    try:
        keys = [bytes([i]) * 32 for i in range(3)]
        store(tiers, "a", keys)
        settle(tiers, lambda: tiers.tiers[0].stats().objects == 3 and index.stats().leased_chunks == 0)
        assert index.clear() == (3, False)
        items = [("", [*keys, b"\x09" * 32])]
        deferred = tiers.lookup("a", items, 0.0)
        assert deferred is not None
        settle(tiers, lambda: answers)
        (result,) = answers[0]
        assert result.num_hits == 3
        for (offset, length), key in zip(result.slots, keys, strict=True):
            assert bytes(pool[offset : offset + length]) == key * (length // 32)
        assert tiers.lookup("a", [("", keys)], 0.0) is None  # all in RAM now: answered at once
        index.check()
    finally:
        tiers.close()


def test_a_commit_stands_and_is_written_behind_after_the_tier_session_was_ended(tmp_path):
    """A peer that greets under the server's own tier id and ends that session cannot make a
    client's commit fail: the session comes back and the chunk is still written below."""
    from kvdepot.server._tiering import TIER_CLIENT

    answers: list = []
    _pool, index, tiers = make(tmp_path, answers)
    try:
        index.close_session(TIER_CLIENT, 0.0)
        assert store(tiers, "a", [b"\x01" * 32]) == 1
        settle(tiers, lambda: tiers.tiers[0].stats().objects == 1 and index.stats().leased_chunks == 0)
        index.check()
    finally:
        tiers.close()


def test_a_slow_tier_read_keeps_its_slots_however_long_it_takes(tmp_path):
    """The slots a tier read fills stay its own until the read settles: neither the reservation
    TTL nor a silent session frees them under the reader. Freed, they could go to another
    client's chunk, which the reader would then overwrite with these bytes (a hit on wrong KV)."""
    answers: list = []
    pool, index, tiers = make(
        tmp_path, answers, index_kw={"reservation_ttl": 0.05}, read_deadline=5.0, read_deadline_per_chunk=None
    )
    try:
        keys = on_disk_only(tiers, index, pool, 4)
        tiers.tiers[0].delay = 0.15
        assert tiers.lookup("a", [("", keys)], 0.0) is not None
        settle(tiers, lambda: index.stats().pending_chunks == 4)  # the slots are taken, the read is under way
        later = time.monotonic() + 100
        index.touch("a", later)  # the asking client stays; everything else is long past due
        index.sessions.session_ttl = 1.0
        index.expire(later)
        assert index.stats().pending_chunks == 4
        settle(tiers, lambda: answers)
        (result,) = answers[0]
        assert result.num_hits == 4
        for (offset, length), key in zip(result.slots, keys, strict=True):
            assert bytes(pool[offset : offset + length]) == key * (length // 32)
        assert index.stats().pending_chunks == 0
        index.check()
    finally:
        tiers.close()


def test_a_tier_read_never_evicts_the_ram_prefix_of_its_own_lookup(tmp_path):
    """With the pool full, the slots for the chunks read from the tier are found by eviction; the
    lookup's own RAM prefix, the least recently used, is held meanwhile, so the whole prompt hits."""
    answers: list = []
    pool, index, tiers = make(tmp_path, answers)
    try:
        keys = on_disk_only(tiers, index, pool, 6)
        store(tiers, "a", keys[:2])  # the prefix is in RAM again, the oldest chunks there
        store(tiers, "a", [bytes([0x80, i]) * 16 for i in range(SLOTS - 2)])  # the pool is full
        settle(tiers, lambda: index.stats().leased_chunks == 0)
        assert tiers.lookup("a", [("", keys)], 0.0) is not None
        settle(tiers, lambda: answers)
        (result,) = answers[0]
        assert result.num_hits == 6
        for (offset, length), key in zip(result.slots, keys, strict=True):
            assert bytes(pool[offset : offset + length]) == key * (length // 32)
        index.release("a", [result.lease_id])
        assert index.stats().leased_chunks == 0  # the tiers' own lease on the prefix is gone too
        index.check()
    finally:
        tiers.close()


def two_clients_and_a_slow_probe(tmp_path, answers: list, n: int, read_deadline: float):
    """Clients "a" and "b", `n` chunks on disk only, and a tier that takes 0.2 s per probe."""
    pool, index, tiers = make(tmp_path, answers, read_deadline=read_deadline, read_deadline_per_chunk=None)
    keys = on_disk_only(tiers, index, pool, n)
    index.touch("b", 0.0)
    tiers.tiers[0].probe_delay = 0.2
    return index, tiers, keys


def test_a_client_cannot_queue_tier_reads_without_bound(tmp_path):
    """Past MAX_READ_KEYS_PER_CLIENT keys of lookups waiting for the tiers, a client's next lookup
    is answered from RAM at once (counted); another client's still waits for the tiers; a lookup
    past the key limit never reaches the reader (the lookup from RAM refuses it); and a read
    that waited in the queue longer than the longest deadline is not even probed."""
    from kvdepot.server._index import MAX_KEYS_PER_REQUEST
    from kvdepot.server._tiering import MAX_READ_KEYS_PER_CLIENT

    answers: list = []
    index, tiers, keys = two_clients_and_a_slow_probe(tmp_path, answers, 4, read_deadline=0.3)
    try:
        now = time.monotonic()
        many = MAX_KEYS_PER_REQUEST - len(keys)  # keys no tier holds, after the ones it holds
        waiting = [
            tiers.lookup("a", [("", keys), ("", [bytes([9, i]) * 16] * many)], now)
            for i in range(MAX_READ_KEYS_PER_CLIENT // MAX_KEYS_PER_REQUEST)
        ]
        assert all(d is not None for d in waiting)
        assert tiers.lookup("a", [("", keys)], now) is None  # answered from RAM at once
        assert tiers.counters["reads_refused"] == 1
        assert tiers.lookup("b", [("", keys)], now) is not None  # another client is not refused
        assert tiers.lookup("b", [("", [b"\x01" * 32] * (MAX_KEYS_PER_REQUEST + 1))], now) is None
        settle(tiers, lambda: len(answers) == len(waiting) + 1)
        assert tiers.counters["reads_expired"] >= 1  # the last ones waited behind 0.2 s probes past 0.3 s
        assert tiers.book.keys_of == {}
        assert tiers.book.keys_waiting == 0
        assert tiers.book.prefix_leases == 0
        assert index.stats().pending_chunks == 0
        index.check()
    finally:
        tiers.close()


def test_the_reader_takes_clients_in_turn(tmp_path):
    """A client with several lookups waiting for a slow tier does not make another client's
    lookup wait behind all of them: the reader takes the clients in turn."""
    answers: list = []
    index, tiers, keys = two_clients_and_a_slow_probe(tmp_path, answers, 8, read_deadline=5.0)
    try:
        for i in range(4):  # "a" asks for one chunk at a time
            assert tiers.lookup("a", [("", keys[i : i + 1])], 0.0) is not None
        assert tiers.lookup("b", [("", keys[4:])], 0.0) is not None  # "b" for four others at once
        settle(tiers, lambda: len(answers) == 5)
        hits = [result.num_hits for (result,) in answers]
        assert sorted(hits) == [1, 1, 1, 1, 4]
        assert hits.index(4) <= 2  # after at most two of a's, not after all four
        index.check()
    finally:
        tiers.close()


def test_a_read_cut_off_by_the_deadline_keeps_the_prefix_it_got(tmp_path):
    """When the tier is too slow for the whole run, the chunks read before the deadline still hit
    (in RAM, intact), the rest are misses, and no slot stays reserved."""
    answers: list = []
    pool, index, tiers = make(tmp_path, answers, read_deadline=0.25, read_deadline_per_chunk=None)
    try:
        keys = on_disk_only(tiers, index, pool, 6)
        tiers.tiers[0].delay = 0.1
        assert tiers.lookup("a", [("", keys)], 0.0) is not None
        settle(tiers, lambda: answers)
        (result,) = answers[0]
        assert 1 <= result.num_hits < 6
        for (offset, length), key in zip(result.slots, keys, strict=False):
            assert bytes(pool[offset : offset + length]) == key * (length // 32)
        assert tiers.tiers[0].stats().late >= 1
        assert index.stats().pending_chunks == 0
        index.check()
    finally:
        tiers.close()


def test_the_deadline_grows_with_the_run_the_tiers_hold_up_to_its_cap(tmp_path):
    """A lookup waits per chunk it would save, never more than the cap; without a per-chunk
    figure, always the cap."""
    answers: list = []
    _, _, tiers = make(tmp_path, answers, read_deadline=0.5, read_deadline_per_chunk=0.04)
    try:
        assert tiers.deadline_for(0) == 0.0
        assert tiers.deadline_for(2) == 0.08
        assert tiers.deadline_for(100) == 0.5
        tiers.read_deadline_per_chunk = None
        assert tiers.deadline_for(1) == 0.5
    finally:
        tiers.close()


def test_the_engines_own_compute_time_bounds_the_wait_when_it_is_shorter(tmp_path):
    """A lookup carries the engine's seconds per chunk: the shorter of it and the server's
    figures wins, so a fast engine never waits longer than it would take to recompute."""
    answers: list = []
    _, _, tiers = make(tmp_path, answers, read_deadline=0.5, read_deadline_per_chunk=0.04)
    try:
        assert tiers.deadline_for(4, 0.01) == 0.04
        assert tiers.deadline_for(4, 0.1) == 0.16
        assert tiers.deadline_for(100, 1.0) == 0.5
        tiers.read_deadline_per_chunk = None
        assert tiers.deadline_for(4, 0.01) == 0.04
        assert tiers.deadline_for(4, None) == 0.5
    finally:
        tiers.close()


def test_a_fast_engine_does_not_wait_for_a_slow_tier(tmp_path):
    """With the server's generous deadline, a slow tier would be waited for; a lookup from an
    engine that computes a chunk in 10 ms is answered after about that per chunk instead, with
    the chunks in by then."""
    answers: list = []
    pool, index, tiers = make(tmp_path, answers, read_deadline=5.0, read_deadline_per_chunk=None)
    try:
        keys = on_disk_only(tiers, index, pool, 6)
        tiers.tiers[0].delay = 0.5
        assert tiers.lookup("a", [("", keys)], 0.0, per_chunk=0.01) is not None
        settle(tiers, lambda: answers)
        (result,) = answers[0]
        assert result.num_hits <= 1  # waiting for the tier (its 5 s deadline covers 6 x 0.5 s) would hit all 6
        assert tiers.tiers[0].stats().late >= 1
        assert index.stats().pending_chunks == 0
        index.check()
    finally:
        tiers.close()


def test_a_run_the_tiers_do_not_hold_costs_no_slot_and_no_wait(tmp_path):
    """Keys no tier holds are answered at once as misses: nothing reserved, nothing read."""
    answers: list = []
    _, index, tiers = make(tmp_path, answers)
    try:
        assert tiers.lookup("a", [("", [b"\x07" * 32])], 0.0) is not None
        settle(tiers, lambda: answers)
        assert answers[0][0].num_hits == 0
        assert tiers.tiers[0].stats().hits == tiers.tiers[0].stats().misses == 0
        assert index.stats().pending_chunks == 0
    finally:
        tiers.close()


def test_the_first_key_no_tier_holds_ends_the_probe_of_its_item(tmp_path, monkeypatch):
    """The tiers are asked about a window of keys at a time, and only for the items whose run
    covered the whole window: a cold prompt of many keys costs one window, while a run the
    tiers hold is found across windows, whole."""
    import kvdepot.server._tier_reader as tier_reader

    monkeypatch.setattr(tier_reader, "PROBE_WINDOW", 2)
    answers: list = []
    pool, index, tiers = make(tmp_path, answers)
    try:
        keys = on_disk_only(tiers, index, pool, 6)
        cold = [bytes([0xC0, i % 256, i // 256]) * 8 for i in range(1000)]
        items = [("", [*keys, *cold[:100]]), ("", cold)]
        assert tiers.lookup("a", items, 0.0) is not None
        settle(tiers, lambda: answers)
        assert [r.num_hits for r in answers[0]] == [6, 0]
        # windows of 2 (both items), then 8 (the first only, which ends at its 7th key)
        assert tiers.tiers[0].asked == [2 + 2, 8]
        index.check()
    finally:
        tiers.close()


def test_a_lookup_is_answered_without_the_tiers_when_a_tier_call_hangs(tmp_path, monkeypatch):
    """A disk read that blocks (a hung mount) holds the reader thread: the lookups waiting for
    it, and those queued behind it, are answered from RAM once past their longest wait, not
    when the read returns. What the read brings in later is still published, and no slot stays
    reserved."""
    import kvdepot.server._tier_read as tier_read

    monkeypatch.setattr(tier_read, "OVERDUE_GRACE_S", 0.1)
    answers: list = []
    pool, index, tiers = make(tmp_path, answers, read_deadline=0.1, read_deadline_per_chunk=None)
    try:
        keys = on_disk_only(tiers, index, pool, 2)
        index.touch("b", 0.0)
        tiers.tiers[0].delay = 2.0  # one file read takes 2 s; the tier checks its deadline only between files
        assert tiers.lookup("a", [("", keys)], 0.0) is not None
        settle(tiers, lambda: index.stats().pending_chunks == 2)  # probed, slots reserved: the read starts
        time.sleep(0.05)
        assert tiers.lookup("b", [("", keys)], 0.0) is not None
        settle(tiers, lambda: len(answers) == 2)
        assert tiers.book.keys_waiting > 0  # both answered while the read still holds the reader, not when it returns
        assert [result.num_hits for (result,) in answers] == [0, 0]
        assert tiers.counters["reads_overdue"] == 2
        settle(tiers, lambda: tiers.book.keys_waiting == 0)  # the reader is done: everything settled
        assert len(answers) == 2  # nobody is answered twice
        assert index.stats().pending_chunks == 0
        assert index.lookup("a", [("", keys)], time.monotonic())[0].num_hits == 1  # the chunk read in time
        index.check()
    finally:
        tiers.close()


def test_a_clear_voids_a_tier_read_of_its_salt_already_under_way(tmp_path):
    """A lookup's read-through that read a salt's chunks before a clear of that salt, and is
    handed back to the loop after it, commits none of them: they were deleted. The clear's
    answer counts what each tier deleted."""
    import threading

    from kvdepot.transport import Deferred

    answers: list = []
    pool, index, tiers = make(tmp_path, answers)
    try:
        keys = on_disk_only(tiers, index, pool, 3)
        disk = tiers.tiers[0]
        read_done = threading.Event()
        original = disk._read_one

        def read_one(ref, buf):
            ok = original(ref, buf)
            if ref.key == keys[-1]:
                read_done.set()
            return ok

        disk._read_one = read_one
        assert tiers.lookup("a", [("", keys)], time.monotonic()) is not None
        settle(tiers, lambda: tiers.book.open[0].state is ReadState.FILLING)  # probed, slots placed
        assert read_done.wait(10)  # every chunk read into its slot
        deadline = time.monotonic() + 10
        while not tiers._posted:  # the fill's outcome waits for the loop
            assert time.monotonic() < deadline
            time.sleep(0.01)
        tiers.clear(Deferred(), "", removed=0)
        settle(tiers, lambda: len(answers) == 2)
        lookup = next(a for a in answers if not hasattr(a, "tiers"))
        cleared = next(a for a in answers if hasattr(a, "tiers"))
        assert lookup[0].num_hits == 0
        assert index.stats().chunks == 0
        assert cleared.tiers == {"disk": 3}
        assert disk.stats().objects == 0
        index.check()
    finally:
        tiers.close()
