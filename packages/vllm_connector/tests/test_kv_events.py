"""The connector's KV events against a fake server: what is announced, when, and what undoes it.

A unit test: the client is a test double holding a server's RAM as a set of keys and its
numbered changes, answering `changes` and `query` as the real server does (the end-to-end test
with real engines and a real server is tests/vllm/test_kv_events_e2e.py).
"""

from __future__ import annotations

import hashlib
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

pytest.importorskip("vllm")

from vllm.distributed.kv_events import BlockRemoved, BlockStored

from kvdepot.core import LABEL_KEY_BYTES, SaltLabeler, salt_label
from kvdepot.transport import MAX_SALTS_PER_CHANGES, Change, ChangesReply, QueryReply, QueryResult
from kvdepot.vllm_connector._kv_events import EventAnnouncer

BLOCK, CHUNK = 4, 8
LABEL_KEY = bytes(range(LABEL_KEY_BYTES))  # the fake server's salt-label key


def digest(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


class FakeServer:
    """A server's RAM (keys) and its numbered changes; a restart forgets both."""

    def __init__(self) -> None:
        self.server_id = "server-1"
        self.label_key = LABEL_KEY  # what its HelloReply hands the owner's engines
        self.held: set[bytes] = set()
        self.below: set[bytes] = set()  # the tiers below RAM (a disk tier)
        self.log: list[tuple[bool, str, bytes]] = []
        self.first = 1  # the oldest change kept
        self.polls = 0
        self.queried: list[bytes] = []

    def commit(self, salt: str, *keys: bytes) -> None:
        for key in keys:
            self.held.add(key)
            self.log.append((True, salt, key))

    def evict(self, salt: str, *keys: bytes) -> None:
        for key in keys:
            self.held.discard(key)
            self.log.append((False, salt, key))

    def restart(self) -> None:
        self.server_id, self.held, self.log, self.first = self.server_id + "'", set(), [], 1

    def changes(self, since: int, salts: list[str], limit: int, server_id: str) -> ChangesReply:
        head = self.first + len(self.log)
        if since == 0:
            return ChangesReply([], head)
        if since < self.first or since > head or server_id not in ("", self.server_id):
            return ChangesReply([], head, lost=True)
        window = self.log[since - self.first : since - self.first + limit]
        out = [Change(stored, salts.index(salt), key) for stored, salt, key in window if salt in salts]
        return ChangesReply(out, since + len(window))


class FakeBatch:
    def __init__(self, server: FakeServer) -> None:
        self.server = server

    def __enter__(self) -> FakeBatch:
        self.server.polls += 1
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def changes(self, since: int, salts: list[str], *, limit: int, server_id: str) -> Future[Any]:
        if len(salts) > MAX_SALTS_PER_CHANGES:  # as the real server: a malformed request
            future: Future[Any] = Future()
            future.set_exception(ValueError(f"{len(salts)} salts"))
            return future
        return done(self.server.changes(since, salts, limit, server_id))

    def query(self, items: list[Any], *, tiers: bool) -> Future[Any]:
        server = self.server
        server.queried.extend(key for item in items for key in item.keys)
        results = []
        for item in items:
            key = item.keys[0]
            ram = int(key in server.held)
            results.append(QueryResult(ram, int(tiers and not ram and key in server.below)))
        return done(QueryReply(results))


class FakeClient:
    def __init__(self, server: FakeServer) -> None:
        self.server = server

    @property
    def server_id(self) -> str:
        return self.server.server_id

    @property
    def label_key(self) -> bytes:
        return self.server.label_key

    def batch(self) -> FakeBatch:
        return FakeBatch(self.server)


def done(value: Any) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_result(value)
    return future


def request(seed: int, chunks: int = 2, lora: str | None = None) -> SimpleNamespace:
    tokens = [seed * 1000 + i for i in range(chunks * CHUNK + 3)]
    hashes = [digest(f"{seed}/{b}") for b in range(len(tokens) // BLOCK)]
    lora_request = SimpleNamespace(name=lora, adapter_id=7) if lora else None
    return SimpleNamespace(block_hashes=hashes, all_token_ids=tokens, lora_request=lora_request)


def hashes_of(req: SimpleNamespace, chunk: int) -> list[int]:
    """The chunk's block hashes as vLLM's events name them by default (their low 64 bits)."""
    blocks = req.block_hashes[chunk * (CHUNK // BLOCK) : (chunk + 1) * (CHUNK // BLOCK)]
    return [int.from_bytes(h, "big") & (2**64 - 1) for h in blocks]


def keys_of(seed: int, chunks: int = 2, ranks: int = 1) -> list[list[bytes]]:
    return [[digest(f"key/{seed}/{c}/{r}") for c in range(chunks)] for r in range(ranks)]


@pytest.fixture
def server() -> FakeServer:
    return FakeServer()


def announcer(server: FakeServer, **kwargs: Any) -> EventAnnouncer:
    events = EventAnnouncer(FakeClient(server), block_size=BLOCK, chunk_size=CHUNK, **kwargs)  # type: ignore[arg-type]
    events.take()  # the first poll: where the server's numbering stands
    return events


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [1000.0]
    monkeypatch.setattr("kvdepot.vllm_connector._kv_events.time.monotonic", lambda: now[0])
    return now


def settle(events: EventAnnouncer, clock: list[float]) -> list[Any]:
    """Two steps: one sends the poll, the next reads it (and sends the next)."""
    out: list[Any] = []
    for _ in range(2):
        clock[0] += 0.1
        out += events.take()
    return out


def test_a_store_is_announced_once_every_rank_committed_it(server, clock):
    events = announcer(server, num_groups=2)
    req, keys = request(1), keys_of(1, ranks=2)
    events.expect(req, 0, keys, "")
    assert settle(events, clock) == []  # planned, not committed
    server.commit("", keys[0][0], keys[0][1], keys[1][0])
    out = settle(events, clock)
    assert [type(e) for e in out] == [BlockStored, BlockStored]  # chunk 0, one event per group
    assert [e.group_idx for e in out] == [0, 1]
    first = out[0]
    assert first.block_hashes == hashes_of(req, 0)
    assert first.parent_block_hash is None
    assert first.token_ids == req.all_token_ids[:CHUNK]
    assert (first.block_size, first.medium, first.ownership) == (BLOCK, "CPU", "kvdepot")
    server.commit("", keys[1][1])
    (second, _) = settle(events, clock)
    assert second.parent_block_hash == first.block_hashes[-1]
    assert second.token_ids == req.all_token_ids[CHUNK : 2 * CHUNK]


def test_an_eviction_removes_and_a_new_commit_announces_again(server, clock):
    events = announcer(server)
    req, keys = request(2), keys_of(2)
    events.expect(req, 0, keys, "")
    server.commit("", *keys[0])
    assert len(settle(events, clock)) == 2
    server.evict("", keys[0][1])
    server.commit("", keys[0][1])  # evicted and stored again between two polls: it ends announced
    server.evict("", keys[0][0])
    out = settle(events, clock)
    assert [(type(e), e.block_hashes) for e in out] == [
        (BlockRemoved, hashes_of(req, 1)),
        (BlockStored, hashes_of(req, 1)),
        (BlockRemoved, hashes_of(req, 0)),
    ]


def test_a_hit_is_announced_at_once(server, clock):
    events = announcer(server)
    req, keys = request(3), keys_of(3)
    events.hit(req, 0, keys, "")
    assert [type(e) for e in events.take()] == [BlockStored, BlockStored]


def test_a_restart_or_a_gap_asks_the_server_and_removes_what_went(server, clock):
    events = announcer(server)
    req, keys = request(4), keys_of(4)
    events.expect(req, 0, keys, "")
    server.commit("", *keys[0])
    assert len(settle(events, clock)) == 2
    server.restart()
    server.commit("", keys[0][1])  # the restarted server got chunk 1 again (read back from a disk tier)
    out = settle(events, clock) + settle(events, clock)
    assert [type(e) for e in out] == [BlockRemoved]  # chunk 0 went with the restart; chunk 1 is still held
    assert set(server.queried) >= set(keys[0])
    # A gap: the server's log moved past what this engine read.
    server.evict("", keys[0][1])
    server.first += len(server.log) + 5
    server.log = []
    out = settle(events, clock) + settle(events, clock)
    assert [type(e) for e in out] == [BlockRemoved]


def test_a_store_never_committed_is_asked_about_and_then_given_up(server, clock):
    events = announcer(server)
    req, keys = request(5), keys_of(5)
    server.held.add(keys[0][0])  # another engine's copy was there first: this engine's store made no change
    events.expect(req, 0, keys, "")
    clock[0] += 1.0
    out = settle(events, clock)
    assert [type(e) for e in out] == [BlockStored]  # asked after a second: chunk 0 is held
    clock[0] += 61.0
    settle(events, clock)
    assert keys[0][1] not in events._by_key  # chunk 1 never came: forgotten


def test_the_oldest_chunk_beyond_the_bound_is_forgotten_with_a_removal(server, clock):
    events = announcer(server, max_watched=2)
    req = request(6, chunks=3)
    events.hit(req, 0, keys_of(6, chunks=3), "")
    out = events.take()
    assert [type(e) for e in out] == [BlockStored, BlockStored, BlockStored, BlockRemoved]
    assert out[-1].block_hashes == out[0].block_hashes


def test_a_reset_removes_everything_announced_and_never_clears_all(server, clock):
    events = announcer(server)
    events.hit(request(7), 0, keys_of(7), "")
    events.take()
    events.reset()
    assert [type(e) for e in events.take()] == [BlockRemoved, BlockRemoved]


def test_events_carry_the_salts_label_never_the_salt(server, clock):
    """The first block's extra keys name the salt by the server's keyed label (its /metrics' label),
    neither the salt nor its unkeyed digest, which a list of guessed salts reverses."""
    events = announcer(server)
    req = request(8, lora="adapter-a")
    events.hit(req, 0, keys_of(8), "tenant-secret")
    out = events.take()
    wire = msgspec.msgpack.encode(out)
    assert b"tenant-secret" not in wire
    assert salt_label("tenant-secret").encode() not in wire
    assert out[0].extra_keys == [("adapter-a", SaltLabeler(LABEL_KEY)("tenant-secret")), ("adapter-a",)]
    assert out[1].extra_keys == [("adapter-a",), ("adapter-a",)]
    assert (out[0].lora_name, out[0].lora_id) == ("adapter-a", 7)


def test_without_the_servers_label_key_events_leave_the_salt_out(server, clock):
    """A server that keeps its key (tcp without a shared secret), or an older one, sends none: the
    extra keys then carry no salt at all rather than a label anyone could compute; a key that
    arrives later (a reconnect) labels the chunks seen after it."""
    server.label_key = b""
    events = announcer(server)
    events.hit(request(8, lora="adapter-a"), 0, keys_of(8), "tenant-secret")
    out = events.take()
    assert salt_label("tenant-secret").encode() not in msgspec.msgpack.encode(out)
    assert out[0].extra_keys == [("adapter-a",), ("adapter-a",)]
    events.hit(request(9), 0, keys_of(9), "tenant-secret")
    assert events.take()[0].extra_keys is None
    server.label_key = bytes(LABEL_KEY_BYTES)
    events.hit(request(10), 0, keys_of(10), "tenant-secret")
    assert events.take()[0].extra_keys == [(SaltLabeler(bytes(LABEL_KEY_BYTES))("tenant-secret"),), None]


def test_a_chunk_that_leaves_ram_for_a_tier_below_is_announced_there(server, clock):
    events = announcer(server)
    req, keys = request(9), keys_of(9)
    events.expect(req, 0, keys, "")
    server.commit("", *keys[0])
    server.below.update(keys[0])  # written behind to the disk tier
    assert len(settle(events, clock)) == 2
    server.evict("", *keys[0])
    out = settle(events, clock) + settle(events, clock)
    assert [(type(e), e.medium, e.block_hashes) for e in out] == [
        (BlockRemoved, "CPU", hashes_of(req, 0)),
        (BlockRemoved, "CPU", hashes_of(req, 1)),
        (BlockStored, "STORAGE", hashes_of(req, 0)),
        (BlockStored, "STORAGE", hashes_of(req, 1)),
    ]
    assert out[2].token_ids == req.all_token_ids[:CHUNK]
    # Valkey's LRU or the disk's capacity took chunk 1: found at the next check, 30 s on.
    server.below.discard(keys[0][1])
    assert settle(events, clock) == []
    clock[0] += 30.0
    out = settle(events, clock)
    assert [(type(e), e.medium, e.block_hashes) for e in out] == [(BlockRemoved, "STORAGE", hashes_of(req, 1))]
    events.reset()
    assert [(type(e), e.medium) for e in events.take()] == [(BlockRemoved, "STORAGE")]


def test_a_chunk_in_no_tier_below_is_only_removed(server, clock):
    events = announcer(server)
    req, keys = request(10, chunks=1), keys_of(10, chunks=1)
    events.hit(req, 0, keys, "")
    assert len(events.take()) == 1
    server.evict("", keys[0][0])
    out = settle(events, clock) + settle(events, clock)
    assert [(type(e), e.medium) for e in out] == [(BlockRemoved, "CPU")]


def test_announced_chunks_are_asked_about_only_every_30_s(server, clock, monkeypatch):
    """A poll asks the server about no chunk that is announced and unchanged, except once every
    `RECHECK_S`: a router's view of thousands of chunks is kept by the changes alone, and no
    announcement outlives its chunk longer than that."""
    monkeypatch.setattr("kvdepot.vllm_connector._kv_events.CHECKS_PER_POLL", 10_000)
    events = announcer(server)
    req, keys = request(12, chunks=500), keys_of(12, chunks=500)
    server.commit("", *keys[0])  # another engine stored them
    events.hit(req, 0, keys, "")
    assert len(events.take()) == 500
    settle(events, clock)
    asked = len(server.queried)  # the first poll after this server's first sight asks about every chunk once
    assert asked == 500
    for _ in range(20):
        assert settle(events, clock) == []
    assert len(server.queried) == asked
    server.evict("", keys[0][7])
    out = settle(events, clock)
    assert [(type(e), e.block_hashes) for e in out] == [(BlockRemoved, hashes_of(req, 7))]
    settle(events, clock)  # the chunk that went, once: is it in a tier below? (no)
    assert len(server.queried) == asked + 1
    server.held.discard(keys[0][9])  # gone without a change the engine saw (a bug, a lost message)
    clock[0] += 61.0
    out = settle(events, clock)
    assert [(type(e), e.block_hashes) for e in out] == [(BlockRemoved, hashes_of(req, 9))]
    assert keys[0][7] not in events._by_key  # gone a minute with no commit bringing it back: forgotten
    # the announced ones once each, and the one found gone once more: is it in a tier below?
    assert len(server.queried) == asked + 1 + 499 + 1


def test_checks_due_together_are_spread_over_polls(server, clock, monkeypatch):
    monkeypatch.setattr("kvdepot.vllm_connector._kv_events.CHECKS_PER_POLL", 2)
    events = announcer(server)
    other = keys_of(14, chunks=1)
    server.commit("", *other[0])
    events.hit(request(14, chunks=1), 0, other, "")
    settle(events, clock)  # the first poll to this server asks about every chunk once: this one
    req, keys = request(13, chunks=5), keys_of(13, chunks=5)
    events.expect(req, 0, keys, "")
    asked = len(server.queried)
    clock[0] += 1.0  # all five are due for their check now
    per_poll = []
    for _ in range(4):
        clock[0] += 0.1
        events.take()
        per_poll.append(len(server.queried) - asked)
        asked = len(server.queried)
    assert per_poll == [2, 2, 1, 0]


def test_a_restart_is_checked_even_after_the_new_server_made_many_changes(server, clock):
    events = announcer(server)
    req, keys = request(15), keys_of(15)
    server.commit("", *keys[0])
    events.hit(req, 0, keys, "")
    events.take()
    settle(events, clock)
    server.restart()
    server.commit("", *[digest(f"other/{i}") for i in range(5000)])  # more than a poll reads
    out = settle(events, clock) + settle(events, clock)
    assert [(type(e), e.block_hashes) for e in out] == [
        (BlockRemoved, hashes_of(req, 0)),
        (BlockRemoved, hashes_of(req, 1)),
    ]


def test_more_salts_than_one_request_takes_are_asked_in_several(server, clock):
    """Changes take at most 1,024 salts: the salts of more chunks go in several, in one message."""
    events = announcer(server)
    salts = [f"user-{i}" for i in range(1500)]
    for i, salt in enumerate(salts):
        keys = [[digest(f"{salt}/chunk")]]
        server.commit(salt, keys[0][0])
        events.hit(request(100 + i, chunks=1), 0, keys, salt)
    events.take()
    settle(events, clock)
    server.evict("user-1400", digest("user-1400/chunk"))
    out = settle(events, clock)
    assert [(type(e), e.block_hashes) for e in out] == [(BlockRemoved, hashes_of(request(1500, chunks=1), 0))]


def test_nothing_is_announced_when_vllm_hashes_finer_than_its_blocks(server, clock):
    events = announcer(server)
    req = request(16)
    req.block_hashes = [digest(f"fine/{i}") for i in range(len(req.all_token_ids) // (BLOCK // 2))]
    events.hit(req, 0, keys_of(16), "")
    assert events.take() == []
