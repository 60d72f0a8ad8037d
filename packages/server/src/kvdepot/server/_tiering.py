"""The tiers below RAM, wired to the index: write-behind after commits, read-through on lookups.

Everything that touches the index runs on the server's loop thread; tier I/O runs on other
threads, which hand their results back through `_post` (a queue the loop drains in `run`).

Write-behind (every committed chunk, written to every tier):
    commit --> pin the chunk (an uncounted lease of the server's own session `TIER_CLIENT`)
           --> WriteBehind queue of each tier --> worker: copy the slot out (checked against the
               slot's header before and after, as a reader would) --> unpin --> write below.
    A chunk therefore leaves RAM only once it was copied for every tier, or deliberately
    dropped: the tier's queue was full, or the tier is down (both counted).

Read-through (a lookup that misses RAM):
    keys past the RAM prefix --> reader thread: each tier in turn reads the chunks still
        missing (one batch per tier), within the deadline --> loop: reserve RAM slots for the
        chunks found that continue the prefix (owned by the asking client), copy them in,
        commit, then answer the lookup as if they had been in RAM (a deferred reply).
    Slots are taken only for chunks found, so a cold prompt evicts nothing from RAM. A chunk
    not found by the deadline is a miss; the engine recomputes it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import attrs
import structlog

from kvdepot.core import SLOT_HEADER_BYTES, slot_digest, slot_header_holds
from kvdepot.server._errors import ServerError
from kvdepot.server._index import ChunkIndex
from kvdepot.server._records import Entry
from kvdepot.server._tiers import ChunkRef, Tier, TierState
from kvdepot.server._write_behind import DeferredWrite, QueuedWrite, WriteBehind
from kvdepot.transport import Deferred
from kvdepot.transport._dispatch import error_reply_from

log = structlog.get_logger(__name__)

#: The server's own session in the index: its leases pin chunks being copied out, its
#: reservations hold the slots that lower-tier reads fill.
TIER_CLIENT = "kvdepot/tiers"
#: How long a lookup waits at most for the lower tiers (seconds), unless `--tier-deadline` says.
DEFAULT_READ_DEADLINE = 0.5


@attrs.define(eq=False)
class _Pin:
    """A chunk pinned in RAM until every tier's worker copied it (or dropped it)."""

    lease_id: int
    waiting: int  # tiers that have not copied it yet


class _Copy:
    """What a tier's writer calls to get a chunk's bytes: a copy out of its slot, checked against
    the slot's header before and after (None when the slot no longer holds the chunk). The
    chunk is unpinned once copied, or once the writer is done with it without copying."""

    def __init__(self, tiers: TierSet, entry: Entry, pin: _Pin) -> None:
        self.tiers, self.pin = tiers, pin
        self.name = (entry.salt, entry.key)
        self.offset, self.length = entry.offset, entry.length
        self.digest = slot_digest(entry.salt, entry.key)
        self._done = False

    def __call__(self) -> bytes | None:
        pool, start = self.tiers.pool, self.offset + SLOT_HEADER_BYTES
        try:
            before = bytes(pool[self.offset : start])
            data = bytes(pool[start : start + self.length])
            after = bytes(pool[self.offset : start])
        finally:
            self.done()
        if before != after or not slot_header_holds(before, self.digest, self.length):
            return None
        return data

    def done(self) -> None:
        if not self._done:
            self._done = True
            self.tiers._post(lambda: self.tiers._unpin(self.name, self.pin))


@attrs.define(eq=False)
class _Read:
    """A deferred lookup waiting for the lower tiers."""

    deferred: Deferred
    client: str
    items: list[tuple[str, Sequence[bytes]]]
    missing: list[tuple[str, list[bytes]]]  # per item: the keys past its RAM prefix
    deadline: float
    size: int
    found: list[list[bytes]] = attrs.field(factory=list)  # per item: the chunks found, in order


