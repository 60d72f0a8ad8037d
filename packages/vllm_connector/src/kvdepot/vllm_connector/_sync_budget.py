"""Which hits join the step that finds them: the per-step budget of synchronous loads.

A hit loaded asynchronously is copied after the forward pass of the step that finds it, and
its request computes one step later: it waits out a whole step of other requests' compute. A
hit loaded synchronously is copied before the forward pass of the step that schedules it, and
its request computes in that step; but every request in that step waits for the copy. The
rule that picks between them (docs/vllm.md, "Which hits join the step that finds them"):

- Only a hit wholly in the server's RAM qualifies, in a model with one full-attention KV-cache
  group (the scheduler checks both). A read from a tier below may be slow, and a failed load
  is then reported block by block.
- While the engine is idle, the step carries nobody else: a hit loads synchronously up to
  `cap` bytes (`kvdepot.sync_load_bytes`), since its copy delays only itself and saves it a
  step.
- While other requests run, a step's synchronous copies may take at most `share` of the
  step's time (`kvdepot.sync_load_share`): at most ``share * step seconds * copy rate`` bytes,
  never more than `cap`. The step's time is what the engine's recent steps took; the copy rate
  is what the workers' recent copies of hits achieved (`copied`), and a conservative
  `INITIAL_RATE` until they have copied something.
- Hits that do not fit, first come first served within a step, load asynchronously.

Pure bookkeeping: the scheduler passes the times and sizes in, on its own thread.
"""

from __future__ import annotations

# Weight of the newest sample in the moving averages.
SMOOTHING = 0.25
#: Bytes per second assumed before any copy was measured: below a cold first copy of a hit
#: on this project's 2-core machine (2.7 GB/s), so a first guess never overruns the share.
INITIAL_RATE = 1e9
# Copies smaller than this say little about the rate: their time is mostly fixed overhead.
MIN_SAMPLE_BYTES = 1 << 20


class SyncBudget:
    """How many bytes of hits the next scheduling pass may load before its forward pass."""

    def __init__(self, cap: int, share: float, *, rate: float = INITIAL_RATE) -> None:
        self.cap = cap
        self.share = share
        self.rate = rate  # bytes per second, moving average of the workers' copies
        self.step_s: float | None = None  # seconds per busy step, moving average
        self.left = 0  # bytes the pass being scheduled may still load synchronously

    def step_took(self, seconds: float) -> None:
        """A step that computed something took ``seconds`` (scheduled to output back)."""
        if seconds > 0:
            self.step_s = seconds if self.step_s is None else self.step_s + SMOOTHING * (seconds - self.step_s)

    def copied(self, nbytes: int, seconds: float) -> None:
        """A worker copied ``nbytes`` of hits in ``seconds``."""
        if nbytes >= MIN_SAMPLE_BYTES and seconds > 0:
            self.rate += SMOOTHING * (nbytes / seconds - self.rate)

    def per_step(self, *, idle: bool) -> int:
        """The bytes a pass may load synchronously: `cap` on an idle engine, else the share."""
        if idle:
            return self.cap
        if self.step_s is None:
            return 0  # no busy step seen yet: nothing to bound the copy by
        return int(min(self.cap, self.share * self.step_s * self.rate))

    def open(self, *, idle: bool) -> None:
        """A new scheduling pass begins; ``idle``: the engine computes nothing else in it."""
        self.left = self.per_step(idle=idle)

    def take(self, nbytes: int) -> bool:
        """Whether a hit of ``nbytes`` loads synchronously in this pass (then counted)."""
        if not self.cap or nbytes > self.left:
            return False
        self.left -= nbytes
        return True
