"""A kept pool: the shared-memory pool that outlives its server, adopted by the next one.

`kvdepot serve` keeps its pool by default. The pool file and its journal (`_pool_journal.py`)
are named after the server's address, in the pool directory::

    kvdepot-<uid>-kept-<first 16 hex digits of sha256(address)>.pool
    kvdepot-<uid>-kept-<...>.journal

A stop (SIGTERM), a kill (SIGKILL) or a crash leaves both behind; the next server of the
same address, pool directory, capacity and page size opens them and adopts what verifies
(`_adopt.py`). The server holds an exclusive lock (flock) on the pool file while it runs, so
a second server of the address never touches a pool in use; the kernel drops the lock when
the process dies, however it dies.

The file must be this user's alone (mode 0600, never reached through a symlink): a file of
that name another user made in the shared directory is not adopted, and the server falls
back to a pool of its own under a random name, for this run only. A pool of another capacity
or page size, or without a journal this build reads, is discarded with a warning that says
why (the old file is unlinked, so a client still mapping it keeps its mapping, and a new one
is made): changing `--capacity` restarts empty rather than refusing to start.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path

import attrs

from kvdepot.server._adopt import Adopter, Adoption, adopt
from kvdepot.server._errors import PoolError, ServerArgumentError
from kvdepot.server._pool import SharedPool, SlotHeaders
from kvdepot.server._pool_journal import COMMITTED, JournalContents, JournalHeader, PoolJournal, read_journal
from kvdepot.transport import get_logger

log = get_logger(__name__)

_KEPT_NAME = re.compile(r"^kvdepot-(\d+)-kept-([0-9a-f]{16})\.pool$")


def kept_pool_path(directory: Path, address: str) -> Path:
    """The kept pool file of the server at `address`."""
    digest = hashlib.sha256(address.encode()).hexdigest()[:16]
    return directory / f"kvdepot-{os.getuid()}-kept-{digest}.pool"


def journal_path(pool_path: Path) -> Path:
    return pool_path.with_suffix(".journal")


@attrs.frozen
class KeptLayout:
    """What a kept pool left behind was made with, and the bytes its file takes."""

    capacity: int
    page_size: int
    file_bytes: int


def kept_layout(directory: Path, address: str) -> KeptLayout | None:
    """The kept pool of `address` in `directory`, when there is one this user may adopt: a
    restart without --capacity or --page-size takes its layout (the default capacity moves with
    the free memory, and a pool of another capacity is discarded), and its file's bytes count as
    free (they are the new pool's)."""
    path = kept_pool_path(directory, address)
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
        return None
    header = read_journal(journal_path(path)).header
    if header is None or header.address != address:
        return None
    return KeptLayout(header.capacity, header.page_size, st.st_blocks * 512)


@attrs.frozen
class KeptPool:
    """The pool a server maps, and what its journal holds to adopt (nothing when it starts fresh)."""

    pool: SharedPool
    journal: JournalContents  # its header is None for a pool that is not kept
    fresh: str = ""  # why nothing is adopted ("" when the journal's records are candidates)

    def adopt_into(self, index: Adopter, headers: SlotHeaders, now: float) -> tuple[Adoption, PoolJournal | None]:
        """Take back what verifies into `index`, and journal from now on through `headers`."""
        header = self.journal.header
        if header is None:
            return Adoption(fresh=self.fresh), None
        adoption, records = adopt(index, self.pool.buffer, [] if self.fresh else self.journal.records, now)
        adoption = attrs.evolve(adoption, fresh=self.fresh)
        for record in records:
            if record.kind == COMMITTED:
                headers.indexed(record.slot)  # engines find what was taken back without a round trip
        journal = PoolJournal(journal_path(self.pool.path), header, self.pool.buffer, records)
        headers.follow(journal, self.journal.max_generation + 2)
        if self.fresh:
            log.info("pool_fresh", path=str(self.pool.path), reason=self.fresh)
        else:
            log.info(
                "pool_adopted",
                path=str(self.pool.path),
                chunks=adoption.chunks,
                bytes=adoption.bytes,
                pending=adoption.pending,
                dropped=adoption.dropped_total,
                **{f"dropped_{why}": count for why, count in sorted(adoption.dropped.items())},
                seconds=round(adoption.seconds, 3),
            )
        return adoption, journal


def open_pool(directory: Path, address: str, size: int, page_size: int, *, keep: bool, fresh: bool) -> KeptPool:
    """The server's pool: its address's kept pool (`keep`), else a new one for this run only,
    as also when the kept pool's file is not this user's alone."""
    if keep:
        try:
            return open_kept_pool(directory, address, size, page_size, fresh=fresh)
        except PoolError as exc:
            log.warning("kept_pool_unusable", reason=exc.message, fallback="a pool for this run only")
            reason = exc.message
    else:
        reason = "not kept (--no-keep-pool)"
    return KeptPool(SharedPool.create(size, directory), JournalContents(None, [], reason), reason)


def open_kept_pool(directory: Path, address: str, size: int, page_size: int, *, fresh: bool = False) -> KeptPool:
    """Open (or make) the kept pool of `address`; `fresh` discards whatever it holds.

    `ServerArgumentError` when another server holds it; `PoolError` when the file there is not
    this user's alone (the caller falls back to a pool of its own)."""
    path = kept_pool_path(directory, address)
    flags = os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return _new(path, size, page_size, address, "no kept pool")
    except OSError as exc:
        raise PoolError(f"cannot open the kept pool file {path}: {exc.strerror}", path=str(path)) from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
            raise PoolError(
                f"the kept pool file {path} belongs to uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):o}; "
                "it is not adopted",
                path=str(path),
                owner=st.st_uid,
            )
        _lock(fd, path)
    except BaseException:
        os.close(fd)
        raise
    journal = read_journal(journal_path(path))
    why = _why_not(journal, st.st_size, size, page_size, address, fresh=fresh)
    if why:
        os.close(fd)
        return _new(path, size, page_size, address, why)
    return KeptPool(SharedPool.reopen(path, fd, size), journal)


def _lock(fd: int, path: Path) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise ServerArgumentError(
            f"another kvdepot server uses the kept pool {path} (same --address and --pool-dir): stop it first",
            path=str(path),
        ) from None


def _why_not(journal: JournalContents, actual: int, size: int, page_size: int, address: str, *, fresh: bool) -> str:
    """Why the pool there is not adopted ("" when it is)."""
    header = journal.header
    if fresh:
        return "--fresh-pool"
    if header is None:
        return journal.reason
    if actual != size or header.capacity != size:
        return f"its capacity was {header.capacity} bytes, this server's is {size}"
    if header.page_size != page_size:
        return f"its page size was {header.page_size} bytes, this server's is {page_size}"
    if header.address != address:
        return "its journal names another address"
    return ""


def _new(path: Path, size: int, page_size: int, address: str, why: str) -> KeptPool:
    """A new, empty kept pool at `path` (the old file, if any, unlinked first)."""
    for old in (path, journal_path(path)):
        with contextlib.suppress(FileNotFoundError):
            old.unlink()
    try:
        pool = SharedPool.create_at(path, size, keep=True, lock=True)
    except PoolError as exc:
        if isinstance(exc.__cause__, BlockingIOError):
            raise ServerArgumentError(f"another kvdepot server uses the kept pool {path}", path=str(path)) from exc
        raise
    header = JournalHeader(size, page_size, address)
    return KeptPool(pool, JournalContents(header, []), why)


def remove_abandoned_pools(directory: Path) -> list[Path]:
    """Delete this user's kept pools no server can adopt again: their ipc address's directory
    is gone (a test's, a removed run directory's). A pool in use (locked) is never touched."""
    removed: list[Path] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    uid = str(os.getuid())
    for name in names:
        match = _KEPT_NAME.match(name)
        if not match or match.group(1) != uid:
            continue
        path = directory / name
        header = read_journal(journal_path(path)).header
        if header is None or not header.address.startswith("ipc://"):
            continue
        if Path(header.address.removeprefix("ipc://")).parent.is_dir():
            continue
        with contextlib.suppress(OSError), _locked(path) as locked:
            if locked:
                path.unlink()
                journal_path(path).unlink(missing_ok=True)
                removed.append(path)
    return removed


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[bool]:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)
