"""The server's salt-label key: random bytes in a file of the server's user alone, made at its
first start and read at every start after, so that salt labels (`kvdepot.core.SaltLabeler`)
stay the same across restarts and nobody without the file can tell which salt a label names.

The file lives under the user's state directory, not the runtime directory (which a reboot
empties). Deleting it rotates the labels: the next start makes a new key. `kvdepot label`
prints a salt's label from it.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from pathlib import Path

from kvdepot.core import LABEL_KEY_BYTES, SaltLabeler
from kvdepot.server._errors import ServerArgumentError
from kvdepot.server._owner_file import OwnerFileProblem, read_owner_only, write_owner_only
from kvdepot.transport import get_logger

log = get_logger(__name__)

FLAG = "--label-key-file"
FILE_NAME = "salt-label.key"
# Bytes read of a key file at most: a key is LABEL_KEY_BYTES; more says the file is something else.
_READ_LIMIT = 4 * LABEL_KEY_BYTES


class LabelKeyError(ServerArgumentError):
    """The salt-label key file is not the server's user's alone, is not a key, or cannot be read
    or made: the server does not start (fields ``path``, ``reason``)."""


def default_label_key_path() -> Path:
    """``$XDG_STATE_HOME/kvdepot/salt-label.key``, or ``~/.local/state/kvdepot/salt-label.key``."""
    state = os.environ.get("XDG_STATE_HOME", "")
    base = Path(state) if os.path.isabs(state) else Path.home() / ".local" / "state"
    return base / "kvdepot" / FILE_NAME


def random_labeler() -> SaltLabeler:
    """A labeler with a key of its own, kept nowhere: labels no one else can make or reverse."""
    return SaltLabeler(secrets.token_bytes(LABEL_KEY_BYTES))


def server_labeler(path: Path | None) -> SaltLabeler:
    """The server's labeler, keyed by the file at ``path`` (None: `default_label_key_path()`),
    made there at the first start. A file at the default place that cannot be made (a user
    without a home directory) leaves the server a key of this run alone, with a warning: labels
    then change at every restart. Any other problem is a `LabelKeyError`: no start."""
    try:
        return SaltLabeler(load_label_key(path if path is not None else default_label_key_path()))
    except LabelKeyError as exc:
        if path is not None or exc.reason != "cannot_create":
            raise
        log.warning("label_key_not_kept", path=exc.path, reason=exc.message)
    except RuntimeError as exc:  # Path.home(): no HOME and no home directory in the user database
        log.warning("label_key_not_kept", reason=f"no state directory ({exc}); pass {FLAG} PATH")
    return random_labeler()


def load_label_key(path: Path, *, create: bool = True) -> bytes:
    """The key in ``path``; with ``create``, a new random one written there (mode 0600, in a
    0700 directory) if there is none yet. A file that another user owns, that others may read,
    or that does not hold exactly `LABEL_KEY_BYTES` bytes is refused with `LabelKeyError`."""
    key = _read(path)
    if key is None and create:
        _create(path)
        key = _read(path)
    if key is None:
        raise LabelKeyError(
            f"there is no salt-label key file {path}: start `kvdepot serve` (which makes it), or pass {FLAG}",
            path=str(path),
            reason="missing",
        )
    return key


def _read(path: Path) -> bytes | None:
    try:
        key = read_owner_only(path, _READ_LIMIT)
    except OwnerFileProblem as exc:
        what = (
            exc.what + ": anyone who reads it can tell which salt each label names"
            if exc.reason == "unsafe"
            else exc.what
        )
        raise _error(path, what, exc.reason, **exc.fields) from exc
    if key is not None and len(key) != LABEL_KEY_BYTES:
        raise _error(path, f"holds {len(key)} bytes, not a key of {LABEL_KEY_BYTES}", "malformed")
    return key


def _create(path: Path) -> None:
    """Write a new key to ``path`` whole, so that a server starting at the same moment reads
    either no file or the whole key, and only one key wins."""
    try:
        write_owner_only(path, secrets.token_bytes(LABEL_KEY_BYTES), replace=False)
    except OwnerFileProblem as exc:
        raise _error(path, exc.what, exc.reason) from exc


def _error(path: Path, what: str, reason: str, **fields: object) -> LabelKeyError:
    return LabelKeyError(
        f"the salt-label key file {path} {what}; fix it, delete it (the next start makes a new key, and "
        f"every salt label changes once), or pass {FLAG} PATH",
        path=str(path),
        reason=reason,
        **fields,
    )


# -- the flag, and `kvdepot label` --------------------------------------------------------


def add_flag(parser: argparse.ArgumentParser, text: str) -> None:
    """`--label-key-file PATH` (None: the default place)."""
    try:
        default = str(default_label_key_path())
    except RuntimeError:  # no home directory
        default = f"$XDG_STATE_HOME/kvdepot/{FILE_NAME}"
    parser.add_argument(FLAG, type=Path, default=None, metavar="PATH", help=f"{text} (default {default})")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "salts",
        nargs="*",
        metavar="SALT",
        help="a cache_salt (none: one per line on stdin, which other users cannot read in the process list)",
    )
    add_flag(parser, "the key file of the server whose labels to print")


def run(args: argparse.Namespace) -> int:
    """Each salt's label under the server's key (read, never made: no key, no label)."""
    try:
        labeler = SaltLabeler(load_label_key(args.label_key_file or default_label_key_path(), create=False))
    except (ServerArgumentError, RuntimeError) as exc:
        sys.stderr.write(f"kvdepot label: {getattr(exc, 'message', None) or exc}\n")
        return 1
    salts = args.salts or [line.rstrip("\n") for line in sys.stdin]
    for salt in salts:
        sys.stdout.write(f"{labeler(salt)}\n")
    return 0
