"""The remote tier against a real Valkey (the `valkey_server` and `valkey_cluster` fixtures of
kvdepot.server.testing): round trips, batches across cluster slots, corruption, and outages
that it notices fast and recovers from by itself."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time

import pytest
from structlog.testing import capture_logs

from kvdepot.server import ChunkRef, ChunkWrite, RemoteTier, TierError, TierState, object_name
from kvdepot.server._remote_tier import READ_WORKERS
from kvdepot.server._tier_format import FIXED_HEADER_BYTES
from kvdepot.server._tiers import SALT_TAG_BYTES, salt_tag

pytestmark = pytest.mark.integration

CHUNK = 64 * 1024
FAST = {"retry_interval": 0.1, "op_timeout": 0.5, "connect_timeout": 0.3}


def payload(i: int, size: int = CHUNK) -> bytes:
    return (i.to_bytes(4, "little") * (size // 4 + 1))[:size]


def writes(*keys: int, salt: str = "s", size: int = CHUNK) -> list[ChunkWrite]:
    return [ChunkWrite(salt, b"k%d" % i, payload(i, size), b"fp") for i in keys]


def read(tier: RemoteTier, *keys: int, salt: str = "s", size: int = CHUNK, **kw) -> list[bytes | None]:
    bufs = [bytearray(size) for _ in keys]
    refs = [ChunkRef(salt, b"k%d" % i, b"fp", size) for i in keys]
    hits = tier.read(refs, [memoryview(b) for b in bufs], **kw)
    return [bytes(b) if hit else None for b, hit in zip(bufs, hits, strict=True)]


@pytest.fixture
def open_tier():
    tiers: list[RemoteTier] = []

    def make(url: str, **kw) -> RemoteTier:
        tier = RemoteTier(url, **{**FAST, **kw})
        tiers.append(tier)
        return tier

    yield make
    for tier in tiers:
        tier.close()


def test_round_trip_standalone(valkey_server, open_tier):
    """Chunks written in one pipeline read back byte for byte; absent ones miss; stats count them."""
    tier = open_tier(valkey_server.url)
    assert tier.state is TierState.UP
    assert tier.write(writes(1, 2, 3)) == [True, True, True]
    assert read(tier, 1, 2, 3, 4) == [payload(1), payload(2), payload(3), None]
    assert tier.lengths([ChunkRef("s", b"k1", b"fp"), ChunkRef("s", b"k4", b"fp")]) == [CHUNK, None]
    s = tier.stats()
    assert (s.hits, s.misses, s.writes, s.bytes_written, s.bytes_read) == (3, 1, 3, 3 * CHUNK, 3 * CHUNK)
    with contextlib.closing(valkey_server.client()) as plain:
        value = plain.get("kvd:" + object_name("s", b"k1"))
    assert value is not None
    # header (its fingerprint: the salt's tag, then the caller's), then the raw payload
    assert value[FIXED_HEADER_BYTES : FIXED_HEADER_BYTES + SALT_TAG_BYTES] == salt_tag("s")
    assert value[FIXED_HEADER_BYTES + SALT_TAG_BYTES + 2 :] == payload(1)


def test_large_chunks(valkey_server, open_tier):
    """8 MiB chunks round-trip intact."""
    tier = open_tier(valkey_server.url)
    big = os.urandom(8 << 20)
    assert tier.write([ChunkWrite("s", b"big", big)]) == [True]
    buf = bytearray(len(big))
    assert tier.read([ChunkRef("s", b"big", b"", len(big))], [memoryview(buf)]) == [True]
    assert buf == big


def test_salt_isolation_and_sharing_between_servers(valkey_server, open_tier):
    """Two tiers on one server (two kvdepot servers) share a chunk of the same salt, never across salts."""
    one, two = open_tier(valkey_server.url), open_tier(valkey_server.url)
    one.write(writes(1, salt="tenant-a"))
    assert read(two, 1, salt="tenant-a") == [payload(1)]
    assert read(two, 1, salt="tenant-b") == [None]


def test_prefix_and_ttl(valkey_server, open_tier):
    """Keys carry the configured prefix and, when asked, a TTL."""
    tier = open_tier(valkey_server.url, prefix="other:", ttl=60)
    tier.write(writes(1))
    with contextlib.closing(valkey_server.client()) as plain:
        ttl = plain.pttl("other:" + object_name("s", b"k1"))
    assert 0 < ttl <= 60_000


@pytest.mark.parametrize("where", ["header", "payload", "garbage"])
def test_corrupt_value_is_a_miss_counted_and_deleted(valkey_server, open_tier, where):
    """A flipped byte (or a foreign value) under a chunk's key is a miss; the key is deleted and counted."""
    tier = open_tier(valkey_server.url)
    tier.write(writes(1, 2))
    key = "kvd:" + object_name("s", b"k1")
    with contextlib.closing(valkey_server.client()) as plain:
        if where == "garbage":
            plain.set(key, b"not a kvdepot object")
        else:
            offset = 20 if where == "header" else FIXED_HEADER_BYTES + SALT_TAG_BYTES + 2 + 1000
            byte = plain.getrange(key, offset, offset)[0]
            plain.setrange(key, offset, bytes([byte ^ 0x40]))
        assert read(tier, 1, 2) == [None, payload(2)]
        assert plain.exists(key) == 0
    assert tier.stats().corrupt == 1


