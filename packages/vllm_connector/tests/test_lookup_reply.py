"""Reading a lookup reply: results in, what they mean out; no client, no clock, no vLLM."""

from __future__ import annotations

import pytest

from kvdepot.core import KeyChain, Namespace, RequestTracker
from kvdepot.transport import LookupResult, Slot
from kvdepot.vllm_connector._lookup_reply import (
    MISS,
    LookupReading,
    LookupStatus,
    hit_sources,
    lookup_status,
    outdated,
    read_reply,
)


def result(hits: int, lease: int, length: int = 64, read_back: dict[str, int] | None = None) -> LookupResult:
    return LookupResult(hits, lease, [Slot(i * length, length) for i in range(hits)], read_back or {})


@pytest.mark.parametrize(
    ("done", "waited", "expected"),
    [
        (True, 0.0, LookupStatus.ANSWERED),
        (True, 99.0, LookupStatus.ANSWERED),  # a late reply that is in is still read
        (False, 0.5, LookupStatus.WAITING),
        (False, 1.0, LookupStatus.TIMED_OUT),
        (False, 5.0, LookupStatus.TIMED_OUT),
    ],
)
def test_a_lookup_is_answered_waited_for_or_late(done: bool, waited: float, expected: LookupStatus) -> None:
    """A reply that is in is read; one that is not is waited for up to the timeout (1 s here), then a miss."""
    assert lookup_status(done, waited, 1.0) is expected


def test_a_requests_results_are_read_from_its_first_item_one_per_rank() -> None:
    """The reply carries every request of the message: a request reads its ranks' results alone."""
    results = [result(5, 1), result(2, 8), result(1, 9), result(3, 4)]
    reading = read_reply(results, 1, world=2, same_server=True, lookup_first=3)
    assert reading == LookupReading(hits=(2, 1), leases=(8, 9), slots=((0, 64), (0,)), slot_bytes=64, read_back=(5, {}))
    assert reading.hit_chunks == 1  # a chunk is a hit only if every rank has it


def test_the_read_back_part_of_the_hit_ends_where_the_first_ranks_hit_ends() -> None:
    """The chunk a hit ends at counts from the lookup's first chunk; the tiers' counts are the first rank's."""
    reading = read_reply([result(4, 2, read_back={"disk": 1})], 0, world=1, same_server=True, lookup_first=2)
    assert reading.read_back == (6, {"disk": 1})


@pytest.mark.parametrize(
    ("results", "first", "same_server"),
    [
        ([result(2, 7), result(2, 8)], 0, False),  # another instance answered: its slots are in another pool
        ([], 0, True),  # the lookup failed: no results
        ([result(2, 7), result(2, 8)], 1, True),  # one result where the request has two ranks
    ],
)
def test_a_reply_that_cannot_be_the_requests_hit_is_a_miss(
    results: list[LookupResult], first: int, same_server: bool
) -> None:
    """The wrong number of results, or another server, bring no hit and no lease to hold."""
    assert read_reply(results, first, world=2, same_server=same_server, lookup_first=0) == MISS
    assert MISS.hit_chunks == 0


def test_slots_of_mixed_lengths_are_a_miss_whose_leases_still_go_back() -> None:
    """Slots of two lengths cannot all be this layout's chunks: no hit, but the leases are held (to release)."""
    reading = read_reply([result(1, 7, 64), result(1, 8, 32)], 0, world=2, same_server=True, lookup_first=0)
    assert reading == LookupReading(leases=(7, 8))
    assert reading.hit_chunks == 0


def test_a_miss_with_no_slots_has_no_length() -> None:
    """No hit on any rank: hits of 0, the leases as the server gave them (0: none), no slot length."""
    reading = read_reply([result(0, 0), result(0, 0)], 0, world=2, same_server=True, lookup_first=1)
    assert reading == LookupReading(hits=(0, 0), leases=(0, 0), slots=((), ()), slot_bytes=0, read_back=(1, {}))


@pytest.mark.parametrize(
    ("start", "num", "read_back", "expected"),
    [
        (0, 0, (4, {"disk": 2}), {}),
        (0, 30, (4, {}), {"host": 30}),
        # chunks 0-1 in RAM, 2 from disk, 3 from the remote tier (the disk's come first)
        (0, 31, (4, {"remote": 1, "disk": 1}), {"disk": 8, "remote": 7, "host": 16}),
        # a load from token 20 on: the rest of chunk 2 from disk, chunk 3 from remote
        (20, 11, (4, {"remote": 1, "disk": 1}), {"disk": 4, "remote": 7}),
    ],
)
def test_a_loads_tokens_are_split_by_where_the_server_had_them(
    start: int, num: int, read_back: tuple[int, dict[str, int]], expected: dict[str, int]
) -> None:
    """Read-back chunks end the hit, the disk's first; the counts sum to the tokens loaded."""
    assert hit_sources(start, num, read_back, 8) == expected
    assert sum(expected.values()) == num


def tracker(lookup_first: int, hit_chunks: int, hit_at: float) -> RequestTracker:
    return RequestTracker(
        "r", "", KeyChain([Namespace(model="m")], 8), lookup_first=lookup_first, hit_chunks=hit_chunks, hit_at=hit_at
    )


@pytest.mark.parametrize(
    ("computed", "hit_chunks", "stores_ended_at", "now", "expected"),
    [
        (8, 4, 0.0, 1.0, False),  # fresh, follows on from vLLM's hit, reaches the last full chunk
        (0, 4, 0.0, 1.0, True),  # vLLM's own hit shrank below the chunk the lookup started at
        (8, 3, 0.0, 1.0, False),  # stops short, but no store ended since it went out
        (8, 3, 0.75, 1.0, True),  # stops short, and a store ended since: the rest may be there now
        (8, 4, 0.75, 1.0, False),  # a store ended since, but the hit reaches the last full chunk
        (8, 4, 0.0, 20.6, True),  # its leases are close to expiring
    ],
)
def test_a_reply_read_while_its_request_waited_is_asked_again_when_it_may_be_stale(
    computed: int, hit_chunks: int, stores_ended_at: float, now: float, expected: bool
) -> None:
    """A 33-token prompt (full chunks 0 to 3), looked up from chunk 1 at 0.5 s; hits count chunks from 0."""
    old = tracker(lookup_first=1, hit_chunks=hit_chunks, hit_at=0.5)
    got = outdated(
        old,
        num_tokens=33,
        num_computed_tokens=computed,
        chunk_size=8,
        stores_ended_at=stores_ended_at,
        now=now,
        refresh_s=20.0,
    )
    assert got is expected
