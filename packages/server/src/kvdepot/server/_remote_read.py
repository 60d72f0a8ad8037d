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

The read runs on a read thread while the caller waits at most until its deadline, whatever
the server does (a reply trickling in, a connection that must be made again to a hung
server). A reply lands only while the caller waits (`Landing`): once it has given up, the
read stops at the next reply, and replies still on the way are dropped with their
connection.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from kvdepot.server._errors import CorruptObjectError, UnknownFormatError
from kvdepot.server._tier_format import FIXED_HEADER_BYTES, verify
from kvdepot.server._tiers import ChunkRef
from kvdepot.transport import get_logger

log = get_logger(__name__)

# Bytes of values asked for at once. 16 MiB is ~10 ms on a 10 Gb/s link, where a round trip
# is ~0.1 ms, so the window never starves the link; a read of a whole lookup's misses (up to
# the pool's size) keeps at most two windows in the server's output buffer.
READ_WINDOW_BYTES = 16 << 20


class Landing:
    """The slots of one read, written by the read thread while the caller waits for them.

    `land` checks one object read back and copies its payload into its slot, under the lock;
    `close` (the caller, at its deadline or when the read is over) takes the lock, so once it
    returns no copy is under way and none starts. The caller waits at most one copy past its
    deadline.
    """

    def __init__(
        self, refs: Sequence[ChunkRef], into: Sequence[memoryview], keys: Sequence[str], fingerprints: Sequence[bytes]
    ) -> None:
        """``fingerprints``: what each object's header must hold (the salt tag, then the ref's)."""
        self.refs = refs
        self.fingerprints = fingerprints
        self.into = into
        self.keys = keys
        self.results = [False] * len(refs)
        self.corrupt: list[str] = []  # keys to delete
        self.unknown = 0  # objects of a format this build does not read: missed, never deleted
        self.failures: list[BaseException] = []
        self._answered = 0  # replies taken: a hit, an absent or corrupt object, or an error
        self._lock = threading.Lock()
        self._open = True

    @property
    def open(self) -> bool:
        return self._open

    def land(self, i: int, value: Any) -> bool:
        """Take the reply for chunk ``i``; False once the caller has stopped waiting (nothing written)."""
        with self._lock:
            if not self._open:
                return False
            self._answered += 1
            if isinstance(value, BaseException):
                self.failures.append(value)
            elif isinstance(value, bytes):  # else absent
                self.results[i] = self._check_and_copy(i, value)
            return True

    def _check_and_copy(self, i: int, value: bytes) -> bool:
        ref = self.refs[i]
        view = memoryview(value)
        fingerprint = self.fingerprints[i]
        start = FIXED_HEADER_BYTES + len(fingerprint)
        try:
            verify(view, view[start:], digest=ref.digest, fingerprint=fingerprint, length=ref.length)
        except CorruptObjectError as exc:
            self.corrupt.append(self.keys[i])
            log.warning("tier_object_corrupt", tier="remote", name=ref.digest.hex(), reason=exc.fields.get("reason"))
            return False
        except UnknownFormatError:  # another build's (a rolling upgrade): theirs, so it stays
            self.unknown += 1
            return False
        self.into[i].cast("B")[:] = view[start:]
        return True

    def close(self) -> int:
        """Stop every later write into the slots; the number of chunks with no reply taken."""
        with self._lock:
            self._open = False
            return len(self.refs) - self._answered


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


def stream_gets(client: Any, landing: Landing, *, cluster: bool) -> list[int]:
    """GET every key of ``landing`` on ``client``'s connections and land each reply as it comes,
    until the caller stops waiting.

    Returns the chunks whose replies were redirections, to fetch again; raises the client's
    errors (a connection lost, no reply within the socket timeout). The connections go back to
    their pools, dropped when replies were left unread.
    """
    from redis.exceptions import ResponseError

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
                try:
                    value = route[i].read_response()
                except ResponseError as exc:  # the server's error reply; the connection is still in step
                    value = exc
                if isinstance(value, redirected):
                    to_fetch.append(i)
                elif not landing.land(i, value):
                    return to_fetch  # the caller gave up: the rest of the replies go with the connection
        drained = True
        return to_fetch
    finally:
        for pool, conn in taken.items():
            if not drained:
                conn.disconnect()
            pool.release(conn)
