"""The disk tier's directory: a descriptor of it, its subdirectories, and the files in them.

Layout of ``DIR`` (0700, this user's alone; flock'ed on the directory itself while a server
uses it, so a second server is kept out)::

    DIR/tmp/NAME.RANDOM      a file being written (removed at start: a crash left it)
    DIR/objects/ab/NAME      a chunk: `_tier_format` header + payload; NAME = object_name(salt, key)

Every file operation is relative to a descriptor of ``DIR`` opened once at start (``openat``
and friends), never to its path: a user who can write a parent of ``DIR`` cannot swap in a
directory of their own and have the tier serve their bytes. ``tmp``, ``objects`` and the 256
subdirectories must be real directories of this user's alone (a symlink is refused), and a
file must be a regular one (opened with ``O_NONBLOCK``, so a FIFO never blocks the tier).

This module knows files, not chunks: which ones the tier holds, their order and their
quotas are `_disk_tier`'s.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import secrets
import stat
from collections.abc import Callable
from pathlib import Path

import attrs

from kvdepot.server._errors import CorruptObjectError, TierConfigError, UnknownFormatError
from kvdepot.server._tier_format import FIXED_HEADER_BYTES, MAX_FINGERPRINT_BYTES, parse_header
from kvdepot.server._tiers import SALT_TAG_BYTES

_NAME = re.compile(r"^[0-9a-f]{64}$")
_OPEN_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC
READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | _OPEN_FLAGS
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | _OPEN_FLAGS
_FAN = [f"{fan:02x}" for fan in range(256)]
#: Errors that mean the file system is full: the tier evicts and tries once more.
FULL = (errno.ENOSPC, errno.EDQUOT)


@attrs.define
class ObjectFile:
    """What the tier knows of one object's file."""

    size: int  # bytes of the file: header and payload
    length: int
    fingerprint: bytes  # the caller's, without the salt tag
    tag: bytes  # `salt_tag` of the chunk's salt


@attrs.define
class Scan:
    """What `TierDirectory.scan` found under objects/."""

    files: list[tuple[float, bytes, ObjectFile]] = attrs.Factory(list)  # (mtime, digest, file): intact
    unknown: dict[bytes, int] = attrs.Factory(dict)  # digest -> bytes of a file of a format this build does not read
    broken: int = 0  # deleted


