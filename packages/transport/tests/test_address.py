"""Addresses and their security defaults."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

import kvdepot.transport as t
from kvdepot.transport._address import check_bind, is_loopback_tcp


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
    endpoint = t.ServerEndpoint(f"ipc://{path}", t.DictHandler())
    try:
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        with pytest.raises(t.LocalProtocolError, match="already serving"):
            t.ServerEndpoint(f"ipc://{path}", t.DictHandler())
    finally:
        endpoint.close()
    assert not path.exists()


def test_memory_address_gives_a_memory_endpoint() -> None:
    """ServerEndpoint picks the in-memory transport for memory:// addresses, and names are exclusive."""
    endpoint = t.ServerEndpoint("memory://addr-test", t.DictHandler())
    try:
        assert isinstance(endpoint, t.MemoryServerEndpoint)
        with pytest.raises(t.LocalProtocolError, match="already bound"):
            t.ServerEndpoint("memory://addr-test", t.DictHandler())
    finally:
        endpoint.close()
