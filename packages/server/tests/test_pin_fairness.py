"""Handoff pins are shared fairly between salts (issue 45, finding 9).

Pins (`Commit.pin_s`) may hold a quarter of the pool. That room was first come, first served: a
client re-committing pinned chunks of one salt kept it full, and every other tenant's handoff
pin was refused, so its chunks were evicted before the decode engine could load them. Now,
when a pin finds no room, the room is shared equally by the salts holding pins and the one
asking: a salt within its share takes room from the salts past theirs (their oldest pins end
early), and a salt past its share is refused (its commit succeeds, unpinned).
"""

from __future__ import annotations

import os
import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdepot.core import SLOT_HEADER_BYTES
from kvdepot.server import ChunkIndex, ServerProcess, SlabAllocator
from kvdepot.server._holds import MAX_PINNED_SHARE, PIN_CLIENT
from kvdepot.server.testing import free_port
from kvdepot.transport import CacheClient

T = 10.0
#: The longest a test waits for the server's metrics snapshot (published every turn of its loop).
METRICS_WAIT_S = 30.0
CHUNK_BYTES = (64 << 10) - SLOT_HEADER_BYTES  # a 64 KiB slot
POOL_CHUNKS = 128  # 8 MiB
PIN_ROOM_CHUNKS = int(POOL_CHUNKS * MAX_PINNED_SHARE)  # 32
HOG, TENANT, CHURN = "hog", "tenant-b", "churn"


# -- against a real server ---------------------------------------------------------------


@pytest.fixture
def server(short_tmp: Path) -> Iterator[tuple[ServerProcess, str]]:
    """A server of 128 chunk slots, with metrics; and its /metrics URL."""
    port = free_port()
    args = ["--page-size", "1MiB", "--pool-dir", str(short_tmp), "--metrics-port", str(port)]
    with ServerProcess(f"ipc://{short_tmp}/kvd.sock", capacity="8MiB", args=args) as proc:
        yield proc, f"http://127.0.0.1:{port}/metrics"


def _client(address: str, name: str) -> CacheClient:
    client = CacheClient(address, timeout=T, client_name=name)
    client.register("layout", 16, CHUNK_BYTES).result(T)
    return client


def _store(client: CacheClient, salt: str, count: int, *, pin_s: float = 0.0) -> list[bytes]:
    """Stores `count` new chunks of `salt` in one commit (pinned for `pin_s`); their keys."""
    keys = [os.urandom(32) for _ in range(count)]
    reply = client.reserve(salt, keys, CHUNK_BYTES).result(T)
    assert len(reply.slots) == count, "the pool had no room for a store"
    assert client.commit(reply.reservation_id, pin_s=pin_s).result(T).committed == count
    return keys


def _pins_refused(client: CacheClient) -> int:
    return int(client.stats().result(T).extra["pins_refused"] or 0)


def _metric(url: str, name: str) -> float:
    """A counter's value in /metrics once the server has published it (bounded wait)."""
    deadline = time.monotonic() + METRICS_WAIT_S
    while True:
        with urllib.request.urlopen(url, timeout=T) as resp:
            text = resp.read().decode()
        match = re.search(rf"^{name} (\S+)$", text, re.M)
        value = float(match.group(1)) if match is not None else 0.0
        if value > 0 or time.monotonic() > deadline:
            assert match is not None, f"no {name} in /metrics"
            return value
        time.sleep(0.1)