class _Unknown(Exception):
    """A file of a format this build does not read (`_tier_format`): left in place."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.size = size


def object_path(digest: bytes) -> str:
    """The object's path, relative to the tier's directory (a string: pathlib costs ~10 us a read)."""
    name = digest.hex()
    return f"objects/{name[:2]}/{name}"


class TierDirectory:
    """The tier's directory, opened, locked and checked; its descriptor is `fd`."""

    def __init__(self, path: Path, warn: Callable[..., None]) -> None:
        self.path = path
        self._warn = warn
        self.fd = _open_private_dir(path)
        try:
            self._take_lock()
            for name in ("objects", "tmp", *(f"objects/{fan}" for fan in _FAN)):  # so that a write needs no mkdir
                _private_subdir(self.fd, name, path / name)
        except BaseException:
            os.close(self.fd)
            raise

    def _take_lock(self) -> None:
        """flock the directory itself: a lock file could be removed from under a running server."""
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise TierConfigError(
                f"another kvdepot server uses the disk tier {self.path}; give each server its own --disk-dir",
                path=str(self.path),
            ) from None

    def free_bytes(self) -> int:
        vfs = os.fstatvfs(self.fd)
        return vfs.f_bavail * vfs.f_frsize

    def _listdir(self, name: str) -> list[str]:
        fd = os.open(name, _DIR_FLAGS, dir_fd=self.fd)
        try:
            return os.listdir(fd)
        finally:
            os.close(fd)

    def remove_temporaries(self) -> int:
        """Delete what a crash left in tmp/; how many files."""
        removed = 0
        for name in self._listdir("tmp"):
            try:
                os.unlink(f"tmp/{name}", dir_fd=self.fd)
                removed += 1
            except FileNotFoundError:
                pass
            except OSError as exc:  # a directory someone made there: not the tier's, left alone
                self._warn("disk_tier_stray_entry", path=str(self.path / "tmp" / name), error=exc.strerror)
        return removed

    def scan(self) -> Scan:
        """Every object under objects/: the intact ones, those of a format this build does not
        read (left in place), and how many broken ones were deleted."""
        found = Scan()
        for sub in _FAN:
            for name in self._listdir(f"objects/{sub}"):
                if not _NAME.match(name) or name[:2] != sub:
                    continue
                path = f"objects/{sub}/{name}"
                digest = bytes.fromhex(name)
                try:
                    entry, mtime = self._scan_one(path, digest)
                except _Unknown as unknown:  # a newer build's (a downgrade): its bytes, never deleted
                    found.unknown[digest] = unknown.size
                    continue
                if entry is None:
                    found.broken += 1
                    self.unlink(path)
                    continue
                found.files.append((mtime, digest, entry))
        return found

    def _scan_one(self, path: str, digest: bytes) -> tuple[ObjectFile | None, float]:
        """The file's entry and mtime; None for a broken one. Raises `_Unknown` for a file of a
        format this build does not read."""
        try:
            fd = os.open(path, READ_FLAGS, dir_fd=self.fd)
        except OSError:  # a symlink or a file that vanished: not ours to serve
            return None, 0.0
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):  # a directory, a FIFO: never read
                return None, 0.0
            head = os.pread(fd, FIXED_HEADER_BYTES + MAX_FINGERPRINT_BYTES, 0)
        except OSError:
            return None, 0.0
        finally:
            os.close(fd)
        try:
            header = parse_header(head)
        except UnknownFormatError:
            raise _Unknown(st.st_size) from None
        except CorruptObjectError:
            return None, 0.0
        if (
            header.digest != digest
            or st.st_size != header.object_size
            or len(header.fingerprint) < SALT_TAG_BYTES  # not written by this tier
        ):
            return None, 0.0
        tag, fingerprint = header.fingerprint[:SALT_TAG_BYTES], header.fingerprint[SALT_TAG_BYTES:]
        return ObjectFile(size=header.object_size, length=header.length, fingerprint=fingerprint, tag=tag), st.st_mtime

    def unlink(self, path: str) -> None:
        try:
            os.unlink(path, dir_fd=self.fd)
        except FileNotFoundError:
            pass
        except OSError as exc:  # a directory in a file's place, a read-only file system: left there
            self._warn("disk_tier_unlink_failed", path=str(self.path / path), error=exc.strerror or str(exc))

    def touch(self, path: str) -> None:
        """Mark a file used now (its mtime orders the LRU at a restart); FileNotFoundError if gone."""
        os.utime(path, dir_fd=self.fd, follow_symlinks=False)

    def open_object(self, path: str) -> int:
        """A descriptor of a regular file to read; raises OSError, or CorruptObjectError for
        anything else in its place (a directory, a FIFO)."""
        fd = os.open(path, READ_FLAGS, dir_fd=self.fd)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise CorruptObjectError("not a regular file", reason="type")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def write_temporary(self, digest: bytes, buffers: list[memoryview]) -> str:
        """Write ``buffers`` to a new file under tmp/; its path. Raises OSError (nothing left)."""
        tmp = f"tmp/{digest.hex()}.{secrets.token_hex(4)}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _OPEN_FLAGS, 0o600, dir_fd=self.fd)
            try:
                _write_full(fd, buffers)
            finally:
                os.close(fd)
        except BaseException:
            self.discard(tmp)
            raise
        return tmp

    def rename(self, tmp: str, final: str) -> None:
        os.rename(tmp, final, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def discard(self, tmp: str) -> None:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=self.fd)

    def remake_directories(self, final: str) -> None:
        """Make tmp/ and the directory of ``final`` again, if someone removed them."""
        for name in ("tmp", final.rsplit("/", 1)[0]):
            with contextlib.suppress(OSError):
                os.mkdir(name, 0o700, dir_fd=self.fd)

    def close(self) -> None:
        os.close(self.fd)


def _open_private_dir(path: Path) -> int:
    """A descriptor of ``path``, a directory of this user's alone (made if missing), or raise
    `TierConfigError`."""
    try:
        path.mkdir(mode=0o700, parents=False, exist_ok=True)
        fd = os.open(path, _DIR_FLAGS)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise TierConfigError(f"{path} is not a directory (a symlink is not followed)", path=str(path)) from None
        raise TierConfigError(f"cannot create the disk tier directory {path}: {exc.strerror}", path=str(path)) from exc
    try:
        _check_private(path, os.fstat(fd))
    except BaseException:
        os.close(fd)
        raise
    return fd


def _private_subdir(parent: int, name: str, shown: Path) -> None:
    """Make ``name`` under the directory ``parent`` a directory of this user's alone (made if
    missing), or raise `TierConfigError`; ``shown`` is its path, for the message."""
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o700, dir_fd=parent)
        st = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except OSError as exc:
        raise TierConfigError(f"cannot create {shown}: {exc.strerror}", path=str(shown)) from exc
    _check_private(shown, st)


def _check_private(path: Path, st: os.stat_result) -> None:
    if not stat.S_ISDIR(st.st_mode):
        raise TierConfigError(
            f"{path} is not a directory (a symlink is not followed); remove it, or name another --disk-dir",
            path=str(path),
        )
    if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
        raise TierConfigError(
            f"{path} belongs to uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):o}; the disk tier keeps "
            "tenants' KV bytes and needs a directory of its own user's alone (chmod 700, or name a new one)",
            path=str(path),
            owner=st.st_uid,
        )


def read_full(fd: int, buffers: list[memoryview], offset: int, enough: int) -> int:
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
