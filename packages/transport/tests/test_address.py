"""Addresses and their security defaults."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest

import kvdepot.transport as t
from kvdepot.transport._address import check_bind, is_loopback_tcp
from kvdepot.transport.testing import DictHandler, MemoryServerEndpoint


def test_default_address_uses_the_runtime_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The default is an ipc socket under $XDG_RUNTIME_DIR/kvdepot, else /tmp/kvdepot-UID."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert t.default_address() == f"ipc://{tmp_path}/kvdepot/kvdepot.sock"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert t.default_address().startswith("ipc:///tmp/kvdepot-")


@pytest.mark.parametrize(
    ("address", "loopback"),
    [
        ("tcp://127.0.0.1:1", True),
        ("tcp://[::1]:1", True),
        ("tcp://localhost:1", True),
        ("tcp://0.0.0.0:1", False),
        ("tcp://*:1", False),
        ("tcp://10.0.0.1:1", False),
    ],
)
def test_loopback_detection(address: str, loopback: bool) -> None:
    """Only loopback hosts count as local."""
    assert is_loopback_tcp(address) is loopback


def test_wide_tcp_binds_need_auth() -> None:
    """Binding beyond loopback without a secret is refused with a hint; with one it is allowed."""
    with pytest.raises(t.LocalProtocolError, match="auth_secret"):
        check_bind("tcp://0.0.0.0:5555", authenticated=False)
    check_bind("tcp://0.0.0.0:5555", authenticated=True)
    with pytest.raises(t.LocalProtocolError, match="unsupported"):
        check_bind("udp://x", authenticated=True)


@pytest.mark.integration
def test_ipc_socket_is_owner_only(tmp_path: Path) -> None:
    """The socket directory is 0o700 and the socket 0o600; a second server cannot steal it."""
    path = tmp_path / "run" / "kv.sock"
    endpoint = t.open_endpoint(f"ipc://{path}", DictHandler())
    try:
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        with pytest.raises(t.LocalProtocolError, match="already serving"):
            t.open_endpoint(f"ipc://{path}", DictHandler())
    finally:
        endpoint.close()
    assert not path.exists()


def test_memory_address_gives_a_memory_endpoint() -> None:
    """open_endpoint picks the in-memory transport for memory:// addresses, and names are exclusive."""
    endpoint = t.open_endpoint("memory://addr-test", DictHandler())
    try:
        assert isinstance(endpoint, MemoryServerEndpoint)
        with pytest.raises(t.LocalProtocolError, match="already bound"):
            t.open_endpoint("memory://addr-test", DictHandler())
    finally:
        endpoint.close()


def test_server_endpoint_refuses_a_memory_address() -> None:
    """The ZMQ endpoint class never turns into another one: memory:// goes through open_endpoint."""
    with pytest.raises(t.LocalProtocolError, match="open_endpoint"):
        t.ServerEndpoint("memory://addr-test-zmq", DictHandler())


# -- a client refuses a socket another local user could control ------------------------------

OTHER_UID = 4242  # a user that is not us (the tests chown to it, so they need root)
needs_root = pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root")


def test_a_missing_socket_directory_is_created_owner_only(tmp_path: Path) -> None:
    """A client to an address whose directory does not exist yet creates it 0700, so no other user can
    create it first and serve there."""
    sock = tmp_path / "run" / "kvdepot.sock"
    client = t.CacheClient(f"ipc://{sock}", timeout=0.5)
    client.close()
    assert stat.S_IMODE(sock.parent.stat().st_mode) == 0o700


@needs_root
def test_a_socket_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    """/tmp/kvdepot-UID made first by someone else (the default address without XDG_RUNTIME_DIR) is refused."""
    directory = tmp_path / "kvdepot-1000"
    directory.mkdir(mode=0o700)
    os.chown(directory, OTHER_UID, OTHER_UID)
    with pytest.raises(t.UntrustedAddressError, match="belongs to uid 4242"):
        t.CacheClient(f"ipc://{directory}/kvdepot.sock")


def test_a_socket_directory_others_can_write_is_refused(tmp_path: Path) -> None:
    """A directory anyone may write (and not sticky) lets anyone replace the socket: refused."""
    directory = tmp_path / "open"
    directory.mkdir()
    directory.chmod(0o777)
    with pytest.raises(t.UntrustedAddressError, match="others can write it"):
        t.CacheClient(f"ipc://{directory}/kvdepot.sock")


@needs_root
def test_a_socket_of_another_user_is_refused(tmp_path: Path) -> None:
    """A socket that another user's server made, even in a sticky shared directory, is refused."""
    directory = tmp_path / "shared"
    directory.mkdir()
    directory.chmod(0o1777)
    sock_path = directory / "kvdepot.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(str(sock_path))
        os.chown(sock_path, OTHER_UID, OTHER_UID)
        with pytest.raises(t.UntrustedAddressError, match="another user's server"):
            t.CacheClient(f"ipc://{sock_path}")
    finally:
        listener.close()
