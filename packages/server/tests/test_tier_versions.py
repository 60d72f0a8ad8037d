"""Format versions below RAM (`_tier_format`): a tier reads the versions it knows, never deletes
an object of a version it does not know (a miss, counted ``unknown_format``), and still deletes
a corrupt object of a version it knows. The remote tier against a real Valkey, the disk tier on
real files. Objects of other builds are crafted here byte by byte (a header of another version,
otherwise valid), or written by a tier whose module says it is one version ahead.
"""

from __future__ import annotations

import contextlib
import struct

import pytest
import xxhash

from kvdepot.core import slot_digest
from kvdepot.server import (
    ChunkRef,
    ChunkWrite,
    CorruptObjectError,
    DiskTier,
    RemoteTier,
    UnknownFormatError,
    object_name,
)
from kvdepot.server import _tier_format as tier_format
from kvdepot.server._tier_format import FIXED_HEADER_BYTES, FORMAT_VERSION, verify
from kvdepot.server._tiers import SALT_TAG_BYTES, salt_tag

CHUNK = 4096
FUTURE = FORMAT_VERSION + 1
FAST = {"retry_interval": 0.1, "op_timeout": 0.5, "connect_timeout": 0.3}
# A disk object: the header with the salt tag and the fingerprint b"fp", then the payload.
OBJECT = FIXED_HEADER_BYTES + SALT_TAG_BYTES + 2 + CHUNK


