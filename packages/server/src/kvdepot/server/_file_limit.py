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

from kvdepot.transport import get_logger

log = get_logger(__name__)

# Where the hard limit is "unlimited", the kernel still refuses more than fs.nr_open.
NR_OPEN_PATH = "/proc/sys/fs/nr_open"
NR_OPEN_FALLBACK = 1 << 20  # the kernel's default fs.nr_open
# Descriptors kept for what is not a listener's connection: the standard streams, the pool and its
# headers, libzmq's own (a mailbox per socket, the ZAP handlers), tier files and Redis connections.
RESERVED_FILES = 64
# The cache endpoint's tcp connections take at most this share of what the file limit leaves once
# the other listeners' caps and `RESERVED_FILES` are set aside. The rest covers the connections a
# burst gets accepted before a listener's filter is on, and the tiers' work.
CACHE_FILE_LIMIT_SHARE = 1 / 2


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


def cache_connections(asked: int, reserved: int) -> int:
    """The cache endpoint's connection cap: `asked`, but at most `CACHE_FILE_LIMIT_SHARE` of the soft
    file limit less `reserved` (the other listeners' caps) and `RESERVED_FILES`, and at least 1."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return asked
    share = max(1, int((soft - reserved - RESERVED_FILES) * CACHE_FILE_LIMIT_SHARE))
    if asked <= share:
        return asked
    log.warning("cache_connections_capped", asked=asked, cap=share, file_limit=soft, reserved=reserved)
    return share
