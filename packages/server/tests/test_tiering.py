"""The tiers wired to the index (`TierSet`), without a server process: pins, write-behind, read-through.

The tier is a real `DiskTier` in a temporary directory; the pool is a plain bytearray with real
slot headers; the loop's part (`run`) is called by the test.
"""

from __future__ import annotations

import time

from kvdepot.server import ChunkIndex, DiskTier, SlabAllocator
from kvdepot.server._pool import SlotHeaders
from kvdepot.server._tiering import TierSet

PAGE = 64 * 1024
CHUNK = 4096 - 64  # one 4 KiB slot
SLOTS = 2 * PAGE // 4096


def make(tmp_path, answers: list):
    pool = memoryview(bytearray(2 * PAGE))
    index = ChunkIndex(SlabAllocator(2 * PAGE, PAGE), headers=SlotHeaders(pool), max_client_pending_bytes=2 * PAGE)
    tiers = TierSet(
        [DiskTier(tmp_path / "disk", 1 << 24)],
        index,
        pool,
        wake=lambda: None,
        answer=lambda deferred, body: answers.append(body),
        lookup=index.lookup,
    )
    index.register("a", CHUNK, 0.0)
    tiers.registered(CHUNK)
    return pool, index, tiers


def store(index, pool, client: str, keys: list[bytes]) -> int:
    out = index.reserve(client, "", keys, CHUNK, 0.0)
    for i, offset, length in out.slots:
        pool[offset : offset + length] = keys[i] * (length // len(keys[i]))
    return index.commit(client, out.reservation_id, None, 0.0) if out.reservation_id else 0


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
    pool, index, tiers = make(tmp_path, answers)
    try:
        keys = [bytes([i]) * 32 for i in range(SLOTS)]
        assert store(index, pool, "a", keys) == SLOTS  # the pool is full, every chunk pinned
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
        store(index, pool, "a", keys)
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
    pool, index, tiers = make(tmp_path, answers)
    try:
        index.close_session(TIER_CLIENT)
        assert store(index, pool, "a", [b"\x01" * 32]) == 1
        settle(tiers, lambda: tiers.tiers[0].stats().objects == 1 and index.stats().leased_chunks == 0)
        index.check()
    finally:
        tiers.close()
