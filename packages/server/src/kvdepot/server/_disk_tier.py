"""The disk tier: one file per chunk under a private directory, LRU-evicted by capacity.

The directory, its layout and every file operation are `_disk_files.TierDirectory`'s, the index
of the files (LRU order, per-salt quotas) `_disk_index.DiskIndex`'s; here are the read and write paths.

One file per chunk rather than a few large files: a chunk is hundreds of KiB to MiBs, so a
file's overhead is small; writing to a temporary name and renaming makes every object
appear whole or not at all, with no log to replay; eviction is an unlink that frees the space
at once, with no compaction; and the index rebuilds from the headers alone. The 256
subdirectories keep directories small.

A file removed behind the tier's back is forgotten at its first read and written again when
the chunk is; removed subdirectories are made again; a full file system (ENOSPC) evicts the
least recently used files and tries once more.

Files of a format version this build does not read (a newer build's, found after a
downgrade: `_tier_format`) are left in place at start and never served, evicted or deleted
(only `clear` of every salt removes them, and a write of the same chunk replaces its file).
Their bytes count against the capacity: ``--disk-capacity`` bounds what the directory holds,
whoever wrote it. ``unknown_format`` counts them (and `disk_tier_opened` logs their bytes).

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
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvdepot.server._disk_files import FULL, ObjectFile, TierDirectory, object_path, read_full
from kvdepot.server._disk_index import DiskIndex
from kvdepot.server._errors import CorruptObjectError, TierConfigError, UnknownFormatError
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
from kvdepot.transport import get_logger

log = get_logger(__name__)

# A read or write batch of at least this many bytes is split between two threads.
SPLIT_BYTES = 2 << 20
# Seconds `close` waits for reads and writes under way.
CLOSE_WAIT_S = 5.0


class DiskTier:
    """Chunks in files under ``directory``, at most ``capacity`` bytes of them (headers included)."""

    kind = "disk"
    probes_in_memory = True  # `lengths` reads the in-memory index under a short lock

    def __init__(
        self,
        directory: str | os.PathLike[str],
        capacity: int | None,
        *,
        quota_of: Callable[[str], int | None] | None = None,
    ) -> None:
        """``capacity``: bytes of files at most; None: half of what the file system has free
        besides the tier's own files (so a restart does not shrink it)."""
        if capacity is not None and capacity <= 0:
            raise TierConfigError(f"the disk tier's capacity must be positive, got {capacity}", capacity=capacity)
        self.directory = Path(directory)
        #: The bytes a salt may hold in this tier (its RAM quota; None: no limit of its own).
        #: Called on the writing thread; the server passes the index's quotas.
        self.quota_of = quota_of
        self._warn = WarnLimiter(log)
        self._files = TierDirectory(self.directory, self._warn)
        self._lock = threading.Lock()  # held around every use of the index
        self._busy = 0  # reads and writes under way, which use the directory's descriptor (close waits for them)
        self._index = DiskIndex(lambda digest: self._files.unlink(object_path(digest)))
        self._counters = Counters()
        self._closed = False
        # One helper thread for reads and one for writes (each starts at first use).
        self._read_helper = ThreadPoolExecutor(1, thread_name_prefix="kvdepot-disk-read")
        self._write_helper = ThreadPoolExecutor(1, thread_name_prefix="kvdepot-disk-write")
        removed = self._files.remove_temporaries()
        scan = self._files.scan()
        index = self._index
        index.load(scan.files, scan.unknown)
        self._counters.add(corrupt=scan.broken, unknown_format=len(scan.unknown))
        if capacity is None:  # half of the free space, counting the tier's own files as free
            capacity = max(1, (self._files.free_bytes() + index.used + index.unknown_bytes) // 2)
        index.capacity = capacity
        with self._lock:
            evicted = index.make_room(0)
        log.info(
            "disk_tier_opened",
            path=str(self.directory),
            capacity=capacity,
            chunks=len(index.files),
            used=index.used,
            temporaries_removed=removed,
            corrupt_removed=scan.broken,
            unknown_format_files=len(scan.unknown),
            unknown_format_bytes=index.unknown_bytes,
            evicted=evicted,
        )

    # -- the index (`DiskIndex`, under the lock) -------------------------------------------------

    @property
    def capacity(self) -> int:
        """Bytes of files at most (headers included)."""
        return self._index.capacity

    def _forget_if(self, digest: bytes, entry: ObjectFile) -> None:
        """Forget a file found gone, unless it was written again meanwhile."""
        with self._lock:
            self._index.forget_if(digest, entry)

    def _drop(self, digest: bytes) -> None:
        """Forget and delete one object (a corrupt or vanished one)."""
        with self._lock:
            self._index.evict(digest)

    # -- the tier API ------------------------------------------------------------------------

    def write(self, items: Sequence[ChunkWrite]) -> list[bool]:
        """Write each chunk to its own file (skipped when the same chunk is already there)."""
        nbytes = sum(memoryview(item.payload).nbytes for item in items)
        return _split(self._write_helper, len(items), lambda i: self._write_one(items[i]), split=self._splits(nbytes))

    def _write_one(self, item: ChunkWrite) -> bool:
        if len(item.fingerprint) > MAX_FINGERPRINT_BYTES - SALT_TAG_BYTES or not self._enter():
            self._counters.add(failed_writes=1)
            return False
        try:
            return self._write_entered(item)
        finally:
            self._leave()

    def _write_entered(self, item: ChunkWrite) -> bool:
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
            kept = self._index.use(digest, item.fingerprint, payload.nbytes)
        if kept is not None:
            try:  # already there: a use, for the LRU order of a restart too
                self._files.touch(object_path(digest))
                return True
            except FileNotFoundError:  # removed behind the tier's back: forget it, write it again
                self._forget_if(digest, kept)
            except OSError:
                return True
        with self._lock:
            room = self._index.reserve(digest, tag, size, quota)
        if not room:
            self._counters.add(failed_writes=1)
            return False
        new = ObjectFile(size=size, length=payload.nbytes, fingerprint=item.fingerprint, tag=tag)
        ok = self._write_reserved(digest, new, header, payload)
        if ok:
            self._counters.add(writes=1, bytes_written=payload.nbytes)
        return ok

    def _write_reserved(self, digest: bytes, entry: ObjectFile, header: bytes, payload: memoryview) -> bool:
        """Write the file whose room `DiskIndex.reserve` took (once more after a repair), then give
        the room back to the index: the file's own entry counts it now, if it was written."""
        try:
            for retry in (False, True):
                try:
                    self._put_file(digest, entry, [memoryview(header), payload])  # a new list: a write consumes it
                    return True
                except OSError as exc:
                    if retry or not self._repair(exc, object_path(digest), entry.size):
                        raise
        except OSError as exc:
            self._counters.add(failed_writes=1, errors=1)
            self._warn("disk_tier_write_failed", path=str(self.directory), error=exc.strerror or str(exc))
        finally:
            with self._lock:
                self._index.unreserve(entry.tag, entry.size)
        return False

    def _put_file(self, digest: bytes, entry: ObjectFile, buffers: list[memoryview]) -> None:
        """Write the object to a temporary file and rename it into place; index it."""
        tmp = self._files.write_temporary(digest, buffers)
        try:
            with self._lock:
                self._files.rename(tmp, object_path(digest))
                self._index.replace(digest, entry)  # written meanwhile by another thread, or of another format
        except BaseException:
            self._files.discard(tmp)
            raise

    def _repair(self, exc: OSError, final: str, size: int) -> bool:
        """Whether a write that failed with ``exc`` may be tried once more: its directories were
        removed (made again), or the file system is full (least recently used files evicted)."""
        if isinstance(exc, FileNotFoundError):
            self._files.remake_directories(final)
            return True
        if exc.errno in FULL:
            with self._lock:
                freed = self._index.free(2 * size)
            self._warn("disk_tier_full", path=str(self.directory), evicted_bytes=freed, capacity=self.capacity)
            return freed > 0
        return False

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

        return _split(self._read_helper, len(refs), one, split=self._splits(sum(ref.length for ref in refs)))

    def _splits(self, nbytes: int) -> bool:
        """Whether a batch of ``nbytes`` is split between two threads (`SPLIT_BYTES`; not once closed)."""
        return nbytes >= SPLIT_BYTES and not self._closed

    def _read_one(self, ref: ChunkRef, buf: memoryview) -> bool:
        if not self._enter():
            return False
        try:
            return self._read_entered(ref, buf)
        finally:
            self._leave()

    def _read_entered(self, ref: ChunkRef, buf: memoryview) -> bool:
        digest = ref.digest
        with self._lock:
            entry = self._index.files.get(digest)
            if entry is None:
                return False
            self._index.touch(digest, entry)
        if entry.length != ref.length or entry.fingerprint != ref.fingerprint:
            return False  # another chunk than the one asked for: a miss, and the file stays
        fingerprint = entry.tag + ref.fingerprint  # the tag: the name mixes the salt in, so it matches
        header = bytearray(FIXED_HEADER_BYTES + len(fingerprint))
        payload = buf.cast("B")
        beyond = bytearray(1)  # a byte read here means the file is longer than its header says
        total = len(header) + payload.nbytes
        got = self._read_file(digest, entry, [memoryview(header), payload, memoryview(beyond)], total)
        if got is None:
            return False
        try:
            if got != total:
                # Another fingerprint or length makes the header itself a mismatch, so say why.
                check_header(parse_header(header), digest=digest, fingerprint=fingerprint, length=ref.length)
                raise CorruptObjectError("the file is shorter or longer than its header says", reason="length")
            verify(header, payload, digest=digest, fingerprint=fingerprint, length=ref.length)
        except CorruptObjectError as exc:
            self._corrupt(digest, exc.fields.get("reason"))
            return False
        except UnknownFormatError as exc:  # replaced behind the tier's back since the scan
            self._set_aside(digest, entry, exc)
            return False
        return True

    def _read_file(self, digest: bytes, entry: ObjectFile, buffers: list[memoryview], total: int) -> int | None:
        """Read the object's file into ``buffers`` (up to ``total`` bytes, `read_full`); the bytes
        read, or None when it could not be (a file gone is forgotten, a corrupt one deleted)."""
        try:
            fd = self._files.open_object(object_path(digest))
        except (FileNotFoundError, NotADirectoryError):  # evicted since we looked, or removed behind our back
            self._forget_if(digest, entry)
            return None
        except CorruptObjectError as exc:  # a directory or a FIFO in the file's place
            self._corrupt(digest, exc.fields.get("reason"))
            return None
        except OSError as exc:
            self._read_failed(exc)
            return None
        try:
            got = read_full(fd, buffers, 0, total)
            with contextlib.suppress(OSError):  # the file's mtime is its last use: a restart rebuilds the LRU from it
                os.utime(fd)
        except CorruptObjectError as exc:
            self._corrupt(digest, exc.fields.get("reason"))
            return None
        except OSError as exc:
            self._read_failed(exc)
            return None
        finally:
            os.close(fd)
        return got

    def _read_failed(self, exc: OSError) -> None:
        self._counters.add(errors=1)
        self._warn("disk_tier_read_failed", path=str(self.directory), error=exc.strerror or str(exc))

    def _set_aside(self, digest: bytes, entry: ObjectFile, exc: UnknownFormatError) -> None:
        """A file found of a format this build does not read: out of the index (never evicted),
        still counted against the capacity, and left in place."""
        self._counters.add(unknown_format=1)
        with self._lock:
            self._index.set_aside(digest, entry)
        self._warn("disk_tier_unknown_format", name=digest.hex(), reason=exc.fields.get("reason"))

    def _corrupt(self, digest: bytes, reason: str | None) -> None:
        self._counters.add(corrupt=1)
        self._drop(digest)
        log.warning("tier_object_corrupt", tier=self.kind, name=digest.hex(), reason=reason)

    def lengths(self, refs: Sequence[ChunkRef], *, timeout: float | None = None) -> list[int | None]:
        """From the in-memory index: no disk access (so no wait, whatever ``timeout``)."""
        with self._lock:
            return self._index.lengths(refs)

    def delete(self, refs: Sequence[ChunkRef]) -> int:
        """Delete these chunks; how many were there."""
        count = 0
        for ref in refs:
            with self._lock:
                present = ref.digest in self._index.files
            if present:
                self._drop(ref.digest)
                count += 1
        return count

    def clear(self, salt: str | None = None) -> int:
        """Delete every chunk of ``salt`` (None: of every salt, and the files of a format this
        build does not read, whose salt it cannot tell); how many there were."""
        with self._lock:
            digests = self._index.digests_of(None if salt is None else salt_tag(salt))
            unknown = self._index.forget_unknown() if salt is None else []
        for digest in digests:
            self._drop(digest)
        for digest in unknown:
            self._files.unlink(object_path(digest))
        return len(digests) + len(unknown)

    def salt_bytes(self, salt: str) -> int:
        """Bytes of ``salt``'s files in the tier (headers included), as its quota counts them."""
        with self._lock:
            return self._index.salt_bytes(salt_tag(salt))

    def stats(self) -> TierStats:
        with self._lock:
            used, objects = self._index.used + self._index.unknown_bytes, len(self._index.files)
        return TierStats(
            kind=self.kind,
            state=TierState.DOWN if self._closed else TierState.UP,
            capacity=self.capacity,
            used_bytes=used,
            objects=objects,
            **self._counters.snapshot(),
        )

    def _enter(self) -> bool:
        """Count a read or write under way; False once the tier is closed."""
        with self._lock:
            if self._closed:
                return False
            self._busy += 1
            return True

    def _leave(self) -> None:
        with self._lock:
            self._busy -= 1

    @property
    def state(self) -> TierState:
        """UP until closed: a failing file fails its own read or write, never the whole tier."""
        return TierState.DOWN if self._closed else TierState.UP

    def close(self) -> None:
        """Stop; the directory's descriptor (and lock) goes once no read or write uses it. One
        still under way after `CLOSE_WAIT_S` (a hung disk) keeps it: closing it then could give
        its number to another file, which a late rename would then be relative to."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._read_helper.shutdown(wait=True)
        self._write_helper.shutdown(wait=True)
        deadline = time.monotonic() + CLOSE_WAIT_S
        while self._busy and time.monotonic() < deadline:
            time.sleep(0.01)
        if self._busy:
            log.warning("disk_tier_busy_at_close", path=str(self.directory), operations=self._busy)
            return
        self._files.close()

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _split(helper: ThreadPoolExecutor, count: int, one: Callable[[int], bool], *, split: bool) -> list[bool]:
    """`one(i)` for i in range(count); with ``split``, on two threads (every other i).

    The helper's half goes back to the caller when the helper has not started it by the time
    the caller is done with its own: a batch never waits for another batch to finish.
    """
    if count < 2 or not split:
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
