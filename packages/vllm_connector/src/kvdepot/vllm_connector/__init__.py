"""kvdepot.vllm_connector: the vLLM KV connector for a kvdepot server, and the vLLM plugin.

Importing this package does not import vLLM or torch. `KVDepotConnector` is resolved on first
access, so that `import kvdepot.vllm_connector` stays cheap in vLLM's plugin loader, in the
argument parser and in test collection.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvdepot.vllm_connector._plugin import CONNECTOR_CLASS, CONNECTOR_MODULE, CONNECTOR_NAME, LMCACHE_MP_NAME
from kvdepot.vllm_connector._version import __version__

if TYPE_CHECKING:
    from kvdepot.vllm_connector._connector import KVDepotConnector

__all__ = [
    "CONNECTOR_CLASS",
    "CONNECTOR_MODULE",
    "CONNECTOR_NAME",
    "LMCACHE_MP_NAME",
    "KVDepotConnector",
    "__version__",
]

# Names resolved lazily: (module, attribute). Touching one imports vLLM and torch.
_LAZY = {"KVDepotConnector": (CONNECTOR_MODULE, CONNECTOR_CLASS)}


def __getattr__(name: str) -> Any:
    try:
        module_name, attribute = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    import importlib

    value = getattr(importlib.import_module(module_name), attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
