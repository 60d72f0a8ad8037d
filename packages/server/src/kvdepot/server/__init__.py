"""kvdepot.server: the cache daemon behind `kvdepot serve`.

It owns a shared-memory pool of fixed capacity, an index from (cache_salt, chunk key) to
slots of that pool with two-phase stores, leases, LRU eviction and per-salt quotas, and
answers the `kvdepot.transport` protocol. Below the pool it may keep chunks in a disk tier
(`DiskTier`) and a Valkey/Redis tier (`RemoteTier`, which imports redis-py only when one is
made), written behind (`WriteBehind`). It never imports torch, gpu or vllm.
"""

from kvdepot.server._cli import ENTRY_POINT_GROUP, Command, SimpleCommand, main
from kvdepot.server._cli_args import configure_logging
from kvdepot.server._disk_tier import DiskTier
from kvdepot.server._errors import (
    ChunkTooLargeError,
    CorruptObjectError,
    NotRegisteredError,
    PoolError,
    ServerArgumentError,
    ServerError,
    TierConfigError,
    TierError,
    TooManyError,
    UnknownFormatError,
    UnknownReservationError,
)
from kvdepot.server._file_limit import FileLimit, raise_file_limit
from kvdepot.server._handler import CacheHandler
from kvdepot.server._index import CLEAR_SLICE, ChunkIndex
from kvdepot.server._pool import PoolMapping, SharedPool, open_pool_file, pid_alive
from kvdepot.server._process import ServerProcess, ServerStartError
from kvdepot.server._remote_tier import RemoteTier
from kvdepot.server._remote_url import RemoteAddress, parse_remote_url
from kvdepot.server._results import IndexStats, LookupOutcome, Reclaimed, ReserveOutcome, SaltUsage
from kvdepot.server._server import CacheServer, ServerConfig, default_capacity
from kvdepot.server._sessions import MAX_SESSIONS
from kvdepot.server._slabs import MIN_SLOT_BYTES, SLOT_ALIGNMENT, SlabAllocator, auto_page_size
from kvdepot.server._stats import fetch_stats, format_stats
from kvdepot.server._tiers import ChunkRef, ChunkWrite, Tier, TierState, TierStats, object_name
from kvdepot.server._units import format_size, parse_size
from kvdepot.server._version import __version__
from kvdepot.server._write_behind import DeferredWrite, WriteBehind, WriteBehindStats

__all__ = [
    "CLEAR_SLICE",
    "ENTRY_POINT_GROUP",
    "MAX_SESSIONS",
    "MIN_SLOT_BYTES",
    "SLOT_ALIGNMENT",
    "CacheHandler",
    "CacheServer",
    "ChunkIndex",
    "ChunkRef",
    "ChunkTooLargeError",
    "ChunkWrite",
    "Command",
    "CorruptObjectError",
    "DeferredWrite",
    "DiskTier",
    "FileLimit",
    "IndexStats",
    "LookupOutcome",
    "NotRegisteredError",
    "PoolError",
    "PoolMapping",
    "Reclaimed",
    "RemoteAddress",
    "RemoteTier",
    "ReserveOutcome",
    "SaltUsage",
    "ServerArgumentError",
    "ServerConfig",
    "ServerError",
    "ServerProcess",
    "ServerStartError",
    "SharedPool",
    "SimpleCommand",
    "SlabAllocator",
    "Tier",
    "TierConfigError",
    "TierError",
    "TierState",
    "TierStats",
    "TooManyError",
    "UnknownFormatError",
    "UnknownReservationError",
    "WriteBehind",
    "WriteBehindStats",
    "__version__",
    "auto_page_size",
    "configure_logging",
    "default_capacity",
    "fetch_stats",
    "format_size",
    "format_stats",
    "main",
    "object_name",
    "open_pool_file",
    "parse_remote_url",
    "parse_size",
    "pid_alive",
    "raise_file_limit",
]
