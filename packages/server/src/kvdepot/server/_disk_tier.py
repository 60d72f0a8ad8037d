"""The disk tier: one file per chunk under a private directory, LRU-evicted by capacity.

Layout of ``DIR`` (0700, this user's alone; a lock file keeps a second server out)::

    DIR/lock                 flock'ed while a server uses DIR
    DIR/tmp/NAME.RANDOM      a file being written (removed at start: a crash left it)
    DIR/objects/ab/NAME      a chunk: `_tier_format` header + payload; NAME = object_name(salt, key)

One file per chunk rather than a few large files: a chunk is hundreds of KiB to MiBs, so a
file's overhead is small; writing to a temporary name and renaming makes every object
appear whole or not at all, with no log to replay; eviction is an unlink that frees the space
at once, with no compaction; and the index rebuilds from the headers alone. The 256
subdirectories keep directories small.

No fsync: this is a cache. A process crash (SIGKILL) loses nothing that was renamed, since
the page cache survives it; a power loss may leave a renamed file empty or short, and its
header or checksum then makes it a miss that is deleted, never a wrong chunk.

Reads go straight from the file into the caller's buffer (`os.preadv`), with the header into
a small buffer in the same system call; writes go straight from the caller's buffer
(`os.writev`). Neither copies the payload in Python. A batch of at least `SPLIT_BYTES` is
split between the calling thread and one helper (every other chunk): the checksum is a second
pass over each chunk, and while one thread hashes a chunk the other copies the next (system
calls and xxh3 both release the GIL). On 2 cores that made a batch of 1 MiB or 8 MiB chunks
1.5x faster than one thread, from 71% of a plain sequential read to about the plain read.
Reads and writes have a helper each, and a batch whose helper is still busy with another
batch when the caller is done with its half does the other half too: a lookup's read never
waits for the write-behind's batch (or another lookup's) to finish.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import attrs
import structlog

from kvdepot.server._errors import CorruptObjectError, TierConfigError
from kvdepot.server._tier_format import (
    FIXED_HEADER_BYTES,
    MAX_FINGERPRINT_BYTES,
    check_header,
    encode_header,
    parse_header,
    verify,
)
from kvdepot.server._tiers import (
    SALT_TAG_BYTES,
    ChunkRef,
    ChunkWrite,
    Counters,
    TierState,
    TierStats,
    WarnLimiter,
    check_batch,
    salt_tag,
)

log = structlog.get_logger(__name__)

_NAME = re.compile(r"^[0-9a-f]{64}$")
# A read or write batch of at least this many bytes is split between two threads.
SPLIT_BYTES = 2 << 20
_OPEN_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC


@attrs.define
class _Entry:
    size: int  # bytes of the file: header and payload
    length: int
    fingerprint: bytes  # the caller's, without the salt tag
    tag: bytes  # `salt_tag` of the chunk's salt


def _private_dir(path: Path) -> None:
    """Make ``path`` a directory of this user's alone, or raise `TierConfigError`."""
    try:
        path.mkdir(mode=0o700, parents=False, exist_ok=True)
        st = os.lstat(path)
    except OSError as exc:
        raise TierConfigError(f"cannot create the disk tier directory {path}: {exc.strerror}", path=str(path)) from exc
    if not stat.S_ISDIR(st.st_mode):
        raise TierConfigError(f"{path} is not a directory (a symlink is not followed)", path=str(path))
    if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
        raise TierConfigError(
            f"{path} belongs to uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):o}; the disk tier keeps "
            "tenants' KV bytes and needs a directory of its own user's alone (chmod 700, or name a new one)",
            path=str(path),
            owner=st.st_uid,
        )


