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
    keys past the RAM prefix --> reader thread: which of them each tier holds, and at what
        length (`lengths`: the disk's index, a STRLEN pipeline on the remote; a window of keys at
        a time, so the first key no tier holds ends the probe); the deadline
        follows from the longest run held (`deadline_for`) --> loop: reserve RAM slots of
        that length for those runs (owned by the asking client) --> reader thread: each tier
        reads its chunks straight into their slots (one batch per tier, within the deadline;
        where a read fails, the next tier that holds the chunk is asked) --> loop: commit the
        slots filled, abort the others, then answer the lookup as if they had been in RAM (a
        deferred reply).
    Slots are taken only for chunks a tier holds, so a cold prompt evicts nothing from RAM. A
    chunk not in by the deadline is a miss, the chunks before it still hit: the engine
    recomputes from there. Each run is read at the length its tier holds: engines of other
    models or layouts on one server store chunks of other sizes, and a chunk's name (its
    namespace covers the model and the layout) fixes which size it has.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import structlog

from kvdepot.core import SLOT_HEADER_BYTES, slot_digest, slot_header_holds
from kvdepot.server._errors import ServerError, TooManyError
from kvdepot.server._index import MAX_KEYS_PER_REQUEST, ChunkIndex
from kvdepot.server._records import Entry
from kvdepot.server._sessions import MAX_LEASES_PER_CLIENT
from kvdepot.server._tiers import ChunkRef, Tier, TierState, WarnLimiter
from kvdepot.server._write_behind import DeferredWrite, QueuedWrite, WriteBehind
from kvdepot.transport import RESERVED_CLIENT_PREFIX, Deferred, error_reply_from

log = structlog.get_logger(__name__)

