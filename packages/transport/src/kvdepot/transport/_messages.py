"""Every message of the kvdepot control protocol, as msgspec structs.

A frame on the wire is one msgpack-encoded envelope: `Request(id, body)` from a client,
`Reply(id, body)` from the server. `body` is a tagged union over a closed set of structs,
so a peer can never make us build a type outside this module. Field constraints
(`Meta`) are checked while decoding, at the boundary, once.

Compatibility rules (see docs/protocol.md): `Hello`, `HelloReply` and `ErrorReply` are
map-encoded and may only ever gain optional fields, so that peers of any version can still
tell each other that their versions differ. Everything else changes only together with
`PROTOCOL_VERSION`.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from kvdepot.core import KEY_SIZE

#: Bumped on any incompatible change of a message other than Hello/HelloReply/ErrorReply.
PROTOCOL_VERSION = 7  # 2: Register.fingerprint; server_id on Commit, Abort and Release; 3: Lookup.prefill_s_per_chunk;
# 4: RegisterReply.reservation_ttl_s; 5: Query; 6: Changes; 7: Clear.tiers, ClearReply.left/tiers/tier_errors,
# Commit.pin_s

#: Client ids the server keeps for itself (its tiers' session is `kvdepot/tiers`): a Hello
#: under one is refused, so no peer can take over or end such a session.
RESERVED_CLIENT_PREFIX = "kvdepot/"

# Bounds that keep a peer's numbers from driving large allocations. The frame-size bound in
# the codec is the real limit; these catch nonsense early with a precise message.
MAX_KEYS_PER_REQUEST = 1 << 16  # 65,536 chunks of 256 tokens = 16M tokens, far beyond any prompt
MAX_ITEMS_PER_LOOKUP = 1 << 14  # requests of one engine step; vLLM batches are a few thousand
MAX_IDS_PER_RELEASE = 1 << 16
MAX_NAME_LENGTH = 1024  # salts, names, layout fingerprints, paths
MAX_SALTS_PER_CHANGES = 1 << 10
MAX_CHANGES_PER_REPLY = 1 << 14
MAX_LABEL_KEY_BYTES = 64  # HelloReply.label_key: a server sends 32
MAX_INT = (1 << 63) - 1

Key = Annotated[bytes, msgspec.Meta(min_length=KEY_SIZE, max_length=KEY_SIZE)]
Keys = Annotated[list[Key], msgspec.Meta(max_length=MAX_KEYS_PER_REQUEST)]
Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME_LENGTH)]
Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_INT)]
Id = Annotated[int, msgspec.Meta(ge=0, le=MAX_INT)]
Ids = Annotated[list[Id], msgspec.Meta(max_length=MAX_IDS_PER_RELEASE)]
Indices = Annotated[list[Count], msgspec.Meta(max_length=MAX_KEYS_PER_REQUEST)]
FieldValue = str | int | float | bool | None
LabelKey = Annotated[bytes, msgspec.Meta(max_length=MAX_LABEL_KEY_BYTES)]


# Every message struct is declared with gc=False: messages hold only strings, bytes, numbers
# and other messages, never a reference cycle, so the cyclic garbage collector need not
# track them. A round trip allocates fewer tracked objects, so collections come less often.


class _Body(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """Base of request and reply bodies: immutable, strict about unknown fields."""


class _Inner(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Base of small structs repeated many times per message, encoded as arrays."""


# --- requests ---------------------------------------------------------------------------


class Hello(msgspec.Struct, frozen=True, tag="hello", gc=False):
    """First request of every connection: protocol version and the client's identity.

    `client_id` is random hex chosen once per client, never a pid. `auth` carries the
    shared secret when the server requires one. Unknown fields are ignored so that a
    newer client can still be told that its version is not spoken here.
    """

    protocol_version: int
    client_id: Name
    client_name: Name = ""
    auth: Name = ""


class Register(_Body, frozen=True, tag="register"):
    """Declares the KV layout this client stores and loads; answered with the pool to map."""

    layout: Name
    chunk_size: Count
    chunk_bytes: Count
    kv_world_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)] = 1
    kv_rank: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)] = 0
    model: Name = ""
    #: What the bytes of a chunk are, as the client measured its KV cache (empty: not checked).
    #: A server refuses a Register whose layout name it already holds with another fingerprint.
    fingerprint: Name = ""


