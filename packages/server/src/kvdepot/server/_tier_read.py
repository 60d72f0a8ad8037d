"""A lookup that misses RAM, read through the tiers below: its state machine and its reader.

`TierSet` (`_tiering.py`) drives each `TierRead` on the server's loop by the table below; the
reader thread (`Reader`) only runs the blocking calls, `probe` then `fill`, and posts what
they found back to the loop. Nothing the reader runs touches the index.

Life of a tiered read::

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
- overdue: the reader has held the read past `TierSet.longest_wait` (a tier call hangs): the
  loop answers the lookup from RAM as it stands, and whatever the reader reads later is
  still published.

A pair not in the table raises `InvalidTransitionError`: a bug, never a silent no-op. The
lookup is answered exactly once, by the move that says so; the read is settled (its prefix
leases and key counts given back) when it reaches DONE.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from kvdepot.core import InvalidTransitionError
from kvdepot.server._tiers import ChunkRef, Tier, TierState
from kvdepot.transport import Deferred, get_logger

log = get_logger(__name__)

#: Keys per item the first probe asks the tiers about; each later probe of the items whose run
#: goes on asks 4x more. An engine's lookup (a few hundred keys) takes one probe.
PROBE_WINDOW = 256


class ReadState(enum.Enum):
    PROBING = "probing"  # the reader asks the tiers which keys they hold
    FILLING = "filling"  # slots are reserved; the reader reads the chunks into them
    LATE_PROBING = "late_probing"  # answered from RAM already; the reader still probes
    LATE_FILLING = "late_filling"  # answered from RAM already; the reader still fills
    DONE = "done"  # settled: slots published or given back, the lookup answered

    __hash__ = object.__hash__  # identity hashing, as the chunk states'


class ReadEvent(enum.Enum):
    PLACED = "placed"
    NOTHING = "nothing"
    FILLED = "filled"
    OVERDUE = "overdue"

    __hash__ = object.__hash__


R, V = ReadState, ReadEvent

#: (state, event) -> (next state, whether this move answers the lookup).
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


@attrs.define(eq=False)
class TierRead:
    """A deferred lookup waiting for the lower tiers. The loop owns every field; the reader
    reads `missing`, `holders`, `sizes`, `targets` and `deadline` while it holds the read."""

    deferred: Deferred
    client: str
    items: list[tuple[str, Sequence[bytes]]]
    missing: list[tuple[str, list[bytes]]]  # per item: the keys past its RAM prefix
    deadline: float  # when the transfer must be done by (the probe's start, plus what it saves)
    overdue_at: float  # when the loop answers it without the tiers, if the reader has not by then
    per_chunk: float | None = None  # the engine's seconds to compute a chunk (Lookup.prefill_s_per_chunk)
    prefix_leases: list[int] = attrs.field(factory=list)  # the tiers' leases on the RAM prefixes
    keys: int = 0  # the keys it asked for, counted against its client's bound
    epoch: int = 0  # the tiers' clears started before it (`TierSet.clear`): a later one voids its fill
    #: A Query's read: probed only, never placed or filled; answered with what the tiers hold
    #: past these RAM prefixes (per item).
    query_prefixes: list[int] | None = None
    state: ReadState = ReadState.PROBING
    # per item: for each key of the run found below RAM, the tiers that hold it, in asking order
    holders: list[list[list[int]]] = attrs.field(factory=list)
    sizes: list[int] = attrs.field(factory=list)  # per item: the payload bytes of each chunk of its run
    # per item: (reservation id, [(index in missing keys, payload offset, length)]) of the slots to fill
    targets: list[tuple[int, list[tuple[int, int, int]]]] = attrs.field(factory=list)
    # per item: the indices (in missing keys) whose slots were filled, each with its tier's position
    filled: list[dict[int, int]] = attrs.field(factory=list)

    def advance(self, event: ReadEvent) -> bool:
        """Move by the table; True when this move answers the lookup."""
        try:
            self.state, answers = TRANSITIONS[self.state, event]
        except KeyError:
            raise InvalidTransitionError(
                f"a {self.state.value} tier read cannot take event {event.value!r}; this is a bug in the tiers",
                state=self.state.value,
                event=event.value,
            ) from None
        return answers

    def held_below(self, tiers: Sequence[Tier]) -> list[tuple[int, dict[str, int]]]:
        """Per item, the run past its RAM prefix that the tiers hold (what a lookup would read
        back), and how far into it each tier holds every key (nothing before the probe)."""
        out = []
        for item in range(len(self.missing)):
            run = self.holders[item] if item < len(self.holders) else []
            each = {}
            for t, tier in enumerate(tiers):
                each[tier.kind] = next((i for i, holders in enumerate(run) if t not in holders), len(run))
            out.append((len(run), each))
        return out

    def ref(self, item: int, i: int) -> ChunkRef:
        salt, keys = self.missing[item]
        return ChunkRef(salt, keys[i], length=self.sizes[item])


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


def up(tier: Tier) -> bool:
    """Whether a tier is worth asking now."""
    return tier.state is TierState.UP


def probe(tiers: Sequence[Tier], read: TierRead, read_deadline: float) -> Probed:
    """Ask each tier which of the keys past the RAM prefixes it holds, and at what length
    (reader thread): nothing is transferred, so a cold prompt costs no bytes and no slots.

    Keys are asked for a window at a time (`PROBE_WINDOW`, then 4x larger each time), and only
    for the items whose run covered the whole last window: the first key no tier holds ends
    its item's probe, so a cold prompt of 65,536 keys costs one window, not 65,536 names and
    lookups (one STRLEN pipeline per window on the remote)."""
    runs: list[list[list[int]]] = [[] for _ in read.missing]
    sizes = [0] * len(read.missing)
    if time.monotonic() >= read.deadline + read_deadline:  # waited its longest in the queue already
        return Probed(runs, sizes, expired=True)
    try:
        _probe_runs(tiers, read, runs, sizes, read_deadline)
    except Exception:
        log.exception("tier_read_failed")
        return Probed([[] for _ in read.missing], sizes, failed=True)
    return Probed(runs, sizes)


def _probe_runs(
    tiers: Sequence[Tier], read: TierRead, runs: list[list[list[int]]], sizes: list[int], read_deadline: float
) -> None:
    open_items = [item for item, (_, keys) in enumerate(read.missing) if keys]
    start, window = 0, PROBE_WINDOW
    while open_items:
        left = read.deadline + read_deadline - time.monotonic()  # the longest it may wait
        if start and left <= 0:
            return
        spans = [(item, min(start + window, len(read.missing[item][1]))) for item in open_items]
        refs = [ChunkRef(read.missing[item][0], key) for item, stop in spans for key in _keys(read, item, start, stop)]
        held = [tier.lengths(refs, timeout=left) if up(tier) else [None] * len(refs) for tier in tiers]
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


def _keys(read: TierRead, item: int, start: int, stop: int) -> list[bytes]:
    return read.missing[item][1][start:stop]


def fill(tiers: Sequence[Tier], pool: memoryview, read: TierRead) -> list[dict[int, int]]:
    """Read the chunks straight into their reserved slots, each from the first tier that holds
    it and, where that read fails, from the next (reader thread). A tier's read returns by the
    deadline, and writes a slot only before it returns. Per item, the indices filled, each with
    the position of the tier it came from."""
    filled: list[dict[int, int]] = [{} for _ in read.targets]
    try:
        for t, tier in enumerate(tiers):
            places = [
                (item, i, offset, length)
                for item, (_, slots) in enumerate(read.targets)
                for i, offset, length in slots
                if i not in filled[item] and t in read.holders[item][i]
            ]
            left = read.deadline - time.monotonic()
            if not places or left <= 0 or not up(tier):
                continue
            refs = [read.ref(item, i) for item, i, _, _ in places]
            into = [pool[offset : offset + length] for _, _, offset, length in places]
            for (item, i, _, _), ok in zip(places, tier.read(refs, into, timeout=left), strict=True):
                if ok:
                    filled[item][i] = t
    except Exception:
        log.exception("tier_read_failed")
    return filled


class Reader:
    """One thread that runs each client's work in the order it came, taking clients in turn: a
    client with many reads queued delays another's new one by about one step of its own (besides
    the step running), not by all of them."""

    def __init__(self, name: str) -> None:
        self._queues: dict[str, deque[Callable[[], Any]]] = {}
        self._turns: deque[str] = deque()  # clients with work, in the order they get the thread
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, client: str, work: Callable[[], Any]) -> None:
        with self._cond:
            if self._closed:
                return
            queue = self._queues.get(client)
            if queue is None:
                queue = self._queues[client] = deque()
                self._turns.append(client)
            queue.append(work)
            self._cond.notify()

    def _take(self) -> Callable[[], Any] | None:
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
            try:
                work()
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
