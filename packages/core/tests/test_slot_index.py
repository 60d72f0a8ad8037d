"""The slot index: what the server adds and removes is what a reader finds, and a reader never
takes an entry the server is writing."""

from __future__ import annotations

import hashlib
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvdepot.core import INDEX_ENTRY_BYTES, SlotIndexWriter, find_in_index, index_entries
from kvdepot.core._slot_index import INDEX_WAYS, MAX_INDEX_ENTRIES, MIN_INDEX_ENTRIES


def digest(n: int) -> bytes:
    return hashlib.sha256(n.to_bytes(4, "little")).digest()


def index(entries: int = MIN_INDEX_ENTRIES) -> tuple[bytearray, SlotIndexWriter]:
    buffer = bytearray(entries * INDEX_ENTRY_BYTES)
    return buffer, SlotIndexWriter(memoryview(buffer))


ops = st.lists(st.tuples(st.booleans(), st.integers(0, 40), st.integers(0, 3)), max_size=200)


@given(ops=ops)
def test_a_reader_finds_exactly_what_was_added_and_not_removed(ops):
    """Against a dict of the chunks committed: each is found at its offset and length, and nothing
    else is (a chunk moved to another slot is found at the new one once the old one is freed)."""
    buffer, writer = index()
    held: dict[bytes, int] = {}
    for add, n, slot in ops:
        d = digest(n)
        if add and d not in held:
            assert writer.add(d, slot * 4096 + 64, 1000 + n)
            held[d] = slot * 4096 + 64
        elif not add and d in held:
            writer.remove(d, held.pop(d))
    for n in range(41):
        d = digest(n)
        assert find_in_index(buffer, d) == ((held[d], 1000 + n) if d in held else None)
    writer.close()


def test_a_full_group_drops_the_chunk_and_counts_it():
    """Past `INDEX_WAYS` chunks of one group the next is not indexed (the server's reply finds it)."""
    buffer, writer = index()
    same_group = [bytes(8) + digest(n)[8:] for n in range(INDEX_WAYS + 1)]  # first 8 bytes pick the group
    for i, d in enumerate(same_group[:-1]):
        assert writer.add(d, 64 * (i + 1), 10)
    assert not writer.add(same_group[-1], 64 * 99, 10)
    assert writer.dropped == 1
    assert find_in_index(buffer, same_group[-1]) is None
    writer.remove(same_group[0], 64)
    assert writer.add(same_group[-1], 64 * 99, 10)  # room again
    assert find_in_index(buffer, same_group[-1]) == (64 * 99, 10)
    writer.close()


def test_an_entry_being_written_is_not_taken():
    """An odd sequence (the server is between its two writes) reads as not indexed."""
    buffer, writer = index()
    d = digest(7)
    writer.add(d, 128, 10)
    entry = next(e for e in range(MIN_INDEX_ENTRIES) if buffer[e * 64 + 24 : e * 64 + 56] == d)
    (seq,) = struct.unpack_from("<Q", buffer, entry * 64)
    struct.pack_into("<Q", buffer, entry * 64, seq + 1)
    assert find_in_index(buffer, d) is None
    struct.pack_into("<Q", buffer, entry * 64, seq + 2)
    assert find_in_index(buffer, d) == (128, 10)
    writer.close()


def test_a_digest_found_across_two_entries_is_not_a_hit():
    """Only a digest at an entry's digest field counts, not bytes that happen to span fields."""
    buffer, writer = index()
    d = digest(3)
    assert find_in_index(buffer, d) is None
    first = (int.from_bytes(d[:8], "little") & (MIN_INDEX_ENTRIES - 1)) & ~(INDEX_WAYS - 1)
    buffer[first * 64 + 8 : first * 64 + 40] = d  # in the offset/length fields, not the digest's
    assert find_in_index(buffer, d) is None
    writer.close()


@pytest.mark.parametrize(
    ("pool", "entries"),
    [(0, MIN_INDEX_ENTRIES), (1 << 30, 1 << 17), (100 << 30, MAX_INDEX_ENTRIES)],
)
def test_the_index_is_sized_from_the_pool(pool, entries):
    assert index_entries(pool) == entries


def test_a_buffer_that_is_not_an_index_is_refused_and_never_read_past():
    with pytest.raises(ValueError, match="power of two"):
        SlotIndexWriter(memoryview(bytearray(3 * INDEX_ENTRY_BYTES * INDEX_WAYS)))
    assert find_in_index(bytearray(100), digest(1)) is None
