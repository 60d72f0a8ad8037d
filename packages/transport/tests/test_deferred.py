"""A handler may answer a request later (`Deferred`): the endpoint sends nothing for it, other
requests are answered meanwhile, and `send_deferred` delivers the reply to the right future."""

from __future__ import annotations

import time

import pytest

from kvdepot.transport import CacheClient, Deferred, PeerInfo, Waker, open_endpoint
from kvdepot.transport._messages import ErrorReply, RequestBody, Stats, StatsReply
from kvdepot.transport.testing import DictHandler


class LateStats(DictHandler):
    """Defers every Stats request; the test answers them."""

    def __init__(self) -> None:
        super().__init__()
        self.deferred: list[Deferred] = []

    def handle(self, peer: PeerInfo, body: RequestBody):  # type: ignore[override]
        if isinstance(body, Stats):
            deferred = Deferred()
            self.deferred.append(deferred)
            return deferred
        return super().handle(peer, body)


def poll_until(endpoint, done, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "timed out"
        endpoint.poll_once(0.01)


@pytest.mark.parametrize("scheme", ["memory", "ipc"])
def test_a_deferred_reply_comes_later_and_others_are_answered_meanwhile(scheme, tmp_path):
    handler = LateStats()
    address = f"memory://deferred-{time.monotonic_ns()}" if scheme == "memory" else f"ipc://{tmp_path}/s.sock"
    endpoint = open_endpoint(address, handler)
    try:
        with CacheClient(address, timeout=5) as client:
            poll_until(endpoint, lambda: client.server_id is not None)
            stats = client.stats()
            quotas = client.get_quotas()
            poll_until(endpoint, quotas.done)
            assert not stats.done()
            assert len(handler.deferred) == 1
            endpoint.send_deferred(handler.deferred[0], StatsReply(capacity_bytes=123))
            poll_until(endpoint, stats.done)
            assert stats.result(0).capacity_bytes == 123
            # A deferred reply of the wrong type becomes a typed internal error, never a wrong answer.
            wrong = client.stats()
            poll_until(endpoint, lambda: len(handler.deferred) == 2)
            endpoint.send_deferred(handler.deferred[1], ErrorReply("internal", "late"))
            poll_until(endpoint, wrong.done)
            assert wrong.exception(0) is not None
    finally:
        endpoint.close()


def test_a_waker_made_before_its_endpoint_keeps_a_wake_until_it_is_connected():
    """The server's collaborators get the waker before the endpoint exists: a wake then is kept
    and delivered on connection, once; later wakes go straight through."""
    woken: list[str] = []
    waker = Waker()
    waker.wake()
    waker.wake()
    assert woken == []
    waker.connect(lambda: woken.append("wake"))
    assert woken == ["wake"]
    waker.wake()
    assert woken == ["wake", "wake"]
    with pytest.raises(RuntimeError):
        waker.connect(lambda: None)


@pytest.mark.parametrize("scheme", ["memory", "ipc"])
def test_open_endpoint_connects_the_waker_and_takes_the_server_id(scheme, tmp_path):
    address = f"memory://waker-{time.monotonic_ns()}" if scheme == "memory" else f"ipc://{tmp_path}/s.sock"
    waker = Waker()
    endpoint = open_endpoint(address, DictHandler(), waker=waker, server_id="feedbeef")
    try:
        assert endpoint.server_id == "feedbeef"
        with pytest.raises(RuntimeError):  # the endpoint holds it now
            waker.connect(lambda: None)
        waker.wake()  # from another thread in a server; here it only must not fail
    finally:
        endpoint.close()