class LookupItem(_Inner, frozen=True):
    """The chunk keys of one request, under its cache salt."""

    salt: Name
    keys: Keys


class Lookup(_Body, frozen=True, tag="lookup"):
    """All lookups of one engine step; each item is answered with its longest committed prefix."""

    items: Annotated[list[LookupItem], msgspec.Meta(max_length=MAX_ITEMS_PER_LOOKUP)]
    #: The engine's estimate of the seconds it takes to compute one chunk (None: no estimate).
    #: A server reading chunks through from a lower tier waits at most this per chunk the read
    #: would save, so a hit never keeps the engine waiting longer than recomputing would.
    prefill_s_per_chunk: Annotated[float, msgspec.Meta(ge=0.0, le=3600.0)] | None = None


class Reserve(_Body, frozen=True, tag="reserve"):
    """Asks for slots to store `keys`; keys already present or pending are skipped."""

    salt: Name
    keys: Keys
    chunk_bytes: Count
    #: The server instance whose pool the client has mapped (HelloReply.server_id). A server
    #: with another id refuses with `stale_pool`, so a client that has not yet remapped after a
    #: restart never writes slots of the new pool into its old mapping. Empty: not checked.
    server_id: Name = ""


class Commit(_Body, frozen=True, tag="commit"):
    """Makes reserved chunks visible to lookups; `indices=None` commits all of them.

    `server_id` (as in `Reserve`) names the instance that granted the reservation: after a
    restart ids start again, and a commit for the old instance must not publish a new one's.
    """

    reservation_id: Id
    indices: Indices | None = None
    server_id: Name = ""
    #: Keep the chunks committed from being evicted for this many seconds (the server bounds
    #: it, 60 s): a prefill engine's handoff, until the decode engine has looked them up.
    pin_s: Annotated[float, msgspec.Meta(ge=0, le=86400)] = 0.0


class Abort(_Body, frozen=True, tag="abort"):
    """Gives back every uncommitted slot of a reservation (`server_id` as in `Commit`)."""

    reservation_id: Id
    server_id: Name = ""


class Release(_Body, frozen=True, tag="release"):
    """Ends leases taken by lookups, so their chunks may be evicted again (`server_id` as in `Commit`)."""

    lease_ids: Ids
    server_id: Name = ""


class EndSession(_Body, frozen=True, tag="end_session"):
    """The client is leaving: the server reclaims its leases and reservations now."""


class Stats(_Body, frozen=True, tag="stats"):
    """Asks for the server's counters."""


class Clear(_Body, frozen=True, tag="clear"):
    """Removes the stored chunks of one salt, or of every salt when `salt` is None.

    With `tiers`, once RAM holds none left to remove, the server also drops them from its
    write-behind queues and deletes them from every tier below RAM (its disk, and the remote
    tier it shares with other servers), then answers: that reply may take seconds."""

    salt: Name | None = None
    tiers: bool = False


class Ping(_Body, frozen=True, tag="ping"):
    """Liveness probe and heartbeat; answered with Pong."""


class SetQuota(_Body, frozen=True, tag="set_quota"):
    """Limits the bytes one salt may hold; `max_bytes=None` removes the limit."""

    salt: Name
    max_bytes: Count | None


class GetQuotas(_Body, frozen=True, tag="get_quotas"):
    """Asks for every quota in force."""


class Query(_Body, frozen=True, tag="query"):
    """How long a prefix of each item's keys the server holds, in RAM and in the tiers below.

    Read-only: it takes no lease, counts no hit or miss, and reads no chunk. For routers and
    schedulers that pick a server before they send a request. A lookup right after it hits
    at most that much (a chunk may be evicted, or a tier's read fail, in between)."""

    items: Annotated[list[LookupItem], msgspec.Meta(max_length=MAX_ITEMS_PER_LOOKUP)]
    #: Ask the tiers below RAM too (a disk index read, a round trip to Valkey); False: RAM only.
    tiers: bool = True


