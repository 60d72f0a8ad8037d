"""The journal of a kept pool: what each slot holds, so that a restarted server can adopt it.

A kept pool (`kvdepot serve`'s default, see `_kept_pool.py`) outlives its server. The slots'
headers say which chunk each holds only as a digest, so the server also appends, for every
slot it hands out and every chunk committed into one, a record to a journal file beside the
pool: the slot, its generation, the salt, the key, the length and, for a committed chunk, a
checksum of its bytes (xxh3-64, as the tiers' objects). A thread writes them, off the loop;
the server's loop only queues them. A restarted server reads the journal and keeps a record
only when the slot's header still says the same (`_adopt.py`).

The file, little endian::

    header   8s magic b"kvdjrnl1", u32 format, u32 slot header bytes, u64 capacity,
             u64 page size, u16 address length, then the address (UTF-8)
    records  u32 body length, u32 crc32 of the body, then the body:
             u8 kind (1 reserved, 2 committed), 7 bytes zero, u64 slot, u64 generation,
             u64 length, u64 checksum (0 for reserved), u16 salt length, u16 key length,
             4 bytes zero, the salt (UTF-8), the key

A record cut short or with a wrong crc ends the journal (a server killed while appending).
When the file grows past twice what its live records need, the thread writes a new one with
those only and renames it into place; a record is live while its slot's header still holds
that generation.
"""

from __future__ import annotations

import contextlib
import os
import queue
import struct
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path

import attrs

from kvdepot.core import SLOT_GENERATION_OFFSET, SLOT_HEADER_BYTES
from kvdepot.server._owner_file import OwnerFileProblem, read_owner_only, write_owner_only
from kvdepot.server._tier_format import payload_checksum
from kvdepot.transport import get_logger

log = get_logger(__name__)

MAGIC = b"kvdjrnl1"
FORMAT_VERSION = 1
RESERVED, COMMITTED = 1, 2
_HEADER = struct.Struct("<8sIIQQH")
_FRAME = struct.Struct("<II")
_BODY = struct.Struct("<B7xQQQQHH4x")
#: Records queued for the thread at most; past it a commit is not journaled (its chunk is not
#: kept across a restart), counted as ``dropped``.
MAX_QUEUED = 1 << 18
#: Records the thread writes with one call at most.
BATCH = 4096
#: The journal is rewritten once it passes twice its live records' bytes and this much.
COMPACT_SLACK = 1 << 20
#: The longest journal a server reads (a million chunks take about 150 MB).
MAX_JOURNAL_BYTES = 1 << 32


@attrs.frozen
class JournalHeader:
    capacity: int
    page_size: int
    address: str
    slot_header_bytes: int = SLOT_HEADER_BYTES
    version: int = FORMAT_VERSION

    def encode(self) -> bytes:
        address = self.address.encode()
        head = _HEADER.pack(MAGIC, self.version, self.slot_header_bytes, self.capacity, self.page_size, len(address))
        return head + address


@attrs.frozen
class Record:
    kind: int
    slot: int
    generation: int
    length: int
    checksum: int
    salt: str
    key: bytes

    def encode(self) -> bytes:
        salt = self.salt.encode()
        body = _BODY.pack(self.kind, self.slot, self.generation, self.length, self.checksum, len(salt), len(self.key))
        body += salt + self.key
        return _FRAME.pack(len(body), zlib.crc32(body)) + body


@attrs.frozen
class JournalContents:
    header: JournalHeader | None  # None: no journal, or not one this build reads
    records: list[Record]
    reason: str = ""  # why there is no header: missing, unreadable, another format

    @property
    def max_generation(self) -> int:
        return max((record.generation for record in self.records), default=0)


