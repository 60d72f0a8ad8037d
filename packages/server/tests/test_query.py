"""Query: what a server holds of a prompt, in RAM and in each tier below, without a lease.

The handler, the index and the tiers are the server's own (a real `DiskTier` in a temporary
directory); the loop's part is run by the test, as `CacheServer.serve_forever` runs it.
"""

from __future__ import annotations

import itertools
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdepot.server import CacheHandler, ChunkIndex, DiskTier, ServerArgumentError, SlabAllocator
from kvdepot.server._pool import SlotHeaders
from kvdepot.server._tiering import TierSet
from kvdepot.transport import Deferred, Lookup, LookupItem, LookupReply, PeerInfo, Query, QueryReply, QueryResult

PAGE = 64 * 1024
CHUNK = 4096 - 64  # one 4 KiB slot
SLOTS = 4 * PAGE // 4096
PEER = PeerInfo("router")


class Server:
    """The server's parts without its socket: `handle` a request, `loop` until it is answered."""

    def __init__(self, directory: Path) -> None:
        self.pool = memoryview(bytearray(4 * PAGE))
        allocator = SlabAllocator(4 * PAGE, PAGE)
        headers = SlotHeaders(self.pool)
        self.index = ChunkIndex(allocator, headers=headers, max_client_pending_bytes=4 * PAGE, events=True)
        self.tiers = TierSet([DiskTier(directory, 1 << 24)], self.index, self.pool, wake=lambda: None)
        self.handler = CacheHandler(
            self.index, pool_path="unused", pool_size=len(self.pool), chunk_size=16, tiers=self.tiers
        )
        self.index.register("engine", CHUNK, 0.0)

    def store(self, salt: str, keys: list[bytes]) -> None:
        """An engine's Reserve and Commit, each followed by the handler's hand-over of events."""
        out = self.index.reserve("engine", salt, keys, CHUNK, 0.0)
        for i, offset, length in out.slots:
            self.pool[offset : offset + length] = keys[i][:1] * length
        if out.reservation_id:
            self.index.commit("engine", out.reservation_id, None, 0.0)
        self.handler.flush_events()
        self.loop_until(lambda: self.index.stats().leased_chunks == 0)  # written behind

    def loop_until(self, done, timeout: float = 10.0) -> list:
        """Run the loop's part until `done()`; the replies it sent meanwhile."""
        sent = []
        deadline = time.monotonic() + timeout
        while not done():
            for answer in self.tiers.run():
                sent.append((answer.deferred, self.handler.answer(answer)))
            self.handler.flush_events()
            assert time.monotonic() < deadline, "timed out"
            time.sleep(0.002)
        return sent

    def query(self, items: list[tuple[str, list[bytes]]], *, tiers: bool = True) -> list[QueryResult]:
        out = self.handler.handle(PEER, Query([LookupItem(salt, keys) for salt, keys in items], tiers))
        if isinstance(out, Deferred):
            sent: list = []
            sent += self.loop_until(lambda: any(d is out for d, _ in sent) or bool(sent.extend(self._pass())))
            (out,) = [reply for d, reply in sent if d is out]
        assert isinstance(out, QueryReply)
        return out.results

    def _pass(self) -> list:
        return [(a.deferred, self.handler.answer(a)) for a in self.tiers.run()]

    def lookup_hits(self, salt: str, keys: list[bytes]) -> int:
        """What a tiered lookup of `keys` hits now (its lease given back)."""
        deferred = self.tiers.lookup("engine", [(salt, keys)], time.monotonic())
        if deferred is not None:
            self.loop_until(lambda: not self.tiers.book.open)
        (outcome,) = self.index.lookup("engine", [(salt, keys)], time.monotonic())
        self.index.release("engine", [outcome.lease_id])
        return outcome.num_hits

    def close(self) -> None:
        self.tiers.close()


@pytest.fixture
def server(tmp_path):
    s = Server(tmp_path / "disk")
    yield s
    s.close()


def keys_of(name: int, n: int) -> list[bytes]:
    return [bytes([name, i]) * 16 for i in range(n)]


