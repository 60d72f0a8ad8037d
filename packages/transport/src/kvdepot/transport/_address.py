"""Addresses: the default ipc socket, owner-only permissions, and the rule for tcp binds."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import stat
from pathlib import Path

from kvdepot.transport._errors import LocalProtocolError, UntrustedAddressError

MEMORY_SCHEME = "memory://"
# sun_path is 108 bytes on Linux including the terminating NUL.
MAX_IPC_PATH = 107


def default_address() -> str:
    """`ipc://$XDG_RUNTIME_DIR/kvdepot/kvdepot.sock`, or `/tmp/kvdepot-$UID/kvdepot.sock`."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) / "kvdepot" if runtime and Path(runtime).is_dir() else Path(f"/tmp/kvdepot-{os.getuid()}")  # noqa: S108 (owner-only dir, checked in prepare_ipc_dir)
    return f"ipc://{base / 'kvdepot.sock'}"


def ipc_path(address: str) -> Path | None:
    """The socket file of an ipc:// address, else None."""
    if address.startswith("ipc://"):
        return Path(address[len("ipc://") :])
    return None


def prepare_ipc_dir(path: Path) -> None:
    """Creates the socket's directory owner-only (0o700) and refuses one others can write."""
    if len(str(path)) > MAX_IPC_PATH:
        raise LocalProtocolError(
            f"ipc socket path {str(path)!r} is longer than {MAX_IPC_PATH} bytes; choose a shorter path",
            path=str(path),
        )
    directory = path.parent
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = directory.stat()
    if st.st_uid != os.getuid():
        raise LocalProtocolError(
            f"the socket directory {directory} belongs to another user; choose an address in a directory you own",
            path=str(directory),
        )
    if stat.S_IMODE(st.st_mode) & 0o022:
        os.chmod(directory, 0o700)


def check_ipc_trusted(path: Path) -> None:
    """Refuses an ipc socket that another local user could have put there (a client's check).

    The socket's directory is created owner-only when missing, so no one else can create it
    first; an existing one must belong to this user (or root) and be writable by no one else
    unless sticky; an existing socket must belong to this user, as the server it reaches does.
    """
    directory = path.parent
    with contextlib.suppress(FileExistsError):
        directory.mkdir(mode=0o700, parents=True)
    uid = os.getuid()
    st = directory.stat()
    writable_by_others = stat.S_IMODE(st.st_mode) & 0o022 and not st.st_mode & stat.S_ISVTX
    if st.st_uid not in (uid, 0) or writable_by_others:
        raise UntrustedAddressError(
            f"the socket directory {directory} belongs to uid {st.st_uid} or others can write it, so another "
            "user could serve there in kvdepot's place; use an address in a directory only you own "
            "(mode 0700), or remove that directory",
            path=str(directory),
            owner=st.st_uid,
        )
    try:
        owner = os.lstat(path).st_uid
    except FileNotFoundError:
        return
    if owner != uid:
        raise UntrustedAddressError(
            f"the socket {path} belongs to uid {owner}, not to you: another user's server listens there; "
            "use another address",
            path=str(path),
            owner=owner,
        )


def check_not_in_use(path: Path) -> None:
    """Fails if a live server already listens on this ipc socket (binding would steal it)."""
    if not path.exists():
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(0.5)
        probe.connect(str(path))
    except OSError:
        return  # a stale file from a dead server; zmq replaces it
    finally:
        probe.close()
    raise LocalProtocolError(
        f"another process is already serving at ipc://{path}; stop it or choose another --address",
        path=str(path),
    )


def secure_ipc_socket(path: Path) -> None:
    """Makes the socket file readable and writable by its owner only (0o600)."""
    os.chmod(path, 0o600)


def is_loopback_tcp(address: str) -> bool:
    """True for tcp://127.x.x.x:port, tcp://[::1]:port and tcp://localhost:port."""
    host = address[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # '*', an interface name or a host name: not provably local


def check_bind(address: str, *, authenticated: bool) -> None:
    """Allows ipc://, inproc://, memory:// and loopback tcp; wider tcp binds need authentication."""
    if address.startswith(("ipc://", "inproc://", MEMORY_SCHEME)):
        return
    if address.startswith("tcp://"):
        if is_loopback_tcp(address) or authenticated:
            return
        raise LocalProtocolError(
            f"binding {address} would let other hosts reach the cache without authentication;"
            " bind tcp://127.0.0.1:PORT, or pass auth_secret=... (kvdepot serve --auth-secret-file ...)",
            address=address,
        )
    raise LocalProtocolError(
        f"unsupported address {address!r}; use ipc://PATH, tcp://HOST:PORT or memory://NAME", address=address
    )
