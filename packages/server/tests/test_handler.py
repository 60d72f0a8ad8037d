"""The server answers the kvdepot protocol end to end (in-memory transport, real pool file)."""

from __future__ import annotations

import time

import pytest

from kvdepot.server import PoolMapping
from kvdepot.server._holds import QUARANTINE_CLIENT
from kvdepot.transport import (
    CacheClient,
    NotRegisteredError,
    RemoteInvalidArgumentError,
    UnknownReservationError,
)

CHUNK = 1000
T = 5.0


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


@pytest.fixture
def server(make_server):
    return make_server()


@pytest.fixture
def client(server):
    with CacheClient(server.address, timeout=T, client_name="test") as c:
        yield c


def test_store_then_lookup_reads_back_the_bytes(server, client):
    """Bytes written into reserved slots and committed come back from a lookup by another client."""
    reg = client.register("layout", 256, CHUNK).result(T)
    assert reg.pool.size == server.pool.size
    assert reg.slot_alignment == 64
    keys = [key(i) for i in range(3)]
    res = client.reserve("salt", keys, CHUNK).result(T)
    assert [s.index for s in res.slots] == [0, 1, 2]
    assert not res.full
    with PoolMapping(reg.pool.path, reg.pool.size) as pool:
        for slot in res.slots:
            pool.write(slot.offset, bytes([slot.index + 1]) * slot.length)
        assert client.commit(res.reservation_id).result(T).committed == 3
        with CacheClient(server.address, timeout=T) as other:
            other.register("layout", 256, CHUNK).result(T)
            (hit,) = other.lookup([("salt", [*keys, key(9)])]).result(T).results
            assert hit.num_hits == 3
            assert [pool.read(s.offset, s.length) for s in hit.slots] == [bytes([i + 1]) * CHUNK for i in range(3)]
            assert other.release([hit.lease_id]).result(T).released == 1


def test_data_requests_before_register_are_refused(client):
    """A reserve from a client that never registered fails with not_registered."""
    with pytest.raises(NotRegisteredError, match="Register"):
        client.reserve("", [key(1)], CHUNK).result(T)


def test_unknown_reservation_is_a_typed_error(client):
    """Committing a reservation that does not exist fails with unknown_reservation."""
    client.register("layout", 256, CHUNK).result(T)
    with pytest.raises(UnknownReservationError):
        client.commit(12345).result(T)


def test_chunk_larger_than_a_page_is_an_invalid_argument(client):
    """Registering chunks larger than a page names --page-size in the error."""
    with pytest.raises(RemoteInvalidArgumentError, match="--page-size"):
        client.register("layout", 256, 10_000).result(T)


def test_stats_and_quotas_round_trip(server, client):
    """Stats reports capacity, use and per-salt bytes; quotas are set and read back."""
    client.register("layout", 256, CHUNK).result(T)
    res = client.reserve("t", [key(1)], CHUNK).result(T)
    client.commit(res.reservation_id).result(T)
    assert client.set_quota("t", 8192).result(T).quotas == {"t": 8192}
    assert client.get_quotas().result(T).quotas == {"t": 8192}
    stats = client.stats().result(T)
    assert stats.capacity_bytes == server.allocator.capacity
    assert stats.chunks == 1
    assert stats.salt_bytes == {"t": server.allocator.slot_size(CHUNK)}
    assert stats.extra["quota:t"] == 8192
    assert client.clear("t").result(T).removed == 1


def test_end_session_reclaims_leases_and_reservations(make_server):
    """EndSession returns everything the client held: its leases at once, the slots of its
    reservations once they were quarantined for one more reservation TTL (a copy into them
    may still be under way)."""
    server = make_server(reservation_ttl=0.3)
    with CacheClient(server.address, timeout=T) as client:
        client.register("layout", 256, CHUNK).result(T)
        res = client.reserve("", [key(1), key(2)], CHUNK).result(T)
        client.commit(res.reservation_id, [0]).result(T)
        client.lookup([("", [key(1)])]).result(T)
        client.end_session().result(T)
        stats = server.index.stats()
        assert (stats.leases, stats.reservations, stats.pending_chunks, stats.quarantined_chunks) == (0, 0, 0, 1)
        deadline = time.monotonic() + 5
        while server.index.stats().pending_chunks and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = server.index.stats()
        assert (stats.leases, stats.reservations, stats.pending_chunks) == (0, 0, 0)


def test_silent_client_is_reclaimed(make_server):
    """A client that stops sending (no heartbeats) loses its leases and reservations after the peer timeout."""
    server = make_server(peer_timeout=0.5)
    client = CacheClient(server.address, timeout=T, heartbeat_interval=60.0)
    client.register("layout", 256, CHUNK).result(T)
    client.reserve("", [key(1)], CHUNK).result(T)
    assert server.index.stats().reservations == 1
    deadline = time.monotonic() + 5
    while server.index.clients() != [QUARANTINE_CLIENT] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.index.clients() == [QUARANTINE_CLIENT]  # its reservation's slots, for one more TTL
    assert (server.index.stats().pending_chunks, server.index.stats().quarantined_chunks) == (0, 1)
    client.close(end_session=False)


