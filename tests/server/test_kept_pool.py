"""A kept pool outlives its server: real `kvdepot serve` processes stopped, killed and started again
on the same pool directory, with real clients writing and reading the shared-memory pool."""

from __future__ import annotations

import os
import signal

import pytest
from _chunks import CHUNK, POOL, keys, lookup, payload, store, wait_for

from kvdepot.core import SLOT_HEADER_BYTES
from kvdepot.server import PoolMapping
from kvdepot.transport import CacheClient

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

T = 10.0


def figures(server) -> dict:
    return {k: v for k, v in server.stats().extra.items() if k.startswith("pool_")}


def journal_of(server):
    (pool,) = server.pool_files()
    return pool, pool.with_suffix(".journal")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_restarted_server_hits_what_its_pool_held(serve, sig):
    """Stopped or killed, the server leaves its pool; the next one adopts every committed chunk,
    with its salt, and serves the same bytes; chunks of two salts stay apart."""
    server = serve(*POOL)
    alpha, beta = keys("alpha", 12), keys("beta", 5)
    store(server.address, "alpha", alpha)
    store(server.address, "beta", beta)
    assert server.stop(sig) in (0, -signal.SIGKILL)
    assert len(server.pool_files()) == 1
    again = serve(*POOL)
    assert lookup(again.address, "alpha", alpha) == (12, True)
    assert lookup(again.address, "beta", beta) == (5, True)
    assert lookup(again.address, "beta", alpha)[0] == 0, "a chunk of one salt is never another's"
    got = figures(again)
    assert got["pool_kept"] is True
    assert got["pool_adopted_chunks"] == 17
    assert got["pool_adopted_bytes"] == 17 * CHUNK
    with CacheClient(again.address, timeout=T) as client:  # its change log names what it took back
        assert [c.key for c in client.changes(1, ["alpha"]).result(T).changes] == alpha
    stats = again.stats()
    assert stats.chunks == 17
    assert stats.salt_bytes == {"alpha": 12 * 64 * 1024, "beta": 5 * 64 * 1024}  # quotas count them
    # ... and it goes on storing and is adopted again by the next one.
    store(again.address, "alpha", keys("alpha-more", 3))
    again.stop(signal.SIGKILL)
    third = serve(*POOL)
    assert lookup(third.address, "alpha", alpha) == (12, True)
    assert lookup(third.address, "alpha", keys("alpha-more", 3)) == (3, True)


def test_a_client_still_connected_reconnects_and_hits(serve):
    """An engine's client that stays up across the restart reconnects, registers again and hits."""
    server = serve(*POOL)
    chunk_keys = keys("live", 4)
    with CacheClient(server.address, timeout=2.0) as client:
        reg = client.register("layout", 256, CHUNK).result(T)
        with PoolMapping(reg.pool.path, reg.pool.size) as pool:
            res = client.reserve("s", chunk_keys, CHUNK).result(T)
            for slot in res.slots:
                pool.write(slot.offset, payload(chunk_keys[slot.index]))
            client.commit(res.reservation_id).result(T)
        # Commits are journaled by a thread right after: one killed sooner than that is a miss.
        wait_for(lambda: server.stats().extra["pool_journal_behind"] == 0)
        server.stop(signal.SIGKILL)
        again = serve(*POOL)
        for _ in range(100):
            try:
                (hit,) = client.lookup([("s", chunk_keys)]).result(2.0).results
                break
            except Exception:  # the client reconnects in the background
                continue
        assert hit.num_hits == 4
        with PoolMapping(reg.pool.path, reg.pool.size, writable=False) as pool:
            assert all(pool.read(s.offset, s.length) == payload(k) for s, k in zip(hit.slots, chunk_keys, strict=True))
        assert again.stats().extra["pool_adopted_chunks"] == 4


def _slots(address: str, salt: str, chunk_keys: list[bytes]) -> list[int]:
    """The offsets of the chunks' slots (their headers), as a lookup hands them out."""
    with CacheClient(address, timeout=T) as client:
        client.register("layout", 256, CHUNK).result(T)
        (res,) = client.lookup([(salt, chunk_keys)]).result(T).results
        client.release([res.lease_id]).result(T)
        return [slot.offset - SLOT_HEADER_BYTES for slot in res.slots]


