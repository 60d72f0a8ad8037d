"""The tiers below RAM, fed by the index's events: write-behind after commits, read-through on lookups.

Everything that touches the index runs on the server's loop thread; tier I/O runs on other
threads, which hand their results back through `_post` (a queue the loop drains in `run`).

Write-behind (every committed chunk, written to every tier):
    index: Committed events --> loop (`take`, after the request that committed): pin the chunk
           (`ServerHolds.tier_lease`: a lease of the server's own `TIER_CLIENT`) --> WriteBehind
           queue of each tier --> worker: copy the slot out (checked against the slot's header
           before and after, as a reader would) --> post: unpin --> write below.
    A chunk therefore leaves RAM only once it was copied for every tier, or deliberately
    dropped: the tier's queue was full, or the tier is down (both counted). A chunk committed
    with a pin (a prefill engine's handoff, which a decode engine on another node waits for)
    goes ahead of the queue.

Read-through (a lookup or a Query that misses RAM): `ReadBook` (`_tier_read.py`) decides every
    move of every read; this module only executes what it asks (`_act`), as the transport's
    client executes its connection's events:
    loop (`lookup`): the RAM prefixes (`ChunkIndex.prefix_lengths`) --> book: a `LookupRead`,
        `LeasePrefixes` (the loop leases them: `ServerHolds.tier_lease`), `Probe` --> reader:
        `probe` which keys past the RAM prefix each tier holds, and at what length (the disk's
        index, a STRLEN pipeline on the remote; a window of keys at a time, so the first key no
        tier holds ends the probe) --> book (`probed`): the deadline follows from the longest
        run held (`deadline_for`); `Reserve` RAM slots of that length for those runs (owned by
        the asking client: `ServerHolds.tier_reserve`) --> book (`placed`): `Fill` --> reader:
        `fill` them straight from the tiers (one batch per tier, within the deadline; where a
        read fails, the next tier that holds the chunk is asked) --> book (`filled`): `Settle`
        each reservation (commit the slots filled, abort the others), the `LookupAnswer`
        (`run` returns it; the server answers from RAM as if they had been there), `Release`
        the prefix leases.
    That is two hand-offs to the reader and two back. Slots are taken only for chunks a tier
    holds, so a cold prompt evicts nothing from RAM. A chunk not in by the deadline is a miss,
    the chunks before it still hit: the engine recomputes from there. Each run is read at the
    length its tier holds: engines of other models or layouts on one server store chunks of
    other sizes, and a chunk's name (its namespace covers the model and the layout) fixes
    which size it has. A Query (`query`) is a `QueryRead`: probed only, on the loop when every
    tier up answers from memory, else by the reader; answered with the runs found.

Clear (`clear`, after the handler cleared RAM): mark the clear (a read from below that began
    before it is a miss), have each tier's writer clear it after the batch it is on, count
    each tier's outcome on the loop (`TierClear.done`), and after the last, mark it again and
    hand out the `ClearAnswer`.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from kvdepot.core import SLOT_HEADER_BYTES, slot_digest, slot_header_holds
from kvdepot.server._errors import ServerError
from kvdepot.server._events import Committed, IndexEvent
from kvdepot.server._holds import TIER_CLIENT
from kvdepot.server._index import ADOPTED_CLIENT, ChunkIndex
from kvdepot.server._label_key import random_labeler
from kvdepot.server._tier_read import (
    MAX_READ_KEYS_PER_CLIENT,
    Fill,
    LeasePrefixes,
    LookupAnswer,
    LookupRead,
    Probe,
    Probed,
    QueryAnswer,
    ReadBook,
    Release,
    Reserve,
    Settle,
    TierRead,
    Warn,
)
from kvdepot.server._tier_reader import Reader, fill, probe, up
from kvdepot.server._tiers import Tier, WarnLimiter
from kvdepot.server._write_behind import DeferredWrite, QueuedWrite, WriteBehind
from kvdepot.transport import Deferred, get_logger

log = get_logger(__name__)

#: Re-exported: the handler answers these, and tests bound the reads by it.
__all__ = ["MAX_READ_KEYS_PER_CLIENT", "TIER_CLIENT", "Answer", "ClearAnswer", "LookupAnswer", "QueryAnswer", "TierSet"]

#: Commits the tiers do not write below: their own (read from below), and a kept pool's chunks
#: taken back at start (written below before, when the last server committed them).
_NOT_WRITTEN_BELOW = frozenset({TIER_CLIENT, ADOPTED_CLIENT})
#: How long a lookup waits at most for the lower tiers (seconds), unless `--tier-deadline` says.
DEFAULT_READ_DEADLINE = 0.5
#: ... and, when set, at most this per chunk of the longest run the tiers hold past the RAM
#: prefix (seconds): the prefill one chunk costs, so a short hit is never waited for longer
#: than the prefill it saves. Off by default: only the operator knows the model's prefill
#: speed (256 tokens take ~10 ms on a GPU for a 1B model, seconds on a CPU), and a figure set
#: too low turns healthy hits into misses (a cold read-pool connection alone takes ~50 ms).
DEFAULT_READ_DEADLINE_PER_CHUNK: float | None = None


@attrs.frozen
class ClearAnswer:
    """A Clear every tier is done with (or failed): what RAM and the tiers removed."""

    deferred: Deferred
    cleared: TierClear


#: What the tiers hand the loop to answer (`TierSet.run`).
Answer = LookupAnswer | QueryAnswer | ClearAnswer


@attrs.define(eq=False)
class TierClear:
    """A Clear the tiers are working on: answered once every tier has cleared (or failed to)."""

    deferred: Deferred
    salt: str | None
    removed: int  # chunks the request removed from RAM
    waiting: int  # tiers not done yet
    tiers: dict[str, int] = attrs.field(factory=dict)  # objects deleted per tier
    errors: dict[str, str] = attrs.field(factory=dict)  # tiers that could not be cleared, and why

    def done(self, kind: str, outcome: int | str) -> bool:
        """A tier is done: the objects it deleted, or why it failed; True after the last one."""
        if isinstance(outcome, int):
            self.tiers[kind] = outcome
        else:
            self.errors[kind] = outcome
        self.waiting -= 1
        return self.waiting == 0


@attrs.define(eq=False)
class _Pin:
    """A chunk pinned in RAM until every tier's worker copied it (or dropped it)."""

    lease_id: int
    waiting: int  # tiers that have not copied it yet


