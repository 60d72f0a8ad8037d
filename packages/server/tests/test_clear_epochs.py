"""`ClearEpochs`: one clock for the clears of RAM (the index) and of the tiers below."""

from __future__ import annotations

from kvdepot.server._clear_epochs import ClearEpochs


def test_a_clear_voids_what_began_before_it_for_its_salt_only():
    clears = ClearEpochs()
    before = clears.now
    clears.mark("a")
    assert clears.since("a", before)
    assert not clears.since("b", before)
    assert not clears.since("a", clears.now)  # what begins after the clear stands


def test_a_clear_of_everything_voids_every_salt():
    clears = ClearEpochs()
    before = clears.now
    clears.mark(None)
    assert clears.since("a", before)
    assert clears.since("b", before)


def test_ram_and_the_tiers_share_the_clock_but_not_their_clears():
    clears = ClearEpochs()
    read = clears.now  # a read from below begins
    clears.mark("a")  # RAM alone is cleared: the bytes below are still there
    assert not clears.since("a", read, below=True)
    store = clears.now  # a store into RAM begins
    clears.mark("a", below=True)  # the tiers are cleared: RAM's store stands, the read does not
    assert not clears.since("a", store)
    assert clears.since("a", read, below=True)
    assert clears.now == 2
