"""The daemon's garbage collection: full collections on the loop's schedule, not CPython's.

The chunk index holds a record per chunk and an order per salt, long-lived and free of
reference cycles. CPython collects its oldest generation whenever the long-lived objects grew
by a quarter, and each such collection walks every one of them with the loop stopped: under
churn (chunks stored and evicted, salts coming and going) that was a pause of 15-70 ms
several times in ten seconds, for every client at once. A `kvdepot serve` process therefore
freezes what it built at start (imports, the pool's tables) out of the collector's way, keeps
the young generations as they are (cycles of short-lived objects still go at once), and runs
a full collection only every `FULL_COLLECTION_INTERVAL_S` from its loop.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

from kvdepot.transport import get_logger

log = get_logger(__name__)

# Seconds between full collections: cycles that outlived the young generations wait this long.
FULL_COLLECTION_INTERVAL_S = 60.0
# A third-generation threshold no count reaches: CPython never starts a full collection itself.
_NEVER = 1 << 30


class Collector:
    """`take_over()` moves full collections onto `run(now)`; `give_back()` restores CPython's own."""

    def __init__(self, clock: Callable[[], float], interval: float = FULL_COLLECTION_INTERVAL_S) -> None:
        self._clock = clock
        self.interval = interval
        self._threshold: tuple[int, int, int] | None = None  # CPython's, while taken over
        self._next = 0.0
        self.full_collections = 0

    def take_over(self) -> None:
        """Freeze what exists now and stop CPython's own full collections (a process-wide setting:
        for the process that is the server, not for one that embeds it beside other work)."""
        if self._threshold is not None:
            return
        gc.collect()
        gc.freeze()
        self._threshold = gc.get_threshold()
        gc.set_threshold(self._threshold[0], self._threshold[1], _NEVER)
        self._next = self._clock() + self.interval

    def run(self, now: float) -> None:
        """A full collection if one is due (loop thread)."""
        if self._threshold is not None and now >= self._next:
            start = time.perf_counter()
            found = gc.collect()
            self.full_collections += 1
            log.debug("full_collection", unreachable=found, ms=round((time.perf_counter() - start) * 1e3, 1))
            self._next = now + self.interval

    def give_back(self) -> None:
        if self._threshold is None:
            return
        gc.set_threshold(*self._threshold)
        gc.unfreeze()
        self._threshold = None
