"""The shared-memory pool: one file of fixed size under /dev/shm, owner-only, mapped by all.

The server creates the file (mode 0o600, exclusive, never followed through a symlink), sizes
it once with ftruncate and maps it. Clients map the same file by path (`PoolInfo.path` in the
Register reply) with `PoolMapping`, or with plain `mmap` in a few lines. The file's size never
changes, so the pool can never exceed its capacity. Pages of the file take memory only once
someone writes them (tmpfs allocates on first touch).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import mmap
import os
import re
import secrets
import stat
import tempfile
from pathlib import Path
from typing import Protocol

from kvdepot.core import (
    SLOT_GENERATION_OFFSET,
    SLOT_HEADER_BYTES,
    SlotIndexWriter,
    pack_slot_header,
    slot_digest,
    unpack_slot_header,
)
from kvdepot.server._errors import PoolError
from kvdepot.transport import get_logger

log = get_logger(__name__)

SHM_DIR = Path("/dev/shm")  # noqa: S108 - the pool is created O_EXCL|O_NOFOLLOW, 0o600, random name
_STALE_NAME = re.compile(r"^kvdepot-(\d+)-(\d+)-[0-9a-f]+\.(pool|index)$")


def default_pool_dir() -> Path:
    """The shared-memory filesystem where it exists (memory-backed), else the temporary directory."""
    return SHM_DIR if SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK) else Path(tempfile.gettempdir())


def pool_dir_free_bytes(directory: Path | None = None) -> int:
    """Bytes free in the filesystem that holds pools (tmpfs: memory the pool may take)."""
    st = os.statvfs(directory or default_pool_dir())
    return st.f_bavail * st.f_frsize


def remove_stale_pools(directory: Path | None = None) -> list[Path]:
    """Delete pool and slot-index files this user left behind when a server died without cleaning up."""
    directory = directory or default_pool_dir()
    removed: list[Path] = []
    uid = os.getuid()
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        match = _STALE_NAME.match(name)
        if not match or int(match.group(1)) != uid:
            continue
        pid = int(match.group(2))
        if pid == os.getpid() or pid_alive(pid):
            continue
        path = directory / name
        with contextlib.suppress(OSError):
            path.unlink()
            removed.append(path)
    return removed


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (of any user)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class SharedPool:
    """The server's side of the pool: creates, maps, and finally unlinks the file."""

    def __init__(self, path: Path, size: int, fd: int, mapping: mmap.mmap, *, keep: bool = False) -> None:
        self.path = path
        self.size = size
        self._fd = fd
        self._mmap: mmap.mmap | None = mapping
        #: Left in place by `close` (a kept pool, adopted by the next server of its address).
        self.keep = keep

    @classmethod
    def create(cls, size: int, directory: Path | None = None, *, suffix: str = ".pool") -> SharedPool:
        """Create a new pool file of `size` bytes, readable and writable by this user only
        (``suffix`` ".index": the server's slot index, made the same way)."""
        if size <= 0:
            raise PoolError(f"pool size must be positive, got {size}", size=size)
        directory = Path(directory) if directory is not None else default_pool_dir()
        free = pool_dir_free_bytes(directory)
        if size > free:
            raise PoolError(
                f"the pool needs {size} bytes but {directory} has only {free} free; lower --capacity",
                size=size,
                free=free,
            )
        path = directory / f"kvdepot-{os.getuid()}-{os.getpid()}-{secrets.token_hex(6)}{suffix}"
        return cls.create_at(path, size)

    @classmethod
    def create_at(cls, path: Path, size: int, *, keep: bool = False, lock: bool = False) -> SharedPool:
        """Create the pool file `path` (which must not exist), size and map it; with `lock`, hold
        an exclusive lock on it while it is open (a kept pool: one server at a time)."""
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(path, flags, 0o600)
        except OSError as exc:
            raise PoolError(f"cannot create the pool file {path}: {exc.strerror}", path=str(path)) from exc
        try:
            if lock:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.fchmod(fd, 0o600)  # whatever the umask did
            os.ftruncate(fd, size)
            # Reserve every page now: on a full /dev/shm a write into a sparse pool would kill
            # the writer with SIGBUS, and first writes into reserved pages are twice as fast.
            os.posix_fallocate(fd, 0, size)
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            os.close(fd)
            with contextlib.suppress(OSError):
                path.unlink()
            raise PoolError(f"cannot size or map the pool file {path}: {exc.strerror}", path=str(path)) from exc
        log.debug("pool_created", path=str(path), size=size)
        return cls(path, size, fd, mapping, keep=keep)

    @classmethod
    def reopen(cls, path: Path, fd: int, size: int) -> SharedPool:
        """Map a kept pool file this server opened and locked (`fd`, of exactly `size` bytes)."""
        try:
            os.posix_fallocate(fd, 0, size)  # its pages may have been given back (a sparse copy)
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            os.close(fd)
            raise PoolError(f"cannot map the kept pool file {path}: {exc.strerror}", path=str(path)) from exc
        log.debug("pool_reopened", path=str(path), size=size)
        return cls(path, size, fd, mapping, keep=True)

    @property
    def buffer(self) -> memoryview:
        """The whole pool as a writable memoryview (release it before `close`)."""
        assert self._mmap is not None, "pool is closed"
        return memoryview(self._mmap)

    @property
    def closed(self) -> bool:
        return self._mmap is None

    def intact(self) -> bool:
        """False once the file is shorter than the pool (someone truncated it): its slots are gone,
        and touching them would kill every process that maps them (SIGBUS)."""
        return self._mmap is not None and os.fstat(self._fd).st_size >= self.size

    def close(self) -> None:
        """Unmap and delete the file (a kept pool's stays); clients that still map it keep their
        mapping until they unmap."""
        if self._mmap is None:
            return
        with contextlib.suppress(BufferError):  # a view still exported: the OS unmaps at exit
            self._mmap.close()
        self._mmap = None
        os.close(self._fd)
        if self.keep:
            log.debug("pool_kept", path=str(self.path))
            return
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        log.debug("pool_removed", path=str(self.path))

    def __enter__(self) -> SharedPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_pool_file(path: str | os.PathLike[str], *, writable: bool = True) -> int:
    """Open a pool file to map it: never through a symlink, and only one that is this user's alone.

    A pool file another user owns, or that others may read, could be a trap set to collect
    this user's KV bytes (or feed it others'): `PoolError`, and nothing is mapped.
    """
    flags = (os.O_RDWR if writable else os.O_RDONLY) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise PoolError(f"cannot open the pool file {path}: {exc.strerror}", path=str(path)) from exc
    st = os.fstat(fd)
    if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
        os.close(fd)
        raise PoolError(
            f"the pool file {path} belongs to uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):o}; a kvdepot "
            "server of yours makes it yours alone (0600): it is not mapped",
            path=str(path),
            owner=st.st_uid,
        )
    return fd


