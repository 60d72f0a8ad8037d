"""Each slot's header says what the slot holds: written at reserve, published at commit, voided when freed."""

from __future__ import annotations

import struct
import threading
from pathlib import Path

from kvdepot.core import SLOT_GENERATION_OFFSET, SLOT_HEADER_BYTES, find_in_index, slot_digest, slot_header_holds
from kvdepot.server import CacheServer, PoolMapping, ServerConfig
from kvdepot.transport import CacheClient, LookupItem

CHUNK = 1000
T = 5.0


def header(pool: PoolMapping, offset: int) -> bytes:
    return pool.read(offset - SLOT_HEADER_BYTES, SLOT_HEADER_BYTES)


def generation(raw: bytes) -> int:
    return struct.unpack_from("<Q", raw, SLOT_GENERATION_OFFSET)[0]


def test_a_slots_header_follows_its_chunk_through_reserve_commit_and_free(make_server):
    """Pending: the chunk's digest with an odd generation; committed: even; freed and reused: a new
    odd generation and the next chunk's digest. Only the committed state holds for a reader."""
    server = make_server()
    with CacheClient(server.address, timeout=T) as client:
        reply = client.register("layout", 256, CHUNK).result(T)
        pool = PoolMapping(reply.pool.path, reply.pool.size, writable=False)
        try:
            key = b"\x07" * 32
            reservation = client.reserve("tenant", [key], CHUNK).result(T)
            (slot,) = reservation.slots
            pending = header(pool, slot.offset)
            assert generation(pending) % 2 == 1
            assert not slot_header_holds(pending, slot_digest("tenant", key), CHUNK)
            client.commit(reservation.reservation_id).result(T)
            committed = header(pool, slot.offset)
            assert generation(committed) == generation(pending) + 1
            assert slot_header_holds(committed, slot_digest("tenant", key), CHUNK)
            assert not slot_header_holds(committed, slot_digest("", key), CHUNK)  # another salt's chunk
            assert not slot_header_holds(committed, slot_digest("tenant", key), CHUNK + 64)
            client.clear().result(T)
            freed = header(pool, slot.offset)
            assert generation(freed) % 2 == 1
            assert generation(freed) > generation(committed)
            assert not slot_header_holds(freed, slot_digest("tenant", key), CHUNK)
            (again,) = client.reserve("tenant", [b"\x08" * 32], CHUNK).result(T).slots
            assert again.offset == slot.offset
            reused = header(pool, slot.offset)
            assert generation(reused) not in (generation(pending), generation(committed), generation(freed))
        finally:
            pool.close()


def test_the_slot_index_holds_each_committed_chunk_at_its_slot_until_it_is_freed(tmp_path):
    """The owner's handshake offers the index (an owner-only file) and says it is complete (no tier
    below RAM); a chunk is in it from its commit to its free, at the offset the lookup gives; a
    kept pool's next server indexes what it adopted."""
    config = ServerConfig(
        address=f"ipc://{tmp_path}/s.sock", keep_pool=True, capacity=1 << 20, page_size=4096, pool_dir=tmp_path
    )
    server = CacheServer(config)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    key = b"\x07" * 32
    with CacheClient(server.address, timeout=T) as client:
        client.ping().result(T)
        hello = client.hello_reply
        assert hello is not None
        assert hello.slot_index is not None
        assert hello.slot_index_complete
        index = PoolMapping(hello.slot_index.path, hello.slot_index.size, writable=False)  # refuses any but 0600
        try:
            client.register("layout", 256, CHUNK).result(T)
            reservation = client.reserve("tenant", [key], CHUNK).result(T)
            assert find_in_index(index.view(0, index.size), slot_digest("tenant", key)) is None  # not committed
            client.commit(reservation.reservation_id).result(T)
            (slot,) = client.lookup([LookupItem("tenant", [key])]).result(T).results[0].slots
            assert find_in_index(index.view(0, index.size), slot_digest("tenant", key)) == (slot.offset, CHUNK)
            assert find_in_index(index.view(0, index.size), slot_digest("other", key)) is None
            client.clear("other").result(T)
            assert find_in_index(index.view(0, index.size), slot_digest("tenant", key)) == (slot.offset, CHUNK)
        finally:
            index.close()
    server.stop()
    thread.join(timeout=10)
    with CacheServer(config) as again:
        assert again.adoption.chunks == 1
        assert find_in_index(again.slot_index_pool.buffer, slot_digest("tenant", key)) == (slot.offset, CHUNK)
        assert again.slot_index_pool.path != Path(hello.slot_index.path)  # an index per server, never kept
    assert not Path(hello.slot_index.path).exists()


def test_a_chunk_leaves_the_slot_index_when_its_slot_is_freed(make_server):
    server = make_server()
    key = b"\x09" * 32
    with CacheClient(server.address, timeout=T) as client:
        client.register("layout", 256, CHUNK).result(T)
        client.commit(client.reserve("tenant", [key], CHUNK).result(T).reservation_id).result(T)
        hello = client.hello_reply
        assert hello is not None
        assert hello.slot_index is not None
        index = PoolMapping(hello.slot_index.path, hello.slot_index.size, writable=False)
        try:
            assert find_in_index(index.view(0, index.size), slot_digest("tenant", key)) is not None
            client.clear().result(T)
            assert find_in_index(index.view(0, index.size), slot_digest("tenant", key)) is None
        finally:
            index.close()


def test_a_server_with_a_tier_below_ram_says_its_slot_index_is_not_complete(make_server, tmp_path):
    server = make_server(disk_dir=tmp_path / "disk", disk_capacity=1 << 20)
    with CacheClient(server.address, timeout=T) as client:
        client.ping().result(T)
        hello = client.hello_reply
        assert hello is not None
        assert hello.slot_index is not None
        assert not hello.slot_index_complete


def test_a_server_without_room_for_its_slot_index_serves_without_one(tmp_path, monkeypatch):
    """The index's file cannot be made (the pool took the room): the server starts, logs it, and
    offers no index; engines then ask it for every lookup."""
    from kvdepot.server import _pool

    monkeypatch.setattr(_pool, "pool_dir_free_bytes", lambda _directory=None: 0)  # only the kept pool fits
    config = ServerConfig(
        address=f"ipc://{tmp_path}/s.sock", keep_pool=True, capacity=1 << 20, page_size=4096, pool_dir=tmp_path
    )
    with CacheServer(config) as server:
        assert server.slot_index is None
        assert server.handler.slot_index is None
        assert not list(tmp_path.glob("*.index"))
