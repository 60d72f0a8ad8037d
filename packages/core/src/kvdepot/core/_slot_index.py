"""The pool's index of committed chunks, in shared memory: where a chunk lies, found without a
round trip to the server.

The server writes it (one writer); engines on the node read it, so that a lookup is answered
in the scheduling pass that asks instead of when the server next gets a core. An entry is a
hint: a reader that finds a chunk here still checks the slot's own header (`_slots.py`) before
and after it copies, so an entry that is stale by the time of the copy costs a failed load
(recomputed), never wrong bytes. A chunk missing from the index (its group was full) is found
by the server's reply instead.

Layout: ``entries`` entries of `INDEX_ENTRY_BYTES`, in groups of `INDEX_WAYS` (a chunk's group
is picked by its digest's first 8 bytes). Each entry, little endian::

    0   sequence  u64      odd while the server writes the entry, even otherwise
    8   offset    u64      the pool offset of the chunk's first byte (after its slot header)
    16  length    u64      the chunk's length in bytes (0: the entry is empty)
    24  digest    32 bytes `slot_digest(salt, key)` of the chunk

An entry changes only between an odd and an even sequence (one aligned 8-byte write each); a
reader takes an entry only when its sequence is even and the same before and after the read.
"""

from __future__ import annotations

import struct

#: Bytes of one entry: a cache line.
INDEX_ENTRY_BYTES = 64
#: Entries a chunk may take, the first free one of its group (1 KiB).
INDEX_WAYS = 16
#: The fewest and the most entries of an index (`index_entries`): 64 KiB to 128 MiB.
MIN_INDEX_ENTRIES = 1024
MAX_INDEX_ENTRIES = 1 << 21

_SEQ = struct.Struct("<Q")
_BODY = struct.Struct("<QQ32s")
_DIGEST_AT = 24


def index_entries(pool_size: int, min_slot: int = 32 << 10) -> int:
    """Entries of the index of a pool of ``pool_size`` bytes: four per slot of ``min_slot``
    bytes, a power of two, within `MIN_INDEX_ENTRIES` and `MAX_INDEX_ENTRIES`. A quarter full at
    most, a group of `INDEX_WAYS` overflows about once in a million chunks."""
    want = max(MIN_INDEX_ENTRIES, 4 * (pool_size // max(min_slot, 1)))
    return min(MAX_INDEX_ENTRIES, 1 << (want - 1).bit_length())


def _group(digest: bytes, entries: int) -> int:
    """The first entry of ``digest``'s group."""
    return (int.from_bytes(digest[:8], "little") & (entries - 1)) & ~(INDEX_WAYS - 1)


class SlotIndexWriter:
    """The server's side: adds a chunk when it is committed, removes it when its slot is freed.

    ``buffer``: the index's shared memory, a multiple of `INDEX_ENTRY_BYTES` times a power of two
    entries (`index_entries`), zeroed (every entry empty).
    """

    def __init__(self, buffer: memoryview) -> None:
        entries = len(buffer) // INDEX_ENTRY_BYTES
        if entries < INDEX_WAYS or entries & (entries - 1) or len(buffer) % INDEX_ENTRY_BYTES:
            raise ValueError(f"an index takes a power of two entries of {INDEX_ENTRY_BYTES} bytes, not {len(buffer)}")
        self._buf = buffer
        self._words = buffer.cast("Q")
        self.entries = entries
        #: Chunks not added because their group was full (the server's reply finds them).
        self.dropped = 0

    def add(self, digest: bytes, offset: int, length: int) -> bool:
        """Index a committed chunk; False when its group is full."""
        first = _group(digest, self.entries)
        free = None
        for entry in range(first, first + INDEX_WAYS):
            got_offset, got_length, got_digest = _BODY.unpack_from(self._buf, entry * INDEX_ENTRY_BYTES + 8)
            if got_length and got_digest == digest and got_offset == offset:
                return True
            if not got_length and free is None:
                free = entry
        if free is None:
            self.dropped += 1
            return False
        self._write(free, offset, length, digest)
        return True

    def remove(self, digest: bytes, offset: int) -> None:
        """Take a chunk out (its slot was freed), if it is in."""
        first = _group(digest, self.entries)
        for entry in range(first, first + INDEX_WAYS):
            got_offset, got_length, got_digest = _BODY.unpack_from(self._buf, entry * INDEX_ENTRY_BYTES + 8)
            if got_length and got_digest == digest and got_offset == offset:
                self._write(entry, 0, 0, bytes(32))

    def _write(self, entry: int, offset: int, length: int, digest: bytes) -> None:
        word = entry * INDEX_ENTRY_BYTES // 8
        self._words[word] += 1  # odd: being written
        _BODY.pack_into(self._buf, entry * INDEX_ENTRY_BYTES + 8, offset, length, digest)
        self._words[word] += 1  # even: done

    def close(self) -> None:
        """Let go of the shared memory (before its mapping closes)."""
        self._words.release()
        self._buf.release()


def find_in_index(buffer: bytes | memoryview, digest: bytes) -> tuple[int, int] | None:
    """Where the chunk with ``digest`` lies, (pool offset, length), if the index holds it;
    None when it does not, or its entry was being written (the reader then asks the server)."""
    entries = len(buffer) // INDEX_ENTRY_BYTES
    if entries < INDEX_WAYS or entries & (entries - 1):
        return None
    first = _group(digest, entries)
    start = first * INDEX_ENTRY_BYTES
    group = bytes(buffer[start : start + INDEX_WAYS * INDEX_ENTRY_BYTES])
    found = group.find(digest)
    while found >= 0 and found % INDEX_ENTRY_BYTES != _DIGEST_AT:
        found = group.find(digest, found + 1)
    if found < 0:
        return None
    at = start + found - _DIGEST_AT  # read again in the seqlock's order: sequence, body, sequence
    (seq,) = _SEQ.unpack_from(buffer, at)
    offset, length, got_digest = _BODY.unpack_from(buffer, at + 8)
    if seq % 2 or not length or got_digest != digest or _SEQ.unpack_from(buffer, at)[0] != seq:
        return None  # emptied, or the server was writing it
    return offset, length
