"""A scheduling pass's loads and stores, made from the planner's plans (`_step_ops.py`); no vLLM."""

from __future__ import annotations

from types import SimpleNamespace

from kvdepot.core import Namespace, Planner
from kvdepot.vllm_connector._groups import NULL_BLOCK_ID, CacheGroup
from kvdepot.vllm_connector._record import Record
from kvdepot.vllm_connector._step_ops import StorePlans, load_op

BLOCK, CHUNK = 4, 8  # two blocks a chunk
FULL = CacheGroup(("full",), index=0)
WINDOW = CacheGroup(("window",), kind="sliding_window", window=8, index=1)


def running(planner: Planner, n: int) -> Record:
    """A request of ``n`` tokens, looked up with no hit and allocated: ready to store."""
    request = SimpleNamespace(request_id="r", all_token_ids=list(range(100, 100 + n)), num_tokens=n, mm_features=[])
    planner.add_request("r")
    planner.start_lookup("r", request.all_token_ids)
    planner.on_lookup_done("r", [0], ())
    planner.on_allocated("r", [], 0)
    return Record(request)


class Manager:
    """vLLM's KV-cache manager as a windowed store reads it: the request's blocks per group."""

    def __init__(self, *groups: list[int]) -> None:
        self.groups = groups

    def get_block_ids(self, req_id: str) -> tuple[list[int], ...]:
        return self.groups


def test_one_full_group_stores_every_planned_chunk_from_the_plans_blocks() -> None:
    planner = Planner(Namespace(model="m"), block_size=BLOCK, chunk_size=CHUNK)
    plans = StorePlans(planner, (CacheGroup(()),), None)
    assert not plans.windowed
    op = plans.op(running(planner, 20), 20, [1, 2, 3, 4, 5], replace=True, manager=None)
    assert op is not None
    assert (len(op.keys[0]), op.block_ids) == (2, [[1, 2, 3, 4]])


def test_a_windowed_store_takes_only_chunks_whose_blocks_every_group_still_holds() -> None:
    """Chunk 0's window block went back to vLLM (its null block): chunk 1 alone is stored, from both groups."""
    planner = Planner(Namespace(model="m"), block_size=BLOCK, chunk_size=CHUNK)
    plans = StorePlans(planner, (FULL, WINDOW), None)
    assert plans.windowed
    record = running(planner, 20)
    table = Manager([1, 2, 3, 4, 5], [NULL_BLOCK_ID, 12, 13, 14, 15])
    op = plans.op(record, 20, [1, 2, 3, 4, 5], replace=True, manager=table)
    assert op is not None
    assert op.block_ids == [[3, 4], [13, 14]]
    assert len(op.keys[0]) == 1


def test_a_windowed_store_whose_chunks_all_left_the_window_is_none() -> None:
    planner = Planner(Namespace(model="m"), block_size=BLOCK, chunk_size=CHUNK)
    plans = StorePlans(planner, (FULL, WINDOW), None)
    table = Manager([1, 2, 3, 4, 5], [NULL_BLOCK_ID] * 5)
    assert plans.op(running(planner, 20), 20, [1, 2, 3, 4, 5], replace=True, manager=table) is None


def test_a_request_that_is_not_running_stores_nothing() -> None:
    planner = Planner(Namespace(model="m"), block_size=BLOCK, chunk_size=CHUNK)
    request = SimpleNamespace(request_id="r", all_token_ids=list(range(20)), num_tokens=20, mm_features=[])
    planner.add_request("r")
    assert StorePlans(planner, (CacheGroup(()),), None).op(Record(request), 20, [1], replace=True, manager=None) is None


def test_a_load_takes_each_groups_blocks_at_the_chunks_positions() -> None:
    """The plan's chunks 1-2 (blocks 2 to 5 of each group), its slots, keys and leases' instance."""
    planner = Planner(Namespace(model="m"), block_size=BLOCK, chunk_size=CHUNK)
    planner.add_request("r")
    planner.start_lookup("r", list(range(30)), local_tokens=8)
    planner.on_lookup_done("r", [2], (7,), slots=[[64, 128]], source="s1")
    plan = planner.on_allocated("r", list(range(8)), planner.num_tokens_to_load("r", 8, 30))
    assert plan is not None
    record = Record(SimpleNamespace(request_id="r"), slot_bytes=64, sync_load=True)
    op = load_op(plan, record, (list(range(8)), list(range(10, 18))), planner.blocks_per_chunk)
    assert (op.req_id, op.server_id, op.slots, op.slot_bytes, op.sync) == ("r", "s1", [[64, 128]], 64, True)
    assert op.block_ids == [[2, 3, 4, 5], [12, 13, 14, 15]]
    assert (op.skip_blocks, op.num_tokens, len(op.keys[0])) == (0, 16, 2)
