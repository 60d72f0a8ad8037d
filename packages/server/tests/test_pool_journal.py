"""The kept pool's journal and the allocator's adoption, on a pool in a bytearray."""

from __future__ import annotations

import pytest

from kvdepot.core import SLOT_HEADER_BYTES
from kvdepot.server import _pool_journal
from kvdepot.server._adopt import adopt
from kvdepot.server._index import ADOPTED_CLIENT, ChunkIndex
from kvdepot.server._pool import SlotHeaders
from kvdepot.server._pool_journal import COMMITTED, JournalHeader, PoolJournal, read_journal
from kvdepot.server._slabs import SlabAllocator

PAGE = 64 * 1024
CAPACITY = 16 * PAGE
CHUNK = 4096 - SLOT_HEADER_BYTES


def _key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


class Pool:
    """An index over a pool in memory, its slots journaled to `path`."""

    def __init__(self, path, records=None, generation=1) -> None:
        self.buffer = bytearray(CAPACITY)
        self.path = path
        self.open(records or [], generation)

    def open(self, records, generation) -> None:
        self.headers = SlotHeaders(memoryview(self.buffer))
        self.index = ChunkIndex(SlabAllocator(CAPACITY, PAGE), headers=self.headers)
        self.adoption, taken = adopt(self.index, memoryview(self.buffer), records, 0.0)
        self.journal = PoolJournal(self.path, JournalHeader(CAPACITY, PAGE, "ipc:///x"), memoryview(self.buffer), taken)
        self.headers.follow(self.journal, generation)

    def store(self, salt: str, keys: list[bytes], fill: int = 0) -> None:
        self.index.register("c", CHUNK, 0.0)
        res = self.index.reserve("c", salt, keys, CHUNK, 0.0)
        for index, offset, length in res.slots:
            self.buffer[offset : offset + length] = bytes([(index + fill) % 251 + 1]) * length
        self.index.commit("c", res.reservation_id, None, 0.0)

    def restart(self) -> None:
        """As a kill would: the journal's thread drains, nothing else is closed."""
        self.journal.close()
        contents = read_journal(self.path)
        self.open(contents.records, contents.max_generation + 2)


def test_allocator_adopts_slots_and_refuses_what_cannot_be_one():
    allocator = SlabAllocator(4 * PAGE, PAGE)
    got = allocator.adopt(
        [
            (0, 4096),  # page 0 becomes the 4 KiB class
            (4096, 4096),
            (4096, 4096),  # taken already
            (8192, 8192),  # another class on page 0
            (PAGE + 100, 4096),  # not a slot start
            (2 * PAGE, 8192),  # page 2 of the 8 KiB class
            (9 * PAGE, 4096),  # outside
        ]
    )
    assert got == [True, True, False, False, False, True, False]
    assert allocator.used_bytes == 2 * 4096 + 8192
    assert allocator.free_pages == 2
    allocator.check()
    # What was left free is handed out as usual, never an adopted slot.
    handed = {allocator.allocate(4096) for _ in range(PAGE // 4096 - 2)}
    assert not handed & {0, 4096}
    allocator.check()


def test_a_restart_adopts_committed_chunks_in_their_order(tmp_path):
    pool = Pool(tmp_path / "j")
    pool.store("a", [_key(i) for i in range(5)])
    pool.store("b", [_key(i) for i in range(3)], fill=7)
    pool.restart()
    assert pool.adoption.chunks == 8
    assert pool.adoption.bytes == 8 * CHUNK
    assert pool.index.stats().salt_chunks == {"a": 5, "b": 3}
    pool.index.check()
    assert all(e.owner == ADOPTED_CLIENT for e in pool.index.chunks.entries.values())
    # The oldest (a's, stored first) goes first when the pool is full.
    assert pool.index.policy.order.oldest_of_size(4096).salt == "a"
    pool.index.register("c", CHUNK, 0.0)
    (outcome,) = pool.index.lookup("c", [("a", [_key(i) for i in range(5)])], 0.0)
    assert outcome.num_hits == 5


def test_a_freed_slot_is_not_adopted(tmp_path):
    pool = Pool(tmp_path / "j")
    pool.store("a", [_key(i) for i in range(3)])
    assert pool.index.clear("a")[0] == 3
    pool.store("a", [_key(9)])
    pool.restart()
    assert pool.adoption.chunks == 1
    assert pool.adoption.dropped.get("moved_on", 0) >= 2  # the slot of key 9 may be one of theirs


def test_a_torn_record_ends_the_journal(tmp_path):
    pool = Pool(tmp_path / "j")
    pool.store("a", [_key(1)])
    pool.store("a", [_key(2)])
    pool.journal.close()
    data = (tmp_path / "j").read_bytes()
    (tmp_path / "j").write_bytes(data[:-3])
    records = read_journal(tmp_path / "j").records
    assert [r.key for r in records if r.kind == COMMITTED] == [_key(1)]


def test_the_journal_is_compacted_and_keeps_what_is_live(tmp_path, monkeypatch):
    """Past twice its live records, the journal is rewritten with them only; a restart from the
    compacted journal adopts the same chunks."""
    monkeypatch.setattr(_pool_journal, "COMPACT_SLACK", 0)
    pool = Pool(tmp_path / "j")
    for round_ in range(20):  # the same four keys stored, cleared, stored again
        pool.store("a", [_key(i) for i in range(4)], fill=round_)
        if round_ < 19:
            pool.index.clear("a")
    pool.journal.close()
    records = read_journal(tmp_path / "j").records
    assert len(records) < 40, "never compacted"
    contents = read_journal(tmp_path / "j")
    pool.open(contents.records, contents.max_generation + 2)
    assert pool.adoption.chunks == 4
    pool.index.register("c", CHUNK, 0.0)
    (hit,) = pool.index.lookup("c", [("a", [_key(i) for i in range(4)])], 0.0)
    assert hit.num_hits == 4
    assert all(pool.buffer[offset] == 20 + i for i, (offset, _) in enumerate(hit.slots))  # the last round's


@pytest.mark.parametrize("where", ["data", "digest"])
def test_a_changed_slot_is_dropped(tmp_path, where):
    pool = Pool(tmp_path / "j")
    pool.store("a", [_key(1), _key(2)])
    pool.journal.close()
    entry = pool.index.chunks.entries[("a", _key(1))]
    spot = entry.offset + (SLOT_HEADER_BYTES + 5 if where == "data" else 30)
    pool.buffer[spot] ^= 0xFF
    contents = read_journal(tmp_path / "j")
    pool.open(contents.records, contents.max_generation + 2)
    assert pool.adoption.chunks == 1
    assert pool.adoption.dropped == {"checksum" if where == "data" else "header": 1}
