"""A local kvdepot server started on demand, shared by every vLLM process of the node."""

from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path

from kvdepot.server import ServerProcess

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
    The server runs in its own session, so it outlives the vLLM process that started it.
    """
    if server_answers(address):
        return
    if not address.startswith("ipc://"):
        raise ValueError(f"kvdepot can only start a local server on an ipc:// address, not {address}")
    sock = Path(address[len("ipc://") :])
    sock.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    lock_path = sock.with_suffix(".start.lock")
    with open(os.open(lock_path, os.O_CREAT | os.O_RDWR, 0o600), "r+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if server_answers(address):
            return
        capacity = capacity or on_demand_capacity()
        server = ServerProcess(address, capacity=capacity, args=(), log_path=sock.with_suffix(".log"))
        server.start(timeout=max(START_TIMEOUT, timeout))
        pid_path(address).write_text(f"{server.pid}\n")
        log.info(
            "started a local kvdepot server at %s (capacity %s, pid %s, log %s)",
            address,
            capacity,
            server.pid,
            server.log_path,
        )


def pid_path(address: str) -> Path:
    """Where a server started on demand records its pid (beside its ipc socket)."""
    return Path(address[len("ipc://") :]).with_suffix(".pid")
