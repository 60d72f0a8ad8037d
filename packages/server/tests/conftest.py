"""Fixtures: a server on an in-memory address, run by a thread, with its pool in tmp_path."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator

import pytest

from kvdepot.server import CacheServer, ServerConfig

_names = itertools.count()


@pytest.fixture
def make_server(tmp_path) -> Iterator:
    """Start servers (memory:// address unless given) in threads; all are stopped at teardown."""
    started: list[tuple[CacheServer, threading.Thread]] = []

    def start(**overrides) -> CacheServer:
        config = {
            "address": f"memory://server-test-{next(_names)}",
            "capacity": 64 * 4096,
            "page_size": 4096,
            "pool_dir": tmp_path,
        }
        config.update(overrides)
        server = CacheServer(ServerConfig(**config))
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        started.append((server, thread))
        return server

    yield start
    for server, thread in started:
        server.stop()
        thread.join(timeout=5)
        assert not thread.is_alive(), "the server loop did not stop"


@pytest.fixture(autouse=True)
def _restore_structlog():
    """Tests that run `main()` configure structlog; give the next test the previous configuration."""
    import structlog

    saved = structlog.get_config()
    yield
    structlog.configure(**saved)