def test_a_query_says_what_ram_and_the_disk_hold_per_salt_and_takes_nothing(server):
    """RAM holds the first 2 chunks, the disk all 6: RAM 2, then 4 below, all 4 on the disk. The
    same keys under another salt are nothing. No lease is taken and no hit or miss counted."""
    keys = keys_of(1, 6)
    server.store("tenant-a", keys)
    server.index.clear()
    server.store("tenant-a", keys[:2])
    before = server.index.stats()
    results = server.query([("tenant-a", keys), ("tenant-b", keys), ("tenant-a", keys[:1] + keys_of(9, 3))])
    assert results == [QueryResult(2, 4, {"disk": 4}), QueryResult(0, 0, {"disk": 0}), QueryResult(1, 0, {"disk": 0})]
    after = server.index.stats()
    assert (after.leases, after.hits, after.misses, after.chunks) == (0, before.hits, before.misses, before.chunks)
    assert server.tiers.counters["queries_probed"] == 1  # one probe for the three items
    assert server.tiers.counters["queries_deferred"] == 0  # the disk's index is asked on the loop
    server.index.check()


def test_a_lookup_read_back_from_the_disk_says_how_many_hits_came_from_it(server):
    """The reply to a lookup the disk tier completed says which of its hits were read back from
    the disk for it (an engine's hits by source); the next lookup finds them all in RAM."""
    keys = keys_of(3, 5)
    server.store("", keys)
    server.index.clear()
    server.store("", keys[:2])
    server.index.touch(PEER.client_id, time.monotonic())
    out = server.handler.handle(PEER, Lookup([LookupItem("", keys)]))
    assert isinstance(out, Deferred)
    sent = server.loop_until(lambda: not server.tiers.book.open)
    ((deferred, reply),) = sent
    assert deferred is out
    (result,) = reply.results
    assert (result.num_hits, result.read_back) == (5, {"disk": 3})
    server.index.release(PEER.client_id, [result.lease_id])
    again = server.handler.handle(PEER, Lookup([LookupItem("", keys)]))
    assert isinstance(again, LookupReply)
    assert (again.results[0].num_hits, again.results[0].read_back) == (5, {})


def test_a_query_of_ram_only_never_asks_the_tiers(server):
    keys = keys_of(2, 4)
    server.store("", keys)
    server.index.clear()
    server.store("", keys[:1])
    assert server.query([("", keys)], tiers=False) == [QueryResult(1)]
    assert server.tiers.counters["queries_probed"] == 0
    assert server.query([("", keys[:1])]) == [QueryResult(1)]  # all in RAM: answered at once
    assert server.tiers.counters["queries_probed"] == 0


def test_a_query_past_the_key_bound_is_refused_with_a_typed_error(server):
    from kvdepot.server._index import MAX_KEYS_PER_REQUEST

    many = [b"\x01" * 32] * (MAX_KEYS_PER_REQUEST // 2 + 1)
    with pytest.raises(ServerArgumentError):
        server.handler.handle(PEER, Query([LookupItem("", many), LookupItem("", many)]))


OPS = st.lists(
    st.tuples(st.sampled_from(["store", "clear"]), st.sampled_from(["a", "b"]), st.integers(0, 2), st.integers(1, 8)),
    max_size=6,
)


@settings(max_examples=20, deadline=None)
@given(ops=OPS, asked=st.tuples(st.sampled_from(["a", "b"]), st.integers(0, 2), st.integers(1, 10)))
def test_a_query_never_claims_more_than_a_lookup_then_hits(ops, asked):
    """Whatever was stored, evicted and cleared, RAM's part and the tiers' run that a query
    reports are never more than a tiered lookup of the same keys right after it hits."""
    with tempfile.TemporaryDirectory() as directory:
        server = Server(Path(directory))
        try:
            for op, salt, name, n in ops:
                if op == "store":
                    server.store(salt, keys_of(name, n))
                else:
                    server.index.clear(salt)
            salt, name, n = asked
            keys = keys_of(name, n)
            (result,) = server.query([(salt, keys)])
            assert result.ram + result.below <= server.lookup_hits(salt, keys)
            assert all(part <= result.below for part in result.tiers.values())
        finally:
            server.close()


def test_chunks_of_every_salt_and_prompt_are_named_apart():
    """The keys the tests use do not collide (a test of the test)."""
    names = [k for name, n in itertools.product(range(3), [10]) for k in keys_of(name, n)]
    assert len(set(names)) == len(names)
