"""The connector's settings, read from `kv_transfer_config.kv_connector_extra_config`.

kvdepot's own keys start with ``kvdepot.``; LMCache's multi-process keys
(``lmcache.mp.*``) are accepted too, so an existing LMCache MP configuration works as is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

import attrs
import msgspec

from kvdepot.core import DEFAULT_CHUNK_SIZE, InvalidArgumentError
from kvdepot.vllm_connector._handoff import DEFAULT_HANDOFF_PIN, DEFAULT_HANDOFF_TIMEOUT

#: How long one request to the server may take before it counts as failed (seconds).
DEFAULT_TIMEOUT = 5.0
#: How long a lookup may stay unanswered before the request goes on as a miss (seconds).
#: The scheduler never waits for it: it asks vLLM to come back on the next step.
DEFAULT_LOOKUP_TIMEOUT = 2.0
#: Heartbeats keep the server from reclaiming a quiet client's leases (seconds).
DEFAULT_HEARTBEAT_INTERVAL = 2.0
#: On a CPU engine, the most a step that computes spends copying hits in, as a share of its time.
DEFAULT_LOAD_STEP_SHARE = 0.03
#: The most bytes of hits one step loads synchronously, before its forward pass, so that they join
#: that step instead of waiting out one (`_sync_budget.py` has the rule). A memcpy that replaces
#: the prefill of the tokens it holds (a 256-token chunk of the tests' model is 1 MiB; of
#: Llama-3-8B in bf16, 32 MiB). Hits past it, and any hit not wholly in the server's RAM, load
#: asynchronously; 0 turns synchronous loads off.
DEFAULT_SYNC_LOAD_BYTES = 256 << 20
#: While other requests run, the most a step's synchronous loads may add to it, as a share of
#: the step's time (its copies at the workers' measured rate).
DEFAULT_SYNC_LOAD_SHARE = 0.25

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
    "kvdepot.sync_load_bytes": (
        "the most bytes of hits a step copies before its forward pass, so that they join the step that finds them "
        "(default 256 MiB; 0: every hit loads asynchronously); only hits wholly in the server's RAM, with one "
        "full-attention KV-cache group; while other requests run, kvdepot.sync_load_share bounds it too"
    ),
    "kvdepot.sync_load_share": (
        "while other requests run, the most a step's synchronous loads may add to its time, as a share of it "
        f"(default {DEFAULT_SYNC_LOAD_SHARE}); see docs/vllm.md"
    ),
    "kvdepot.slot_index": (
        "answer lookups from the server's index of chunks in shared memory, in the scheduling pass that asks, "
        "when the server offers one (default true; false: every lookup waits for the server's reply)"
    ),
    "kvdepot.handoff_timeout": (
        "kv_consumer: seconds a handed-over request waits at most for the chunks its prefill engine stored "
        f"(default {DEFAULT_HANDOFF_TIMEOUT:g}); then it computes what is missing"
    ),
    "kvdepot.handoff_pin": (
        "kv_producer: seconds the server keeps the chunks it stores from eviction, until a decode engine looks them "
        f"up (default {DEFAULT_HANDOFF_PIN:g}; the server bounds it at 60)"
    ),
    "kvdepot.consumer_stores": "kv_consumer: also store the chunks it computes, e.g. what it decodes (default false)",
    "kvdepot.test.fail_loads": "testing only: report every load as failed (exercises recovery)",
    "kvdepot.test.load_delay": "testing only: seconds each load waits before it copies (keeps loads in flight)",
    "kvdepot.test.store_gate": (
        "testing only: a path; each store waits before its commit, on the copy thread, until it exists"
    ),
    "lmcache.mp.host": "LMCache MP compatible: server host, e.g. tcp://localhost",
    "lmcache.mp.port": "LMCache MP compatible: server port",
    "lmcache.mp.mq_timeout": "LMCache MP compatible: same as kvdepot.timeout",
    "lmcache.mp.heartbeat_interval": "LMCache MP compatible: same as kvdepot.heartbeat_interval",
}


# What msgspec.convert makes of each setting that is not a string, and what an error says it may
# be. Not strict: a number or a bool may come as a string ("2.5", "true"), as a command line
# writes it; only kvdepot.chunk_size is an int and nothing else, as it always was.
_SECONDS = (Annotated[float, msgspec.Meta(gt=0)], "a positive number of seconds")
_BOOL = "a boolean (true/false, 1/0, yes/no or on/off)"
_KINDS: dict[str, tuple[Any, str]] = {
    "kvdepot.timeout": _SECONDS,
    "kvdepot.lookup_timeout": _SECONDS,
    "kvdepot.heartbeat_interval": _SECONDS,
    "kvdepot.chunk_size": (Annotated[int, msgspec.Meta(ge=1)], "a positive int"),
    "kvdepot.start_server": (bool | None, _BOOL),  # None: the default
    "kvdepot.prefault_pool": (bool, _BOOL),
    "kvdepot.load_step_share": (Annotated[float, msgspec.Meta(gt=0, le=1)], "a number more than 0 and at most 1"),
    "kvdepot.handoff_timeout": _SECONDS,
    "kvdepot.sync_load_bytes": (Annotated[int, msgspec.Meta(ge=0)], "a number of bytes, 0 or more"),
    "kvdepot.sync_load_share": (Annotated[float, msgspec.Meta(gt=0, le=1)], "a number more than 0 and at most 1"),
    "kvdepot.slot_index": (bool, _BOOL),
    "kvdepot.handoff_pin": (Annotated[float, msgspec.Meta(ge=0)], "a number of seconds, 0 or more"),
    "kvdepot.consumer_stores": (bool, _BOOL),
    "kvdepot.test.fail_loads": (bool, _BOOL),
    "kvdepot.test.load_delay": _SECONDS,
    "lmcache.mp.port": (Annotated[int, msgspec.Meta(ge=1, le=65535)], "a port number (1 to 65535)"),
    "lmcache.mp.mq_timeout": _SECONDS,
    "lmcache.mp.heartbeat_interval": _SECONDS,
}
# Words for a bool that msgspec does not take (it takes true/false and 1/0, in any case).
_BOOL_WORDS = {"yes": True, "on": True, "no": False, "off": False}


def _convert(key: str, value: Any) -> Any:
    """The value of setting `key` as its kind, or InvalidArgumentError saying what `key` may be."""
    type_, allowed = _KINDS[key]
    # A word that means a bool becomes one; only the bool kinds take a bool.
    word = _BOOL_WORDS.get(value.lower(), value) if isinstance(value, str) else value
    try:
        return msgspec.convert(word, type_, strict=key == "kvdepot.chunk_size")
    except msgspec.ValidationError:
        raise InvalidArgumentError(f"{key} must be {allowed}, got {value!r}", key=key, got=repr(value)) from None


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
    sync_load_bytes: int = DEFAULT_SYNC_LOAD_BYTES
    sync_load_share: float = DEFAULT_SYNC_LOAD_SHARE
    slot_index: bool = True
    handoff_timeout: float = DEFAULT_HANDOFF_TIMEOUT
    handoff_pin: float = DEFAULT_HANDOFF_PIN
    consumer_stores: bool = False
    fail_loads: bool = False
    load_delay: float = 0.0
    store_gate: str | None = None

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
        got = {key: _convert(key, value) for key, value in extra.items() if key in _KINDS}
        address = _address(extra, got)
        start = got.get("kvdepot.start_server")
        capacity = extra.get("kvdepot.capacity")
        if capacity is None and offloading_gib:
            capacity = f"{offloading_gib:g}GiB"
        heartbeat = got.get("lmcache.mp.heartbeat_interval", DEFAULT_HEARTBEAT_INTERVAL)
        return cls(
            address=address,
            timeout=got.get("kvdepot.timeout", got.get("lmcache.mp.mq_timeout", DEFAULT_TIMEOUT)),
            lookup_timeout=got.get("kvdepot.lookup_timeout", DEFAULT_LOOKUP_TIMEOUT),
            heartbeat_interval=got.get("kvdepot.heartbeat_interval", heartbeat),
            chunk_size=got.get("kvdepot.chunk_size", DEFAULT_CHUNK_SIZE),
            start_server=start if start is not None else lmcache_backend and not address,
            capacity=str(capacity) if capacity else None,
            auth=str(extra.get("kvdepot.auth") or ""),  # null: no secret, never the secret "None"
            prefault_pool=got.get("kvdepot.prefault_pool", True),
            load_step_share=got.get("kvdepot.load_step_share", DEFAULT_LOAD_STEP_SHARE),
            sync_load_bytes=got.get("kvdepot.sync_load_bytes", DEFAULT_SYNC_LOAD_BYTES),
            sync_load_share=got.get("kvdepot.sync_load_share", DEFAULT_SYNC_LOAD_SHARE),
            slot_index=got.get("kvdepot.slot_index", True),
            handoff_timeout=got.get("kvdepot.handoff_timeout", DEFAULT_HANDOFF_TIMEOUT),
            handoff_pin=got.get("kvdepot.handoff_pin", DEFAULT_HANDOFF_PIN),
            consumer_stores=got.get("kvdepot.consumer_stores", False),
            fail_loads=got.get("kvdepot.test.fail_loads", False),
            load_delay=got.get("kvdepot.test.load_delay", 0.0),
            store_gate=str(extra["kvdepot.test.store_gate"]) if extra.get("kvdepot.test.store_gate") else None,
        )


def _address(extra: Mapping[str, Any], got: Mapping[str, Any]) -> str | None:
    """The server's address: `kvdepot.address`, else one made of LMCache's `lmcache.mp.host`/`port`."""
    address = extra.get("kvdepot.address")
    if address is None and ("lmcache.mp.host" in extra or "lmcache.mp.port" in extra):
        host = str(extra.get("lmcache.mp.host", "tcp://localhost"))
        if "://" not in host:
            host = f"tcp://{host}"
        address = f"{host}:{got.get('lmcache.mp.port', 5555)}"
    return str(address) if address else None
