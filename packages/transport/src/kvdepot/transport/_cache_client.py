"""`CacheClient`: one method per protocol operation, each returning a future of its reply.

Futures are `concurrent.futures.Future`s. Callbacks added to a pending one run on the
transport's settler thread (never on the I/O loop), one at a time and in order, so keep
them short and thread-safe (one that blocks holds up the rest; one may wait on a reply, never
on another callback). A future fails with
`DeadlineExceededError`, a `RemoteError` subclass for an error reply, `TransportBrokenError`
when the connection drops under it, or `TransportClosedError` once the client is closed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

from kvdepot.transport._client import (
    DEFAULT_HEARTBEAT_INTERVAL,
    DEFAULT_TIMEOUT,
    Call,
    Connection,
    ReconnectCallback,
)
from kvdepot.transport._codec import DEFAULT_MAX_FRAME_BYTES
from kvdepot.transport._connection import State
from kvdepot.transport._log import get_logger
from kvdepot.transport._messages import (
    PROTOCOL_VERSION,
    Abort,
    AbortReply,
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
    LookupItem,
    LookupReply,
    Ping,
    Pong,
    Query,
    QueryReply,
    QueryResult,
    QuotaReply,
    Register,
    RegisterReply,
    Release,
    ReleaseReply,
    RequestBody,
    Reserve,
    ReserveReply,
    SetQuota,
    Stats,
    StatsReply,
)

log = get_logger(__name__)
R = TypeVar("R")
LookupInput = LookupItem | tuple[str, Sequence[bytes]]


def _items(items: Iterable[LookupInput]) -> list[LookupItem]:
    out = []
    for item in items:
        if isinstance(item, LookupItem):
            out.append(item)
        else:
            salt, keys = item
            out.append(LookupItem(salt, keys if isinstance(keys, list) else list(keys)))
    return out


class _Operations:
    """The typed operations, shared by `CacheClient` and `Batch`."""

    _conn: Connection

    def _call(self, body: RequestBody) -> Future[Any]:
        raise NotImplementedError

    def hello(self) -> Future[HelloReply]:
        """Says Hello again (the client already does on every connect); answers the server's versions."""
        conn = self._conn
        return self._call(Hello(PROTOCOL_VERSION, conn.client_id, conn.client_name, conn.auth_secret))

    def register(  # noqa: PLR0917 (mirrors the fields of Register)
        self,
        layout: str,
        chunk_size: int,
        chunk_bytes: int,
        kv_world_size: int = 1,
        kv_rank: int = 0,
        model: str = "",
        fingerprint: str = "",
    ) -> Future[RegisterReply]:
        """Declares this client's KV layout; the client repeats it by itself after a server restart.

        With ``fingerprint``, a server that holds ``layout`` with another fingerprint or chunk size
        refuses with `LayoutConflictError`.
        """
        return self._call(Register(layout, chunk_size, chunk_bytes, kv_world_size, kv_rank, model, fingerprint))

    def lookup(self, items: Iterable[LookupInput], *, prefill_s_per_chunk: float | None = None) -> Future[LookupReply]:
        """Longest committed prefix (and a lease on it) for each item: LookupItem or (salt, keys).

        `prefill_s_per_chunk`: how long the engine takes to compute a chunk; a server reading
        chunks through from a lower tier waits at most that per chunk the read would save."""
        return self._call(Lookup(_items(items), prefill_s_per_chunk))

    def query(self, items: Iterable[LookupInput], *, tiers: bool = True) -> Future[QueryReply]:
        """How long a prefix of each item the server holds, in RAM and (``tiers``) in the tiers
        below; takes no lease and needs no Register. For routers: `QueryResult`."""
        return self._call(Query(_items(items), tiers))

    def changes(
        self, since: int, salts: Sequence[str], *, limit: int = 4096, server_id: str = ""
    ) -> Future[ChangesReply]:
        """What became of the chunks of ``salts`` in RAM since change ``since`` of server
        ``server_id`` (0: where the numbering stands now); at most ``limit`` changes. Takes no
        lease and needs no Register."""
        return self._call(Changes(since, list(salts), limit, server_id))

    def reserve(
        self, salt: str, keys: Sequence[bytes], chunk_bytes: int, *, server_id: str = ""
    ) -> Future[ReserveReply]:
        """Slots for the keys that are neither committed nor pending.

        With `server_id`, a server that is another instance refuses with `StalePoolError`.
        """
        return self._call(Reserve(salt, keys if isinstance(keys, list) else list(keys), chunk_bytes, server_id))

    def commit(
        self, reservation_id: int, indices: Sequence[int] | None = None, *, server_id: str = "", pin_s: float = 0.0
    ) -> Future[CommitReply]:
        """Makes the reserved chunks (or only `indices` of them) visible to lookups.

        With `server_id` (the instance that granted the reservation), another instance refuses
        with `StalePoolError`; so do `abort` and `release`. With `pin_s`, the server keeps them
        from eviction for that long (at most 60 s).
        """
        return self._call(Commit(reservation_id, None if indices is None else list(indices), server_id, pin_s))

    def abort(self, reservation_id: int, *, server_id: str = "") -> Future[AbortReply]:
        """Gives back the uncommitted slots of a reservation."""
        return self._call(Abort(reservation_id, server_id))

    def release(self, lease_ids: Sequence[int], *, server_id: str = "") -> Future[ReleaseReply]:
        """Ends leases taken by lookups."""
        return self._call(Release(list(lease_ids), server_id))

    def end_session(self) -> Future[EndSessionReply]:
        """Tells the server to reclaim this client's leases and reservations now."""
        return self._call(EndSession())

    def stats(self) -> Future[StatsReply]:
        """The server's counters."""
        return self._call(Stats())

    def clear(self, salt: str | None = None, *, tiers: bool = False) -> Future[ClearReply]:
        """Removes chunks of one salt, or of all: a slice of them, `more` says whether some are
        left (`CacheClient.clear_all` repeats it until none are). With ``tiers``, the last slice
        also clears the write-behind queues and every tier below RAM (see `Clear`)."""
        return self._call(Clear(salt, tiers))

    def ping(self) -> Future[Pong]:
        """A round trip that does nothing."""
        return self._call(Ping())

    def set_quota(self, salt: str, max_bytes: int | None) -> Future[QuotaReply]:
        """Limits the bytes of one salt (None removes the limit)."""
        return self._call(SetQuota(salt, max_bytes))

    def get_quotas(self) -> Future[QuotaReply]:
        """Every quota in force."""
        return self._call(GetQuotas())


