"""The daemon's garbage collection: no full collection but the loop's own, and cycles still go."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from kvdepot.server._collector import Collector


class Node:
    def __init__(self) -> None:
        self.other: object = None


@pytest.fixture
def full_collections() -> Iterator[list[int]]:
    """Counts the full (oldest-generation) collections that start while the test runs."""
    seen: list[int] = []

    def note(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and info["generation"] == 2:
            seen.append(1)

    gc.callbacks.append(note)
    try:
        yield seen
    finally:
        gc.callbacks.remove(note)


def _long_lived_growth() -> list[list[int]]:
    """Enough new long-lived containers to make CPython start full collections by itself."""
    kept = []
    for _ in range(400_000):
        kept.append([0])
    return kept


def test_cpython_collects_fully_by_itself_without_the_collector(full_collections: list[int]) -> None:
    kept = _long_lived_growth()
    assert full_collections, "the growth is too small to show anything"
    del kept


def test_taken_over_only_the_loop_collects_fully_and_cycles_still_go(full_collections: list[int]) -> None:
    now = [100.0]
    collector = Collector(lambda: now[0], interval=60.0)
    collector.take_over()
    try:
        full_collections.clear()  # take_over's own collection
        a, b = Node(), Node()
        a.other, b.other = b, a
        gone = weakref.ref(a)
        kept = _long_lived_growth()  # moves the cycle into the oldest generation too
        del a, b
        assert full_collections == []
        collector.run(now[0] + 59.0)
        assert full_collections == []
        assert gone() is not None
        collector.run(now[0] + 60.0)
        assert full_collections == [1]
        assert collector.full_collections == 1
        assert gone() is None  # the cycle went in the loop's collection
        del kept
    finally:
        collector.give_back()
    assert gc.get_threshold()[2] < 1 << 30
    assert gc.get_freeze_count() == 0


def test_young_cycles_go_without_any_full_collection(full_collections: list[int]) -> None:
    collector = Collector(lambda: 0.0)
    collector.take_over()
    try:
        full_collections.clear()
        a = Node()
        a.other = a
        gone = weakref.ref(a)
        del a
        kept = [[] for _ in range(10_000)]  # allocations enough for CPython's young collections
        assert gone() is None
        assert full_collections == []
        del kept
    finally:
        collector.give_back()
