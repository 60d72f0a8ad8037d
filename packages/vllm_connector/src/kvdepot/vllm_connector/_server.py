"""A local kvdepot server started on demand, shared by every vLLM process of the node."""

from __future__ import annotations

import fcntl
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from kvdepot.transport import CacheClient

log = logging.getLogger("vllm.kvdepot.server")

#: How long to wait for a server this process started to answer (seconds).
START_TIMEOUT = 30.0
#: How long one probe of an existing server may take (seconds).
PROBE_TIMEOUT = 1.0


# Runs the `kvdepot` command line with this interpreter, whatever PATH holds.
_SERVE = "import sys; from kvdepot.server._cli import main; sys.exit(main(sys.argv[1:]))"


def server_answers(address: str, timeout: float = PROBE_TIMEOUT) -> bool:
    """Whether a kvdepot server answers a ping at ``address`` within ``timeout``."""
    client = CacheClient(address, timeout=timeout)
    try:
        client.ping().result(timeout=timeout + 0.5)
    except Exception:
        return False
    else:
        return True
    finally:
        client.close(end_session=False)


def ensure_server(address: str, *, capacity: str | None, timeout: float) -> None:
    """Start a detached local server at ``address`` unless one answers already.

    Several processes may race here (every vLLM engine of the node); an exclusive lock on a
    file beside the socket lets exactly one start the server while the others wait for it.
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
        command = [sys.executable, "-c", _SERVE, "serve", "--address", address, "--no-metrics"]
        if capacity:
            command += ["--capacity", capacity]
        log_path = sock.with_suffix(".log")
        with open(os.open(log_path, os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o600), "ab") as out:
            process = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True, close_fds=True
            )
        deadline = time.monotonic() + max(START_TIMEOUT, timeout)
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(
                    f"the kvdepot server started at {address} exited with code {process.returncode}; see {log_path}"
                )
            if server_answers(address, timeout=0.5):
                pid_path(address).write_text(f"{process.pid}\n")
                log.info(
                    "started a local kvdepot server at %s (capacity %s, pid %d, log %s)",
                    address,
                    capacity or "default",
                    process.pid,
                    log_path,
                )
                return
            time.sleep(0.1)
        raise RuntimeError(f"the kvdepot server started at {address} did not answer in time; see {log_path}")


def pid_path(address: str) -> Path:
    """Where a server started on demand records its pid (beside its ipc socket)."""
    return Path(address[len("ipc://") :]).with_suffix(".pid")