#: The server's own session in the index: its leases pin chunks being copied out, its
#: reservations hold the slots that lower-tier reads fill.
TIER_CLIENT = f"{RESERVED_CLIENT_PREFIX}tiers"
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
#: Keys per item the first probe asks the tiers about; each later probe of the items whose run
#: goes on asks 4x more. An engine's lookup (a few hundred keys) takes one probe.
PROBE_WINDOW = 256


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
    per_chunk: float | None = None  # the engine's seconds to compute a chunk (Lookup.prefill_s_per_chunk)
    prefix_leases: list[int] = attrs.field(factory=list)  # the tiers' leases on the RAM prefixes
    keys: int = 0  # the keys it asked for, counted against its client's bound
    # per item: for each key of the run found below RAM, the tiers that hold it, in asking order
    holders: list[list[list[int]]] = attrs.field(factory=list)
    sizes: list[int] = attrs.field(factory=list)  # per item: the payload bytes of each chunk of its run
    # per item: (reservation id, [(index in missing keys, payload offset, length)]) of the slots to fill
    targets: list[tuple[int, list[tuple[int, int, int]]]] = attrs.field(factory=list)
    filled: list[set[int]] = attrs.field(factory=list)  # per item: the indices whose slots now hold their chunk
    overdue_at: float = 0.0  # when the loop answers it without the tiers, if the reader has not by then
    answered: bool = False  # its lookup got its reply (settled, or answered as overdue)
    settled: bool = False  # the reader is done with it, its slots published or given back


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
        read_deadline_per_chunk: float | None = DEFAULT_READ_DEADLINE_PER_CHUNK,
    ) -> None:
        self.tiers = list(tiers)
        self.index = index
        self.pool = pool
        self.read_deadline = read_deadline
        self.read_deadline_per_chunk = read_deadline_per_chunk
        self._wake = wake
        self._answer = answer
        self._lookup = lookup
        self._posted: deque[Callable[[], None]] = deque()
        self._pins: dict[tuple[str, bytes], _Pin] = {}
        self._writers = [WriteBehind(t, on_done=self._written) for t in self.tiers]
        self._reader = _RoundRobin("kvdepot-tier-read")
        self.counters = {
            "read_hits": 0,
            "read_misses": 0,
            "read_late": 0,
            "reads_deferred": 0,
            "reads_refused": 0,
            "reads_expired": 0,
            "reads_overdue": 0,
            "pins_dropped": 0,
        }
        self._keys_of: dict[str, int] = {}  # per client: keys of its lookups waiting for the tiers
        self._keys_waiting = 0  # and their sum
        self._open: deque[_Read] = deque()  # reads not settled yet, oldest first (for `_answer_overdue`)
        self._warn = WarnLimiter(log)
        self._prefix_leases = 0  # leases held on the RAM prefixes of those lookups
        self._closed = False
        index.touch(TIER_CLIENT, 0.0, "tiers")
        index.on_commit = self._committed
        for tier in self.tiers:
            if hasattr(tier, "quota_of"):  # a tier that keeps each salt's bytes to its quota (the disk)
                tier.quota_of = index.quota_of

    # -- loop thread ------------------------------------------------------------------------

    def run(self) -> None:
        """Apply what the tier threads handed back, and answer the lookups the reader is too late
        for (loop thread, every pass)."""
        while self._posted:
            try:
                self._posted.popleft()()
            except Exception:  # a bug here must not stop the server: the chunk is only not written below
                log.exception("tier_work_failed")
        if self._open:
            self._answer_overdue(time.monotonic())

    def _answer_overdue(self, now: float) -> None:
        """Answer from RAM the lookups still waiting past their longest wait: the reader is stuck
        in a tier call. What it reads for them later is still published when it settles."""
        while self._open and (self._open[0].settled or self._open[0].overdue_at <= now):
            read = self._open.popleft()
            if read.settled or read.answered:
                continue
            self.counters["reads_overdue"] += 1
            self._warn("tier_read_overdue", after_s=round(self._longest_wait(), 3), reason="a tier call hangs")
            self._reply(read, now)

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

    def lookup(
        self, client: str, items: list[tuple[str, Sequence[bytes]]], now: float, per_chunk: float | None = None
    ) -> Deferred | None:
        """Start reading the keys past each item's RAM prefix from the tiers; None when there
        is nothing to read (the caller answers from RAM at once). ``per_chunk``: the engine's
        seconds to compute a chunk, which bounds the wait like ``read_deadline_per_chunk``."""
        if self._closed or not any(_up(t) for t in self.tiers):
            return None
        count = sum(len(keys) for _, keys in items)
        if count > MAX_KEYS_PER_REQUEST:
            return None  # the lookup from RAM refuses it with its typed error
        own = self._keys_of.get(client, 0)
        if own + count > MAX_READ_KEYS_PER_CLIENT or self._keys_waiting + count > MAX_READ_KEYS:
            self.counters["reads_refused"] += 1
            return None
        prefixes = self.index.prefix_lengths(items)
        missing = [(salt, list(keys[prefix:])) for (salt, keys), prefix in zip(items, prefixes, strict=True)]
        if not any(keys for _, keys in missing):
            return None  # all in RAM: the common case costs no lease
        leases: list[int] = []
        try:  # lease each RAM prefix, so that the slots taken for the rest cannot evict it meanwhile
            if self._prefix_leases + len(items) > MAX_PREFIX_LEASES:
                raise TooManyError("the tiers hold their share of leases on RAM prefixes")
            self.index.touch(TIER_CLIENT, now, "tiers")
            leases = [o.lease_id for o in self.index.lookup(TIER_CLIENT, items, now, count=False) if o.lease_id]
        except ServerError:  # too many leases or sessions: read without holding the prefixes
            pass
        started = time.monotonic()
        read = _Read(Deferred(), client, items, missing, started, per_chunk, leases, count)
        read.overdue_at = started + self._longest_wait()
        self._open.append(read)
        self._keys_of[client] = own + count
        self._keys_waiting += count
        self._prefix_leases += len(leases)
        self.counters["reads_deferred"] += 1
        self._reader.submit(client, self._probe, read)
        return read.deferred

    def _longest_wait(self) -> float:
        """Seconds a lookup may wait for the tiers before it counts as overdue."""
        return 2 * self.read_deadline + OVERDUE_GRACE_S

    def _place(self, read: _Read) -> None:
        """Reserve RAM slots for the run of chunks the tiers hold past each RAM prefix, then
        have the reader fill them straight from the tiers (loop thread)."""
        now = time.monotonic()
        if now >= read.deadline:  # no time left for any transfer: take no slots (they might evict)
            self.counters["read_late"] += sum(len(run) for run in read.holders)
            read.holders = []
        for (salt, keys), holders, size in zip(read.missing, read.holders, read.sizes, strict=False):
            out = None
            if holders:
                try:
                    self.index.register(TIER_CLIENT, size, now)  # also re-opens a session a peer ended
                    out = self.index.reserve(TIER_CLIENT, salt, keys[: len(holders)], size, now, owner=read.client)
                except ServerError as exc:  # too many reservations: a miss
                    log.warning("tier_read_not_placed", error=str(exc))
            read.targets.append((out.reservation_id, out.slots) if out is not None else (0, []))
        if now >= read.deadline or not any(slots for _, slots in read.targets):
            self._settle(read)
        else:
            self._reader.submit(read.client, self._fill, read)

    def _settle(self, read: _Read) -> None:
        """Publish the slots filled in time, give back the others, and answer the lookup unless it
        was answered as overdue (loop thread)."""
        now = time.monotonic()
        for item, (reservation_id, _slots) in enumerate(read.targets):
            filled = read.filled[item] if item < len(read.filled) else set()
            self.counters["read_hits"] += len(filled)
            self.counters["read_misses"] += len(read.missing[item][1]) - len(filled)
            if not reservation_id:
                continue
            try:
                if filled:
                    self.index.commit(TIER_CLIENT, reservation_id, filled, now)
                self.index.abort(TIER_CLIENT, reservation_id)  # the slots not filled (a no-op when none)
            except ServerError as exc:  # a peer ended the tiers' session meanwhile: those chunks are misses
                log.warning("tier_read_not_placed", error=str(exc))
        read.settled = True
        if not read.answered:
            self._reply(read, now)
        self.index.release(TIER_CLIENT, read.prefix_leases)  # the client holds its own leases now
        self._prefix_leases -= len(read.prefix_leases)
        self._keys_waiting -= read.keys
        left = self._keys_of[read.client] - read.keys
        if left:
            self._keys_of[read.client] = left
        else:
            del self._keys_of[read.client]

    def _reply(self, read: _Read, now: float) -> None:
        """Answer the lookup from RAM, as it stands now (loop thread)."""
        read.answered = True
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
        self._reader.close()
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

    def _probe(self, read: _Read) -> None:
        """Ask each tier which of the keys past the RAM prefixes it holds, and at what length
        (reader thread): the disk from its index, the remote with STRLEN pipelines; nothing is
        transferred, so a cold prompt costs no bytes and no slots. Sets the lookup's deadline
        from what it would save."""
        runs: list[list[list[int]]] = [[] for _ in read.missing]
        sizes = [0] * len(read.missing)
        if time.monotonic() >= read.deadline + self.read_deadline:  # waited its longest in the queue already
            self.counters["reads_expired"] += 1
            read.holders, read.sizes = runs, sizes
            self._post(lambda: self._place(read))
            return
        try:
            self._probe_runs(read, runs, sizes)
        except Exception:
            log.exception("tier_read_failed")
            runs = [[] for _ in read.missing]
        longest = max((len(run) for run in runs), default=0)
        read.deadline += self.deadline_for(longest, read.per_chunk)
        read.holders = runs
        read.sizes = sizes
        self._post(lambda: self._place(read))

    def _probe_runs(self, read: _Read, runs: list[list[list[int]]], sizes: list[int]) -> None:
        """Find each item's run: its keys from the first on that some tier holds at the run's
        size. Keys are asked for a window at a time (`PROBE_WINDOW`, then 4x larger each time),
        and only for the items whose run covered the whole last window: the first key no tier
        holds ends its item's probe, so a cold prompt of 65,536 keys costs one window, not
        65,536 names and lookups (one STRLEN pipeline per window on the remote)."""
        open_items = [item for item, (_, keys) in enumerate(read.missing) if keys]
        start, window = 0, PROBE_WINDOW
        while open_items:
            left = read.deadline + self.read_deadline - time.monotonic()  # the longest it may wait
            if start and left <= 0:
                return
            spans = [(item, min(start + window, len(read.missing[item][1]))) for item in open_items]
            refs = [
                ChunkRef(salt, key)
                for item, stop in spans
                for salt, keys in [read.missing[item]]
                for key in keys[start:stop]
            ]
            held = [tier.lengths(refs, timeout=left) if _up(tier) else [None] * len(refs) for tier in self.tiers]
            flat, open_items = 0, []
            for item, stop in spans:
                run = runs[item]
                for i in range(start, stop):
                    found = [lengths[flat] for lengths in held]
                    flat += 1
                    if i == 0:  # the run's chunk size: what the first tier holding its first key has
                        sizes[item] = next((n for n in found if n), 0)
                    holders = [t for t, n in enumerate(found) if n and n == sizes[item]]
                    if holders and len(run) == i:  # else the run ended at an earlier key
                        run.append(holders)
                if len(run) == stop < len(read.missing[item][1]):
                    open_items.append(item)
            start, window = start + window, window * 4

    def deadline_for(self, chunks: int, engine_per_chunk: float | None = None) -> float:
        """Seconds a lookup may wait for the tiers when they hold a run of ``chunks``: the prefill
        that run saves (``read_deadline_per_chunk`` each, and the engine's own estimate
        ``engine_per_chunk``, whichever is shorter), at most ``read_deadline``."""
        per_chunk = [p for p in (self.read_deadline_per_chunk, engine_per_chunk) if p is not None]
        return min([self.read_deadline, *(chunks * p for p in per_chunk)])

    def _fill(self, read: _Read) -> None:
        """Read the chunks straight into their reserved slots, each from the first tier that
        holds it and, where that read fails, from the next (reader thread). A tier's read
        returns by the deadline, and writes a slot only before it returns."""
        read.filled = [set() for _ in read.targets]
        try:
            for t, tier in enumerate(self.tiers):
                places = [
                    (item, i, offset, length)
                    for item, (_, slots) in enumerate(read.targets)
                    for i, offset, length in slots
                    if i not in read.filled[item] and t in read.holders[item][i]
                ]
                left = read.deadline - time.monotonic()
                if not places or left <= 0 or not _up(tier):
                    continue
                refs = [self._ref(read, item, i) for item, i, _, _ in places]
                into = [self.pool[offset : offset + length] for _, _, offset, length in places]
                for (item, i, _, _), ok in zip(places, tier.read(refs, into, timeout=left), strict=True):
                    if ok:
                        read.filled[item].add(i)
        except Exception:
            log.exception("tier_read_failed")
        finally:
            self._post(lambda: self._settle(read))

    @staticmethod
    def _ref(read: _Read, item: int, i: int) -> ChunkRef:
        salt, keys = read.missing[item]
        return ChunkRef(salt, keys[i], length=read.sizes[item])


