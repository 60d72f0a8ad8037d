from kvdepot.core import LoadedRequest, recover_load_failures

B = 16


def test_unaffected_requests_are_left_alone():
    """A request none of whose computed blocks failed does not appear in the result."""
    r = recover_load_failures([LoadedRequest("a", 64, 16, [1, 2, 3, 4])], {9}, B)
    assert r.num_computed_tokens == {}
    assert r.num_recompute_tokens == 0
    assert not r.evict_block_ids


def test_reduced_by_scheduled_then_truncated_at_first_failed_block():
    """Computed tokens drop by the step's scheduled tokens, then to the start of the first failed block."""
    r = recover_load_failures([LoadedRequest("a", 80, 16, [1, 2, 3, 4, 5])], {3, 4}, B)
    assert r.num_computed_tokens == {"a": 32}
    assert r.num_recompute_tokens == 80 - 32
    assert r.evict_block_ids == {3, 4, 5}


def test_blocks_past_loaded_range_are_not_failures():
    """A failed id among blocks scheduled this step (not loaded) does not affect the request."""
    r = recover_load_failures([LoadedRequest("a", 48, 16, [1, 2, 3])], {3}, B)
    assert r.num_computed_tokens == {}


def test_shared_failed_block_recomputed_by_first_only():
    """Two requests sharing a failed block: the first truncates, the second keeps its prefix."""
    reqs = [LoadedRequest("a", 48, 16, [7, 8, 9]), LoadedRequest("b", 64, 16, [7, 8, 10, 11])]
    r = recover_load_failures(reqs, {8}, B)
    assert r.num_computed_tokens == {"a": 16, "b": 48}
    assert r.evict_block_ids == {8, 9}
    assert r.num_recompute_tokens == (48 - 16) + (64 - 48)


def test_second_request_truncates_at_its_own_unshared_failure():
    """A later request with its own failed block truncates there even if an earlier block was claimed."""
    reqs = [LoadedRequest("a", 32, 0, [7, 8]), LoadedRequest("b", 64, 0, [7, 8, 12, 13])]
    r = recover_load_failures(reqs, {8, 13}, B)
    assert r.num_computed_tokens == {"a": 16, "b": 48}
    assert r.evict_block_ids == {8, 13}


def test_partial_last_block_counts():
    """A partly computed last block is checked too."""
    r = recover_load_failures([LoadedRequest("a", 40, 0, [1, 2, 3])], {3}, B)
    assert r.num_computed_tokens == {"a": 32}