def test_password_from_file(valkey_server, open_tier, tmp_path):
    """A server with a password is reached with the password from a file; without it the tier is down."""
    with contextlib.closing(valkey_server.client()) as plain:
        plain.config_set("requirepass", "s3cret")
    secret = tmp_path / "password"
    secret.write_text("s3cret\n")
    tier = open_tier(valkey_server.url, password_file=secret)
    assert tier.write(writes(1)) == [True]
    assert read(tier, 1) == [payload(1)]
    refused = open_tier(valkey_server.url)
    assert refused.state is TierState.DOWN
    assert read(refused, 1) == [None]


def test_server_killed_then_restarted(valkey_server, open_tier):
    """Killed: calls miss at once, the tier is down with one warning. Restarted: it comes back by itself."""
    tier = open_tier(valkey_server.url)
    tier.write(writes(1))
    valkey_server.kill()
    with capture_logs() as logs:
        assert read(tier, 1) == [None]
        for _ in range(50):
            assert read(tier, 1) == [None]
            assert tier.write(writes(2)) == [False]
    assert tier.state is TierState.DOWN
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == ["remote_tier_down"]
    s = tier.stats()
    assert (s.outages, s.skipped) == (1, 50)  # every read after the first was answered without the server
    valkey_server.start()  # same port; the data is gone (no persistence)
    assert tier.wait_until_up(10), "the tier did not come back by itself"
    assert tier.write(writes(3)) == [True]
    assert read(tier, 3) == [payload(3)]


def test_hung_server_costs_at_most_the_deadline(valkey_server, open_tier):
    """A server that stops answering (SIGSTOP): a read returns at its deadline as late misses, then the
    tier goes down and later calls return at once; when the server answers again the tier is back."""
    tier = open_tier(valkey_server.url, op_timeout=0.4)
    tier.write(writes(1))
    valkey_server.pause()
    try:
        assert read(tier, 1, timeout=0.1) == [None]
        assert tier.stats().late == 1  # given up at its deadline, not at the 0.4 s command timeout
        deadline = time.monotonic() + 5
        while tier.state is TierState.UP and time.monotonic() < deadline:
            time.sleep(0.05)
        assert tier.state is TierState.DOWN
        skipped = tier.stats().skipped
        assert read(tier, 1) == [None]
        assert tier.stats().skipped == skipped + 1  # answered without the server
    finally:
        valkey_server.resume()
    assert tier.wait_until_up(10)
    assert read(tier, 1) == [payload(1)]


