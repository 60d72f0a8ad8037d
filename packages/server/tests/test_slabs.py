"""The slab allocator: slots never overlap, never pass capacity, and pages return when empty."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdepot.core import SLOT_HEADER_BYTES
from kvdepot.server import ChunkTooLargeError, ServerArgumentError, SlabAllocator, auto_page_size
from kvdepot.server._slabs import PageRecency

PAGE = 4096


def test_slots_fill_a_page_then_take_another():
    """A class carves whole pages into equal slots and takes a new page only when its pages are full."""
    alloc = SlabAllocator(4 * PAGE, PAGE)
    offsets = [alloc.allocate(1024) for _ in range(5)]
    assert offsets[:4] == [0, 1024, 2048, 3072]
    assert offsets[4] is not None
    assert offsets[4] // PAGE != 0
    assert alloc.free_pages == 2
    alloc.check()


def test_empty_page_returns_to_free_pages_and_serves_another_class():
    """Freeing a page's last slot makes the page available to a different size class."""
    alloc = SlabAllocator(PAGE, PAGE)
    first = alloc.allocate(2048)
    second = alloc.allocate(2048)
    assert alloc.allocate(1024) is None
    assert first is not None
    assert second is not None
    alloc.free(first)
    assert alloc.allocate(1024) is None  # the page still holds a 2048-byte slot
    alloc.free(second)
    assert alloc.free_pages == 1
    assert alloc.allocate(1024) == 0
    alloc.check()


def test_a_page_holds_at_most_max_slots_per_page():
    """Small chunks get slots of at least 1/4,096 of a page (and 1 KiB), so freeing a page never
    means evicting more than MAX_SLOTS_PER_PAGE chunks at once."""
    from kvdepot.server._slabs import MAX_SLOTS_PER_PAGE, MIN_SLOT_BYTES

    big = SlabAllocator(4 * (16 << 20), 16 << 20)
    assert big.slot_size(1) == (16 << 20) // MAX_SLOTS_PER_PAGE == 4096
    assert big.slot_size(64 << 10) == 64 * 1024 + SLOT_HEADER_BYTES  # real chunks are unaffected
    small = SlabAllocator(4 * (1 << 20), 1 << 20)
    assert small.slot_size(1) == MIN_SLOT_BYTES


def test_chunk_larger_than_page_is_refused_with_advice():
    """A chunk that cannot fit a page is refused and the message names --page-size."""
    alloc = SlabAllocator(4 * PAGE, PAGE)
    with pytest.raises(ChunkTooLargeError, match="--page-size"):
        alloc.slot_size(PAGE + 1)
    with pytest.raises(ServerArgumentError):
        alloc.slot_size(0)


def test_capacity_smaller_than_a_page_is_refused():
    """A pool that cannot hold one page is a configuration error, not a silent empty pool."""
    with pytest.raises(ServerArgumentError, match="capacity"):
        SlabAllocator(PAGE - 64, PAGE)


def test_auto_page_size_keeps_many_pages_and_a_bound():
    """The automatic page size is at most 256 MiB and leaves at least 16 pages in large pools."""
    assert auto_page_size(64 << 30) == 256 << 20
    assert (1 << 30) // auto_page_size(1 << 30) >= 16
    assert auto_page_size(4 << 20) == 1 << 20
    assert auto_page_size(100_000) <= 100_032


SIZES = [64, 192, 1000, 2048, PAGE - SLOT_HEADER_BYTES]  # the last fills a page with its header


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.booleans(), st.sampled_from(SIZES), st.integers(0, 1000)),
        max_size=200,
    )
)
def test_random_allocations_never_overlap_or_exceed_capacity(ops):
    """Any interleaving of allocations of mixed sizes and frees keeps slots disjoint and in range."""
    alloc = SlabAllocator(8 * PAGE + 100, PAGE)
    live: dict[int, int] = {}
    for is_alloc, size, pick in ops:
        if is_alloc or not live:
            slot = alloc.slot_size(size)
            offset = alloc.allocate(slot)
            if offset is not None:
                assert offset not in live
                live[offset] = slot
        else:
            offset = sorted(live)[pick % len(live)]
            del live[offset]
            alloc.free(offset)
        spans = sorted((o, o + s) for o, s in live.items())
        assert all(end <= alloc.capacity for _, end in spans)
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
    alloc.check()
    for offset in list(live):
        alloc.free(offset)
    assert alloc.free_pages == alloc.num_pages
    assert alloc.used_bytes == 0


recency_op = st.one_of(
    st.tuples(st.just("use"), st.integers(0, 5)),
    st.tuples(st.just("lower"), st.integers(0, 5)),
    st.tuples(st.just("empty"), st.integers(0, 5)),
    st.tuples(st.just("pin"), st.integers(0, 5)),
    st.tuples(st.just("oldest"), st.none()),
)


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(recency_op, max_size=120))
def test_page_recency_finds_the_unpinned_page_used_longest_ago(ops):
    """PageRecency.oldest always names the unpinned page whose newest stamp is the oldest, however
    stamps rise, fall and reset and pages are pinned, and the lazily kept heap stays bounded."""
    recency = PageRecency(6)
    stamps: list[list[int]] = [[] for _ in range(6)]  # every stamp still held by a chunk of the page
    pinned = [0] * 6
    clock = itertools.count(1)
    for name, page in ops:
        if name == "use":
            stamp = next(clock)
            stamps[page].append(stamp)
            recency.used(page, stamp)
        elif name == "lower" and stamps[page]:
            stamps[page].pop()  # the newest chunk left the page
            recency.reset(page, max(stamps[page], default=0))
        elif name == "empty":
            stamps[page] = []
            recency.reset(page, 0)
        elif name == "pin":
            pinned[page] ^= 1
        elif name == "oldest":
            candidates = [(max(s), p) for p, s in enumerate(stamps) if s and not pinned[p]]
            assert recency.oldest(pinned) == min(candidates, default=None)
        recency.check((p, s) for p, held in enumerate(stamps) for s in held)
        assert len(recency._heap) <= 2 * 6 + 64 + 1
