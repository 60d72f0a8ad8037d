"""The connector's settings, read from `kv_transfer_config.kv_connector_extra_config`.

kvdepot's own keys start with ``kvdepot.``; LMCache's multi-process keys
(``lmcache.mp.*``) are accepted too, so an existing LMCache MP configuration works as is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from kvdepot.core import DEFAULT_CHUNK_SIZE, InvalidArgumentError

#: How long one request to the server may take before it counts as failed (seconds).
DEFAULT_TIMEOUT = 5.0
#: How long a lookup may stay unanswered before the request goes on as a miss (seconds).
#: The scheduler never waits for it: it asks vLLM to come back on the next step.
DEFAULT_LOOKUP_TIMEOUT = 2.0
#: Heartbeats keep the server from reclaiming a quiet client's leases (seconds).
DEFAULT_HEARTBEAT_INTERVAL = 2.0
#: On a CPU engine, the most a step that computes spends copying hits in, as a share of its time.
DEFAULT_LOAD_STEP_SHARE = 0.03

KEYS = {
    "kvdepot.address": "server address: ipc:///path or tcp://127.0.0.1:PORT (default: the local ipc socket)",
    "kvdepot.timeout": f"seconds one server request may take (default {DEFAULT_TIMEOUT})",
    "kvdepot.lookup_timeout": (
        f"seconds before an unanswered lookup counts as a miss (default {DEFAULT_LOOKUP_TIMEOUT})"
    ),
    "kvdepot.heartbeat_interval": f"seconds between heartbeats (default {DEFAULT_HEARTBEAT_INTERVAL})",
    "kvdepot.chunk_size": f"tokens per chunk, a multiple of the block size (default {DEFAULT_CHUNK_SIZE})",
    "kvdepot.start_server": "start a local server when none answers (default: true with the lmcache backend)",
    "kvdepot.capacity": "size of a server started on demand, e.g. '16GiB' (default: --kv-offloading-size, else 4GiB)",
    "kvdepot.auth": "shared secret for tcp servers started with --auth-secret-file",
    "kvdepot.prefault_pool": "map the pool's pages in the background when a worker maps it (default true)",
    "kvdepot.load_step_share": (
        "CPU engines: the share of a computing step's time that may go to copying hits in, at least one chunk a step "
        f"(default {DEFAULT_LOAD_STEP_SHARE}; 1 copies each hit whole in the step that starts it)"
    ),
    "kvdepot.test.fail_loads": "testing only: report every load as failed (exercises recovery)",
    "kvdepot.test.load_delay": "testing only: seconds each load waits before it copies (keeps loads in flight)",
    "lmcache.mp.host": "LMCache MP compatible: server host, e.g. tcp://localhost",
    "lmcache.mp.port": "LMCache MP compatible: server port",
    "lmcache.mp.mq_timeout": "LMCache MP compatible: same as kvdepot.timeout",
    "lmcache.mp.heartbeat_interval": "LMCache MP compatible: same as kvdepot.heartbeat_interval",
}


def _as_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return value.lower() in ("1", "true", "yes", "on")
    if isinstance(value, int):
        return bool(value)
    raise InvalidArgumentError(f"{name} must be a boolean, got {value!r}", key=name, got=repr(value))


def _as_float(name: str, value: Any) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"{name} must be a number of seconds, got {value!r}", key=name) from None
    if not out > 0:
        raise InvalidArgumentError(f"{name} must be positive, got {value!r}", key=name)
    return out


def _as_share(name: str, value: Any) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"{name} must be a number, got {value!r}", key=name) from None
    if not 0 < out <= 1:
        raise InvalidArgumentError(f"{name} must be more than 0 and at most 1, got {value!r}", key=name)
    return out


@attrs.frozen
class ConnectorConfig:
    """Every setting of the connector, validated."""

    address: str | None = None
    timeout: float = DEFAULT_TIMEOUT
    lookup_timeout: float = DEFAULT_LOOKUP_TIMEOUT
    heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL
    chunk_size: int = DEFAULT_CHUNK_SIZE
    start_server: bool = False
    capacity: str | None = None
    auth: str = ""
    prefault_pool: bool = True
    load_step_share: float = DEFAULT_LOAD_STEP_SHARE
    fail_loads: bool = False
    load_delay: float = 0.0

    @classmethod
    def from_extra_config(
        cls, extra: Mapping[str, Any] | None, *, lmcache_backend: bool = False, offloading_gib: float | None = None
    ) -> ConnectorConfig:
        """Reads the extra config; unknown ``kvdepot.*`` keys are refused (a typo must not be silent)."""
        extra = dict(extra or {})
        unknown = [k for k in extra if k.startswith(("kvdepot.", "lmcache.mp.")) and k not in KEYS]
        if unknown:
            raise InvalidArgumentError(
                f"unknown kvdepot setting(s) {unknown}; known keys: {sorted(KEYS)}", keys=",".join(unknown)
            )
        address = extra.get("kvdepot.address")
        if address is None and ("lmcache.mp.host" in extra or "lmcache.mp.port" in extra):
            host = str(extra.get("lmcache.mp.host", "tcp://localhost"))
            if "://" not in host:
                host = f"tcp://{host}"
            address = f"{host}:{int(extra.get('lmcache.mp.port', 5555))}"
        timeout = extra.get("kvdepot.timeout", extra.get("lmcache.mp.mq_timeout", DEFAULT_TIMEOUT))
        heartbeat = extra.get(
            "kvdepot.heartbeat_interval", extra.get("lmcache.mp.heartbeat_interval", DEFAULT_HEARTBEAT_INTERVAL)
        )
        chunk_size = extra.get("kvdepot.chunk_size", DEFAULT_CHUNK_SIZE)
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise InvalidArgumentError(f"kvdepot.chunk_size must be a positive int, got {chunk_size!r}")
        start = extra.get("kvdepot.start_server")
        capacity = extra.get("kvdepot.capacity")
        if capacity is None and offloading_gib:
            capacity = f"{offloading_gib:g}GiB"
        return cls(
            address=str(address) if address else None,
            timeout=_as_float("kvdepot.timeout", timeout),
            lookup_timeout=_as_float(
                "kvdepot.lookup_timeout", extra.get("kvdepot.lookup_timeout", DEFAULT_LOOKUP_TIMEOUT)
            ),
            heartbeat_interval=_as_float("kvdepot.heartbeat_interval", heartbeat),
            chunk_size=chunk_size,
            start_server=_as_bool("kvdepot.start_server", start)
            if start is not None
            else lmcache_backend and not address,
            capacity=str(capacity) if capacity else None,
            auth=str(extra.get("kvdepot.auth", "")),
            prefault_pool=_as_bool("kvdepot.prefault_pool", extra.get("kvdepot.prefault_pool", True)),
            load_step_share=_as_share(
                "kvdepot.load_step_share", extra.get("kvdepot.load_step_share", DEFAULT_LOAD_STEP_SHARE)
            ),
            fail_loads=_as_bool("kvdepot.test.fail_loads", extra.get("kvdepot.test.fail_loads", False)),
            load_delay=_as_float("kvdepot.test.load_delay", extra["kvdepot.test.load_delay"])
            if "kvdepot.test.load_delay" in extra
            else 0.0,
        )
