"""Client sessions and what each holds: reservations and leases, each with a deadline.

Pure bookkeeping, like the index that owns it: it knows which client holds which
reservation or lease and when each expires, and bounds how much one client (and all of them)
may hold. What a reservation or lease does to chunks is the index's business.
"""

from __future__ import annotations

import heapq
import secrets
from collections.abc import Iterator

from kvdepot.server._errors import NotRegisteredError, TooManyError
from kvdepot.server._records import Entry, Lease, Reservation, Session
from kvdepot.transport import RESERVED_CLIENT_PREFIX

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
# Live leases of all clients together: a bound on the index's memory for leases.
MAX_LEASES = 1 << 18
# Client sessions at once: a bound on the index's memory for sessions, however many peers connect.
MAX_SESSIONS = 4096

_LEASE, _RESERVATION = 0, 1  # kinds in the deadline heap


class Sessions:
    """The live client sessions, reservations and leases, and their deadlines."""

    def __init__(
        self,
        *,
        lease_ttl: float,
        reservation_ttl: float,
        session_ttl: float,
        max_client_pending_bytes: int,
        max_pending_bytes: int,
        client_pending_floor: int,
        max_pending_with_floors: int | None = None,
    ) -> None:
        self.lease_ttl = lease_ttl
        self.reservation_ttl = reservation_ttl
        self.session_ttl = session_ttl
        self.max_client_pending_bytes = max_client_pending_bytes
        self.max_pending_bytes = max_pending_bytes
        self.client_pending_floor = client_pending_floor
        #: Pending bytes of all clients at most, floors included (None: no bound past the floors).
        self.max_pending_with_floors = max_pending_with_floors
        self.pending_bytes = 0  # slot bytes of every reservation's pending chunks
        self.reservations: dict[int, Reservation] = {}
        self.leases: dict[int, Lease] = {}
        self._sessions: dict[str, Session] = {}
        self._deadlines: list[tuple[float, int, int]] = []  # (deadline, kind, id)
        self._next_id = 1 + secrets.randbits(48)  # ids differ from those of the instance before a restart

    def __contains__(self, client: object) -> bool:
        return client in self._sessions

    def __len__(self) -> int:
        return len(self._sessions)

    def clients(self) -> list[str]:
        return list(self._sessions)

    def session_of(self, client: str) -> Session | None:
        return self._sessions.get(client)

    def outside_clients(self) -> int:
        """Sessions of clients, not of the server's own reserved ids."""
        return sum(not client.startswith(RESERVED_CLIENT_PREFIX) for client in self._sessions)

    # -- sessions -------------------------------------------------------------------------

    def touch(self, client: str, now: float, name: str = "") -> bool:
        """Note that `client` is alive; opens its session if new and returns whether it did."""
        session = self._sessions.get(client)
        if session is None:
            if len(self._sessions) >= MAX_SESSIONS:
                raise TooManyError(
                    f"the server has {len(self._sessions)} client sessions, its limit; retry once some end",
                    limit=MAX_SESSIONS,
                )
            self._sessions[client] = Session(client, name, now)
            return True
        session.last_seen = now
        if name:
            session.name = name
        return False

    def register(self, client: str, chunk_bytes: int) -> None:
        self._sessions[client].chunk_bytes = chunk_bytes

    def is_registered(self, client: str) -> bool:
        session = self._sessions.get(client)
        return session is not None and session.chunk_bytes is not None

    def active(self, client: str, now: float, *, need_layout: bool = True) -> Session:
        """The session of a client that sends data requests; `NotRegisteredError` without one."""
        session = self._sessions.get(client)
        if session is None or (need_layout and session.chunk_bytes is None):
            raise NotRegisteredError(
                "this client has not registered; send Register (layout, chunk_size, chunk_bytes) first",
                client=client,
            )
        session.last_seen = now
        return session

    def close(self, client: str) -> tuple[list[Reservation], list[Lease]] | None:
        """Forget `client`; returns the reservations and leases it still held (None: unknown)."""
        session = self._sessions.pop(client, None)
        if session is None:
            return None
        return [self.reservations[r] for r in session.reservations], [self.leases[lid] for lid in session.leases]

    def silent(self, now: float) -> list[str]:
        """The clients not heard from for longer than the session TTL."""
        if self.session_ttl == float("inf"):
            return []
        return [
            c
            for c, s in self._sessions.items()
            if now - s.last_seen > self.session_ttl and not c.startswith(RESERVED_CLIENT_PREFIX)
        ]

    # -- reservations ---------------------------------------------------------------------

    def new_reservation(self, session: Session, salt: str, now: float, ttl: float | None = None) -> Reservation:
        """A reservation for `session` to fill, not yet held (`hold` it once it has chunks);
        ``ttl`` overrides the seconds it may stay uncommitted."""
        if len(session.reservations) >= MAX_RESERVATIONS_PER_CLIENT:
            raise TooManyError(
                f"client holds {len(session.reservations)} reservations; commit or abort some first",
                limit=MAX_RESERVATIONS_PER_CLIENT,
            )
        # The server's own sessions (no peer may take their ids) end their reservations
        # themselves: a tier read fills its slots from another thread until it settles, so
        # slots freed by expiry under it could be handed to another client and overwritten.
        if ttl is None:
            ttl = float("inf") if session.client.startswith(RESERVED_CLIENT_PREFIX) else self.reservation_ttl
        return Reservation(self._new_id(), session.client, salt, now + ttl, {})

    def may_pend(self, session: Session, slot_size: int) -> bool:
        """Whether `session` may hold one more pending slot of `slot_size` bytes."""
        own = session.pending_bytes + slot_size
        if own > self.max_client_pending_bytes:
            return False
        total = self.pending_bytes + slot_size
        if total <= self.max_pending_bytes:
            return True
        return own <= self.client_pending_floor and (
            self.max_pending_with_floors is None or total <= self.max_pending_with_floors
        )

    def pend(self, session: Session | None, slot_size: int) -> None:
        """Count `slot_size` pending bytes (negative: no longer pending) to `session` and to all."""
        self.pending_bytes += slot_size
        if session is not None:
            session.pending_bytes += slot_size

    def hold(self, session: Session, reservation: Reservation) -> None:
        self.reservations[reservation.id] = reservation
        session.reservations.add(reservation.id)
        if reservation.deadline != float("inf"):  # one that never expires would never leave the heap
            heapq.heappush(self._deadlines, (reservation.deadline, _RESERVATION, reservation.id))

    def reservation(self, client: str, reservation_id: int) -> Reservation | None:
        """The live reservation `reservation_id` of `client`; None if unknown or another's."""
        reservation = self.reservations.get(reservation_id)
        return reservation if reservation is not None and reservation.client == client else None

    def end_reservation(self, reservation: Reservation) -> Session | None:
        """Forget `reservation`; returns its client's session, None once that ended."""
        del self.reservations[reservation.id]
        session = self._sessions.get(reservation.client)
        if session is not None:
            session.reservations.discard(reservation.id)
        return session

    # -- leases ---------------------------------------------------------------------------

    def check_lease_room(self, session: Session, count: int) -> None:
        """Refuse `count` more leases past the server's or the client's bound."""
        if len(self.leases) + count > MAX_LEASES:
            raise TooManyError(
                f"the server holds {len(self.leases)} leases, its limit; retry once clients release some",
                limit=MAX_LEASES,
            )
        if len(session.leases) + count > MAX_LEASES_PER_CLIENT:
            raise TooManyError(
                f"client holds {len(session.leases)} leases; release some first", limit=MAX_LEASES_PER_CLIENT
            )

    def new_lease(self, session: Session, entries: list[Entry], now: float, ttl: float | None = None) -> Lease:
        """A lease of `entries` for `ttl` seconds (the lease TTL when None)."""
        lease = Lease(self._new_id(), session.client, now + (self.lease_ttl if ttl is None else ttl), entries)
        self.leases[lease.id] = lease
        session.leases.add(lease.id)
        heapq.heappush(self._deadlines, (lease.deadline, _LEASE, lease.id))
        return lease

    def lease(self, client: str, lease_id: int) -> Lease | None:
        """The live lease `lease_id` of `client`; None if unknown or another's."""
        lease = self.leases.get(lease_id)
        return lease if lease is not None and lease.client == client else None

    def end_lease(self, lease: Lease) -> None:
        del self.leases[lease.id]
        session = self._sessions.get(lease.client)
        if session is not None:
            session.leases.discard(lease.id)

    # -- expiry ---------------------------------------------------------------------------

    def due(self, now: float) -> Iterator[Lease | Reservation]:
        """The live leases and reservations whose deadline passed, earliest first.

        The caller ends each one before taking the next.
        """
        while self._deadlines and self._deadlines[0][0] <= now:
            _, kind, ident = heapq.heappop(self._deadlines)
            held = self.leases.get(ident) if kind == _LEASE else self.reservations.get(ident)
            if held is not None:
                yield held

    def _new_id(self) -> int:
        ident = self._next_id
        self._next_id += 1
        return ident

    def check(self) -> None:
        """Assert that sessions, reservations and leases agree (for tests)."""
        for lease in self.leases.values():
            assert lease.id in self._sessions[lease.client].leases
        by_client: dict[str, list[Reservation]] = {}
        for reservation in self.reservations.values():
            assert reservation.pending, "a reservation with nothing pending was kept"
            assert reservation.id in self._sessions[reservation.client].reservations
            by_client.setdefault(reservation.client, []).append(reservation)
        for session in self._sessions.values():
            held = by_client.get(session.client, ())
            assert session.pending_bytes == sum(e.slot_size for r in held for e in r.pending.values())
        assert self.pending_bytes == sum(e.slot_size for r in self.reservations.values() for e in r.pending.values())
