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
        with contextlib.suppress(FileNotFoundError, ValueError):
            _stop(int(_server.pid_path(address).read_text()), address)


def test_the_started_server_is_no_descendant_of_this_process(tmp_path: Path) -> None:
    """The server started on demand is handed to init at once: killing the starter's process tree
    (as `vllm serve` does to its workers on SIGTERM) cannot reach it."""
    address = f"ipc://{tmp_path}/s.sock"
    _server.ensure_server(address, capacity="16MiB", timeout=30)
    pid = int(_server.pid_path(address).read_text())
    try:
        assert pid not in {c.pid for c in _children(os.getpid())}
        assert ServerProcess(address).answers()
    finally:
        _stop(pid, address)


def _libgomp() -> str | None:
    import ctypes.util
    import importlib.util

    found = ctypes.util.find_library("gomp")
    if found:
        return found
    spec = importlib.util.find_spec("torch")
    bundled = Path(spec.origin).parent / "lib" / "libgomp.so.1" if spec and spec.origin else None
    return str(bundled) if bundled and bundled.exists() else None


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to tell a binding from none")
def test_the_started_server_is_not_bound_to_the_cpu_of_the_vllm_thread_that_started_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's CPU backend binds the thread that runs the model to one core, preloads libgomp and
    sets GOMP_CPU_AFFINITY. A server started from that thread must inherit none of it (it would
    share the core with the model's compute), and the thread gets its own binding back."""
    everything = os.sched_getaffinity(0)
    first = min(everything)
    libgomp = _libgomp()
    if libgomp:  # as vLLM's CPU workers run: a preloaded libgomp binds each new process's first thread
        monkeypatch.setenv("LD_PRELOAD", libgomp)
        monkeypatch.setenv("GOMP_CPU_AFFINITY", " ".join(map(str, sorted(everything))))
        monkeypatch.setenv("OMP_NUM_THREADS", str(len(everything)))
    address = f"ipc://{tmp_path}/s.sock"
    os.sched_setaffinity(0, {first})  # this thread only, as vLLM binds its model thread
    try:
        _server.ensure_server(address, capacity="16MiB", timeout=30)
        assert os.sched_getaffinity(0) == {first}
    finally:
        os.sched_setaffinity(0, everything)
    pid = int(_server.pid_path(address).read_text())
    try:
        assert os.sched_getaffinity(pid) >= everything
    finally:
        _stop(pid, address)


def test_the_openmp_settings_of_vllm_are_not_passed_to_the_server() -> None:
    environ = {
        "PATH": "/usr/bin",
        "LD_PRELOAD": "/x/libtcmalloc.so.4:/x/torch/lib/libgomp.so.1 /x/libiomp5.so",
        "GOMP_CPU_AFFINITY": "0 1",
        "OMP_NUM_THREADS": "2",
        "KMP_AFFINITY": "granularity=fine",
    }
    assert _server._without_openmp(environ) == {"PATH": "/usr/bin", "LD_PRELOAD": "/x/libtcmalloc.so.4"}
    assert "LD_PRELOAD" not in _server._without_openmp({"LD_PRELOAD": "/x/libgomp.so.1"})


def _stop(pid: int, address: str) -> None:
    """Stop a server started on demand (SIGTERM: a clean stop keeps its pool for the next start),
    then remove the pool it kept: a test leaves nothing in /dev/shm."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    with contextlib.suppress(Exception):
        import psutil

        psutil.Process(pid).wait(timeout=30)
    ServerProcess(address).remove_kept_pool()


def _children(pid: int) -> list:
    import psutil

    return psutil.Process(pid).children(recursive=True)


@pytest.mark.parametrize("name", ["s.start.lock", "s.log", "s.pid"])
def test_the_files_of_the_on_demand_start_are_never_opened_through_a_symlink(tmp_path: Path, name: str) -> None:
    """A symlink planted where the start writes its lock, log or pid file is refused, and the file it
    points to is left as it was."""
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (tmp_path / name).symlink_to(victim)
    address = f"ipc://{tmp_path}/s.sock"
    try:
        with pytest.raises(OSError, match="symbolic links"):
            _server.ensure_server(address, capacity="16MiB", timeout=30)
        assert victim.read_text() == "precious\n"
    finally:
        if name != "s.pid" and _server.pid_path(address).exists():
            with contextlib.suppress(ValueError):
                _stop(int(_server.pid_path(address).read_text()), address)
        for proc in _children(os.getpid()):
            with contextlib.suppress(Exception):
                proc.kill()