def read_journal(path: Path) -> JournalContents:
    """The journal at `path`: its header and every whole record up to the first torn one."""
    try:
        data = read_owner_only(path, MAX_JOURNAL_BYTES)
    except OwnerFileProblem as exc:
        return JournalContents(None, [], f"the journal {path} {exc.what}")
    if data is None:
        return JournalContents(None, [], "no journal")
    if len(data) < _HEADER.size:
        return JournalContents(None, [], "journal cut short")
    magic, version, slot_header_bytes, capacity, page_size, address_length = _HEADER.unpack_from(data)
    if magic != MAGIC or version != FORMAT_VERSION:
        return JournalContents(None, [], f"journal of another format ({magic!r} version {version})")
    start = _HEADER.size + address_length
    address = data[_HEADER.size : start].decode(errors="replace")
    header = JournalHeader(capacity, page_size, address, slot_header_bytes, version)
    return JournalContents(header, list(_records(data, start)))


def _records(data: bytes, offset: int) -> Iterator[Record]:
    view = memoryview(data)
    while offset + _FRAME.size <= len(data):
        length, crc = _FRAME.unpack_from(data, offset)
        body = view[offset + _FRAME.size : offset + _FRAME.size + length]
        if length < _BODY.size or len(body) != length or zlib.crc32(body) != crc:
            return  # torn: the server died while appending it
        kind, slot, generation, chunk_length, checksum, salt_length, key_length = _BODY.unpack_from(body)
        if _BODY.size + salt_length + key_length != length or kind not in (RESERVED, COMMITTED):
            return
        salt = bytes(body[_BODY.size : _BODY.size + salt_length]).decode(errors="replace")
        key = bytes(body[_BODY.size + salt_length :])
        yield Record(kind, slot, generation, chunk_length, checksum, salt, key)
        offset += _FRAME.size + length


def write_journal(path: Path, header: JournalHeader, records: list[Record]) -> None:
    """Write a whole journal beside `path` and rename it into place (0600, never through a symlink)."""
    write_owner_only(path, header.encode() + b"".join(record.encode() for record in records), replace=True)


