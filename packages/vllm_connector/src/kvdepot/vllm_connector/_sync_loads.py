"""Hits that join the step that finds them (`LoadOp.sync`): each pass's budget, and when their steps end.

A hit wholly in the server's RAM loads before the forward pass of the step that schedules it,
as far as the pass's budget allows (`_sync_budget.py`: `kvdepot.sync_load_bytes` on an idle
engine, else a share of the step's time at the workers' copy rate). Its blocks are kept from other requests'
prefix hits until its step has ended (`_sync_guard.py`). A step has ended by the time the one
after the next is scheduled, with async scheduling too (one step in flight): then its sync
loads are done (the scheduler side gives their leases back), and if it stored, the scheduler
side looks up again the waiting requests whose hit stopped short (`stores_ended_at`).
"""

from __future__ import annotations

import collections
import logging
from typing import Any

from kvdepot.vllm_connector._sync_budget import SyncBudget
from kvdepot.vllm_connector._sync_guard import SyncGuard

log = logging.getLogger("vllm.kvdepot.scheduler")


class SyncLoads:
    """This pass's sync-load budget, the blocks of sync loads in flight, and the last two steps."""

    def __init__(self, cap: int, share: float) -> None:
        """``cap``: the most bytes of hits a pass loads before its forward pass (0: none);
        ``share``: while others run, the most those copies may add to a step, as a share of it."""
        self.budget = SyncBudget(cap, share)
        self.budget.open(idle=True)  # the first pass: nothing ran before it
        self._loading: list[str] = []  # this pass's sync loads
        self.guard = SyncGuard()  # their blocks, kept from other requests until known good
        # The last two steps scheduled: (whether it stored, its sync loads).
        self._recent: collections.deque[tuple[bool, list[str]]] = collections.deque()
        self.stores_ended_at = 0.0

    def joins(self, first_token: int, num_tokens: int, *, chunk_size: int, slot_bytes: int) -> bool:
        """Whether a hit of ``num_tokens`` from token ``first_token`` on, in chunks of
        ``slot_bytes``, fits in what is left of this pass's budget (it is then taken)."""
        chunks = -(-(first_token + num_tokens) // chunk_size) - first_token // chunk_size
        return self.budget.take(chunks * slot_bytes)

    def loading(self, req_id: str, hashes: list[Any], blocks: list[int]) -> None:
        """A sync load of this pass fills ``blocks`` (their hashes ``hashes``): guarded until its step ends."""
        self._loading.append(req_id)
        self.guard.loading(req_id, hashes, blocks)

    def pass_started(self, now: float, *, idle: bool) -> list[str]:
        """A scheduling pass starts (``idle``: the step before computed nothing): its budget is
        whole again; the sync loads of the step that ended since (copied; a failure was reported
        already), settled."""
        self.budget.open(idle=idle)
        if len(self._recent) < 2:
            return []
        stored, synced = self._recent.popleft()
        if stored:
            self.stores_ended_at = now
        for req_id in synced:
            self.guard.settle(req_id)
        return synced

    def pass_planned(self, stored: bool) -> None:
        """The pass's step is planned (``stored``: it stores chunks), with this pass's sync loads."""
        self._recent.append((stored, self._loading))
        self._loading = []

    def evict_failed(self, req_id: str, manager: Any) -> None:
        """Take a failed sync load's blocks out of vLLM's prefix cache (``manager``: vLLM's KV-cache
        manager): the request recomputes into them, and nobody else can take them for a hit in the
        meantime, nor after it was aborted."""
        blocks = self.guard.failed(req_id)
        if not blocks:
            return
        try:
            manager.evict_blocks(set(blocks))
        except Exception:  # a vLLM without it: the blocks stay cached, as vLLM's own recovery leaves them
            log.exception("kvdepot: could not take the blocks of %s's failed load out of vLLM's prefix cache", req_id)
