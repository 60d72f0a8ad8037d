"""Each slot's header says what the slot holds: written at reserve, published at commit, voided when freed."""

from __future__ import annotations

import struct

from kvdepot.core import SLOT_GENERATION_OFFSET, SLOT_HEADER_BYTES, slot_digest, slot_header_holds
from kvdepot.server import PoolMapping
from kvdepot.transport import CacheClient

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
