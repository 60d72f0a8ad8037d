"""The server's own holds on chunks: handoff pins, quarantined slots and the tiers' leases.

The index holds chunks; clients hold them through sessions (`_sessions.py`). The server holds
them too, through sessions of its own, under reserved client ids no peer may take:

- `PIN_CLIENT`: a commit with a pin (`Commit.pin_s`: a prefill engine's handoff, until the
  decode engine has looked it up) leases its chunks for a bounded time, within a room that
  salts share fairly (`_pins.py`);
- `QUARANTINE_CLIENT`: the slots of a reservation that expired or whose client left stay
  pending one more reservation TTL (`quarantine`), as do the slots a kept pool's last server
  was writing when it died (`quarantine_adopted`);
- `TIER_CLIENT`: the tiers' leases on chunks being copied below or on a lookup's RAM prefix
  (not counted as hits), and their reservations for chunks read back (owned by the client
  that asked).

`ServerHolds` sits beside `Sessions` and the `EvictionPolicy`: the index calls it when a commit
asks for a pin, a reservation ends without its client, or a clear removes pinned chunks; the
tiers call it for their leases. It moves chunks only through the index's `HeldChunks` methods.
Pure state, like the index that owns it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import Protocol

from kvdepot.server._errors import ServerError
from kvdepot.server._pins import PinShares
from kvdepot.server._records import Entry, Lease, Reservation, Session
from kvdepot.server._results import LookupOutcome, ReserveOutcome
from kvdepot.server._sessions import MAX_LEASES_PER_CLIENT, Sessions
from kvdepot.transport import RESERVED_CLIENT_PREFIX

#: The server's own session that holds, for one more reservation TTL, the slots of reservations
#: that expired or whose client left (`ServerHolds.quarantine`).
QUARANTINE_CLIENT = f"{RESERVED_CLIENT_PREFIX}quarantine"
#: The server's own session whose leases pin chunks committed with a pin (`Commit.pin_s`: a
#: prefill engine's handoff, until the decode engine has looked them up), each for a bounded time.
PIN_CLIENT = f"{RESERVED_CLIENT_PREFIX}pins"
#: The server's own session in the index: its leases pin chunks being copied out, its
#: reservations hold the slots that lower-tier reads fill.
TIER_CLIENT = f"{RESERVED_CLIENT_PREFIX}tiers"
#: The longest a commit may pin its chunks (seconds), whatever it asks.
MAX_PIN_S = 60.0
#: The share of the pool that pins may hold at once; past it a commit's chunks go unpinned.
#: When a pin does not fit, the salts pinning share this room equally (`_pins.py`).
MAX_PINNED_SHARE = 0.25
#: Pins (leases of `PIN_CLIENT`) at once, shared between salts the same way.
MAX_PIN_LEASES = MAX_LEASES_PER_CLIENT


class HeldChunks(Protocol):
    """What the holds need of the index (`ChunkIndex`)."""

    def touch(self, client: str, now: float, name: str = "") -> None: ...
    def register(self, client: str, chunk_bytes: int, now: float) -> int: ...
    def lease(self, session: Session, entries: list[Entry], now: float, ttl: float | None = None) -> Lease: ...
    def drop_lease(self, lease: Lease) -> None: ...
    def abort_reservation(self, reservation: Reservation) -> int: ...
    def lease_prefixes(
        self, client: str, items: Sequence[tuple[str, Sequence[bytes]]], now: float
    ) -> list[LookupOutcome]: ...
    def reserve_for(
        self, client: str, salt: str, keys: Sequence[bytes], chunk_bytes: int, now: float, *, owner: str
    ) -> ReserveOutcome: ...
    def commit(self, client: str, reservation_id: int, indices: Iterable[int] | None, now: float) -> int: ...
    def abort(self, client: str, reservation_id: int) -> int: ...
    def release(self, client: str, lease_ids: Iterable[int]) -> int: ...


class ServerHolds:
    """The server's pins, quarantine and tier leases in the index (module docstring)."""

    def __init__(self, chunks: HeldChunks, sessions: Sessions, capacity: int) -> None:
        self._chunks = chunks
        self._sessions = sessions
        self.pins = PinShares(int(MAX_PINNED_SHARE * capacity), MAX_PIN_LEASES)  # slot bytes per salt
        self.pins_refused = 0  # commits whose pin found no room (the chunks are committed unpinned)
        self.pins_refused_share = 0  # ... of those, because their salt held its share while others pinned
        self.pins_ended_early = 0  # pins of salts past their share ended to make room for another salt

    # -- pins -----------------------------------------------------------------------------

    def pin(self, entries: list[Entry], now: float, pin_s: float) -> None:
        """Lease `entries` (of one salt, just committed) to `PIN_CLIENT` for `pin_s` seconds (at
        most `MAX_PIN_S`). When the pins' room is full, a salt within its share of it ends the
        oldest pins of salts past theirs; a salt past its share, or no room for a lease, leaves
        the chunks unpinned (`pins_refused`)."""
        size = sum(entry.slot_size for entry in entries)
        sessions = self._sessions
        try:
            ended = self.pins.make_room(entries[0].salt, size)
            self._chunks.touch(PIN_CLIENT, now, "pins")
            session = sessions.active(PIN_CLIENT, now, need_layout=False)
            sessions.check_lease_room(session, 1 - len(ended))
        except ServerError as exc:
            self.pins_refused += 1
            self.pins_refused_share += exc.fields.get("reason") == "share"
            return
        for lease_id in ended:
            self._chunks.drop_lease(sessions.leases[lease_id])
        self.pins_ended_early += len(ended)
        lease = self._chunks.lease(session, entries, now, min(pin_s, MAX_PIN_S))
        lease.ended = self.pins.remove
        self.pins.add(entries[0].salt, lease.id, size)

    def unpin(self, salt: str | None) -> None:
        """End the pins of `salt`'s chunks (None: every pin): a clear removes pinned chunks too."""
        for lease in self._leases_of(PIN_CLIENT):
            if salt is None or lease.entries[0].salt == salt:
                self._chunks.drop_lease(lease)

    def _leases_of(self, client: str) -> list[Lease]:
        session = self._sessions.session_of(client)
        return [] if session is None else [self._sessions.leases[lease_id] for lease_id in session.leases]

    # -- quarantine -----------------------------------------------------------------------

    def quarantine(self, reservation: Reservation, now: float) -> int:
        """End a reservation its client did not end (expired, or the client left) without
        freeing its slots yet: the client's copy into them may still be under way (a stalled
        GPU stream, a paused process), and landing in a slot another client has since filled
        and committed it would pass every reader's check with the wrong bytes. The slots stay
        pending, held by the server's `QUARANTINE_CLIENT`, for one more reservation TTL; then
        they are freed. How many chunks it held."""
        if reservation.client == QUARANTINE_CLIENT:
            return self._chunks.abort_reservation(reservation)
        sessions = self._sessions
        try:
            holder = self._holder(now)
            moved = sessions.new_reservation(holder, reservation.salt, now, ttl=sessions.reservation_ttl)
        except ServerError:  # too many sessions or reservations: freed now, as before
            return self._chunks.abort_reservation(reservation)
        session = sessions.end_reservation(reservation)
        for index, entry in reservation.pending.items():
            sessions.pend(session, -entry.slot_size)
            sessions.pend(holder, entry.slot_size)
            moved.pending[index] = entry
        sessions.hold(holder, moved)
        return len(reservation.pending)

    def quarantine_adopted(self, entries: list[Entry], now: float) -> None:
        """Hold PENDING `entries` (slots a kept pool's last server was writing when it died) in
        the quarantine for one reservation TTL, one reservation per salt."""
        sessions = self._sessions
        held: dict[str, Reservation] = {}
        for entry in entries:
            holder = self._holder(now)
            if (reservation := held.get(entry.salt)) is None:
                ttl = sessions.reservation_ttl
                reservation = held[entry.salt] = sessions.new_reservation(holder, entry.salt, now, ttl=ttl)
                sessions.hold(holder, reservation)
            reservation.pending[len(reservation.pending)] = entry
            sessions.pend(holder, entry.slot_size)

    def _holder(self, now: float) -> Session:
        self._chunks.touch(QUARANTINE_CLIENT, now, "quarantine")
        return self._sessions.active(QUARANTINE_CLIENT, now, need_layout=False)

    def quarantined(self) -> tuple[int, int]:
        """(chunks, reservations) the quarantine holds: pending for the allocator, but no client
        is writing them."""
        session = self._sessions.session_of(QUARANTINE_CLIENT)
        if session is None:
            return 0, 0
        held = [self._sessions.reservations[r] for r in session.reservations]
        return sum(len(reservation.pending) for reservation in held), len(held)

    # -- the tiers' session ---------------------------------------------------------------

    def open_tiers(self, now: float) -> None:
        """Open the tiers' session (again, if a peer greeting under its id ended it)."""
        self._chunks.touch(TIER_CLIENT, now, "tiers")

    def tier_lease(self, items: Sequence[tuple[str, Sequence[bytes]]], now: float) -> list[LookupOutcome]:
        """Lease each item's RAM prefix for the tiers (not a hit or a miss: no client asked)."""
        self.open_tiers(now)
        return self._chunks.lease_prefixes(TIER_CLIENT, items, now)

    def tier_release(self, lease_ids: Iterable[int]) -> None:
        self._chunks.release(TIER_CLIENT, lease_ids)

    def tier_reserve(
        self, owner: str, salt: str, keys: Sequence[bytes], chunk_bytes: int, now: float
    ) -> ReserveOutcome:
        """Slots for chunks the tiers read back, counted to `owner` (the client that asked)."""
        self._chunks.register(TIER_CLIENT, chunk_bytes, now)  # also re-opens a session a peer ended
        return self._chunks.reserve_for(TIER_CLIENT, salt, keys, chunk_bytes, now, owner=owner)

    def tier_settle(self, reservation_id: int, done: Collection[int], now: float) -> None:
        """Commit the slots of a tier read that were filled (`done`), and free the others."""
        if done:
            self._chunks.commit(TIER_CLIENT, reservation_id, done, now)
        self._chunks.abort(TIER_CLIENT, reservation_id)  # the slots not filled (a no-op when none)

    def check(self) -> None:
        """Assert that the pins' shares hold exactly the pins' leases (for tests)."""
        leases = self._leases_of(PIN_CLIENT)
        self.pins.check(
            {lease.id: (lease.entries[0].salt, sum(e.slot_size for e in lease.entries)) for lease in leases}
        )