def _flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_a_tampered_pool_serves_nothing_wrong(serve):
    """Bytes flipped in one chunk, in another's header (its digest, its generation), and a journal
    cut short: those chunks are dropped, never served; every other chunk hits with its bytes."""
    server = serve(*POOL)
    chunk_keys = keys("t", 8)
    store(server.address, "s", chunk_keys)
    offsets = _slots(server.address, "s", chunk_keys)
    server.stop(signal.SIGTERM)
    pool, _ = journal_of(server)
    _flip(pool, offsets[1] + SLOT_HEADER_BYTES + CHUNK // 2)  # the chunk's bytes
    _flip(pool, offsets[3] + 30)  # the header's digest
    _flip(pool, offsets[5] + 8)  # the header's generation
    again = serve(*POOL)
    got = figures(again)
    assert got["pool_adopted_chunks"] == 5
    assert got["pool_dropped_checksum"] == 1
    assert got["pool_dropped_header"] == 1
    assert got["pool_dropped_moved_on"] == 1
    for i, k in enumerate(chunk_keys):
        hits, right = lookup(again.address, "s", [k])
        assert right
        assert hits == (0 if i in (1, 3, 5) else 1), i
    # A store of the dropped ones goes through as for any miss.
    store(again.address, "s", [chunk_keys[1], chunk_keys[3], chunk_keys[5]])
    assert lookup(again.address, "s", chunk_keys) == (8, True)


def test_a_journal_cut_short_keeps_what_came_before(serve):
    """A server killed while appending leaves a torn record: the records before it count."""
    server = serve(*POOL)
    store(server.address, "s", keys("first", 3))
    store(server.address, "s", keys("second", 3))
    server.stop(signal.SIGKILL)
    _, journal = journal_of(server)
    size = journal.stat().st_size
    os.truncate(journal, size - 5)  # the last record (the last chunk's commit) torn
    again = serve(*POOL)
    assert lookup(again.address, "s", keys("first", 3)) == (3, True)
    assert lookup(again.address, "s", keys("second", 3)) == (2, True)


def test_a_pool_of_another_capacity_or_a_fresh_start_is_discarded(serve):
    """Another capacity (or page size) starts empty and says why; --fresh-pool too."""
    server = serve(*POOL)
    store(server.address, "s", keys("c", 4))
    server.stop()
    bigger = serve("--capacity", "32MiB", "--page-size", "1MiB")
    assert lookup(bigger.address, "s", keys("c", 4))[0] == 0
    assert "capacity" in figures(bigger)["pool_fresh_reason"]
    store(bigger.address, "s", keys("c", 4))
    bigger.stop()
    fresh = serve("--capacity", "32MiB", "--page-size", "1MiB", "--fresh-pool")
    assert figures(fresh)["pool_fresh_reason"] == "--fresh-pool"
    assert lookup(fresh.address, "s", keys("c", 4))[0] == 0


def test_a_chunk_being_written_when_the_server_died_is_quarantined(serve):
    """A slot reserved and not committed when the server was killed is held (its writer may still
    be copying) for one reservation TTL, never handed to another chunk before, never served."""
    server = serve(*POOL, "--reservation-ttl", "600")
    chunk_key = keys("pending", 1)
    with CacheClient(server.address, timeout=T) as client:
        client.register("layout", 256, CHUNK).result(T)
        res = client.reserve("s", chunk_key, CHUNK).result(T)
        assert len(res.slots) == 1
        server.stop(signal.SIGKILL)
    again = serve(*POOL, "--reservation-ttl", "600")
    stats = again.stats()
    assert stats.extra["pool_adopted_pending"] == 1
    assert stats.extra["quarantined_chunks"] == 1
    assert lookup(again.address, "s", chunk_key)[0] == 0
    with CacheClient(again.address, timeout=T) as client:
        client.register("layout", 256, CHUNK).result(T)
        res = client.reserve("s", keys("other", 63), CHUNK).result(T)
        taken = {slot.offset for slot in res.slots}
        assert len(taken) == len(res.slots)
        held = _pending_slot(again, "s", chunk_key[0])
        assert held not in taken


def _pending_slot(server, salt: str, key: bytes) -> int:
    """The slot the journal names for a pending chunk (its data's offset)."""
    from kvdepot.server._pool_journal import RESERVED, read_journal

    _, journal = journal_of(server)
    records = [r for r in read_journal(journal).records if r.kind == RESERVED and r.key == key and r.salt == salt]
    return records[-1].slot + SLOT_HEADER_BYTES


def test_no_keep_pool_removes_it_at_stop(serve):
    server = serve(*POOL, "--no-keep-pool")
    store(server.address, "s", keys("n", 2))
    assert server.pool_files()
    assert server.stop() == 0
    assert not server.pool_files()
    again = serve(*POOL, "--no-keep-pool")
    assert lookup(again.address, "s", keys("n", 2))[0] == 0


def test_a_second_server_never_takes_a_pool_in_use(serve, workdir):
    """A second `kvdepot serve` of the same address and pool directory is refused (exit 2) and the
    first goes on serving what it holds."""
    import subprocess
    import sys

    server = serve(*POOL)
    store(server.address, "s", keys("busy", 2))
    cmd = [sys.executable, "-m", "kvdepot.server._cli", "serve", "--address", server.address, *POOL]
    cmd += ["--pool-dir", str(workdir), "--no-metrics", "--settings-file", "none"]
    second = subprocess.run(cmd, capture_output=True, timeout=60, check=False)
    assert second.returncode == 2
    assert b"another kvdepot server uses the kept pool" in second.stderr
    assert lookup(server.address, "s", keys("busy", 2)) == (2, True)


def test_a_pool_file_others_may_read_is_not_adopted(serve):
    """A kept pool file that is not this user's alone (here: readable by others) is never mapped
    for adoption; the server runs on a pool of its own for this run and says so."""
    server = serve(*POOL)
    store(server.address, "s", keys("open", 2))
    server.stop()
    pool, _ = journal_of(server)
    pool.chmod(0o644)
    again = serve(*POOL)
    assert lookup(again.address, "s", keys("open", 2))[0] == 0
    got = figures(again)
    assert got["pool_kept"] is False
    assert "mode 644" in got["pool_fresh_reason"]
    assert again.stats().extra["pool_path"] != str(pool)


def test_generations_go_on_past_the_last_servers(serve):
    """Slots handed out after a restart get generations past every one the journal names, so a
    record of the last server can never match a slot the new one rewrote."""
    from kvdepot.server._pool_journal import read_journal

    server = serve(*POOL)
    store(server.address, "s", keys("g1", 4))
    server.stop()
    _, journal = journal_of(server)
    before = read_journal(journal).max_generation
    again = serve(*POOL)
    store(again.address, "s", keys("g2", 4))
    again.stop()
    records = read_journal(journal).records
    assert min(r.generation for r in records if r.key in keys("g2", 4)) > before


def test_the_next_build_adopts_this_builds_pool_and_this_one_adopts_it_back(serve):
    """An upgrade (a build one tier format ahead, `_future_format.py`) restarts on the pool this
    build kept and hits it; a downgrade back does too (the pool and journal formats are shared)."""
    import sys
    from pathlib import Path

    upgraded = (sys.executable, str(Path(__file__).with_name("_future_format.py")))
    server = serve(*POOL)
    chunk_keys = keys("upgrade", 6)
    store(server.address, "s", chunk_keys)
    server.stop()
    nxt = serve(*POOL, command=upgraded)
    assert figures(nxt)["pool_adopted_chunks"] == 6
    assert lookup(nxt.address, "s", chunk_keys) == (6, True)
    store(nxt.address, "s", keys("upgrade-more", 2))
    nxt.stop(signal.SIGKILL)
    back = serve(*POOL)
    assert lookup(back.address, "s", chunk_keys + keys("upgrade-more", 2)) == (8, True)


def test_a_restart_that_names_no_capacity_takes_the_kept_pools(serve):
    """Without --capacity and --page-size, the restart takes the kept pool's (the default capacity
    moves with the free memory, and a pool of another capacity would be discarded)."""
    server = serve("--capacity", "12MiB", "--page-size", "2MiB")
    store(server.address, "s", keys("layout", 3))
    server.stop()
    again = serve()
    assert figures(again)["pool_adopted_chunks"] == 3
    stats = again.stats()
    assert (stats.capacity_bytes, stats.extra["page_size"]) == (12 << 20, 2 << 20)
    assert lookup(again.address, "s", keys("layout", 3)) == (3, True)
