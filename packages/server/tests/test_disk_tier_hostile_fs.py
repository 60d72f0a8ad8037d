"""The disk tier when its directory is tampered with: swapped, symlinked, emptied, filled with
odd entries, or on a file system that runs full. Real files throughout; the full file system is
a real tmpfs (skipped where this user cannot mount one)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from kvdepot.server import ChunkRef, ChunkWrite, DiskTier, TierConfigError, object_name
from kvdepot.server._tier_format import encode_header
from kvdepot.server._tiers import salt_tag

C = 4096


def payload(i: int) -> bytes:
    return (i.to_bytes(4, "little") * (C // 4))[:C]


def put(tier: DiskTier, *keys: int, size: int = C) -> list[bool]:
    return tier.write([ChunkWrite("s", b"k%d" % i, payload(i) * (size // C)) for i in keys])


def get(tier: DiskTier, *keys: int) -> list[bytes | None]:
    bufs = [bytearray(C) for _ in keys]
    hits = tier.read([ChunkRef("s", b"k%d" % i, b"", C) for i in keys], [memoryview(b) for b in bufs])
    return [bytes(b) if hit else None for b, hit in zip(bufs, hits, strict=True)]


def path_of(d: Path, i: int) -> Path:
    name = object_name("s", b"k%d" % i)
    return d / "objects" / name[:2] / name


def forged(i: int, body: bytes) -> bytes:
    """A valid object for chunk ``i`` with bytes of someone else's choosing (the checksum is not a secret)."""
    digest = bytes.fromhex(object_name("s", b"k%d" % i))
    return encode_header(digest, salt_tag("s"), body) + body


def primed(d: Path) -> Path:
    DiskTier(d, 1 << 20).close()
    return d


@pytest.fixture
def d(tmp_path) -> Path:
    return tmp_path / "disk"


def test_a_directory_swapped_under_a_running_tier_is_never_used(d):
    """The tier works on the directory it opened, not on its path: whoever can write the parent
    and puts another directory (with a forged object) under the same name gets nothing written
    there, and its object is never served."""
    with DiskTier(d, 64 * C) as tier:
        put(tier, 0)
        d.rename(d.with_name("moved"))
        for sub in ("tmp", "objects", f"objects/{path_of(d, 1).parent.name}"):
            (d / sub).mkdir(parents=True, mode=0o700)
        assert put(tier, 2) == [True]
        assert not path_of(d, 2).exists()
        assert path_of(d.with_name("moved"), 2).exists()
        path_of(d, 1).write_bytes(forged(1, b"E" * C))
        assert get(tier, 0, 1, 2) == [payload(0), None, payload(2)]


def test_a_symlinked_subdirectory_is_refused_with_its_path(d, tmp_path):
    """A symlink in place of objects/xx (or a file there) would have writes go through it: the
    tier refuses to start and names it."""
    primed(d)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    fan = d / "objects" / path_of(d, 1).parent.name
    fan.rmdir()
    fan.symlink_to(elsewhere)
    with pytest.raises(TierConfigError, match=str(fan)):
        DiskTier(d, 64 * C)
    fan.unlink()
    fan.write_bytes(b"x")
    with pytest.raises(TierConfigError, match="not a directory"):
        DiskTier(d, 64 * C)
    assert os.listdir(elsewhere) == []


def test_a_second_tier_is_refused_even_after_every_file_in_the_directory_was_removed(d):
    """The lock is the directory itself: removing its files (rm DIR/*, a cleaner) lets no
    second server in."""
    with DiskTier(d, 64 * C) as tier:
        put(tier, 1)
        for entry in d.iterdir():
            if entry.is_file():
                entry.unlink()
        with pytest.raises(TierConfigError, match="another kvdepot server"):
            DiskTier(d, 64 * C)


def test_a_file_removed_behind_the_tier_is_forgotten_and_written_again(d):
    """A chunk whose file an operator removed is a miss once, then forgotten (not advertised, not
    counted), and written again when the chunk is stored again."""
    with DiskTier(d, 64 * C) as tier:
        put(tier, 1, 2)
        os.unlink(path_of(d, 1))
        assert get(tier, 1) == [None]
        assert tier.lengths([ChunkRef("s", b"k1")]) == [None]
        assert tier.stats().objects == 1
        assert put(tier, 1) == [True]
        assert path_of(d, 1).exists()
        assert get(tier, 1, 2) == [payload(1), payload(2)]


def test_a_chunk_stored_again_after_its_file_went_is_written_again(d):
    """Stored again before anyone read it: the write notices the file is gone and writes it."""
    with DiskTier(d, 64 * C) as tier:
        put(tier, 1)
        os.unlink(path_of(d, 1))
        assert put(tier, 1) == [True]
        assert path_of(d, 1).exists()


