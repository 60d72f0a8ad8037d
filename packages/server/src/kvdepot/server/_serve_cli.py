"""`kvdepot serve`: its flags, the `ServerConfig` they make, and the server's run in the foreground.

Flags left out take `ServerConfig`'s defaults, written there only (`_server_config.py`).
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from typing import Any

import structlog

from kvdepot.core import DEFAULT_CHUNK_SIZE
from kvdepot.server import _label_key, _settings_file
from kvdepot.server._cli_args import (
    add_log_flags,
    configure_logging,
    port_arg,
    positive_int_arg,
    read_secret_file,
    seconds_arg,
    size_arg,
)
from kvdepot.server._errors import ServerArgumentError
from kvdepot.server._metrics_http import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_HEADER_BYTES,
    DEFAULT_REQUEST_DEADLINE_S,
    HTTPLimits,
)
from kvdepot.server._server_config import HEALTH_STALL_S, ServerConfig
from kvdepot.server._units import format_size
from kvdepot.transport import MAX_CONNECTIONS

DEFAULT_METRICS_PORT = 9477
EXIT_USAGE = 2


def usage_error(message: str) -> int:
    """Say what was wrong with the command line; the exit code of a usage error."""
    sys.stderr.write(f"kvdepot: error: {message}\n")
    return EXIT_USAGE


def configure(parser: argparse.ArgumentParser) -> None:
    from kvdepot.transport import default_address

    parser.add_argument(
        "--address",
        default=None,
        help=f"where to listen: ipc://PATH or tcp://127.0.0.1:PORT (default {default_address()})",
    )
    parser.add_argument(
        "--capacity", type=size_arg, default=None, help="pool size, e.g. 64GiB (default: half the available memory)"
    )
    parser.add_argument("--page-size", type=size_arg, default=None, help="allocation page, e.g. 256MiB (default: auto)")
    parser.add_argument(
        "--chunk-size", type=positive_int_arg, default=DEFAULT_CHUNK_SIZE, help="tokens per chunk offered to clients"
    )
    parser.add_argument(
        "--metrics-port",
        type=port_arg,
        default=None,
        help=f"Prometheus port on 127.0.0.1 (0: any free port; default {DEFAULT_METRICS_PORT}, skipped if busy)",
    )
    parser.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="address the metrics and /healthz endpoint binds (default 127.0.0.1; 0.0.0.0 lets a Prometheus "
        "on another host scrape it, and anyone who reaches the port read it)",
    )
    parser.add_argument("--no-metrics", action="store_true", help="do not serve Prometheus metrics")
    parser.add_argument(
        "--metrics-max-connections",
        type=positive_int_arg,
        default=DEFAULT_MAX_CONNECTIONS,
        help="connections the metrics endpoint keeps open at once; past it the oldest unfinished request is "
        f"closed, or the new one gets 503 (default {DEFAULT_MAX_CONNECTIONS}; at most 1/8 of the file limit)",
    )
    parser.add_argument(
        "--metrics-request-deadline",
        type=seconds_arg,
        default=DEFAULT_REQUEST_DEADLINE_S,
        help="seconds a metrics request's line and headers may take to arrive, in all; past it 408 "
        f"(default {DEFAULT_REQUEST_DEADLINE_S:g})",
    )
    parser.add_argument(
        "--metrics-max-header-bytes",
        type=size_arg,
        default=DEFAULT_MAX_HEADER_BYTES,
        help="bytes of a metrics request's line and headers, in all; past it 431 "
        f"(default {format_size(DEFAULT_MAX_HEADER_BYTES)})",
    )
    parser.add_argument(
        "--health-stall",
        type=seconds_arg,
        default=None,
        help=f"/healthz answers 503 once the loop has not turned for this many seconds (default {HEALTH_STALL_S:g})",
    )
    parser.add_argument("--pool-dir", type=Path, default=None, help="where the pool file lives (default /dev/shm)")
    parser.add_argument(
        "--keep-pool",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep the pool (and its journal) when the server stops, is killed or crashes, and adopt what "
        "verifies at the next start with the same --address, --pool-dir, --capacity and --page-size "
        "(default: kept; --no-keep-pool: a pool for this run only, deleted at stop)",
    )
    parser.add_argument(
        "--fresh-pool",
        action="store_true",
        help="start with an empty pool: discard what the kept pool holds (it is kept again from now on)",
    )
    parser.add_argument(
        "--lease-ttl", type=seconds_arg, default=None, help="seconds before an unreleased lease expires"
    )
    parser.add_argument(
        "--reservation-ttl", type=seconds_arg, default=None, help="seconds before an uncommitted reservation expires"
    )
    parser.add_argument(
        "--default-quota",
        type=size_arg,
        default=None,
        help="bytes each cache_salt without a quota of its own may hold, e.g. 8GiB (default: no limit)",
    )
    parser.add_argument(
        "--peer-timeout", type=seconds_arg, default=None, help="seconds of silence before a client is gone"
    )
    parser.add_argument(
        "--max-connections",
        type=positive_int_arg,
        default=MAX_CONNECTIONS,
        metavar="N",
        help=f"connections a tcp --address takes at once; past it new ones wait unanswered (default {MAX_CONNECTIONS}; "
        "at most half of what the file limit leaves after the other listeners' caps; ipc has no cap)",
    )
    flood = parser.add_argument_group("what one peer's flood may cost (docs/server.md, 'Limits')")
    flood.add_argument(
        "--peer-queue", type=positive_int_arg, default=16, metavar="N", help="messages queued per peer (default 16)"
    )
    flood.add_argument(
        "--max-bad-frames",
        type=positive_int_arg,
        default=256,
        metavar="N",
        help="frames that are not requests a peer may send per second before it is muted for a second (default 256)",
    )
    flood.add_argument(
        "--trim-after",
        type=size_arg,
        default=64 << 20,
        metavar="SIZE",
        help="bytes taken in after which a quiet moment gives free memory back to the system (default 64MiB)",
    )
    parser.add_argument(
        "--auth-secret-file", type=Path, default=None, help="file with a shared secret clients must present (tcp)"
    )
    _label_key.add_flag(parser, "the key of salt labels in /metrics, logs and KV events; made (0600) if absent")
    parser.add_argument(
        _settings_file.FLAG,
        default=None,
        metavar="PATH",
        help="where the quotas `kvdepot quota` sets are kept across restarts (0600), or `none` to keep them in "
        "memory only (default: $XDG_STATE_HOME/kvdepot/settings/<digest of --address>.json)",
    )
    tiers = parser.add_argument_group("tiers below RAM (docs/server.md, 'Tiers below RAM')")
    tiers.add_argument("--disk-dir", type=Path, default=None, help="a local disk tier in this directory")
    tiers.add_argument(
        "--disk-capacity",
        type=size_arg,
        default=None,
        help="bytes the disk tier may hold (default: half its free space)",
    )
    tiers.add_argument(
        "--remote",
        default=None,
        metavar="URL",
        help="a Valkey/Redis tier: redis://[user@]host:port[/db], rediss://... (TLS), redis+cluster://h:p[,h:p...]",
    )
    tiers.add_argument("--remote-password-file", type=Path, default=None, help="file with the remote tier's password")
    tiers.add_argument(
        "--remote-password-env", default=None, metavar="VAR", help="environment variable with the remote's password"
    )
    tiers.add_argument(
        "--remote-ca-file",
        type=Path,
        default=None,
        metavar="PATH",
        help="CA certificates (PEM) to verify a rediss:// server with (default: the system's)",
    )
    tiers.add_argument("--remote-prefix", default="kvd:", help="prefix of the remote tier's keys (default kvd:)")
    tiers.add_argument(
        "--remote-ttl", type=seconds_arg, default=None, help="expiry of every remote value (default: none, LRU evicts)"
    )
    tiers.add_argument(
        "--tier-deadline",
        type=seconds_arg,
        default=None,
        help="seconds a lookup waits at most for the lower tiers; later chunks are misses (default 0.5)",
    )
    tiers.add_argument(
        "--tier-deadline-per-chunk",
        type=seconds_arg,
        default=None,
        help="... and at most this many seconds per chunk the tiers would save: the prefill time of one "
        "chunk (default: none, --tier-deadline alone)",
    )
    events = parser.add_argument_group("KV events for routers (docs/server.md, 'KV events')")
    events.add_argument(
        "--kv-events",
        default=None,
        metavar="ENDPOINT",
        help="publish what RAM gains and loses as vLLM KV events on this ZMQ PUB endpoint, "
        "e.g. tcp://127.0.0.1:5557 or ipc://PATH",
    )
    events.add_argument(
        "--kv-events-replay",
        default=None,
        metavar="ENDPOINT",
        help="a ZMQ ROUTER endpoint for replaying missed batches",
    )
    events.add_argument(
        "--kv-events-topic",
        default=None,
        metavar="TOPIC",
        help="the events' topic (default kv@node:<host name>@kvdepot)",
    )
    for flag, kind, default, text in (  # the publisher's bounds (docs/server.md, 'Limits')
        ("--kv-events-max-connections", positive_int_arg, 64, "connections per KV-events tcp port (default 64)"),
        (
            "--kv-events-subscriber-bytes",
            size_arg,
            4 << 20,
            "queued for a subscriber that does not read (default 4MiB)",
        ),
        (
            "--kv-events-subscriber-send-bytes",
            size_arg,
            16 << 10,
            "bytes one tcp peer of the PUB port may send in all before a refused subscription cuts it (default 16KiB)",
        ),
        ("--kv-events-replay-bytes", size_arg, 64 << 20, "batches kept for replay, in bytes (default 64MiB)"),
        ("--kv-events-replay-page", size_arg, 256 << 10, "payload bytes of one replay answer (default 256KiB)"),
    ):
        events.add_argument(
            flag, type=kind, default=default, metavar="N" if kind is positive_int_arg else "SIZE", help=text
        )
    add_log_flags(parser)


def _settings_path(args: argparse.Namespace) -> Path | None:
    """The settings file `--settings-file` names (None for `none`), by default one per address."""
    from kvdepot.transport import default_address

    if args.settings_file is not None:
        return None if args.settings_file == "none" else Path(args.settings_file)
    try:
        return _settings_file.default_settings_path(args.address or default_address())
    except RuntimeError as exc:  # Path.home(): no home directory
        structlog.get_logger("kvdepot.server").warning(
            "settings_not_kept", reason=f"no state directory ({exc}); pass {_settings_file.FLAG} PATH"
        )
        return None


def run(args: argparse.Namespace) -> int:
    from kvdepot.server._file_limit import raise_file_limit
    from kvdepot.server._server import CacheServer

    fmt = configure_logging(args.log_format, args.log_level)
    log = structlog.get_logger("kvdepot.server")
    files = raise_file_limit()  # before any socket: the metrics cap is a share of it
    if files.error is not None:
        log.warning("file_limit_kept", soft=files.soft, hard=files.hard, reason=files.error)
    else:
        log.info("file_limit_set", soft_before=files.before, soft=files.soft, hard=files.hard)
    try:
        secret = read_secret_file(args.auth_secret_file)
    except ServerArgumentError as exc:
        return usage_error(exc.message)
    config = _config(args, secret)
    try:
        server = CacheServer(config)
    except ServerArgumentError as exc:
        return usage_error(exc.message)
    except Exception as exc:  # address in use, no shared memory, ...: say it and exit 1
        message = getattr(exc, "message", None) or str(exc)
        sys.stderr.write(f"kvdepot serve: cannot start: {message}\n")
        return 1

    def on_signal(signum: int, frame: object) -> None:
        log.info("signal_received", signal=signal.Signals(signum).name)
        server.stop()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    summary = server.summary()
    if fmt == "pretty":
        sys.stdout.write(_banner(summary))
        sys.stdout.flush()
    else:
        log.info("server_started", **summary)
    server.collector.take_over()  # this process is the server: no full collections at CPython's whim
    try:
        server.serve_forever()
    finally:
        server.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if server.failure:
        sys.stderr.write(f"kvdepot serve: stopped: {server.failure}\n")
        return 1
    return 0


def _config(args: argparse.Namespace, secret: str | None) -> ServerConfig:
    """The server's config from the command line (``secret``: the one `--auth-secret-file` holds)."""
    from kvdepot.transport import PeerLimits

    metrics_port = args.metrics_port if args.metrics_port is not None else DEFAULT_METRICS_PORT
    return ServerConfig(
        address=args.address,
        capacity=args.capacity,
        page_size=args.page_size,
        chunk_size=args.chunk_size,
        metrics_port=None if args.no_metrics else metrics_port,
        metrics_required=args.metrics_port is not None,
        metrics_host=args.metrics_host,
        metrics_limits=HTTPLimits(
            args.metrics_max_connections, args.metrics_request_deadline, args.metrics_max_header_bytes
        ),
        pool_dir=args.pool_dir,
        keep_pool=args.keep_pool,
        fresh_pool=args.fresh_pool,
        default_quota=args.default_quota,
        peer_timeout=args.peer_timeout,
        peer_limits=PeerLimits(args.peer_queue, args.max_bad_frames, args.trim_after),
        max_connections=args.max_connections,
        auth_secret=secret,
        disk_dir=args.disk_dir,
        disk_capacity=args.disk_capacity,
        remote_url=args.remote,
        remote_password_file=args.remote_password_file,
        remote_password_env=args.remote_password_env,
        remote_prefix=args.remote_prefix,
        remote_ttl=args.remote_ttl,
        remote_ca_file=args.remote_ca_file,
        kv_events=args.kv_events,
        kv_events_replay=args.kv_events_replay,
        kv_events_topic=args.kv_events_topic,
        kv_events_max_connections=args.kv_events_max_connections,
        kv_events_subscriber_bytes=args.kv_events_subscriber_bytes,
        kv_events_subscriber_send_bytes=args.kv_events_subscriber_send_bytes,
        kv_events_replay_bytes=args.kv_events_replay_bytes,
        kv_events_replay_page_bytes=args.kv_events_replay_page,
        label_key_file=args.label_key_file,
        settings_file=_settings_path(args),
        # Flags left out take ServerConfig's defaults, written there only.
        **_given(
            health_stall=args.health_stall,
            lease_ttl=args.lease_ttl,
            reservation_ttl=args.reservation_ttl,
            tier_deadline=args.tier_deadline,
            tier_deadline_per_chunk=args.tier_deadline_per_chunk,
        ),
    )


def _given(**values: Any) -> dict[str, Any]:
    """The values a command line gave (argparse leaves the others None)."""
    return {name: value for name, value in values.items() if value is not None}


def _banner(summary: dict[str, Any]) -> str:
    rows = [
        ("address", summary["address"]),
        (
            "capacity",
            f"{format_size(summary['capacity'])} ({summary['pages']} pages of {format_size(summary['page_size'])})",
        ),
        ("pool", summary["pool"]),
        ("metrics", summary["metrics"] or "off"),
        ("kv events", summary.get("kv_events") or "off"),
        ("chunk size", f"{summary['chunk_size']} tokens"),
    ]
    lines = [f"kvdepot {summary['version']} serving (pid {summary['pid']}); Ctrl-C stops it"]
    lines += [f"  {name:<10} {value}" for name, value in rows]
    lines.append(f"  read its figures with: kvdepot stats --address {summary['address']}")
    return "\n".join(lines) + "\n"
