"""The sync loads' books (`_sync_loads.py`): each pass's budget, and when their steps end."""

from __future__ import annotations

from kvdepot.vllm_connector._sync_loads import SyncLoads

SHARE = 0.25


def test_a_pass_loads_hits_before_its_forward_pass_up_to_its_budget() -> None:
    """Whole chunks count (a hit from mid-chunk takes its chunk); the budget is whole again each pass."""
    sync = SyncLoads(3 * 64, SHARE)
    assert sync.joins(0, 16, chunk_size=8, slot_bytes=64)  # chunks 0-1
    assert not sync.joins(4, 8, chunk_size=8, slot_bytes=64)  # chunks 0-1 again: one chunk's bytes are left
    assert sync.joins(8, 8, chunk_size=8, slot_bytes=64)  # chunk 1
    assert not sync.joins(0, 1, chunk_size=8, slot_bytes=64)
    sync.pass_started(1.0, idle=True)
    assert sync.joins(0, 24, chunk_size=8, slot_bytes=64)


def test_while_others_run_a_pass_loads_only_its_share_of_the_step() -> None:
    """A pass after a step that computed gets the share of that step's time at the copy rate."""
    sync = SyncLoads(1 << 30, SHARE)
    sync.budget.step_took(0.010)
    sync.budget.copied(100 << 20, 0.1)  # the workers copied at about 1 GB/s
    sync.pass_started(1.0, idle=False)
    allowed = sync.budget.left
    assert 0 < allowed < 1 << 30
    assert not sync.joins(0, allowed // 64 + 8, chunk_size=8, slot_bytes=8 * 64)
    assert sync.joins(0, 8, chunk_size=8, slot_bytes=allowed)
    sync.pass_started(2.0, idle=True)
    assert sync.joins(0, 8, chunk_size=8, slot_bytes=1 << 30)  # an idle engine: up to the cap


def test_no_budget_no_sync_load() -> None:
    assert not SyncLoads(0, SHARE).joins(0, 8, chunk_size=8, slot_bytes=0)


def test_a_steps_sync_loads_settle_when_the_step_after_the_next_is_scheduled() -> None:
    """With one step in flight, a step has ended by the time the one after the next is scheduled:
    its sync loads come back then, and its blocks are free to share; a step that stored says when."""
    sync = SyncLoads(1 << 20, SHARE)
    assert sync.pass_started(1.0, idle=True) == []
    sync.loading("a", ["h0", "h1"], [5, 6])
    sync.pass_planned(stored=True)
    assert sync.guard.reaches("b", ["h0", "h1"], 2)  # another request's hit would take a.'s blocks
    assert sync.pass_started(2.0, idle=True) == []
    sync.pass_planned(stored=False)
    assert sync.pass_started(3.0, idle=True) == ["a"]
    assert sync.stores_ended_at == 3.0
    assert not sync.guard.reaches("b", ["h0", "h1"], 2)
    sync.pass_planned(stored=False)
    assert sync.pass_started(4.0, idle=True) == []  # the second step stored nothing, loaded nothing
    assert sync.stores_ended_at == 3.0


class Manager:
    def __init__(self, fail: bool = False) -> None:
        self.evicted: list[set[int]] = []
        self.fail = fail

    def evict_blocks(self, blocks: set[int]) -> None:
        if self.fail:
            raise AttributeError("an older vLLM")
        self.evicted.append(blocks)


def test_a_failed_sync_loads_blocks_leave_vllms_prefix_cache() -> None:
    """Its blocks are evicted through vLLM's KV-cache manager; a vLLM without that keeps them, quietly."""
    sync = SyncLoads(1 << 20, SHARE)
    sync.loading("a", ["h0"], [5])
    manager = Manager()
    sync.evict_failed("a", manager)
    sync.evict_failed("unknown", manager)
    assert manager.evicted == [{5}]
    sync.evict_failed("a", Manager(fail=True))
