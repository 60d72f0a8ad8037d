"""Errors of the kvdepot server, rooted at `kvdepot.core.KVDepotError`.

Each error that can reach a client carries `code`, the `ErrorReply.code` it travels as.
"""

from __future__ import annotations

from kvdepot.core import InvalidArgumentError, KVDepotError


class ServerError(KVDepotError):
    """Root of the errors the kvdepot server raises."""

    code = "internal"


class ServerArgumentError(ServerError, InvalidArgumentError):
    """A request or a command-line flag carried a value the server cannot use."""

    code = "invalid_argument"


class ChunkTooLargeError(ServerArgumentError):
    """A chunk does not fit in one page of the pool; the server needs a larger `--page-size`."""


class UnknownReservationError(ServerError):
    """A commit named a reservation this client does not hold (never made, expired or finished)."""

    code = "unknown_reservation"


class NotRegisteredError(ServerError):
    """A client sent a data request before `Register`."""

    code = "not_registered"


class StalePoolError(ServerError):
    """A reserve named the pool of another server instance (the client has not remapped yet)."""

    code = "stale_pool"


class LayoutConflictError(ServerError):
    """A Register named a layout the server already holds with other bytes."""

    code = "layout_conflict"


class AdminRefusedError(ServerError):
    """An administrative request (clear, set quota) from a peer that cannot prove it is the owner."""

    code = "unauthorized"


class TooManyError(ServerError):
    """A client holds more leases or reservations than the server allows one client."""

    code = "invalid_argument"


class PoolError(ServerError):
    """The shared-memory pool could not be created or mapped."""


class TierError(ServerError):
    """A tier below RAM (disk or remote) could not be set up or used."""


class TierConfigError(TierError, ServerArgumentError):
    """A tier's configuration (directory, capacity, URL, password source) cannot be used."""

    code = "invalid_argument"


class CorruptObjectError(TierError):
    """An object read from a tier below RAM failed its header or checksum check (`reason` says which).

    The tier counts it, deletes the object and reports a miss; it never reaches a client.
    """


class UnknownFormatError(TierError):
    """An object of a tier below RAM in a format this server does not read (`_tier_format`).

    Either a format version it does not know (a newer build wrote it), or an older version whose
    header names something else than the chunk asked for (`reason` says which). The tier counts
    it (``unknown_format``) and reports a miss, and never deletes the object: in a tier shared
    with servers of other builds, it is theirs.
    """