class _Copy:
    """What a tier's writer calls to get a chunk's bytes: a copy out of its slot, checked against
    the slot's header before and after (None when the slot no longer holds the chunk). The
    chunk is unpinned once copied, or once the writer is done with it without copying:
    ``unpin`` runs on the loop thread, ``post`` hands a call to it from a writer's thread."""

    def __init__(
        self,
        pool: memoryview,
        name: tuple[str, bytes],
        slot: tuple[int, int],
        unpin: Callable[[], None],
        post: Callable[[Callable[[], None]], None],
    ) -> None:
        self.pool, self._unpin, self._post = pool, unpin, post
        self.start, self.length = slot  # the payload's offset in the pool, and its bytes
        self.digest = slot_digest(*name)
        self._done = False

    def __call__(self) -> bytes | None:
        pool, start = self.pool, self.start
        header = start - SLOT_HEADER_BYTES
        try:
            before = bytes(pool[header:start])
            data = bytes(pool[start : start + self.length])
            after = bytes(pool[header:start])
        finally:
            self.done()
        if before != after or not slot_header_holds(before, self.digest, self.length):
            return None
        return data

    def done(self) -> None:
        if not self._done:
            self._done = True
            self._post(self._unpin)

    def cancel(self) -> None:
        """Never to be copied: unpin now (loop thread)."""
        if not self._done:
            self._done = True
            self._unpin()