class TierSet:
    """The server's tiers below RAM, in the order they are asked (disk before remote)."""

    def __init__(
        self,
        tiers: Sequence[Tier],
        index: ChunkIndex,
        pool: memoryview,
        *,
        wake: Callable[[], None],
        answer: Callable[[Deferred, Any], None],
        lookup: Callable[[str, list[tuple[str, Sequence[bytes]]], float], Any],
        read_deadline: float = DEFAULT_READ_DEADLINE,
    ) -> None:
        self.tiers = list(tiers)
        self.index = index
        self.pool = pool
        self.read_deadline = read_deadline
        self._wake = wake
        self._answer = answer
        self._lookup = lookup
        self._posted: deque[Callable[[], None]] = deque()
        self._pins: dict[tuple[str, bytes], _Pin] = {}
        self._writers = [WriteBehind(t, on_done=self._written) for t in self.tiers]
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="kvdepot-tier-read")
        self._chunk_bytes: int | None = None  # the size of the chunks lower-tier reads bring in
        self.counters = {"read_hits": 0, "read_misses": 0, "reads_deferred": 0, "pins_dropped": 0}
        self._closed = False
        index.touch(TIER_CLIENT, 0.0, "tiers")
        index.on_commit = self._committed

    # -- loop thread ------------------------------------------------------------------------

    def registered(self, chunk_bytes: int) -> None:
        """A client registered chunks of `chunk_bytes`: lower-tier reads bring in chunks of that size."""
        self._chunk_bytes = chunk_bytes

    def run(self) -> None:
        """Apply what the tier threads handed back (loop thread, every pass)."""
        while self._posted:
            try:
                self._posted.popleft()()
            except Exception:  # a bug here must not stop the server: the chunk is only not written below
                log.exception("tier_work_failed")

    def _committed(self, client: str, entries: list[Entry]) -> None:
        """Write-behind: pin the chunks a client just committed and queue them for every tier."""
        if client == TIER_CLIENT or self._closed:
            return  # chunks read from a tier are there already
        now = time.monotonic()
        try:
            self.index.touch(TIER_CLIENT, now, "tiers")  # back if a peer greeting under its id ended it
            outcomes = self.index.lookup(TIER_CLIENT, [(e.salt, [e.key]) for e in entries], now, count=False)
        except ServerError:  # too many pins or sessions: these chunks stay in RAM only, the commit stands
            self.counters["pins_dropped"] += len(entries)
            return
        for entry, outcome in zip(entries, outcomes, strict=True):
            if not outcome.num_hits:
                continue
            name = (entry.salt, entry.key)
            old = self._pins.pop(name, None)
            if old is not None:  # committed again while an older copy is queued: the new pin stands
                self.index.release(TIER_CLIENT, [old.lease_id])
            pin = self._pins[name] = _Pin(outcome.lease_id, len(self._writers))
            for writer in self._writers:
                item = DeferredWrite(entry.salt, entry.key, entry.length, _Copy(self, entry, pin))
                if not writer.submit([item]):
                    self._unpin(name, pin)  # the queue is full: dropped, and counted by the writer

    def _unpin(self, name: tuple[str, bytes], pin: _Pin) -> None:
        pin.waiting -= 1
        if pin.waiting <= 0 and self._pins.get(name) is pin:
            del self._pins[name]
            self.index.release(TIER_CLIENT, [pin.lease_id])

    def lookup(self, client: str, items: list[tuple[str, Sequence[bytes]]], now: float) -> Deferred | None:
        """Start reading the keys past each item's RAM prefix from the tiers; None when there
        is nothing to read (the caller answers from RAM at once)."""
        size = self._chunk_bytes
        if size is None or self._closed or not any(_up(t) for t in self.tiers):
            return None
        prefixes = self.index.prefix_lengths(items)
        missing = [(salt, list(keys[prefix:])) for (salt, keys), prefix in zip(items, prefixes, strict=True)]
        if not any(keys for _, keys in missing):
            return None
        read = _Read(Deferred(), client, items, missing, time.monotonic() + self.read_deadline, size)
        self.counters["reads_deferred"] += 1
        self._reader.submit(self._read, read)
        return read.deferred

    def _finish(self, read: _Read) -> None:
        """Bring the chunks found into RAM and answer the lookup (loop thread)."""
        now = time.monotonic()
        self.index.register(TIER_CLIENT, read.size, now)
        for (salt, keys), found in zip(read.missing, read.found, strict=False):
            self.counters["read_hits"] += len(found)
            self.counters["read_misses"] += len(keys) - len(found)
            if not found:
                continue
            try:
                out = self.index.reserve(TIER_CLIENT, salt, keys[: len(found)], read.size, now, owner=read.client)
            except Exception as exc:  # the pool cannot take them now: a miss
                log.warning("tier_read_not_placed", error=str(exc))
                continue
            for i, offset, length in out.slots:
                self.pool[offset : offset + length] = found[i]
            if out.reservation_id:
                self.index.commit(TIER_CLIENT, out.reservation_id, None, now)
        try:
            reply = self._lookup(read.client, read.items, now)
        except Exception as exc:  # the client left meanwhile, or its leases are at their limit
            reply = error_reply_from(exc)
        self._answer(read.deferred, reply)

    def stats(self) -> dict[str, str | int | float | bool | None]:
        """Each tier's figures and its write queue, flat, for the Stats reply's `extra`."""
        out: dict[str, str | int | float | bool | None] = {f"tier_{k}": v for k, v in self.counters.items()}
        for tier, writer in zip(self.tiers, self._writers, strict=True):
            figures = attrs.asdict(tier.stats())
            figures["state"] = figures["state"].value
            queue = writer.stats()
            figures.update(write_queue=queue.depth, write_dropped=queue.dropped, write_skipped=queue.skipped)
            out.update({f"tier:{tier.kind}:{name}": value for name, value in figures.items() if name != "kind"})
        return out

    def close(self) -> None:
        """Stop the threads; queued writes are dropped (the chunks may still be in RAM)."""
        self._closed = True
        self.index.on_commit = None
        self._reader.shutdown(wait=True, cancel_futures=True)
        for writer in self._writers:
            writer.close(drain=False)
        for tier in self.tiers:
            tier.close()

    # -- tier threads -----------------------------------------------------------------------

    def _post(self, fn: Callable[[], None]) -> None:
        self._posted.append(fn)
        self._wake()

    def _written(self, item: QueuedWrite, ok: bool) -> None:
        """A writer is done with an item: unpin it if its bytes were never copied (dropped at close)."""
        if isinstance(item, DeferredWrite) and isinstance(item.load, _Copy):
            item.load.done()

    def _read(self, read: _Read) -> None:
        """Each tier in turn reads the chunks still missing that continue an item's prefix
        (reader thread): an existence check first (in memory for the disk, one round trip for
        the remote), so a cold prompt costs no transfer and no buffers."""
        chunks: list[dict[int, bytes]] = [{} for _ in read.missing]
        try:
            for tier in self.tiers:
                left = read.deadline - time.monotonic()
                if left <= 0 or not _up(tier):
                    continue
                wanted = [(item, i) for item, (_, keys) in enumerate(read.missing) for i in range(len(keys))]
                wanted = [(item, i) for item, i in wanted if i not in chunks[item]]
                refs = [self._ref(read, item, i) for item, i in wanted]
                present = dict(zip(wanted, tier.contains(refs), strict=True)) if refs else {}
                places = []
                for item, got in enumerate(chunks):
                    i = 0
                    while i in got or present.get((item, i)):
                        if i not in got:
                            places.append((item, i))
                        i += 1
                if not places:
                    continue
                buffers = [bytearray(read.size) for _ in places]
                refs = [self._ref(read, item, i) for item, i in places]
                found = tier.read(refs, [memoryview(b) for b in buffers], timeout=read.deadline - time.monotonic())
                for (item, i), buffer, ok in zip(places, buffers, found, strict=True):
                    if ok:
                        chunks[item][i] = bytes(buffer)
        except Exception:
            log.exception("tier_read_failed")
        finally:
            for got in chunks:
                prefix: list[bytes] = []
                while len(prefix) in got:
                    prefix.append(got[len(prefix)])
                read.found.append(prefix)
            self._post(lambda: self._finish(read))

    @staticmethod
    def _ref(read: _Read, item: int, i: int) -> ChunkRef:
        salt, keys = read.missing[item]
        return ChunkRef(salt, keys[i], length=read.size)


def _up(tier: Tier) -> bool:
    """Whether a tier is worth asking: a tier with no `state` (the disk) always is."""
    return getattr(tier, "state", TierState.UP) is TierState.UP
