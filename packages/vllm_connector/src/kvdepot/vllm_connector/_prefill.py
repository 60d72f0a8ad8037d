"""How long this engine takes to compute tokens: the bound on how long a request waits for a hit.

A lookup that the server answers from RAM comes back in about a millisecond; one it reads
through from the disk or remote tier can take tens or hundreds of milliseconds. A request
that waits for its lookup is not scheduled meanwhile, so waiting longer than the engine would
take to compute the chunks the read saves makes the hit worse than no hit. Each lookup
therefore carries the engine's estimate of its compute time per chunk
(`Lookup.prefill_s_per_chunk`), and the server stops waiting for the tiers after that much per
chunk of the run they hold (the chunks in by then still hit). The estimate comes from the
engine's own recent steps: the tokens each step scheduled and the time it took (from
`build_connector_meta` to `update_connector_output`). Steps of few tokens (decode) are left
out: their time is mostly fixed overhead and would make prefill look slow.

The estimate is an exponential moving average of seconds per token, so it follows a change
of load within a few steps. Until a step of enough tokens was seen there is no estimate, and
the server's own `--tier-deadline` alone bounds the wait. RAM hits never wait for it.
"""

from __future__ import annotations

from collections import deque

# Steps that scheduled fewer tokens than this say little about prefill speed.
MIN_STEP_TOKENS = 128
# Weight of the newest step in the average.
SMOOTHING = 0.25


class PrefillRate:
    """Seconds per token from the engine's recent steps (scheduler thread only)."""

    def __init__(self) -> None:
        # Steps sent to the workers and not back: (when, tokens). vLLM skips the output of a step
        # with nothing to report, so at most two are kept (one more may be in flight with
        # asynchronous scheduling); a step whose output was skipped makes the next sample span
        # two steps, which errs towards waiting longer, as without an estimate.
        self._started: deque[tuple[float, int]] = deque(maxlen=2)
        self._last_done = 0.0
        self._per_token: float | None = None

    def step_started(self, tokens: int, now: float) -> None:
        """A step of ``tokens`` scheduled tokens left for the workers."""
        self._started.append((now, tokens))

    def step_done(self, now: float) -> float | None:
        """The oldest step in flight came back; its seconds when it computed anything. With
        asynchronous scheduling the next step may have left before this one came back; its
        time then starts when this one ended."""
        if not self._started:
            return None
        started, tokens = self._started.popleft()
        seconds = now - max(started, self._last_done)
        self._last_done = now
        if tokens < MIN_STEP_TOKENS or seconds <= 0:
            return seconds if tokens and seconds > 0 else None
        sample = seconds / tokens
        self._per_token = (
            sample if self._per_token is None else self._per_token + SMOOTHING * (sample - self._per_token)
        )
        return seconds

    def seconds_for(self, tokens: int) -> float | None:
        """The estimated time to compute ``tokens`` tokens; None until a step of enough tokens was seen."""
        return None if self._per_token is None else self._per_token * tokens
