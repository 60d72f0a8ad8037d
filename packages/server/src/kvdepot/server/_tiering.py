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

Read-through (a lookup that misses RAM), one `TierRead` moved by the table in `_tier_read.py`:
    loop (`lookup`): lease the RAM prefixes, defer the reply --> reader: `probe` which keys past
        the RAM prefix each tier holds, and at what length (the disk's index, a STRLEN pipeline
        on the remote; a window of keys at a time, so the first key no tier holds ends the
        probe) --> loop (`_probed`): the deadline follows from the longest run held
        (`deadline_for`); reserve RAM slots of that length for those runs (owned by the asking
        client: `ServerHolds.tier_reserve`) --> reader: `fill` them straight from the tiers (one
        batch per tier, within the deadline; where a read fails, the next tier that holds the
        chunk is asked) --> loop (`_filled`): commit the slots filled, abort the others, and
        answer the lookup as if they had been in RAM (`run` returns it; the server sends the
        deferred reply).
    That is two hand-offs to the reader and two back. Slots are taken only for chunks a tier
    holds, so a cold prompt evicts nothing from RAM. A chunk not in by the deadline is a miss,
    the chunks before it still hit: the engine recomputes from there. Each run is read at the
    length its tier holds: engines of other models or layouts on one server store chunks of
    other sizes, and a chunk's name (its namespace covers the model and the layout) fixes
    which size it has.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Callable, Sequence

import attrs

from kvdepot.core import SLOT_HEADER_BYTES, slot_digest, slot_header_holds
from kvdepot.server._errors import ServerError, TooManyError
from kvdepot.server._events import Committed, IndexEvent
from kvdepot.server._holds import TIER_CLIENT
from kvdepot.server._index import ADOPTED_CLIENT, MAX_KEYS_PER_REQUEST, ChunkIndex
from kvdepot.server._label_key import random_labeler
from kvdepot.server._sessions import MAX_LEASES_PER_CLIENT
from kvdepot.server._tier_read import Probed, Reader, ReadEvent, ReadState, TierRead, fill, probe, up
from kvdepot.server._tiers import Tier, WarnLimiter
from kvdepot.server._write_behind import DeferredWrite, QueuedWrite, WriteBehind
from kvdepot.transport import Deferred, get_logger

log = get_logger(__name__)

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
#: Chunk keys of the lookups waiting for the tiers at once, per client and in all: past these
#: a lookup is answered from RAM at once (`tier_reads_refused`). One reader thread serves them
#: in turn, so without a bound one client's stream of lookups would queue reads (and their
#: memory) without limit, and everyone else's would wait behind them. An engine sends a lookup
#: every step while earlier ones wait, but of a few hundred keys each: far below these.
MAX_READ_KEYS_PER_CLIENT = 4 * MAX_KEYS_PER_REQUEST
MAX_READ_KEYS = 16 * MAX_KEYS_PER_REQUEST
#: Leases the tiers' session may hold on the RAM prefixes of the lookups they read for; past
#: this a read goes on without holding its prefix. The rest of the session's lease limit stays
#: for the write-behind's pins.
MAX_PREFIX_LEASES = MAX_LEASES_PER_CLIENT // 2
#: Seconds past the longest a lookup may wait for the tiers (twice the read deadline: the probe,
#: then the transfer) after which the loop answers it from RAM without them: a tier call that
#: blocks (a hung NFS mount, a dying disk) holds the single reader thread, and the lookups
#: waiting behind it would otherwise never be answered. Their slots stay reserved until the
#: reader is done with them.
OVERDUE_GRACE_S = 1.0


@attrs.frozen
class LookupAnswer:
    """A deferred lookup the tiers are done waiting for: the server answers it from RAM now."""

    deferred: Deferred
    client: str
    items: list[tuple[str, Sequence[bytes]]]
    #: Per item, the keys (by position) that were just read back, and from which tier.
    read_back: list[dict[int, str]]


