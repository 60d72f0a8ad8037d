"""The engine's compute time per token, from its own steps: the bound on a request's wait for a hit."""

from __future__ import annotations

import pytest

from kvdepot.vllm_connector._prefill import MIN_STEP_TOKENS, PrefillRate


def test_no_estimate_before_a_step_of_enough_tokens():
    rate = PrefillRate()
    assert rate.seconds_for(1000) is None
    rate.step_started(MIN_STEP_TOKENS - 1, 0.0)  # decode-like: mostly fixed overhead
    rate.step_done(1.0)
    assert rate.seconds_for(1000) is None


def test_the_estimate_follows_the_steps():
    rate = PrefillRate()
    rate.step_started(1000, 10.0)
    rate.step_done(10.5)  # 0.5 ms per token
    assert rate.seconds_for(2000) == pytest.approx(1.0)
    for start in range(20):  # the engine got 5x faster
        rate.step_started(1000, 20.0 + start)
        rate.step_done(20.1 + start)
    assert rate.seconds_for(2000) == pytest.approx(0.2, rel=0.05)


def test_overlapping_steps_are_not_counted_twice():
    """With asynchronous scheduling the next step leaves before the last came back: its time
    starts when the last one ended."""
    rate = PrefillRate()
    rate.step_started(1000, 0.0)
    rate.step_started(1000, 0.05)  # in flight beside the first
    rate.step_done(0.1)
    rate.step_done(0.2)
    assert rate.seconds_for(1000) == pytest.approx(0.1)


def test_a_skipped_output_errs_towards_waiting_longer():
    """vLLM drops a step's empty output: the next sample spans two steps, never less than one."""
    rate = PrefillRate()
    for start in (0.0, 0.1, 0.2):  # the first two outputs never come
        rate.step_started(1000, start)
    rate.step_done(0.3)
    assert rate.seconds_for(1000) >= 0.1
    rate.step_done(0.4)
    assert rate.seconds_for(1000) >= 0.1


@pytest.mark.parametrize(
    ("tokens", "started", "done", "seconds"),
    [
        (1000, 0.0, 0.5, 0.5),  # a prefill step
        (4, 0.0, 0.02, 0.02),  # a decode step: no rate sample, but a step that computed
        (0, 0.0, 0.01, None),  # an idle step computed nothing
    ],
)
def test_a_step_that_came_back_says_how_long_it_took_when_it_computed(
    tokens: int, started: float, done: float, seconds: float | None
) -> None:
    rate = PrefillRate()
    rate.step_started(tokens, started)
    assert rate.step_done(done) == (pytest.approx(seconds) if seconds is not None else None)
    assert rate.step_done(done + 1) is None  # nothing was in flight
