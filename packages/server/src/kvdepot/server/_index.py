"""The chunk index: two-phase stores, leased lookups, clears and quotas over the pool's slots.

Pure state: no clock, no sockets, no logging. Every method that depends on time takes
`now: float` (seconds, any monotonic origin), so the server loop feeds it a clock and the
tests feed it numbers.

The index is the manager; its collaborators hold the rest, as vLLM splits its offloading
manager from its policies:

- `ChunkTable` (`_chunks.py`): the chunks, by name and by slot, their states (moved only by
  the table in `_chunk_state.py`) and the figures per salt; it places slots and evicts;
- `EvictionPolicy` (`_eviction.py`, the table's): which chunks give way to a new one;
- `Sessions` (`_sessions.py`): client sessions, reservations, leases and their deadlines;
- `ServerHolds` (`_holds.py`): what the server itself holds: handoff pins, quarantined slots,
  the tiers' leases and reservations;
- `ClearEpochs` (`_clear_epochs.py`): the clears so far, shared with the tiers.

The index never calls out. What others must know (a chunk committed, evicted or cleared) it
queues as events (`_events.py`), which the server's loop takes with `take_events()`.

Rules that hold after every method returns (`check()` asserts them):

- a slot holds at most one entry, inside the pool, of the entry's size class;
- PENDING and LEASED chunks are never evicted, cleared or overwritten;
- the LRU lists hold exactly the COMMITTED chunks;
- a salt's usage never exceeds its quota because of a reserve, and a salt only ever sees its
  own chunks (the index is keyed by (salt, key)).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvdepot.core import SLOT_HEADER_BYTES
from kvdepot.server._chunk_state import ChunkEvent, ChunkState
from kvdepot.server._chunks import ChunkTable
from kvdepot.server._clear_epochs import ClearEpochs
from kvdepot.server._errors import ServerArgumentError, UnknownReservationError
from kvdepot.server._events import Cleared, Committed, IndexEvent
from kvdepot.server._holds import QUARANTINE_CLIENT, ServerHolds
from kvdepot.server._pool import SlotHeaders
from kvdepot.server._pool_journal import Record
from kvdepot.server._records import Entry, Lease, Reservation, Session
from kvdepot.server._results import AdoptOutcome, IndexStats, LookupOutcome, Reclaimed, ReserveOutcome
from kvdepot.server._sessions import DEFAULT_LEASE_TTL, DEFAULT_RESERVATION_TTL, DEFAULT_SESSION_TTL, Sessions
from kvdepot.server._slabs import SlabAllocator
from kvdepot.transport import RESERVED_CLIENT_PREFIX

# Share of the pool one client may hold in uncommitted reservations (a store in progress is a
# few engine steps of chunks): one that never commits cannot fill the pool with pending slots.
DEFAULT_MAX_CLIENT_PENDING_FRACTION = 0.5
# ... and all clients together, so that several client ids cannot pin the whole pool either;
# past that, a client still gets a small share of its own, so one that was idle can store.
MAX_PENDING_FRACTION = 0.75
CLIENT_PENDING_FLOOR_FRACTION = 1 / 16
# ... but never past this share of the pool in all, however many client ids use their floor:
# eight of them otherwise pinned every slot with reservations they never committed.
MAX_PENDING_WITH_FLOORS_FRACTION = 7 / 8
# Chunks one Clear request removes; a larger clear takes several (the client's `clear` loops).
CLEAR_SLICE = 8192
# Keys in one lookup, summed over its items (the wire format bounds each item, not their sum).
MAX_KEYS_PER_REQUEST = 1 << 16
#: Who owns the chunks a restarted server took back from its kept pool (`adopt`).
ADOPTED_CLIENT = f"{RESERVED_CLIENT_PREFIX}adopted"

S = ChunkState
# Module globals: cheaper than an Enum class's attributes on the hot paths.
_COMMITTED = S.COMMITTED
_COMMIT = ChunkEvent.COMMIT


class ChunkIndex:
    """Maps (salt, key) to pool slots with two-phase stores, leases, LRU eviction and quotas."""

    def __init__(
        self,
        allocator: SlabAllocator,
        *,
        lease_ttl: float = DEFAULT_LEASE_TTL,
        reservation_ttl: float = DEFAULT_RESERVATION_TTL,
        session_ttl: float = DEFAULT_SESSION_TTL,
        max_client_pending_bytes: int | None = None,
        headers: SlotHeaders | None = None,
        default_quota: int | None = None,
        events: bool = False,
    ) -> None:
        """``events``: queue what happens for `take_events()` (the server does; a caller that
        never takes them leaves it off, so they cannot pile up)."""
        self.allocator = allocator
        capacity = allocator.capacity
        if max_client_pending_bytes is None:
            max_client_pending_bytes = int(capacity * DEFAULT_MAX_CLIENT_PENDING_FRACTION)
        self.sessions = Sessions(
            lease_ttl=lease_ttl,
            reservation_ttl=reservation_ttl,
            session_ttl=session_ttl,
            max_client_pending_bytes=max_client_pending_bytes,
            max_pending_bytes=max(int(capacity * MAX_PENDING_FRACTION), max_client_pending_bytes),
            client_pending_floor=int(capacity * CLIENT_PENDING_FLOOR_FRACTION),
            max_pending_with_floors=int(capacity * MAX_PENDING_WITH_FLOORS_FRACTION),
        )
        self.chunks = ChunkTable(
            allocator, headers or SlotHeaders(), self.sessions, default_quota=default_quota, events=events
        )
        self.policy = self.chunks.policy
        self.holds = ServerHolds(self, self.sessions, capacity)
        self.clears = ClearEpochs()  # a reservation made before a clear of its salt commits nothing
        self.hits = self.misses = self.bytes_stored = self.bytes_loaded = 0
        self.expired_leases = self.expired_reservations = self.full_reserves = 0

    # -- sessions -------------------------------------------------------------------------

    def touch(self, client: str, now: float, name: str = "") -> None:
        """Note that `client` is alive (any request or heartbeat); opens its session if new."""
        if self.sessions.touch(client, now, name):
            self.policy.session_changed(client, opened=True)

    def register(self, client: str, chunk_bytes: int, now: float) -> int:
        """Record the client's chunk size in bytes; returns its slot size. Opens the session."""
        slot_size = self.allocator.slot_size(chunk_bytes)
        self.touch(client, now)
        self.sessions.register(client, chunk_bytes)
        return slot_size

    def is_registered(self, client: str) -> bool:
        return self.sessions.is_registered(client)

    def close_session(self, client: str, now: float) -> Reclaimed:
        """Give back everything `client` holds and forget it; a no-op for unknown clients. Its
        reservations' slots are quarantined (`ServerHolds.quarantine`) for one more reservation TTL."""
        held = self.sessions.close(client)
        if held is None:
            return Reclaimed()
        self.policy.session_changed(client, opened=False)
        reservations, leases = held
        chunks = sum(self.holds.quarantine(reservation, now) for reservation in reservations)
        for lease in leases:
            self.drop_lease(lease)
        return Reclaimed(len(reservations), len(leases), chunks)

    def clients(self) -> list[str]:
        return self.sessions.clients()

    # -- store ----------------------------------------------------------------------------

    def reserve(self, client: str, salt: str, keys: Sequence[bytes], chunk_bytes: int, now: float) -> ReserveOutcome:
        """Give slots to keys neither committed nor pending, in order, until the pool is full.

        Keys already present are listed in `present` (and count as used). Placement stops at
        the first key that cannot be placed without evicting leased or pending chunks,
        breaking the salt's quota, or passing the client's bound on pending bytes; `full`
        then says so. Never blocks. The chunks count toward the client's share of the pool.
        """
        return self.reserve_for(client, salt, keys, chunk_bytes, now, owner=client)

    def reserve_for(
        self, client: str, salt: str, keys: Sequence[bytes], chunk_bytes: int, now: float, *, owner: str
    ) -> ReserveOutcome:
        """`reserve` for `client`, with the chunks counted toward `owner`'s share of the pool
        (the tiers reserve the chunks they read back for the client that asked)."""
        session = self.sessions.active(client, now)
        if chunk_bytes != session.chunk_bytes:  # each new slot size would cost the allocator a class for good
            raise ServerArgumentError(
                f"reserve of {chunk_bytes}-byte chunks by a client registered with {session.chunk_bytes}-byte ones; "
                "register again with the chunk size you store",
                expected=session.chunk_bytes,
                got=chunk_bytes,
            )
        chunks = self.chunks
        slot_size = self.allocator.slot_size(chunk_bytes)
        reservation = self.sessions.new_reservation(session, salt, now)
        reservation.generation = self.clears.now
        slots: list[tuple[int, int, int]] = []
        present: list[int] = []
        full = False
        # The chunks found committed are held out of eviction until the call ends (then put back
        # as just used): the client is told they are stored, so placing a later key of the same
        # call must not evict them.
        found: dict[int, Entry] = {}
        try:
            for index, key in enumerate(keys):
                entry = chunks.entries.get((salt, key))
                if entry is not None:
                    present.append(index)
                    if entry.state is _COMMITTED and id(entry) not in found:
                        found[id(entry)] = entry
                        self.policy.hold(entry)
                    continue
                if full:
                    continue
                offset = chunks.place(salt, slot_size, owner) if self.sessions.may_pend(session, slot_size) else None
                if offset is None:
                    full = True
                    continue
                entry = chunks.add(Entry(salt, key, offset, chunk_bytes, slot_size, owner))
                self.sessions.pend(session, slot_size)
                reservation.pending[index] = entry
                slots.append((index, offset + SLOT_HEADER_BYTES, chunk_bytes))
        finally:
            for entry in found.values():  # a reserve that finds a chunk counts as a use of it
                self.policy.unhold(entry)
            chunks.headers.flush()  # a kept pool's journal names every slot handed out before the reply
        self.full_reserves += full
        if not reservation.pending:
            return ReserveOutcome(0, slots, present, full)
        self.sessions.hold(session, reservation)
        return ReserveOutcome(reservation.id, slots, present, full)

    def commit(
        self, client: str, reservation_id: int, indices: Iterable[int] | None, now: float, *, pin_s: float = 0.0
    ) -> int:
        """Make the reservation's chunks at `indices` (None = all) visible; returns how many.

        Indices that are not pending in this reservation are ignored. The reservation ends
        when nothing in it is pending any more. With `pin_s`, the chunks committed stay
        unevictable for that long (`ServerHolds.pin`).
        """
        session = self.sessions.active(client, now)
        reservation = self.sessions.reservation(client, reservation_id)
        if reservation is None:
            raise UnknownReservationError(
                f"reservation {reservation_id} is unknown, expired or finished; reserve the keys again",
                reservation_id=reservation_id,
            )
        if self.clears.since(reservation.salt, reservation.generation):  # stored before a clear: it stays cleared
            self.abort_reservation(reservation)
            return 0
        chosen = list(reservation.pending) if indices is None else list(indices)
        done: list[Entry] = []
        chunks = self.chunks
        events = chunks.events
        for index in chosen:
            entry = reservation.pending.pop(index, None)
            if entry is None:
                continue
            chunks.step(entry, _COMMIT)
            chunks.headers.published(entry.offset)
            self.sessions.pend(session, -entry.slot_size)
            self.bytes_stored += entry.length
            done.append(entry)
            if events is not None:
                events.append(Committed(entry.salt, entry.key, entry.length, client, pin_s > 0))
        if not reservation.pending:
            self.sessions.end_reservation(reservation)
        if pin_s > 0 and done:
            self.holds.pin(done, now, pin_s)
        return len(done)

    def adopt(self, committed: Sequence[Record], pending: Sequence[Record], now: float) -> AdoptOutcome:
        """Take back a kept pool's slots, verified by `_adopt.py`, on an index that holds nothing
        yet: `committed` chunks become COMMITTED in order (the first is the oldest use), owned by
        `ADOPTED_CLIENT`; `pending` slots (written when the last server died) stay PENDING in the
        quarantine for one reservation TTL (`ServerHolds.quarantine_adopted`). Records that break
        a quota, repeat a chunk, or claim a slot another record has are refused, by reason."""
        outcome, quarantined = self.chunks.adopt(committed, pending, owners=(ADOPTED_CLIENT, QUARANTINE_CLIENT))
        self.holds.quarantine_adopted(quarantined, now)
        return outcome

    def abort(self, client: str, reservation_id: int) -> int:
        """Drop a reservation and free its pending slots; 0 when it is unknown (idempotent)."""
        reservation = self.sessions.reservation(client, reservation_id)
        return 0 if reservation is None else self.abort_reservation(reservation)

    def abort_reservation(self, reservation: Reservation) -> int:
        """End `reservation` and free its pending slots; how many."""
        session = self.sessions.end_reservation(reservation)
        for entry in reservation.pending.values():
            self.sessions.pend(session, -entry.slot_size)
            self.chunks.drop_pending(entry)
        return len(reservation.pending)

    # -- retrieve -------------------------------------------------------------------------

    def prefix_lengths(self, items: Sequence[tuple[str, Sequence[bytes]]]) -> list[int]:
        """Per item, how many of its first keys are committed; changes nothing."""
        return [len(self.chunks.prefix(salt, keys)) for salt, keys in items]

    def lookup(self, client: str, items: Sequence[tuple[str, Sequence[bytes]]], now: float) -> list[LookupOutcome]:
        """Per item, the longest prefix of committed keys, leased until release or expiry;
        counted as hits and misses.

        A lookup needs a session (Hello) but no layout: a scheduler that only looks up never
        registers one.
        """
        session = self._lookup_session(client, items, now)
        results: list[LookupOutcome] = []
        prefix = self.chunks.prefix
        for salt, keys in items:
            hits = prefix(salt, keys)
            self.hits += len(hits)
            self.misses += len(keys) - len(hits)
            self.bytes_loaded += sum(entry.length for entry in hits)
            results.append(self._leased(session, hits, now))
        return results

    def lease_prefixes(
        self, client: str, items: Sequence[tuple[str, Sequence[bytes]]], now: float
    ) -> list[LookupOutcome]:
        """`lookup` without counting hits and misses (the server's own leases: `ServerHolds`)."""
        session = self._lookup_session(client, items, now)
        return [self._leased(session, self.chunks.prefix(salt, keys), now) for salt, keys in items]

    def _lookup_session(self, client: str, items: Sequence[tuple[str, Sequence[bytes]]], now: float) -> Session:
        """The session of a client looking `items` up, once the lookup is within the bounds."""
        session = self.sessions.active(client, now, need_layout=False)
        if (total := sum(len(keys) for _, keys in items)) > MAX_KEYS_PER_REQUEST:
            raise ServerArgumentError(f"{total} keys in one lookup; send at most {MAX_KEYS_PER_REQUEST}", count=total)
        self.sessions.check_lease_room(session, len(items))
        return session

    def _leased(self, session: Session, hits: list[Entry], now: float) -> LookupOutcome:
        """An item's answer: its hits, leased to `session` (no lease when none)."""
        if not hits:
            return LookupOutcome(0, 0, [])
        lease = self.lease(session, hits, now)
        return LookupOutcome(len(hits), lease.id, [(e.offset + SLOT_HEADER_BYTES, e.length) for e in hits])

    def lease(self, session: Session, entries: list[Entry], now: float, ttl: float | None = None) -> Lease:
        """Lease visible `entries` to `session` for `ttl` seconds (the lease TTL when None)."""
        self.chunks.lease(entries)
        return self.sessions.new_lease(session, entries, now, ttl)

    def release(self, client: str, lease_ids: Iterable[int]) -> int:
        """End the client's leases; unknown or foreign ids are skipped. Returns how many ended."""
        released = 0
        for lid in lease_ids:
            lease = self.sessions.lease(client, lid)
            if lease is not None:
                self.drop_lease(lease)
                released += 1
        return released

    def drop_lease(self, lease: Lease) -> None:
        """End `lease`: its chunks no longer leased by anyone become evictable again."""
        self.sessions.end_lease(lease)
        if lease.ended is not None:
            lease.ended(lease.id)
        self.chunks.unlease(lease.entries)

    # -- administration -------------------------------------------------------------------

    def clear(self, salt: str | None = None, limit: int = CLEAR_SLICE) -> tuple[int, bool]:
        """Remove up to `limit` committed, unleased chunks (of `salt`, or all).

        Returns (removed, more): `more` when some are left. A large clear takes several
        requests, so that other clients are served in between.
        """
        self.clears.mark(salt)
        self.holds.unpin(salt)
        victims = self.policy.evictable(salt, limit + 1)
        events = self.chunks.events
        for entry in victims[:limit]:
            self.chunks.remove(entry)
            if events is not None:
                events.append(Cleared(entry.salt, entry.key, entry.length))
        return min(len(victims), limit), len(victims) > limit

    def visible_chunks(self, salt: str | None = None) -> int:
        """Committed chunks of ``salt`` (None: of every salt) in RAM, leased or not."""
        return self.chunks.visible(salt)

    def set_quota(self, salt: str, max_bytes: int | None) -> dict[str, int]:
        """Limit the bytes `salt` may hold (None removes the limit); evicts its LRU chunks now.

        `max_bytes` is not negative: the wire format (`SetQuota`) checks that.
        """
        return self.chunks.set_quota(salt, max_bytes)

    def quotas(self) -> dict[str, int]:
        return dict(self.chunks.quotas)

    def take_events(self) -> list[IndexEvent]:
        """What happened since the last call, oldest first (the loop thread takes them)."""
        return self.chunks.take_events()

    def quota_of(self, salt: str) -> int | None:
        """The bytes `salt` may hold (None: no limit); one dict read, safe from the tiers' threads."""
        return self.chunks.quotas.get(salt, self.chunks.default_quota)

    def expire(self, now: float) -> Reclaimed:
        """End leases and reservations past their deadline and sessions silent too long."""
        leases = reservations = chunks = 0
        for held in self.sessions.due(now):
            if isinstance(held, Lease):
                self.drop_lease(held)
                leases += 1
            else:
                chunks += self.holds.quarantine(held, now)
                reservations += 1
        self.expired_leases += leases
        self.expired_reservations += reservations
        for client in self.sessions.silent(now):
            gone = self.close_session(client, now)
            leases += gone.leases
            reservations += gone.reservations
            chunks += gone.chunks
        return Reclaimed(reservations, leases, chunks)

    def stats(self, salts: Iterable[str] | None = None) -> IndexStats:
        """The index's figures; per-salt ones for every salt, or for `salts` only (cheap)."""
        return _stats(self, salts)

    @property
    def salt_count(self) -> int:
        """Salts holding any bytes."""
        return len(self.chunks.salt_bytes)

    def largest_salts(self, count: int) -> list[str]:
        """The `count` salts holding the most bytes, most first (O(salts): not per request)."""
        return self.chunks.largest_salts(count)

    def check(self) -> None:
        """Assert every invariant of the index and its collaborators (for tests)."""
        self.allocator.check()
        self.chunks.check([e for r in self.sessions.reservations.values() for e in r.pending.values()])
        self.policy.check(list(self.chunks.entries.values()), self.sessions.clients())
        self.sessions.check()
        self.holds.check()


