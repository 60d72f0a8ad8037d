"""The chunk index: which (salt, key) lives in which slot, and who may touch it.

Pure state: no clock, no sockets, no logging. Every method that depends on time takes
`now: float` (seconds, any monotonic origin), so the server loop feeds it a clock and the
tests feed it numbers.

Life of a chunk::

    (absent) --reserve--> PENDING --commit--> COMMITTED --evict/clear--> (absent)
                             |                   ^  |
                             +--abort/expire-->  |  lookup: leases += 1 (never evicted while > 0)
                               (absent)          +--release/lease expiry: leases -= 1

Rules that hold after every method returns (`check()` asserts them):

- a slot holds at most one entry, inside the pool, of the entry's size class;
- PENDING and leased chunks are never evicted, cleared or overwritten;
- the LRU lists hold exactly the COMMITTED chunks with no lease;
- a salt's usage never exceeds its quota because of a reserve, and a salt only ever sees its
  own chunks (the index is keyed by (salt, key)).
"""

from __future__ import annotations

import heapq
import itertools
import secrets
from collections.abc import Callable, Iterable, Sequence

from kvdepot.core import SLOT_HEADER_BYTES
from kvdepot.server._errors import (
    NotRegisteredError,
    ServerArgumentError,
    TooManyError,
    UnknownReservationError,
)
from kvdepot.server._order import UseOrder
from kvdepot.server._pool import SlotHeaders
from kvdepot.server._records import Entry, Lease, Reservation, Session
from kvdepot.server._results import IndexStats, LookupOutcome, Reclaimed, ReserveOutcome
from kvdepot.server._slabs import SlabAllocator

# Seconds a lookup's lease pins its chunks when the client never releases it. Long enough for
# a loaded engine to schedule and scatter a hit; short enough that a stuck client frees memory.
DEFAULT_LEASE_TTL = 60.0
# Seconds a reservation may stay uncommitted before its slots return to the pool.
DEFAULT_RESERVATION_TTL = 60.0
# Seconds without any request (heartbeats included) after which a client counts as gone.
DEFAULT_SESSION_TTL = 30.0
# Live leases and reservations one client may hold: a bound on what one peer can pin.
MAX_LEASES_PER_CLIENT = 1 << 16
MAX_RESERVATIONS_PER_CLIENT = 1 << 16
# Share of the pool one client may hold in uncommitted reservations (a store in progress is a
# few engine steps of chunks): one that never commits cannot fill the pool with pending slots.
DEFAULT_MAX_CLIENT_PENDING_FRACTION = 0.5
# ... and all clients together, so that several client ids cannot pin the whole pool either;
# past that, a client still gets a small share of its own, so one that was idle can store.
MAX_PENDING_FRACTION = 0.75
CLIENT_PENDING_FLOOR_FRACTION = 1 / 16
# Live leases of all clients together: a bound on the index's memory for leases.
MAX_LEASES = 1 << 18
# Client sessions at once: a bound on the index's memory for sessions, however many peers connect.
MAX_SESSIONS = 4096
# Chunks one Clear request removes; a larger clear takes several (the client's `clear` loops).
CLEAR_SLICE = 8192
# Keys in one lookup, summed over its items (the wire format bounds each item, key and salt).
MAX_KEYS_PER_REQUEST = 1 << 16

