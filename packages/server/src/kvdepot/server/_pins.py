"""Fair shares of the room for handoff pins: which salt gives way when a pin does not fit.

Pure bookkeeping, like `Sessions`: it knows which salt holds which pin (a lease of the index's
`PIN_CLIENT`) and how many bytes; `ServerHolds` (`_holds.py`) ends and makes the leases.

Pins of all salts together hold at most `max_bytes` slot bytes and `max_pins` leases. While a
pin fits, it is granted, whoever asks: one tenant alone may use all the room. When it does not
fit, the room is shared equally by the salts holding pins and the salt asking (each gets
`max / n` of bytes and of leases):

- a salt that would pass its share with this pin is refused (`TooManyError`, reason "share"
  when other salts hold pins, "room" when it is alone);
- a salt within its share takes the room from the salts past theirs: their oldest pins end
  early, the salt furthest past its share first, each only while it is past its share.

So a client re-committing pinned chunks of one salt cannot keep another salt's handoffs
unpinned: what it holds past its share gives way to them at once.

Every salt's share is the same, so how far past it a salt is orders salts the same way for any
number of salts: by the larger of its fractions of the room's bytes and pins. A heap in that
order (entries made stale by later changes are skipped) finds the salts to give way without
walking every salt pinning: a peer inventing salts cannot make a commit's cost grow with them.
"""

from __future__ import annotations

import heapq
import itertools

import attrs

from kvdepot.server._errors import TooManyError


@attrs.define(eq=False)
class _Holding:
    bytes: int = 0
    pins: dict[int, int] = attrs.field(factory=dict)  # lease id -> slot bytes, oldest first
    stamp: int = 0  # of its latest entry in the heap; older ones are stale


@attrs.define
class _Short:
    """What the room lacks for a new pin: bytes and pins (met once neither is above 0)."""

    bytes: int
    pins: int

    def met(self) -> bool:
        return self.bytes <= 0 and self.pins <= 0

    def take(self, size: int) -> None:
        """A pin of `size` slot bytes will end."""
        self.bytes -= size
        self.pins -= 1


