"""The reader thread of the tiered reads: the blocking calls `probe` and `fill`, and its queue.

`TierSet` (`_tiering.py`) hands the reader a read when the reads' book (`_tier_read.py`) asks
for a `Probe` or a `Fill`; the reader runs the call and posts what it found back to the loop,
which feeds it to the book. Nothing here touches the index or the book: a read's fields are
the loop's, and the reader only reads `missing`, `holders`, `sizes`, `targets` and `deadline`
while it holds the read.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from kvdepot.server._tier_read import LookupRead, Probed, TierRead
from kvdepot.server._tiers import ChunkRef, Tier, TierState
from kvdepot.transport import get_logger

log = get_logger(__name__)

#: Keys per item the first probe asks the tiers about; each later probe of the items whose run
#: goes on asks 4x more. An engine's lookup (a few hundred keys) takes one probe.
PROBE_WINDOW = 256


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
    """Grow each item's run window by window, while it covers the whole window and time is left."""
    open_items = [item for item, (_, keys) in enumerate(read.missing) if keys]
    start, window = 0, PROBE_WINDOW
    while open_items:
        left = read.deadline + read_deadline - time.monotonic()  # the longest it may wait
        if start and left <= 0:
            return
        spans = [(item, min(start + window, len(read.missing[item][1]))) for item in open_items]
        refs = [
            ChunkRef(read.missing[item][0], key) for item, stop in spans for key in read.missing[item][1][start:stop]
        ]
        held = [tier.lengths(refs, timeout=left) if up(tier) else [None] * len(refs) for tier in tiers]
        found = iter([[lengths[k] for lengths in held] for k in range(len(refs))])  # per key asked: each tier's
        going_on = []
        for item, stop in spans:
            sizes[item] = _extend_run(runs[item], sizes[item], range(start, stop), found)
            if len(runs[item]) == stop < len(read.missing[item][1]):
                going_on.append(item)
        start, window, open_items = start + window, window * 4, going_on


def _extend_run(run: list[list[int]], size: int, span: range, found: Iterator[list[int | None]]) -> int:
    """Add to ``run`` the keys of ``span`` that the tiers hold at the run's chunk size, taking
    each key's lengths (one per tier) from ``found``; the run's chunk size, which its first key sets."""
    for i in span:
        lengths = next(found)
        if i == 0:  # the run's chunk size: what the first tier holding its first key has
            size = next((n for n in lengths if n), 0)
        holders = [t for t, n in enumerate(lengths) if n and n == size]
        if holders and len(run) == i:  # else the run ended at an earlier key
            run.append(holders)
    return size


def fill(tiers: Sequence[Tier], pool: memoryview, read: LookupRead) -> list[dict[int, int]]:
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
