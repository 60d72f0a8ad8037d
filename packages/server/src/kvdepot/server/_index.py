"""The chunk index: which (salt, key) lives in which slot, and the figures per salt.

Pure state: no clock, no sockets, no logging. Every method that depends on time takes
`now: float` (seconds, any monotonic origin), so the server loop feeds it a clock and the
tests feed it numbers.

The index is the manager; two collaborators hold the rest, as vLLM splits its offloading
manager from its policies:

- `Sessions` (`_sessions.py`): client sessions, reservations, leases and their deadlines;
- `EvictionPolicy` (`_eviction.py`): which chunks give way to a new one, and the use order
  and page pins it picks them from (behind its methods).

A chunk's state moves only through `_step`, by the table in `_chunk_state.py`.

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

import heapq
import itertools
from collections.abc import Iterable, Iterator, Sequence

from kvdepot.core import SLOT_HEADER_BYTES
from kvdepot.server._chunk_state import LIVE, MOVES, VISIBLE, ChunkEvent, ChunkState, move
from kvdepot.server._errors import ServerArgumentError, ServerError, UnknownReservationError
from kvdepot.server._events import Cleared, Committed, Evicted, IndexEvent
from kvdepot.server._eviction import EvictionPolicy
from kvdepot.server._pins import PinShares
from kvdepot.server._pool import SlotHeaders
from kvdepot.server._pool_journal import COMMITTED, Record
from kvdepot.server._records import Entry, Lease, Reservation
from kvdepot.server._results import AdoptOutcome, IndexStats, LookupOutcome, Reclaimed, ReserveOutcome
from kvdepot.server._sessions import (
    DEFAULT_LEASE_TTL,
    DEFAULT_RESERVATION_TTL,
    DEFAULT_SESSION_TTL,
    MAX_LEASES_PER_CLIENT,
    Sessions,
)
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
#: The server's own session that holds, for one more reservation TTL, the slots of reservations
#: that expired or whose client left (`ChunkIndex._quarantine`).
QUARANTINE_CLIENT = f"{RESERVED_CLIENT_PREFIX}quarantine"
#: Who owns the chunks a restarted server took back from its kept pool (`adopt`).
ADOPTED_CLIENT = f"{RESERVED_CLIENT_PREFIX}adopted"
#: The server's own session whose leases pin chunks committed with a pin (`Commit.pin_s`: a
#: prefill engine's handoff, until the decode engine has looked them up), each for a bounded time.
PIN_CLIENT = f"{RESERVED_CLIENT_PREFIX}pins"
#: The longest a commit may pin its chunks (seconds), whatever it asks.
MAX_PIN_S = 60.0
#: The share of the pool that pins may hold at once; past it a commit's chunks go unpinned.
#: When a pin does not fit, the salts pinning share this room equally (`_pins.py`).
MAX_PINNED_SHARE = 0.25
#: Pins (leases of `PIN_CLIENT`) at once, shared between salts the same way.
MAX_PIN_LEASES = MAX_LEASES_PER_CLIENT

EntryKey = tuple[str, bytes]
S, E = ChunkState, ChunkEvent
# Module globals: cheaper than an Enum class's attributes on the hot paths.
_FREE, _COMMITTED = S.FREE, S.COMMITTED
_RESERVE, _COMMIT, _ABORT, _LEASE, _UNLEASE, _REMOVE = E.RESERVE, E.COMMIT, E.ABORT, E.LEASE, E.UNLEASE, E.REMOVE


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
        self.headers = headers or SlotHeaders()  # each slot's header says what it holds
        self.default_quota = default_quota  # bytes of a salt without a quota of its own (None: no limit)
        if max_client_pending_bytes is None:
            max_client_pending_bytes = int(allocator.capacity * DEFAULT_MAX_CLIENT_PENDING_FRACTION)
        self.sessions = Sessions(
            lease_ttl=lease_ttl,
            reservation_ttl=reservation_ttl,
            session_ttl=session_ttl,
            max_client_pending_bytes=max_client_pending_bytes,
            max_pending_bytes=max(int(allocator.capacity * MAX_PENDING_FRACTION), max_client_pending_bytes),
            client_pending_floor=int(allocator.capacity * CLIENT_PENDING_FLOOR_FRACTION),
            max_pending_with_floors=int(allocator.capacity * MAX_PENDING_WITH_FLOORS_FRACTION),
        )
        self.policy = EvictionPolicy(allocator, self._residents, self.sessions)
        self._entries: dict[EntryKey, Entry] = {}
        self._by_offset: dict[int, Entry] = {}
        self._in_state = dict.fromkeys(LIVE, 0)  # chunks per state
        self._events: list[IndexEvent] | None = [] if events else None
        self._salt_bytes: dict[str, int] = {}  # slot bytes per salt, pending chunks included
        self._salt_chunks: dict[str, int] = {}  # visible chunks per salt
        self._quotas: dict[str, int] = {}
        self.hits = self.misses = self.bytes_stored = self.bytes_loaded = 0
        self.evictions = self.expired_leases = self.expired_reservations = self.full_reserves = 0
        self.pins_refused = 0  # commits whose pin found no room (the chunks are committed unpinned)
        self.pins_refused_share = 0  # ... of those, because their salt held its share while others pinned
        self.pins_ended_early = 0  # pins of salts past their share ended to make room for another salt
        self.pins = PinShares(int(MAX_PINNED_SHARE * allocator.capacity), MAX_PIN_LEASES)  # slot bytes per salt
        self._clears = 0  # clears so far (a reservation made before a clear of its salt commits nothing)
        self._cleared: dict[str | None, int] = {}  # per salt (None: all): the number of its last clear

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
        reservations' slots are quarantined (`_quarantine`) for one more reservation TTL."""
        held = self.sessions.close(client)
        if held is None:
            return Reclaimed()
        self.policy.session_changed(client, opened=False)
        reservations, leases = held
        chunks = sum(self._quarantine(reservation, now) for reservation in reservations)
        for lease in leases:
            self._drop_lease(lease)
        return Reclaimed(len(reservations), len(leases), chunks)

    def clients(self) -> list[str]:
        return self.sessions.clients()

    # -- store ----------------------------------------------------------------------------

    def reserve(
        self, client: str, salt: str, keys: Sequence[bytes], chunk_bytes: int, now: float, *, owner: str | None = None
    ) -> ReserveOutcome:
        """Give slots to keys neither committed nor pending, in order, until the pool is full.

        Keys already present are listed in `present` (and count as used). Placement stops at
        the first key that cannot be placed without evicting leased or pending chunks,
        breaking the salt's quota, or passing the client's bound on pending bytes; `full`
        then says so. Never blocks. The chunks count toward `owner`'s share (default: the client).
        """
        session = self.sessions.active(client, now)
        if chunk_bytes != session.chunk_bytes:  # each new slot size would cost the allocator a class for good
            raise ServerArgumentError(
                f"reserve of {chunk_bytes}-byte chunks by a client registered with {session.chunk_bytes}-byte ones; "
                "register again with the chunk size you store",
                expected=session.chunk_bytes,
                got=chunk_bytes,
            )
        owner = client if owner is None else owner
        slot_size = self.allocator.slot_size(chunk_bytes)
        reservation = self.sessions.new_reservation(session, salt, now)
        reservation.generation = self._clears
        slots: list[tuple[int, int, int]] = []
        present: list[int] = []
        full = False
        # The chunks found committed are held out of eviction until the call ends (then put back
        # as just used): the client is told they are stored, so placing a later key of the same
        # call must not evict them.
        found: dict[int, Entry] = {}
        try:
            for index, key in enumerate(keys):
                entry = self._entries.get((salt, key))
                if entry is not None:
                    present.append(index)
                    if entry.state is S.COMMITTED and id(entry) not in found:
                        found[id(entry)] = entry
                        self.policy.hold(entry)
                    continue
                if full:
                    continue
                offset = self._place(salt, slot_size, owner) if self.sessions.may_pend(session, slot_size) else None
                if offset is None:
                    full = True
                    continue
                entry = self._new_entry(Entry(salt, key, offset, chunk_bytes, slot_size, owner))
                self.sessions.pend(session, slot_size)
                reservation.pending[index] = entry
                slots.append((index, offset + SLOT_HEADER_BYTES, chunk_bytes))
        finally:
            for entry in found.values():  # a reserve that finds a chunk counts as a use of it
                self.policy.unhold(entry)
            self.headers.flush()  # a kept pool's journal names every slot handed out before the reply
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
        unevictable for that long (at most `MAX_PIN_S`), leased to `PIN_CLIENT`.
        """
        session = self.sessions.active(client, now)
        reservation = self.sessions.reservation(client, reservation_id)
        if reservation is None:
            raise UnknownReservationError(
                f"reservation {reservation_id} is unknown, expired or finished; reserve the keys again",
                reservation_id=reservation_id,
            )
        if self._cleared_since(reservation):  # stored before a clear of its salt: it stays cleared
            self._abort(reservation)
            return 0
        chosen = list(reservation.pending) if indices is None else list(indices)
        done: list[Entry] = []
        events = self._events
        for index in chosen:
            entry = reservation.pending.pop(index, None)
            if entry is None:
                continue
            self._step(entry, _COMMIT)
            self.headers.published(entry.offset)
            self.sessions.pend(session, -entry.slot_size)
            self.bytes_stored += entry.length
            done.append(entry)
            if events is not None:
                events.append(Committed(entry.salt, entry.key, entry.length, client, pin_s > 0))
        if not reservation.pending:
            self.sessions.end_reservation(reservation)
        if pin_s > 0 and done:
            self._pin(done, now, min(pin_s, MAX_PIN_S))
        return len(done)

    def _cleared_since(self, reservation: Reservation) -> bool:
        """Whether its salt (or everything) was cleared after the reservation was made."""
        last = max(self._cleared.get(reservation.salt, 0), self._cleared.get(None, 0))
        return last > reservation.generation

    def _pin(self, entries: list[Entry], now: float, seconds: float) -> None:
        """Lease `entries` (of one salt) to `PIN_CLIENT` for `seconds`. When the pins' room is
        full, a salt within its share of it ends the oldest pins of salts past theirs; a salt
        past its share, or no room for a lease, leaves the chunks unpinned (`pins_refused`)."""
        size = sum(entry.slot_size for entry in entries)
        try:
            ended = self.pins.make_room(entries[0].salt, size)
            self.touch(PIN_CLIENT, now, "pins")
            session = self.sessions.active(PIN_CLIENT, now, need_layout=False)
            self.sessions.check_lease_room(session, 1 - len(ended))
        except ServerError as exc:
            self.pins_refused += 1
            self.pins_refused_share += exc.fields.get("reason") == "share"
            return
        for lease_id in ended:
            self._drop_lease(self.sessions.leases[lease_id])
        self.pins_ended_early += len(ended)
        for entry in entries:
            entry.leases += 1
            if entry.leases == 1:
                self._step(entry, _LEASE)
        lease = self.sessions.new_lease(session, entries, now, ttl=seconds)
        self.pins.add(entries[0].salt, lease.id, size)

    def adopt(self, committed: Sequence[Record], pending: Sequence[Record], now: float) -> AdoptOutcome:
        """Take back a kept pool's slots, verified by `_adopt.py`, on an index that holds nothing
        yet: `committed` chunks become COMMITTED in order (the first is the oldest use), owned by
        `ADOPTED_CLIENT`; `pending` slots (written when the last server died) stay PENDING in the
        quarantine for one reservation TTL. Records that break a quota, repeat a chunk, or claim
        a slot another record has are refused, by reason."""
        assert not self._entries, "adopt runs on an empty index"
        refused: dict[str, int] = {}
        wanted: list[tuple[Record, int]] = []
        seen: set[EntryKey] = set()
        usage: dict[str, int] = {}
        for record in (*committed, *pending):
            try:
                slot_size = self.allocator.slot_size(record.length)
            except ServerError:
                _add(refused, "layout", 1)
                continue
            quota = self._quotas.get(record.salt, self.default_quota)
            if (record.salt, record.key) in seen:
                _add(refused, "duplicate", 1)
            elif quota is not None and usage.get(record.salt, 0) + slot_size > quota:
                _add(refused, "quota", 1)
            else:
                seen.add((record.salt, record.key))
                _add(usage, record.salt, slot_size)
                wanted.append((record, slot_size))
        outcome = AdoptOutcome(refused=refused)
        held: dict[str, Reservation] = {}
        accepted = self.allocator.adopt((record.slot, slot_size) for record, slot_size in wanted)
        for (record, slot_size), ok in zip(wanted, accepted, strict=True):
            if not ok:
                _add(refused, "overlap", 1)
                continue
            kept = record.kind == COMMITTED
            outcome.records.append(record)
            entry = Entry(record.salt, record.key, record.slot, record.length, slot_size)
            entry.owner = ADOPTED_CLIENT if kept else QUARANTINE_CLIENT
            self._entries[(entry.salt, entry.key)] = entry
            self._by_offset[entry.offset] = entry
            self.policy.own(entry.owner, slot_size)
            _add(self._salt_bytes, entry.salt, slot_size)
            self._step(entry, _RESERVE)
            if kept:
                self._step(entry, _COMMIT)
                outcome.chunks += 1
                outcome.bytes += entry.length
                if self._events is not None:
                    self._events.append(Committed(entry.salt, entry.key, entry.length, ADOPTED_CLIENT, False))
                continue
            if (reservation := held.get(entry.salt)) is None:
                self.touch(QUARANTINE_CLIENT, now, "quarantine")
                holder = self.sessions.active(QUARANTINE_CLIENT, now, need_layout=False)
                ttl = self.sessions.reservation_ttl
                reservation = held[entry.salt] = self.sessions.new_reservation(holder, entry.salt, now, ttl=ttl)
                self.sessions.hold(holder, reservation)
            reservation.pending[len(reservation.pending)] = entry
            self.sessions.pend(self.sessions.active(QUARANTINE_CLIENT, now, need_layout=False), slot_size)
            outcome.pending += 1
        return outcome

    def abort(self, client: str, reservation_id: int) -> int:
        """Drop a reservation and free its pending slots; 0 when it is unknown (idempotent)."""
        reservation = self.sessions.reservation(client, reservation_id)
        return 0 if reservation is None else self._abort(reservation)

    # -- retrieve -------------------------------------------------------------------------

    def prefix_lengths(self, items: Sequence[tuple[str, Sequence[bytes]]]) -> list[int]:
        """Per item, how many of its first keys are committed; changes nothing."""
        return [len(self._prefix(salt, keys)) for salt, keys in items]

    def _prefix(self, salt: str, keys: Sequence[bytes]) -> list[Entry]:
        """The visible chunks of `keys`' longest visible prefix."""
        hits: list[Entry] = []
        for key in keys:
            entry = self._entries.get((salt, key))
            if entry is None or entry.state not in VISIBLE:
                break
            hits.append(entry)
        return hits

    def lookup(
        self, client: str, items: Sequence[tuple[str, Sequence[bytes]]], now: float, *, count: bool = True
    ) -> list[LookupOutcome]:
        """Per item, the longest prefix of committed keys, leased until release or expiry.

        A lookup needs a session (Hello) but no layout: a scheduler that only looks up never
        registers one. With `count=False` (the server's own leases) hits and misses are not counted.
        """
        session = self.sessions.active(client, now, need_layout=False)
        if (total := sum(len(keys) for _, keys in items)) > MAX_KEYS_PER_REQUEST:
            raise ServerArgumentError(f"{total} keys in one lookup; send at most {MAX_KEYS_PER_REQUEST}", count=total)
        self.sessions.check_lease_room(session, len(items))
        results: list[LookupOutcome] = []
        for salt, keys in items:
            hits = self._prefix(salt, keys)
            if count:
                self.hits += len(hits)
                self.misses += len(keys) - len(hits)
                self.bytes_loaded += sum(entry.length for entry in hits)
            if not hits:
                results.append(LookupOutcome(0, 0, []))
                continue
            for entry in hits:
                entry.leases += 1
                if entry.leases == 1:
                    self._step(entry, _LEASE)
            lease = self.sessions.new_lease(session, hits, now)
            results.append(LookupOutcome(len(hits), lease.id, [(e.offset + SLOT_HEADER_BYTES, e.length) for e in hits]))
        return results

    def release(self, client: str, lease_ids: Iterable[int]) -> int:
        """End the client's leases; unknown or foreign ids are skipped. Returns how many ended."""
        released = 0
        for lid in lease_ids:
            lease = self.sessions.lease(client, lid)
            if lease is not None:
                self._drop_lease(lease)
                released += 1
        return released

    # -- administration -------------------------------------------------------------------

    def clear(self, salt: str | None = None, limit: int = CLEAR_SLICE) -> tuple[int, bool]:
        """Remove up to `limit` committed, unleased chunks (of `salt`, or all).

        Returns (removed, more): `more` when some are left. A large clear takes several
        requests, so that other clients are served in between.
        """
        self._clears += 1
        self._cleared[salt] = self._clears
        self._unpin(salt)
        victims = self.policy.evictable(salt, limit + 1)
        for entry in victims[:limit]:
            self._remove(entry)
            if self._events is not None:
                self._events.append(Cleared(entry.salt, entry.key, entry.length))
        return min(len(victims), limit), len(victims) > limit

    def visible_chunks(self, salt: str | None = None) -> int:
        """Committed chunks of ``salt`` (None: of every salt) in RAM, leased or not."""
        return sum(self._salt_chunks.values()) if salt is None else self._salt_chunks.get(salt, 0)

    def _unpin(self, salt: str | None) -> None:
        """End the pins of `salt`'s chunks (None: every pin): a clear removes pinned chunks too."""
        session = self.sessions.session_of(PIN_CLIENT)
        if session is None:
            return
        for lease_id in list(session.leases):
            lease = self.sessions.lease(PIN_CLIENT, lease_id)
            if lease is not None and (salt is None or lease.entries[0].salt == salt):
                self._drop_lease(lease)

    def set_quota(self, salt: str, max_bytes: int | None) -> dict[str, int]:
        """Limit the bytes `salt` may hold (None removes the limit); evicts its LRU chunks now.

        `max_bytes` is not negative: the wire format (`SetQuota`) checks that.
        """
        if max_bytes is None:
            self._quotas.pop(salt, None)
            return dict(self._quotas)
        assert max_bytes >= 0, "a quota is a number of bytes"
        self._quotas[salt] = max_bytes
        while self._salt_bytes.get(salt, 0) > max_bytes and (oldest := self.policy.quota_victim(salt)):
            self._evict(oldest)
        return dict(self._quotas)

    def quotas(self) -> dict[str, int]:
        return dict(self._quotas)

    def take_events(self) -> list[IndexEvent]:
        """What happened since the last call, oldest first (the loop thread takes them)."""
        events = self._events
        if not events:
            return []
        self._events = []
        return events

    def quota_of(self, salt: str) -> int | None:
        """The bytes `salt` may hold (None: no limit); one dict read, safe from the tiers' threads."""
        return self._quotas.get(salt, self.default_quota)

    def expire(self, now: float) -> Reclaimed:
        """End leases and reservations past their deadline and sessions silent too long."""
        leases = reservations = chunks = 0
        for held in self.sessions.due(now):
            if isinstance(held, Lease):
                self._drop_lease(held)
                leases += 1
            else:
                chunks += self._quarantine(held, now)
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
        if salts is None:
            salt_bytes, salt_chunks = dict(self._salt_bytes), dict(self._salt_chunks)
        else:
            salt_bytes = {salt: self._salt_bytes[salt] for salt in salts if salt in self._salt_bytes}
            salt_chunks = {salt: self._salt_chunks.get(salt, 0) for salt in salt_bytes}
        # The quarantine's slots are pending for the allocator, but no client is writing them.
        quarantine = self.sessions.session_of(QUARANTINE_CLIENT)
        held = [self.sessions.reservations[r] for r in quarantine.reservations] if quarantine is not None else []
        quarantined = sum(len(reservation.pending) for reservation in held)
        return IndexStats(
            capacity_bytes=self.allocator.capacity,
            used_bytes=self.allocator.used_bytes,
            page_size=self.allocator.page_size,
            pages_total=self.allocator.num_pages,
            pages_free=self.allocator.free_pages,
            chunks=self._in_state[S.COMMITTED] + self._in_state[S.LEASED],
            pending_chunks=self._in_state[S.PENDING] - quarantined,
            quarantined_chunks=quarantined,
            leased_chunks=self._in_state[S.LEASED],
            hits=self.hits,
            misses=self.misses,
            bytes_stored=self.bytes_stored,
            bytes_loaded=self.bytes_loaded,
            evictions=self.evictions,
            leases=len(self.sessions.leases),
            reservations=len(self.sessions.reservations) - len(held),
            expired_leases=self.expired_leases,
            expired_reservations=self.expired_reservations,
            clients=self.sessions.outside_clients(),
            full_reserves=self.full_reserves,
            pins_refused=self.pins_refused,
            pins_refused_share=self.pins_refused_share,
            pins_ended_early=self.pins_ended_early,
            salt_bytes=salt_bytes,
            salt_chunks=salt_chunks,
            quotas=dict(self._quotas),
            salt_count=len(self._salt_bytes),
        )

    @property
    def salt_count(self) -> int:
        """Salts holding any bytes."""
        return len(self._salt_bytes)

    def largest_salts(self, count: int) -> list[str]:
        """The `count` salts holding the most bytes, most first (O(salts): not per request)."""
        return heapq.nlargest(count, self._salt_bytes, key=self._salt_bytes.__getitem__)

    # -- internals ------------------------------------------------------------------------

    def _step(self, entry: Entry, event: ChunkEvent) -> None:
        """Move `entry` by the state table, and keep every figure that depends on its state."""
        old = entry.state
        try:
            new, pinned, visible = MOVES[old, event]
        except KeyError:
            move(old, event)  # raises InvalidTransitionError, which says what was asked
            raise
        entry.state = new
        in_state = self._in_state
        if old is not _FREE:
            in_state[old] -= 1
        if new is not _FREE:
            in_state[new] += 1
        self.policy.moved(entry, old, new, pinned)
        if visible:
            _add(self._salt_chunks, entry.salt, visible)

    def _residents(self, page: int) -> Iterator[Entry]:
        """The chunks in `page`'s slots."""
        for offset in self.allocator.page_slots(page):
            if (entry := self._by_offset.get(offset)) is not None:
                yield entry

    def _place(self, salt: str, slot_size: int, owner: str) -> int | None:
        """A free slot for a new chunk of `salt`, evicting as the quota and the policy allow."""
        quota = self._quotas.get(salt, self.default_quota)
        if quota is not None:
            if slot_size > quota:
                return None
            over = self._salt_bytes.get(salt, 0) + slot_size > quota
            if over and not self._slot_possible(salt, slot_size):
                return None  # the salt's chunks would be evicted for a slot that cannot be had
            while self._salt_bytes.get(salt, 0) + slot_size > quota:
                if (oldest := self.policy.quota_victim(salt)) is None:
                    return None
                self._evict(oldest)
        while (offset := self.allocator.allocate(slot_size)) is None:
            victims = self.policy.victims(owner, slot_size)
            if not victims:
                return None
            for victim in victims:
                self._evict(victim)
        return offset

    def _slot_possible(self, salt: str, slot_size: int) -> bool:
        """Whether a slot of `slot_size` is free, can be freed by the policy, or is what evicting
        the salt's own oldest chunk frees (the quota's first victim)."""
        if self.allocator.can_allocate(slot_size) or self.policy.can_free(slot_size):
            return True
        oldest = self.policy.quota_victim(salt)
        return oldest is not None and oldest.slot_size == slot_size

    def _new_entry(self, entry: Entry) -> Entry:
        """Put a placed chunk in the index, PENDING."""
        self._entries[(entry.salt, entry.key)] = entry
        self._by_offset[entry.offset] = entry
        self.policy.own(entry.owner, entry.slot_size)
        _add(self._salt_bytes, entry.salt, entry.slot_size)
        self._step(entry, _RESERVE)
        self.headers.writing(entry.offset, entry.salt, entry.key, entry.length)
        return entry

    def _evict(self, entry: Entry) -> None:
        self._remove(entry)
        self.evictions += 1
        if self._events is not None:
            self._events.append(Evicted(entry.salt, entry.key, entry.length))

    def _remove(self, entry: Entry) -> None:
        self._step(entry, _REMOVE)
        self._free_slot(entry)
        self.policy.removed(entry)

    def _free_slot(self, entry: Entry) -> None:
        del self._entries[(entry.salt, entry.key)]
        del self._by_offset[entry.offset]
        self.policy.own(entry.owner, -entry.slot_size)
        self.allocator.free(entry.offset)
        self.headers.freed(entry.offset)
        _add(self._salt_bytes, entry.salt, -entry.slot_size)

    def _abort(self, reservation: Reservation) -> int:
        session = self.sessions.end_reservation(reservation)
        for entry in reservation.pending.values():
            self.sessions.pend(session, -entry.slot_size)
            self._step(entry, _ABORT)
            self._free_slot(entry)
        return len(reservation.pending)

    def _quarantine(self, reservation: Reservation, now: float) -> int:
        """End a reservation its client did not end (expired, or the client left) without
        freeing its slots yet: the client's copy into them may still be under way (a stalled
        GPU stream, a paused process), and landing in a slot another client has since filled
        and committed it would pass every reader's check with the wrong bytes. The slots stay
        pending, held by the server's `QUARANTINE_CLIENT`, for one more reservation TTL; then
        they are freed. How many chunks it held."""
        if reservation.client == QUARANTINE_CLIENT:
            return self._abort(reservation)
        try:
            self.touch(QUARANTINE_CLIENT, now, "quarantine")
            holder = self.sessions.active(QUARANTINE_CLIENT, now, need_layout=False)
            moved = self.sessions.new_reservation(holder, reservation.salt, now, ttl=self.sessions.reservation_ttl)
        except ServerError:  # too many sessions or reservations: freed now, as before
            return self._abort(reservation)
        session = self.sessions.end_reservation(reservation)
        for index, entry in reservation.pending.items():
            self.sessions.pend(session, -entry.slot_size)
            self.sessions.pend(holder, entry.slot_size)
            moved.pending[index] = entry
        self.sessions.hold(holder, moved)
        return len(reservation.pending)

    def _drop_lease(self, lease: Lease) -> None:
        self.sessions.end_lease(lease)
        if lease.client == PIN_CLIENT:
            self.pins.remove(lease.id)
        for entry in lease.entries:
            entry.leases -= 1
            if not entry.leases:
                assert self._entries.get((entry.salt, entry.key)) is entry, "a leased chunk left the index"
                self._step(entry, _UNLEASE)

    def check(self) -> None:
        """Assert every invariant of the index, its allocator, policy and sessions (for tests)."""
        self.allocator.check()
        entries = list(self._entries.values())
        self._check_slots(entries)
        in_state = dict.fromkeys(LIVE, 0)
        salt_chunks: dict[str, int] = {}
        for entry in entries:
            in_state[entry.state] += 1  # a FREE entry in the index fails here
            assert (entry.state is S.LEASED) == (entry.leases > 0), "a chunk's state disagrees with its leases"
            if entry.state in VISIBLE:
                _add(salt_chunks, entry.salt, 1)
        assert in_state == self._in_state
        assert salt_chunks == self._salt_chunks
        pending = [e for r in self.sessions.reservations.values() for e in r.pending.values()]
        assert all(e.state is S.PENDING for e in pending)
        assert len(pending) == in_state[S.PENDING]
        self.policy.check(entries, self.sessions.clients())
        self.sessions.check()
        pins = self.sessions.session_of(PIN_CLIENT)
        leases = [self.sessions.leases[lid] for lid in pins.leases] if pins is not None else []
        self.pins.check(
            {lease.id: (lease.entries[0].salt, sum(e.slot_size for e in lease.entries)) for lease in leases}
        )

    def _check_slots(self, entries: list[Entry]) -> None:
        """Assert that every chunk has its own slot, of its size class, inside the pool."""
        spans = []
        for entry in entries:
            assert self._entries[(entry.salt, entry.key)] is entry
            assert self._by_offset[entry.offset] is entry
            assert self.allocator.page_slot_size(self.allocator.page_of(entry.offset)) == entry.slot_size
            assert entry.offset + entry.slot_size <= self.allocator.capacity
            spans.append((entry.offset, entry.offset + entry.slot_size))
        spans.sort()
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert end <= start, "two chunks share bytes"
        used = sum(entry.slot_size for entry in entries)
        assert used == self.allocator.used_bytes == sum(self._salt_bytes.values())
        assert len(self._by_offset) == len(self._entries)


def _add(counts: dict[str, int], name: str, delta: int) -> None:
    """Add `delta` to `counts[name]`, dropping names that reach zero (so figures stay small)."""
    left = counts.get(name, 0) + delta
    if left:
        counts[name] = left
    else:
        del counts[name]
