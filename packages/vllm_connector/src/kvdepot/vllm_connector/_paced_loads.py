"""A CPU engine's loads, copied by the engine's own thread at the end of its steps.

On a CPU a copy beside the forward pass would take a core from it. So a CPU engine's loads wait
here, and the engine's thread copies them in `get_finished`, at its step's end, with torch's own
OpenMP team (the pool mapping's engine copiers), oldest first: a step that computes nothing
copies them whole; a step that computes copies whole chunks of them for at most ``share`` of its
own time so far, one chunk at least, so that running requests' steps stay as fast as without a
load. A load whose server restarted meanwhile (a newer mapping waits for the copy thread) is
handed to the copy thread, which finishes it (`_worker.py`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from kvdepot.vllm_connector._loads import Checked, PacedLoad

if TYPE_CHECKING:
    from collections.abc import Callable
    from concurrent.futures import Future

    from kvdepot.vllm_connector._chunk_slots import SlotLayout
    from kvdepot.vllm_connector._meta import LoadOp
    from kvdepot.vllm_connector._pool_mapping import _PoolMapping


class PacedLoads:
    """The loads waiting for the engine's thread (engine thread only)."""

    def __init__(
        self,
        *,
        share: float,
        check: Callable[[LoadOp, _PoolMapping], Checked],
        loaded: Callable[[LoadOp, int], None],
        hand_off: Callable[[PacedLoad], None],
    ) -> None:
        """``check``: a load's slots, checked against the mapping (raises what is wrong);
        ``loaded``: counts a load's chunks once copied; ``hand_off``: finishes a load on the copy thread."""
        self.share = share
        self._check = check
        self._loaded = loaded
        self._hand_off = hand_off
        self.queue: list[PacedLoad] = []
        self.step_started_at = time.monotonic()
        self._budget_end = float("inf")  # while `copy` runs: when its share of the step is spent
        self._copied = False  # while `copy` runs: a chunk was copied (one at least a step)

    def __len__(self) -> int:
        return len(self.queue)

    def add(self, op: LoadOp) -> Future[None]:
        """Queue ``op``; its future settles once copied (or failed)."""
        paced = PacedLoad(op)
        self.queue.append(paced)
        return paced.future

    def fail_all(self, exc: BaseException) -> None:
        """Fail every load not yet copied (vLLM recomputes them)."""
        for paced in self.queue:
            paced.future.set_exception(exc)
        self.queue.clear()

    def copy(self, pool: _PoolMapping | None, slots: SlotLayout, *, whole: bool) -> None:
        """Copy the loads, oldest first: all of them (``whole``), or whole chunks until ``share`` of
        the step's time so far is spent, one at least. The caller holds the mapping's lock; a
        ``pool`` of None (a newer mapping waits for the copy thread) hands every load to it."""
        started = time.monotonic()
        self._budget_end = float("inf") if whole else started + (started - self.step_started_at) * self.share
        self._copied = False
        while self.queue:
            paced = self.queue[0]
            if pool is None or paced.op.server_id != pool.server_id:
                # A newer mapping waits on the copy thread (a server restart): it loads this one.
                self.queue.pop(0)
                self._hand_off(paced)
                continue
            try:
                done = self._copy_chunks(paced, pool, slots)
            except Exception as exc:
                self.queue.pop(0)
                paced.future.set_exception(exc)
                continue
            if not done:
                return  # the budget is spent: the next step goes on
            self.queue.pop(0)
            self._loaded(paced.op, paced.done_chunks)
            paced.future.set_result(None)

    def _copy_chunks(self, paced: PacedLoad, pool: _PoolMapping, slots: SlotLayout) -> bool:
        """Copy ``paced``'s chunks one at a time: True once all are, False when the budget ran out first."""
        if paced.checked is None:
            paced.checked = self._check(paced.op, pool)
        while paced.done_chunks < len(paced.checked.slots):
            if self._copied and time.monotonic() >= self._budget_end:
                return False
            start = paced.done_chunks
            slots.scatter(paced.op, pool, pool.engine_copiers, paced.checked, start=start, stop=start + 1)
            paced.done_chunks += 1
            self._copied = True
        return True
