"""`DictHandler`: a small, complete handler over a dict, for tests and examples.

It follows the protocol's semantics (longest committed prefix, leases, reservations,
quotas) without a real pool: slots are offsets in an imaginary file. It is no model for a
server's memory management, only for the protocol's behaviour.
"""

from __future__ import annotations

import itertools
import threading
import uuid

from kvdepot.transport._errors import NotRegisteredError, UnknownLeaseError, UnknownReservationError
from kvdepot.transport._handler import PeerInfo
from kvdepot.transport._messages import (
    PROTOCOL_VERSION,
    Abort,
    AbortReply,
    Change,
    Changes,
    ChangesReply,
    Clear,
    ClearReply,
    Commit,
    CommitReply,
    EndSession,
    EndSessionReply,
    GetQuotas,
    Hello,
    HelloReply,
    Lookup,
    LookupReply,
    LookupResult,
    PoolInfo,
    Query,
    QueryReply,
    QueryResult,
    QuotaReply,
    Register,
    RegisterReply,
    Release,
    ReleaseReply,
    ReplyBody,
    RequestBody,
    Reserve,
    ReservedSlot,
    ReserveReply,
    SetQuota,
    Slot,
    Stats,
    StatsReply,
)


class DictHandler:
    """Answers every request from plain dicts; records what it saw for assertions.

    `gate`, when set to an unset `threading.Event`, makes the handler wait on it (up to
    `gate_timeout` seconds) before answering a request whose type is in `gated`: a way to
    hold a reply back in deadline tests.
    """

    def __init__(self, *, server_version: str = "test", chunk_size: int = 256, pool_size: int = 1 << 30) -> None:
        self.server_version = server_version
        self.server_id = f"dict-{uuid.uuid4().hex}"  # unique per instance, like a server process
        self.chunk_size = chunk_size
        self.pool_size = pool_size
        self.chunks: dict[tuple[str, bytes], Slot] = {}
        self.leases: dict[int, str] = {}
        self.reservations: dict[int, tuple[str, str, list[bytes], dict[int, Slot]]] = {}
        self.registered: dict[str, Register] = {}
        self.quotas: dict[str, int] = {}
        self.changes: list[tuple[bool, str, bytes]] = []  # change n is changes[n - 1]
        self.seen: list[tuple[str, RequestBody]] = []
        self.gone: list[str] = []
        self.gate: threading.Event | None = None
        self.gated: tuple[type, ...] = (Stats,)
        self.gate_timeout = 10.0
        self._ids = itertools.count(1)
        self._offset = 0
        self.lock = threading.Lock()

    def handle(self, peer: PeerInfo, body: RequestBody) -> ReplyBody:
        with self.lock:
            self.seen.append((peer.client_id, body))
        if self.gate is not None and isinstance(body, self.gated):
            self.gate.wait(self.gate_timeout)
        method = getattr(self, "_" + type(body).__name__.lower())
        reply: ReplyBody = method(peer, body)
        return reply

    def peer_gone(self, peer: PeerInfo) -> None:
        with self.lock:
            self.gone.append(peer.client_id)
        self._drop(peer.client_id)

    def seen_types(self, client_id: str | None = None) -> list[str]:
        """Names of the request types seen (of one client), in order."""
        with self.lock:
            return [type(b).__name__ for c, b in self.seen if client_id is None or c == client_id]

    # -- operations ----------------------------------------------------------------------

    def _drop(self, client_id: str) -> None:
        for lease_id in [k for k, v in self.leases.items() if v == client_id]:
            del self.leases[lease_id]
        for rid in [k for k, v in self.reservations.items() if v[0] == client_id]:
            del self.reservations[rid]

    def _hello(self, peer: PeerInfo, body: Hello) -> HelloReply:
        return HelloReply(PROTOCOL_VERSION, self.server_version, self.server_id)

    def _register(self, peer: PeerInfo, body: Register) -> RegisterReply:
        self.registered[peer.client_id] = body
        return RegisterReply(self.chunk_size, PoolInfo("shm_file", "/dev/shm/kvdepot-test", self.pool_size), 64)  # noqa: S108 (never opened)

    def _need_registered(self, peer: PeerInfo) -> None:
        if peer.client_id not in self.registered:
            raise NotRegisteredError("send Register before this request", client_id=peer.client_id)

    def _lookup(self, peer: PeerInfo, body: Lookup) -> LookupReply:
        self._need_registered(peer)
        results = []
        for item in body.items:
            slots = []
            for key in item.keys:
                slot = self.chunks.get((item.salt, key))
                if slot is None:
                    break
                slots.append(slot)
            lease_id = 0
            if slots:
                lease_id = next(self._ids)
                self.leases[lease_id] = peer.client_id
            results.append(LookupResult(len(slots), lease_id, slots))
        return LookupReply(results)

    def _reserve(self, peer: PeerInfo, body: Reserve) -> ReserveReply:
        self._need_registered(peer)
        pending = {k for r in self.reservations.values() if r[1] == body.salt for k in r[2]}
        present, slots, placed = [], [], {}
        for index, key in enumerate(body.keys):
            if (body.salt, key) in self.chunks or key in pending:
                present.append(index)
                continue
            slot = Slot(self._offset, body.chunk_bytes)
            self._offset += body.chunk_bytes
            placed[index] = slot
            slots.append(ReservedSlot(index, slot.offset, slot.length))
        rid = next(self._ids)
        self.reservations[rid] = (peer.client_id, body.salt, list(body.keys), placed)
        return ReserveReply(rid, slots, present, False)

    def _commit(self, peer: PeerInfo, body: Commit) -> CommitReply:
        res = self.reservations.pop(body.reservation_id, None)
        if res is None:
            raise UnknownReservationError("no such reservation", reservation_id=body.reservation_id)
        _, salt, keys, placed = res
        indices = placed.keys() if body.indices is None else [i for i in body.indices if i in placed]
        for index in indices:
            self.chunks[(salt, keys[index])] = placed[index]
            self.changes.append((True, salt, keys[index]))
        return CommitReply(len(list(indices)))

    def _abort(self, peer: PeerInfo, body: Abort) -> AbortReply:
        res = self.reservations.pop(body.reservation_id, None)
        if res is None:
            raise UnknownReservationError("no such reservation", reservation_id=body.reservation_id)
        return AbortReply(len(res[3]))

    def _release(self, peer: PeerInfo, body: Release) -> ReleaseReply:
        unknown = [i for i in body.lease_ids if i not in self.leases]
        if unknown:
            raise UnknownLeaseError("unknown lease", lease_id=unknown[0])
        for lease_id in body.lease_ids:
            del self.leases[lease_id]
        return ReleaseReply(len(body.lease_ids))

    def _endsession(self, peer: PeerInfo, body: EndSession) -> EndSessionReply:
        self._drop(peer.client_id)
        self.registered.pop(peer.client_id, None)
        return EndSessionReply()

    def _stats(self, peer: PeerInfo, body: Stats) -> StatsReply:
        return StatsReply(
            capacity_bytes=self.pool_size,
            chunks=len(self.chunks),
            leases=len(self.leases),
            reservations=len(self.reservations),
            clients=len(self.registered),
        )

    def _clear(self, peer: PeerInfo, body: Clear) -> ClearReply:
        doomed = [k for k in self.chunks if body.salt is None or k[0] == body.salt]
        for k in doomed:
            del self.chunks[k]
            self.changes.append((False, *k))
        return ClearReply(len(doomed))

    def _setquota(self, peer: PeerInfo, body: SetQuota) -> QuotaReply:
        if body.max_bytes is None:
            self.quotas.pop(body.salt, None)
        else:
            self.quotas[body.salt] = body.max_bytes
        return QuotaReply(dict(self.quotas))

    def _getquotas(self, peer: PeerInfo, body: GetQuotas) -> QuotaReply:
        return QuotaReply(dict(self.quotas))

    def _query(self, peer: PeerInfo, body: Query) -> QueryReply:
        results = []
        for item in body.items:
            held = 0
            while held < len(item.keys) and (item.salt, item.keys[held]) in self.chunks:
                held += 1
            results.append(QueryResult(held))
        return QueryReply(results)

    def _changes(self, peer: PeerInfo, body: Changes) -> ChangesReply:
        head = len(self.changes) + 1
        if body.since == 0:
            return ChangesReply([], head)
        if body.since > head or body.server_id not in ("", self.server_id):
            return ChangesReply([], head, lost=True)
        index = {salt: i for i, salt in enumerate(body.salts)}
        end = min(head, body.since + body.limit)
        window = self.changes[body.since - 1 : end - 1]
        return ChangesReply([Change(s, index[salt], k) for s, salt, k in window if salt in index], end)

    def __repr__(self) -> str:
        return f"DictHandler(chunks={len(self.chunks)}, leases={len(self.leases)})"
