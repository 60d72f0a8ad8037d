"""A local kvdepot server started on demand, shared by every vLLM process of the node."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import subprocess
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

from kvdepot.server import ServerProcess, ServerStartError, pid_alive
from kvdepot.transport import check_ipc_trusted, ipc_path

log = logging.getLogger("vllm.kvdepot.server")

#: How long to wait for a server this process started to answer (seconds).
START_TIMEOUT = 30.0
#: How long one probe of an existing server may take (seconds).
PROBE_TIMEOUT = 1.0
#: The pool of a server started on demand when no size is given (neither `kvdepot.capacity`
#: nor `--kv-offloading-size`): this, or half the available memory if that is less. The pool
#: is allocated in full at start, and vLLM's CPU backend refuses to start when it finds less
#: free memory than it means to use, so the server's own default (half the memory) is too much.
ON_DEMAND_CAPACITY = 4 << 30


def on_demand_capacity() -> str:
    """The capacity, in bytes, of a server started on demand with no size given."""
    from kvdepot.server import default_capacity

    return str(min(ON_DEMAND_CAPACITY, default_capacity()))


def server_answers(address: str, timeout: float = PROBE_TIMEOUT) -> bool:
    """Whether a kvdepot server answers at ``address`` within ``timeout``."""
    return ServerProcess(address).answers(timeout)


def ensure_server(address: str, *, capacity: str | None, timeout: float) -> None:
    """Start a detached local server at ``address`` unless one answers already.

    Several processes may race here (every vLLM engine of the node); an exclusive lock on a
    file beside the socket lets exactly one start the server while the others wait for it.
    The server is no descendant of the vLLM process that started it (a launcher starts it in
    a session of its own and exits), so stopping `vllm serve`, which kills its workers'
    process trees, leaves the server and its chunks to the next vLLM.
    """
    sock = ipc_path(address)
    if sock is not None:
        check_ipc_trusted(sock)  # creates its directory 0700, or refuses one another user controls
    if server_answers(address):
        return
    if sock is None:
        raise ValueError(f"kvdepot can only start a local server on an ipc:// address, not {address}")
    with os.fdopen(_open_private(sock.with_suffix(".start.lock"), os.O_RDWR), "r+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if server_answers(address):
            return
        capacity = capacity or on_demand_capacity()
        log_path = sock.with_suffix(".log")
        pid_fd = _open_private(pid_path(address), os.O_WRONLY)  # before the start: a trap here starts nothing
        with os.fdopen(pid_fd, "w") as pid_file:
            command = ServerProcess(address, capacity=capacity, args=()).command()
            pid = _start_detached(command, log_path)
            pid_file.truncate(0)
            pid_file.write(f"{pid}\n")
        deadline = time.monotonic() + max(START_TIMEOUT, timeout)
        while not server_answers(address):
            if not pid_alive(pid) or time.monotonic() > deadline:
                tail = log_path.read_text(errors="replace")[-2000:] if log_path.exists() else ""
                raise ServerStartError(f"the kvdepot server started at {address} did not answer; its log ends:\n{tail}")
            time.sleep(0.05)
        log.info("started a local kvdepot server at %s (capacity %s, pid %s, log %s)", address, capacity, pid, log_path)


def _open_private(path: Path, flags: int) -> int:
    """Open (creating, 0600) a file of the on-demand start, never through a symlink."""
    return os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def _start_detached(command: list[str], log_path: Path) -> int:
    """Start ``command`` in a session of its own, as no descendant of this process; its pid.

    A shell puts it in the background, prints its pid and exits, so the server is handed to
    init (or the nearest subreaper) at once. Its output goes to ``log_path`` (appended). It may
    run on every CPU of the node, whatever this thread is bound to (`_on_every_cpu`), and it
    gets none of the OpenMP settings vLLM gives its workers (`_without_openmp`).
    """
    log_fd = _open_private(log_path, os.O_WRONLY | os.O_APPEND)
    try:
        with _on_every_cpu():
            launcher = subprocess.run(
                ["/bin/sh", "-c", '"$@" </dev/null >&2 & echo $!', "kvdepot-launcher", *command],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=log_fd,
                start_new_session=True,
                env=_without_openmp(os.environ),
                check=True,
                timeout=30,
            )
    finally:
        os.close(log_fd)
    return int(launcher.stdout.strip())


@contextlib.contextmanager
def _on_every_cpu() -> Iterator[None]:
    """Let the calling thread, and so what it starts, run on every CPU this process may use.

    vLLM's CPU backend binds the thread that runs the model to its OpenMP cores, and threads and
    processes inherit that binding. A node-wide server that inherited it would share one core
    with the model's compute and answer late, seconds late on a busy machine. The kernel
    narrows the full set to the CPUs the process's cpuset allows; the thread's own binding is
    put back afterwards. To pin the server, start it yourself (`taskset -c ... kvdepot serve`).
    """
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    except OSError:  # nothing more is allowed: start it as we are
        yield
        return
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _without_openmp(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` less the OpenMP settings, which the server (no torch, no OpenMP) has no use for.

    vLLM's CPU backend preloads libgomp into its workers and sets GOMP_CPU_AFFINITY; inherited,
    the preloaded library binds the server's first thread to the model's first core as it
    loads, before any code of ours runs.
    """
    env = {k: v for k, v in environ.items() if not k.startswith(_OPENMP_PREFIXES)}
    preload = [p for p in environ.get("LD_PRELOAD", "").replace(":", " ").split() if not _is_openmp(p)]
    if preload:
        env["LD_PRELOAD"] = " ".join(preload)
    else:
        env.pop("LD_PRELOAD", None)
    return env


_OPENMP_PREFIXES = ("OMP_", "GOMP_", "KMP_")


def _is_openmp(library: str) -> bool:
    name = Path(library).name
    return name.startswith(("libgomp", "libiomp", "libomp"))


def pid_path(address: str) -> Path:
    """Where a server started on demand records its pid (beside its ipc socket)."""
    return Path(address[len("ipc://") :]).with_suffix(".pid")
