"""The lease book gives leases back to the server instance that granted them, and keeps nothing."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from kvdepot.transport import LookupReply, LookupResult
from kvdepot.vllm_connector._lease_book import LeaseBook


class Client:
    """A client serving instance ``server_id``; records each release."""

    def __init__(self, server_id: str = "b", fail: bool = False) -> None:
        self.server_id = server_id
        self.fail = fail
        self.released: list[tuple[list[int], str]] = []

    def release(self, leases: list[int], *, server_id: str) -> None:
        if self.fail:
            raise ConnectionError("closed")
        self.released.append((list(leases), server_id))


def test_only_the_serving_instances_leases_are_given_back_in_one_message() -> None:
    """Pairs of another instance (restarted: its leases died with it) are dropped."""
    client = Client("b")
    book = LeaseBook(client, 1)
    book.release([("a", 1), ("b", 2), ("b", 3), ("", 4)])
    assert client.released == [([2, 3], "b")]
    book.release([("a", 5)])
    book.release([])
    assert client.released == [([2, 3], "b")]


def test_nothing_is_released_while_no_instance_serves() -> None:
    client = Client("")
    LeaseBook(client, 1).release([("", 1)])
    assert client.released == []


def test_a_failed_release_is_left_to_expire() -> None:
    """The server expires leases by itself: a release that cannot be sent raises nothing."""
    LeaseBook(Client("b", fail=True), 1).release([("b", 1)])


def test_a_reply_nobody_waits_for_releases_its_ranks_leases_when_it_lands() -> None:
    """Its results from ``first`` on, one per rank, with a lease; from the instance asked, if it still serves."""
    client = Client("b")
    book = LeaseBook(client, 2)
    future: Future[Any] = Future()
    book.release_on_arrival(future, 1, "b")
    assert client.released == []
    results = [LookupResult(1, 9, []), LookupResult(1, 5, []), LookupResult(0, 0, []), LookupResult(1, 6, [])]
    future.set_result(LookupReply(results=results))
    assert client.released == [([5], "b")]
    stale: Future[Any] = Future()
    book.release_on_arrival(stale, 0, "a")  # asked of an instance that no longer serves
    stale.set_result(LookupReply(results=[LookupResult(1, 3, []), LookupResult(1, 4, [])]))
    failed: Future[Any] = Future()
    book.release_on_arrival(failed, 0, "b")
    failed.set_exception(ConnectionError("gone"))
    assert client.released == [([5], "b")]
