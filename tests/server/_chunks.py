"""Chunks for the server's integration tests: bytes that are a function of their key (so every
hit is checked byte for byte), stored and looked up as an engine does, against a real server."""

from __future__ import annotations

import hashlib
import time

from kvdepot.server import PoolMapping
from kvdepot.transport import CacheClient

T = 10.0
CHUNK = 64 * 1024 - 64
SMALL = 16 * 1024 - 64  # another model's chunks
POOL = ["--capacity", "16MiB", "--page-size", "1MiB"]


def payload(key: bytes, size: int = CHUNK) -> bytes:
    return (hashlib.sha256(key).digest() * (size // 32 + 1))[:size]


def keys(tag: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{tag}-{i}".encode()).digest() for i in range(n)]


def store(address: str, salt: str, chunk_keys: list[bytes], *, size: int = CHUNK, layout: str = "layout") -> None:
    with CacheClient(address, timeout=T) as client:
        reg = client.register(layout, 256, size).result(T)
        with PoolMapping(reg.pool.path, reg.pool.size) as pool:
            res = client.reserve(salt, chunk_keys, size).result(T)
            assert len(res.slots) == len(chunk_keys)
            for slot in res.slots:
                pool.write(slot.offset, payload(chunk_keys[slot.index], size))
            client.commit(res.reservation_id).result(T)


def lookup(address: str, salt: str, chunk_keys: list[bytes], **kw) -> tuple[int, bool]:
    """(hits, every hit's bytes are right), as an engine that registered its layout sees them."""
    with CacheClient(address, timeout=T) as client:
        reg = client.register("layout", 256, CHUNK).result(T)
        with PoolMapping(reg.pool.path, reg.pool.size, writable=False) as pool:
            (res,) = client.lookup([(salt, chunk_keys)], **kw).result(T).results
            right = all(
                pool.read(slot.offset, slot.length) == payload(key)
                for slot, key in zip(res.slots, chunk_keys, strict=False)
            )
            if res.lease_id:
                client.release([res.lease_id]).result(T)
            return res.num_hits, right


def wait_for(predicate, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)
    return value


def extra(server, name: str):
    return server.stats().extra.get(name)
