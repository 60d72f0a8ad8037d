"""Which salts a figure lists when there are too many to list them all."""

from __future__ import annotations

import math
from typing import Protocol


class _Salts(Protocol):
    @property
    def salt_count(self) -> int: ...

    def largest_salts(self, count: int) -> list[str]: ...


class SaltRanking:
    """The salts holding the most bytes, worked out (O(salts)) at most every `every` seconds.

    Stats replies and the metrics snapshot list a bounded number of salts; ranking them all on
    every request would let a peer that asks in a loop, with many salts stored, hold the loop.
    Between rankings the same salts are listed, with their current figures.
    """

    def __init__(self, index: _Salts, every: float) -> None:
        self.index = index
        self.every = every
        self._ranked: list[str] = []
        self._until = -math.inf

    def listed(self, count: int, now: float) -> list[str] | None:
        """The salts to list: None (all of them) while there are at most `count`."""
        if self.index.salt_count <= count:
            return None
        if now >= self._until or len(self._ranked) != count:
            self._ranked = self.index.largest_salts(count)
            self._until = now + self.every
        return self._ranked
