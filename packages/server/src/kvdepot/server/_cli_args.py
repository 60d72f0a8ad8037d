"""What every `kvdepot` subcommand parses its arguments with, and the logging it configures.

Apart from `_cli.py`, so that the subcommands' modules (`_admin_cli.py`, `_query_cli.py`) and
the command table in `_cli.py` import it without importing each other.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO, TypeVar

import structlog

from kvdepot.server._errors import ServerArgumentError
from kvdepot.server._units import parse_size

T = TypeVar("T", int, float)


def configure_logging(fmt: str = "auto", level: str = "info", stream: str = "stdout") -> str:
    """Configure structlog once for the process: JSON unless the stream is a terminal.

    `stream` names the `sys` attribute to write to ("stdout" or "stderr"); it is looked up
    for every message, so a replaced `sys.stdout` (a test's capture) is followed.
    """

    def current() -> TextIO:
        out: TextIO = getattr(sys, stream)
        return out

    tty = current().isatty()
    if fmt == "auto":
        fmt = "pretty" if tty else "json"
    renderer: Any = structlog.processors.JSONRenderer() if fmt == "json" else structlog.dev.ConsoleRenderer(colors=tty)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.dict_tracebacks if fmt == "json" else structlog.dev.set_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=lambda *args: structlog.PrintLogger(current()),
        cache_logger_on_first_use=False,
    )
    return fmt


# -- argument types (argparse turns ValueError/ArgumentTypeError into exit code 2) ------


def size_arg(text: str) -> int:
    try:
        value = parse_size(text)
    except ServerArgumentError as exc:
        raise argparse.ArgumentTypeError(exc.message) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be more than 0 bytes")
    return value


def _number(text: str, convert: Callable[[str], T], kind: str) -> T:
    try:
        return convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {kind}") from None


def positive_int_arg(text: str) -> int:
    if (value := _number(text, int, "a whole number")) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value


def port_arg(text: str) -> int:
    if not 0 <= (value := _number(text, int, "a port number")) <= 65535:
        raise argparse.ArgumentTypeError(f"port {value} is outside 0-65535")
    return value


def seconds_arg(text: str) -> float:
    if not (value := _number(text, float, "a number of seconds")) > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be more than 0 seconds")
    return value


def add_log_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--log-format", choices=["auto", "json", "pretty"], default="auto", help="default: json unless a terminal"
    )
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info")


def read_secret_file(path: Path | None, option: str = "--auth-secret-file") -> str | None:
    """The shared secret in `path` (stripped), None without a path; a clear error if unreadable."""
    if path is None:
        return None
    try:
        return path.read_text().strip()
    except OSError as exc:
        raise ServerArgumentError(f"cannot read {option} {path}: {exc.strerror}", path=str(path)) from exc
