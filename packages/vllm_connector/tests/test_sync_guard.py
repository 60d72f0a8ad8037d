"""The sync-load guard's books (`_sync_guard.py`): which prefix hits must wait, and for how long."""

from __future__ import annotations

from kvdepot.vllm_connector._sync_guard import SyncGuard

A = [f"a{i}".encode() for i in range(6)]  # block hashes of a loading request's prompt


def test_a_hit_reaching_a_loading_block_waits_and_one_short_of_it_does_not():
    guard = SyncGuard()
    guard.loading("a", A[2:], block_ids=[12, 13, 14, 15])  # blocks 0-1 were vLLM's own hit
    assert guard.reaches("b", A, num_hit_blocks=3)
    assert guard.reaches("b", A, num_hit_blocks=6)
    assert not guard.reaches("b", A, num_hit_blocks=2)  # its hit ends before the loaded blocks
    assert not guard.reaches("b", [b"other"] * 6, num_hit_blocks=6)


def test_the_loading_request_itself_is_never_held():
    guard = SyncGuard()
    guard.loading("a", A[2:], block_ids=[12, 13, 14, 15])
    assert not guard.reaches("a", A, num_hit_blocks=6)  # preempted and asked again: its own blocks


def test_a_settled_load_frees_its_blocks_and_a_failed_one_names_them_first():
    guard = SyncGuard()
    guard.loading("a", A[2:], block_ids=[12, 13, 14, 15])
    guard.loading("c", [b"c0"], block_ids=[20])
    assert guard.failed("a") == [12, 13, 14, 15]
    guard.settle("a")
    assert not guard.reaches("b", A, num_hit_blocks=6)
    assert guard.failed("a") == []
    assert guard.reaches("b", [b"c0"], num_hit_blocks=1)  # c's step has not ended
    guard.settle("c")
    assert len(guard) == 0


def test_a_block_loaded_again_by_a_later_request_stays_held_until_that_one_settles():
    guard = SyncGuard()
    guard.loading("a", A[2:4], block_ids=[12, 13])
    guard.loading("d", A[2:4], block_ids=[30, 31])  # a's blocks were freed, d loads the same prefix
    guard.settle("a")
    assert guard.reaches("b", A, num_hit_blocks=4)
    guard.settle("d")
    assert not guard.reaches("b", A, num_hit_blocks=4)
