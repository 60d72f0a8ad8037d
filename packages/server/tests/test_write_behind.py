"""Write-behind: submit never blocks, a full queue drops and counts, every accepted item is reported once."""

from __future__ import annotations

import threading
import time

import pytest

from kvdepot.server import ChunkRef, ChunkWrite, DeferredWrite, DiskTier, TierState, TierStats, WriteBehind


class FakeTier:
    """An in-memory tier whose writes can be held back or made to fail (a unit-test double)."""

    kind = "fake"

    def __init__(self) -> None:
        self.objects: dict[tuple[str, bytes], bytes] = {}
        self.gate = threading.Event()
        self.gate.set()
        self.fail = False
        self.raise_error = False
        self.batches: list[int] = []

    def write(self, items):
        self.gate.wait(10)
        self.batches.append(len(items))
        if self.raise_error:
            raise RuntimeError("boom")
        if self.fail:
            return [False] * len(items)
        for item in items:
            self.objects[(item.salt, item.key)] = bytes(item.payload)
        return [True] * len(items)

    def read(self, refs, into, *, timeout=None):
        return [False] * len(refs)

    def lengths(self, refs, *, timeout=None):
        return [len(v) if (v := self.objects.get((r.salt, r.key))) is not None else None for r in refs]

    def stats(self):
        return TierStats("fake", TierState.UP, None, None, None, *([0] * 11))

    def close(self):
        pass


def item(i: int, size: int = 100) -> ChunkWrite:
    return ChunkWrite("s", b"k%d" % i, bytes([i % 256]) * size)


@pytest.fixture
def fake():
    return FakeTier()


def test_writes_reach_the_tier_in_batches(fake):
    """Submitted chunks are all written, in batches no larger than asked, and reported done."""
    done: list[tuple[bytes, bool]] = []
    wb = WriteBehind(fake, batch_items=4, on_done=lambda it, ok: done.append((it.key, ok)))
    fake.gate.clear()
    assert wb.submit([item(i) for i in range(10)]) == 10
    fake.gate.set()
    assert wb.flush(5)
    assert len(fake.objects) == 10
    assert max(fake.batches) <= 4
    assert sorted(done) == sorted((b"k%d" % i, True) for i in range(10))
    s = wb.stats()
    assert (s.submitted, s.written, s.failed, s.dropped, s.depth, s.queued_bytes) == (10, 10, 0, 0, 0, 0)
    wb.close()


def test_submit_never_blocks_and_drops_when_full(fake):
    """With the tier stuck, every submit returns without waiting for it; past the bound, items are
    dropped and counted."""
    fake.gate.clear()
    wb = WriteBehind(fake, max_items=5, batch_items=1)
    results: list[int] = []
    submitter = threading.Thread(target=lambda: results.extend(wb.submit([item(i)]) for i in range(50)))
    submitter.start()
    submitter.join(10)  # a hang guard: a submit that waited for room would wait for the gate below
    assert not submitter.is_alive(), "submit blocked on a stuck tier"
    assert not fake.objects  # nothing was written: no room was made meanwhile
    accepted = sum(results)
    assert accepted <= 6  # 5 queued, and perhaps one the worker already holds
    assert wb.stats().dropped == 50 - accepted
    assert wb.depth <= 5
    fake.gate.set()
    assert wb.flush(5)
    assert len(fake.objects) == accepted
    wb.close()


def test_one_salt_leaves_a_share_of_the_queue_to_the_others(fake):
    """A tenant that commits a burst fills at most SALT_SHARE of the queue (items and bytes); the
    rest takes other tenants' chunks, which would otherwise all be dropped behind the burst."""
    fake.gate.clear()
    wb = WriteBehind(fake, max_items=8, max_bytes=8000, batch_items=1)
    wb.submit([ChunkWrite("held", b"h", b"x")])  # the worker takes it and waits at the gate
    time.sleep(0.05)
    burst = [ChunkWrite("a", b"a%d" % i, b"a" * 100) for i in range(20)]
    assert wb.submit(burst) == 6  # 3/4 of 8
    assert wb.submit([ChunkWrite("b", b"b%d" % i, b"b" * 100) for i in range(4)]) == 2  # the queue is full
    assert wb.submit([ChunkWrite("c", b"c", b"c" * 7000)]) == 0  # past the byte bound
    fake.gate.set()
    assert wb.flush(5)
    assert sum(1 for salt, _ in fake.objects if salt == "b") == 2
    assert wb.submit([ChunkWrite("c", b"c", b"c" * 5000)]) == 1  # within its share once the queue drained
    assert wb.submit([ChunkWrite("c", b"c2", b"c" * 1500)]) == 0  # past 3/4 of the bytes for one salt
    fake.gate.set()
    wb.close(drain=True)


def test_byte_bound(fake):
    """The queue also holds at most max_bytes of payload."""
    fake.gate.clear()
    wb = WriteBehind(fake, max_bytes=1000, batch_items=1)
    wb.submit([item(0, 10)])  # the worker takes it and waits at the gate
    time.sleep(0.05)
    assert wb.submit([ChunkWrite(f"s{i}", b"k", b"x" * 400) for i in range(1, 5)]) == 2  # salts of their own
    assert wb.stats().queued_bytes == 800
    fake.gate.set()
    wb.close(drain=True)