def test_removed_subdirectories_are_made_again(d):
    """rm -rf DIR/objects/* DIR/tmp under a running tier: writes make the directories again."""
    with DiskTier(d, 64 * C) as tier:
        put(tier, 1)
        for sub in (d / "objects").iterdir():
            shutil.rmtree(sub)
        shutil.rmtree(d / "tmp")
        assert all(put(tier, *range(10, 30)))
        assert get(tier, 10, 29) == [payload(10), payload(29)]


def test_a_rewrite_is_a_use_across_a_restart(d):
    """A chunk stored again is the most recently used one after a restart too."""
    with DiskTier(d, 64 * C) as tier:
        put(tier, 1)
        one = tier.stats().used_bytes
        time.sleep(0.02)
        put(tier, 2)
        time.sleep(0.02)
        put(tier, 1)
    assert one is not None
    with DiskTier(d, one) as tier:  # room for one: the most recently used stays
        assert get(tier, 1, 2) == [payload(1), None]


def test_odd_entries_in_the_directory_never_stop_a_start(d):
    """A directory named like an object or left in tmp/, and a FIFO named like an object: the
    tier starts (in a child, so that a blocking open would show as a timeout) and serves the rest."""
    primed(d)
    with DiskTier(d, 64 * C) as tier:
        put(tier, 3)
    path_of(d, 1).mkdir()
    (d / "tmp" / "leftover").mkdir()
    os.mkfifo(path_of(d, 2))
    code = textwrap.dedent(f"""
        from kvdepot.server import ChunkRef, DiskTier
        with DiskTier({str(d)!r}, 1 << 20) as tier:
            buf = memoryview(bytearray({C}))
            print("result", tier.stats().objects, tier.read([ChunkRef("s", b"k2", b"", {C})], [buf]))
    """)
    out = subprocess.run([sys.executable, "-c", code], timeout=60, check=True, capture_output=True, text=True)
    assert "result 1 [False]" in out.stdout.splitlines()


def test_a_fifo_in_a_files_place_never_blocks_a_read(d):
    """A FIFO put where an indexed file was: the read is a miss at once (a corrupt object)."""
    with DiskTier(d, 64 * C) as tier:
        put(tier, 1, 2)
        os.unlink(path_of(d, 1))
        os.mkfifo(path_of(d, 1))
        assert get(tier, 1, 2) == [None, payload(2)]
        assert tier.stats().corrupt == 1


@pytest.fixture
def small_fs(tmp_path):
    """A real 4 MiB tmpfs, where this user may mount one."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m,mode=700", "tmpfs", str(mnt)], capture_output=True, check=False
    )
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip() or done.returncode}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_full_file_system_makes_room_from_the_lru(small_fs):
    """--disk-capacity above what the file system holds: at ENOSPC the tier evicts its least
    recently used files and writes the chunk, rather than failing every write from then on."""
    d = small_fs / "disk"
    with DiskTier(d, 64 << 20) as tier:
        results = [put(tier, i, size=64 * C)[0] for i in range(40)]
        assert results[-10:] == [True] * 10
        files = sum(p.stat().st_size for p in (d / "objects").rglob("*") if p.is_file())
        assert tier.stats().used_bytes == files
        assert os.listdir(d / "tmp") == []


def test_the_default_capacity_does_not_shrink_at_a_restart(small_fs):
    """No capacity given: half the free space, counting the tier's own files as free, so a
    restart of a full tier keeps every chunk."""
    d = small_fs / "disk"
    with DiskTier(d, None) as tier:
        first = tier.capacity
        assert all(put(tier, *range(6), size=64 * C))  # 1.5 MiB of a 2 MiB capacity
    with DiskTier(d, None) as tier:
        assert tier.capacity >= first - 6 * 4096  # block rounding, at most
        assert tier.stats().objects == 6


def test_close_waits_for_a_read_under_way(d):
    """The directory's descriptor is closed only once no read uses it (a reused descriptor
    number would make a late read open someone else's file)."""
    tier = DiskTier(d, 64 * C)
    put(tier, 1)
    assert tier._enter()
    with contextlib.ExitStack() as stack:
        stack.callback(tier._leave)
        tier_close = threading.Thread(target=tier.close)
        tier_close.start()
        time.sleep(0.2)
        assert tier_close.is_alive()  # waiting for the read
    tier_close.join(5)
    assert not tier_close.is_alive()  # done once the read was
    assert get(tier, 1) == [None]  # closed: a miss
