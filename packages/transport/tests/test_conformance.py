"""The conformance suite of kvdepot.transport.testing, run against every transport."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvdepot.transport.testing import CHECKS, MemoryPair, TransportPair, ZmqPair

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

PAIRS: dict[str, Callable[[], TransportPair]] = {
    "memory": MemoryPair,
    "ipc": ZmqPair,
    "tcp": lambda: ZmqPair("tcp://127.0.0.1:0"),
}


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
@pytest.mark.parametrize("transport", list(PAIRS))
def test_conformance(transport: str, check: Callable[[Callable[[], TransportPair]], None]) -> None:
    """Each transport passes each check of the conformance suite."""
    check(PAIRS[transport])
