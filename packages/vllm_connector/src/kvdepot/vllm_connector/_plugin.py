"""The vLLM general plugin: registers kvdepot's connector names in vLLM's connector registry.

vLLM loads every `vllm.general_plugins` entry point in each of its processes (the argument
parser, the engine core, every worker), before it builds its configuration. This module must
stay cheap and must never import `lmcache`: vLLM's own `LMCacheMPConnector` module imports it at
the top, and vLLM resolves the connector class during config (the hybrid KV-cache manager
question), so an entry that still pointed there would fail without the lmcache package.
"""

from __future__ import annotations

import enum
import importlib
import importlib.util
import logging
import os
from collections.abc import Callable, MutableMapping
from typing import Any

CONNECTOR_NAME = "KVDepotConnector"
CONNECTOR_MODULE = "kvdepot.vllm_connector._connector"
CONNECTOR_CLASS = "KVDepotConnector"
# The name `VllmConfig._post_init_kv_transfer_config` derives from `--kv-offloading-backend lmcache`.
LMCACHE_MP_NAME = "LMCacheMPConnector"
# Set to 1 to serve LMCacheMPConnector with kvdepot even when the lmcache package is installed.
TAKE_LMCACHE_ENV = "KVDEPOT_TAKE_LMCACHE"

# A child of vLLM's "vllm" logger, so the line goes through vLLM's handlers and format
# (vLLM configures "vllm" and stops propagation there); style.md: inside vLLM, log through stdlib.
_log = logging.getLogger("vllm.kvdepot.plugin")

# Marks the loader functions this module installs, so a second call recognises its own entries.
_KVDEPOT_LOADER_ATTR = "__kvdepot_loader__"

Loader = Callable[[], Any]


class LMCacheNameOutcome(enum.Enum):
    """What the plugin did with vLLM's `LMCacheMPConnector` registry entry."""

    SERVED = "served"  # lmcache is absent: the name now loads kvdepot's connector
    TAKEN = "taken"  # lmcache is installed, and KVDEPOT_TAKE_LMCACHE asked kvdepot to take the name
    LEFT = "left"  # lmcache is installed: the name still loads lmcache's connector


def lmcache_installed() -> bool:
    """Whether the `lmcache` package can be imported, found without importing it."""
    try:
        return importlib.util.find_spec("lmcache") is not None
    except (ImportError, ValueError):
        # A broken or half-removed installation counts as absent: importing it would fail too.
        return False


def take_lmcache_requested(environ: MutableMapping[str, str] | None = None) -> bool:
    """Whether the environment asks kvdepot to serve `LMCacheMPConnector` even with lmcache installed."""
    value = (os.environ if environ is None else environ).get(TAKE_LMCACHE_ENV, "")
    return value.strip().lower() in {"1", "true", "yes", "on"}


def make_loader(module: str, class_name: str) -> Loader:
    """A registry loader that imports `module` only when vLLM asks for the class."""

    def load() -> Any:
        return getattr(importlib.import_module(module), class_name)

    setattr(load, _KVDEPOT_LOADER_ATTR, (module, class_name))
    load.__qualname__ = f"kvdepot_loader[{module}:{class_name}]"
    return load


def is_kvdepot_loader(loader: object) -> bool:
    """Whether a registry entry was installed by this module."""
    return getattr(loader, _KVDEPOT_LOADER_ATTR, None) is not None


def _vllm_registry() -> MutableMapping[str, Loader]:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    registry: MutableMapping[str, Loader] = KVConnectorFactory._registry
    return registry


def register_connectors(
    registry: MutableMapping[str, Loader] | None = None,
    *,
    module: str = CONNECTOR_MODULE,
    class_name: str = CONNECTOR_CLASS,
    lmcache_present: bool | None = None,
    take_lmcache: bool | None = None,
) -> LMCacheNameOutcome:
    """Register `KVDepotConnector`, and `LMCacheMPConnector` where kvdepot should serve it.

    Idempotent: entries this module installed earlier are recognised and left as they are.
    `registry` defaults to vLLM's `KVConnectorFactory._registry`; the keyword arguments exist for
    tests (a stub connector module, a pretended lmcache installation).
    """
    if registry is None:
        registry = _vllm_registry()
    if lmcache_present is None:
        lmcache_present = lmcache_installed()
    if take_lmcache is None:
        take_lmcache = take_lmcache_requested()

    existing = registry.get(CONNECTOR_NAME)
    if existing is None:
        # Equivalent to KVConnectorFactory.register_connector, which refuses a name it already has.
        registry[CONNECTOR_NAME] = make_loader(module, class_name)
    elif not is_kvdepot_loader(existing):
        _log.warning(
            "kvdepot: connector name %s is already registered by someone else; leaving it alone",
            CONNECTOR_NAME,
        )

    if lmcache_present and not take_lmcache:
        return LMCacheNameOutcome.LEFT
    # vLLM registers LMCacheMPConnector itself, so the entry is replaced, not added.
    if not is_kvdepot_loader(registry.get(LMCACHE_MP_NAME)):
        registry[LMCACHE_MP_NAME] = make_loader(module, class_name)
    return LMCacheNameOutcome.TAKEN if lmcache_present else LMCacheNameOutcome.SERVED


_MESSAGES = {
    LMCacheNameOutcome.SERVED: (
        "kvdepot: registered %s; serving %s with kvdepot because the lmcache package is not installed"
    ),
    LMCacheNameOutcome.TAKEN: (
        "kvdepot: registered %s; serving %s with kvdepot because " + TAKE_LMCACHE_ENV + " is set"
    ),
    LMCacheNameOutcome.LEFT: (
        "kvdepot: registered %s; leaving %s to the installed lmcache package (set "
        + TAKE_LMCACHE_ENV
        + "=1 to serve it with kvdepot)"
    ),
}

# The outcome of this process's registration, and whether its line has been logged. vLLM loads
# plugins before it configures logging in the front-end process (EngineArgs.__post_init__ runs
# first), so a line logged then would be lost: it waits until a handler exists.
_state: dict[str, object] = {}


def register() -> None:
    """The `vllm.general_plugins` entry point: register kvdepot's connector names, log one line."""
    outcome = register_connectors()
    if _state.get("outcome") is not outcome:
        _state["outcome"] = outcome
        _state["logged"] = False
    announce()


def announce() -> None:
    """Log the registration line once per process, as soon as logging can show it.

    The connector calls this when it is created, so the line appears even where the plugin ran
    before vLLM configured its logging.
    """
    outcome = _state.get("outcome")
    if not isinstance(outcome, LMCacheNameOutcome) or _state.get("logged"):
        return
    if not _log.hasHandlers():
        return
    _log.info(_MESSAGES[outcome], CONNECTOR_NAME, LMCACHE_MP_NAME)
    _state["logged"] = True
