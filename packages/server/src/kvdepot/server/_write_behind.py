"""Write-behind: the server loop hands chunks to a tier without ever waiting for it.

One `WriteBehind` per tier: a bounded queue and one worker thread that writes batches with
`Tier.write`. `submit` never blocks: an item that does not fit in the queue (by count or by
bytes) is dropped and counted, and the chunk simply stays in RAM only.

A queued item either holds its bytes (`ChunkWrite`, e.g. copied out of the pool) or says how
to get them (`DeferredWrite.load`, called on the worker thread just before the write; it may
return None when the chunk is gone, and the item is skipped). ``on_done(item, ok)`` runs on
the worker thread once per accepted item, after the tier wrote it (ok) or did not (dropped
at close, skipped, failed): the place to unpin a slot or tell the loop the chunk is safe below.

A clear takes a salt's items off the queue (`discard`), then has the worker run the tier's
clear (`call`) before its next batch: after the batch under way, so that no write the server
queued before the clear lands after it.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Callable, Sequence

import attrs

from kvdepot.server._tier_format import Buffer
from kvdepot.server._tiers import ChunkWrite, Tier, WarnLimiter
from kvdepot.transport import get_logger

log = get_logger(__name__)

# Defaults: enough to absorb a burst of stores (a few hundred chunks) without holding much RAM
# beyond the pool; a batch is what one pipeline or one pass over files should carry.
DEFAULT_MAX_ITEMS = 4096
DEFAULT_MAX_BYTES = 1 << 30
DEFAULT_BATCH_ITEMS = 16
DEFAULT_BATCH_BYTES = 32 << 20
#: The part of a queue (items and bytes) one salt may hold: a tenant that commits a burst
#: leaves the rest for the others' chunks, which would otherwise all be dropped behind it.
SALT_SHARE = 0.75


@attrs.frozen
class DeferredWrite:
    """A chunk whose bytes the worker fetches with ``load()`` right before writing it."""

    salt: str
    key: bytes
    length: int
    load: Callable[[], Buffer | None]
    fingerprint: bytes = b""


QueuedWrite = ChunkWrite | DeferredWrite
DoneCallback = Callable[[QueuedWrite, bool], None]


@attrs.frozen
class WriteBehindStats:
    depth: int  # items waiting
    queued_bytes: int
    submitted: int  # items accepted
    written: int
    failed: int  # accepted, then not written (tier down or failing, or dropped at close)
    skipped: int  # `DeferredWrite.load` returned None
    dropped: int  # refused by `submit`: the queue was full
    discarded: int = 0  # taken off the queue unwritten by a clear


class WriteBehind:
    """A bounded queue of writes to ``tier`` and the thread that drains it."""

    def __init__(
        self,
        tier: Tier,
        *,
        max_items: int = DEFAULT_MAX_ITEMS,
        max_bytes: int = DEFAULT_MAX_BYTES,
        batch_items: int = DEFAULT_BATCH_ITEMS,
        batch_bytes: int = DEFAULT_BATCH_BYTES,
        on_done: DoneCallback | None = None,
    ) -> None:
        self.tier = tier
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.batch_items = max(1, batch_items)
        self.batch_bytes = batch_bytes
        self._on_done = on_done
        self._queue: deque[QueuedWrite] = deque()
        self._jobs: deque[Callable[[], None]] = deque()  # run by the worker before its next batch
        self._ahead = 0  # items at the queue's front that were submitted `first`
        self._queued_bytes = 0
        self._salt_items: dict[str, int] = {}  # per salt: items queued
        self._salt_bytes: dict[str, int] = {}  # per salt: bytes queued
        self._in_flight = 0
        self._cond = threading.Condition()
        self._closing = False
        self._submitted = self._written = self._failed = self._skipped = self._dropped = self._discarded = 0
        self._warn = WarnLimiter(log)
        self._thread = threading.Thread(target=self._run, name=f"kvdepot-write-behind-{tier.kind}", daemon=True)
        self._thread.start()

    def submit(self, items: Sequence[QueuedWrite], *, first: bool = False) -> int:
        """Queue ``items`` without blocking; how many were accepted (the others were dropped).
        ``first``: ahead of everything queued (a handoff another node waits for)."""
        accepted = 0
        with self._cond:
            for item in items:
                size = item.length
                own_items = self._salt_items.get(item.salt, 0)
                own_bytes = self._salt_bytes.get(item.salt, 0)
                if (
                    self._closing
                    or len(self._queue) >= self.max_items
                    or (self._queue and self._queued_bytes + size > self.max_bytes)
                    or own_items + 1 > max(1, int(self.max_items * SALT_SHARE))
                    or (own_items and own_bytes + size > self.max_bytes * SALT_SHARE)
                ):
                    self._dropped += 1
                    continue
                if first:  # behind the earlier ones ahead, in their order
                    self._queue.insert(self._ahead, item)
                    self._ahead += 1
                else:
                    self._queue.append(item)
                self._queued_bytes += size
                self._salt_items[item.salt] = own_items + 1
                self._salt_bytes[item.salt] = own_bytes + size
                accepted += 1
            self._submitted += accepted
            if accepted:
                self._cond.notify()
        return accepted

    def discard(self, salt: str | None) -> list[QueuedWrite]:
        """Take the queued writes of ``salt`` (None: all) off the queue, unwritten; they are the
        caller's to finish (``on_done`` is not called for them). The batch under way is not touched."""
        with self._cond:
            gone = [item for item in self._queue if salt is None or item.salt == salt]
            if gone:
                ahead = list(itertools.islice(self._queue, self._ahead))
                self._ahead -= sum(1 for item in ahead if salt is None or item.salt == salt)
                self._queue = deque(item for item in self._queue if salt is not None and item.salt != salt)
                for item in gone:
                    self._unqueued(item)
                    self._queued_bytes -= item.length
                self._discarded += len(gone)
        return gone

    def call(self, job: Callable[[], None]) -> bool:
        """Have the worker run ``job`` before its next batch (after the one under way); False
        once closing (the job never runs). An exception in it is logged."""
        with self._cond:
            if self._closing:
                return False
            self._jobs.append(job)
            self._cond.notify()
        return True

    @property
    def depth(self) -> int:
        return len(self._queue)

    def stats(self) -> WriteBehindStats:
        with self._cond:
            return WriteBehindStats(
                depth=len(self._queue),
                queued_bytes=self._queued_bytes,
                submitted=self._submitted,
                written=self._written,
                failed=self._failed,
                skipped=self._skipped,
                dropped=self._dropped,
                discarded=self._discarded,
            )

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued so far is written (or failed); False at the timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._jobs and not self._in_flight, timeout)

    def close(self, *, drain: bool = False, timeout: float = 5.0) -> None:
        """Stop the worker: after writing what is queued if ``drain``, else failing it (``on_done(item, False)``)."""
        with self._cond:
            if self._closing:
                return
            self._closing = True
            if not drain:
                abandoned = list(self._queue)
                self._queue.clear()
                self._ahead = 0
                self._queued_bytes = 0
                self._salt_items.clear()
                self._salt_bytes.clear()
                self._failed += len(abandoned)
            else:
                abandoned = []
            self._cond.notify_all()
        for item in abandoned:
            self._done(item, ok=False)
        self._thread.join(timeout)

    def _take_batch(self) -> list[QueuedWrite] | Callable[[], None] | None:
        """The next job, else the next batch; None once closing and drained."""
        with self._cond:
            self._cond.wait_for(lambda: self._queue or self._jobs or self._closing)
            if self._jobs:
                self._in_flight = 1
                return self._jobs.popleft()
            if not self._queue:
                return None  # closing and drained
            batch: list[QueuedWrite] = []
            size = 0
            while self._queue and len(batch) < self.batch_items:
                item = self._queue[0]
                if batch and size + item.length > self.batch_bytes:
                    break
                self._queue.popleft()
                self._ahead = max(0, self._ahead - 1)
                size += item.length
                batch.append(item)
                self._unqueued(item)
            self._queued_bytes -= size
            self._in_flight = len(batch)
            return batch

    def _unqueued(self, item: QueuedWrite) -> None:
        """Take an item off its salt's share (lock held)."""
        left = self._salt_items[item.salt] - 1
        if left:
            self._salt_items[item.salt] = left
            self._salt_bytes[item.salt] -= item.length
        else:
            del self._salt_items[item.salt], self._salt_bytes[item.salt]

    def _run(self) -> None:
        while (batch := self._take_batch()) is not None:
            if not isinstance(batch, list):
                self._run_job(batch)
                continue
            writes: list[ChunkWrite] = []
            sources: list[QueuedWrite] = []
            skipped: list[QueuedWrite] = []
            for item in batch:
                write = self._resolve(item)
                if write is None:
                    skipped.append(item)
                else:
                    writes.append(write)
                    sources.append(item)
            results = self._write(writes)
            with self._cond:
                self._written += sum(results)
                self._failed += len(results) - sum(results)
                self._skipped += len(skipped)
            for item in skipped:
                self._done(item, ok=False)
            for item, ok in zip(sources, results, strict=True):
                self._done(item, ok=ok)
            with self._cond:
                self._in_flight = 0
                self._cond.notify_all()

    def _run_job(self, job: Callable[[], None]) -> None:
        try:
            job()
        except Exception as exc:
            self._warn("write_behind_job_failed", tier=self.tier.kind, error=repr(exc))
        with self._cond:
            self._in_flight = 0
            self._cond.notify_all()

    def _resolve(self, item: QueuedWrite) -> ChunkWrite | None:
        if isinstance(item, ChunkWrite):
            return item
        try:
            payload = item.load()
        except Exception as exc:
            self._warn("write_behind_load_failed", tier=self.tier.kind, error=repr(exc))
            return None
        if payload is None:
            return None
        return ChunkWrite(item.salt, item.key, payload, item.fingerprint)

    def _write(self, writes: list[ChunkWrite]) -> list[bool]:
        if not writes:
            return []
        try:
            results = self.tier.write(writes)
        except Exception as exc:  # a tier reports failures as False; anything else is a bug, kept off the loop
            self._warn("write_behind_failed", tier=self.tier.kind, error=repr(exc))
            return [False] * len(writes)
        assert len(results) == len(writes)
        return results

    def _done(self, item: QueuedWrite, *, ok: bool) -> None:
        if self._on_done is None:
            return
        try:
            self._on_done(item, ok)
        except Exception as exc:
            self._warn("write_behind_callback_failed", tier=self.tier.kind, error=repr(exc))
