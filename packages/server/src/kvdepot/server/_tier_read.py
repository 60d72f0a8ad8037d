"""A lookup or a Query that misses RAM, read through the tiers below: the reads' book.

`ReadBook` holds every tiered read under way and decides each of its moves. It never touches
the index, a tier, a thread or a clock: the loop (`TierSet`, `_tiering.py`) passes `now`,
feeds it what happened (`lookup`, `query`, `leased`, `probed`, `placed`, `filled`, `timer`)
and executes what `take_actions()` returns, in order: `LeasePrefixes`, `Probe`, `Reserve`,
`Fill`, `Settle`, `Release`, `Warn`, and the answers (`LookupAnswer`, `QueryAnswer`). The
reader thread (`_tier_reader.py`) runs the blocking calls, `probe` and `fill`.

Life of a lookup's read (`LookupRead`)::

    PROBING --placed--> FILLING --filled--> DONE (answered)
       |                   |
       +--nothing--> DONE (answered)
       |                   |
    overdue (answered from RAM now; the reader still holds it)
       v                   v
    LATE_PROBING --placed--> LATE_FILLING --filled--> DONE
       +--nothing--> DONE

- placed: the probe found runs of chunks in the tiers, and the loop reserved RAM slots for
  them (owned by the asking client); the reader fills them next.
- nothing: the probe found nothing to read, failed, or came past the deadline: no slots.
- filled: the reader is done, whatever it read in time; the loop commits the slots filled
  and gives back the others.
- overdue: the reader has held the read past `ReadBook.longest_wait` (a tier call hangs):
  the loop answers the lookup from RAM as it stands, and whatever the reader reads later is
  still published.

Life of a Query's read (`QueryRead`): probed only, never placed or filled, no slot, no lease::

    PROBING --probed--> DONE (answered: what the tiers hold)
       +--overdue--> LATE_PROBING (answered with RAM's prefixes only) --probed--> DONE

A pair not in its kind's table raises `InvalidTransitionError`: a bug, never a silent no-op.
Each read is answered exactly once, by the move that says so; it is settled (its prefix
leases and key counts given back) when it reaches DONE.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Sequence
from typing import Any, ClassVar

import attrs

from kvdepot.core import InvalidTransitionError
from kvdepot.server._clear_epochs import ClearEpochs
from kvdepot.server._index import MAX_KEYS_PER_REQUEST
from kvdepot.server._sessions import MAX_LEASES_PER_CLIENT
from kvdepot.server._tiers import ChunkRef
from kvdepot.transport import Deferred

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
#: The reads' counters, as `Stats` shows them (``tier_`` in front).
READ_COUNTERS: tuple[str, ...] = ("read_hits", "read_misses", "read_late", "reads_deferred", "reads_refused")
READ_COUNTERS += ("reads_expired", "reads_overdue", "queries_probed", "queries_deferred")


class ReadState(enum.Enum):
    PROBING = "probing"  # the reader asks the tiers which keys they hold
    FILLING = "filling"  # slots are reserved; the reader reads the chunks into them
    LATE_PROBING = "late_probing"  # answered from RAM already; the reader still probes
    LATE_FILLING = "late_filling"  # answered from RAM already; the reader still fills
    DONE = "done"  # settled: slots published or given back, the read answered

    __hash__ = object.__hash__  # identity hashing, as the chunk states'


class ReadEvent(enum.Enum):
    PLACED = "placed"
    NOTHING = "nothing"
    FILLED = "filled"
    PROBED = "probed"  # a Query's probe is back
    OVERDUE = "overdue"

    __hash__ = object.__hash__


R, V = ReadState, ReadEvent

#: A lookup's read: (state, event) -> (next state, whether this move answers the lookup).
TRANSITIONS: dict[tuple[ReadState, ReadEvent], tuple[ReadState, bool]] = {
    (R.PROBING, V.PLACED): (R.FILLING, False),
    (R.PROBING, V.NOTHING): (R.DONE, True),
    (R.PROBING, V.OVERDUE): (R.LATE_PROBING, True),
    (R.FILLING, V.FILLED): (R.DONE, True),
    (R.FILLING, V.OVERDUE): (R.LATE_FILLING, True),
    (R.LATE_PROBING, V.PLACED): (R.LATE_FILLING, False),
    (R.LATE_PROBING, V.NOTHING): (R.DONE, False),
    (R.LATE_FILLING, V.FILLED): (R.DONE, False),
}
#: A Query's read: the same, for a read that is only ever probed.
QUERY_TRANSITIONS: dict[tuple[ReadState, ReadEvent], tuple[ReadState, bool]] = {
    (R.PROBING, V.PROBED): (R.DONE, True),
    (R.PROBING, V.OVERDUE): (R.LATE_PROBING, True),
    (R.LATE_PROBING, V.PROBED): (R.DONE, False),
}


@attrs.define(eq=False, kw_only=True)
class TierRead:
    """A deferred request waiting for the lower tiers (see `LookupRead` and `QueryRead`). The
    loop owns every field; the reader reads `missing`, `deadline` (and a lookup's `holders`,
    `sizes` and `targets`) while it holds the read."""

    TABLE: ClassVar[dict[tuple[ReadState, ReadEvent], tuple[ReadState, bool]]]

    deferred: Deferred
    client: str
    items: list[tuple[str, Sequence[bytes]]]
    missing: list[tuple[str, list[bytes]]]  # per item: the keys past its RAM prefix
    deadline: float  # when the transfer must be done by (the probe's start, plus what it saves)
    overdue_at: float  # when the loop answers it without the tiers, if the reader has not by then
    keys: int = 0  # the keys it asked for, counted against its client's bound
    state: ReadState = ReadState.PROBING
    # per item: for each key of the run found below RAM, the tiers that hold it, in asking order
    holders: list[list[list[int]]] = attrs.field(factory=list)

    def advance(self, event: ReadEvent) -> bool:
        """Move by its kind's table; True when this move answers the request."""
        try:
            self.state, answers = self.TABLE[self.state, event]
        except KeyError:
            raise InvalidTransitionError(
                f"a {self.state.value} tier read cannot take event {event.value!r}; this is a bug in the tiers",
                state=self.state.value,
                event=event.value,
            ) from None
        return answers

    def answer(self, kinds: Sequence[str]) -> LookupAnswer | QueryAnswer:
        """What the loop sends back for it now (``kinds``: the tiers' kinds, in asking order)."""
        raise NotImplementedError