class _RoundRobin:
    """One thread that runs each client's work in the order it came, taking clients in turn: a
    client with many reads queued delays another's new one by about one step of its own (besides
    the step running), not by all of them."""

    def __init__(self, name: str) -> None:
        self._queues: dict[str, deque[tuple[Callable[[_Read], None], _Read]]] = {}
        self._turns: deque[str] = deque()  # clients with work, in the order they get the thread
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, client: str, fn: Callable[[_Read], None], read: _Read) -> None:
        with self._cond:
            if self._closed:
                return
            queue = self._queues.get(client)
            if queue is None:
                queue = self._queues[client] = deque()
                self._turns.append(client)
            queue.append((fn, read))
            self._cond.notify()

    def _take(self) -> tuple[Callable[[_Read], None], _Read] | None:
        with self._cond:
            self._cond.wait_for(lambda: self._turns or self._closed)
            if self._closed:
                return None
            client = self._turns.popleft()
            queue = self._queues[client]
            work = queue.popleft()
            if queue:
                self._turns.append(client)  # its next item waits for every other client's turn
            else:
                del self._queues[client]
            return work

    def _run(self) -> None:
        while (work := self._take()) is not None:
            fn, read = work
            try:
                fn(read)
            except Exception:  # each step catches its own; a bug here must not stop the thread
                log.exception("tier_read_failed")

    def close(self) -> None:
        """Drop what is queued and wait for the item running."""
        with self._cond:
            self._closed = True
            self._queues.clear()
            self._turns.clear()
            self._cond.notify_all()
        self._thread.join()


def _up(tier: Tier) -> bool:
    """Whether a tier is worth asking: a tier with no `state` (the disk) always is."""
    return getattr(tier, "state", TierState.UP) is TierState.UP
