"""The per-step budget of synchronous loads: which hits join the step that finds them."""

from __future__ import annotations

import pytest

from kvdepot.vllm_connector._sync_budget import INITIAL_RATE, MIN_SAMPLE_BYTES, SMOOTHING, SyncBudget

MIB = 1 << 20


def test_an_idle_engine_loads_up_to_the_cap_whatever_the_steps_took() -> None:
    budget = SyncBudget(cap=64 * MIB, share=0.05)
    budget.open(idle=True)
    assert budget.take(40 * MIB)
    assert budget.take(24 * MIB)
    assert not budget.take(1)  # the cap is per pass, first come first served


def test_a_busy_engine_loads_nothing_synchronously_before_it_timed_a_step() -> None:
    budget = SyncBudget(cap=64 * MIB, share=0.05)
    budget.open(idle=False)
    assert budget.left == 0
    assert not budget.take(1)


def test_a_busy_step_loads_at_most_its_share_of_the_step_at_the_copy_rate() -> None:
    budget = SyncBudget(cap=1 << 40, share=0.05, rate=4e9)
    budget.step_took(0.020)
    budget.open(idle=False)
    assert budget.left == int(0.05 * 0.020 * 4e9)  # 1 ms of copy: 4 MB
    assert not budget.take(budget.left + 1)  # too big: loads asynchronously, and takes nothing
    assert budget.take(3_000_000)
    assert not budget.take(1_000_001)
    assert budget.take(1_000_000)


def test_the_cap_bounds_a_busy_step_too() -> None:
    budget = SyncBudget(cap=MIB, share=1.0, rate=1e10)
    budget.step_took(1.0)
    assert budget.per_step(idle=False) == MIB


def test_a_cap_of_zero_turns_synchronous_loads_off() -> None:
    budget = SyncBudget(cap=0, share=0.05)
    budget.open(idle=True)
    assert not budget.take(0)
    assert not budget.take(1)


def test_each_pass_starts_from_a_full_budget() -> None:
    budget = SyncBudget(cap=8 * MIB, share=0.05)
    budget.open(idle=True)
    assert budget.take(8 * MIB)
    budget.open(idle=True)
    assert budget.take(8 * MIB)


@pytest.mark.parametrize(
    ("nbytes", "seconds", "moves"),
    [
        (64 * MIB, 0.01, True),
        (MIN_SAMPLE_BYTES - 1, 0.0001, False),  # too small to say anything about the rate
        (64 * MIB, 0.0, False),  # no time: no rate
    ],
)
def test_the_rate_follows_the_workers_copies(nbytes: int, seconds: float, moves: bool) -> None:
    budget = SyncBudget(cap=MIB, share=0.05)
    budget.copied(nbytes, seconds)
    expected = INITIAL_RATE + SMOOTHING * (nbytes / seconds - INITIAL_RATE) if moves else INITIAL_RATE
    assert budget.rate == pytest.approx(expected)


def test_the_step_time_is_a_moving_average_of_busy_steps() -> None:
    budget = SyncBudget(cap=MIB, share=0.05)
    budget.step_took(0.010)
    budget.step_took(0.0)  # a step that took no time is not a sample
    assert budget.step_s == pytest.approx(0.010)
    budget.step_took(0.030)
    assert budget.step_s == pytest.approx(0.010 + SMOOTHING * 0.020)


@pytest.mark.parametrize(
    ("a", "b", "kept"),
    [
        ((8 * MIB, 0.004), (8 * MIB, 0.002), (8 * MIB, 0.004)),  # the slower worker's figures stand
        ((0, 0.0), (4 * MIB, 0.001), (4 * MIB, 0.001)),  # a worker that copied nothing says nothing
        ((0, 0.0), (0, 0.0), (0, 0.0)),
    ],
)
def test_the_workers_copy_figures_aggregate_to_the_slowest(
    a: tuple[int, float], b: tuple[int, float], kept: tuple[int, float]
) -> None:
    from kvdepot.vllm_connector._meta import KVDepotWorkerMetadata

    for first, second in ((a, b), (b, a)):
        meta = KVDepotWorkerMetadata({"x"}, *first).aggregate(KVDepotWorkerMetadata({"y"}, *second))
        assert isinstance(meta, KVDepotWorkerMetadata)
        assert (meta.failed, meta.copied_bytes, meta.copied_s) == ({"x", "y"}, *kept)


def test_the_copy_meter_sums_until_taken() -> None:
    from kvdepot.vllm_connector._loads import CopyMeter

    meter = CopyMeter()
    meter.add(MIB, 0.001)
    meter.add(2 * MIB, 0.002)
    assert meter.take() == (3 * MIB, pytest.approx(0.003))
    assert meter.take() == (0, 0.0)
