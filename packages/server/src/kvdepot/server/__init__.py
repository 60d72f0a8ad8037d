"""kvdepot.server: the cache daemon behind `kvdepot serve`.

It owns a shared-memory pool of fixed capacity, an index from (cache_salt, chunk key) to
slots of that pool with two-phase stores, leases, LRU eviction and per-salt quotas, and
answers the `kvdepot.transport` protocol. It never imports torch, gpu or vllm.
"""

from kvdepot.server._cli import ENTRY_POINT_GROUP, Command, SimpleCommand, configure_logging, main
from kvdepot.server._errors import (
    ChunkTooLargeError,
    NotRegisteredError,
    PoolError,
    ServerArgumentError,
    ServerError,
    TooManyError,
    UnknownReservationError,
)
from kvdepot.server._handler import CacheHandler
from kvdepot.server._index import CLEAR_SLICE, MAX_SESSIONS, ChunkIndex
from kvdepot.server._pool import PoolMapping, SharedPool, open_pool_file
from kvdepot.server._process import ServerProcess, ServerStartError
from kvdepot.server._results import IndexStats, LookupOutcome, Reclaimed, ReserveOutcome, SaltUsage
from kvdepot.server._server import CacheServer, ServerConfig, default_capacity
from kvdepot.server._slabs import MIN_SLOT_BYTES, SLOT_ALIGNMENT, SlabAllocator, auto_page_size
from kvdepot.server._stats import fetch_stats, format_stats
from kvdepot.server._units import format_size, parse_size
from kvdepot.server._version import __version__

__all__ = [
    "CLEAR_SLICE",
    "ENTRY_POINT_GROUP",
    "MAX_SESSIONS",
    "MIN_SLOT_BYTES",
    "SLOT_ALIGNMENT",
    "CacheHandler",
    "CacheServer",
    "ChunkIndex",
    "ChunkTooLargeError",
    "Command",
    "IndexStats",
    "LookupOutcome",
    "NotRegisteredError",
    "PoolError",
    "PoolMapping",
    "Reclaimed",
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
    "TooManyError",
    "UnknownReservationError",
    "__version__",
    "auto_page_size",
    "configure_logging",
    "default_capacity",
    "fetch_stats",
    "format_size",
    "format_stats",
    "main",
    "open_pool_file",
    "parse_size",
]
