"""A `kvdepot serve` child process: start it, wait until it answers, stop it.

For programs that run a server of their own (the demo, tests, benchmarks, a vLLM process
starting a node's server on demand). The child runs with the same interpreter.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from kvdepot.server._kept_pool import journal_path, kept_pool_path
from kvdepot.server._pool import default_pool_dir
from kvdepot.server._stats import fetch_stats
from kvdepot.transport import StatsReply

#: How often a starting server is asked whether it answers (seconds).
_PROBE_INTERVAL = 0.1


class ServerStartError(RuntimeError):
    """The server process exited, or did not answer in time; the message holds its log's end."""


class ServerProcess:
    """One `kvdepot serve` process at ``address``; start and stop it as often as needed."""

    def __init__(
        self,
        address: str,
        *,
        capacity: str | None = None,
        args: Sequence[str] = ("--no-metrics",),
        log_path: str | os.PathLike[str] | None = None,
    ) -> None:
        self.address = address
        self.capacity = capacity
        self.args = list(args)
        self.log_path = Path(log_path) if log_path is not None else None
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def command(self) -> list[str]:
        command = [sys.executable, "-m", "kvdepot.server", "serve", "--address", self.address, *self.args]
        if self.capacity:
            command += ["--capacity", self.capacity]
        return command

    def start(self, timeout: float = 30.0) -> ServerProcess:
        """Start the process in its own session and return once it answers."""
        out = self.log_path.open("ab") if self.log_path is not None else subprocess.DEVNULL
        try:
            self.process = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                close_fds=True,
            )
        finally:
            if self.log_path is not None:
                out.close()  # type: ignore[union-attr]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerStartError(f"kvdepot serve exited with code {self.process.returncode}{self._log_tail()}")
            if self.answers():
                return self
            time.sleep(_PROBE_INTERVAL)
        self.kill()
        raise ServerStartError(
            f"kvdepot serve did not answer at {self.address} within {timeout:.0f} s{self._log_tail()}"
        )

    def answers(self, timeout: float = 0.5) -> bool:
        """Whether a server answers at the address (this process's or any other)."""
        try:
            self.stats(timeout)
        except Exception:
            return False
        return True

    def stats(self, timeout: float = 3.0) -> StatsReply:
        return fetch_stats(self.address, timeout=timeout)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (a clean stop that removes the socket; the pool stays for the next start
        unless the server runs with --no-keep-pool), then SIGKILL if needed."""
        if not self.alive():
            return
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def remove_kept_pool(self, pool_dir: str | os.PathLike[str] | None = None) -> bool:
        """Delete the pool (and journal) a stopped server of this address kept in `pool_dir`
        (default: the server's default); True when there was one. Never one in use."""
        if self.alive():
            raise ServerStartError("the server still runs; stop it first")
        path = kept_pool_path(Path(pool_dir) if pool_dir is not None else default_pool_dir(), self.address)
        found = path.exists()
        for gone in (path, journal_path(path)):
            gone.unlink(missing_ok=True)
        return found

    def kill(self) -> None:
        """SIGKILL the whole process group, as a crash would."""
        if self.alive():
            assert self.process is not None
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)

    def __enter__(self) -> ServerProcess:
        if not self.alive():
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self.kill()

    def _log_tail(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return f"; its log ends with:\n{self.log_path.read_text(errors='replace')[-2000:]}"