def test_gone_connection_of_a_client_still_connected_keeps_its_session(server):
    """A stale connection reported gone does not reclaim a client that is connected under another identity."""
    from kvdepot.transport import PeerInfo

    with CacheClient(server.address, timeout=T) as client:
        client.register("layout", 256, CHUNK).result(T)
        client.reserve("", [key(1)], CHUNK).result(T)
        server.handler.peer_gone(PeerInfo(client.client_id, identity=b"old-connection"))
        assert server.index.stats().reservations == 1
        server.handler.peer_gone(PeerInfo("someone-else"))
        assert server.index.stats().reservations == 1


def test_a_layout_name_held_with_other_bytes_is_refused(server, client):
    """A second layout fingerprint (or chunk size) under a layout name already held is a typed error;
    the server keeps serving the first, and equal or unfingerprinted registrations still pass."""
    from kvdepot.transport import LayoutConflictError

    client.register("layout", 256, CHUNK, fingerprint="cpu-attn-v1").result(T)
    with CacheClient(server.address, timeout=T) as other:
        with pytest.raises(LayoutConflictError, match="held here with fingerprint"):
            other.register("layout", 256, CHUNK, fingerprint="flash-attn-v1").result(T)
        with pytest.raises(LayoutConflictError):
            other.register("layout", 256, 2 * CHUNK, fingerprint="cpu-attn-v1").result(T)
        assert other.register("layout", 256, CHUNK, fingerprint="cpu-attn-v1").result(T).pool.size > 0
        assert other.register("other-layout", 256, CHUNK, fingerprint="flash-attn-v1").result(T).pool.size > 0
    res = client.reserve("", [key(1)], CHUNK).result(T)
    assert client.commit(res.reservation_id).result(T).committed == 1


@pytest.mark.parametrize("request_name", ["commit", "abort", "release"])
def test_a_request_for_another_server_instance_is_refused(server, client, request_name):
    """A commit, abort or release naming another instance (one before a restart) is refused and changes
    nothing; named for this instance it goes through."""
    from kvdepot.transport import StalePoolError

    this = client.hello().result(T).server_id
    client.register("layout", 256, CHUNK).result(T)
    res = client.reserve("", [key(1)], CHUNK).result(T)
    if request_name == "release":
        client.commit(res.reservation_id, server_id=this).result(T)
        (hit,) = client.lookup([("", [key(1)])]).result(T).results
        call = lambda server_id: client.release([hit.lease_id], server_id=server_id)  # noqa: E731
    else:
        call = lambda server_id: getattr(client, request_name)(res.reservation_id, server_id=server_id)  # noqa: E731
    with pytest.raises(StalePoolError, match="restarted"):
        call("an-old-instance").result(T)
    call(this).result(T)
    (after,) = client.lookup([("", [key(1)])]).result(T).results
    assert after.num_hits == (0 if request_name == "abort" else 1)


def test_stats_with_more_salts_than_listed_ranks_them_at_most_once_a_second(server, client, monkeypatch):
    """Past MAX_STATS_SALTS salts, Stats lists the largest as ranked at most every SALT_RANKING_S,
    with current figures, and counts every salt; a new largest salt shows up at the next ranking."""
    from kvdepot.server import _handler

    monkeypatch.setattr(_handler, "MAX_STATS_SALTS", 2)
    ahead = [0.0]  # the handler's clock runs this far ahead of the real one
    server.handler.clock = lambda: time.monotonic() + ahead[0]
    client.register("layout", 256, CHUNK).result(T)
    slot = server.allocator.slot_size(CHUNK)
    n = iter(range(1000))

    def store(salt: str, chunks: int) -> None:
        res = client.reserve(salt, [key(next(n)) for _ in range(chunks)], CHUNK).result(T)
        client.commit(res.reservation_id).result(T)

    store("big", 3)
    store("mid", 2)
    store("small", 1)
    stats = client.stats().result(T)
    assert stats.salt_bytes == {"big": 3 * slot, "mid": 2 * slot}
    assert stats.extra["salts"] == 3
    store("small", 4)  # now the largest, but the ranking is less than a second old
    store("mid", 1)
    stats = client.stats().result(T)
    assert stats.salt_bytes == {"big": 3 * slot, "mid": 3 * slot}  # figures are current
    ahead[0] += _handler.SALT_RANKING_S
    stats = client.stats().result(T)
    assert stats.salt_bytes == {"small": 5 * slot, "big": 3 * slot} or stats.salt_bytes == {
        "small": 5 * slot,
        "mid": 3 * slot,
    }
    assert stats.extra["salt_chunks:small"] == 5