def _stats(index: ChunkIndex, salts: Iterable[str] | None) -> IndexStats:
    """`ChunkIndex.stats`: its figures and its collaborators'."""
    chunks, holds, allocator = index.chunks, index.holds, index.allocator
    salt_bytes, salt_chunks = chunks.per_salt(salts)
    # The quarantine's slots are pending for the allocator, but no client is writing them.
    quarantined, held = holds.quarantined()
    return IndexStats(
        capacity_bytes=allocator.capacity,
        used_bytes=allocator.used_bytes,
        page_size=allocator.page_size,
        pages_total=allocator.num_pages,
        pages_free=allocator.free_pages,
        chunks=chunks.in_state[S.COMMITTED] + chunks.in_state[S.LEASED],
        pending_chunks=chunks.in_state[S.PENDING] - quarantined,
        quarantined_chunks=quarantined,
        leased_chunks=chunks.in_state[S.LEASED],
        hits=index.hits,
        misses=index.misses,
        bytes_stored=index.bytes_stored,
        bytes_loaded=index.bytes_loaded,
        evictions=chunks.evictions,
        leases=len(index.sessions.leases),
        reservations=len(index.sessions.reservations) - held,
        expired_leases=index.expired_leases,
        expired_reservations=index.expired_reservations,
        clients=index.sessions.outside_clients(),
        full_reserves=index.full_reserves,
        pins_refused=holds.pins_refused,
        pins_refused_share=holds.pins_refused_share,
        pins_ended_early=holds.pins_ended_early,
        salt_bytes=salt_bytes,
        salt_chunks=salt_chunks,
        quotas=dict(chunks.quotas),
        salt_count=len(chunks.salt_bytes),
    )