@attrs.define(eq=False, kw_only=True)
class LookupRead(TierRead):
    """A lookup's read: probed, then placed into RAM slots and filled, then answered from RAM."""

    TABLE: ClassVar[dict[tuple[ReadState, ReadEvent], tuple[ReadState, bool]]] = TRANSITIONS

    per_chunk: float | None = None  # the engine's seconds to compute a chunk (Lookup.prefill_s_per_chunk)
    prefix_leases: list[int] = attrs.field(factory=list)  # the tiers' leases on the RAM prefixes
    epoch: int = 0  # the tiers' clears started before it (`TierSet.clear`): a later one voids its fill
    sizes: list[int] = attrs.field(factory=list)  # per item: the payload bytes of each chunk of its run
    # per item: (reservation id, [(index in missing keys, payload offset, length)]) of the slots to fill
    targets: list[tuple[int, list[tuple[int, int, int]]]] = attrs.field(factory=list)
    # per item: the indices (in missing keys) whose slots were filled, each with its tier's position
    filled: list[dict[int, int]] = attrs.field(factory=list)

    def ref(self, item: int, i: int) -> ChunkRef:
        salt, keys = self.missing[item]
        return ChunkRef(salt, keys[i], length=self.sizes[item])

    def answer(self, kinds: Sequence[str]) -> LookupAnswer:
        """Its answer: per item, the keys (by position in the lookup) read back, and from where."""
        read_back = []
        for item, (_, keys) in enumerate(self.items):
            start = len(keys) - len(self.missing[item][1])  # the RAM prefix when the lookup came
            filled = self.filled[item] if item < len(self.filled) else {}
            read_back.append({start + i: kinds[t] for i, t in filled.items()})
        return LookupAnswer(self.deferred, self.client, self.items, read_back)