class Changes(_Body, frozen=True, tag="changes"):
    """What became of the chunks of ``salts`` in RAM since change number ``since``: for engines
    that publish KV events (the connector announces what it stored, then what went).

    The server numbers every chunk that becomes visible or goes away in RAM, in the order it
    happened, and keeps the last few hundred thousand. ``since=0`` asks where the numbering
    stands now (no changes). ``server_id``: the instance that numbered ``since`` (another one
    answers ``lost``). Read-only: no lease, no Register."""

    since: Count
    salts: Annotated[list[Name], msgspec.Meta(max_length=MAX_SALTS_PER_CHANGES)]
    limit: Annotated[int, msgspec.Meta(ge=1, le=MAX_CHANGES_PER_REPLY)] = 4096
    server_id: Name = ""


RequestBody = (
    Hello
    | Register
    | Lookup
    | Reserve
    | Commit
    | Abort
    | Release
    | EndSession
    | Stats
    | Clear
    | Ping
    | SetQuota
    | GetQuotas
    | Query
    | Changes
)
REQUEST_TYPES: tuple[type, ...] = RequestBody.__args__


# --- replies ----------------------------------------------------------------------------


class HelloReply(msgspec.Struct, frozen=True, tag="hello_reply", gc=False):
    """The server's protocol version, package version and random per-process id.

    A changed `server_id` after a reconnect means the server restarted and lost all state.
    `label_key` is the server's salt-label key (`kvdepot.core.SaltLabeler`), sent only to a
    peer that proved it is the owner (the server's own user on ipc, the shared secret on tcp),
    so that its engines name salts as the server's /metrics does; empty to anyone else.
    """

    protocol_version: int
    server_version: str
    server_id: str
    label_key: LabelKey = b""
    #: The server's index of committed chunks in shared memory (`kvdepot.core.find_in_index`),
    #: sent, like `label_key`, only to a peer that proved it is the owner; None: not offered.
    slot_index: PoolInfo | None = None
    #: True when the index holds every chunk the server could hit (it has no tier below RAM), so
    #: that a chunk missing from it is a miss.
    slot_index_complete: bool = False


class PoolInfo(msgspec.Struct, frozen=True, gc=False):
    """How to map the server's shared pool: a file (e.g. under /dev/shm) of `size` bytes."""

    kind: Literal["shm_file"]
    path: Name
    size: Count


class RegisterReply(_Body, frozen=True, tag="register_reply"):
    """The chunk size the server uses, the pool to map, and the alignment of every slot."""

    chunk_size: Count
    pool: PoolInfo
    slot_alignment: Count = 1
    #: Seconds a reservation lives uncommitted (0: not said). A client must not start a copy
    #: into a reserved slot after that: the server hands the slots out again once they expire.
    reservation_ttl_s: Annotated[float, msgspec.Meta(ge=0.0, le=1e9)] = 0.0


class Slot(_Inner, frozen=True):
    """Where one chunk's bytes lie in the pool."""

    offset: Count
    length: Count


class LookupResult(_Inner, frozen=True):
    """Longest committed prefix of one lookup item, its lease and where its chunks are.

    `lease_id` is 0 when there were no hits and so no lease was taken. `read_back`: how many
    of the hits the server has just read back from each tier below RAM for this lookup (the
    rest were in RAM), so that an engine can count its hits by source.
    """

    num_hits: Count
    lease_id: Id
    slots: list[Slot]
    read_back: dict[Name, Count] = {}


class LookupReply(_Body, frozen=True, tag="lookup_reply"):
    """One result per lookup item, in the same order."""

    results: list[LookupResult]


class ReservedSlot(_Inner, frozen=True):
    """A slot to fill for `keys[index]` of the reservation."""

    index: Count
    offset: Count
    length: Count


class ReserveReply(_Body, frozen=True, tag="reserve_reply"):
    """Slots for the keys that were neither committed nor pending; `full` if some did not fit."""

    reservation_id: Id
    slots: list[ReservedSlot]
    present: list[Count]
    full: bool = False


class CommitReply(_Body, frozen=True, tag="commit_reply"):
    """How many chunks became visible."""

    committed: Count


class AbortReply(_Body, frozen=True, tag="abort_reply"):
    """How many reserved slots were freed."""

    freed: Count


class ReleaseReply(_Body, frozen=True, tag="release_reply"):
    """How many leases ended."""

    released: Count


class EndSessionReply(_Body, frozen=True, tag="end_session_reply"):
    """The session's resources are reclaimed."""