def test_a_client_recommitting_pins_of_one_salt_cannot_starve_another_salts_handoffs(server):
    """A hog fills the pins' room with pinned chunks of its salt and keeps re-committing more;
    between its commits, another tenant commits its handoffs pinned. Each of the tenant's pins
    is granted (the hog's oldest pins give way), so a churn that evicts every unpinned chunk
    leaves the tenant's handoffs in the pool; the hog's pins past its share are refused and
    counted in /metrics. Before, the room was first come, first served: the tenant's pins were
    refused and its handoffs evicted."""
    proc, url = server
    with _client(proc.address, "hog") as hog, _client(proc.address, "tenant") as tenant:
        while _pins_refused(hog) == 0:  # the hog holds the whole room
            _store(hog, HOG, 4, pin_s=60.0)
        handoffs = []
        for _ in range(3):
            refused = _pins_refused(tenant)
            handoffs += _store(tenant, TENANT, 4, pin_s=60.0)
            assert _pins_refused(tenant) == refused, "the tenant's handoff pin was refused"
            for _ in range(4):  # the hog goes on re-committing pinned chunks
                _store(hog, HOG, 4, pin_s=60.0)
        stats = tenant.stats().result(T).extra
        assert stats["pins_refused_share"], "the hog's pins past its share were not refused"
        with _client(proc.address, "churn") as churn:
            for _ in range(2 * POOL_CHUNKS // 8):  # evicts every chunk not pinned
                _store(churn, CHURN, 8)
        found = tenant.lookup([(TENANT, handoffs)]).result(T).results[0]
        assert found.num_hits == len(handoffs), "the tenant's pinned handoffs were evicted"
    assert _metric(url, "kvdepot_pins_refused_share_total") >= 1
    assert _metric(url, "kvdepot_pins_ended_early_total") >= 1


# -- the index's accounting ----------------------------------------------------------------

PAGE = 4096
SLOT = 1024
CHUNK = SLOT - SLOT_HEADER_BYTES


def _index(pages: int = 16) -> ChunkIndex:
    """An index of `pages` pages of four slots; pins may hold a quarter of them."""
    index = ChunkIndex(SlabAllocator(pages * PAGE, PAGE), max_client_pending_bytes=pages * PAGE, session_ttl=1e9)
    index.register("c", CHUNK, 0.0)
    return index


def _pin(index: ChunkIndex, salt: str, count: int, now: float = 0.0, start: int = 0) -> bool:
    """Commits `count` chunks of `salt` with a pin; whether the pin was granted."""
    refused = index.holds.pins_refused
    keys = [(start + i).to_bytes(32, "big") for i in range(count)]
    out = index.reserve("c", salt, keys, CHUNK, now)
    assert len(out.slots) == count
    assert index.commit("c", out.reservation_id, None, now, pin_s=30.0) == count
    return index.holds.pins_refused == refused


def _pinned(index: ChunkIndex, salt: str) -> int:
    return index.holds.pins.bytes_of(salt) // SLOT


def test_one_salt_alone_may_use_the_whole_room():
    """Work-conserving: with no other salt pinning, one salt's pins fill the room (16 slots)."""
    index = _index()
    assert all(_pin(index, "a", 1, start=i) for i in range(16))
    assert not _pin(index, "a", 1, start=16)  # the room is full
    assert index.holds.pins_refused_share == 0  # no other salt: a plain lack of room
    index.check()


def test_a_salt_within_its_share_ends_the_oldest_pins_of_the_salt_past_its_share():
    index = _index()
    for i in range(16):
        _pin(index, "a", 1, start=i)
    leases = sorted(index.sessions.session_of(PIN_CLIENT).leases)
    assert _pin(index, "b", 3, start=100)
    assert (_pinned(index, "a"), _pinned(index, "b")) == (13, 3)
    assert index.holds.pins_ended_early == 3
    assert sorted(index.sessions.session_of(PIN_CLIENT).leases)[:13] == leases[3:]  # the oldest ended
    assert index.stats().leased_chunks == 16
    index.check()


def test_a_salt_past_its_share_is_refused_and_its_commit_still_succeeds():
    """Two salts pinning share the room half and half once it is full: the one holding its half
    is refused (the chunks are committed, unpinned) until a pin of its own ends."""
    index = _index()
    for i in range(12):
        _pin(index, "a", 1, start=i)
    assert _pin(index, "b", 4, start=100)  # room left: no one gives way
    assert not _pin(index, "a", 1, start=200)  # a holds 12 of 16, past its half
    assert index.holds.pins_refused_share == 1
    assert index.stats().chunks == 12 + 4 + 1  # committed all the same
    assert _pin(index, "b", 4, start=300)  # b within its half: a's oldest give way
    assert (_pinned(index, "a"), _pinned(index, "b")) == (8, 8)
    assert not _pin(index, "b", 1, start=400)  # now b holds its half too
    assert index.holds.pins_refused_share == 2
    index.expire(30.0)  # every pin ends
    assert index.holds.pins.pinned_bytes == 0
    assert _pin(index, "a", 16, start=500)
    index.check()


def test_shares_shrink_with_the_salts_pinning():
    """Three salts: each may hold a third of the room when it is short."""
    index = _index()
    for i in range(10):
        _pin(index, "a", 1, start=i)
    _pin(index, "b", 6, start=100)
    assert _pin(index, "c", 5, start=200)  # a third of 16 is 5.33: a and b give way
    assert _pinned(index, "c") == 5
    assert _pinned(index, "a") + _pinned(index, "b") == 11
    assert (_pinned(index, "a"), _pinned(index, "b")) == (5, 6)  # the one furthest past its share gave way
    assert not _pin(index, "c", 1, start=300)
    index.check()


def test_a_clear_ends_a_salts_pins_and_its_share():
    index = _index()
    for i in range(16):
        _pin(index, "a", 1, start=i)
    index.clear("a")
    assert index.holds.pins.pinned_bytes == 0
    assert index.holds.pins.bytes_of("a") == 0
    assert _pin(index, "b", 16, start=100)
    index.check()


def test_a_salt_cannot_starve_others_by_pin_count_either(monkeypatch):
    """The pins' lease count is shared the same way: many tiny pins of one salt do not keep
    another salt's pin out."""
    monkeypatch.setattr("kvdepot.server._holds.MAX_PIN_LEASES", 4)
    index = _index(pages=64)  # room for 64 slots of pins: the count binds first
    for i in range(4):
        _pin(index, "a", 1, start=i)
    assert not _pin(index, "a", 1, start=10)
    assert _pin(index, "b", 1, start=100)
    assert index.holds.pins_ended_early == 1
    index.check()


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["pin", "pin", "pin", "tick", "clear"]), st.sampled_from("abcd"), st.integers(1, 6)),
        min_size=10,
        max_size=80,
    )
)
def test_a_pin_that_keeps_its_salt_within_its_share_is_always_granted(ops):
    """Whatever salts pin, expire or clear: pins stay within their room, and a pin that keeps its
    salt within its equal share of the room (among the salts pinning and itself) is granted."""
    index = _index(pages=16)
    room = index.holds.pins.max_bytes
    now, start = 0.0, 0
    for name, salt, count in ops:
        if name == "tick":
            now += count * 5.0
            index.expire(now)
        elif name == "clear":
            index.clear(salt)
        else:
            pinning = {lease.entries[0].salt for lease in _pin_leases(index)} | {salt}
            within = index.holds.pins.bytes_of(salt) + count * SLOT <= room / len(pinning)
            granted = _pin(index, salt, count, now, start)
            start += count
            assert granted or not within, "a pin within its salt's share was refused"
        assert index.holds.pins.pinned_bytes <= room
        index.check()


def _pin_leases(index: ChunkIndex) -> list:
    session = index.sessions.session_of(PIN_CLIENT)
    return [] if session is None else [index.sessions.leases[lid] for lid in session.leases]


def test_salts_pinning_and_leaving_keep_the_bookkeeping_in_proportion():
    """Hundreds of salts pin, give way and expire: what is kept to find the salts past their
    share stays in proportion to the salts pinning now (`check` bounds it)."""
    index = _index(pages=64)  # room for 64 one-slot pins
    start = 0
    for round_ in range(6):
        now = round_ * 40.0
        for n in range(100):
            _pin(index, f"salt-{round_}-{n}", 1, now, start)
            start += 1
            index.check()
        assert index.holds.pins.pins == 64
        index.expire(now + 30.0)
        assert index.holds.pins.pins == 0
        index.check()
