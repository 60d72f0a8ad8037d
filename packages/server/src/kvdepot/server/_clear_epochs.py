"""The clears so far, on one clock that the index and the tiers share.

A store or a read that began before a clear of its salt must not put back what the clear
removed. Each takes the clock's `now` when it begins, and asks `since` when it would publish:

- the index (`ChunkIndex.clear`): a client's reservation made before a clear of RAM commits
  nothing (`since(salt, epoch)`);
- the tiers (`TierSet.clear`): a chunk read from below before a clear of the tiers is a miss
  (`since(salt, epoch, below=True)`). The tiers mark the clear twice, when it starts and when
  the last tier is done, since a read may race the tiers' deletes in between.

A clear of RAM alone leaves a read from below valid (the bytes below are still there), and a
clear of the tiers leaves a store into RAM valid: each side marks and asks its own, on the one
clock. Pure state, used on the server's loop thread only.
"""

from __future__ import annotations


class ClearEpochs:
    """The number of the last clear per salt (None: of everything), of RAM and of the tiers."""

    def __init__(self) -> None:
        self.now = 0  # clears marked so far: the epoch of whatever begins now
        self._ram: dict[str | None, int] = {}
        self._below: dict[str | None, int] = {}

    def mark(self, salt: str | None, *, below: bool = False) -> None:
        """Count a clear of `salt` (None: all), of the tiers with `below`, else of RAM."""
        self.now += 1
        (self._below if below else self._ram)[salt] = self.now

    def since(self, salt: str, epoch: int, *, below: bool = False) -> bool:
        """Whether `salt` (or everything) was cleared, there, after `epoch` (a `now` taken earlier)."""
        last = self._below if below else self._ram
        return max(last.get(salt, 0), last.get(None, 0)) > epoch
