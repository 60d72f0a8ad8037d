"""The settings an operator changes while the server runs, kept across restarts.

Today that is the quotas `kvdepot quota set` and `unset` give salts. The server reads the file
at start and applies it before it answers anyone; every change is written to the file before
it takes effect, so a change the operator was told about survives a restart, a crash or a
kill. The file is JSON, of the server's user alone (mode 0600, in a 0700 directory: it names
tenants' salts), replaced whole on each change, and carries the version of its format:
a server refuses to start on a file of a newer format than it reads, rather than lose what
it cannot read.

Flags (``--default-quota``, capacities, addresses) are not kept here: they are the operator's
command line or unit file, read again at each start.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Annotated

import msgspec

from kvdepot.server._errors import ServerArgumentError, ServerError
from kvdepot.server._owner_file import OwnerFileProblem, read_owner_only, write_owner_only
from kvdepot.transport import get_logger

log = get_logger(__name__)

FLAG = "--settings-file"
#: The format this server writes; it reads this one and every older one.
SETTINGS_VERSION = 1
#: The largest settings file read or written (a quota is a salt and a number: thousands fit in 1 MiB).
MAX_SETTINGS_BYTES = 16 << 20


class SettingsFileError(ServerArgumentError):
    """The settings file cannot be used: the server does not start (fields ``path``, ``reason``)."""


class SettingsNotSavedError(ServerError):
    """A change could not be written to the settings file, so it was not made (field ``path``)."""


class _Settings(msgspec.Struct, forbid_unknown_fields=True):
    version: Annotated[int, msgspec.Meta(ge=1)]
    quotas: dict[str, Annotated[int, msgspec.Meta(ge=0)]] = {}


def default_settings_path(address: str) -> Path:
    """``$XDG_STATE_HOME/kvdepot/settings/<digest of the address>.json`` (or under
    ``~/.local/state``): one file per server address, so that servers of one user on other
    addresses keep settings of their own."""
    state = os.environ.get("XDG_STATE_HOME", "")
    base = Path(state) if os.path.isabs(state) else Path.home() / ".local" / "state"
    name = hashlib.sha256(address.encode()).hexdigest()[:16]
    return base / "kvdepot" / "settings" / f"{name}.json"


class SettingsFile:
    """The settings file at ``path``; None keeps the settings in memory only (lost at a restart)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path

    def load_quotas(self) -> dict[str, int]:
        """The quotas in the file (none when there is no file yet)."""
        if self.path is None:
            return {}
        try:
            data = read_owner_only(self.path, MAX_SETTINGS_BYTES + 1)
        except OwnerFileProblem as exc:
            raise self._error(exc.what, exc.reason, **exc.fields) from exc
        if data is None:
            log.info("settings_file", path=str(self.path), quotas=0)
            return {}
        if len(data) > MAX_SETTINGS_BYTES:
            raise self._error(f"is larger than {MAX_SETTINGS_BYTES} bytes", "too_large")
        try:
            version = msgspec.json.decode(data, type=dict[str, object]).get("version")
        except msgspec.DecodeError as exc:
            raise self._error(f"is not a settings file ({exc})", "malformed") from exc
        if isinstance(version, int) and version > SETTINGS_VERSION:
            raise self._error(
                f"is of format {version}, written by a newer kvdepot; this one reads formats up to "
                f"{SETTINGS_VERSION}. Start the newer kvdepot, or move the file away (its quotas are then lost)",
                "newer_format",
            )
        try:
            settings = msgspec.json.decode(data, type=_Settings)
        except msgspec.ValidationError as exc:
            raise self._error(f"is not a settings file ({exc})", "malformed") from exc
        log.info("settings_file", path=str(self.path), quotas=len(settings.quotas))
        return dict(settings.quotas)

    def save_quotas(self, quotas: dict[str, int]) -> None:
        """Write ``quotas`` as the file's whole content, or raise `SettingsNotSavedError`."""
        if self.path is None:
            return
        data = msgspec.json.encode(_Settings(version=SETTINGS_VERSION, quotas=dict(sorted(quotas.items()))))
        if len(data) > MAX_SETTINGS_BYTES:
            raise SettingsNotSavedError(
                f"the settings would take more than {MAX_SETTINGS_BYTES} bytes; remove quotas first",
                path=str(self.path),
            )
        try:
            write_owner_only(self.path, data, replace=True)
        except OwnerFileProblem as exc:
            raise SettingsNotSavedError(
                f"the settings file {self.path} {exc.what}, so the change was not made", path=str(self.path)
            ) from exc

    def _error(self, what: str, reason: str, **fields: object) -> SettingsFileError:
        return SettingsFileError(
            f"the settings file {self.path} {what}; fix it, or pass {FLAG} with another file (or `none`)",
            path=str(self.path),
            reason=reason,
            **fields,
        )
