"""On ipc, each side lets in only a peer of its own user or root (SO_PEERCRED, checked in ZAP).

The peers of another user are real processes that drop to another uid, so these tests need
root; the socket directory is opened to everyone on purpose, as a careless operator might.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from kvdepot.transport import CacheClient, ServerEndpoint, TransportError, open_endpoint
from kvdepot.transport._peercred import ZAP_DOMAIN, PeerUserCheck, peer_uid
from kvdepot.transport.testing import DictHandler

OTHER_UID = 65534  # nobody
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="running a peer as another user needs root")


def test_peer_uid_reads_the_credentials_libzmq_passes():
    assert peer_uid(b"localhost:1000:1000:4242") == 1000
    assert peer_uid(b"127.0.0.1") is None
    assert peer_uid(b"") is None


def as_other_user(code: str) -> subprocess.Popen[str]:
    """`code` in a Python process running as OTHER_UID."""
    # Imports first: the other user may not read this interpreter's files.
    prelude = f"import os, zmq\nos.setgroups([])\nos.setgid({OTHER_UID})\nos.setuid({OTHER_UID})\n"
    return subprocess.Popen([sys.executable, "-c", prelude + textwrap.dedent(code)], stdout=subprocess.PIPE, text=True)


@pytest.fixture
def open_dir() -> Iterator[Path]:
    # A directory another user can reach: every ancestor must be searchable by others.
    bases = [b for b in ("/var/tmp", "/dev/shm", tempfile.gettempdir()) if _reachable(Path(b))]
    if not bases:
        pytest.skip("no directory here that another user can reach")
    with tempfile.TemporaryDirectory(dir=bases[0]) as d:
        os.chmod(d, 0o1777)
        yield Path(d)


def _reachable(path: Path) -> bool:
    return path.is_dir() and all(p.stat().st_mode & 0o001 for p in [path, *path.parents])


def serve(address: str) -> tuple[ServerEndpoint, threading.Thread]:
    endpoint = open_endpoint(address, DictHandler())
    thread = threading.Thread(target=endpoint.serve_forever, daemon=True)
    thread.start()
    return endpoint, thread


def stop(endpoint: ServerEndpoint, thread: threading.Thread) -> None:
    endpoint.stop()
    thread.join(10)
    endpoint.close()


@needs_root
def test_the_server_refuses_a_client_of_another_user_in_the_handshake(open_dir):
    """A client of another user that can reach the socket gets no request through; this user's
    client is served."""
    address = f"ipc://{open_dir}/run/s.sock"
    endpoint, thread = serve(address)
    try:
        os.chmod(open_dir / "run", 0o755)  # a careless operator opens the socket to everyone
        os.chmod(open_dir / "run" / "s.sock", 0o777)
        peer = as_other_user(
            f"""
            import zmq
            sock = zmq.Context().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect({address!r})
            sock.send(b"anything")
            print("answered" if sock.poll(3000) else "refused", flush=True)
            """
        )
        out, _ = peer.communicate(timeout=30)
        assert out.strip() == "refused"
        assert endpoint._peer_check is not None
        assert endpoint._peer_check.refused >= 1
        with CacheClient(address, timeout=5) as client:  # this user's client is still served
            assert client.ping().result(5) is not None
    finally:
        stop(endpoint, thread)


@needs_root
def test_a_client_refuses_a_server_of_another_user_in_the_handshake(open_dir):
    """A process of another user serving at the path gets nothing from this user's socket."""
    address = f"ipc://{open_dir}/s.sock"
    server = as_other_user(
        f"""
        import zmq
        sock = zmq.Context().socket(zmq.ROUTER)
        sock.bind({address!r})
        print("bound", flush=True)
        got = sock.poll(5000)
        print("received" if got else "nothing", flush=True)
        """
    )
    assert server.stdout is not None
    assert server.stdout.readline().strip() == "bound"
    ctx = zmq.Context()
    check = PeerUserCheck(ctx, "client")
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_SUCCEEDED)
    try:
        sock.connect(address)
        sock.send(b"a chunk's bytes")  # queued: never sent to a peer the handshake refused
        deadline = time.monotonic() + 10
        while check.refused == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert check.refused >= 1
        assert server.communicate(timeout=30)[0].strip() == "nothing"
    finally:
        monitor.close(0)
        sock.close(0)
        check.close()
        ctx.term()


def test_cache_client_over_ipc_is_served_by_its_own_users_server(tmp_path):
    """The check lets this user's server in: the ordinary path works with the handshake check on."""
    address = f"ipc://{tmp_path}/s.sock"
    endpoint, thread = serve(address)
    try:
        with CacheClient(address, timeout=5) as client:
            assert client.ping().result(5) is not None
    except TransportError as exc:  # pragma: no cover - the failure this test exists to catch
        pytest.fail(f"refused its own server: {exc}")
    finally:
        stop(endpoint, thread)