class CacheClient(_Operations):
    """A client of one kvdepot server (`ipc://`, `tcp://` or `memory://` address).

    Thread-safe: any thread may call any method. All clients of a process share one I/O
    thread. The client connects in the background, says Hello first, and after a server
    restart says Hello and repeats the last Register by itself, then calls
    `on_reconnect(hello_reply, register_reply_or_None)` on the settler thread.
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL,
        client_name: str = "",
        auth_secret: str | None = None,
        curve_server_key: bytes | None = None,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        on_reconnect: ReconnectCallback | None = None,
    ) -> None:
        self._conn = Connection(
            address,
            timeout=timeout,
            heartbeat_interval=heartbeat_interval,
            client_name=client_name,
            auth_secret=auth_secret,
            curve_server_key=curve_server_key,
            max_frame_bytes=max_frame_bytes,
            on_reconnect=on_reconnect,
        )

    @property
    def address(self) -> str:
        """The server address."""
        return self._conn.address

    def clear_all(self, salt: str | None = None, timeout: float | None = 60.0) -> int:
        """Removes every unleased chunk of one salt, or of all salts, one slice per request so
        that other clients are served in between; returns how many were removed."""
        removed, more = 0, True
        while more:
            reply = self.clear(salt).result(timeout)
            removed, more = removed + reply.removed, reply.more
        return removed

    @property
    def client_id(self) -> str:
        """This client's random id, as the server sees it."""
        return self._conn.client_id

    @property
    def server_id(self) -> str | None:
        """The id of the server from the last handshake (changes when the server restarts)."""
        return self._conn.server_id

    @property
    def label_key(self) -> bytes:
        """The server's salt-label key from the last handshake (`HelloReply.label_key`): empty
        before it, from a server that keeps it to its owner, or from an older server."""
        hello = self._conn.proto.hello_reply
        return hello.label_key if hello is not None else b""

    @property
    def hello_reply(self) -> HelloReply | None:
        """The server's reply to the last handshake (None before it): what it offers this client,
        such as its slot index (`HelloReply.slot_index`)."""
        return self._conn.proto.hello_reply

    @property
    def connected(self) -> bool:
        """True while the handshake is done and the connection is up."""
        return self._conn.state is State.READY

    @property
    def counters(self) -> dict[str, int]:
        """Late replies (after their deadline), bad reply frames, reconnects."""
        return dict(self._conn.stats)

    def _call(self, body: RequestBody) -> Future[Any]:
        return self.request(body)

    def request(self, body: RequestBody, *, timeout: float | None = None) -> Future[Any]:
        """Sends any request body; the future resolves to its reply body."""
        call = self._conn.prepare(body, timeout)
        self._conn.submit((call,))
        return call.token  # type: ignore[no-any-return]

    def batch(self, *, timeout: float | None = None) -> Batch:
        """Collects requests (e.g. all of one engine step) to send as one message; see `Batch`."""
        return Batch(self._conn, timeout)

    def close(self, *, end_session: bool = True, timeout: float = 0.5) -> None:
        """Ends the session (best effort, if connected) and fails whatever is still pending."""
        if end_session and self._conn.state is State.READY:
            call = self._conn.prepare(EndSession(), timeout)
            self._conn.submit((call,))
            try:
                call.token.result(timeout + 0.1)
            except Exception as exc:  # the server is gone or slow; closing goes on regardless
                log.debug("end_session_failed", address=self.address, error=str(exc))
        self._conn.close()

    def __enter__(self) -> CacheClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Batch(_Operations):
    """Requests that travel together as one message: `with client.batch() as b: f = b.lookup(...)`.

    Each operation returns its own future at once; nothing is sent until `send()` (called
    by the `with` block on exit). Each request still gets its own reply and error.
    """

    def __init__(self, conn: Connection, timeout: float | None) -> None:
        self._conn = conn
        self._timeout = timeout
        self._calls: list[Call] = []

    def _call(self, body: RequestBody) -> Future[Any]:
        call = self._conn.prepare(body, self._timeout)
        self._calls.append(call)
        return call.token  # type: ignore[no-any-return]

    def __len__(self) -> int:
        return len(self._calls)

    def send(self) -> None:
        """Sends everything collected so far in one message."""
        calls, self._calls = self._calls, []
        self._conn.submit(calls)

    def __enter__(self) -> Batch:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.send()
        else:
            for call in self._calls:
                call.token.cancel()
            self._calls = []


def query_prefixes(
    address: str | None,
    items: Iterable[LookupInput],
    *,
    tiers: bool = True,
    timeout: float = DEFAULT_TIMEOUT,
    auth_secret: str | None = None,
) -> list[QueryResult]:
    """What the server at `address` holds of each item (salt, chunk keys), in RAM and in the
    tiers below (``tiers``), through a short-lived client: Hello, Query and EndSession in one
    message. For a router that asks now and then; one that asks per request keeps a
    `CacheClient` and calls `query`. Takes no lease; needs no Register."""
    client = CacheClient(address, timeout=timeout, client_name="kvdepot-query", auth_secret=auth_secret)
    try:
        with client.batch() as batch:
            reply = batch.query(items, tiers=tiers)
            batch.end_session()  # in the same message: the server forgets this client at once
        return reply.result(timeout).results
    finally:
        client.close(end_session=False)
