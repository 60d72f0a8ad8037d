"""The remote tier's reads: the replies of a batch of GETs taken one at a time, each checked and
copied into its slot before the next is read.

redis-py's pipeline hands back every value of a batch at once, all alive together, each a
fresh allocation the size of a chunk: whether that memory is warm or newly mapped and faulted
in page by page depends on the allocator's state, and a plain pipeline of 1 MiB GETs ran
anywhere from 0.8 to 3 GB/s on a 2-core machine. Landing those values in the slots afterwards
cost another 25-40%. Taking the replies one at a time, through the same redis-py connection
API its pipelines use (`send_packed_command`, `read_response`), frees each value before the
next is parsed, so the parser gets the same warm memory every time, and each value is checked
and copied while it is still in the cache (`benchmarks/tier_bench.py` has the figures).

The GETs are sent a window at a time (`READ_WINDOW_BYTES` of values), the next window before
the replies of the current one are read: the server never waits on the client, and at most
two windows of values sit in its output buffer. In a cluster each window's GETs go to the
nodes that hold their keys, and the replies are read in the batch's order, each from its
key's connection; a reply that redirects (MOVED, ASK, TRYAGAIN, while slots move) is fetched
again through redis-py's cluster pipeline, which follows redirections.

The read runs on the caller's thread, each reply waited for at most until the caller's
deadline (redis-py's per-read socket timeout): handing the read to another thread and back
cost ~10% at 1 MiB chunks on a 2-core machine. Past the deadline the read stops, and replies
still on the way are dropped with their connection: nothing lands in a slot after the read
returns.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import structlog

from kvdepot.server._errors import CorruptObjectError
from kvdepot.server._tier_format import FIXED_HEADER_BYTES, verify
from kvdepot.server._tiers import ChunkRef

log = structlog.get_logger(__name__)

# Bytes of values asked for at once. 16 MiB is ~10 ms on a 10 Gb/s link, where a round trip
# is ~0.1 ms, so the window never starves the link; a read of a whole lookup's misses (up to
# the pool's size) keeps at most two windows in the server's output buffer.
READ_WINDOW_BYTES = 16 << 20


class Landing:
    """The slots of one read and what its replies said."""

    def __init__(self, refs: Sequence[ChunkRef], into: Sequence[memoryview], keys: Sequence[str]) -> None:
        self.refs = refs
        self.into = into
        self.keys = keys
        self.results = [False] * len(refs)
        #: Chunks whose replies were not in by the deadline.
        self.late = 0
        self.corrupt: list[str] = []
        self.failures: list[BaseException] = []

    def land(self, i: int, value: Any) -> None:
        """Take the reply for chunk ``i``: check an object and copy its payload into its slot."""
        if isinstance(value, BaseException):
            self.failures.append(value)
        elif isinstance(value, bytes):  # else absent
            self.results[i] = self._check_and_copy(i, value)

    def _check_and_copy(self, i: int, value: bytes) -> bool:
        ref = self.refs[i]
        view = memoryview(value)
        start = FIXED_HEADER_BYTES + len(ref.fingerprint)
        try:
            verify(view, view[start:], digest=ref.digest, fingerprint=ref.fingerprint, length=ref.length)
        except CorruptObjectError as exc:
            self.corrupt.append(self.keys[i])
            log.warning("tier_object_corrupt", tier="remote", name=ref.digest.hex(), reason=exc.fields.get("reason"))
            return False
        self.into[i].cast("B")[:] = view[start:]
        return True


def windows(lengths: Sequence[int]) -> list[tuple[int, int]]:
    """Split a batch into consecutive (start, stop) windows of at least `READ_WINDOW_BYTES`."""
    found: list[tuple[int, int]] = []
    start = size = 0
    for i, length in enumerate(lengths):
        size += length
        if size >= READ_WINDOW_BYTES:
            found.append((start, i + 1))
            start, size = i + 1, 0
    if start < len(lengths):
        found.append((start, len(lengths)))
    return found


def redirections() -> tuple[type[BaseException], ...]:
    """The replies of a cluster node that send a key elsewhere."""
    from redis.exceptions import AskError, MovedError, TryAgainError

    return (MovedError, AskError, TryAgainError)


def stream_gets(client: Any, landing: Landing, *, cluster: bool, deadline: float, op_timeout: float) -> list[int]:
    """GET every key of ``landing`` on ``client``'s connections and land each reply as it comes.

    A reply not in by ``deadline`` (`time.monotonic`) ends the read: it and the rest count as
    late. Returns the chunks whose replies were redirections, to fetch again; raises the
    client's errors (a connection lost, no reply within ``op_timeout`` seconds). The connections
    go back to their pools, dropped when replies were left unread.
    """
    from redis.exceptions import ResponseError
    from redis.exceptions import TimeoutError as ReplyTimeout

    redirected = redirections()
    keys = landing.keys
    taken: dict[Any, Any] = {}  # pool -> the connection taken from it
    route: list[Any] = [None] * len(keys)  # the connection each key's reply comes on

    def pool_of(key: str) -> Any:
        if cluster:
            return client.get_redis_connection(client.get_node_from_key(key)).connection_pool
        return client.connection_pool

    def send(lo: int, hi: int) -> None:
        commands: dict[Any, list[tuple[str, str]]] = {}
        for i in range(lo, hi):
            pool = pool_of(keys[i])
            if pool not in taken:
                taken[pool] = pool.get_connection()
            route[i] = taken[pool]
            commands.setdefault(route[i], []).append(("GET", keys[i]))
        for conn, batch in commands.items():
            conn.send_packed_command(conn.pack_commands(batch))

    to_fetch: list[int] = []
    spans = windows([ref.length for ref in landing.refs])
    drained = False
    try:
        for w, (lo, hi) in enumerate(spans):
            if w == 0:
                send(lo, hi)
            if w + 1 < len(spans):
                send(*spans[w + 1])
            for i in range(lo, hi):
                left = deadline - time.monotonic()
                try:
                    if left <= 0:
                        raise ReplyTimeout("the read's deadline passed")
                    value = route[i].read_response(timeout=min(left, op_timeout))
                except ResponseError as exc:  # the server's error reply; the connection is still in step
                    value = exc
                except ReplyTimeout:
                    if left >= op_timeout:
                        raise  # no reply in the tier's own timeout: the server is slow or gone
                    landing.late = len(keys) - i
                    return to_fetch
                if isinstance(value, redirected):
                    to_fetch.append(i)
                else:
                    landing.land(i, value)
        drained = True
        return to_fetch
    finally:
        for pool, conn in taken.items():
            if not drained:
                conn.disconnect()
            pool.release(conn)
