"""Where the remote tier is: a URL, and a password that never needs to be on the command line.

    redis://[user:password@]host[:port][/db]        one Valkey or Redis server
    rediss://...                                    the same over TLS
    redis+cluster://[user:password@]host:port[,host:port...]    a cluster (any of its nodes)
    rediss+cluster://...                            a cluster over TLS

``valkey``/``valkeys`` are accepted for ``redis``/``rediss``. A password in the URL works but
shows in `ps`; give it from a file (``password_file``) or an environment variable
(``password_env``) instead. Pure parsing: nothing here connects.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import unquote

import attrs

from kvdepot.server._errors import TierConfigError

DEFAULT_PORT = 6379
_SCHEMES = {
    "redis": (False, False),
    "valkey": (False, False),
    "rediss": (True, False),
    "valkeys": (True, False),
    "redis+cluster": (False, True),
    "valkey+cluster": (False, True),
    "rediss+cluster": (True, True),
    "valkeys+cluster": (True, True),
}
_HOST_PORT = re.compile(r"^(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<host>[A-Za-z0-9._-]+))(?::(?P<port>[0-9]{1,5}))?$")


@attrs.frozen(repr=False)
class RemoteAddress:
    """A parsed remote-tier URL. Its repr and `display` never show the password."""

    nodes: tuple[tuple[str, int], ...]
    cluster: bool
    tls: bool
    db: int = 0
    username: str | None = None
    password: str | None = None

    @property
    def display(self) -> str:
        """The URL without credentials, for logs and stats."""
        scheme = ("rediss" if self.tls else "redis") + ("+cluster" if self.cluster else "")
        hosts = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.nodes)
        return f"{scheme}://{hosts}" + (f"/{self.db}" if self.db else "")

    def __repr__(self) -> str:
        return f"RemoteAddress({self.display!r})"


def _read_password(
    password: str | None, password_file: str | os.PathLike[str] | None, password_env: str | None
) -> str | None:
    if password is not None:
        return password
    if password_file is not None:
        try:
            text = Path(password_file).read_text()
        except OSError as exc:
            raise TierConfigError(
                f"cannot read the remote tier's password file {password_file}: {exc.strerror}", path=str(password_file)
            ) from exc
        return text.rstrip("\r\n")
    if password_env is not None:
        value = os.environ.get(password_env)
        if value is None:
            raise TierConfigError(
                f"the environment variable {password_env} (the remote tier's password) is not set", name=password_env
            )
        return value
    return None


# The URL is split by hand, not with urllib.parse.urlsplit: urlsplit ends the host part at "/" or
# "#" (a password may hold either unquoted), drops tabs and newlines anywhere, and on current
# Pythons refuses a cluster's node list with an IPv6 node after the first ("Invalid IPv6 URL").
def parse_remote_url(
    url: str,
    *,
    password: str | None = None,
    password_file: str | os.PathLike[str] | None = None,
    password_env: str | None = None,
) -> RemoteAddress:
    """Parse ``url``; a password given here (directly, from a file, or from the environment, in that
    order) replaces one in the URL. Raises `TierConfigError` on anything it cannot use."""
    tls, cluster, rest = _scheme(url)
    rest, _, query = rest.partition("?")
    if query:
        raise TierConfigError("the remote tier URL takes no query options", url=_redact(url))
    userinfo, _, hostpart = rest.rpartition("@")  # a password may hold "@", "/" or "#" unquoted
    hostpart, _, path = hostpart.partition("/")
    db = _database(path, cluster)
    nodes = tuple(_node(item) for item in hostpart.split(","))
    if len(nodes) > 1 and not cluster:
        raise TierConfigError("several hosts need a cluster URL: redis+cluster://h1:p1,h2:p2", url=_redact(url))
    user, colon, secret = userinfo.partition(":")
    return RemoteAddress(
        nodes=nodes,
        cluster=cluster,
        tls=tls,
        db=db,
        username=unquote(user) or None,
        password=_read_password(password, password_file, password_env) or (unquote(secret) if colon else None),
    )


def _scheme(url: str) -> tuple[bool, bool, str]:
    """(TLS, cluster, the rest of the URL after ``://``)."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in _SCHEMES:
        raise TierConfigError(
            f"cannot use {_redact(url)!r} as a remote tier; write redis://host:port, rediss://host:port "
            "or redis+cluster://host:port[,host:port...]",
            url=_redact(url),
        )
    tls, cluster = _SCHEMES[scheme.lower()]
    return tls, cluster, rest


def _database(path: str, cluster: bool) -> int:
    """The database number the URL's path names (0 for none)."""
    if not path:
        return 0
    if not (path.isascii() and path.isdigit()):  # "²".isdigit() is true, and int() refuses it
        raise TierConfigError(f"the database in the remote tier URL must be a number, got {path!r}", db=path)
    db = int(path)
    if cluster and db:
        raise TierConfigError("a cluster has only database 0; drop /N from the URL", db=db)
    return db


def _node(item: str) -> tuple[str, int]:
    """(host, port) of one ``host[:port]`` or ``[v6][:port]`` of the URL's host list."""
    match = _HOST_PORT.match(item.strip())
    if match is None:
        raise TierConfigError(f"cannot read {item!r} as host:port in the remote tier URL", node=item)
    port = int(match.group("port") or DEFAULT_PORT)
    if not 0 < port < 65536:
        raise TierConfigError(f"port {port} is out of range", port=port)
    return match.group("v6") or match.group("host"), port


def _redact(url: str) -> str:
    """``url`` with any user:password part replaced, for error messages."""
    head, at, hosts = url.rpartition("@")  # whatever comes before the last "@" may hold a secret
    if not at:
        return url
    scheme, sep, _ = head.partition("://")
    return f"{scheme}{sep}***@{hosts}" if sep else f"***@{hosts}"