class TierSet:
    """The server's tiers below RAM, in the order they are asked (disk before remote): the driver
    of their write-behind, of their clears, and of the tiered reads that `ReadBook` decides."""

    def __init__(
        self,
        tiers: Sequence[Tier],
        index: ChunkIndex,
        pool: memoryview,
        *,
        wake: Callable[[], None],
        read_deadline: float = DEFAULT_READ_DEADLINE,
        read_deadline_per_chunk: float | None = DEFAULT_READ_DEADLINE_PER_CHUNK,
        label: Callable[[str], str] | None = None,
    ) -> None:
        """``wake``: ends the loop's wait (any thread), so that it runs `run` soon; ``label``:
        how logs name a salt (the server's labeler; default: a key of its own)."""
        self._salt_label = label if label is not None else random_labeler()
        self.tiers = list(tiers)
        self.index = index
        self.holds = index.holds  # the tiers' leases and reservations in the index
        self.clears = index.clears  # a read from below before a clear of the tiers is a miss
        self.pool = pool
        self.book = ReadBook([t.kind for t in self.tiers], self.clears, read_deadline, read_deadline_per_chunk)
        self._wake = wake
        self._posted: deque[Callable[[], None]] = deque()
        self._pins: dict[tuple[str, bytes], _Pin] = {}
        self._writers = [WriteBehind(t, on_done=self._written) for t in self.tiers]
        self._reader = Reader("kvdepot-tier-read")
        self.counters = self.book.counters  # the reads' counters, and the write-behind's below
        self.counters["pins_dropped"] = 0
        self._answers: list[Answer] = []  # requests to answer, handed out by `run`
        self._warn = WarnLimiter(log)
        self._closed = False
        self._execute: dict[type, Callable[[Any, float], None]] = {
            LookupAnswer: lambda answer, _: self._answers.append(answer),
            QueryAnswer: lambda answer, _: self._answers.append(answer),
            LeasePrefixes: self._lease_prefixes,
            Probe: self._probe,
            Reserve: self._reserve,
            Fill: self._fill,
            Settle: self._settle,
            Release: lambda release, _: self.holds.tier_release(release.lease_ids),
            Warn: lambda warn, _: self._warn(warn.name, **warn.fields),
        }
        self.holds.open_tiers(0.0)

    @property
    def read_deadline(self) -> float:
        return self.book.read_deadline

    @read_deadline.setter
    def read_deadline(self, value: float) -> None:
        self.book.read_deadline = value

    @property
    def read_deadline_per_chunk(self) -> float | None:
        return self.book.read_deadline_per_chunk

    @read_deadline_per_chunk.setter
    def read_deadline_per_chunk(self, value: float | None) -> None:
        self.book.read_deadline_per_chunk = value

    def longest_wait(self) -> float:
        """Seconds a lookup may wait for the tiers before it counts as overdue."""
        return self.book.longest_wait()

    def deadline_for(self, chunks: int, engine_per_chunk: float | None = None) -> float:
        """Seconds a lookup may wait for the tiers when they hold a run of ``chunks`` (`ReadBook.deadline_for`)."""
        return self.book.deadline_for(chunks, engine_per_chunk)

    # -- loop thread ------------------------------------------------------------------------

    def run(self) -> list[Answer]:
        """Apply what the tier threads handed back, and give up waiting for the reads the reader
        is too late for (loop thread, every pass). Returns the requests to answer now."""
        while self._posted:
            try:
                self._posted.popleft()()
            except Exception:  # a bug here must not stop the server: the chunk is only not written below
                log.exception("tier_work_failed")
        if self.book.open:
            now = time.monotonic()
            self.book.timer(now)
            self._act(now)
        answers, self._answers = self._answers, []
        return answers

    def take(self, events: Sequence[IndexEvent]) -> None:
        """Write-behind for the chunks clients just committed (loop thread, after each request):
        pin them, and queue them for every tier. Chunks read back from a tier are there already."""
        committed = [e for e in events if isinstance(e, Committed) and e.client not in _NOT_WRITTEN_BELOW]
        if committed and not self._closed:
            self._pin(committed)

    def _pin(self, committed: list[Committed]) -> None:
        now = time.monotonic()
        try:
            outcomes = self.holds.tier_lease([(e.salt, [e.key]) for e in committed], now)
        except ServerError:  # too many pins or sessions: these chunks stay in RAM only, the commit stands
            self.counters["pins_dropped"] += len(committed)
            return
        for event, outcome in zip(committed, outcomes, strict=True):
            if not outcome.num_hits:
                continue  # gone again already (evicted or cleared by the same request)
            name = (event.salt, event.key)
            old = self._pins.pop(name, None)
            if old is not None:  # committed again while an older copy is queued: the new pin stands
                self.holds.tier_release([old.lease_id])
            pin = self._pins[name] = _Pin(outcome.lease_id, len(self._writers))
            for writer in self._writers:
                item = DeferredWrite(
                    event.salt,
                    event.key,
                    event.length,
                    _Copy(self.pool, name, outcome.slots[0], functools.partial(self._unpin, name, pin), self._post),
                )
                if not writer.submit([item], first=event.pinned):
                    self._unpin(name, pin)  # the queue is full: dropped, and counted by the writer

    def _unpin(self, name: tuple[str, bytes], pin: _Pin) -> None:
        pin.waiting -= 1
        if pin.waiting <= 0 and self._pins.get(name) is pin:
            del self._pins[name]
            self.holds.tier_release([pin.lease_id])

    def lookup(
        self, client: str, items: list[tuple[str, Sequence[bytes]]], now: float, per_chunk: float | None = None
    ) -> Deferred | None:
        """Start reading the keys past each item's RAM prefix from the tiers; None when there
        is nothing to read (the caller answers from RAM at once). ``per_chunk``: the engine's
        seconds to compute a chunk, which bounds the wait like ``read_deadline_per_chunk``."""
        if (prefixes := self._prefixes(client, items)) is None:
            return None
        if (read := self.book.lookup(client, items, prefixes, time.monotonic(), per_chunk)) is None:
            return None
        self._act(now)  # ``now``, the handler's clock, is the prefix leases' start
        return read.deferred

    def query(self, client: str, items: list[tuple[str, Sequence[bytes]]]) -> Deferred | QueryAnswer | None:
        """Ask the tiers which keys past each item's RAM prefix they hold (a Query: no slot, no
        lease, no transfer). None when there is nothing to ask (the caller answers from RAM at
        once); the answer itself when every tier up answers from memory (the disk's index: asked
        here, on the loop); else a deferred reply, bounded as lookups are, with them."""
        if (prefixes := self._prefixes(client, items)) is None:
            return None
        if (read := self.book.query(client, items, prefixes, time.monotonic())) is None:
            return None
        if all(tier.probes_in_memory for tier in self.tiers if up(tier)):
            return self.book.probed_now(read, probe(self.tiers, read, self.read_deadline))
        self.book.defer(read)
        self._act(time.monotonic())
        return read.deferred

    def _prefixes(self, client: str, items: list[tuple[str, Sequence[bytes]]]) -> list[int] | None:
        """Each item's RAM prefix, when the tiers are worth asking about ``items`` at all."""
        if self._closed or not any(up(t) for t in self.tiers) or not self.book.admits(client, items):
            return None
        return self.index.prefix_lengths(items)

    # -- what the reads' book asks for (loop thread) ----------------------------------------

    def _act(self, now: float) -> None:
        """Execute what the reads' book asks for, in order, until it asks nothing more."""
        while actions := self.book.take_actions():
            for action in actions:
                self._execute[type(action)](action, now)

    def _lease_prefixes(self, action: LeasePrefixes, now: float) -> None:
        try:
            leases = [o.lease_id for o in self.holds.tier_lease(action.read.items, now) if o.lease_id]
        except ServerError:  # too many leases or sessions: read without holding the prefixes
            leases = []
        self.book.leased(action.read, leases)

    def _probe(self, action: Probe, now: float) -> None:
        read = action.read
        self._reader.submit(
            read.client, lambda: self._post(self._feed_probed(read, probe(self.tiers, read, self.read_deadline)))
        )

    def _reserve(self, action: Reserve, now: float) -> None:
        self.book.placed(action.read, [self._reserve_run(action.read.client, run, now) for run in action.runs], now)

    def _reserve_run(
        self, owner: str, run: tuple[str, list[bytes], int] | None, now: float
    ) -> tuple[int, list[tuple[int, int, int]]]:
        """RAM slots for one item's run, owned by the asking client: (reservation id, slots)."""
        if run is None:
            return (0, [])
        try:
            out = self.holds.tier_reserve(owner, *run, now)
        except ServerError as exc:  # too many reservations: a miss
            log.warning("tier_read_not_placed", error=str(exc))
            return (0, [])
        return (out.reservation_id, out.slots)

    def _fill(self, action: Fill, now: float) -> None:
        read = action.read
        self._reader.submit(read.client, lambda: self._post(self._feed_filled(read, fill(self.tiers, self.pool, read))))

    def _settle(self, action: Settle, now: float) -> None:
        try:
            self.holds.tier_settle(action.reservation_id, action.done, now)
        except ServerError as exc:  # a peer ended the tiers' session meanwhile: those chunks are misses
            log.warning("tier_read_not_placed", error=str(exc))

    # -- clears -----------------------------------------------------------------------------

    def clear(self, deferred: Deferred, salt: str | None, removed: int) -> TierClear:
        """Have every tier delete the objects of ``salt`` (None: all), after the batch its writer is
        on (loop thread; the caller took the salt's writes off the queues with `discard` first).
        ``removed``: what the request removed from RAM. Answered through `run`."""
        self.clears.mark(salt, below=True)
        job = TierClear(deferred, salt, removed, waiting=len(self.tiers))
        for tier, writer in zip(self.tiers, self._writers, strict=True):
            if not writer.call(functools.partial(self._clear_on_writer, job, tier)):
                self._clear_done(job, tier.kind, "the server is closing")()
        if not self.tiers:
            self._answers.append(ClearAnswer(deferred, job))
        log.info("tiers_clearing", salt=self._label(salt))
        return job

    def discard(self, salt: str | None) -> int:
        """Take the writes of ``salt`` (None: all) off every queue and unpin their chunks, so that
        a clear of RAM can remove them (loop thread); how many were queued."""
        count = 0
        for writer in self._writers:
            for item in writer.discard(salt):
                count += 1
                if isinstance(item, DeferredWrite) and isinstance(item.load, _Copy):
                    item.load.cancel()
        return count

    def _clear_on_writer(self, job: TierClear, tier: Tier) -> None:
        self._post(self._clear_done(job, tier.kind, _clear_tier(tier, job.salt, self._label(job.salt))))

    def _clear_done(self, job: TierClear, kind: str, outcome: int | str) -> Callable[[], None]:
        """What the loop runs once a tier is done clearing: count it, answer after the last one."""

        def done() -> None:
            if job.done(kind, outcome):
                # A read that started before every tier was done may hold bytes they deleted.
                self.clears.mark(job.salt, below=True)
                log.info("tiers_cleared", salt=self._label(job.salt), deleted=job.tiers, errors=job.errors)
                self._answers.append(ClearAnswer(job.deferred, job))

        return done

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
        self._reader.close()
        for writer in self._writers:
            writer.close(drain=False)
        for tier in self.tiers:
            tier.close()

    # -- tier threads -----------------------------------------------------------------------

    def _post(self, fn: Callable[[], None]) -> None:
        self._posted.append(fn)
        self._wake()

    def _feed_probed(self, read: TierRead, found: Probed) -> Callable[[], None]:
        """What the loop runs once the reader probed ``read``: feed the book, execute its actions."""

        def on_loop() -> None:
            now = time.monotonic()
            self.book.probed(read, found, now)
            self._act(now)

        return on_loop

    def _feed_filled(self, read: LookupRead, filled: list[dict[int, int]]) -> Callable[[], None]:
        """What the loop runs once the reader filled ``read``'s slots: feed the book, execute its actions."""

        def on_loop() -> None:
            self.book.filled(read, filled)
            self._act(time.monotonic())

        return on_loop

    def _label(self, salt: str | None) -> str:
        """How logs name a salt (never the salt itself: it may be a tenant's secret)."""
        return "*" if salt is None else self._salt_label(salt)

    def _written(self, item: QueuedWrite, ok: bool) -> None:
        """A writer is done with an item: unpin it if its bytes were never copied (dropped at close)."""
        if isinstance(item, DeferredWrite) and isinstance(item.load, _Copy):
            item.load.done()


def _clear_tier(tier: Tier, salt: str | None, label: str) -> int | str:
    """Clear ``tier`` of ``salt`` (labelled ``label`` in logs; a writer thread); the objects
    deleted, or why it failed."""
    try:
        return tier.clear(salt)
    except Exception as exc:  # a tier down, or a bug: the operator is told, the server goes on
        log.warning("tier_clear_failed", tier=tier.kind, salt=label, error=str(exc))
        return getattr(exc, "message", None) or str(exc)
