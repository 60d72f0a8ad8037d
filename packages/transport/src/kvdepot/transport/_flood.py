"""What a flood of frames may cost a server endpoint, and the memory it gives back afterwards.

A peer that sends faster than the loop answers has its messages queued by libzmq, per peer, up
to the socket's RCVHWM. That bound counts messages, not bytes, and a message may hold thousands
of frames: every frame costs libzmq a 64-byte message header however small it is. At the
default RCVHWM (1,000) four peers sending messages of 4,096 one-byte frames held 280 MiB, and
libzmq keeps a gone peer's queue until the socket has read it all. `PeerLimits.queue` bounds
the queue; a peer whose frames are not requests at all (`PeerLimits.bad_frames`) is muted a
while, so that its queue is read and dropped, not answered frame by frame.

Memory freed after a flood stays with the C allocator: libzmq's I/O thread allocates from its
own glibc arena, and a freed arena is not given back to the system while anything sits above
the free space (after a flood's peers left, the server still held 109 MiB more than before it;
`malloc_trim` gave all of it back). `MemoryTrim` does so once a quiet moment follows a flood.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import time
from collections.abc import Callable

import attrs

from kvdepot.transport._log import get_logger

log = get_logger(__name__)

#: Messages libzmq queues for one peer before it stops reading that peer's connection (RCVHWM).
#: A client waits for its replies long before it has this many messages in flight; a faster one
#: only waits in its own queue (ZMQ's back-pressure), nothing is lost.
PEER_QUEUE = 16
#: Frames a peer may send in `BAD_WINDOW_S` that are not requests (undecodable, oversized, or a
#: message of no frames or too many) before its messages are discarded unread for `BAD_MUTE_S`.
#: A client of this protocol sends none; one of another version is told so in its Hello.
MAX_BAD_FRAMES = 256
BAD_WINDOW_S = 1.0
BAD_MUTE_S = 1.0
#: Bytes taken in (a frame counts `FRAME_OVERHEAD` beyond its length) after which the first
#: quiet moment of the loop gives the allocator's free memory back to the system.
TRIM_AFTER = 64 << 20
#: libzmq's per-frame cost: a zmq_msg_t, whatever the frame's length (short frames live in it).
FRAME_OVERHEAD = 64
#: Gives back at most this often (seconds): a quiet moment between two bursts is not a flood's end.
MIN_TRIM_INTERVAL_S = 1.0


@attrs.frozen
class PeerLimits:
    """A server endpoint's bounds on what one peer's flood may cost; 0 turns a bound off."""

    queue: int = PEER_QUEUE  # messages queued per peer (RCVHWM)
    bad_frames: int = MAX_BAD_FRAMES  # per peer per BAD_WINDOW_S before it is muted
    trim_after: int = TRIM_AFTER  # bytes taken in before a quiet moment gives memory back

    def __attrs_post_init__(self) -> None:
        for name in ("queue", "bad_frames", "trim_after"):
            if getattr(self, name) < 0:
                raise ValueError(f"PeerLimits.{name} must be 0 (off) or more, not {getattr(self, name)}")


class BadFrames:
    """Bad frames per peer in the current window; says when one passes the limit."""

    def __init__(self, limit: int, max_peers: int) -> None:
        self.limit = limit
        self._max_peers = max_peers
        self._counts: dict[bytes, int] = {}
        self._window_end = 0.0

    def allowed(self, identity: bytes, now: float) -> int | None:
        """Bad frames ``identity`` may still send in this window before it passes the limit
        (None: no limit)."""
        if not self.limit:
            return None
        if now >= self._window_end:
            return self.limit
        return max(0, self.limit - self._counts.get(identity, 0))

    def add(self, identity: bytes, count: int, now: float) -> bool:
        """Counts ``count`` bad frames of ``identity``; True once it has sent more than the limit."""
        if now >= self._window_end or len(self._counts) >= self._max_peers:
            self._counts = {}
            self._window_end = now + BAD_WINDOW_S
        total = self._counts[identity] = self._counts.get(identity, 0) + count
        if self.limit and total > self.limit:
            del self._counts[identity]
            return True
        return False


def _load_malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None where the C library has none (musl, macOS)."""
    with contextlib.suppress(OSError, AttributeError):
        trim = ctypes.CDLL(None).malloc_trim
        trim.argtypes = [ctypes.c_size_t]
        trim.restype = ctypes.c_int
        return trim
    return None


_malloc_trim = _load_malloc_trim()
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_bytes() -> int:
    """This process's resident memory (0 where /proc is not there)."""
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * _PAGE
    return 0


class MemoryTrim:
    """Counts what a flood took in and, at a quiet moment after it, gives free memory back."""

    def __init__(self, after: int, counters: dict[str, int], clock: Callable[[], float] = time.monotonic) -> None:
        self.after = after
        self._counters = counters
        self._clock = clock
        self.taken = 0
        self._last = 0.0
        counters.setdefault("memory_trims", 0)
        counters.setdefault("memory_trimmed_bytes", 0)

    def due(self) -> bool:
        return bool(self.after) and self.taken >= self.after and _malloc_trim is not None

    def run(self) -> None:
        """Gives the allocator's free memory back if a flood's worth was taken in (loop thread, when quiet)."""
        now = self._clock()
        if not self.due() or now - self._last < MIN_TRIM_INTERVAL_S:
            return
        assert _malloc_trim is not None
        before = resident_bytes()
        start = time.perf_counter()
        _malloc_trim(0)
        returned = max(0, before - resident_bytes())
        self._last, self.taken = now, 0
        self._counters["memory_trims"] += 1
        self._counters["memory_trimmed_bytes"] += returned
        log.info("memory_returned", mib=round(returned / 2**20, 1), ms=round((time.perf_counter() - start) * 1e3, 1))
