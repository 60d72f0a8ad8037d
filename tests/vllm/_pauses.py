"""Acting between an engine's prompts (`pause_after`), and waiting for what a running engine does.

An engine runs in its own process at its own speed. A test that checks what the engine does
after a change (a server restart, a clear) pauses it there with `busy_prompt` set, so it keeps
stepping, and waits with `until` for the outcome, however slow the machine is, up to a bound.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

# How long a test waits for an engine's outcome at most: a bound against a hang, not a speed check.
WAIT_S = 180.0


class Pauses:
    """Lets a test act between two prompts of an engine run (`pause_after`)."""

    def __init__(self, where: Path) -> None:
        self.where = where

    def wait(self, name: str, timeout: float = 300.0) -> None:
        until((self.where / f"{name}.paused").exists, f"the engine never reached pause {name!r}", timeout)

    def go(self, name: str) -> None:
        (self.where / f"{name}.go").touch()


def until(probe: Callable[[], T], what: str, timeout: float = WAIT_S) -> T:
    """`probe()`'s first true value, asked every 0.1 s; fails with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not (value := probe()):
        assert time.monotonic() < deadline, what
        time.sleep(0.1)
    return value
