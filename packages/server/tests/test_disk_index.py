"""The disk tier's index of its files (`DiskIndex`), without a directory: room, quotas, LRU order."""

from __future__ import annotations

from kvdepot.server._disk_files import ObjectFile
from kvdepot.server._disk_index import DiskIndex

A, B = b"a" * 16, b"b" * 16  # two salts' tags


def index_of(capacity: int, *files: tuple[int, bytes]) -> tuple[DiskIndex, list[bytes]]:
    """An index of ``capacity`` bytes holding ``files`` (size, salt tag), oldest first; the
    digests it deleted go to the list returned."""
    deleted: list[bytes] = []
    index = DiskIndex(deleted.append)
    index.capacity = capacity
    for n, (size, tag) in enumerate(files):
        index.add(bytes([n]) * 32, ObjectFile(size=size, length=size - 10, fingerprint=b"", tag=tag))
    return index, deleted


def test_room_for_a_new_file_evicts_the_least_recently_used_and_counts_it_as_being_written():
    index, deleted = index_of(300, (100, A), (100, B), (100, A))
    index.touch(bytes([0]) * 32, index.files[bytes([0]) * 32])  # the oldest was just used
    assert index.reserve(b"new" * 10, B, 100, None)
    assert deleted == [bytes([1]) * 32]
    assert (index.reserved, index.occupied(), index.salt_bytes(B)) == (100, 300, 100)
    index.unreserve(B, 100)
    assert (index.reserved, index.salt_bytes(B)) == (0, 0)


def test_a_salt_past_its_quota_evicts_only_its_own_files():
    index, deleted = index_of(1000, (100, A), (100, B), (100, A))
    assert index.reserve(b"new" * 10, A, 100, quota=200)
    assert deleted == [bytes([0]) * 32]
    assert index.salt_bytes(B) == 100


def test_a_chunk_larger_than_its_salts_quota_takes_no_room_and_evicts_nothing():
    index, deleted = index_of(1000, (100, A))
    assert not index.reserve(b"new" * 10, A, 300, quota=200)
    assert (deleted, index.reserved) == ([], 0)


def test_a_file_of_an_unknown_format_leaves_the_lru_but_still_counts_against_the_capacity():
    index, deleted = index_of(200, (100, A), (100, B))
    digest = bytes([0]) * 32
    index.set_aside(digest, index.files[digest])
    assert (list(index.files), index.occupied()) == ([bytes([1]) * 32], 200)
    assert index.make_room(100) == 1  # only the known file can go
    assert deleted == [bytes([1]) * 32]
    assert index.forget_unknown() == [digest]
    assert index.occupied() == 0


def test_a_file_renamed_into_place_replaces_whatever_was_under_its_name():
    index, _ = index_of(1000, (100, A))
    digest = bytes([0]) * 32
    index.replace(digest, ObjectFile(size=50, length=40, fingerprint=b"f", tag=B))
    assert (index.used, index.salt_bytes(A), index.salt_bytes(B)) == (50, 0, 50)
