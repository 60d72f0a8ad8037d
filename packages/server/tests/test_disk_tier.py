"""The disk tier on real files: round trips, LRU eviction, restarts, torn and corrupt files, isolation, permissions."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from kvdepot.server import ChunkRef, ChunkWrite, DiskTier, TierConfigError, TierState, object_name
from kvdepot.server import _disk_tier as disk_tier_module
from kvdepot.server._disk_tier import SALT_TAG_BYTES, SPLIT_BYTES
from kvdepot.server._tier_format import FIXED_HEADER_BYTES

CHUNK = 4096
# header with the salt tag and the 2-byte fingerprint b"fp", and the payload
OBJECT = FIXED_HEADER_BYTES + SALT_TAG_BYTES + 2 + CHUNK


def payload(i: int, size: int = CHUNK) -> bytes:
    return (i.to_bytes(4, "little") * (size // 4 + 1))[:size]


def write(tier: DiskTier, *keys: int, salt: str = "s") -> list[bool]:
    return tier.write([ChunkWrite(salt, b"k%d" % i, payload(i), b"fp") for i in keys])


def read(tier: DiskTier, *keys: int, salt: str = "s", fingerprint: bytes = b"fp", **kw) -> list[bytes | None]:
    bufs = [bytearray(CHUNK) for _ in keys]
    refs = [ChunkRef(salt, b"k%d" % i, fingerprint, CHUNK) for i in keys]
    hits = tier.read(refs, [memoryview(b) for b in bufs], **kw)
    return [bytes(b) if hit else None for b, hit in zip(bufs, hits, strict=True)]


def object_path(directory: Path, key: int, salt: str = "s") -> Path:
    name = object_name(salt, b"k%d" % key)
    return directory / "objects" / name[:2] / name


@pytest.fixture
def tier_dir(tmp_path) -> Path:
    return tmp_path / "disk"


@pytest.fixture(params=["one thread", "split"])
def tier(request, tier_dir, monkeypatch):
    """The tier as it runs small batches (one thread) and large ones (split between two)."""
    if request.param == "split":
        monkeypatch.setattr(disk_tier_module, "SPLIT_BYTES", 1)
    with DiskTier(tier_dir, 16 * OBJECT) as tier:
        yield tier


def test_round_trip(tier):
    """Chunks written come back byte for byte; absent ones miss; the stats count both."""
    assert write(tier, 1, 2, 3) == [True, True, True]
    assert read(tier, 1, 2, 3, 4) == [payload(1), payload(2), payload(3), None]
    s = tier.stats()
    assert (s.hits, s.misses, s.objects, s.used_bytes) == (3, 1, 3, 3 * OBJECT)
    assert (s.writes, s.bytes_written, s.bytes_read, s.state) == (3, 3 * CHUNK, 3 * CHUNK, TierState.UP)
    assert tier.lengths([ChunkRef("s", b"k1", b"fp"), ChunkRef("s", b"k9", b"fp")]) == [CHUNK, None]


def test_write_of_a_chunk_already_there_is_skipped(tier, tier_dir):
    """Writing the same chunk again does not rewrite its file (write-behind may offer it twice)."""
    write(tier, 1)
    before = os.stat(object_path(tier_dir, 1)).st_ino
    assert write(tier, 1) == [True]
    assert os.stat(object_path(tier_dir, 1)).st_ino == before
    assert tier.stats().writes == 1


def test_eviction_keeps_capacity_and_drops_least_recently_used(tier_dir):
    """Past capacity the least recently used chunks go first; a read counts as a use."""
    with DiskTier(tier_dir, 4 * OBJECT) as tier:
        write(tier, 0, 1, 2, 3)
        read(tier, 0)  # 0 is now the most recent; 1 is the oldest
        write(tier, 4, 5)
        assert tier.stats().used_bytes <= 4 * OBJECT
        got = read(tier, 0, 1, 2, 3, 4, 5)
        assert [g is not None for g in got] == [True, False, False, True, True, True]
        assert not object_path(tier_dir, 1).exists()
        files = list((tier_dir / "objects").rglob("*"))
        assert sum(f.stat().st_size for f in files if f.is_file()) <= 4 * OBJECT


def test_chunk_larger_than_capacity_is_refused(tier_dir):
    """A chunk that can never fit is not written and does not evict everything else."""
    with DiskTier(tier_dir, OBJECT) as tier:
        write(tier, 1)
        big = ChunkWrite("s", b"big", b"x" * (2 * CHUNK), b"fp")
        assert tier.write([big]) == [False]
        assert read(tier, 1) == [payload(1)]
        assert tier.stats().failed_writes == 1


def test_restart_rebuilds_the_index(tier_dir):
    """A new DiskTier on the same directory finds every chunk the old one wrote, in LRU order."""
    with DiskTier(tier_dir, 8 * OBJECT) as tier:
        write(tier, 1, 2, 3)
    with DiskTier(tier_dir, 8 * OBJECT) as again:
        s = again.stats()
        assert (s.objects, s.used_bytes) == (3, 3 * OBJECT)
        assert read(again, 1, 2, 3) == [payload(1), payload(2), payload(3)]


def test_a_restart_keeps_reads_as_uses_in_the_lru_order(tier_dir):
    """A chunk read since it was written is more recently used than one written after it, also
    for a restarted tier (which rebuilds its LRU order from the files' times)."""
    with DiskTier(tier_dir, 4 * OBJECT) as tier:
        write(tier, 0, 1, 2, 3)
        for key in range(4):  # written long ago, one second apart (file times are coarser than that)
            os.utime(object_path(tier_dir, key), (1e9 + key, 1e9 + key))
        assert read(tier, 0) == [payload(0)]  # ... but 0 was used just now; 1 is the least recent
    with DiskTier(tier_dir, 4 * OBJECT) as again:
        write(again, 4)
        assert [g is not None for g in read(again, 0, 1, 2, 3, 4)] == [True, False, True, True, True]


def test_restart_with_smaller_capacity_evicts_down_to_it(tier_dir):
    """Reopened with less capacity, the tier evicts at start until it fits."""
    with DiskTier(tier_dir, 8 * OBJECT) as tier:
        write(tier, 1, 2, 3, 4)
    with DiskTier(tier_dir, 2 * OBJECT) as small:
        assert small.stats().objects == 2
        assert small.stats().used_bytes <= 2 * OBJECT


def test_survives_sigkill_of_the_writer(tier_dir):
    """Chunks written by a process killed with SIGKILL right after are all there at the next start."""
    code = textwrap.dedent(
        f"""
        import os, signal
        from kvdepot.server import ChunkWrite, DiskTier
        tier = DiskTier({str(tier_dir)!r}, 1 << 24)
        tier.write([ChunkWrite("s", b"k%d" % i, bytes([i]) * {CHUNK}, b"fp") for i in range(5)])
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, timeout=60)
    assert proc.returncode == -9, proc.stderr.decode()
    with DiskTier(tier_dir, 1 << 24) as tier:
        bufs = [bytearray(CHUNK) for _ in range(5)]
        refs = [ChunkRef("s", b"k%d" % i, b"fp", CHUNK) for i in range(5)]
        assert tier.read(refs, [memoryview(b) for b in bufs]) == [True] * 5
        assert all(b == bytes([i]) * CHUNK for i, b in enumerate(bufs))


def test_half_written_temporary_file_is_never_served(tier_dir):
    """A temporary file left by a crash is removed at start and never read, even if named like the chunk."""
    with DiskTier(tier_dir, 8 * OBJECT) as tier:
        write(tier, 1)
        full = object_path(tier_dir, 1).read_bytes()
    leftover = tier_dir / "tmp" / f"{object_name('s', b'k2')}.deadbeef"
    leftover.write_bytes(full[: len(full) // 2])
    with DiskTier(tier_dir, 8 * OBJECT) as tier:
        assert not leftover.exists()
        assert tier.stats().objects == 1
        assert read(tier, 2) == [None]


def test_torn_file_under_its_real_name_is_a_miss_and_deleted(tier_dir):
    """A short file under a chunk's name (power loss without fsync) is dropped at start, never served."""
    with DiskTier(tier_dir, 8 * OBJECT) as tier:
        write(tier, 1, 2)
    path = object_path(tier_dir, 1)
    path.write_bytes(path.read_bytes()[:100])
    with DiskTier(tier_dir, 8 * OBJECT) as tier:
        assert not path.exists()
        assert tier.stats().corrupt == 1
        assert read(tier, 1, 2) == [None, payload(2)]


@pytest.mark.parametrize("where", ["header", "payload", "last"])
def test_corrupted_file_is_a_miss_counted_and_deleted(tier, tier_dir, where):
    """A flipped byte in a file (header or payload) makes the read a miss; the file is deleted and counted."""
    write(tier, 1)
    path = object_path(tier_dir, 1)
    data = bytearray(path.read_bytes())
    offset = {"header": 30, "payload": FIXED_HEADER_BYTES + SALT_TAG_BYTES + 2 + 100, "last": len(data) - 1}[where]
    data[offset] ^= 0x01
    path.write_bytes(data)
    assert read(tier, 1) == [None]
    assert not path.exists()
    s = tier.stats()
    assert (s.corrupt, s.objects, s.used_bytes, s.hits) == (1, 0, 0, 0)
    assert write(tier, 1) == [True]  # written again, it hits again
    assert read(tier, 1) == [payload(1)]


def test_file_swapped_for_another_chunk_is_a_miss(tier, tier_dir):
    """A file renamed to another chunk's name is refused: the header names the chunk it holds."""
    write(tier, 1, 2)
    os.replace(object_path(tier_dir, 2), object_path(tier_dir, 1))
    assert read(tier, 1) == [None]
    assert tier.stats().corrupt == 1


def test_salts_are_isolated(tier):
    """A chunk stored under one salt is never found with another, though the key is the same."""
    write(tier, 1, salt="tenant-a")
    assert read(tier, 1, salt="tenant-b") == [None]
    assert read(tier, 1, salt="tenant-a") == [payload(1)]
    assert tier.lengths([ChunkRef("tenant-b", b"k1", b"fp")]) == [None]


def test_other_fingerprint_is_a_miss(tier):
    """Asked with another fingerprint (or length), a chunk is a miss, never served; the file is
    intact, so it stays and is still served to who asks for it as it is."""
    write(tier, 1)
    assert read(tier, 1, fingerprint=b"other") == [None]
    assert tier.read([ChunkRef("s", b"k1", b"fp", CHUNK // 2)], [memoryview(bytearray(CHUNK // 2))]) == [False]
    assert tier.stats().corrupt == 0
    assert read(tier, 1) == [payload(1)]


def test_permissions_are_owner_only(tier, tier_dir):
    """The directory is 0700 and every object file 0600."""
    write(tier, 1)
    assert stat.S_IMODE(tier_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE(object_path(tier_dir, 1).stat().st_mode) == 0o600
    assert stat.S_IMODE(object_path(tier_dir, 1).parent.stat().st_mode) == 0o700


def test_refuses_a_directory_others_can_read(tmp_path):
    """A directory with group or other permissions is refused with what to do."""
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    with pytest.raises(TierConfigError, match="chmod 700"):
        DiskTier(shared, 1 << 20)


def test_refuses_a_symlinked_directory(tmp_path):
    """The tier directory is never reached through a symlink."""
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(TierConfigError, match="not a directory"):
        DiskTier(link, 1 << 20)


def test_symlinked_object_is_not_followed(tier, tier_dir, tmp_path):
    """A symlink planted under a chunk's name is not followed, at start or on read."""
    write(tier, 1)
    tier.close()
    target = tmp_path / "elsewhere"
    target.write_bytes(object_path(tier_dir, 1).read_bytes())
    object_path(tier_dir, 1).unlink()
    object_path(tier_dir, 1).symlink_to(target)
    with DiskTier(tier_dir, 8 * OBJECT) as again:
        assert read(again, 1) == [None]
        assert again.stats().objects == 0


def test_one_server_per_directory(tier, tier_dir):
    """A second DiskTier on a directory in use is refused (two indexes would fight over the files)."""
    with pytest.raises(TierConfigError, match="another kvdepot server"):
        DiskTier(tier_dir, 1 << 20)


def test_bad_arguments_are_typed_errors(tier, tmp_path):
    """A wrong-sized or read-only buffer, a mismatched batch, or a bad capacity are TierConfigError."""
    with pytest.raises(TierConfigError):
        tier.read([ChunkRef("s", b"k", b"", CHUNK)], [memoryview(bytearray(CHUNK - 1))])
    with pytest.raises(TierConfigError):
        tier.read([ChunkRef("s", b"k", b"", CHUNK)], [memoryview(bytes(CHUNK))])
    with pytest.raises(TierConfigError):
        tier.read([ChunkRef("s", b"k", b"", CHUNK)], [])
    with pytest.raises(TierConfigError):
        DiskTier(tmp_path / "zero", 0)


def test_deadline_past_means_late_misses(tier):
    """With no time left, a read is all misses, counted as late, without touching the files."""
    write(tier, 1, 2)
    assert read(tier, 1, 2, timeout=-1) == [None, None]
    assert tier.stats().late == 2


def test_a_large_batch_is_split_between_two_threads_and_every_chunk_is_checked(tier_dir):
    """A batch of SPLIT_BYTES and more runs on two threads: every chunk lands in its own buffer,
    a corrupted one in the middle misses (and goes), and the counts add up."""
    size = SPLIT_BYTES // 4
    keys = range(6)
    with DiskTier(tier_dir, 8 * (size + 4096)) as tier:
        used: set[int] = set()
        helper_started = threading.Event()
        original = tier._read_one

        def noting(ref, buf):
            used.add(threading.get_ident())
            if threading.current_thread() is not threading.main_thread():  # the helper
                helper_started.set()
            else:  # the caller gives the helper time to take its half (else the caller would do it)
                helper_started.wait(10)
            return original(ref, buf)

        tier._read_one = noting  # type: ignore[method-assign]
        assert tier.write([ChunkWrite("s", b"k%d" % i, payload(i, size), b"fp") for i in keys]) == [True] * 6
        path = object_path(tier_dir, 3)
        with path.open("r+b") as f:
            f.seek(-1, os.SEEK_END)
            last = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([last[0] ^ 0xFF]))
        bufs = [bytearray(size) for _ in keys]
        hits = tier.read([ChunkRef("s", b"k%d" % i, b"fp", size) for i in keys], [memoryview(b) for b in bufs])
        assert hits == [True, True, True, False, True, True]
        assert [bytes(b) for i, b in enumerate(bufs) if i != 3] == [payload(i, size) for i in keys if i != 3]
        assert len(used) == 2
        s = tier.stats()
        assert (s.hits, s.misses, s.corrupt, s.objects) == (5, 1, 1, 5)
        assert not path.exists()


def test_a_batch_never_waits_for_another_batch_on_the_helper(tier_dir):
    """While one large read's helper half is stuck (a slow disk), another large read and a large
    write still complete, on their own threads, every chunk checked: a lookup never waits for an
    unrelated batch (before, the second read queued behind the stuck one until it finished)."""
    size = SPLIT_BYTES // 2
    with DiskTier(tier_dir, 16 * (size + 4096)) as tier:
        assert tier.write([ChunkWrite("s", b"k%d" % i, payload(i, size), b"fp") for i in range(4)]) == [True] * 4
        helper_started, release = threading.Event(), threading.Event()
        callers: list[threading.Thread] = []
        original = tier._read_one

        def slow_disk(ref, buf):
            if threading.current_thread() not in callers and ref.key == b"k1":  # on a helper
                helper_started.set()
                release.wait(30)
            elif ref.key == b"k0":  # the first read's caller lets the helper take its half
                helper_started.wait(10)
            return original(ref, buf)

        tier._read_one = slow_disk  # type: ignore[method-assign]

        def read_keys(*keys: int) -> list[bytes | None]:
            bufs = [bytearray(size) for _ in keys]
            refs = [ChunkRef("s", b"k%d" % i, b"fp", size) for i in keys]
            hits = tier.read(refs, [memoryview(b) for b in bufs])
            return [bytes(b) if hit else None for b, hit in zip(bufs, hits, strict=True)]

        outcomes: dict[str, object] = {}
        first = threading.Thread(target=lambda: outcomes.update(first=read_keys(0, 1)))
        callers.append(first)
        first.start()
        assert helper_started.wait(10)

        def others() -> None:
            outcomes["second"] = read_keys(2, 3)
            outcomes["write"] = tier.write([ChunkWrite("s", b"k%d" % i, payload(i, size), b"fp") for i in (4, 5)])

        second = threading.Thread(target=others)
        callers.append(second)
        second.start()
        second.join(10)
        stuck = second.is_alive()
        release.set()
        first.join(10)
        second.join(10)
        assert not stuck, "a batch waited for another batch's helper half"
        assert outcomes == {
            "first": [payload(0, size), payload(1, size)],
            "second": [payload(2, size), payload(3, size)],
            "write": [True, True],
        }
        assert read_keys(4, 5) == [payload(4, size), payload(5, size)]


def test_clear_and_delete(tier, tier_dir):
    """delete() removes the named chunks, clear() all of them, files included."""
    write(tier, 1, 2, 3)
    assert tier.delete([ChunkRef("s", b"k1", b"fp", CHUNK)]) == 1
    assert read(tier, 1) == [None]
    assert tier.clear() == 2
    assert tier.stats().objects == 0
    assert not [p for p in (tier_dir / "objects").rglob("*") if p.is_file()]


def test_concurrent_writers_and_readers_keep_accounts(tier_dir):
    """Threads writing and reading at once never serve a wrong chunk, and used bytes match the files."""
    with DiskTier(tier_dir, 12 * OBJECT) as tier:
        errors: list[str] = []

        def worker(base: int) -> None:
            for round_ in range(30):
                keys = [(base + round_ + j) % 24 for j in range(3)]
                write(tier, *keys)
                for key, got in zip(keys, read(tier, *keys), strict=True):
                    if got is not None and got != payload(key):
                        errors.append(f"key {key} served wrong bytes")

        threads = [threading.Thread(target=worker, args=(i * 5,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        files = [p for p in (tier_dir / "objects").rglob("*") if p.is_file()]
        s = tier.stats()
        assert s.used_bytes == sum(p.stat().st_size for p in files) <= 12 * OBJECT
        assert s.objects == len(files)
        assert not list((tier_dir / "tmp").iterdir())


def test_a_salt_over_its_quota_evicts_only_its_own_files(tier_dir):
    """With a quota, a salt's writes past it evict that salt's least recently used files, never
    another salt's; a chunk larger than the quota is refused; salts without one are unbounded."""
    quotas = {"small": 2 * OBJECT}
    with DiskTier(tier_dir, 16 * OBJECT, quota_of=quotas.get) as tier:
        assert write(tier, 1, 2, 3, salt="other") == [True, True, True]
        assert write(tier, 1, 2, 3, 4, 5, salt="small") == [True] * 5
        assert tier.salt_bytes("small") == 2 * OBJECT
        assert read(tier, 1, 2, 3, 4, 5, salt="small") == [None, None, None, payload(4), payload(5)]
        assert read(tier, 1, 2, 3, salt="other") == [payload(1), payload(2), payload(3)]
        assert tier.salt_bytes("other") == 3 * OBJECT
        quotas["small"] = OBJECT - 1
        assert write(tier, 6, salt="small") == [False]
        assert tier.stats().failed_writes == 1


def test_a_salt_cannot_fill_the_tier_past_its_quota(tier_dir):
    """A salt that writes much more than its quota leaves the rest of the tier to the others: what
    they stored earlier stays."""
    with DiskTier(tier_dir, 8 * OBJECT, quota_of=lambda salt: 3 * OBJECT) as tier:
        assert write(tier, *range(5), salt="b") == [True] * 5
        assert write(tier, *range(100), salt="a") == [True] * 100
        assert read(tier, *range(2, 5), salt="b") == [payload(i) for i in range(2, 5)]
        assert tier.stats().used_bytes == 6 * OBJECT


def test_each_salts_usage_is_counted_again_after_a_restart(tier_dir):
    """The salt tag in each header lets a restarted tier count every salt's bytes, so its quota
    holds across restarts; files without one (not written by this tier) are removed."""
    with DiskTier(tier_dir, 16 * OBJECT) as tier:
        write(tier, 1, 2, salt="x")
        write(tier, 1, salt="y")
    with DiskTier(tier_dir, 16 * OBJECT, quota_of=lambda salt: OBJECT) as tier:
        assert (tier.salt_bytes("x"), tier.salt_bytes("y")) == (2 * OBJECT, OBJECT)
        assert write(tier, 3, salt="x") == [True]
        assert tier.salt_bytes("x") == OBJECT
        assert read(tier, 1, 2, 3, salt="x") == [None, None, payload(3)]
        assert read(tier, 1, salt="y") == [payload(1)]


def test_a_clear_of_one_salt_deletes_its_files_only_and_a_restart_finds_none(tier_dir):
    with DiskTier(tier_dir, 1 << 30) as tier:
        assert write(tier, 1, 2, 3, salt="gone") == [True] * 3
        assert write(tier, 1, 2, salt="kept") == [True] * 2
        assert tier.clear("gone") == 3
        assert tier.salt_bytes("gone") == 0
        assert read(tier, 1, 2, 3, salt="gone") == [None] * 3
        assert read(tier, 1, 2, salt="kept") == [payload(1), payload(2)]
    with DiskTier(tier_dir, 1 << 30) as again:
        assert read(again, 1, salt="gone") == [None]
        assert read(again, 1, 2, salt="kept") == [payload(1), payload(2)]
        assert again.clear(None) == 2
        assert again.stats().objects == 0
