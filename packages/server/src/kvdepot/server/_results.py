"""What the chunk index answers: plain frozen values, free of any index internals."""

from __future__ import annotations

import heapq

import attrs

from kvdepot.server._pool_journal import Record


@attrs.frozen
class LookupOutcome:
    """One lookup item's answer: the committed prefix, its lease (0 = none) and its slots."""

    num_hits: int
    lease_id: int
    slots: list[tuple[int, int]]  # (offset, length) per hit, in key order


@attrs.frozen
class ReserveOutcome:
    """A reserve's answer; `slots` are (index in keys, offset, length) to write then commit."""

    reservation_id: int  # 0 when nothing was reserved
    slots: list[tuple[int, int, int]]
    present: list[int]
    full: bool


@attrs.frozen
class Reclaimed:
    """What closing a client's session (or expiry) gave back."""

    reservations: int = 0
    leases: int = 0
    chunks: int = 0


@attrs.frozen
class SaltUsage:
    bytes: int
    chunks: int


@attrs.frozen
class IndexStats:
    """Figures for `kvdepot stats` and the metrics; counters only grow."""

    capacity_bytes: int
    used_bytes: int
    page_size: int
    pages_total: int
    pages_free: int
    chunks: int
    pending_chunks: int  # reserved by clients, not yet committed (the quarantine's apart)
    leased_chunks: int
    hits: int
    misses: int
    bytes_stored: int
    bytes_loaded: int
    evictions: int
    leases: int
    reservations: int
    expired_leases: int
    expired_reservations: int
    clients: int
    full_reserves: int
    pins_refused: int
    salt_bytes: dict[str, int]  # bytes per salt holding any (a plain copy: cheap with many salts)
    salt_chunks: dict[str, int]  # committed chunks per salt
    quotas: dict[str, int]
    salt_count: int = 0  # salts holding any bytes, whether or not `salt_bytes` lists them all
    #: Slots of reservations that expired or whose client left, held until a late copy cannot land.
    quarantined_chunks: int = 0
    pins_refused_share: int = 0  # pins refused because their salt held its share of the pins' room
    pins_ended_early: int = 0  # pins of salts past their share ended for a salt within its share

    @property
    def per_salt(self) -> dict[str, SaltUsage]:
        """Bytes and chunks per salt holding any."""
        return {salt: SaltUsage(used, self.salt_chunks.get(salt, 0)) for salt, used in self.salt_bytes.items()}

    def largest_salts(self, count: int) -> list[str]:
        """The `count` salts holding the most bytes, most first."""
        return heapq.nlargest(count, self.salt_bytes, key=self.salt_bytes.__getitem__)


@attrs.define
class AdoptOutcome:
    """What `ChunkIndex.adopt` took back from a kept pool, and what it refused, by reason."""

    chunks: int = 0
    bytes: int = 0
    pending: int = 0
    refused: dict[str, int] = attrs.field(factory=dict)
    records: list[Record] = attrs.field(factory=list)  # of what was taken back, in order