def _write_all(fd: int, data: bytes | bytearray) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class PoolJournal:
    """A kept pool's journal, written as the server hands out and commits slots.

    The loop calls `reserved` for each slot a reserve hands out and `flush` before the reserve's
    reply: those records are on file before any client may write the slot, so a restart after
    a kill knows every slot a client may still be copying into (and quarantines it). The loop
    calls `committed` and `freed`; a thread takes a committed chunk's checksum in `buffer` (the
    pool), keeps it only when the slot's generation is the same before and after (the chunk may
    be evicted meanwhile), and appends it. A commit the server was killed before writing is not
    adopted: a miss, never a wrong hit.
    """

    def __init__(self, path: Path, header: JournalHeader, buffer: memoryview, records: list[Record]) -> None:
        self.path = path
        self._header = header
        write_journal(path, header, records)
        self._fd = _open_append(path)
        self._lock = threading.Lock()  # the file, between the loop's reserves and the thread
        self._buf = buffer
        self._words = buffer.cast("Q")
        self._live: dict[int, Record] = {r.slot: r for r in records if r.kind == COMMITTED}  # the thread's
        self._pending: dict[int, Record] = {r.slot: r for r in records if r.kind == RESERVED}  # the loop's
        self._unwritten: list[bytes] = []  # reserves to write at the next `flush`
        self._size = os.fstat(self._fd).st_size
        self._compacted_size = self._size
        self._queue: queue.SimpleQueue[Record | None] = queue.SimpleQueue()
        self.dropped = 0  # commits not journaled: the queue was full
        self.written = 0  # records on file
        self._queued = 0  # commits handed to the thread (the loop's count) ...
        self._done = 0  # ... and those it has written or found gone (the thread's)
        self.failed: str | None = None  # why journaling stopped (a write failed)
        self._thread = threading.Thread(target=self._run, name="kvdepot-pool-journal", daemon=True)
        self._thread.start()

    # -- the loop -------------------------------------------------------------------------

    def reserved(self, slot: int, generation: int, salt: str, key: bytes, length: int) -> None:
        record = Record(RESERVED, slot, generation, length, 0, salt, key)
        self._pending[slot] = record
        self._unwritten.append(record.encode())

    def flush(self) -> None:
        """Write the reserves noted since the last flush (before their reply goes out)."""
        if not self._unwritten:
            return
        count, data, self._unwritten = len(self._unwritten), b"".join(self._unwritten), []
        with self._lock:
            self._write(data, count)

    def committed(self, slot: int, generation: int) -> None:
        record = self._pending.pop(slot, None)
        if record is None:
            return
        if self._queue.qsize() >= MAX_QUEUED:
            self.dropped += 1
            return
        self._queued += 1
        self._queue.put(attrs.evolve(record, kind=COMMITTED, generation=generation))

    @property
    def behind(self) -> int:
        """Commits handed to the thread and not on file yet (a kill now would lose them)."""
        return self._queued - self._done

    def freed(self, slot: int) -> None:
        self._pending.pop(slot, None)

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued (at most `timeout` seconds), then stop and let go of the pool."""
        if self._fd < 0:
            return
        self.flush()
        self._queue.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("pool_journal_not_drained", queued=self._queue.qsize())
            return  # the thread still reads the pool: leave the views to the exit
        self._words.release()
        self._buf.release()
        os.close(self._fd)
        self._fd = -1

    # -- the thread -----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            with contextlib.suppress(queue.Empty):
                while len(batch) < BATCH:
                    batch.append(self._queue.get_nowait())
            stop = None in batch
            records = [done for record in batch if record is not None and (done := self._checked(record))]
            if records:
                self._append(records)
            self._done += len(batch) - stop
            if stop:
                return

    def _append(self, records: list[Record]) -> None:
        data = b"".join(record.encode() for record in records)
        with self._lock:
            self._write(data, len(records))
        live = self._live
        for record in records:  # newest last: the order a restart adopts them in
            live.pop(record.slot, None)
            live[record.slot] = record
        if self._size > 2 * self._compacted_size + COMPACT_SLACK:
            self._compact()

    def _checked(self, record: Record) -> Record | None:
        """The commit's record with its checksum, or None when its slot moved on already."""
        word = (record.slot + SLOT_GENERATION_OFFSET) // 8
        if self._words[word] != record.generation:
            return None
        start = record.slot + SLOT_HEADER_BYTES
        checksum = payload_checksum(self._buf[start : start + record.length])
        if self._words[word] != record.generation:
            return None
        return attrs.evolve(record, checksum=checksum)

    def _write(self, data: bytes, records: int) -> None:
        """Append `data` (the lock held); a failure stops journaling, never the server."""
        if self.failed is not None:
            return
        try:
            _write_all(self._fd, data)
        except OSError as exc:
            self.failed = str(exc)
            log.error("pool_journal_failed", error=str(exc), path=str(self.path))
            return
        self._size += len(data)
        self.written += records

    def _compact(self) -> None:
        """A new journal of the live records, renamed into place. It is written without the lock;
        what the loop appended meanwhile is copied over under it, then the file is swapped."""
        with self._lock:
            start = self._size
        words = self._words
        live = {s: r for s, r in self._live.items() if words[(s + SLOT_GENERATION_OFFSET) // 8] == r.generation}
        self._live = live
        pending = list(dict(self._pending).values())  # one copy, under the GIL: the loop changes it
        temporary = self.path.with_name(self.path.name + ".new")
        try:
            write_journal(temporary, self._header, [*live.values(), *pending])
            with self._lock:
                if self.failed is not None:
                    return
                tail = os.pread(self._fd, self._size - start, start) if self._size > start else b""
                fd = _open_append(temporary)
                _write_all(fd, tail)
                os.replace(temporary, self.path)
                os.close(self._fd)
                self._fd = fd
                self._size = self._compacted_size = os.fstat(fd).st_size
        except (OSError, OwnerFileProblem) as exc:
            log.warning("pool_journal_not_compacted", error=str(exc), path=str(self.path))
            self._compacted_size = self._size  # try again once it has doubled


def _open_append(path: Path) -> int:
    """The journal opened to append (and to read back what was appended during a compaction)."""
    return os.open(path, os.O_RDWR | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