class PoolMapping:
    """A client's mapping of the pool, by path and size from the Register reply.

    `view(offset, length)` is a zero-copy memoryview for writing (after Reserve) or reading
    (after Lookup) one chunk slot.
    """

    def __init__(self, path: str | os.PathLike[str], size: int, *, writable: bool = True) -> None:
        fd = open_pool_file(path, writable=writable)
        try:
            actual = os.fstat(fd).st_size
            if actual < size:
                raise PoolError(
                    f"the pool file {path} has {actual} bytes, the server announced {size}; is it the same server?",
                    path=str(path),
                    size=size,
                    actual=actual,
                )
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            self._mmap: mmap.mmap | None = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=prot)
        finally:
            os.close(fd)
        self.path = str(path)
        self.size = size
        self._view = memoryview(self._mmap)
        self._anchor: ctypes.Array[ctypes.c_char] | None = None

    @property
    def address(self) -> int:
        """The virtual address of the mapping's first byte in this process.

        For native copies (`ctypes.memmove`, which releases the GIL) and for registering the
        pool with a device (e.g. cudaHostRegister). Valid until `close()`.
        """
        if self._anchor is None:
            assert self._mmap is not None, "pool mapping is closed"
            self._anchor = (ctypes.c_char * self.size).from_buffer(self._mmap)
        return ctypes.addressof(self._anchor)

    def view(self, offset: int, length: int) -> memoryview:
        """The bytes of one slot, without copying."""
        if offset < 0 or length < 0 or offset + length > self.size:
            raise PoolError(f"slot [{offset}, {offset + length}) lies outside the pool of {self.size} bytes")
        return self._view[offset : offset + length]

    def write(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        self.view(offset, len(data))[:] = data

    def read(self, offset: int, length: int) -> bytes:
        return bytes(self.view(offset, length))

    def close(self) -> None:
        if self._mmap is None:
            return
        self._view.release()
        self._anchor = None
        with contextlib.suppress(BufferError):
            self._mmap.close()
        self._mmap = None

    def __enter__(self) -> PoolMapping:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SlotJournal(Protocol):
    """Where a kept pool's slots are journaled (`_pool_journal.PoolJournal`)."""

    def reserved(self, slot: int, generation: int, salt: str, key: bytes, length: int) -> None: ...

    def flush(self) -> None: ...

    def committed(self, slot: int, generation: int) -> None: ...

    def freed(self, slot: int) -> None: ...


class SlotHeaders:
    """Writes the header in front of each slot (`kvdepot.core.SLOT_HEADER_BYTES`) into the pool.

    ``slot`` is the offset of a slot's header, the chunk's bytes follow it. A generation is
    stored with one aligned 8-byte write (a memoryview of 8-byte words), so a reader never
    sees half of one. Without a buffer (unit tests of the index) it writes nothing. With a
    ``slot_index`` (`kvdepot.core.SlotIndexWriter`), every committed slot is in it until it is
    freed, so that engines on the node find chunks without a round trip.
    """

    def __init__(
        self,
        buffer: memoryview | None = None,
        *,
        journal: SlotJournal | None = None,
        generation: int = 1,
        slot_index: SlotIndexWriter | None = None,
    ) -> None:
        self._buf = buffer
        self._words = buffer.cast("Q") if buffer is not None else None
        self._generation = generation | 1  # the last odd generation handed out; +1 is its committed one
        #: A kept pool's journal (`_pool_journal.py`): told of every slot handed out, committed, freed.
        self._journal = journal
        self._slot_index = slot_index

    def follow(self, journal: SlotJournal, generation: int) -> None:
        """Journal every slot from now on, with generations past `generation` (a kept pool's,
        whose slots may hold generations up to it from the servers before)."""
        self._journal = journal
        self._generation = max(self._generation, generation | 1)

    def writing(self, slot: int, salt: str, key: bytes, length: int) -> None:
        """The slot now belongs to a reservation: odd generation first, then what it will hold."""
        if self._buf is None or self._words is None:
            return
        self._unindex(slot)
        self._generation += 2
        self._words[(slot + SLOT_GENERATION_OFFSET) // 8] = self._generation
        self._buf[slot : slot + SLOT_HEADER_BYTES] = pack_slot_header(self._generation, length, slot_digest(salt, key))
        if self._journal is not None:
            self._journal.reserved(slot, self._generation, salt, key, length)

    def flush(self) -> None:
        """The slots handed out so far are on file (a reserve calls it before its reply)."""
        if self._journal is not None:
            self._journal.flush()

    def published(self, slot: int) -> None:
        """The slot's chunk is committed: its generation becomes even."""
        if self._words is not None:
            word = (slot + SLOT_GENERATION_OFFSET) // 8
            self._words[word] += 1
            if self._journal is not None:
                self._journal.committed(slot, self._words[word])
            self.indexed(slot)

    def indexed(self, slot: int) -> None:
        """Put a committed slot in the slot index (at commit, and a kept pool's adopted ones)."""
        if self._slot_index is not None and (held := self._held(slot)) is not None:
            generation, length, digest = held
            if generation % 2 == 0:
                self._slot_index.add(digest, slot + SLOT_HEADER_BYTES, length)

    def _unindex(self, slot: int) -> None:
        """Take the slot's chunk out of the slot index (before its header changes)."""
        if self._slot_index is not None and (held := self._held(slot)) is not None:
            self._slot_index.remove(held[2], slot + SLOT_HEADER_BYTES)

    def _held(self, slot: int) -> tuple[int, int, bytes] | None:
        """What the slot's header says it holds."""
        return None if self._buf is None else unpack_slot_header(self._buf[slot : slot + SLOT_HEADER_BYTES])

    def freed(self, slot: int) -> None:
        """The slot left the index (evicted, cleared, aborted, expired): a new odd generation."""
        if self._words is not None:
            self._unindex(slot)
            self._generation += 2
            self._words[(slot + SLOT_GENERATION_OFFSET) // 8] = self._generation
            if self._journal is not None:
                self._journal.freed(slot)

    def close(self) -> None:
        """Let go of the pool's memory (before the pool closes)."""
        if self._words is not None and self._buf is not None:
            self._words.release()
            self._buf.release()
        self._words = self._buf = None
