"""The slot header: it holds for exactly the chunk, length and committed state it was written for."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvdepot.core import SLOT_HEADER_BYTES, pack_slot_header, slot_digest, slot_header_holds

salts = st.text(max_size=8)
keys = st.binary(min_size=1, max_size=64)
lengths = st.integers(1, 2**40)


@given(salt=salts, key=keys, length=lengths, generation=st.integers(0, 2**62))
def test_a_header_holds_only_its_own_committed_chunk(salt, key, length, generation):
    """Even generation, same digest and length: holds; an odd generation (being written or free) never does."""
    raw = pack_slot_header(generation, length, slot_digest(salt, key))
    assert len(raw) == SLOT_HEADER_BYTES
    assert slot_header_holds(raw, slot_digest(salt, key), length) == (generation % 2 == 0)
    assert not slot_header_holds(raw, slot_digest(salt, key), length + 1)
    assert not slot_header_holds(raw[:-1], slot_digest(salt, key), length)
    assert not slot_header_holds(b"\0" * 8 + raw[8:], slot_digest(salt, key), length)  # no magic


@given(a=st.tuples(salts, keys), b=st.tuples(salts, keys))
def test_digests_differ_for_every_other_salt_or_key(a, b):
    """The digest names (salt, key) without ambiguity: the salt's length is part of it."""
    assert (slot_digest(*a) == slot_digest(*b)) == (a == b)


def test_salt_and_key_bytes_do_not_run_together():
    """Moving bytes between the salt and the key gives another digest."""
    assert slot_digest("ab", b"c") != slot_digest("a", b"bc")


@pytest.mark.parametrize("salt", ["", "tenant-a", "ünïcode-salt", "x" * 5000])
def test_the_digest_is_blake2b_of_the_salts_length_the_salt_and_the_key(salt):
    """The digest per key reuses the salt's hashed prefix: it must equal the definition, for each
    salt, and for one salt asked again after others (the prefix is never shared across salts)."""
    import hashlib
    import struct

    def definition(salt: str, key: bytes) -> bytes:
        raw = salt.encode()
        data = struct.pack("<I", len(raw)) + raw + key
        return hashlib.blake2b(data, digest_size=32, person=b"kvdepot-slot-v1").digest()

    for key in (b"\x00" * 32, bytes(range(32))):
        assert slot_digest(salt, key) == definition(salt, key)
        assert slot_digest("other", key) != slot_digest(salt, key)
        assert slot_digest(salt, key) == definition(salt, key)


def test_unpack_slot_header_reads_a_header_and_refuses_what_is_not_one():
    from kvdepot.core import unpack_slot_header

    digest = slot_digest("salt", b"k" * 32)
    header = pack_slot_header(6, 4096, digest)
    assert unpack_slot_header(header) == (6, 4096, digest)
    assert unpack_slot_header(b"x" + header[1:]) is None  # not the magic
    assert unpack_slot_header(header[:-1]) is None  # not a header's size
