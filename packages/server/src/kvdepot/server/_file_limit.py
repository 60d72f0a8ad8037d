"""The process's file limit: `kvdepot serve` raises its soft RLIMIT_NOFILE to the hard limit.

systemd and most shells start a process with a soft limit of 1,024 descriptors, far below the
hard limit. Every client of the cache socket, every metrics connection and every KV-event
subscriber costs one; libzmq aborts the whole process when it cannot get one, so the server
takes every descriptor it is allowed before it opens a socket.
"""

from __future__ import annotations

import contextlib
import resource

import attrs

# Where the hard limit is "unlimited", the kernel still refuses more than fs.nr_open.
NR_OPEN_PATH = "/proc/sys/fs/nr_open"
NR_OPEN_FALLBACK = 1 << 20  # the kernel's default fs.nr_open


@attrs.frozen
class FileLimit:
    """The soft limit before and after `raise_file_limit`, the hard limit, and why not raised."""

    before: int
    soft: int
    hard: int
    error: str | None = None


def _nr_open() -> int:
    with contextlib.suppress(OSError, ValueError), open(NR_OPEN_PATH) as f:
        return int(f.read())
    return NR_OPEN_FALLBACK


def raise_file_limit() -> FileLimit:
    """Set the soft RLIMIT_NOFILE to the hard limit where the kernel allows it."""
    before, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = _nr_open() if hard == resource.RLIM_INFINITY else hard
    if before != resource.RLIM_INFINITY and before >= target:
        return FileLimit(before, before, hard)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (OSError, ValueError) as exc:
        return FileLimit(before, before, hard, str(exc))
    return FileLimit(before, target, hard)
