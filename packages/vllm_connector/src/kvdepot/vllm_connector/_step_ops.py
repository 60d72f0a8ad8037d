"""What a scheduling pass hands the workers: its loads and stores, made from the planner's plans.

A load (`load_op`) copies a hit's chunks from the server's slots into the blocks vLLM allocated
for it, in every KV-cache group at the chunks' positions. A store (`StorePlans.op`) takes the
full chunks the planner (`kvdepot.core.Planner.on_scheduled`) lets a step of a running request
store, never twice and never over a load not yet confirmed, from the request's blocks; the
workers read those blocks within the step (`_stores.py`).

With several KV-cache groups (a hybrid or sliding-window model) the planner accounts for the
request's positions, and a chunk is stored from the blocks of every group at those positions.
A sliding-window block may go back to vLLM's pool while its request runs: a store then takes
a chunk only if vLLM's block table still holds every one of its blocks when it is planned.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvdepot.vllm_connector._groups import NULL_BLOCK_ID, CacheGroup, ours
from kvdepot.vllm_connector._meta import LoadOp, StoreOp
from kvdepot.vllm_connector._record import RUNNING

if TYPE_CHECKING:
    from kvdepot.core import Planner, RetrievePlan
    from kvdepot.vllm_connector._kv_events import EventAnnouncer
    from kvdepot.vllm_connector._record import Record


def load_op(plan: RetrievePlan, record: Record, block_ids: tuple[list[int], ...], blocks_per_chunk: int) -> LoadOp:
    """The load of a retrieve plan into the request's blocks ``block_ids`` (one list per group)."""
    start, end = plan.first_chunk * blocks_per_chunk, (plan.first_chunk + plan.num_chunks) * blocks_per_chunk
    return LoadOp(
        req_id=plan.req_id,
        server_id=plan.source,
        slots=[list(rank_slots) for rank_slots in plan.slots],
        block_ids=[list(group[start:end]) for group in block_ids],
        skip_blocks=plan.skip_blocks,
        num_tokens=plan.num_tokens,
        slot_bytes=record.slot_bytes,
        salt=plan.cache_salt,
        keys=[list(rank_keys) for rank_keys in plan.keys],
        sync=record.sync_load,
    )


class StorePlans:
    """Makes the stores of the steps vLLM schedules."""

    def __init__(self, planner: Planner, groups: tuple[CacheGroup, ...], events: EventAnnouncer | None) -> None:
        self.planner, self.groups, self.events = planner, groups, events
        # With several groups, or one whose blocks vLLM may drop while their request runs (a
        # window), the blocks of each store are read from vLLM's block table when it is planned.
        self.windowed = len(groups) > 1 or not groups[0].stable

    def op(
        self, record: Record, num_tokens: int, block_ids: list[int], *, replace: bool, manager: Any
    ) -> StoreOp | None:
        """The store of a step scheduling ``num_tokens`` of the request, its new blocks (of the
        first group) ``block_ids``, or all of them with ``replace``; None if it stores nothing.
        ``manager``: vLLM's KV-cache manager, whose block table a windowed store reads."""
        req_id = record.request.request_id
        tracker = self.planner.get(req_id)
        if tracker.state not in RUNNING:
            return None
        if len(getattr(record.request, "mm_features", None) or ()) != len(tracker.marks):
            return None  # a streaming session got media after it was keyed: its keys no longer describe its KV
        plan = self.planner.on_scheduled(
            req_id, num_tokens, record.request.all_token_ids, block_ids, replace_blocks=replace
        )
        if plan is None:
            return None
        keys, blocks = [list(k) for k in plan.keys], [list(plan.block_ids)]
        if self.events is not None:
            self.events.expect(record.request, plan.first_chunk, keys, plan.cache_salt)
        if self.windowed:
            table = ours(self.groups, manager.get_block_ids(req_id)) if manager is not None else ()
            keys, blocks = self._windowed(table, plan.first_chunk, keys)
            if not blocks[0]:
                return None
        return StoreOp(req_id=req_id, salt=plan.cache_salt, keys=keys, block_ids=blocks, first_chunk=plan.first_chunk)

    def _windowed(
        self, table: tuple[list[int], ...], first_chunk: int, keys: list[list[bytes]]
    ) -> tuple[list[list[bytes]], list[list[int]]]:
        """The chunks of a store whose blocks still hold their tokens in every group of vLLM's
        block ``table`` (the request's blocks per group).

        A chunk with a block vLLM dropped from the window (its null block) is not stored by
        this request; the blocks still in the table are read by the workers within this step.
        """
        bpc = self.planner.blocks_per_chunk
        kept: list[int] = []
        blocks: list[list[int]] = [[] for _ in self.groups]
        for index in range(len(keys[0])):
            start = (first_chunk + index) * bpc
            chunk = [group[start : start + bpc] for group in table]
            if len(chunk) != len(self.groups) or any(
                len(ids) != bpc or NULL_BLOCK_ID in ids for ids in chunk
            ):  # fmt: skip
                continue
            kept.append(index)
            for out, ids in zip(blocks, chunk, strict=True):
                out.extend(ids)
        return [[rank_keys[i] for i in kept] for rank_keys in keys], blocks
