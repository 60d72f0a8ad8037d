"""The remote tier: chunks as values in Valkey or Redis, standalone or cluster, through redis-py.

redis-py (with hiredis to parse replies in C) is the maintained reference client; its
`RedisCluster` routes every key to its node and runs one pipeline per node in one round trip,
and it is plain Python, imported here only when a remote tier is configured (`kvdepot serve`
without ``--remote`` never imports it). valkey-glide would add a Rust core with its own
runtime and threads to the server for no gain at these sizes.

Each chunk is one string value, ``PREFIX + object_name(salt, key)``, holding the
`_tier_format` header then the payload; a batch of writes or probes is one pipeline (SET or
STRLEN per chunk), a batch of reads a stream of GETs whose replies are landed one by one
(`_remote_read`). Values may carry a TTL; the server should run with ``maxmemory-policy allkeys-lru``.

Each header's fingerprint starts with the chunk's salt tag (`salt_tag`), as on the disk tier,
so that a clear can find a salt's objects (`_remote_clear`).

Servers of several builds may share one Valkey (a rolling upgrade): an object of a format
version this build does not read (`_tier_format`) is a miss, counted ``unknown_format`` and
never deleted; a corrupt one of a version it reads is deleted.

Quotas: a salt with a quota (`quota_of`) is counted in Valkey itself (`_remote_quota`).

Failure: every command has short socket timeouts and no client-side retries. The connection
and its state live in `_remote_link`: the first connection error or timeout marks the tier
DOWN; while down, reads miss and writes are dropped at once, until the link's thread finds the
server answering again.
Reads run on a small pool of I/O threads, so a caller waits at most its deadline: the chunks
whose replies are not in by then are counted ``late`` and missed, while those in time still hit
(a reply is copied into the caller's buffer only while the caller waits, so a late one never
writes into a slot it gave up).
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

from kvdepot.server._errors import TierConfigError, TierError
from kvdepot.server._remote_clear import clear_objects
from kvdepot.server._remote_link import CONNECT_TIMEOUT, OP_TIMEOUT, RETRY_INTERVAL, RemoteLink
from kvdepot.server._remote_quota import charge, quotas_of
from kvdepot.server._remote_read import Landing, stream_gets
from kvdepot.server._remote_url import RemoteAddress, parse_remote_url
from kvdepot.server._tier_format import FIXED_HEADER_BYTES, Buffer, encode_header, header_size
from kvdepot.server._tiers import (
    SALT_TAG_BYTES,
    ChunkRef,
    ChunkWrite,
    Counters,
    TierState,
    TierStats,
    check_batch,
    object_name,
    salt_tag,
)
from kvdepot.transport import get_logger

log = get_logger(__name__)

#: Prefix of every key kvdepot writes, so a shared server's other data is never touched.
DEFAULT_PREFIX = "kvd:"
# Seconds a read waits when the caller gives no deadline.
READ_TIMEOUT = 1.0
# Bytes of the buffer a writing thread keeps to assemble values in (one WriteBehind batch).
MAX_SCRATCH_BYTES = 64 << 20
# Threads that run reads and probes, so that a caller can stop waiting at its deadline.
READ_WORKERS = 4


class RemoteTier:
    """Chunks in Valkey/Redis at ``url`` (see `parse_remote_url` for the forms and the password)."""

    kind = "remote"
    probes_in_memory = False  # `lengths` is a round trip to Valkey

    def __init__(
        self,
        url: str,
        *,
        prefix: str = DEFAULT_PREFIX,
        password: str | None = None,
        password_file: str | os.PathLike[str] | None = None,
        password_env: str | None = None,
        ssl_ca_certs: str | None = None,
        ttl: float | None = None,
        quota_of: Callable[[str], int | None] | None = None,
        connect_timeout: float = CONNECT_TIMEOUT,
        op_timeout: float = OP_TIMEOUT,
        read_timeout: float = READ_TIMEOUT,
        retry_interval: float = RETRY_INTERVAL,
    ) -> None:
        self.address: RemoteAddress = parse_remote_url(
            url, password=password, password_file=password_file, password_env=password_env
        )
        if ttl is not None and ttl <= 0:
            raise TierConfigError(f"the remote tier's TTL must be positive, got {ttl}", ttl=ttl)
        try:
            import redis  # noqa: F401 - fail here, with the fix, rather than at the first call
        except ImportError as exc:
            raise TierConfigError(
                "the remote tier needs redis-py: pip install 'kvdepot-server[remote]'", url=self.address.display
            ) from exc
        self.prefix = prefix
        #: The bytes a salt may hold in this tier, counted across every server sharing it (None:
        #: no limit of its own). Called on the writing thread; the server passes its quotas.
        self.quota_of = quota_of
        self.ttl_ms = None if ttl is None else max(1, int(ttl * 1000))
        self.read_timeout = read_timeout
        self._counters = Counters()
        self._link = RemoteLink(
            self.address,
            self._counters,
            ssl_ca_certs=ssl_ca_certs,
            connect_timeout=connect_timeout,
            op_timeout=op_timeout,
            retry_interval=retry_interval,
        )
        self._errors, self._warn = self._link.errors, self._link.warn
        self._local = threading.local()  # per writing thread: the scratch buffer of `write`
        self._reads = concurrent.futures.ThreadPoolExecutor(READ_WORKERS, thread_name_prefix="kvdepot-remote-read")

    @property
    def state(self) -> TierState:
        return self._link.state

    def wait_until_up(self, timeout: float) -> bool:
        """Block until the tier is up (tests and start-up checks); False at the timeout."""
        return self._link.wait_until_up(timeout)

    # -- the tier API -------------------------------------------------------------------------

    def _key(self, digest: bytes) -> str:
        return self.prefix + digest.hex()

    def write(self, items: Sequence[ChunkWrite]) -> list[bool]:
        """SET every chunk in one pipeline; all False at once while the tier is down."""
        if not items:
            return []
        current = self._link.current()
        if current is None:
            self._counters.add(failed_writes=len(items))
            return [False] * len(items)
        quotas = quotas_of(self.quota_of, items)
        over = [quotas.get(item.salt) is not None and item.length > quotas[item.salt] for item in items]
        if any(over):  # a chunk larger than its salt's quota is never written
            kept = [item for item, skip in zip(items, over, strict=True) if not skip]
            done = iter(self.write(kept) if kept else [])
            self._counters.add(failed_writes=sum(over))
            return [False if skip else next(done) for skip in over]
        results = self._set_all(*current, items)
        if quotas:
            self._charge(*current, items, results, quotas)
        return results

    def _set_all(self, client: Any, generation: int, items: Sequence[ChunkWrite]) -> list[bool]:
        """SET every chunk in one pipeline, and count what it wrote; per chunk, whether it was."""
        pipe = client.pipeline(transaction=False)
        sizes = self._queue_sets(pipe, items)
        with _Commands(self._link, generation, pipe) as run:
            replies = pipe.execute(raise_on_error=False)
        if run.error is not None:
            if not run.down:
                self._warn("remote_tier_write_failed", url=self.address.display, error=repr(run.error))
            self._counters.add(failed_writes=len(items), errors=1)
            return [False] * len(items)
        results = [reply is True for reply in replies]
        failures = [r for r in replies if isinstance(r, BaseException)]
        written = sum(size for size, ok in zip(sizes, results, strict=True) if ok)
        self._counters.add(
            writes=sum(results),
            bytes_written=written,
            failed_writes=len(results) - sum(results),
            errors=len(failures),
        )
        if failures:  # refused by the server (e.g. out of memory): the tier stays up
            self._failed(generation, failures, "remote_tier_write_failed")
        return results

    def _queue_sets(self, pipe: Any, items: Sequence[ChunkWrite]) -> list[int]:
        """Queue a SET of every chunk's value on ``pipe``; the payload bytes of each."""
        sizes = []
        scratch = self._scratch_for(items)
        offset = 0
        for item in items:
            digest = item.digest
            payload = memoryview(item.payload).cast("B")
            header = encode_header(digest, salt_tag(item.salt) + item.fingerprint, payload)
            # One value per chunk, header then payload, assembled in a buffer this thread reuses:
            # a copy into warm memory costs a tenth of what a fresh allocation's page faults do.
            end = offset + len(header) + payload.nbytes
            if scratch is not None:
                scratch[offset : offset + len(header)] = header
                scratch[offset + len(header) : end] = payload
                value: Buffer = scratch[offset:end]
            else:
                value = b"".join((header, payload))
            offset = end
            pipe.set(self._key(digest), value, px=self.ttl_ms)
            sizes.append(payload.nbytes)
        return sizes

    def _failed(self, generation: int, failures: Sequence[BaseException], event: str) -> None:
        """Commands of a batch failed: the tier goes down when one says the server is gone; else
        (the server refused them) it stays up, and the operator is told as ``event``."""
        if any(isinstance(f, self._link.down_errors) for f in failures):
            self._link.mark_down(generation, failures[0])
        else:
            self._warn(event, url=self.address.display, error=repr(failures[0]))

    def _charge(
        self,
        client: Any,
        generation: int,
        items: Sequence[ChunkWrite],
        results: Sequence[bool],
        quotas: dict[str, int],
    ) -> None:
        """Count the chunks written in their salts' totals and delete what that pushed out."""
        with _Commands(self._link, generation) as run:
            popped = charge(client, self.prefix, items, results, quotas)
        if run.error is not None:
            self._counters.add(errors=1)
            self._warn("remote_tier_quota_failed", url=self.address.display, error=repr(run.error))
            return
        if popped:
            self._delete_keys(client, generation, popped)

    def _scratch_for(self, items: Sequence[ChunkWrite]) -> memoryview | None:
        """This thread's reusable buffer, large enough for the batch's values; None past `MAX_SCRATCH_BYTES`."""
        need = sum(
            FIXED_HEADER_BYTES + SALT_TAG_BYTES + len(i.fingerprint) + memoryview(i.payload).nbytes for i in items
        )
        if need > MAX_SCRATCH_BYTES:
            return None
        buf: bytearray | None = getattr(self._local, "scratch", None)
        if buf is None or len(buf) < need:
            buf = bytearray(max(need, 2 * len(buf) if buf is not None else need))
            self._local.scratch = buf
        return memoryview(buf)

    def _fetch(self, client: Any, generation: int, keys: list[str]) -> list[Any]:
        """One pipeline of GETs, on a read thread."""
        pipe = client.pipeline(transaction=False)
        with _Commands(self._link, generation, pipe) as run:
            for key in keys:
                pipe.get(key)
            return list(pipe.execute(raise_on_error=False))
        raise run.failure()

    def _read_on_thread(self, client: Any, generation: int, landing: Landing) -> None:
        """Stream the GETs and land each reply; those redirected by a moving cluster are fetched
        again through the cluster pipeline. On a read thread."""
        with _Commands(self._link, generation) as run:
            again = stream_gets(client, landing, cluster=self.address.cluster)
        if run.error is not None:
            raise run.failure()
        if again and landing.open:
            values = self._fetch(client, generation, [landing.keys[i] for i in again])
            for i, value in zip(again, values, strict=True):
                if not landing.land(i, value):
                    return

    def read(self, refs: Sequence[ChunkRef], into: Sequence[memoryview], *, timeout: float | None = None) -> list[bool]:
        """GET every chunk and copy the intact ones into ``into``, each as its reply comes in
        (`_remote_read`); those not in by the deadline are late misses, those before still hit."""
        check_batch(refs, into)
        if not refs:
            return []
        current = self._link.current()
        if current is None or self._link.closed:
            self._counters.add(skipped=len(refs), misses=len(refs))
            return [False] * len(refs)
        client, generation = current
        timeout = self.read_timeout if timeout is None else timeout
        keys = [self._key(ref.digest) for ref in refs]
        landing = Landing(refs, into, keys, [salt_tag(ref.salt) + ref.fingerprint for ref in refs])
        future = self._reads.submit(self._read_on_thread, client, generation, landing)
        late = False
        try:
            future.result(timeout=max(0.0, timeout))
        except concurrent.futures.TimeoutError:
            _give_up(future)
            late = True
        except self._errors:  # the tier went down (marked on the read thread): the rest are misses
            pass
        unanswered = landing.close()
        if late and unanswered:
            self._counters.add(late=unanswered)
            self._link.suspect(generation)  # a server this slow may be gone: the link checks it now
        results, failures, corrupt, unknown = landing.results, landing.failures, landing.corrupt, landing.unknown
        if failures:
            self._counters.add(errors=len(failures))
            self._failed(generation, failures, "remote_tier_read_failed")
        hits = sum(results)
        self._counters.add(
            hits=hits,
            misses=len(results) - hits,
            corrupt=len(corrupt),
            unknown_format=unknown,
            bytes_read=sum(ref.length for ref, ok in zip(refs, results, strict=True) if ok),
        )
        if corrupt:
            self._delete_keys(client, generation, corrupt)
        if unknown:
            self._warn("remote_tier_unknown_format", url=self.address.display, objects=unknown)
        return results

    def _delete_keys(self, client: Any, generation: int, keys: list[str]) -> None:
        pipe = client.pipeline(transaction=False)
        with _Commands(self._link, generation, pipe):  # best effort: a failure only tells the link
            for key in keys:
                pipe.delete(key)
            pipe.execute(raise_on_error=False)

    def lengths(self, refs: Sequence[ChunkRef], *, timeout: float | None = None) -> list[int | None]:
        """STRLEN of every chunk in one pipeline, less its header; all None while down, and
        where the answer is not in within ``timeout`` seconds (None: the tier's own timeouts)."""
        if not refs:
            return []
        current = self._link.current()
        if current is None:
            return [None] * len(refs)
        if timeout is None:
            return self._lengths(*current, refs)
        future = self._reads.submit(self._lengths, *current, refs)
        try:
            return future.result(timeout=max(0.0, timeout))
        except concurrent.futures.TimeoutError:
            _give_up(future)
            self._counters.add(late=len(refs))
            self._warn("remote_tier_probe_late", url=self.address.display, timeout_s=round(timeout, 3))
            return [None] * len(refs)

    def _lengths(self, client: Any, generation: int, refs: Sequence[ChunkRef]) -> list[int | None]:
        pipe = client.pipeline(transaction=False)
        with _Commands(self._link, generation, pipe):
            for ref in refs:
                pipe.strlen(self._key(ref.digest))
            return [
                n - header
                if isinstance(n, int) and n > (header := SALT_TAG_BYTES + header_size(ref.fingerprint))
                else None
                for ref, n in zip(refs, pipe.execute(False), strict=True)
            ]
        return [None] * len(refs)

    def delete(self, refs: Sequence[ChunkRef]) -> None:
        """Delete these chunks (best effort; nothing happens while down)."""
        current = self._link.current()
        if current is not None and refs:
            self._delete_keys(current[0], current[1], [self._key(ref.digest) for ref in refs])

    def clear(self, salt: str | None = None) -> int:
        """Delete every object of ``salt`` under this tier's prefix (None: every object), whichever
        server wrote it, and its quota accounting (`_remote_clear`); how many objects went."""
        current = self._link.current()
        if current is None:
            raise TierError(f"the remote tier at {self.address.display} is down", url=self.address.display)
        client, generation = current
        with _Commands(self._link, generation) as run:
            return clear_objects(client, self.prefix, salt)
        self._counters.add(errors=1)
        raise TierError(f"clearing the remote tier failed: {run.error!r}", url=self.address.display) from run.error

    def key_of(self, salt: str, key: bytes) -> str:
        """The key a chunk has on the server (for operators and tests)."""
        return self.prefix + object_name(salt, key)

    def stats(self) -> TierStats:
        capacity, used, objects = self._link.server_figures
        return TierStats(
            kind=self.kind,
            state=self._link.state,
            capacity=capacity,
            used_bytes=used,
            objects=objects,
            **self._counters.snapshot(),
        )

    def close(self) -> None:
        if not self._link.closed:
            self._link.close()
            self._reads.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> RemoteTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Commands:
    """``with _Commands(link, generation, pipe):`` around a client's commands: an error of the
    link's kinds (`RemoteLink.errors`) is told to the link (a connection error or a timeout marks
    it down: ``down``), kept in ``error`` and not raised, so the caller goes on after the block
    with its fallback; ``pipe`` (a pipeline) is reset either way. Any other error propagates."""

    def __init__(self, link: RemoteLink, generation: int, pipe: Any = None) -> None:
        self._link, self._generation, self._pipe = link, generation, pipe
        self.error: BaseException | None = None
        self.down = False

    def __enter__(self) -> _Commands:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> bool:
        try:
            if exc is None or not isinstance(exc, self._link.errors):
                return False
            self.error, self.down = exc, self._link.failed(self._generation, exc)
            return True
        finally:
            if self._pipe is not None:
                self._pipe.reset()

    def failure(self) -> BaseException:
        """The error caught, for a caller that raises it again."""
        assert self.error is not None
        return self.error


def _give_up(future: concurrent.futures.Future[Any]) -> None:
    """The caller stopped waiting: a call no read thread has started yet never runs (while every
    thread waits on a hung server, it would send its commands once the server answers); one
    under way is left to end, its outcome consumed."""
    future.cancel()
    future.add_done_callback(_consume)


def _consume(future: concurrent.futures.Future[Any]) -> None:
    """Retrieve a late read's outcome, so that its exception is never reported as unhandled."""
    if not future.cancelled():
        future.exception()