EntryKey = tuple[str, bytes]


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
    ) -> None:
        self.allocator = allocator
        self.headers = headers or SlotHeaders()  # each slot's header says what it holds
        self.default_quota = default_quota  # bytes of a salt without a quota of its own (None: no limit)
        if max_client_pending_bytes is None:
            max_client_pending_bytes = int(allocator.capacity * DEFAULT_MAX_CLIENT_PENDING_FRACTION)
        self.max_client_pending_bytes = max_client_pending_bytes
        self.max_pending_bytes = max(int(allocator.capacity * MAX_PENDING_FRACTION), max_client_pending_bytes)
        self.client_pending_floor = int(allocator.capacity * CLIENT_PENDING_FLOOR_FRACTION)
        self._pending_bytes = 0  # slot bytes of every reservation's pending chunks
        self.lease_ttl = lease_ttl
        self.reservation_ttl = reservation_ttl
        self.session_ttl = session_ttl
        self._entries: dict[EntryKey, Entry] = {}
        self._by_offset: dict[int, Entry] = {}
        # Committed chunks with no lease, oldest use first: per size class and per salt.
        self._order = UseOrder(allocator.num_pages, allocator.page_size)  # evictable chunks, oldest use first
        self._owner_bytes: dict[str, int] = {}  # slot bytes per client that stored them
        self._sharers = 0  # clients with a session that own bytes: the pool's fair share is split among them
        # Called with (client, entries) after each commit that made chunks visible (the tiers' write-behind).
        self.on_commit: Callable[[str, list[Entry]], None] | None = None
        self._salt_bytes: dict[str, int] = {}
        self._salt_chunks: dict[str, int] = {}
        self._quotas: dict[str, int] = {}
        self._reservations: dict[int, Reservation] = {}
        self._leases: dict[int, Lease] = {}
        self._sessions: dict[str, Session] = {}
        # Per page: how many of its slots hold a pending or leased chunk (which pins the page).
        self._page_pinned: list[int] = [0] * allocator.num_pages
        self._deadlines: list[tuple[float, int, int]] = []  # (deadline, kind, id); kind 0 lease, 1 reservation
        self._next_id = 1 + secrets.randbits(48)  # ids differ from those of the instance before a restart
        self._chunks = 0
        self._pending = 0
        self._leased_chunks = 0
        self.hits = self.misses = self.bytes_stored = self.bytes_loaded = 0
        self.evictions = self.expired_leases = self.expired_reservations = self.full_reserves = 0

    # -- sessions -------------------------------------------------------------------------

    def touch(self, client: str, now: float, name: str = "") -> None:
        """Note that `client` is alive (any request or heartbeat); opens its session if new."""
        session = self._sessions.get(client)
        if session is None:
            if len(self._sessions) >= MAX_SESSIONS:
                raise TooManyError(
                    f"the server has {len(self._sessions)} client sessions, its limit; retry once some end",
                    limit=MAX_SESSIONS,
                )
            self._sessions[client] = Session(client, name, now)
            self._sharers += client in self._owner_bytes
            return
        session.last_seen = now
        if name:
            session.name = name

    def register(self, client: str, chunk_bytes: int, now: float) -> int:
        """Record the client's chunk size in bytes; returns its slot size. Opens the session."""
        slot_size = self.allocator.slot_size(chunk_bytes)
        self.touch(client, now)
        self._sessions[client].chunk_bytes = chunk_bytes
        return slot_size

    def is_registered(self, client: str) -> bool:
        session = self._sessions.get(client)
        return session is not None and session.chunk_bytes is not None

    def close_session(self, client: str) -> Reclaimed:
        """Give back everything `client` holds and forget it; a no-op for unknown clients."""
        session = self._sessions.pop(client, None)
        if session is None:
            return Reclaimed()
        self._sharers -= client in self._owner_bytes
        reservations, leases = list(session.reservations), list(session.leases)
        chunks = sum(self._abort(self._reservations[rid]) for rid in reservations)
        for lid in leases:
            self._drop_lease(self._leases[lid])
        return Reclaimed(len(reservations), len(leases), chunks)

    def clients(self) -> list[str]:
        return list(self._sessions)

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
        session = self._data_session(client, now)
        owner = client if owner is None else owner
        slot_size = self.allocator.slot_size(chunk_bytes)
        if len(session.reservations) >= MAX_RESERVATIONS_PER_CLIENT:
            raise TooManyError(
                f"client holds {len(session.reservations)} reservations; commit or abort some first",
                limit=MAX_RESERVATIONS_PER_CLIENT,
            )
        rid = self._new_id()
        reservation = Reservation(rid, client, salt, now + self.reservation_ttl, {})
        slots: list[tuple[int, int, int]] = []
        present: list[int] = []
        full = False
        for index, key in enumerate(keys):
            entry = self._entries.get((salt, key))
            if entry is not None:
                present.append(index)
                if entry.committed and not entry.leases:
                    self._order.drop(entry)
                    self._order.add(entry)
                continue
            if full:
                continue
            own = session.pending_bytes + slot_size
            if own > self.max_client_pending_bytes or (
                self._pending_bytes + slot_size > self.max_pending_bytes and own > self.client_pending_floor
            ):
                full = True
                continue
            offset = self._place(salt, slot_size, owner)
            if offset is None:
                full = True
                continue
            entry = Entry(salt, key, offset, chunk_bytes, slot_size, owner)
            self._own(owner, slot_size)
            self._entries[(salt, key)] = entry
            self._by_offset[offset] = entry
            self._salt_bytes[salt] = self._salt_bytes.get(salt, 0) + slot_size
            self._pending += 1
            self._page_pinned[offset // self.allocator.page_size] += 1
            session.pending_bytes += slot_size
            self._pending_bytes += slot_size
            reservation.pending[index] = entry
            self.headers.writing(offset, salt, key, chunk_bytes)
            slots.append((index, offset + SLOT_HEADER_BYTES, chunk_bytes))
        if full:
            self.full_reserves += 1
        if not reservation.pending:
            return ReserveOutcome(0, slots, present, full)
        self._reservations[rid] = reservation
        session.reservations.add(rid)
        heapq.heappush(self._deadlines, (reservation.deadline, 1, rid))
        return ReserveOutcome(rid, slots, present, full)

    def commit(self, client: str, reservation_id: int, indices: Iterable[int] | None, now: float) -> int:
        """Make the reservation's chunks at `indices` (None = all) visible; returns how many.

        Indices that are not pending in this reservation are ignored. The reservation ends
        when nothing in it is pending any more.
        """
        session = self._data_session(client, now)
        reservation = self._reservations.get(reservation_id)
        if reservation is None or reservation.client != client:
            raise UnknownReservationError(
                f"reservation {reservation_id} is unknown, expired or finished; reserve the keys again",
                reservation_id=reservation_id,
            )
        chosen = list(reservation.pending) if indices is None else list(indices)
        committed: list[Entry] = []
        for index in chosen:
            entry = reservation.pending.pop(index, None)
            if entry is None:
                continue
            entry.committed = True
            self.headers.published(entry.offset)
            self._pending -= 1
            self._page_pinned[entry.offset // self.allocator.page_size] -= 1
            session.pending_bytes -= entry.slot_size
            self._pending_bytes -= entry.slot_size
            self._chunks += 1
            self._salt_chunks[entry.salt] = self._salt_chunks.get(entry.salt, 0) + 1
            self._order.add(entry)
            self.bytes_stored += entry.length
            committed.append(entry)
        if not reservation.pending:
            del self._reservations[reservation_id]
            session.reservations.discard(reservation_id)
        if self.on_commit is not None and committed:
            self.on_commit(client, committed)
        return len(committed)

    def abort(self, client: str, reservation_id: int) -> int:
        """Drop a reservation and free its pending slots; 0 when it is unknown (idempotent)."""
        reservation = self._reservations.get(reservation_id)
        if reservation is None or reservation.client != client:
            return 0
        return self._abort(reservation)

    # -- retrieve -------------------------------------------------------------------------

    def prefix_lengths(self, items: Sequence[tuple[str, Sequence[bytes]]]) -> list[int]:
        """Per item, how many of its first keys are committed; changes nothing."""
        return [len(self._prefix(salt, keys)) for salt, keys in items]

    def _prefix(self, salt: str, keys: Sequence[bytes]) -> list[Entry]:
        """The committed chunks of `keys`' longest committed prefix."""
        hits: list[Entry] = []
        for key in keys:
            entry = self._entries.get((salt, key))
            if entry is None or not entry.committed:
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
        session = self._data_session(client, now, need_layout=False)
        if (total := sum(len(keys) for _, keys in items)) > MAX_KEYS_PER_REQUEST:
            raise ServerArgumentError(f"{total} keys in one lookup; send at most {MAX_KEYS_PER_REQUEST}", count=total)
        if len(self._leases) + len(items) > MAX_LEASES:
            raise TooManyError(
                f"the server holds {len(self._leases)} leases, its limit; retry once clients release some",
                limit=MAX_LEASES,
            )
        if len(session.leases) + len(items) > MAX_LEASES_PER_CLIENT:
            raise TooManyError(
                f"client holds {len(session.leases)} leases; release some first", limit=MAX_LEASES_PER_CLIENT
            )
        results: list[LookupOutcome] = []
        for salt, keys in items:
            hits = self._prefix(salt, keys)
            if count:
                self.hits += len(hits)
                self.misses += len(keys) - len(hits)
            if not hits:
                results.append(LookupOutcome(0, 0, []))
                continue
            for entry in hits:
                if not entry.leases:
                    self._order.drop(entry)
                    self._leased_chunks += 1
                    self._page_pinned[entry.offset // self.allocator.page_size] += 1
                entry.leases += 1
                self.bytes_loaded += entry.length if count else 0
            lid = self._new_id()
            lease = Lease(lid, client, now + self.lease_ttl, hits)
            self._leases[lid] = lease
            session.leases.add(lid)
            heapq.heappush(self._deadlines, (lease.deadline, 0, lid))
            results.append(LookupOutcome(len(hits), lid, [(e.offset + SLOT_HEADER_BYTES, e.length) for e in hits]))
        return results

    def release(self, client: str, lease_ids: Iterable[int]) -> int:
        """End the client's leases; unknown or foreign ids are skipped. Returns how many ended."""
        released = 0
        for lid in lease_ids:
            lease = self._leases.get(lid)
            if lease is None or lease.client != client:
                continue
            self._drop_lease(lease)
            released += 1
        return released

    # -- administration -------------------------------------------------------------------

    def clear(self, salt: str | None = None, limit: int = CLEAR_SLICE) -> tuple[int, bool]:
        """Remove up to `limit` committed, unleased chunks (of `salt`, or all).

        Returns (removed, more): `more` when some are left. A large clear takes several
        requests, so that other clients are served in between.
        """
        victims = self._order.evictable(salt, limit + 1)
        for entry in victims[:limit]:
            self._remove(entry)
        return min(len(victims), limit), len(victims) > limit

    def set_quota(self, salt: str, max_bytes: int | None) -> dict[str, int]:
        """Limit the bytes `salt` may hold (None removes the limit); evicts its LRU chunks now."""
        if max_bytes is None:
            self._quotas.pop(salt, None)
            return dict(self._quotas)
        if max_bytes < 0:
            raise ServerArgumentError(f"quota must be >= 0 bytes, got {max_bytes}", max_bytes=max_bytes)
        self._quotas[salt] = max_bytes
        while self._salt_bytes.get(salt, 0) > max_bytes and (oldest := self._order.oldest_of_salt(salt)):
            self._evict(oldest)
        return dict(self._quotas)

    def quotas(self) -> dict[str, int]:
        return dict(self._quotas)

    def quota_of(self, salt: str) -> int | None:
        """The bytes `salt` may hold (None: no limit); one dict read, safe from the tiers' threads."""
        return self._quotas.get(salt, self.default_quota)

    def expire(self, now: float) -> Reclaimed:
        """End leases and reservations past their deadline and sessions silent too long."""
        leases = reservations = chunks = 0
        while self._deadlines and self._deadlines[0][0] <= now:
            _, kind, ident = heapq.heappop(self._deadlines)
            if kind == 0:
                lease = self._leases.get(ident)
                if lease is not None:
                    self._drop_lease(lease)
                    self.expired_leases += 1
                    leases += 1
            else:
                reservation = self._reservations.get(ident)
                if reservation is not None:
                    chunks += self._abort(reservation)
                    self.expired_reservations += 1
                    reservations += 1
        silent = [] if self.session_ttl == float("inf") else self._sessions.items()
        for client in [c for c, s in silent if now - s.last_seen > self.session_ttl]:
            gone = self.close_session(client)
            leases += gone.leases
            reservations += gone.reservations
            chunks += gone.chunks
        return Reclaimed(reservations, leases, chunks)

    def stats(self) -> IndexStats:
        return IndexStats(
            capacity_bytes=self.allocator.capacity,
            used_bytes=self.allocator.used_bytes,
            page_size=self.allocator.page_size,
            pages_total=self.allocator.num_pages,
            pages_free=self.allocator.free_pages,
            chunks=self._chunks,
            pending_chunks=self._pending,
            leased_chunks=self._leased_chunks,
            hits=self.hits,
            misses=self.misses,
            bytes_stored=self.bytes_stored,
            bytes_loaded=self.bytes_loaded,
            evictions=self.evictions,
            leases=len(self._leases),
            reservations=len(self._reservations),
            expired_leases=self.expired_leases,
            expired_reservations=self.expired_reservations,
            clients=len(self._sessions),
            full_reserves=self.full_reserves,
            salt_bytes=dict(self._salt_bytes),
            salt_chunks=dict(self._salt_chunks),
            quotas=dict(self._quotas),
        )

    # -- internals ------------------------------------------------------------------------

    def _new_id(self) -> int:
        ident = self._next_id
        self._next_id += 1
        return ident

    def _data_session(self, client: str, now: float, *, need_layout: bool = True) -> Session:
        session = self._sessions.get(client)
        if session is None or (need_layout and session.chunk_bytes is None):
            raise NotRegisteredError(
                "this client has not registered; send Register (layout, chunk_size, chunk_bytes) first",
                client=client,
            )
        session.last_seen = now
        return session

    def _place(self, salt: str, slot_size: int, owner: str) -> int | None:
        """A free slot for a new chunk of `salt`, evicting as the quota and LRU allow."""
        quota = self._quotas.get(salt, self.default_quota)
        if quota is not None:
            if slot_size > quota:
                return None
            while self._salt_bytes.get(salt, 0) + slot_size > quota:
                oldest = self._order.oldest_of_salt(salt)
                if oldest is None:
                    return None
                self._evict(oldest)
        while True:
            offset = self.allocator.allocate(slot_size)
            if offset is not None:
                return offset
            if self._over_share(owner, slot_size) and (own := self._order.oldest_of_owner(owner, slot_size)):
                self._evict(own)  # a client past its fair share makes room from its own chunks
            elif not self._make_room(slot_size):
                return None

    def _over_share(self, owner: str, slot_size: int) -> bool:
        """Whether `owner` holding one more slot passes its share of the pool: the pool split
        evenly among the clients with a session that hold chunks they stored."""
        held = self._owner_bytes.get(owner, 0)
        sharers = self._sharers + (0 if held and owner in self._sessions else 1)
        return sharers > 1 and held + slot_size > self.allocator.capacity // sharers

    def _own(self, owner: str, delta: int) -> None:
        """Count `delta` slot bytes to the client that stored them."""
        before = self._owner_bytes.get(owner, 0)
        after = before + delta
        if after:
            self._owner_bytes[owner] = after
        else:
            del self._owner_bytes[owner]
        if owner in self._sessions and bool(before) != bool(after):
            self._sharers += 1 if after else -1

    def _make_room(self, slot_size: int) -> bool:
        """Free a slot of `slot_size`: evict the oldest chunk of that size alone, or every chunk
        of the page (nothing pending or leased) whose most recently used chunk is older still.
        A page holding a chunk used just now goes only when every other choice is fresher."""
        oldest = self._order.oldest_of_size(slot_size)
        found = self._order.pages.oldest(self._page_pinned)
        if oldest is not None and (found is None or oldest.used <= found[0]):
            self._evict(oldest)
            return True
        if found is None:
            return False
        page = found[1]
        self._order.pages.reset(page, 0)  # first, so that no eviction below looks for the newest chunk
        for off in self.allocator.page_slots(page):
            resident = self._by_offset.get(off)
            if resident is not None:
                self._evict(resident)
        assert not self.allocator.page_used(page), "a reclaimed page kept a chunk"
        return True

    def _evict(self, entry: Entry) -> None:
        self._remove(entry)
        self.evictions += 1

    def _remove(self, entry: Entry) -> None:
        assert entry.committed, "only committed chunks are evicted or cleared"
        assert not entry.leases, "leased chunks are never evicted or cleared"
        self._order.drop(entry)
        self._chunks -= 1
        self._salt_chunks[entry.salt] -= 1
        if not self._salt_chunks[entry.salt]:
            del self._salt_chunks[entry.salt]
        self._free_slot(entry)
        page = entry.offset // self.allocator.page_size
        if entry.used == self._order.pages.newest(page):  # the page's stamp is its newest committed chunk's
            residents = (self._by_offset.get(off) for off in self.allocator.page_slots(page))
            self._order.pages.reset(page, max((e.used for e in residents if e and e.committed), default=0))

    def _free_slot(self, entry: Entry) -> None:
        del self._entries[(entry.salt, entry.key)]
        del self._by_offset[entry.offset]
        self._own(entry.owner, -entry.slot_size)
        self.allocator.free(entry.offset)
        self.headers.freed(entry.offset)
        left = self._salt_bytes[entry.salt] - entry.slot_size
        if left:
            self._salt_bytes[entry.salt] = left
        else:
            del self._salt_bytes[entry.salt]

    def _abort(self, reservation: Reservation) -> int:
        del self._reservations[reservation.id]
        session = self._sessions.get(reservation.client)
        if session is not None:
            session.reservations.discard(reservation.id)
        for entry in reservation.pending.values():
            self._pending -= 1
            self._pending_bytes -= entry.slot_size
            self._page_pinned[entry.offset // self.allocator.page_size] -= 1
            if session is not None:
                session.pending_bytes -= entry.slot_size
            self._free_slot(entry)
        return len(reservation.pending)

    def _drop_lease(self, lease: Lease) -> None:
        del self._leases[lease.id]
        session = self._sessions.get(lease.client)
        if session is not None:
            session.leases.discard(lease.id)
        for entry in lease.entries:
            entry.leases -= 1
            if not entry.leases:
                assert self._entries.get((entry.salt, entry.key)) is entry, "a leased chunk left the index"
                self._leased_chunks -= 1
                self._page_pinned[entry.offset // self.allocator.page_size] -= 1
                self._order.add(entry)

    def check(self) -> None:
        """Assert every invariant of the index and its allocator (for tests)."""
        self.allocator.check()
        used = 0
        spans = []
        for (salt, key), entry in self._entries.items():
            assert (entry.salt, entry.key) == (salt, key)
            assert self._by_offset[entry.offset] is entry
            assert self.allocator.page_slot_size(self.allocator.page_of(entry.offset)) == entry.slot_size
            assert entry.offset + entry.slot_size <= self.allocator.capacity
            assert (entry in self._order) == (entry.committed and not entry.leases)
            spans.append((entry.offset, entry.offset + entry.slot_size))
            used += entry.slot_size
        spans.sort()
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert end <= start, "two chunks share bytes"
        assert used == self.allocator.used_bytes == sum(self._salt_bytes.values())
        assert len(self._by_offset) == len(self._entries)
        assert self._pending == sum(len(r.pending) for r in self._reservations.values())
        assert self._pending_bytes == sum(e.slot_size for r in self._reservations.values() for e in r.pending.values())
        assert self._chunks == sum(1 for e in self._entries.values() if e.committed)
        assert self._leased_chunks == sum(1 for e in self._entries.values() if e.leases)
        pinned = [0] * self.allocator.num_pages
        for entry in self._entries.values():
            pinned[entry.offset // self.allocator.page_size] += not entry.committed or entry.leases > 0
        assert pinned == self._page_pinned
        self._order.pages.check((e.offset // self.allocator.page_size, e.used) for e in self._by_offset.values())
        self._order.check(self._chunks - self._leased_chunks)
        owners: dict[str, int] = {}
        for entry in self._entries.values():
            owners[entry.owner] = owners.get(entry.owner, 0) + entry.slot_size
        assert owners == self._owner_bytes
        assert self._sharers == sum(1 for c in self._sessions if c in self._owner_bytes)
        for lease in self._leases.values():
            assert lease.id in self._sessions[lease.client].leases
        for session in self._sessions.values():
            pending = [r for r in self._reservations.values() if r.client == session.client]
            assert session.pending_bytes == sum(e.slot_size for r in pending for e in r.pending.values())
        for reservation in self._reservations.values():
            assert reservation.pending
            assert reservation.id in self._sessions[reservation.client].reservations
