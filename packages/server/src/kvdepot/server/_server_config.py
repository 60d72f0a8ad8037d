"""What `kvdepot serve` can set: `ServerConfig`, every field's default written here only (the
CLI leaves out the flags it was not given)."""

from __future__ import annotations

from pathlib import Path

import attrs

from kvdepot.core import DEFAULT_CHUNK_SIZE
from kvdepot.server._kv_peers import DEFAULT_SEND_BYTES
from kvdepot.server._kv_publisher import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_REPLAY_BYTES,
    DEFAULT_REPLAY_PAGE_BYTES,
    DEFAULT_SUBSCRIBER_BYTES,
)
from kvdepot.server._metrics_http import HTTPLimits
from kvdepot.server._sessions import DEFAULT_LEASE_TTL, DEFAULT_RESERVATION_TTL
from kvdepot.server._tiering import DEFAULT_READ_DEADLINE, DEFAULT_READ_DEADLINE_PER_CHUNK
from kvdepot.transport import MAX_CONNECTIONS, PeerLimits

# /healthz answers 503 once the loop has not turned for this long (seconds). An idle loop turns
# every `_server.POLL_INTERVAL`; a full garbage collection or a large request holds it for milliseconds.
HEALTH_STALL_S = 10.0


@attrs.frozen
class ServerConfig:
    """Everything `kvdepot serve` can set; None means the documented default."""

    address: str | None = None
    capacity: int | None = None
    page_size: int | None = None
    chunk_size: int = DEFAULT_CHUNK_SIZE
    metrics_port: int | None = None  # None: no metrics endpoint; 0: any free port
    metrics_required: bool = True  # False: a busy port only logs a warning (the CLI's default port)
    metrics_host: str = "127.0.0.1"
    metrics_limits: HTTPLimits = attrs.field(factory=HTTPLimits)  # connections, deadline, header bytes
    pool_dir: Path | None = None
    lease_ttl: float = DEFAULT_LEASE_TTL
    reservation_ttl: float = DEFAULT_RESERVATION_TTL
    default_quota: int | None = None  # bytes a salt without its own quota may hold
    peer_timeout: float | None = None
    peer_limits: PeerLimits = attrs.field(factory=PeerLimits)  # what one peer's flood may cost
    max_connections: int = MAX_CONNECTIONS  # a tcp address's connections at once (`cache_connections` caps it)
    auth_secret: str | None = None
    disk_dir: Path | None = None  # a disk tier below RAM
    disk_capacity: int | None = None  # None: half the free space of its filesystem
    remote_url: str | None = None  # a Valkey/Redis tier below RAM (and the disk)
    remote_password_file: Path | None = None
    remote_password_env: str | None = None
    remote_prefix: str = "kvd:"
    remote_ttl: float | None = None
    remote_ca_file: Path | None = None  # CA certificates to verify a rediss:// server with (None: the system's)
    tier_deadline: float = DEFAULT_READ_DEADLINE
    tier_deadline_per_chunk: float | None = DEFAULT_READ_DEADLINE_PER_CHUNK  # None: always `tier_deadline`
    kv_events: str | None = None  # a ZMQ PUB endpoint for the RAM tier's KV events (None: none)
    kv_events_replay: str | None = None  # ... and a ROUTER endpoint to replay missed batches from
    kv_events_topic: str | None = None  # None: `default_topic()`
    kv_events_max_connections: int = DEFAULT_MAX_CONNECTIONS  # per tcp listener
    kv_events_subscriber_bytes: int = DEFAULT_SUBSCRIBER_BYTES  # queued for one subscriber
    kv_events_subscriber_send_bytes: int = DEFAULT_SEND_BYTES  # one tcp peer may send in all
    kv_events_replay_bytes: int = DEFAULT_REPLAY_BYTES  # kept for replay
    kv_events_replay_page_bytes: int = DEFAULT_REPLAY_PAGE_BYTES  # one replay answer
    health_stall: float = HEALTH_STALL_S  # /healthz: seconds without a turn of the loop before 503
    label_key_file: Path | None = None  # the salt-label key (None: `default_label_key_path()`)
    settings_file: Path | None = None  # where quotas are kept across restarts (None: in memory only)
    keep_pool: bool = False  # the address's kept pool: left at stop, adopted at start (`kvdepot serve`: on)
    fresh_pool: bool = False  # ... but discard what it holds at this start