def test_unreachable_at_start_is_down_then_up(valkey_server, open_tier):
    """A tier whose server is not there yet starts down (no error) and comes up when the server does."""
    port = valkey_server.port
    valkey_server.kill()
    tier = open_tier(f"redis://127.0.0.1:{port}")
    assert tier.state is TierState.DOWN
    assert tier.write(writes(1)) == [False]
    valkey_server.start()
    assert tier.wait_until_up(10)
    assert tier.write(writes(1)) == [True]


def test_cluster_batch_across_slots(valkey_cluster, open_tier):
    """One call writes and reads a batch whose keys live on all three masters."""
    tier = open_tier(valkey_cluster.url)
    keys = list(range(48))
    assert tier.write(writes(*keys)) == [True] * 48
    per_node = []
    for node in valkey_cluster.nodes:
        with contextlib.closing(node.client()) as plain:
            per_node.append(plain.dbsize())
    assert sum(per_node) == 48
    assert all(n > 0 for n in per_node), f"keys not spread over the masters: {per_node}"
    assert read(tier, *keys) == [payload(i) for i in keys]
    assert read(tier, 1, salt="other") == [None]


def test_cluster_corruption_is_a_miss(valkey_cluster, open_tier):
    """A flipped payload byte on a cluster node is a miss, and the key is deleted."""
    tier = open_tier(valkey_cluster.url)
    tier.write(writes(1, 2, 3))
    key = "kvd:" + object_name("s", b"k2")
    for node in valkey_cluster.nodes:
        with contextlib.closing(node.client()) as plain:
            slot = plain.execute_command("CLUSTER", "KEYSLOT", key)
            if plain.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot):
                plain.setrange(key, FIXED_HEADER_BYTES + SALT_TAG_BYTES + 2 + 5, b"\xff\xff")
    assert read(tier, 1, 2, 3) == [payload(1), None, payload(3)]
    assert tier.stats().corrupt == 1
    assert tier.lengths([ChunkRef("s", b"k2", b"fp")]) == [None]


@pytest.mark.slow
def test_cluster_node_killed_then_back(valkey_cluster, open_tier):
    """A master killed mid-run: reads miss fast and the tier reports down; restarted, the tier comes back
    by itself and writes resume."""
    tier = open_tier(valkey_cluster.url)
    keys = list(range(24))
    tier.write(writes(*keys))
    valkey_cluster.kill(1)
    got = read(tier, *keys)
    assert tier.state is TierState.DOWN
    assert got == [None] * len(keys)
    skipped = tier.stats().skipped
    assert read(tier, *keys) == [None] * len(keys)
    assert tier.write(writes(100)) == [False]
    assert tier.stats().skipped == skipped + len(keys)  # answered without the cluster
    valkey_cluster.restart(1)
    assert tier.wait_until_up(30), "the tier did not come back after the node restarted"
    assert tier.write(writes(*keys)) == [True] * len(keys)
    assert read(tier, *keys) == [payload(i) for i in keys]


def test_a_read_cut_off_by_the_deadline_keeps_the_chunks_in_by_then(valkey_server, open_tier, monkeypatch):
    """The server stops answering after the first chunk (CLIENT PAUSE): that chunk hits, the
    late ones are misses, counted, and never land in the buffers afterwards; the next read gets
    a clean connection."""
    import redis

    from kvdepot.server import _remote_read

    monkeypatch.setattr(_remote_read, "READ_WINDOW_BYTES", CHUNK)  # one GET per window
    tier = open_tier(valkey_server.url, op_timeout=5.0)
    tier.write(writes(1, 2, 3, 4))
    admin = valkey_server.client()
    sent = []
    send = redis.Connection.send_packed_command

    def pause_before_the_second(self, *args, **kwargs):
        sent.append(1)
        if len(sent) == 2:
            time.sleep(0.05)  # the first GET is answered
            admin.execute_command("CLIENT", "PAUSE", 1500, "ALL")  # sent #3
        return send(self, *args, **kwargs)

    monkeypatch.setattr(redis.Connection, "send_packed_command", pause_before_the_second)
    bufs = [bytearray(CHUNK) for _ in range(4)]
    try:
        hits = tier.read(
            [ChunkRef("s", b"k%d" % i, b"fp", CHUNK) for i in (1, 2, 3, 4)],
            [memoryview(b) for b in bufs],
            timeout=0.3,
        )
        monkeypatch.setattr(redis.Connection, "send_packed_command", send)
        assert hits == [True, False, False, False]
        assert bytes(bufs[0]) == payload(1)
        assert tier.stats().late == 3
    finally:
        admin.execute_command("CLIENT", "UNPAUSE")
        admin.close()
    time.sleep(0.2)
    assert bufs[1:] == [bytearray(CHUNK)] * 3  # the late replies never wrote
    assert read(tier, 4, 3, 2, 1) == [payload(4), payload(3), payload(2), payload(1)]
    assert tier.state is TierState.UP