def _read_full(fd: int, buffers: list[memoryview], offset: int, enough: int) -> int:
    """Fill ``buffers`` from ``offset`` of ``fd``; bytes read (less only at EOF).

    A short read of a regular file means its end, so once ``enough`` bytes are in, a short read
    ends the loop without the extra call that would return 0: one syscall for a whole chunk.
    """
    total = 0
    want = sum(b.nbytes for b in buffers)
    buffers = list(buffers)
    while buffers:
        asked = sum(b.nbytes for b in buffers)
        n = os.preadv(fd, buffers, offset + total)
        total += n
        if n == 0 or (n < asked and total >= enough):
            break
        while buffers and n >= buffers[0].nbytes:
            n -= buffers[0].nbytes
            buffers.pop(0)
        if buffers and n:
            buffers[0] = buffers[0][n:]
    assert total <= want
    return total


def _write_full(fd: int, buffers: list[memoryview]) -> None:
    while buffers:
        n = os.writev(fd, buffers)
        while buffers and n >= buffers[0].nbytes:
            n -= buffers[0].nbytes
            buffers.pop(0)
        if buffers and n:
            buffers[0] = buffers[0][n:]


class DiskTier:
    """Chunks in files under ``directory``, at most ``capacity`` bytes of them (headers included)."""

    kind = "disk"

    def __init__(
        self,
        directory: str | os.PathLike[str],
        capacity: int,
        *,
        quota_of: Callable[[str], int | None] | None = None,
    ) -> None:
        if capacity <= 0:
            raise TierConfigError(f"the disk tier's capacity must be positive, got {capacity}", capacity=capacity)
        self.directory = Path(directory)
        self.capacity = capacity
        #: The bytes a salt may hold in this tier (its RAM quota; None: no limit of its own).
        #: Called on the writing thread; the server sets it to the index's quotas.
        self.quota_of = quota_of
        _private_dir(self.directory)
        self._lock_fd = self._take_lock()
        self._objects = self.directory / "objects"
        self._objects_str = str(self._objects)
        self._tmp = self.directory / "tmp"
        self._tmp_str = str(self._tmp)
        _private_dir(self._objects)
        _private_dir(self._tmp)
        for fan in range(256):  # made once here, so that a write needs no mkdir
            (self._objects / f"{fan:02x}").mkdir(mode=0o700, exist_ok=True)
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, _Entry] = OrderedDict()  # least recently used first
        self._used = 0  # bytes of the files in the index
        self._salts: dict[bytes, OrderedDict[bytes, None]] = {}  # per salt tag: its digests, LRU first
        self._salt_used: dict[bytes, int] = {}  # per salt tag: bytes of its files, and of one being written
        self._reserved = 0  # bytes of files being written
        self._counters = Counters()
        self._closed = False
        self._warn = WarnLimiter(log)
        # One helper thread for reads and one for writes (each starts at first use).
        self._read_helper = ThreadPoolExecutor(1, thread_name_prefix="kvdepot-disk-read")
        self._write_helper = ThreadPoolExecutor(1, thread_name_prefix="kvdepot-disk-write")
        removed = self._remove_temporaries()
        corrupt = self._rebuild()
        self._counters.add(corrupt=corrupt)
        with self._lock:
            evicted = self._make_room(0)
        log.info(
            "disk_tier_opened",
            path=str(self.directory),
            capacity=capacity,
            chunks=len(self._index),
            used=self._used,
            temporaries_removed=removed,
            corrupt_removed=corrupt,
            evicted=evicted,
        )

    # -- setup -------------------------------------------------------------------------------

    def _take_lock(self) -> int:
        path = self.directory / "lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | _OPEN_FLAGS, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise TierConfigError(
                f"another kvdepot server uses the disk tier {self.directory}; give each server its own --disk-dir",
                path=str(self.directory),
            ) from None
        return fd

    def _remove_temporaries(self) -> int:
        removed = 0
        for name in os.listdir(self._tmp):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._tmp / name)
                removed += 1
        return removed

    def _rebuild(self) -> int:
        """Index every intact object under objects/, oldest first; delete the broken ones."""
        found: list[tuple[float, bytes, _Entry]] = []
        corrupt = 0
        for sub in os.listdir(self._objects):
            subdir = self._objects / sub
            if not (len(sub) == 2 and subdir.is_dir() and not subdir.is_symlink()):
                continue
            for name in os.listdir(subdir):
                path = subdir / name
                if not _NAME.match(name) or name[:2] != sub:
                    continue
                entry, mtime = self._scan_one(path, bytes.fromhex(name))
                if entry is None:
                    corrupt += 1
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
                    continue
                found.append((mtime, bytes.fromhex(name), entry))
        found.sort(key=lambda item: item[0])
        for _, digest, entry in found:
            self._add(digest, entry)
        return corrupt

    @staticmethod
    def _scan_one(path: Path, digest: bytes) -> tuple[_Entry | None, float]:
        try:
            fd = os.open(path, os.O_RDONLY | _OPEN_FLAGS)
        except OSError:  # a symlink or a file that vanished: not ours to serve
            return None, 0.0
        try:
            st = os.fstat(fd)
            head = os.pread(fd, FIXED_HEADER_BYTES + MAX_FINGERPRINT_BYTES, 0)
        finally:
            os.close(fd)
        try:
            header = parse_header(head)
        except CorruptObjectError:
            return None, 0.0
        if (
            not stat.S_ISREG(st.st_mode)
            or header.digest != digest
            or st.st_size != header.object_size
            or len(header.fingerprint) < SALT_TAG_BYTES  # not written by this tier
        ):
            return None, 0.0
        tag, fingerprint = header.fingerprint[:SALT_TAG_BYTES], header.fingerprint[SALT_TAG_BYTES:]
        return _Entry(size=header.object_size, length=header.length, fingerprint=fingerprint, tag=tag), st.st_mtime

    # -- helpers -----------------------------------------------------------------------------

    def _path(self, digest: bytes) -> str:
        name = digest.hex()
        return f"{self._objects_str}/{name[:2]}/{name}"  # a string: pathlib costs ~10 us a read

    def _make_room(self, size: int) -> int:
        """Evict least recently used files until ``size`` more bytes fit (lock held); how many."""
        evicted = 0
        while self._index and self._used + self._reserved + size > self.capacity:
            self._evict(next(iter(self._index)))
            evicted += 1
        return evicted

    def _make_salt_room(self, tag: bytes, size: int, quota: int) -> bool:
        """Evict the salt's own least recently used files until ``size`` more bytes fit in its
        quota (lock held); False when they cannot (the chunk alone is larger)."""
        if size > quota:
            return False
        own = self._salts.get(tag)
        while own and self._salt_used.get(tag, 0) + size > quota:
            self._evict(next(iter(own)))
        return self._salt_used.get(tag, 0) + size <= quota

    def _add(self, digest: bytes, entry: _Entry) -> None:
        """Index a file (lock held), most recently used."""
        self._index[digest] = entry
        self._used += entry.size
        self._salts.setdefault(entry.tag, OrderedDict())[digest] = None
        self._salt_used[entry.tag] = self._salt_used.get(entry.tag, 0) + entry.size

    def _forget(self, digest: bytes) -> _Entry | None:
        """Drop a file from the index (lock held); its entry, or None."""
        entry = self._index.pop(digest, None)
        if entry is not None:
            self._used -= entry.size
            own = self._salts[entry.tag]
            del own[digest]
            if not own:
                del self._salts[entry.tag]
            self._charge(entry.tag, -entry.size)
        return entry

    def _charge(self, tag: bytes, delta: int) -> None:
        used = self._salt_used.get(tag, 0) + delta
        if used:
            self._salt_used[tag] = used
        else:
            self._salt_used.pop(tag, None)

    def _touch(self, digest: bytes, entry: _Entry) -> None:
        """Mark a file most recently used (lock held)."""
        self._index.move_to_end(digest)
        self._salts[entry.tag].move_to_end(digest)

    def _evict(self, digest: bytes) -> None:
        self._forget(digest)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path(digest))

    def _drop(self, digest: bytes) -> None:
        """Forget and delete one object (a corrupt or vanished one)."""
        with self._lock:
            self._evict(digest)

    # -- the tier API ------------------------------------------------------------------------

    def _split(self, helper: ThreadPoolExecutor, count: int, nbytes: int, one: Callable[[int], bool]) -> list[bool]:
        """`one(i)` for i in range(count); on two threads (every other i) for a batch of `SPLIT_BYTES`.

        The helper's half goes back to the caller when the helper has not started it by the time
        the caller is done with its own: a batch never waits for another batch to finish.
        """
        if count < 2 or nbytes < SPLIT_BYTES or self._closed:
            return [one(i) for i in range(count)]
        results = [False] * count

        def every_other(first: int) -> None:
            for i in range(first, count, 2):
                results[i] = one(i)

        odd = helper.submit(every_other, 1)
        try:
            every_other(0)
        finally:
            if odd.cancel():  # the helper is busy with another batch
                every_other(1)
            else:
                odd.result()
        return results

    def write(self, items: Sequence[ChunkWrite]) -> list[bool]:
        """Write each chunk to its own file (skipped when the same chunk is already there)."""
        nbytes = sum(memoryview(item.payload).nbytes for item in items)
        return self._split(self._write_helper, len(items), nbytes, lambda i: self._write_one(items[i]))

    def _write_one(self, item: ChunkWrite) -> bool:
        if self._closed or len(item.fingerprint) > MAX_FINGERPRINT_BYTES - SALT_TAG_BYTES:
            self._counters.add(failed_writes=1)
            return False
        digest = item.digest
        tag = salt_tag(item.salt)
        payload = memoryview(item.payload).cast("B")
        header = encode_header(digest, tag + item.fingerprint, payload)
        size = len(header) + payload.nbytes
        quota = None if self.quota_of is None else self.quota_of(item.salt)
        if size > self.capacity:
            self._counters.add(failed_writes=1)
            return False
        with self._lock:
            entry = self._index.get(digest)
            if entry is not None and entry.length == payload.nbytes and entry.fingerprint == item.fingerprint:
                self._touch(digest, entry)
                return True
            if entry is not None:  # a stale object under this name: it goes, whatever happens next
                self._evict(digest)
            # The salt's quota first, from its own files; then the capacity, from everyone's LRU.
            if quota is not None and not self._make_salt_room(tag, size, quota):
                self._counters.add(failed_writes=1)
                return False
            self._make_room(size)
            if self._used + self._reserved + size > self.capacity:  # the rest is being written now
                self._counters.add(failed_writes=1)
                return False
            self._reserved += size
            self._charge(tag, size)  # counts toward the salt's quota while it is written
        final = self._path(digest)
        tmp = f"{self._tmp_str}/{digest.hex()}.{secrets.token_hex(4)}"
        ok = False
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _OPEN_FLAGS, 0o600)
            try:
                _write_full(fd, [memoryview(header), payload])
            finally:
                os.close(fd)
            with self._lock:
                os.rename(tmp, final)
                ok = True
                self._forget(digest)  # written meanwhile by another thread: the new file replaced it
                self._add(digest, _Entry(size=size, length=payload.nbytes, fingerprint=item.fingerprint, tag=tag))
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            self._counters.add(failed_writes=1, errors=1)
            self._warn("disk_tier_write_failed", path=str(self.directory), error=exc.strerror or str(exc))
        finally:
            with self._lock:
                self._reserved -= size
                self._charge(tag, -size)
        if ok:
            self._counters.add(writes=1, bytes_written=payload.nbytes)
        return ok

    def read(self, refs: Sequence[ChunkRef], into: Sequence[memoryview], *, timeout: float | None = None) -> list[bool]:
        """Read each chunk found into its buffer, checked; ``timeout`` bounds the whole batch."""
        check_batch(refs, into)
        deadline = None if timeout is None else time.monotonic() + timeout

        def one(i: int) -> bool:
            if deadline is not None and time.monotonic() > deadline:
                self._counters.add(late=1, misses=1)
                return False
            hit = self._read_one(refs[i], into[i])
            self._counters.add(**({"hits": 1, "bytes_read": refs[i].length} if hit else {"misses": 1}))
            return hit

        return self._split(self._read_helper, len(refs), sum(ref.length for ref in refs), one)

    def _read_one(self, ref: ChunkRef, buf: memoryview) -> bool:
        if self._closed:
            return False
        digest = ref.digest
        with self._lock:
            entry = self._index.get(digest)
            if entry is None:
                return False
            self._touch(digest, entry)
        fingerprint = entry.tag + ref.fingerprint  # the tag: the name mixes the salt in, so it matches
        if entry.length != ref.length or entry.fingerprint != ref.fingerprint:
            self._corrupt(digest, "length" if entry.length != ref.length else "fingerprint")
            return False
        try:
            fd = os.open(self._path(digest), os.O_RDONLY | _OPEN_FLAGS)
        except FileNotFoundError:  # evicted or deleted since we looked
            return False
        except OSError as exc:
            self._counters.add(errors=1)
            self._warn("disk_tier_read_failed", path=str(self.directory), error=exc.strerror or str(exc))
            return False
        try:
            header = bytearray(FIXED_HEADER_BYTES + len(fingerprint))
            payload = buf.cast("B")
            beyond = bytearray(1)  # a byte read here means the file is longer than its header says
            total = len(header) + payload.nbytes
            got = _read_full(fd, [memoryview(header), payload, memoryview(beyond)], 0, total)
            with contextlib.suppress(OSError):  # the file's mtime is its last use: a restart rebuilds the LRU from it
                os.utime(fd)
        except OSError as exc:
            self._counters.add(errors=1)
            self._warn("disk_tier_read_failed", path=str(self.directory), error=exc.strerror or str(exc))
            return False
        finally:
            os.close(fd)
        try:
            if got != total:
                # Another fingerprint or length makes the header itself a mismatch, so say why.
                check_header(parse_header(header), digest=digest, fingerprint=fingerprint, length=ref.length)
                raise CorruptObjectError("the file is shorter or longer than its header says", reason="length")
            verify(header, payload, digest=digest, fingerprint=fingerprint, length=ref.length)
        except CorruptObjectError as exc:
            self._corrupt(digest, exc.fields.get("reason"))
            return False
        return True

    def _corrupt(self, digest: bytes, reason: str | None) -> None:
        self._counters.add(corrupt=1)
        self._drop(digest)
        log.warning("tier_object_corrupt", tier=self.kind, name=digest.hex(), reason=reason)

    def lengths(self, refs: Sequence[ChunkRef], *, timeout: float | None = None) -> list[int | None]:
        """From the in-memory index: no disk access (so no wait, whatever ``timeout``)."""
        with self._lock:
            found = [self._index.get(ref.digest) for ref in refs]
        return [
            e.length if e is not None and e.fingerprint == ref.fingerprint else None
            for e, ref in zip(found, refs, strict=True)
        ]

    def delete(self, refs: Sequence[ChunkRef]) -> int:
        """Delete these chunks; how many were there."""
        count = 0
        for ref in refs:
            with self._lock:
                present = ref.digest in self._index
            if present:
                self._drop(ref.digest)
                count += 1
        return count

    def clear(self) -> int:
        """Delete every chunk; how many there were."""
        with self._lock:
            digests = list(self._index)
        for digest in digests:
            self._drop(digest)
        return len(digests)

    def salt_bytes(self, salt: str) -> int:
        """Bytes of ``salt``'s files in the tier (headers included), as its quota counts them."""
        with self._lock:
            return self._salt_used.get(salt_tag(salt), 0)

    def stats(self) -> TierStats:
        with self._lock:
            used, objects = self._used, len(self._index)
        return TierStats(
            kind=self.kind,
            state=TierState.DOWN if self._closed else TierState.UP,
            capacity=self.capacity,
            used_bytes=used,
            objects=objects,
            **self._counters.snapshot(),
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._read_helper.shutdown(wait=True)
        self._write_helper.shutdown(wait=True)
        os.close(self._lock_fd)

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