@attrs.frozen
class QueryAnswer:
    """A Query the tiers answered: per item, what RAM held when it came (its prefix), and what
    the tiers hold past that: the run a lookup would read back, and each tier's part of it."""

    deferred: Deferred
    held: list[tuple[int, int, dict[str, int]]]


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
    """The server's tiers below RAM, in the order they are asked (disk before remote)."""

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
        self.read_deadline = read_deadline
        self.read_deadline_per_chunk = read_deadline_per_chunk
        self._wake = wake
        self._posted: deque[Callable[[], None]] = deque()
        self._pins: dict[tuple[str, bytes], _Pin] = {}
        self._writers = [WriteBehind(t, on_done=self._written) for t in self.tiers]
        self._reader = Reader("kvdepot-tier-read")
        self.counters = {
            "read_hits": 0,
            "read_misses": 0,
            "read_late": 0,
            "reads_deferred": 0,
            "reads_refused": 0,
            "reads_expired": 0,
            "reads_overdue": 0,
            "queries_probed": 0,
            "queries_deferred": 0,
            "pins_dropped": 0,
        }
        self._keys_of: dict[str, int] = {}  # per client: keys of its lookups waiting for the tiers
        self._keys_waiting = 0  # and their sum
        self._open: deque[TierRead] = deque()  # reads not done yet, oldest first (for `_answer_overdue`)
        self._answers: list[Answer] = []  # lookups to answer, handed out by `run`
        self._warn = WarnLimiter(log)
        self._prefix_leases = 0  # leases held on the RAM prefixes of those lookups
        self._closed = False
        self.holds.open_tiers(0.0)

    # -- loop thread ------------------------------------------------------------------------

    def run(self) -> list[Answer]:
        """Apply what the tier threads handed back, and give up waiting for the reads the reader
        is too late for (loop thread, every pass). Returns the lookups to answer now."""
        while self._posted:
            try:
                self._posted.popleft()()
            except Exception:  # a bug here must not stop the server: the chunk is only not written below
                log.exception("tier_work_failed")
        if self._open:
            self._answer_overdue(time.monotonic())
        answers, self._answers = self._answers, []
        return answers

    def take(self, events: Sequence[IndexEvent]) -> None:
        """Write-behind for the chunks clients just committed (loop thread, after each request):
        pin them, and queue them for every tier. Chunks read back from a tier are there already."""
        committed = [e for e in events if isinstance(e, Committed) and e.client not in _NOT_WRITTEN_BELOW]
        if committed and not self._closed:
            self._pin(committed)

    def _answer_overdue(self, now: float) -> None:
        """Answer from RAM the lookups still waiting past their longest wait: the reader is stuck
        in a tier call. What it reads for them later is still published when it is done."""
        while self._open and (self._open[0].state is ReadState.DONE or self._open[0].overdue_at <= now):
            read = self._open.popleft()
            if read.state is ReadState.DONE:
                continue
            if read.advance(ReadEvent.OVERDUE):
                self.counters["reads_overdue"] += 1
                self._warn("tier_read_overdue", after_s=round(self.longest_wait(), 3), reason="a tier call hangs")
                self._answer(read)

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
        if (start := self._may_read(client, items)) is None:
            return None
        count, _, missing = start
        leases: list[int] = []
        try:  # lease each RAM prefix, so that the slots taken for the rest cannot evict it meanwhile
            if self._prefix_leases + len(items) > MAX_PREFIX_LEASES:
                raise TooManyError("the tiers hold their share of leases on RAM prefixes")
            leases = [o.lease_id for o in self.holds.tier_lease(items, now) if o.lease_id]
        except ServerError:  # too many leases or sessions: read without holding the prefixes
            pass
        started = time.monotonic()
        read = TierRead(Deferred(), client, items, missing, started, started + self.longest_wait(), per_chunk)
        read.prefix_leases = leases
        read.epoch = self.clears.now
        self._prefix_leases += len(leases)
        self.counters["reads_deferred"] += 1
        return self._start(read, count)

    def query(self, client: str, items: list[tuple[str, Sequence[bytes]]]) -> Deferred | QueryAnswer | None:
        """Ask the tiers which keys past each item's RAM prefix they hold (a Query: no slot, no
        lease, no transfer). None when there is nothing to ask (the caller answers from RAM at
        once); the answer itself when every tier up answers from memory (the disk's index: asked
        here, on the loop); else a deferred reply, bounded as lookups are, with them."""
        if (start := self._may_read(client, items)) is None:
            return None
        count, prefixes, missing = start
        started = time.monotonic()
        read = TierRead(Deferred(), client, items, missing, started, started + self.longest_wait())
        read.query_prefixes = prefixes
        self.counters["queries_probed"] += 1
        if all(tier.probes_in_memory for tier in self.tiers if up(tier)):
            read.holders = probe(self.tiers, read, self.read_deadline).holders
            return self._held(read)
        self.counters["queries_deferred"] += 1
        return self._start(read, count)

    def _may_read(
        self, client: str, items: list[tuple[str, Sequence[bytes]]]
    ) -> tuple[int, list[int], list[tuple[str, list[bytes]]]] | None:
        """(keys, RAM prefixes, keys past them) when the tiers are worth asking about `items`."""
        if self._closed or not any(up(t) for t in self.tiers):
            return None
        count = sum(len(keys) for _, keys in items)
        if count > MAX_KEYS_PER_REQUEST:
            return None  # the answer from RAM refuses it with its typed error
        own = self._keys_of.get(client, 0)
        if own + count > MAX_READ_KEYS_PER_CLIENT or self._keys_waiting + count > MAX_READ_KEYS:
            self.counters["reads_refused"] += 1
            return None
        prefixes = self.index.prefix_lengths(items)
        missing = [(salt, list(keys[prefix:])) for (salt, keys), prefix in zip(items, prefixes, strict=True)]
        if not any(keys for _, keys in missing):
            return None  # all in RAM: the common case costs no lease
        return count, prefixes, missing

    def _start(self, read: TierRead, count: int) -> Deferred:
        """Count a read against its client's bound and hand it to the reader (loop thread)."""
        read.keys = count
        self._open.append(read)
        self._keys_of[read.client] = self._keys_of.get(read.client, 0) + count
        self._keys_waiting += count
        self._reader.submit(read.client, lambda: self._post_probed(read, probe(self.tiers, read, self.read_deadline)))
        return read.deferred

    def longest_wait(self) -> float:
        """Seconds a lookup may wait for the tiers before it counts as overdue."""
        return 2 * self.read_deadline + OVERDUE_GRACE_S

    def deadline_for(self, chunks: int, engine_per_chunk: float | None = None) -> float:
        """Seconds a lookup may wait for the tiers when they hold a run of ``chunks``: the prefill
        that run saves (``read_deadline_per_chunk`` each, and the engine's own estimate
        ``engine_per_chunk``, whichever is shorter), at most ``read_deadline``."""
        per_chunk = [p for p in (self.read_deadline_per_chunk, engine_per_chunk) if p is not None]
        return min([self.read_deadline, *(chunks * p for p in per_chunk)])

    def _probed(self, read: TierRead, found: Probed) -> None:
        """The probe is back: reserve RAM slots for the run of chunks the tiers hold past each
        RAM prefix, then have the reader fill them (loop thread)."""
        self.counters["reads_expired"] += found.expired
        read.holders, read.sizes = found.holders, found.sizes
        if read.query_prefixes is not None:  # a Query: answered with what the probe found
            self._filled(read, [], ReadEvent.NOTHING)
            return
        if not found.expired:
            read.deadline += self.deadline_for(found.longest, read.per_chunk)
        now = time.monotonic()
        if now >= read.deadline:  # no time left for any transfer: take no slots (they might evict)
            self.counters["read_late"] += sum(len(run) for run in read.holders)
            read.holders = []
        read.targets = [self._reserve(read, item, now) for item in range(len(read.holders))]
        if now < read.deadline and any(slots for _, slots in read.targets):
            read.advance(ReadEvent.PLACED)
            self._reader.submit(read.client, lambda: self._post_filled(read, fill(self.tiers, self.pool, read)))
        else:
            self._filled(read, [], ReadEvent.NOTHING)

    def _reserve(self, read: TierRead, item: int, now: float) -> tuple[int, list[tuple[int, int, int]]]:
        """RAM slots for item's run, owned by the asking client: (reservation id, slots)."""
        holders = read.holders[item]
        if not holders:
            return (0, [])
        salt, keys = read.missing[item]
        try:
            out = self.holds.tier_reserve(read.client, salt, keys[: len(holders)], read.sizes[item], now)
        except ServerError as exc:  # too many reservations: a miss
            log.warning("tier_read_not_placed", error=str(exc))
            return (0, [])
        return (out.reservation_id, out.slots)

    def _filled(self, read: TierRead, filled: list[dict[int, int]], event: ReadEvent = ReadEvent.FILLED) -> None:
        """Publish the slots filled in time, give back the others, answer the lookup unless it was
        answered as overdue, and give back what the read held (loop thread)."""
        now = time.monotonic()
        read.filled = filled
        for item, (reservation_id, _slots) in enumerate(read.targets):
            done = set(filled[item]) if item < len(filled) else set()
            if done and self.clears.since(read.missing[item][0], read.epoch, below=True):
                done = set()  # read before a clear of its salt: those bytes were deleted
            self.counters["read_hits"] += len(done)
            self.counters["read_misses"] += len(read.missing[item][1]) - len(done)
            if not reservation_id:
                continue
            try:
                self.holds.tier_settle(reservation_id, done, now)
            except ServerError as exc:  # a peer ended the tiers' session meanwhile: those chunks are misses
                log.warning("tier_read_not_placed", error=str(exc))
        if read.advance(event):
            self._answer(read)
        self.holds.tier_release(read.prefix_leases)  # the client holds its own leases now
        self._prefix_leases -= len(read.prefix_leases)
        self._keys_waiting -= read.keys
        left = self._keys_of[read.client] - read.keys
        if left:
            self._keys_of[read.client] = left
        else:
            del self._keys_of[read.client]

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
            if isinstance(outcome, int):
                job.tiers[kind] = outcome
            else:
                job.errors[kind] = outcome
            job.waiting -= 1
            if job.waiting == 0:
                # A read that started before every tier was done may hold bytes they deleted.
                self.clears.mark(job.salt, below=True)
                log.info("tiers_cleared", salt=self._label(job.salt), deleted=job.tiers, errors=job.errors)
                self._answers.append(ClearAnswer(job.deferred, job))

        return done

    def _held(self, read: TierRead) -> QueryAnswer:
        """The answer to a Query: per item, its RAM prefix and what the tiers hold past it."""
        assert read.query_prefixes is not None
        below = read.held_below(self.tiers)
        held = [(ram, run, each) for ram, (run, each) in zip(read.query_prefixes, below, strict=True)]
        return QueryAnswer(read.deferred, held)

    def _answer(self, read: TierRead) -> None:
        if read.query_prefixes is not None:
            self._answers.append(self._held(read))
            return
        read_back = []
        for item, (_, keys) in enumerate(read.items):
            start = len(keys) - len(read.missing[item][1])  # the RAM prefix when the lookup came
            filled = read.filled[item] if item < len(read.filled) else {}
            read_back.append({start + i: self.tiers[t].kind for i, t in filled.items()})
        self._answers.append(LookupAnswer(read.deferred, read.client, read.items, read_back))

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

    def _post_probed(self, read: TierRead, found: Probed) -> None:
        self._post(lambda: self._probed(read, found))

    def _label(self, salt: str | None) -> str:
        """How logs name a salt (never the salt itself: it may be a tenant's secret)."""
        return "*" if salt is None else self._salt_label(salt)

    def _post_filled(self, read: TierRead, filled: list[dict[int, int]]) -> None:
        self._post(lambda: self._filled(read, filled))

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
