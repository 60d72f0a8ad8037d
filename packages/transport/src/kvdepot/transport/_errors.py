"""Errors of kvdepot.transport, rooted at `TransportError` (itself a `KVDepotError`).

Whose fault is it: `LocalProtocolError` (this process misused the API or tried to send
something invalid) versus `RemoteProtocolError` (the peer sent something we cannot accept);
`TransportClosedError` (you closed it) versus `TransportBrokenError` (the peer or the network
failed). `RemoteError` and its subclasses carry an `ErrorReply` from the server; a server
handler may raise the very same classes to produce that reply.
"""

from __future__ import annotations

from typing import Any, ClassVar

from kvdepot.core import InvalidArgumentError, KVDepotError

# The error codes of ErrorReply.code (docs/protocol.md lists what each means).
CODE_PROTOCOL = "protocol"
CODE_VERSION_MISMATCH = "version_mismatch"
CODE_TOO_LARGE = "too_large"
CODE_HELLO_REQUIRED = "hello_required"
CODE_UNAUTHORIZED = "unauthorized"
CODE_UNKNOWN_RESERVATION = "unknown_reservation"
CODE_UNKNOWN_LEASE = "unknown_lease"
CODE_NOT_REGISTERED = "not_registered"
CODE_INVALID_ARGUMENT = "invalid_argument"
CODE_POOL_FULL = "pool_full"
CODE_INTERNAL = "internal"
CODE_STALE_POOL = "stale_pool"
CODE_LAYOUT_CONFLICT = "layout_conflict"


class TransportError(KVDepotError):
    """Root of every error of kvdepot.transport."""


class LocalProtocolError(TransportError):
    """This process broke the protocol: an invalid message or a misuse of the API."""


class UntrustedAddressError(LocalProtocolError):
    """The address is a socket another local user could control (fields `path`, `owner`)."""


class RemoteProtocolError(TransportError):
    """The peer sent a frame that does not decode into the expected message."""


class FrameTooLargeError(TransportError):
    """A frame is larger than the configured bound (fields `size`, `limit`)."""


class DeadlineExceededError(TransportError, TimeoutError):
    """No reply came before the request's deadline (fields `address`, `timeout`, `request`)."""


class TransportClosedError(TransportError):
    """The client or endpoint was closed by this process; no more requests go through it."""


class TransportBrokenError(TransportError):
    """The connection failed under a request in flight; the request may or may not have run."""


class RemoteError(TransportError):
    """The server answered with an error reply. `code` names the kind; fields carry details."""

    code: ClassVar[str] = ""

    def __init__(self, message: str, *, code: str | None = None, **fields: Any) -> None:
        super().__init__(message, **fields)
        if code is not None and code != type(self).code:
            self.__dict__["code"] = code  # an unknown code keeps its wire name


class BadRequestError(RemoteError):
    """The server could not decode or accept our frame (code `protocol`)."""

    code = CODE_PROTOCOL


class VersionMismatchError(RemoteError):
    """Client and server speak different protocol versions (fields `client_version`, `server_version`)."""

    code = CODE_VERSION_MISMATCH


class RequestTooLargeError(RemoteError):
    """The server refused a frame above its size bound (fields `size`, `limit`)."""

    code = CODE_TOO_LARGE


class HelloRequiredError(RemoteError):
    """The server does not know this client (it restarted): the client must say Hello again."""

    code = CODE_HELLO_REQUIRED


class UnauthorizedError(RemoteError):
    """The shared secret in Hello was missing or wrong."""

    code = CODE_UNAUTHORIZED


class UnknownReservationError(RemoteError):
    """The reservation id is unknown, expired, or already committed or aborted."""

    code = CODE_UNKNOWN_RESERVATION


class UnknownLeaseError(RemoteError):
    """The lease id is unknown, expired or already released."""

    code = CODE_UNKNOWN_LEASE


class NotRegisteredError(RemoteError):
    """The request needs a Register first."""

    code = CODE_NOT_REGISTERED


class RemoteInvalidArgumentError(RemoteError, InvalidArgumentError):
    """The server rejected a value of the request."""

    code = CODE_INVALID_ARGUMENT


class PoolFullError(RemoteError):
    """The pool cannot hold what was asked, even after eviction."""

    code = CODE_POOL_FULL


class StalePoolError(RemoteError):
    """The request names another server instance's pool: map the pool of the current server first."""

    code = CODE_STALE_POOL


class LayoutConflictError(RemoteError):
    """A registration's layout name is already held with other bytes (fingerprint or chunk size)."""

    code = CODE_LAYOUT_CONFLICT


class InternalServerError(RemoteError):
    """The server failed while handling the request; its log has the traceback."""

    code = CODE_INTERNAL


#: ErrorReply.code -> the exception class a client raises for it.
ERROR_CLASSES: dict[str, type[RemoteError]] = {
    cls.code: cls
    for cls in (
        BadRequestError,
        VersionMismatchError,
        RequestTooLargeError,
        HelloRequiredError,
        UnauthorizedError,
        UnknownReservationError,
        UnknownLeaseError,
        NotRegisteredError,
        RemoteInvalidArgumentError,
        PoolFullError,
        StalePoolError,
        LayoutConflictError,
        InternalServerError,
    )
}
ERROR_CODES = frozenset(ERROR_CLASSES)


def remote_error(code: str, message: str, fields: dict[str, Any] | None = None) -> RemoteError:
    """The exception for an error reply; unknown codes give a plain `RemoteError`."""
    cls = ERROR_CLASSES.get(code, RemoteError)
    safe = {k: v for k, v in (fields or {}).items() if k not in ("code", "message")}
    return cls(message, code=code, **safe)
