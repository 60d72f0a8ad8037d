"""Real `kvdepot serve` processes and client processes for the server's reliability tests."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvdepot.server import fetch_stats

# The tests import their shared helpers (`_chunks`) from this directory (pytest's importlib mode
# does not put it on the path).
sys.path.insert(0, str(Path(__file__).parent))

WORKER = Path(__file__).with_name("_worker.py")
START_TIMEOUT = 20.0


class ServerProcess:
    """One `kvdepot serve` child process bound to an ipc socket in a private directory."""

    #: What runs `kvdepot serve`, unless a server is given another command (another build).
    COMMAND = (sys.executable, "-m", "kvdepot.server._cli")

    def __init__(self, workdir: Path, *args: str, command: tuple[str, ...] | None = None) -> None:
        self.command = command or self.COMMAND
        self.workdir = workdir
        self.address = f"ipc://{workdir}/kvdepot.sock"
        self.args = list(args)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ServerProcess:
        cmd = [
            *self.command,
            "serve",
            "--address",
            self.address,
            "--pool-dir",
            str(self.workdir),
            "--no-metrics",
            "--log-format",
            "json",
            "--log-level",
            "warning",
            *self.args,
        ]
        if "--settings-file" not in self.args:  # kept in the test's directory, not the user's state
            cmd += ["--settings-file", str(self.workdir / "settings.json")]
        self.log = open(self.workdir / "server.log", "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvdepot serve exited with {self.proc.returncode}: {self.read_log()}")
            try:
                fetch_stats(self.address, timeout=0.5)
                return self
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def stats(self):
        return fetch_stats(self.address, timeout=5.0)

    def rss(self) -> int:
        """Resident memory of the server process in bytes."""
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    def pool_files(self) -> list[Path]:
        return sorted(self.workdir.glob("kvdepot-*.pool"))

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait(timeout)
        self.log.close()
        return code

    def read_log(self) -> str:
        return (self.workdir / "server.log").read_text(errors="replace")[-4000:]


@pytest.fixture
def workdir(short_tmp: Path) -> Path:
    """A short private directory (ipc paths must stay under 108 bytes), removed after the servers
    and workers of the test have stopped (`serve` and `workers` use it, so they end first)."""
    return short_tmp


@pytest.fixture
def serve(workdir) -> Iterator:
    """Start `kvdepot serve` processes; every one still running is stopped at teardown."""
    started: list[ServerProcess] = []

    def start(*args: str, where: Path | None = None, command: tuple[str, ...] | None = None) -> ServerProcess:
        """A server in `workdir`, or in `where` (a second server needs a directory of its own);
        ``command`` runs another build's `kvdepot serve`."""
        if where is not None:
            where.mkdir(mode=0o700, exist_ok=True)
        server = ServerProcess(where or workdir, *args, command=command).start()
        started.append(server)
        return server

    yield start
    for server in started:
        if server.alive():
            server.stop(signal.SIGKILL)


class Workers:
    """`_worker.py` client processes; `result(p)` returns the JSON counts a worker printed."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []

    def spawn(self, *args: str) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, str(WORKER), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.procs.append(proc)
        return proc

    @staticmethod
    def result(proc: subprocess.Popen[str], timeout: float) -> dict[str, int]:
        out, err = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, f"worker failed ({proc.returncode}): {err[-2000:]}"
        return json.loads(out.strip().splitlines()[-1])

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            with contextlib.suppress(Exception):
                proc.communicate(timeout=5)


@pytest.fixture
def workers(workdir: Path) -> Iterator[Workers]:
    """Worker processes, killed before `workdir` (whose pool file they map) is removed."""
    pool = Workers()
    yield pool
    pool.close()


def _wait_until(predicate, timeout: float, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


@pytest.fixture
def wait_until():
    """Poll `predicate` until it returns a truthy value or `timeout` passes; returns the last value."""
    return _wait_until
