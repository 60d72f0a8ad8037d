"""Small files of the server's user alone (the salt-label key, the settings file): read only
when they are regular files that nobody else owns or may read, written whole through a
temporary file so that a reader sees the old content or the new, never a part."""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from pathlib import Path


class OwnerFileProblem(Exception):
    """Why an owner-only file cannot be used: ``what`` completes "the file PATH ..." and
    ``reason`` is a word for logs and tests (``unreadable``, ``not_a_file``, ``unsafe``,
    ``cannot_create``); ``fields`` add detail."""

    def __init__(self, what: str, reason: str, **fields: object) -> None:
        super().__init__(what)
        self.what = what
        self.reason = reason
        self.fields = fields


def read_owner_only(path: Path, limit: int) -> bytes | None:
    """At most `limit` bytes of ``path``, or None when there is no such file."""
    # No symlink followed; O_NONBLOCK: a FIFO planted there does not hang the open.
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise OwnerFileProblem(f"cannot be opened ({exc.strerror})", "unreadable") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OwnerFileProblem("is not a regular file", "not_a_file")
        mode = stat.S_IMODE(st.st_mode)
        if st.st_uid != os.getuid() or mode & 0o077:
            raise OwnerFileProblem(
                f"belongs to uid {st.st_uid} with mode {mode:o}; it must be yours alone (`chmod 600 {path}`)",
                "unsafe",
                owner=st.st_uid,
                mode=f"{mode:o}",
            )
        chunks, left = [], limit
        while left > 0 and (data := os.read(fd, left)):
            chunks.append(data)
            left -= len(data)
        return b"".join(chunks)
    finally:
        os.close(fd)


def write_owner_only(path: Path, data: bytes, *, replace: bool) -> None:
    """Write ``data`` to ``path`` whole (mode 0600, in a 0700 directory made if missing).

    With ``replace``, the file takes the new content (renamed over). Without it, a file already
    there is kept: the first writer wins (servers starting at the same moment agree on one)."""
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
    except OSError as exc:
        raise OwnerFileProblem(f"cannot be made ({exc.strerror})", "cannot_create") from exc
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        if replace:
            os.rename(temporary, path)
            return
        try:
            os.link(temporary, path)
        except FileExistsError:
            pass  # another server made it first: its content is the one
        except OSError as exc:
            if exc.errno not in {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP}:
                raise
            os.rename(temporary, path)  # a filesystem without hard links
    except OSError as exc:
        raise OwnerFileProblem(f"cannot be written ({exc.strerror})", "cannot_create") from exc
    finally:
        with contextlib.suppress(FileNotFoundError):
            temporary.unlink()