@attrs.define(eq=False, kw_only=True)
class QueryRead(TierRead):
    """A Query's read: probed only (no slot, no lease, no transfer), answered with what the
    tiers hold past each item's RAM prefix."""

    TABLE: ClassVar[dict[tuple[ReadState, ReadEvent], tuple[ReadState, bool]]] = QUERY_TRANSITIONS

    prefixes: list[int]  # per item: what RAM held when the Query came

    def answer(self, kinds: Sequence[str]) -> QueryAnswer:
        """Per item: its RAM prefix, the run past it that the tiers hold (what a lookup would read
        back), and how far into that run each tier holds every key (nothing before the probe)."""
        held = []
        for item, ram in enumerate(self.prefixes):
            run = self.holders[item] if item < len(self.holders) else []
            each = {}
            for t, kind in enumerate(kinds):
                each[kind] = next((i for i, holders in enumerate(run) if t not in holders), len(run))
            held.append((ram, len(run), each))
        return QueryAnswer(self.deferred, held)


@attrs.frozen
class Probed:
    """What a probe found: per item, the run of keys some tier holds (each key's holders) and
    the run's chunk size; `expired` when it was not asked at all (it waited too long)."""

    holders: list[list[list[int]]]
    sizes: list[int]
    expired: bool = False
    failed: bool = False

    @property
    def longest(self) -> int:
        return max((len(run) for run in self.holders), default=0)


# -- what the book asks the loop to do -------------------------------------------------------


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
class LeasePrefixes:
    """Lease each item's RAM prefix for the tiers, so that the slots taken for the rest cannot
    evict it meanwhile; feed the lease ids to `leased` (none when the index refuses)."""

    read: LookupRead


@attrs.frozen
class Probe:
    """Have the reader `probe` the tiers for this read; feed what it found to `probed`."""

    read: TierRead


@attrs.frozen
class Reserve:
    """Reserve RAM slots, owned by the asking client, for each item's run (salt, keys, chunk
    bytes; None: no run); feed the (reservation id, slots) per item to `placed`."""

    read: LookupRead
    runs: list[tuple[str, list[bytes], int] | None]


@attrs.frozen
class Fill:
    """Have the reader `fill` this read's slots; feed what it filled to `filled`."""

    read: LookupRead


@attrs.frozen
class Settle:
    """Commit the slots of a tier read's reservation that were filled (`done`), free the others."""

    reservation_id: int
    done: set[int]


@attrs.frozen
class Release:
    """Give back the tiers' leases on a read's RAM prefixes (the client holds its own now)."""

    lease_ids: list[int]


@attrs.frozen
class Warn:
    """A warning worth a (rate-limited) log line."""

    name: str
    fields: dict[str, Any]


Action = LookupAnswer | QueryAnswer | LeasePrefixes | Probe | Reserve | Fill | Settle | Release | Warn


