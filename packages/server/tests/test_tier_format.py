"""The object format below RAM: a header that names the chunk, and checksums that catch any changed byte."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdepot.core import slot_digest
from kvdepot.server import CorruptObjectError, TierConfigError, UnknownFormatError
from kvdepot.server._tier_format import (
    FIXED_HEADER_BYTES,
    FORMAT_VERSION,
    MAX_FINGERPRINT_BYTES,
    encode_header,
    parse_header,
    verify,
)

DIGEST = slot_digest("salt", b"key")


def _object(payload: bytes, fingerprint: bytes = b"fp", digest: bytes = DIGEST) -> bytes:
    return encode_header(digest, fingerprint, payload) + payload


def _verify(obj: bytes, *, fingerprint: bytes = b"fp", length: int, digest: bytes = DIGEST) -> None:
    start = FIXED_HEADER_BYTES + len(fingerprint)
    verify(obj, obj[start:], digest=digest, fingerprint=fingerprint, length=length)


def test_round_trip():
    """A header parses back to what was encoded, and the whole object verifies."""
    payload = bytes(range(256)) * 17
    obj = _object(payload)
    header = parse_header(obj)
    assert header.digest == DIGEST
    assert header.fingerprint == b"fp"
    assert header.length == len(payload)
    assert header.size == FIXED_HEADER_BYTES + 2
    assert header.object_size == len(obj)
    _verify(obj, length=len(payload))


def test_empty_fingerprint_and_payload():
    """An empty fingerprint and an empty payload are valid objects."""
    obj = _object(b"", fingerprint=b"")
    assert len(obj) == FIXED_HEADER_BYTES
    _verify(obj, fingerprint=b"", length=0)


@settings(max_examples=300, deadline=None)
@given(
    payload=st.binary(min_size=1, max_size=2048),
    fingerprint=st.binary(max_size=40),
    data=st.data(),
)
def test_any_flipped_byte_is_detected(payload, fingerprint, data):
    """Changing any byte of the header or the payload (any bit pattern) makes verification fail:
    corruption, or where the version field now names a version this build does not know, an
    unknown format (never served either, but left in place: it cannot be told from a newer build's)."""
    obj = bytearray(_object(payload, fingerprint))
    position = data.draw(st.integers(0, len(obj) - 1), label="position")
    flip = data.draw(st.integers(1, 255), label="xor")
    obj[position] ^= flip
    with pytest.raises((CorruptObjectError, UnknownFormatError)) as info:
        _verify(bytes(obj), fingerprint=fingerprint, length=len(payload))
    assert isinstance(info.value, CorruptObjectError) or position in (4, 5)


@settings(max_examples=100, deadline=None)
@given(payload=st.binary(max_size=512), cut=st.integers(min_value=1, max_value=600))
def test_truncated_object_is_detected(payload, cut):
    """An object cut short anywhere (a torn write) never verifies."""
    obj = _object(payload)
    cut = min(cut, len(obj))
    with pytest.raises(CorruptObjectError):
        _verify(obj[: len(obj) - cut], length=len(payload))


def test_other_chunk_fingerprint_or_length_is_a_mismatch():
    """An intact object of another chunk (another salt), fingerprint or length is refused, with the reason."""
    payload = b"x" * 100
    obj = _object(payload)
    other_salt = slot_digest("other", b"key")
    with pytest.raises(CorruptObjectError) as info:
        _verify(obj, length=100, digest=other_salt)
    assert info.value.reason == "digest"
    with pytest.raises(CorruptObjectError) as info:
        verify(obj, obj[FIXED_HEADER_BYTES + 2 :], digest=DIGEST, fingerprint=b"fq", length=100)
    assert info.value.reason == "fingerprint"
    with pytest.raises(CorruptObjectError) as info:
        _verify(obj, length=99)
    assert info.value.reason == "length"


def test_garbage_is_corrupt_and_a_future_version_unknown():
    """Bytes that are not an object are corrupt, not a crash; an object of a future format
    version is an unknown format (never corrupt: a newer build reads it), short or not."""
    for junk in (b"", b"KVDT", b"\0" * 200, b"hello world" * 10):
        with pytest.raises(CorruptObjectError):
            parse_header(junk)
    obj = bytearray(_object(b"abc"))
    obj[4] = FORMAT_VERSION + 1
    for data in (obj, obj[:6]):
        with pytest.raises(UnknownFormatError) as info:
            parse_header(data)
        assert (info.value.reason, info.value.version) == ("version", FORMAT_VERSION + 1)


def test_bad_arguments_are_typed_errors():
    """A digest of the wrong size or an overlong fingerprint is the caller's error (TierConfigError)."""
    with pytest.raises(TierConfigError):
        encode_header(b"short", b"", b"x")
    with pytest.raises(TierConfigError):
        encode_header(DIGEST, b"f" * (MAX_FINGERPRINT_BYTES + 1), b"x")


def test_header_accepts_memoryviews():
    """Payloads given as memoryviews (pool slots) encode and verify like bytes."""
    payload = bytearray(b"abc" * 1000)
    header = encode_header(DIGEST, b"", memoryview(payload))
    verify(header, memoryview(payload), digest=DIGEST, fingerprint=b"", length=len(payload))
