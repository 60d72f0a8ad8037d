"""Loggers for kvdepot's library code: silent until the application configures logging.

structlog's defaults print every event, debug included, to standard output. A program that
uses kvdepot's client or server classes (a router, a script, a test) and configured no logging
would see kvdepot's lines mixed into its own output. So a kvdepot module's logger goes through
structlog as configured once the application configured structlog (`kvdepot serve` does, and
the vLLM connector routes it into vLLM's logging), and otherwise through the standard
library's `logging`, under the module's name, where the "kvdepot" logger holds a
`NullHandler` (the library convention): nothing shows until the application adds a handler
or configures structlog.
"""

from __future__ import annotations

import logging
from typing import Any

import structlog

logging.getLogger("kvdepot").addHandler(logging.NullHandler())

_STDLIB_PROCESSORS: list[Any] = [
    structlog.stdlib.filter_by_level,
    structlog.processors.format_exc_info,
    structlog.processors.KeyValueRenderer(key_order=["event"]),
]


class LibraryLogger:
    """A structlog-style logger (``log.info("event", key=value)``, ``bind``) that picks its
    destination at each call, as above."""

    __slots__ = ("_context", "_name")

    def __init__(self, name: str, context: dict[str, Any] | None = None) -> None:
        self._name = name
        self._context = context or {}

    def bind(self, **values: Any) -> LibraryLogger:
        return LibraryLogger(self._name, {**self._context, **values})

    def _target(self) -> Any:
        if structlog.is_configured():
            logger = structlog.get_logger(self._name)
        else:
            logger = structlog.wrap_logger(
                logging.getLogger(self._name),
                processors=_STDLIB_PROCESSORS,
                wrapper_class=structlog.stdlib.BoundLogger,
            )
        return logger.bind(**self._context) if self._context else logger

    def __getattr__(self, method: str) -> Any:
        return getattr(self._target(), method)


def get_logger(name: str) -> Any:
    """The logger of module ``name`` (typed as structlog's are: Any)."""
    return LibraryLogger(name)