def payload(i: int) -> bytes:
    return (i.to_bytes(4, "little") * (CHUNK // 4 + 1))[:CHUNK]


def crafted(version: int, i: int, *, tagged: bool = True, salt: str = "s") -> bytes:
    """Chunk ``b"k%d" % i`` as a build writing format ``version`` would store it: the layout of
    versions 1 and 2, its fingerprint the salt tag and b"fp" (``tagged``: versions 1 of builds
    before the salt tag had b"fp" alone)."""
    body = payload(i)
    fingerprint = (salt_tag(salt) if tagged else b"") + b"fp"
    digest = slot_digest(salt, b"k%d" % i)
    fixed = struct.pack(
        "<4sHHQQ32s", b"KVDT", version, len(fingerprint), len(body), xxhash.xxh3_64_intdigest(body), digest
    )
    check = struct.pack("<Q", xxhash.xxh3_64_intdigest(fixed + fingerprint))
    return fixed + check + fingerprint + body


def flipped(data: bytes, offset: int) -> bytes:
    out = bytearray(data)
    out[offset] ^= 0x01
    return bytes(out)


def writes(*keys: int) -> list[ChunkWrite]:
    return [ChunkWrite("s", b"k%d" % i, payload(i), b"fp") for i in keys]


def read(tier: RemoteTier | DiskTier, *keys: int) -> list[bytes | None]:
    bufs = [bytearray(CHUNK) for _ in keys]
    refs = [ChunkRef("s", b"k%d" % i, b"fp", CHUNK) for i in keys]
    hits = tier.read(refs, [memoryview(b) for b in bufs])
    return [bytes(b) if hit else None for b, hit in zip(bufs, hits, strict=True)]


def key(i: int) -> str:
    return "kvd:" + object_name("s", b"k%d" % i)


@pytest.fixture
def open_tier():
    tiers: list[RemoteTier] = []

    def make(url: str) -> RemoteTier:
        tier = RemoteTier(url, **FAST)
        tiers.append(tier)
        return tier

    yield make
    for tier in tiers:
        tier.close()


def one_version_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make this process a build of the next format: it writes `FUTURE` and reads this one as older."""
    monkeypatch.setattr(tier_format, "OLDER_VERSIONS", frozenset({*tier_format.OLDER_VERSIONS, FORMAT_VERSION}))
    monkeypatch.setattr(tier_format, "FORMAT_VERSION", FUTURE)


def test_the_rule_on_headers():
    """The current version and a version-1 object naming exactly what is asked for verify; a newer
    version, or a version-1 object naming another fingerprint, is an unknown format; damage to a
    version-1 object is corruption."""
    tag = salt_tag("s")
    digest = slot_digest("s", b"k1")

    def check(data: bytes) -> None:
        start = FIXED_HEADER_BYTES + SALT_TAG_BYTES + 2
        verify(data, data[start:], digest=digest, fingerprint=tag + b"fp", length=CHUNK)

    check(crafted(FORMAT_VERSION, 1))
    check(crafted(1, 1))
    for data, reason in ((crafted(FUTURE, 1), "version"), (crafted(FUTURE, 1)[:8], "version")):
        with pytest.raises(UnknownFormatError) as info:
            check(data)
        assert (info.value.reason, info.value.version) == (reason, FUTURE)
    untagged = crafted(1, 1, tagged=False)
    with pytest.raises(UnknownFormatError) as info:
        verify(untagged, untagged[FIXED_HEADER_BYTES + 2 :], digest=digest, fingerprint=tag + b"fp", length=CHUNK)
    assert (info.value.reason, info.value.version) == ("older", 1)
    for version in (1, FORMAT_VERSION):
        with pytest.raises(CorruptObjectError) as corrupt:
            check(flipped(crafted(version, 1), len(crafted(version, 1)) - 1))
        assert corrupt.value.reason == "checksum"


@pytest.mark.integration
def test_rolling_upgrade_neither_build_deletes_the_others_objects(valkey_server, open_tier, monkeypatch):
    """Objects of this format and of the next share one Valkey: this build hits its own and misses
    the next's (counted unknown_format, not corrupt); a tier of the next build hits both (it reads
    this version as older). Every object is still there, byte for byte, after both have read all."""
    today = open_tier(valkey_server.url)
    assert today.write(writes(1, 2, 3)) == [True] * 3
    with contextlib.closing(valkey_server.client()) as plain:
        for i in (4, 5, 6):
            plain.set(key(i), crafted(FUTURE, i))
        before = {i: plain.get(key(i)) for i in range(1, 7)}
        assert read(today, 1, 2, 3, 4, 5, 6) == [payload(1), payload(2), payload(3), None, None, None]
        assert {i: plain.get(key(i)) for i in range(1, 7)} == before  # nothing deleted
        s = today.stats()
        assert (s.hits, s.misses, s.corrupt, s.unknown_format) == (3, 3, 0, 3)

        one_version_ahead(monkeypatch)
        future = open_tier(valkey_server.url)
        assert future.write(writes(7, 8)) == [True, True]
        assert read(future, *range(1, 9)) == [payload(i) for i in range(1, 9)]
        assert (future.stats().corrupt, future.stats().unknown_format) == (0, 0)
        monkeypatch.undo()

        assert read(today, 7, 8, 1) == [None, None, payload(1)]
        assert (today.stats().corrupt, today.stats().unknown_format) == (0, 5)
        assert {i: plain.get(key(i)) for i in range(1, 7)} == before
        assert [struct.unpack_from("<H", plain.get(key(i)), 4)[0] for i in (7, 8)] == [FUTURE, FUTURE]


@pytest.mark.integration
def test_corrupt_objects_of_known_versions_are_still_deleted(valkey_server, open_tier):
    """A flipped byte in an object of this version or of version 1 is corruption: a miss, deleted.
    An intact version-1 object with the salt tag hits; one without it (a build before the tag)
    misses and stays; so does a newer version's object, whatever its bytes (it cannot be checked)."""
    tier = open_tier(valkey_server.url)
    tier.write(writes(1))
    with contextlib.closing(valkey_server.client()) as plain:
        plain.set(key(1), flipped(plain.get(key(1)), FIXED_HEADER_BYTES + SALT_TAG_BYTES + 2 + 100))
        plain.set(key(2), crafted(1, 2))
        plain.set(key(3), flipped(crafted(1, 3), FIXED_HEADER_BYTES + SALT_TAG_BYTES + 2 + 100))
        plain.set(key(4), crafted(1, 4, tagged=False))
        plain.set(key(5), flipped(crafted(FUTURE, 5), FIXED_HEADER_BYTES + SALT_TAG_BYTES + 2 + 100))
        plain.set(key(6), flipped(crafted(1, 6), 20))  # the header's check fails
        assert read(tier, *range(1, 7)) == [None, payload(2), None, None, None, None]
        assert [plain.exists(key(i)) for i in range(1, 7)] == [0, 1, 0, 1, 1, 0]
        s = tier.stats()
        assert (s.corrupt, s.unknown_format, s.hits) == (3, 2, 1)


def test_disk_tier_leaves_an_unknown_format_file_in_place(tmp_path):
    """A file of the next format found at start (a downgrade) is left in place and never served,
    evicted or deleted, and its bytes count against the capacity; a version-1 file with the salt
    tag is served. A clear of every salt removes it."""
    directory = tmp_path / "disk"
    with DiskTier(directory, 8 * OBJECT) as tier:
        assert tier.write(writes(1, 2)) == [True, True]
    newer = directory / "objects" / object_name("s", b"k3")[:2] / object_name("s", b"k3")
    newer.write_bytes(crafted(FUTURE, 3))
    older = directory / "objects" / object_name("s", b"k4")[:2] / object_name("s", b"k4")
    older.write_bytes(crafted(1, 4))
    with DiskTier(directory, 8 * OBJECT) as tier:
        assert newer.read_bytes() == crafted(FUTURE, 3)
        s = tier.stats()
        assert (s.unknown_format, s.corrupt, s.objects, s.used_bytes) == (1, 0, 3, 4 * OBJECT)
        assert read(tier, 1, 2, 3, 4) == [payload(1), payload(2), None, payload(4)]
        assert tier.write(writes(*range(5, 15))) == [True] * 10  # past the capacity: LRU evictions
        s = tier.stats()
        assert (s.objects, s.used_bytes) == (7, 8 * OBJECT)  # 7 chunks and the newer file
        assert newer.read_bytes() == crafted(FUTURE, 3)
    with DiskTier(directory, 8 * OBJECT) as tier:
        assert tier.stats().unknown_format == 1
        assert newer.exists()
        assert tier.clear() == 8
        assert not newer.exists()
        assert tier.stats().used_bytes == 0
