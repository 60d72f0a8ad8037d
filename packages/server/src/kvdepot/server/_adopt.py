"""Adopting a kept pool: which of its journal's records a restarted server takes back.

Only the newest record of each slot counts. A committed chunk is taken back when its slot's
header, read now, still says what the record says (the magic, an even generation equal to
the record's, the length, and the digest of the record's salt and key), and its bytes still
have the record's checksum. Anything else is dropped and never served: a slot freed or
reused after the record (its generation moved on), a torn or tampered header or chunk, a
chunk that would pass its salt's quota, two records claiming one slot.

A slot whose newest record is a reservation still pending in its header (the server died
while a client wrote it) is taken back pending, in the quarantine, for one reservation TTL:
the dead server's client may still be copying into it, so no new chunk goes there before
that copy must have ended (`ServerHolds.quarantine`'s rule, across the restart).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Protocol

import attrs

from kvdepot.core import SLOT_HEADER_BYTES, slot_digest, unpack_slot_header
from kvdepot.server._pool_journal import COMMITTED, RESERVED, Record
from kvdepot.server._results import AdoptOutcome
from kvdepot.server._tier_format import payload_checksum


class Adopter(Protocol):
    """What adoption needs of the index (`ChunkIndex.adopt`)."""

    def adopt(self, committed: Sequence[Record], pending: Sequence[Record], now: float) -> AdoptOutcome: ...


@attrs.frozen
class Adoption:
    """What a restarted server took back from its kept pool."""

    chunks: int = 0
    bytes: int = 0
    pending: int = 0  # slots taken back pending (quarantined)
    dropped: dict[str, int] = attrs.field(factory=dict)  # records not taken back, by reason
    seconds: float = 0.0
    fresh: str = ""  # why nothing was adopted ("" when the journal was read)

    @property
    def dropped_total(self) -> int:
        return sum(self.dropped.values())


def adopt(index: Adopter, buffer: memoryview, records: Iterable[Record], now: float) -> tuple[Adoption, list[Record]]:
    """Verify `records` (a journal's, oldest first) against the pool `buffer` and give the good
    ones to `index`, oldest first (so the use order is the one the dead server had). Returns
    what was taken back, and the records of what the index now holds (the new journal's)."""
    started = time.perf_counter()
    newest: dict[int, Record] = {}
    for record in records:
        newest.pop(record.slot, None)  # a record moves to the end: its slot's use is the newest
        newest[record.slot] = record
    dropped: dict[str, int] = {}
    committed: list[Record] = []
    pending: list[Record] = []
    for record in newest.values():
        why = _check(buffer, record)
        if why:
            dropped[why] = dropped.get(why, 0) + 1
        else:
            (committed if record.kind == COMMITTED else pending).append(record)
    outcome = index.adopt(committed, pending, now)
    for why, count in outcome.refused.items():
        dropped[why] = dropped.get(why, 0) + count
    seconds = time.perf_counter() - started
    return Adoption(outcome.chunks, outcome.bytes, outcome.pending, dropped, seconds), outcome.records


def _check(buffer: memoryview, record: Record) -> str:
    """Why `record` is not taken back ("" when it is)."""
    slot, length = record.slot, record.length
    if slot < 0 or slot % 64 or slot + SLOT_HEADER_BYTES + length > len(buffer) or length <= 0:
        return "outside"
    if (fields := unpack_slot_header(buffer[slot : slot + SLOT_HEADER_BYTES])) is None:
        return "header"
    generation, got_length, digest = fields
    if generation != record.generation:
        return "moved_on"  # freed, reused or pending again after the record
    if got_length != length or digest != slot_digest(record.salt, record.key):
        return "header"
    if record.kind == RESERVED:  # still pending (odd): what the reservation was for
        return "" if generation % 2 else "moved_on"
    data = buffer[slot + SLOT_HEADER_BYTES : slot + SLOT_HEADER_BYTES + length]
    if payload_checksum(data) != record.checksum:
        return "checksum"
    return ""
