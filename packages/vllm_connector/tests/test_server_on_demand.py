"""A server started on demand: a real `kvdepot serve` process, its pool sized when no size is given."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import pytest

from kvdepot.server import ServerProcess, default_capacity
from kvdepot.vllm_connector import _server

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_without_a_size_the_pool_is_modest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No kvdepot.capacity and no --kv-offloading-size: ON_DEMAND_CAPACITY (or less), not half the memory."""
    monkeypatch.setattr(_server, "ON_DEMAND_CAPACITY", 64 << 20)
    address = f"ipc://{tmp_path}/s.sock"
    _server.ensure_server(address, capacity=None, timeout=30)
    try:
        stats = ServerProcess(address).stats()
        assert stats.capacity_bytes == min(64 << 20, default_capacity())
        _server.ensure_server(address, capacity="1GiB", timeout=30)  # one answers: nothing new starts
        assert ServerProcess(address).stats().capacity_bytes == stats.capacity_bytes
    finally:
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            os.kill(int(_server.pid_path(address).read_text()), signal.SIGTERM)