class TricklingLink:
    """A TCP relay in front of a real Valkey: requests pass at once; once `slow` is set, replies
    come ``piece`` bytes every ``pause`` seconds (a congested link, an overloaded server)."""

    def __init__(self, port: int, piece: int, pause: float) -> None:
        self.port_to, self.piece, self.pause = port, piece, pause
        self.slow = False
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = [self.listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                near, _ = self.listener.accept()
                far = socket.create_connection(("127.0.0.1", self.port_to))
                self.sockets += [near, far]
                threading.Thread(target=self._relay, args=(near, far, False), daemon=True).start()
                threading.Thread(target=self._relay, args=(far, near, True), daemon=True).start()

    def _relay(self, src: socket.socket, dst: socket.socket, replies: bool) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(self.piece if replies else 1 << 16):
                dst.sendall(data)
                if replies and self.slow:
                    time.sleep(self.pause)

    def close(self) -> None:
        for s in self.sockets:
            with contextlib.suppress(OSError):
                s.close()


def test_a_reply_trickling_in_costs_the_caller_its_deadline_only(valkey_server, open_tier):
    """A 1 MiB value coming 32 KiB every 50 ms (each piece well within any socket timeout)
    takes 1.6 s; a read with a 0.3 s deadline returns at it, a late miss, and its buffer is
    never written afterwards."""
    link = TricklingLink(valkey_server.port, piece=32 << 10, pause=0.05)
    try:
        tier = open_tier(f"redis://127.0.0.1:{link.port}", op_timeout=0.5)
        size = 1 << 20
        assert tier.write(writes(1, size=size)) == [True]
        link.slow = True
        buf = bytearray(size)
        assert tier.read([ChunkRef("s", b"k1", b"fp", size)], [memoryview(buf)], timeout=0.3) == [False]
        assert tier.stats().late == 1  # given up at its deadline, before the value was in
        time.sleep(1.5)
        assert buf == bytearray(size)
    finally:
        link.close()


def test_the_read_after_a_late_one_on_a_hung_server_costs_its_deadline_only(valkey_server, open_tier):
    """The late read dropped its connection; the next one must open another, whose handshake
    a hung (SIGSTOP) server never answers: the caller still waits its deadline only."""
    tier = open_tier(valkey_server.url, op_timeout=2.0)
    tier.write(writes(1))
    valkey_server.pause()
    try:
        for _ in range(2):
            assert read(tier, 1, timeout=0.1) == [None]
        assert tier.stats().late == 2  # both given up at their deadlines, not at the 2 s command timeout
    finally:
        valkey_server.resume()


def test_a_read_given_up_on_before_a_read_thread_was_free_sends_nothing(valkey_server, open_tier):
    """Reads queued while every read thread waits on a hung server (SIGSTOP), whose callers gave
    up at their deadlines, send no GET once the server answers and a thread takes them. (The
    long command timeout keeps the reads that have a thread waiting until the server answers.)"""
    tier = open_tier(valkey_server.url, op_timeout=5.0)
    tier.write(writes(1))
    stats = valkey_server.client()

    def gets() -> int:
        return int(stats.info("commandstats").get("cmdstat_get", {}).get("calls", 0))

    valkey_server.pause()
    try:
        for _ in range(READ_WORKERS + 2):
            assert read(tier, 1, timeout=0.05) == [None]
    finally:
        valkey_server.resume()
    deadline = time.monotonic() + 5
    while gets() < READ_WORKERS and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # the queued reads run as soon as a thread is free
    assert gets() == READ_WORKERS
    assert tier.stats().late == READ_WORKERS + 2
    assert read(tier, 1) == [payload(1)]


def test_a_batch_in_several_windows_lands_each_chunk_checked(valkey_server, open_tier, monkeypatch):
    """Window by window as the replies come in: every chunk lands in its own buffer, a corrupt
    one in a middle window is a miss (deleted, counted), an absent one a miss, the rest hit."""
    from kvdepot.server import _remote_read

    monkeypatch.setattr(_remote_read, "READ_WINDOW_BYTES", 2 * CHUNK)
    tier = open_tier(valkey_server.url)
    tier.write(writes(1, 2, 3, 4, 5, 6))
    key = "kvd:" + object_name("s", b"k4")
    with contextlib.closing(valkey_server.client()) as plain:
        offset = FIXED_HEADER_BYTES + SALT_TAG_BYTES + 2 + 7
        plain.setrange(key, offset, bytes([plain.getrange(key, offset, offset)[0] ^ 1]))
        assert read(tier, 1, 2, 3, 4, 9, 6) == [payload(1), payload(2), payload(3), None, None, payload(6)]
        assert plain.exists(key) == 0
    s = tier.stats()
    assert (s.hits, s.misses, s.corrupt) == (4, 2, 1)


@pytest.mark.parametrize(
    ("lengths", "spans"),
    [
        ([], []),
        ([1 << 20] * 8, [(0, 8)]),
        ([16 << 20] * 3, [(0, 1), (1, 2), (2, 3)]),
        ([10 << 20] * 3, [(0, 2), (2, 3)]),
        ([1 << 20] * 40, [(0, 16), (16, 32), (32, 40)]),
    ],
)
def test_read_windows_are_consecutive_and_large(lengths, spans):
    """A batch's GETs are sent in consecutive windows of at least READ_WINDOW_BYTES of values."""
    from kvdepot.server._remote_read import windows

    assert windows(lengths) == spans


def test_a_cluster_read_follows_a_moved_slot(valkey_cluster, open_tier):
    """A client whose map of the slots is stale (as while slots move) is answered MOVED by the
    node it asks: those chunks are fetched again from the right node and hit."""
    tier = open_tier(valkey_cluster.url)
    keys = list(range(12))
    assert tier.write(writes(*keys)) == [True] * 12
    client, _ = tier._link.current()
    manager = client.nodes_manager
    slot = client.keyslot(tier.key_of("s", b"k5"))
    owner = manager.slots_cache[slot][0]
    wrong = next(n for n in client.get_primaries() if n.name != owner.name)
    manager.slots_cache[slot] = [wrong]  # the stale map: the slot's key goes to a node that no longer has it
    assert client.get_node_from_key(tier.key_of("s", b"k5")).name == wrong.name
    assert read(tier, *keys) == [payload(i) for i in keys]
    s = tier.stats()
    assert (s.hits, s.errors) == (12, 0)


def stored(server, salt: str, *keys: int) -> list[int]:
    """Which of ``keys`` of ``salt`` the Valkey server (or cluster) holds, asked directly."""
    names = {object_name(salt, b"k%d" % i): i for i in keys}
    found = []
    for node in getattr(server, "nodes", [server]):
        with contextlib.closing(node.client()) as plain:
            found += [names[k.decode()[len("kvd:") :]] for k in plain.keys("kvd:*") if k.decode()[4:] in names]
    return sorted(found)


@pytest.mark.parametrize("where", ["valkey_server", "valkey_cluster"])
def test_a_salt_over_its_quota_loses_its_own_oldest_objects_only(where, request, open_tier):
    """With a quota, a salt's writes past it delete that salt's oldest objects, never another
    salt's; a chunk larger than the quota is not written; a salt without a quota is unbounded."""
    server = request.getfixturevalue(where)
    quotas = {"small": 3 * CHUNK}
    tier = open_tier(server.url)
    tier.quota_of = quotas.get
    assert tier.write(writes(*range(10), salt="big")) == [True] * 10
    for i in range(6):
        assert tier.write(writes(i, salt="small")) == [True]
    assert stored(server, "small", *range(6)) == [3, 4, 5]
    assert tier.write(writes(6, 7, salt="small")) == [True, True]  # one batch, two salts' worth
    assert stored(server, "small", *range(8)) == [5, 6, 7]
    assert stored(server, "big", *range(10)) == list(range(10))
    assert read(tier, 5, 6, 7, salt="small") == [payload(5), payload(6), payload(7)]
    assert tier.write(writes(9, salt="small", size=3 * CHUNK + 1)) == [False]
    assert stored(server, "small", 9) == []


def test_servers_sharing_a_remote_tier_count_a_salt_together(valkey_server, open_tier):
    """Two servers (two tiers) writing the same salt share one count: together they keep it
    within its quota, and a rewrite of an object already there is not counted twice."""
    one, two = open_tier(valkey_server.url), open_tier(valkey_server.url)
    for tier in (one, two):
        tier.quota_of = lambda salt: 4 * CHUNK
    one.write(writes(0, 1, 2))
    two.write(writes(2, 3))  # 2 again: the same object, counted once
    assert stored(valkey_server, "s", *range(6)) == [0, 1, 2, 3]
    two.write(writes(4, 5))
    assert stored(valkey_server, "s", *range(6)) == [2, 3, 4, 5]


def test_a_salts_count_evicted_apart_from_its_objects_is_rebuilt(valkey_server, open_tier):
    """allkeys-lru evicts keys one by one: a salt's byte count may go while its list of objects
    stays. The next write rebuilds the count from that list, so the quota still holds."""
    from kvdepot.server._tiers import salt_tag

    tier = open_tier(valkey_server.url)
    tier.quota_of = lambda salt: 3 * CHUNK
    tier.write(writes(0, 1, 2))
    count = f"kvd:quota:{{{salt_tag('s').hex()}}}:bytes"
    with contextlib.closing(valkey_server.client()) as plain:
        assert int(plain.get(count)) == 3 * CHUNK
        plain.delete(count)  # as maxmemory would
        for n in range(3, 9):
            tier.write(writes(n))
            assert int(plain.get(count)) == 3 * CHUNK
    assert stored(valkey_server, "s", *range(9)) == [6, 7, 8]


def test_a_probe_not_answered_by_its_deadline_is_a_miss_then(valkey_server, open_tier):
    """A Valkey that stops answering (frozen, or paused) holds a lookup's probe only until the
    lookup's deadline, not until the tier's socket timeout: the chunks count as not there, and
    as late. Once it answers again, the probe finds them."""
    tier = open_tier(valkey_server.url, op_timeout=5.0)
    assert tier.write(writes(1)) == [True]
    valkey_server.pause()
    try:
        assert tier.lengths([ChunkRef("s", b"k1", b"fp")], timeout=0.2) == [None]
    finally:
        valkey_server.resume()
    assert tier.stats().late == 1  # given up at the lookup's deadline; the socket timeout is 5 s
    assert tier.lengths([ChunkRef("s", b"k1", b"fp")], timeout=5.0) == [CHUNK]


def test_a_whole_cluster_down_degrades_the_tier_and_it_comes_back(tmp_path):
    """With every node of a cluster unreachable the tier's calls miss instead of raising, the tier
    is marked down, and it comes back by itself once the cluster is; a server started while the
    cluster is down starts with the tier down rather than failing."""
    from kvdepot.server.testing import ValkeyCluster, _binary_or_skip

    cluster = ValkeyCluster(_binary_or_skip(), tmp_path / "cluster").start()
    tiers: list[RemoteTier] = []
    try:
        tier = RemoteTier(cluster.url, **FAST)
        tiers.append(tier)
        assert tier.wait_until_up(10)
        for i in range(3):
            cluster.kill(i)
        assert tier.write(writes(1)) == [False]
        assert tier.lengths([ChunkRef("s", b"k1", b"fp")]) == [None]
        assert read(tier, 1) == [None]
        assert tier.state is TierState.DOWN
        late = RemoteTier(cluster.url, **FAST)
        tiers.append(late)
        assert late.state is TierState.DOWN
        time.sleep(0.5)  # a few rounds of the probe thread against the dead cluster
        for i in range(3):
            cluster.restart(i)
        cluster.wait_ok()
        assert tier.wait_until_up(20)
        assert late.wait_until_up(20)
        assert tier.write(writes(1)) == [True]
        assert read(late, 1) == [payload(1)]
    finally:
        for t in tiers:
            t.close()
        cluster.stop()


def test_an_object_evicted_behind_the_tier_is_counted_until_it_is_the_oldest(valkey_server, open_tier):
    """Valkey evicts or expires objects without telling anyone: the count errs high until the
    salt's next writes pop the missing name, and the salt never holds more than its quota."""
    tier = open_tier(valkey_server.url)
    tier.quota_of = lambda salt: 3 * CHUNK
    tier.write(writes(0, 1, 2))
    with contextlib.closing(valkey_server.client()) as plain:
        plain.delete("kvd:" + object_name("s", b"k0"))  # as maxmemory or a TTL would
    tier.write(writes(3))
    assert stored(valkey_server, "s", *range(4)) == [1, 2, 3]
    tier.write(writes(4, 5))
    assert stored(valkey_server, "s", *range(6)) == [3, 4, 5]


def all_keys(server) -> list[bytes]:
    found: list[bytes] = []
    for node in getattr(server, "nodes", [server]):
        with contextlib.closing(node.client()) as plain:
            found += plain.keys("*")
    return found


@pytest.mark.parametrize("where", ["valkey_server", "valkey_cluster"])
def test_a_clear_deletes_one_salts_objects_whoever_wrote_them_and_its_accounting(where, request, open_tier):
    """A clear finds a salt's objects by the tag in their headers (on every node of a cluster), also
    those another server wrote and those whose quota accounting Valkey lost; other salts' objects
    and keys outside the prefix stay."""
    server = request.getfixturevalue(where)
    writer, clearer = open_tier(server.url), open_tier(server.url)
    writer.quota_of = {"gone": 100 * CHUNK}.get
    assert writer.write(writes(*range(30), salt="gone", size=1024)) == [True] * 30
    assert writer.write(writes(*range(5), salt="kept", size=1024)) == [True] * 5
    import redis

    if where == "valkey_server":
        plain = server.client()
    else:
        plain = redis.RedisCluster(host="127.0.0.1", port=server.nodes[0].port)
    with contextlib.closing(plain):
        plain.set("not-kvdepot", b"x")
        plain.delete(f"kvd:quota:{{{salt_tag('gone').hex()}}}:objects")  # as if Valkey evicted it
    assert any(b"quota:" in k for k in all_keys(server))
    assert clearer.clear("gone") == 30
    assert stored(server, "gone", *range(30)) == []
    assert stored(server, "kept", *range(5)) == list(range(5))
    assert not any(b"quota:" in k for k in all_keys(server))
    assert b"not-kvdepot" in all_keys(server)
    assert read(clearer, 0, 1, salt="kept", size=1024) == [payload(0, 1024), payload(1, 1024)]
    assert clearer.clear("gone") == 0
    assert clearer.clear(None) == 5
    assert stored(server, "kept", *range(5)) == []
    assert b"not-kvdepot" in all_keys(server)


def test_clearing_a_tier_that_is_down_is_a_typed_error(valkey_server, open_tier):
    tier = open_tier(valkey_server.url)
    assert tier.write(writes(1)) == [True]
    valkey_server.kill()
    tier.write(writes(2))  # marks it down
    with pytest.raises(TierError, match="down"):
        tier.clear("s")