class StatsReply(_Body, frozen=True, tag="stats_reply"):
    """The server's counters. `extra` holds counters newer than this protocol version."""

    capacity_bytes: Count = 0
    used_bytes: Count = 0
    chunks: Count = 0
    hits: Count = 0
    misses: Count = 0
    bytes_stored: Count = 0
    bytes_loaded: Count = 0
    evictions: Count = 0
    leases: Count = 0
    reservations: Count = 0
    clients: Count = 0
    salt_bytes: dict[str, int] = {}
    extra: dict[str, FieldValue] = {}


class ClearReply(_Body, frozen=True, tag="clear_reply"):
    """How many chunks were removed; `more` when chunks to clear are left (send Clear again).

    One Clear removes a bounded number of chunks, so a large clear never holds the server."""

    removed: Count
    more: bool = False
    #: Chunks of the salt (or of all, for a clear of all) still in RAM because a client or the
    #: write-behind holds them right now; a later Clear removes them once let go.
    left: Count = 0
    #: For a Clear with `tiers`: objects deleted per tier below RAM...
    tiers: dict[str, int] = msgspec.field(default_factory=dict)
    #: ... and the tiers that could not be cleared, with why (e.g. the remote tier is down).
    tier_errors: dict[str, str] = msgspec.field(default_factory=dict)


class Pong(_Body, frozen=True, tag="pong"):
    """Answer to Ping."""


class QuotaReply(_Body, frozen=True, tag="quota_reply"):
    """Every quota in force, in bytes per salt."""

    quotas: dict[str, int]


class QueryResult(_Inner, frozen=True):
    """What the server holds of one query item: `ram` keys from the first are in RAM, then
    `below` more in the tiers below (each in at least one tier, with the size of the first:
    what a lookup would read back), of which each tier holds the first `tiers[kind]`."""

    ram: Count
    below: Count = 0
    tiers: dict[Name, Count] = {}


class QueryReply(_Body, frozen=True, tag="query_reply"):
    """One result per query item, in the same order."""

    results: list[QueryResult]


class Change(_Inner, frozen=True):
    """One chunk's change: ``stored`` (it became visible) or not (it was evicted or cleared), of
    salt ``salts[salt]`` of the request."""

    stored: bool
    salt: Count
    key: Key


class ChangesReply(_Body, frozen=True, tag="changes_reply"):
    """The changes numbered ``since`` up to ``next`` (exclusive), oldest first, of the salts asked.

    ``lost``: changes between ``since`` and the oldest kept are gone (the server keeps a bounded
    number), or ``since`` is not a number of this server instance (``server_id`` names another,
    or ``since`` is past this one's numbering: a restart): the asker no longer knows what the
    server holds and must ask (`Query`). ``next`` is where to go on from."""

    changes: list[Change]
    next: Count
    lost: bool = False


class ErrorReply(msgspec.Struct, frozen=True, tag="error", gc=False):
    """The request failed. `code` is one of `ERROR_CODES`; `fields` carry the details."""

    code: str
    message: str
    fields: dict[str, FieldValue] = {}


ReplyBody = (
    HelloReply
    | RegisterReply
    | LookupReply
    | ReserveReply
    | CommitReply
    | AbortReply
    | ReleaseReply
    | EndSessionReply
    | StatsReply
    | ClearReply
    | Pong
    | QuotaReply
    | QueryReply
    | ChangesReply
    | ErrorReply
)
REPLY_TYPES: tuple[type, ...] = ReplyBody.__args__

#: The reply type that answers each request type (besides ErrorReply, which answers any).
REPLY_FOR: dict[type, type] = {
    Hello: HelloReply,
    Register: RegisterReply,
    Lookup: LookupReply,
    Reserve: ReserveReply,
    Commit: CommitReply,
    Abort: AbortReply,
    Release: ReleaseReply,
    EndSession: EndSessionReply,
    Stats: StatsReply,
    Clear: ClearReply,
    Ping: Pong,
    SetQuota: QuotaReply,
    GetQuotas: QuotaReply,
    Query: QueryReply,
    Changes: ChangesReply,
}


# --- envelopes --------------------------------------------------------------------------


class Request(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One request frame: a client-chosen id (> 0) and the body."""

    id: Id
    body: RequestBody


class Reply(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One reply frame: the id of the request it answers (0 if that id was unreadable)."""

    id: Id
    body: ReplyBody
