"""The error tree of kvdepot. Every package roots its errors at `KVDepotError`."""

from __future__ import annotations

from typing import Any


class KVDepotError(Exception):
    """Root of every error kvdepot raises on purpose.

    Subclasses carry structured fields (passed as keyword arguments) besides the
    message, so callers and the wire protocol can act on them without parsing text.
    """

    def __init__(self, message: str, **fields: Any) -> None:
        super().__init__(message)
        self.message = message
        self.fields = fields

    def __getattr__(self, name: str) -> Any:
        fields = self.__dict__.get("fields", {})
        if name in fields:
            return fields[name]
        raise AttributeError(name)

    def __reduce__(self) -> Any:  # keep fields when copied
        return (_rebuild, (type(self), self.message, self.fields))


def _rebuild(cls: type[KVDepotError], message: str, fields: dict[str, Any]) -> KVDepotError:
    return cls(message, **fields)


class InvalidArgumentError(KVDepotError, ValueError):
    """A caller passed a value kvdepot cannot use (negative size, wrong type, ...)."""


class ParallelConfigError(InvalidArgumentError):
    """World size, rank, tensor- and pipeline-parallel sizes do not fit together."""


class InvalidTransitionError(KVDepotError):
    """A request tracker got an event its current state does not allow."""


class UnknownRequestError(KVDepotError, KeyError):
    """An operation named a request id the planner does not track."""

    def __str__(self) -> str:  # KeyError would quote the message
        return self.message
