"""The protocol handler: request bodies from `kvdepot.transport` in, reply bodies out.

It translates messages to `ChunkIndex` calls and back, and nothing else. The endpoint has
already decoded and bounded the frame and checked Hello; exceptions raised here become
`ErrorReply`s through their `code`. After each request it hands the index's events to the
tiers (`flush_events`), so that a chunk a request committed is pinned for the write-behind
before the next request can evict it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvdepot.core import SaltLabeler
from kvdepot.server._change_log import CHANGE_WORK_BYTES, ChangeLog
from kvdepot.server._errors import AdminRefusedError, LayoutConflictError, ServerArgumentError, StalePoolError
from kvdepot.server._events import EventConsumer
from kvdepot.server._index import MAX_KEYS_PER_REQUEST, ChunkIndex
from kvdepot.server._label_key import random_labeler
from kvdepot.server._ranking import SaltRanking
from kvdepot.server._results import IndexStats, LookupOutcome, Reclaimed
from kvdepot.server._settings_file import SettingsFile
from kvdepot.server._slabs import SLOT_ALIGNMENT
from kvdepot.server._tiering import ClearAnswer, QueryAnswer
from kvdepot.server._version import __version__
from kvdepot.transport import get_logger

if TYPE_CHECKING:
    from kvdepot.server._tiering import Answer, TierSet
from kvdepot.transport import (
    PROTOCOL_VERSION,
    Abort,
    AbortReply,
    Changes,
    Clear,
    ClearReply,
    Commit,
    CommitReply,
    Deferred,
    EndSession,
    EndSessionReply,
    GetQuotas,
    Hello,
    HelloReply,
    Lookup,
    LookupReply,
    LookupResult,
    PeerInfo,
    Ping,
    Pong,
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
    error_reply_from,
)

log = get_logger(__name__)


#: Layout names whose fingerprints the server remembers. Past this many it starts over, so a
#: stream of names cannot grow its memory; a conflict is then caught again once both re-register.
MAX_LAYOUTS = 4096
# Salts listed in a Stats reply (the largest by bytes; `extra["salts"]` counts them all).
MAX_STATS_SALTS = 1000
#: With more salts than a reply lists, which ones are the largest is worked out (O(salts)) at
#: most this often (seconds); their figures are always current. A peer that asks for Stats in
#: a loop so costs the loop O(listed salts) per request, not O(salts).
SALT_RANKING_S = 1.0


class CacheHandler:
    """Answers every request of the kvdepot protocol from a `ChunkIndex` and its pool."""

    def __init__(
        self,
        index: ChunkIndex,
        *,
        pool_path: str,
        pool_size: int,
        chunk_size: int,
        slot_index: tuple[str, int, bool] | None = None,
        server_id: str = "",
        clock: Callable[[], float] = time.monotonic,
        tiers: TierSet | None = None,
        extra_stats: Callable[[], dict[str, str | int | float | bool | None]] = dict,
        client_connected: Callable[[str], bool] = lambda client: False,
        admin_allowed: bool = True,
        labeler: SaltLabeler | None = None,
        consumers: Sequence[EventConsumer] = (),
        timed: Callable[[str, float], None] | None = None,
        looked_up: Callable[[Sequence[tuple[str, Sequence[bytes]]], Sequence[LookupOutcome]], None] | None = None,
        settings: SettingsFile | None = None,
    ) -> None:
        """``slot_index``: the path and size of the pool's slot index in shared memory, and
        whether it holds every chunk a lookup could hit (`HelloReply.slot_index`); ``tiers``: the
        tiers below RAM, if any (lookups that miss RAM ask them, commits are written behind to them);
        ``extra_stats``: figures the server adds to Stats (pool path,
        transport counters); ``client_connected``: whether another live connection still speaks
        for a client id; ``admin_allowed``: whether every peer is the owner (an owner-only ipc
        socket, or tcp with a shared secret), so that Clear and SetQuota may be served, Stats may name salts
        and Hello hands out the label key; ``labeler``: how Stats to others and logs name a salt (the
        server's, whose key its owner's engines get in `HelloReply.label_key`; default: a key of its own);
        ``consumers``: take the index's events too, after the change log and the tiers (the
        server's metrics and its KV event publisher); ``timed``:
        told each request's type name and the seconds it took; ``looked_up``: told each lookup
        answered and its outcomes (the server's metrics); ``settings``: where quota changes are
        written before they take effect (default: nowhere, they end with the process)."""
        self.index = index
        # layout name -> (fingerprint, chunk bytes) of the first client that registered it
        self.layouts: dict[str, tuple[str, int]] = {}
        self.pool_info = PoolInfo(kind="shm_file", path=pool_path, size=pool_size)
        self.slot_index = (
            None if slot_index is None else PoolInfo(kind="shm_file", path=slot_index[0], size=slot_index[1])
        )
        self.slot_index_complete = slot_index is not None and slot_index[2]
        self.chunk_size = chunk_size
        self.server_id = server_id
        self.reclaimed_leases = 0
        self.reclaimed_reservations = 0
        self.clock = clock
        self.extra_stats = extra_stats
        self.client_connected = client_connected
        self.admin_allowed = admin_allowed
        self.label = labeler if labeler is not None else random_labeler()
        self.tiers = tiers
        self.changes = ChangeLog(server_id)
        # Every taker of the index's events, in order: the change log, the tiers, then the others.
        self.consumers: tuple[EventConsumer, ...] = (self.changes, *(() if tiers is None else (tiers,)), *consumers)
        self.timed = timed
        self.looked_up = looked_up
        self.settings = settings if settings is not None else SettingsFile(None)
        self._ranking = SaltRanking(index, SALT_RANKING_S)
        self._table: dict[type, Callable[[str, Any, float], ReplyBody | Deferred]] = {
            Hello: self._hello,
            Register: self._register,
            Lookup: self._lookup,
            Reserve: self._reserve,
            Commit: self._commit,
            Abort: self._abort,
            Release: self._release,
            EndSession: self._end_session,
            Stats: self._stats,
            Clear: self._clear,
            Ping: self._ping,
            SetQuota: self._set_quota,
            GetQuotas: self._get_quotas,
            Query: self._query,
            Changes: self._changes,
        }

    # -- transport.Handler ----------------------------------------------------------------

    def handle(self, peer: PeerInfo, body: RequestBody) -> ReplyBody | Deferred:
        start = time.perf_counter()
        try:
            return self._table[type(body)](peer.client_id, body, self.clock())
        finally:
            self.flush_events()
            if self.timed is not None:
                self.timed(type(body).__name__, time.perf_counter() - start)

    def work(self, body: RequestBody) -> int:
        """Bytes of its message's budget a request uses beyond its frame (`kvdepot.transport.Handler`):
        a `Changes` costs `CHANGE_WORK_BYTES` per change it reads (its limit asks for up to 16,384
        with a frame of 40 bytes), so a message of them is bounded like a message of lookups."""
        if isinstance(body, Changes):
            return self.changes.span(body.since, body.limit, body.server_id) * CHANGE_WORK_BYTES
        return 0

    def flush_events(self) -> None:
        """Hand what happened in the index to its consumers (loop thread: after every request,
        and after every pass of the server's own work)."""
        events = self.index.take_events()
        if not events:
            return
        for consumer in self.consumers:
            consumer.take(events)

    def answer(self, answer: Answer) -> ReplyBody:
        """The reply to a lookup the tiers are done with: from RAM, as it stands now (a Query:
        what RAM held when it came, and what the tiers hold past that)."""
        if isinstance(answer, ClearAnswer):
            cleared = answer.cleared
            return ClearReply(
                removed=cleared.removed,
                left=self.index.visible_chunks(cleared.salt),
                tiers=cleared.tiers,
                tier_errors=cleared.errors,
            )
        if isinstance(answer, QueryAnswer):
            return QueryReply([QueryResult(ram, below, tiers) for ram, below, tiers in answer.held])
        try:
            return self.lookup_reply(answer.client, answer.items, self.clock(), answer.read_back)
        except Exception as exc:  # the client left meanwhile, or its leases are at their limit
            return error_reply_from(exc)

    def peer_gone(self, peer: PeerInfo) -> None:
        if self.client_connected(peer.client_id):
            # An old connection of a client that is still here under another identity.
            log.info("stale_connection_dropped", peer=peer.client_id)
            return
        gone = self.index.close_session(peer.client_id, self.clock())
        self._count_reclaimed(gone)
        log.info(
            "client_reclaimed",
            peer=peer.client_id,
            client_name=peer.client_name,
            leases=gone.leases,
            reservations=gone.reservations,
            chunks=gone.chunks,
        )

    # -- one method per request -----------------------------------------------------------

    def _hello(self, client: str, body: Hello, now: float) -> ReplyBody:
        self.index.touch(client, now, body.client_name)
        return HelloReply(
            protocol_version=PROTOCOL_VERSION,
            server_version=__version__,
            server_id=self.server_id,
            label_key=self.label.key if self.admin_allowed else b"",  # an engine names salts as /metrics does
            slot_index=self.slot_index if self.admin_allowed else None,
            slot_index_complete=self.slot_index_complete and self.admin_allowed,
        )

    def _register(self, client: str, body: Register, now: float) -> ReplyBody:
        held = self.layouts.get(body.layout)
        if body.fingerprint and held is not None and held != (body.fingerprint, body.chunk_bytes):
            raise LayoutConflictError(
                f"layout {body.layout!r} is held here with fingerprint {held[0]!r} and {held[1]} bytes per chunk; "
                f"this client has {body.fingerprint!r} and {body.chunk_bytes}: their chunks would mix bytes of "
                "different layouts. Give one of them another layout name (another model, backend or KV layout "
                "setting), or another server",
                layout=body.layout,
                expected=held[0],
                got=body.fingerprint,
            )
        slot_size = self.index.register(client, body.chunk_bytes, now)
        if body.fingerprint and held is None:
            if len(self.layouts) >= MAX_LAYOUTS:
                self.layouts.clear()  # bounded: a stream of layout names cannot grow it without limit
            self.layouts[body.layout] = (body.fingerprint, body.chunk_bytes)
        log.info(
            "client_registered",
            peer=client,
            layout=body.layout,
            chunk_bytes=body.chunk_bytes,
            slot_size=slot_size,
            kv_rank=body.kv_rank,
            kv_world_size=body.kv_world_size,
        )
        return RegisterReply(
            chunk_size=body.chunk_size or self.chunk_size,
            pool=self.pool_info,
            slot_alignment=SLOT_ALIGNMENT,
            reservation_ttl_s=self.index.sessions.reservation_ttl,
        )

    def _lookup(self, client: str, body: Lookup, now: float) -> ReplyBody | Deferred:
        items: list[tuple[str, Sequence[bytes]]] = [(item.salt, item.keys) for item in body.items]
        tiers = self.tiers
        if tiers is not None and (deferred := tiers.lookup(client, items, now, body.prefill_s_per_chunk)) is not None:
            return deferred  # answered with lookup_reply once the lower tiers are done
        return self.lookup_reply(client, items, now)

    def lookup_reply(
        self,
        client: str,
        items: list[tuple[str, Sequence[bytes]]],
        now: float,
        read_back: list[dict[int, str]] | None = None,
    ) -> LookupReply:
        """Lease the committed prefix of each item, and say where its chunks are; ``read_back``
        (a lookup the tiers answered) says which keys were just read back from which tier."""
        outcomes = self.index.lookup(client, items, now)
        if self.looked_up is not None:
            self.looked_up(items, outcomes)
        results = []
        for item, o in enumerate(outcomes):
            below: dict[str, int] = {}
            for i, kind in (read_back[item] if read_back else {}).items():
                if i < o.num_hits:
                    below[kind] = below.get(kind, 0) + 1
            results.append(LookupResult(o.num_hits, o.lease_id, [Slot(off, n) for off, n in o.slots], below))
        return LookupReply(results=results)

    def _same_instance(self, body: Reserve | Commit | Abort | Release) -> None:
        """Refuses a request meant for another instance of this server (one before a restart)."""
        if body.server_id and body.server_id != self.server_id:
            what = type(body).__name__.lower()
            raise StalePoolError(
                f"this {what} is for server {body.server_id}, but this is server {self.server_id}: the server "
                "restarted, and what the old one granted died with it; map the pool from the Register reply "
                "of this server first",
                expected=self.server_id,
                got=body.server_id,
            )

    def _reserve(self, client: str, body: Reserve, now: float) -> ReplyBody:
        self._same_instance(body)
        out = self.index.reserve(client, body.salt, body.keys, body.chunk_bytes, now)
        return ReserveReply(
            reservation_id=out.reservation_id,
            slots=[ReservedSlot(i, offset, length) for i, offset, length in out.slots],
            present=out.present,
            full=out.full,
        )

    def _commit(self, client: str, body: Commit, now: float) -> ReplyBody:
        self._same_instance(body)
        committed = self.index.commit(client, body.reservation_id, body.indices, now, pin_s=body.pin_s)
        return CommitReply(committed=committed)

    def _abort(self, client: str, body: Abort, now: float) -> ReplyBody:
        self._same_instance(body)
        return AbortReply(freed=self.index.abort(client, body.reservation_id))

    def _release(self, client: str, body: Release, now: float) -> ReplyBody:
        self._same_instance(body)
        return ReleaseReply(released=self.index.release(client, body.lease_ids))

    def _end_session(self, client: str, body: EndSession, now: float) -> ReplyBody:
        gone = self.index.close_session(client, now)
        self._count_reclaimed(gone)
        log.info("client_left", peer=client, leases=gone.leases, reservations=gone.reservations)
        return EndSessionReply()

    def _count_reclaimed(self, gone: Reclaimed) -> None:
        # Leases and reservations a client still held when it left or went silent: a client
        # that releases everything it takes leaves these at zero.
        self.reclaimed_leases += gone.leases
        self.reclaimed_reservations += gone.reservations

    def _stats(self, client: str, body: Stats, now: float) -> ReplyBody:
        extra = {
            **self.extra_stats(),
            "reclaimed_leases": self.reclaimed_leases,
            "reclaimed_reservations": self.reclaimed_reservations,
        }
        stats = self.index.stats(self._ranking.listed(MAX_STATS_SALTS, now))
        # A salt is a tenant's secret: a peer that may not be the owner sees it as /metrics names it.
        return stats_reply(stats, extra, name=str if self.admin_allowed else self.label)

    def _check_admin(self, client: str, request: str) -> None:
        if not self.admin_allowed:
            log.warning("admin_refused", peer=client, request=request)
            raise AdminRefusedError(
                f"{request} changes what every tenant has; this server listens on tcp without a shared secret, "
                "so anyone on this host could send it. Send it over the server's ipc socket, or start the server "
                "with --auth-secret-file",
                request=request,
            )

    def _clear(self, client: str, body: Clear, now: float) -> ReplyBody | Deferred:
        """A slice of RAM; with `tiers`, the writes queued for the salt first (which unpins them),
        and once RAM holds none left to remove, every tier below (answered when they are done)."""
        self._check_admin(client, "clear")
        tiers = self.tiers if body.tiers else None
        if tiers is not None:
            tiers.discard(body.salt)
        removed, more = self.index.clear(body.salt)
        label = "*" if body.salt is None else self.label(body.salt)
        log.info("chunks_cleared", peer=client, salt=label, removed=removed, more=more, tiers=body.tiers)
        if more:
            return ClearReply(removed=removed, more=True)
        if tiers is None:
            return ClearReply(removed=removed, left=self.index.visible_chunks(body.salt))
        deferred = Deferred()
        tiers.clear(deferred, body.salt, removed)
        return deferred

    def _ping(self, client: str, body: Ping, now: float) -> ReplyBody:
        return Pong()

    def _set_quota(self, client: str, body: SetQuota, now: float) -> ReplyBody:
        self._check_admin(client, "set_quota")
        kept = self.index.quotas()
        if body.max_bytes is None:
            kept.pop(body.salt, None)
        else:
            kept[body.salt] = body.max_bytes
        self.settings.save_quotas(kept)  # before it takes effect: what the operator is told survives a restart
        quotas = self.index.set_quota(body.salt, body.max_bytes)
        log.info("quota_set", peer=client, salt=self.label(body.salt), max_bytes=body.max_bytes)
        return QuotaReply(quotas=quotas)

    def _query(self, client: str, body: Query, now: float) -> ReplyBody | Deferred:
        """What this server holds of each item, without a lease (routers; see `Query`)."""
        items: list[tuple[str, Sequence[bytes]]] = [(item.salt, item.keys) for item in body.items]
        if (total := sum(len(keys) for _, keys in items)) > MAX_KEYS_PER_REQUEST:
            raise ServerArgumentError(f"{total} keys in one query; send at most {MAX_KEYS_PER_REQUEST}", count=total)
        asked = self.tiers.query(client, items) if body.tiers and self.tiers is not None else None
        if isinstance(asked, Deferred):
            return asked  # answered with the tiers' runs once the reader has probed them
        if asked is not None:
            return self.answer(asked)
        return QueryReply([QueryResult(ram) for ram in self.index.prefix_lengths(items)])

    def _changes(self, client: str, body: Changes, now: float) -> ReplyBody:
        """What became of chunks of some salts in RAM (engines publishing KV events; see `Changes`)."""
        return self.changes.read(body.since, body.salts, body.limit, body.server_id)

    def _get_quotas(self, client: str, body: GetQuotas, now: float) -> ReplyBody:
        self._check_admin(client, "get_quotas")  # it names every tenant's salt
        return QuotaReply(quotas=self.index.quotas())


def stats_reply(
    stats: IndexStats, extra: dict[str, str | int | float | bool | None], *, name: Callable[[str], str] = str
) -> StatsReply:
    """The Stats reply for an index snapshot; figures beyond the protocol's go in `extra`; each
    salt appears as ``name(salt)`` (its label for a peer that may not be the owner)."""
    more: dict[str, str | int | float | bool | None] = {
        "page_size": stats.page_size,
        "pages_total": stats.pages_total,
        "pages_free": stats.pages_free,
        "pending_chunks": stats.pending_chunks,
        "quarantined_chunks": stats.quarantined_chunks,
        "leased_chunks": stats.leased_chunks,
        "expired_leases": stats.expired_leases,
        "expired_reservations": stats.expired_reservations,
        "full_reserves": stats.full_reserves,
        "pins_refused": stats.pins_refused,
        "pins_refused_share": stats.pins_refused_share,
        "pins_ended_early": stats.pins_ended_early,
    }
    # The salts holding the most bytes, so a reply stays small however many salts there are.
    listed = stats.largest_salts(MAX_STATS_SALTS)
    more["salts"] = stats.salt_count
    for salt in listed:
        more[f"salt_chunks:{name(salt)}"] = stats.salt_chunks.get(salt, 0)
    for salt, quota in sorted(stats.quotas.items())[:MAX_STATS_SALTS]:
        more[f"quota:{name(salt)}"] = quota
    more.update(extra)
    return StatsReply(
        capacity_bytes=stats.capacity_bytes,
        used_bytes=stats.used_bytes,
        chunks=stats.chunks,
        hits=stats.hits,
        misses=stats.misses,
        bytes_stored=stats.bytes_stored,
        bytes_loaded=stats.bytes_loaded,
        evictions=stats.evictions,
        leases=stats.leases,
        reservations=stats.reservations,
        clients=stats.clients,
        salt_bytes={name(salt): stats.salt_bytes[salt] for salt in listed},
        extra=more,
    )