def test_deferred_payload_is_loaded_on_the_worker(fake):
    """A DeferredWrite's load runs on the worker thread; None skips the chunk."""
    threads: list[str] = []

    def load():
        threads.append(threading.current_thread().name)
        return b"late bytes"

    done: list[bool] = []
    wb = WriteBehind(fake, on_done=lambda it, ok: done.append(ok))
    wb.submit([DeferredWrite("s", b"a", 10, load), DeferredWrite("s", b"gone", 10, lambda: None)])
    assert wb.flush(5)
    assert fake.objects == {("s", b"a"): b"late bytes"}
    assert threads == ["kvdepot-write-behind-fake"]
    assert sorted(done) == [False, True]
    assert wb.stats().skipped == 1
    wb.close()


def test_failures_and_exceptions_are_reported_not_raised(fake):
    """A tier that fails or raises makes items done with ok=False; the worker keeps going."""
    done: list[bool] = []
    wb = WriteBehind(fake, on_done=lambda it, ok: done.append(ok))
    fake.fail = True
    wb.submit([item(1)])
    assert wb.flush(5)
    fake.fail, fake.raise_error = False, True
    wb.submit([item(2)])
    assert wb.flush(5)
    fake.raise_error = False
    wb.submit([item(3)])
    assert wb.flush(5)
    assert done == [False, False, True]
    assert wb.stats().failed == 2
    wb.close()


def test_close_without_drain_fails_what_is_queued(fake):
    """close() reports queued items as not written and refuses new ones."""
    fake.gate.clear()
    done: list[bool] = []
    wb = WriteBehind(fake, batch_items=1, on_done=lambda it, ok: done.append(ok))
    wb.submit([item(i) for i in range(4)])
    time.sleep(0.05)
    closer = threading.Thread(target=wb.close)
    closer.start()
    time.sleep(0.05)
    fake.gate.set()
    closer.join(5)
    assert len(done) == 4
    assert done.count(False) >= 3
    assert wb.submit([item(9)]) == 0


def test_with_a_real_disk_tier(tmp_path):
    """Write-behind into a DiskTier: after flush every chunk reads back."""
    with DiskTier(tmp_path / "d", 1 << 20) as tier:
        wb = WriteBehind(tier)
        wb.submit([item(i, 1000) for i in range(8)])
        assert wb.flush(10)
        bufs = [memoryview(bytearray(1000)) for _ in range(8)]
        assert tier.read([ChunkRef("s", b"k%d" % i, b"", 1000) for i in range(8)], bufs) == [True] * 8
        wb.close()


def test_a_clear_takes_its_salts_writes_off_the_queue_and_runs_after_the_batch_under_way(fake):
    """`discard` hands back the queued writes of one salt unwritten; a job given to `call` runs on
    the worker after the batch it is writing, before the writes still queued."""
    fake.gate.clear()  # the worker holds its first batch
    order: list[str] = []
    wb = WriteBehind(fake, batch_items=1, on_done=lambda item, ok: order.append(f"{item.salt}{item.key.decode()}"))
    try:
        other = [ChunkWrite("t", b"k%d" % i, b"x" * 10) for i in range(2)]
        assert wb.submit([item(0), item(1), other[0], item(2), other[1]]) == 5
        time.sleep(0.05)  # let the worker take item 0
        gone = wb.discard("s")
        assert [g.key for g in gone] == [b"k1", b"k2"]  # k0 is under way
        assert wb.call(lambda: order.append("job"))
        fake.gate.set()
        assert wb.flush(10)
        assert order == ["sk0", "job", "tk0", "tk1"]
        assert set(fake.objects) == {("s", b"k0"), ("t", b"k0"), ("t", b"k1")}
        assert wb.stats().discarded == 2
        assert wb.discard(None) == []
    finally:
        wb.close()
    assert not wb.call(lambda: None)


def test_writes_submitted_first_go_ahead_of_the_queue_in_their_own_order(fake):
    """A handoff's chunks (submitted `first`) are written before what was queued earlier, in the
    order they came; a clear of their salt keeps the rest's order."""
    fake.gate.clear()
    order: list[bytes] = []
    wb = WriteBehind(fake, batch_items=1, on_done=lambda item, ok: order.append(item.key))
    try:
        assert wb.submit([item(0)]) == 1  # taken by the worker at once, then held at the gate
        time.sleep(0.05)
        assert wb.submit([item(1), item(2)]) == 2
        for i in (3, 4):
            assert wb.submit([ChunkWrite("h", b"k%d" % i, b"x" * 10)], first=True) == 1
        assert wb.submit([item(5)], first=True) == 1
        assert [g.key for g in wb.discard("h")] == [b"k3", b"k4"]
        assert wb.submit([ChunkWrite("h", b"k6", b"x")], first=True) == 1
        fake.gate.set()
        assert wb.flush(10)
        assert order == [b"k0", b"k5", b"k6", b"k1", b"k2"]
    finally:
        wb.close()