class ReadBook:
    """The tiered reads under way, their bounds and counters, and what each move asks of the
    loop (see the module docstring). ``kinds``: the tiers' kinds, in asking order; ``clears``:
    the clears so far (a read from below before a clear of its salt is a miss)."""

    def __init__(
        self, kinds: Sequence[str], clears: ClearEpochs, read_deadline: float, read_deadline_per_chunk: float | None
    ) -> None:
        self.kinds = list(kinds)
        self.clears = clears
        self.read_deadline = read_deadline
        self.read_deadline_per_chunk = read_deadline_per_chunk
        self.counters = dict.fromkeys(READ_COUNTERS, 0)
        self.open: deque[TierRead] = deque()  # reads not done yet, oldest first (for `timer`)
        self.keys_of: dict[str, int] = {}  # per client: keys of its reads waiting for the tiers
        self.keys_waiting = 0  # and their sum
        self.prefix_leases = 0  # leases held on the RAM prefixes of those lookups
        self._actions: list[Action] = []

    def take_actions(self) -> list[Action]:
        """What to do, in order, since the last call."""
        actions, self._actions = self._actions, []
        return actions

    # -- deadlines ---------------------------------------------------------------------------

    def longest_wait(self) -> float:
        """Seconds a read may wait for the tiers before it counts as overdue."""
        return 2 * self.read_deadline + OVERDUE_GRACE_S

    def deadline_for(self, chunks: int, engine_per_chunk: float | None = None) -> float:
        """Seconds a lookup may wait for the tiers when they hold a run of ``chunks``: the prefill
        that run saves (``read_deadline_per_chunk`` each, and the engine's own estimate
        ``engine_per_chunk``, whichever is shorter), at most ``read_deadline``."""
        per_chunk = [p for p in (self.read_deadline_per_chunk, engine_per_chunk) if p is not None]
        return min([self.read_deadline, *(chunks * p for p in per_chunk)])

    # -- what the loop feeds it --------------------------------------------------------------

    def admits(self, client: str, items: Sequence[tuple[str, Sequence[bytes]]]) -> bool:
        """Whether a read of ``items`` may wait for the tiers: not past the request's key limit
        (RAM's answer refuses it with its typed error), nor past the client's or everyone's
        bound on keys waiting (counted as refused)."""
        count = sum(len(keys) for _, keys in items)
        if count > MAX_KEYS_PER_REQUEST:
            return False
        if self.keys_of.get(client, 0) + count > MAX_READ_KEYS_PER_CLIENT or self.keys_waiting + count > MAX_READ_KEYS:
            self.counters["reads_refused"] += 1
            return False
        return True

    def lookup(
        self,
        client: str,
        items: list[tuple[str, Sequence[bytes]]],
        prefixes: list[int],
        now: float,
        per_chunk: float | None = None,
    ) -> LookupRead | None:
        """Start reading the keys past each item's RAM prefix (``prefixes``) for a lookup: lease
        the prefixes, then probe. None when all is in RAM (the common case costs no lease)."""
        if (missing := _past(items, prefixes)) is None:
            return None
        read = LookupRead(**self._begin(client, items, missing, now), per_chunk=per_chunk, epoch=self.clears.now)
        if self.prefix_leases + len(items) <= MAX_PREFIX_LEASES:  # else it reads without holding them
            self._actions.append(LeasePrefixes(read))
        self.counters["reads_deferred"] += 1
        self._start(read)
        return read

    def leased(self, read: LookupRead, lease_ids: list[int]) -> None:
        """The index leased these of ``read``'s RAM prefixes for the tiers."""
        read.prefix_leases = lease_ids
        self.prefix_leases += len(lease_ids)

    def query(
        self, client: str, items: list[tuple[str, Sequence[bytes]]], prefixes: list[int], now: float
    ) -> QueryRead | None:
        """A Query's read of the keys past each RAM prefix; the loop either probes it at once
        (`probed_now`) or has the reader do it (`defer`). None when all is in RAM."""
        if (missing := _past(items, prefixes)) is None:
            return None
        self.counters["queries_probed"] += 1
        return QueryRead(**self._begin(client, items, missing, now), prefixes=prefixes)

    def probed_now(self, read: QueryRead, found: Probed) -> QueryAnswer:
        """The answer to a Query probed on the loop (every tier up answers from memory): it never
        waited, so it was never counted against the bounds."""
        read.holders = found.holders
        return read.answer(self.kinds)

    def defer(self, read: QueryRead) -> None:
        """Have the reader probe a Query: it waits, bounded as lookups are, with them."""
        self.counters["queries_deferred"] += 1
        self._start(read)

    def probed(self, read: TierRead, found: Probed, now: float) -> None:
        """The probe is back: a Query is answered with it; a lookup's deadline follows from the
        longest run found, and slots are reserved for the runs unless no time is left."""
        self.counters["reads_expired"] += found.expired
        read.holders = found.holders
        if isinstance(read, QueryRead):
            self._finish(read, ReadEvent.PROBED)
            return
        assert isinstance(read, LookupRead)
        read.sizes = found.sizes
        if not found.expired:
            read.deadline += self.deadline_for(found.longest, read.per_chunk)
        if now >= read.deadline:  # no time left for any transfer: take no slots (they might evict)
            self.counters["read_late"] += sum(len(run) for run in read.holders)
            read.holders = []
            self.placed(read, [], now)
            return
        runs = [
            (salt, keys[: len(held)], read.sizes[item]) if held else None
            for item, ((salt, keys), held) in enumerate(zip(read.missing, read.holders, strict=True))
        ]
        self._actions.append(Reserve(read, runs))

    def placed(self, read: LookupRead, targets: list[tuple[int, list[tuple[int, int, int]]]], now: float) -> None:
        """The slots reserved per item (reservation id, slots): the reader fills them, if any and
        if time is left; else the read is done, a miss past the RAM prefixes."""
        read.targets = targets
        if now < read.deadline and any(slots for _, slots in targets):
            read.advance(ReadEvent.PLACED)
            self._actions.append(Fill(read))
        else:
            self.filled(read, [], ReadEvent.NOTHING)

    def filled(self, read: LookupRead, filled: list[dict[int, int]], event: ReadEvent = ReadEvent.FILLED) -> None:
        """The reader is done: publish the slots filled in time (none read before a clear of their
        salt), give back the others, answer the lookup unless it was answered as overdue."""
        read.filled = filled
        for item, (reservation_id, _slots) in enumerate(read.targets):
            done = set(filled[item]) if item < len(filled) else set()
            if done and self.clears.since(read.missing[item][0], read.epoch, below=True):
                done = set()  # read before a clear of its salt: those bytes were deleted
            self.counters["read_hits"] += len(done)
            self.counters["read_misses"] += len(read.missing[item][1]) - len(done)
            if reservation_id:
                self._actions.append(Settle(reservation_id, done))
        self._finish(read, event)

    def timer(self, now: float) -> None:
        """Answer from RAM the reads still waiting past their longest wait: the reader is stuck in
        a tier call. What it reads for them later is still published when it is done."""
        while self.open and (self.open[0].state is ReadState.DONE or self.open[0].overdue_at <= now):
            read = self.open.popleft()
            if read.state is not ReadState.DONE and read.advance(ReadEvent.OVERDUE):
                self.counters["reads_overdue"] += 1
                fields = {"after_s": round(self.longest_wait(), 3), "reason": "a tier call hangs"}
                self._actions += [Warn("tier_read_overdue", fields), read.answer(self.kinds)]

    # -- internals ---------------------------------------------------------------------------

    def _begin(
        self, client: str, items: list[tuple[str, Sequence[bytes]]], missing: list[tuple[str, list[bytes]]], now: float
    ) -> dict[str, Any]:
        """The fields every read begins with: its deferred reply, and its deadlines from ``now``."""
        overdue_at = now + self.longest_wait()
        return {
            "deferred": Deferred(),
            "client": client,
            "items": items,
            "missing": missing,
            "deadline": now,
            "overdue_at": overdue_at,
        }

    def _start(self, read: TierRead) -> None:
        """Count a read against its client's bound and have the reader probe it."""
        read.keys = sum(len(keys) for _, keys in read.items)
        self.open.append(read)
        self.keys_of[read.client] = self.keys_of.get(read.client, 0) + read.keys
        self.keys_waiting += read.keys
        self._actions.append(Probe(read))

    def _finish(self, read: TierRead, event: ReadEvent) -> None:
        """Move ``read`` to DONE by ``event``: answer it if the move says so, give back what it held."""
        if read.advance(event):
            self._actions.append(read.answer(self.kinds))
        if isinstance(read, LookupRead) and read.prefix_leases:
            self._actions.append(Release(read.prefix_leases))
            self.prefix_leases -= len(read.prefix_leases)
        self.keys_waiting -= read.keys
        left = self.keys_of[read.client] - read.keys
        if left:
            self.keys_of[read.client] = left
        else:
            del self.keys_of[read.client]


def _past(items: Sequence[tuple[str, Sequence[bytes]]], prefixes: list[int]) -> list[tuple[str, list[bytes]]] | None:
    """Per item, the keys past its RAM prefix; None when there are none at all."""
    missing = [(salt, list(keys[prefix:])) for (salt, keys), prefix in zip(items, prefixes, strict=True)]
    return missing if any(keys for _, keys in missing) else None
