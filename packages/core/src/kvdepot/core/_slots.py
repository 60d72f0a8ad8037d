"""The header in front of every slot of the pool: what the slot holds, as a seqlock.

The server writes a slot's header; a reader checks it before and after copying the slot,
so a slot that was evicted and reused while a late or expired lease read it is caught,
whatever the timing. ``SLOT_HEADER_BYTES`` bytes just before the slot's first byte, little
endian::

    0   magic       8 bytes  b"kvdslot1"
    8   generation  u64      odd while the slot is being written or is free, even once committed
    16  length      u64      the chunk's length in bytes
    24  digest      32 bytes `slot_digest(salt, key)` of the chunk it holds
    56  (zero)      8 bytes

Every change of a slot's content goes through a new generation, and the server stores the
generation with one aligned 8-byte write: first an odd one (then the rest of the header), and
an even one only at commit. A reader takes a copy as good only when the header before the
copy names the chunk it wants with an even generation, and the header after the copy is the
same bytes.
"""

from __future__ import annotations

import functools
import hashlib
import struct

#: Bytes of the header in front of each slot; a multiple of 64 keeps slots cache-line aligned.
SLOT_HEADER_BYTES = 64

_MAGIC = b"kvdslot1"
_HEADER = struct.Struct("<8sQQ32s8x")
_PERSON = b"kvdepot-slot-v1"
#: Byte offset of the generation word inside the header.
SLOT_GENERATION_OFFSET = 8


def slot_digest(salt: str, key: bytes) -> bytes:
    """The 32-byte digest a slot's header holds for chunk ``key`` of ``salt``: BLAKE2b-256 of the
    salt's length (u32, little-endian), the salt and the key."""
    hasher = _salted(salt).copy()
    hasher.update(key)
    return hasher.digest()


@functools.lru_cache(maxsize=1024)
def _salted(salt: str) -> hashlib.blake2b:
    """A BLAKE2b state that has taken the salt's part of every digest of ``salt`` (copied per key:
    a query or a tier probe hashes hundreds of keys of one salt)."""
    salt_bytes = salt.encode()
    return hashlib.blake2b(struct.pack("<I", len(salt_bytes)) + salt_bytes, digest_size=32, person=_PERSON)


def pack_slot_header(generation: int, length: int, digest: bytes) -> bytes:
    """The header's bytes (for the server, and for tests that forge one)."""
    return _HEADER.pack(_MAGIC, generation, length, digest)


def unpack_slot_header(header: bytes | memoryview) -> tuple[int, int, bytes] | None:
    """(generation, length, digest) of a slot's header, or None when it is not one (its size or
    magic): for a reader that must tell a slot that moved on from one that was damaged."""
    if len(header) != SLOT_HEADER_BYTES:
        return None
    magic, generation, length, digest = _HEADER.unpack(header)
    return (generation, length, digest) if magic == _MAGIC else None


def slot_header_holds(header: bytes | memoryview, digest: bytes, length: int) -> bool:
    """True when ``header`` says its slot holds a committed chunk of ``length`` bytes with
    ``digest`` (`slot_digest`)."""
    if len(header) != SLOT_HEADER_BYTES:
        return False
    magic, generation, got_length, got_digest = _HEADER.unpack(header)
    return bool(magic == _MAGIC and generation % 2 == 0 and got_length == length and got_digest == digest)