class PinShares:
    """The pins per salt, and the room each may take (module docstring)."""

    def __init__(self, max_bytes: int, max_pins: int) -> None:
        self.max_bytes = max_bytes
        self.max_pins = max_pins
        self.pinned_bytes = 0
        self.pins = 0
        self._salts: dict[str, _Holding] = {}
        self._salt_of: dict[int, str] = {}  # lease id -> salt
        self._heap: list[tuple[float, int, str]] = []  # (-fraction of the room, stamp, salt): the fullest first
        self._stamps = itertools.count(1)

    def bytes_of(self, salt: str) -> int:
        holding = self._salts.get(salt)
        return 0 if holding is None else holding.bytes

    def make_room(self, salt: str, size: int) -> list[int]:
        """The pins (lease ids) to end so that a pin of `size` slot bytes of `salt` fits, oldest
        first (none while it fits); `TooManyError` when `salt` may not pin. Changes no pin."""
        short = _Short(self.pinned_bytes + size - self.max_bytes, self.pins + 1 - self.max_pins)
        if short.met():
            return []
        own = self._salts.get(salt) or _Holding()
        n = len(self._salts) + (salt not in self._salts)  # the salts pinning and this one
        if self._past_share(own.bytes + size, len(own.pins) + 1, n):
            raise TooManyError(
                f"pins hold their room ({self.max_bytes} bytes, {self.max_pins} pins), and this salt would pass "
                f"its share of it (1/{n}); its chunks are committed unpinned",
                reason="share" if n > 1 and size <= self.max_bytes else "room",
            )
        ended = self._take_room(salt, n, short)
        if not short.met():  # not reached: the others hold past their shares what it needs
            raise TooManyError("pins hold their room", reason="room")
        return ended

    def _take_room(self, salt: str, n: int, short: _Short) -> list[int]:
        """The pins to end of the salts past their share (of `n`), the fullest salt first, until
        `short` is met or no salt but `salt` is past its share (the heap is left as it was)."""
        ended: list[int] = []
        taken: list[tuple[float, int, str]] = []
        try:
            while not short.met() and self._heap:
                item = heapq.heappop(self._heap)
                holding = self._salts.get(item[2])
                if holding is None or holding.stamp != item[1]:
                    continue  # stale
                taken.append(item)
                if item[2] == salt:
                    continue
                if not self._past_share(holding.bytes, len(holding.pins), n):
                    break  # the fullest first: no salt left past its share
                ended += self._oldest_past_share(holding, n, short)
        finally:
            for item in taken:
                heapq.heappush(self._heap, item)
        return ended

    def _oldest_past_share(self, holding: _Holding, n: int, short: _Short) -> list[int]:
        """A salt's oldest pins, each while the salt is still past its share and `short` is not met."""
        ended = []
        left_bytes, left_pins = holding.bytes, len(holding.pins)
        for lease_id, pin_bytes in holding.pins.items():  # oldest first
            if short.met() or not self._past_share(left_bytes, left_pins, n):
                break
            ended.append(lease_id)
            short.take(pin_bytes)
            left_bytes -= pin_bytes
            left_pins -= 1
        return ended

    def _past_share(self, size: int, pins: int, n: int) -> bool:
        """Whether `size` bytes in `pins` pins pass one of `n` equal shares of the room."""
        return size * n > self.max_bytes or pins * n > self.max_pins

    def add(self, salt: str, lease_id: int, size: int) -> None:
        """Count a pin of `size` slot bytes of `salt`, the lease `lease_id`."""
        holding = self._salts.get(salt)
        if holding is None:
            holding = self._salts[salt] = _Holding()
        holding.bytes += size
        holding.pins[lease_id] = size
        self._salt_of[lease_id] = salt
        self.pinned_bytes += size
        self.pins += 1
        self._push(salt, holding)

    def remove(self, lease_id: int) -> None:
        """Forget the pin `lease_id` (ended, expired or cleared)."""
        salt = self._salt_of.pop(lease_id)
        holding = self._salts[salt]
        size = holding.pins.pop(lease_id)
        holding.bytes -= size
        self.pinned_bytes -= size
        self.pins -= 1
        if holding.pins:
            self._push(salt, holding)
        else:
            del self._salts[salt]
            self._compact()

    def _push(self, salt: str, holding: _Holding) -> None:
        """Put the salt's new place in the heap (its older entries go stale)."""
        holding.stamp = next(self._stamps)
        fraction = max(holding.bytes / self.max_bytes if self.max_bytes else 1.0, len(holding.pins) / self.max_pins)
        heapq.heappush(self._heap, (-fraction, holding.stamp, salt))
        self._compact()

    def _compact(self) -> None:
        """Rebuild the heap from the salts once stale entries outnumber live ones, so that it
        stays in proportion to them (amortised: as many changes came before)."""
        if len(self._heap) > 2 * len(self._salts) + 64:
            live = [item for item in self._heap if (h := self._salts.get(item[2])) is not None and h.stamp == item[1]]
            heapq.heapify(live)
            self._heap = live

    def check(self, pins: dict[int, tuple[str, int]]) -> None:
        """Assert that the shares hold exactly `pins` (lease id -> (salt, slot bytes)) (for tests)."""
        assert {lid: (salt, self._salts[salt].pins[lid]) for lid, salt in self._salt_of.items()} == pins
        assert self.pins == len(pins) <= self.max_pins
        assert self.pinned_bytes == sum(size for _, size in pins.values()) <= self.max_bytes
        assert all(holding.pins and holding.bytes == sum(holding.pins.values()) for holding in self._salts.values())
        live = {item[2] for item in self._heap if (h := self._salts.get(item[2])) is not None and h.stamp == item[1]}
        assert live == set(self._salts), "a salt pinning is missing from the heap"
        assert len(self._heap) <= 2 * len(self._salts) + 64
