"""The RAM tier's changes as seen from outside a real `kvdepot serve`: the `changes` request of a
real client, the `--kv-events` ZMQ publisher read by a SUB subscriber that decodes with vLLM's
own `KVEventBatch`, its replay endpoint, and the publisher's bounds when nobody reads.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from kvdepot.server import ServerArgumentError
from kvdepot.server._events import Cleared, Committed
from kvdepot.server._kv_publisher import END_SEQ, EventBatch, KVEventPublisher
from kvdepot.transport import CacheClient, Change

pytestmark = pytest.mark.integration

T = 10.0
CHUNK = 16 * 1024 - 64  # one 16 KiB slot
POOL = ["--capacity", "8MiB", "--page-size", "1MiB"]
TOPIC = "kv@test@kvdepot"


def keys(tag: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{tag}-{i}".encode()).digest() for i in range(n)]


def commit(client: CacheClient, salt: str, chunk_keys: list[bytes]) -> None:
    """Reserve and commit the keys not held yet (the bytes do not matter: nobody reads them back)."""
    res = client.reserve(salt, chunk_keys, CHUNK).result(T)
    assert len(res.slots) + len(res.present) == len(chunk_keys)
    if res.slots:
        client.commit(res.reservation_id).result(T)


@pytest.fixture
def zctx() -> Iterator[zmq.Context]:
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def replay_page(sock: zmq.Socket, start: int, timeout: float = T) -> tuple[list[list[bytes]], list[bytes]]:
    """Ask the replay endpoint once, from `start`: (the page's batches' frames, the end marker)."""
    sock.send_multipart([b"", start.to_bytes(8, "big")])
    batches = []
    while True:
        assert sock.poll(int(timeout * 1000)), "the replay endpoint did not answer"
        frames = sock.recv_multipart()
        if frames[2] == END_SEQ:
            return batches, frames
        batches.append(frames)


def replay(ctx: zmq.Context, endpoint: str, start: int, timeout: float = T) -> tuple[list[list[bytes]], list[bytes]]:
    """Every kept batch from `start`, page after page as a subscriber asks for them (each time
    from the number after the last it got): (the batches' frames, the last end marker)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        batches: list[list[bytes]] = []
        while True:
            page, end = replay_page(sock, start, timeout)
            if not page:
                return batches, end
            batches += page
            start = int.from_bytes(page[-1][2], "big") + 1
    finally:
        sock.close(0)


# -- the `changes` request -----------------------------------------------------------------


def test_changes_of_a_real_server_name_the_salts_chunks_and_a_restart_is_lost(serve):
    """Commits under two salts are told to a reader of one salt only (by its index in the
    request), a clear as removals, paging by `next`; after a restart at the same address, a
    number of the old instance is `lost`, with or without the old server id."""
    server = serve(*POOL, "--no-keep-pool")  # the new instance starts empty (a kept pool's: test_kept_pool)
    a_keys, b_keys = keys("a", 3), keys("b", 2)
    with CacheClient(server.address, timeout=T) as client:
        start = client.changes(0, ["a"]).result(T)
        assert (start.changes, start.next, start.lost) == ([], 1, False)  # a fresh server
        old_id = client.server_id
        assert old_id

        client.register("layout", 256, CHUNK).result(T)
        commit(client, "a", a_keys)
        commit(client, "b", b_keys)
        commit(client, "a", a_keys)  # already held: nothing changes
        assert client.reserve("a", a_keys, CHUNK).result(T).present == [0, 1, 2]

        only_a = client.changes(start.next, ["a"], server_id=old_id).result(T)
        assert not only_a.lost
        assert only_a.changes == [Change(True, 0, key) for key in a_keys]
        assert only_a.next == 6
        both = client.changes(start.next, ["b", "a"]).result(T)
        assert both.changes == [Change(True, 1, key) for key in a_keys] + [Change(True, 0, key) for key in b_keys]
        assert server.stats().extra["changes_next"] == 6

        # paging: two numbers a page
        paged, since = [], start.next
        while since < both.next:
            page = client.changes(since, ["a", "b"], limit=2).result(T)
            assert not page.lost
            assert len(page.changes) <= 2
            assert page.next > since
            paged += page.changes
            since = page.next
        assert [c.key for c in paged] == a_keys + b_keys

        assert client.clear_all("a") == 3
        gone = client.changes(both.next, ["a", "b"], server_id=old_id).result(T)
        assert not gone.lost
        assert sorted(gone.changes, key=lambda c: c.key) == sorted(
            (Change(False, 0, key) for key in a_keys), key=lambda c: c.key
        )
        assert client.changes(both.next, ["b"]).result(T).changes == []  # b's chunks stay
        old_next = gone.next
        assert old_next == 9

    server.stop()
    server.start()  # the same address, a new instance
    with CacheClient(server.address, timeout=T) as client:
        assert client.changes(0, ["a"]).result(T).next == 1
        new_id = client.server_id
        assert new_id
        assert new_id != old_id
        lost = client.changes(old_next, ["a", "b"], server_id=old_id).result(T)
        assert (lost.changes, lost.next, lost.lost) == ([], 1, True)
        # without the id, a number past this instance's numbering is lost too
        assert client.changes(old_next, ["a", "b"]).result(T).lost
        # a number of the old instance this one also gave is still lost when the id says so
        client.register("layout", 256, CHUNK).result(T)
        commit(client, "b", keys("new", 4))
        assert client.changes(2, ["b"], server_id=old_id).result(T).lost
        fresh = client.changes(2, ["b"], server_id=new_id).result(T)
        assert not fresh.lost
        assert [c.key for c in fresh.changes] == keys("new", 4)[1:]


# -- the publisher of `kvdepot serve --kv-events` -------------------------------------------


def test_a_subscriber_decodes_stores_and_removals_with_vllms_types_without_gaps_and_replays(
    serve, workdir, zctx, wait_until
):
    """A SUB socket sees a BlockStored for each committed chunk and a BlockRemoved for each
    cleared one (vLLM's `KVEventBatch` decodes every payload), with consecutive sequence numbers
    while it keeps up; everything the server numbered was published; the replay endpoint gives
    every batch from 0 again, byte for byte, then the end marker."""
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    decoder = msgspec.msgpack.Decoder(type=kv_events.KVEventBatch)
    ev, rp = f"ipc://{workdir}/ev", f"ipc://{workdir}/rp"
    server = serve(*POOL, "--kv-events", ev, "--kv-events-replay", rp, "--kv-events-topic", TOPIC)

    sub = zctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVHWM, 0)  # this subscriber keeps up: nothing is dropped on its side
    sub.connect(ev)
    received: list[list[bytes]] = []
    client = CacheClient(server.address, timeout=T)
    try:
        client.register("layout", 256, CHUNK).result(T)
        # the subscription takes a moment to reach the publisher: commit until one batch arrives
        for i in range(100):
            commit(client, "warm", [hashlib.sha256(f"warm-{i}".encode()).digest()])
            if sub.poll(100):
                break
        else:
            pytest.fail("the subscriber never received a batch")

        stored = keys("t", 200)
        for key in stored:  # 200 small commits: up to 200 batches
            commit(client, "t", [key])
        assert client.clear_all("t") == 200
        assert wait_until(lambda: (extra := server.stats().extra)["kv_events_sent"] == extra["changes_next"] - 1, T), (
            server.stats().extra
        )

        def drained() -> bool:
            while sub.poll(0):
                received.append(sub.recv_multipart())
            return (
                bool(received)
                and int.from_bytes(received[-1][1], "big") + 1 == server.stats().extra["kv_events_batches"]
            )

        assert wait_until(drained, T), (len(received), server.stats().extra)
    finally:
        client.close()

    assert all(len(frames) == 3 and frames[0] == TOPIC.encode() for frames in received)
    seqs = [int.from_bytes(frames[1], "big") for frames in received]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # no gap, no repeat
    extra = server.stats().extra
    assert extra["kv_events_dropped"] == 0
    assert extra["kv_events_batches"] == seqs[-1] + 1

    events = [event for frames in received for event in decoder.decode(frames[2]).events]
    for event in events:
        assert isinstance(event, kv_events.BlockStored | kv_events.BlockRemoved)
        assert (event.medium, event.ownership) == ("CPU", "kvdepot")
        assert [len(h) for h in event.block_hashes] == [32]
    for event in (e for e in events if isinstance(e, kv_events.BlockStored)):
        assert (event.token_ids, event.block_size, event.parent_block_hash) == ([], 0, None)
    wanted = set(stored)
    order = [(type(e).__name__, e.block_hashes[0]) for e in events if e.block_hashes[0] in wanted]
    assert [key for kind, key in order if kind == "BlockStored"] == stored
    assert sorted(key for kind, key in order if kind == "BlockRemoved") == sorted(stored)
    assert order.index(("BlockStored", stored[-1])) < min(
        i for i, (kind, _) in enumerate(order) if kind == "BlockRemoved"
    )  # the clear came after the last commit, and so do its removals

    # replay from 0: every batch (the server keeps far more than these), then the end marker
    batches, end = replay(zctx, rp, 0)
    assert end == [b"", b"", END_SEQ, b""]
    assert [int.from_bytes(f[2], "big") for f in batches] == list(range(seqs[-1] + 1))
    assert all(f[0] == b"" and f[1] == TOPIC.encode() for f in batches)
    by_seq = {int.from_bytes(f[2], "big"): f[3] for f in batches}
    assert all(by_seq[int.from_bytes(f[1], "big")] == f[2] for f in received)  # the same bytes
    for f in batches:
        decoder.decode(f[3])
    # from the middle: only what follows
    middle = seqs[len(seqs) // 2]
    later, _ = replay(zctx, rp, middle)
    assert [int.from_bytes(f[2], "big") for f in later] == list(range(middle, seqs[-1] + 1))


def test_a_server_that_publishes_kv_events_refuses_a_port_it_cannot_bind(serve, workdir):
    """`--kv-events` on an endpoint another socket holds: the server says so and does not start."""
    ctx = zmq.Context()
    holder = ctx.socket(zmq.PUB)
    try:
        port = holder.bind_to_random_port("tcp://127.0.0.1")
        with pytest.raises(RuntimeError, match="cannot publish KV events"):
            serve(*POOL, "--kv-events", f"tcp://127.0.0.1:{port}")
    finally:
        holder.close(0)
        ctx.term()


# -- the publisher's bounds, in process ------------------------------------------------------


def ram_commits(n: int, tag: str = "k") -> list[Committed]:
    return [Committed("s", hashlib.sha256(f"{tag}-{i}".encode()).digest(), 1, "engine") for i in range(n)]


def published_keys(payloads: list[bytes]) -> list[bytes]:
    decoder = msgspec.msgpack.Decoder(type=EventBatch)
    return [event.block_hashes[0] for payload in payloads for event in decoder.decode(payload).events]


def test_with_nobody_reading_a_burst_keeps_at_most_max_pending_and_counts_the_rest(short_tmp, zctx, wait_until):
    """One call with ten times `max_pending` events: the queue holds `max_pending` (the newest),
    the rest are counted as dropped at once, and what is published plus what was dropped is
    every event."""
    publisher = KVEventPublisher(
        f"ipc://{short_tmp}/ev", replay_endpoint=f"ipc://{short_tmp}/rp", topic="t", max_pending=100
    )
    try:
        events = ram_commits(1000)
        publisher.take(events)
        assert len(publisher._pending) <= 100
        assert publisher.dropped == 900
        assert wait_until(lambda: publisher.published_events + publisher.dropped == 1000, T)
        assert publisher.published_events == 100
        assert (
            publisher.figures().items()
            >= {
                "kv_events_batches": publisher.seq,
                "kv_events_sent": 100,
                "kv_events_dropped": 900,
            }.items()
        )
        batches, _ = replay(zctx, publisher.replay_endpoint, 0)
        assert published_keys([f[3] for f in batches]) == [e.key for e in events[900:]]  # the oldest went
        assert int.from_bytes(batches[0][2], "big") == 1  # number 0 was skipped: the dropped events' gap
    finally:
        publisher.close()


def test_with_nobody_reading_many_calls_keep_the_queue_and_the_replay_buffer_bounded(short_tmp, zctx, wait_until):
    """Two thousand calls as fast as the loop could make them, 200 times `max_pending` events in
    all, no subscriber: the queue never holds more than `max_pending`, published plus dropped is
    every event, and replay keeps only the last `replay_batches` batches."""
    publisher = KVEventPublisher(
        f"ipc://{short_tmp}/ev",
        replay_endpoint=f"ipc://{short_tmp}/rp",
        topic="t",
        max_pending=100,
        replay_batches=5,
    )
    try:
        total, most = 0, 0
        for i in range(2000):
            publisher.take(ram_commits(10, tag=f"{i}"))
            total += 10
            most = max(most, len(publisher._pending))
        assert most <= 100
        assert wait_until(lambda: publisher.published_events + publisher.dropped == total, T)
        assert len(publisher._pending) == 0
        assert publisher.published_events >= 100  # the last burst at least
        assert len(publisher._replay_buffer) <= 5
        batches, end = replay(zctx, publisher.replay_endpoint, 0)
        assert end == [b"", b"", END_SEQ, b""]
        numbers = [int.from_bytes(f[2], "big") for f in batches]
        # the last batches kept, in order; drops made the numbers skip (a gap subscribers can see)
        assert 0 < len(numbers) <= 5
        assert numbers == sorted(set(numbers))
        assert numbers[-1] == publisher.seq - 1
        # the newest event of all is in the last batch
        assert published_keys([batches[-1][3]])[-1] == ram_commits(10, tag="1999")[-1].key
    finally:
        publisher.close()


def test_events_of_other_tiers_and_empty_calls_publish_nothing(short_tmp, wait_until):
    publisher = KVEventPublisher(f"ipc://{short_tmp}/ev", topic="t", max_pending=10)
    try:
        publisher.take([])
        publisher.take([Committed("s", b"\1" * 32, 1, "engine", tier="disk"), Cleared("s", b"\2" * 32, 1, tier="disk")])
        time.sleep(0.2)  # give the thread a chance to (wrongly) send something
        assert (publisher.seq, publisher.published_events, publisher.dropped) == (0, 0, 0)
        publisher.take([Cleared("s", b"\2" * 32, 1)])
        assert wait_until(lambda: publisher.seq == 1, T)
        assert publisher.published_events == 1
    finally:
        publisher.close()


def test_a_publisher_on_an_endpoint_in_use_is_an_argument_error(zctx):
    holder = zctx.socket(zmq.PUB)
    holder.setsockopt(zmq.LINGER, 0)
    port = holder.bind_to_random_port("tcp://127.0.0.1")
    with pytest.raises(ServerArgumentError, match="cannot publish KV events"):
        KVEventPublisher(f"tcp://127.0.0.1:{port}", topic="t")
    holder.close(0)


def test_a_second_publisher_does_not_steal_a_live_publishers_ipc_socket(short_tmp):
    """As `kvdepot serve --address ipc://...` refuses a path a live server listens on, a second
    `--kv-events ipc://...` on a live publisher's path should be refused, not take it over."""
    first = KVEventPublisher(f"ipc://{short_tmp}/ev", topic="t")
    try:
        try:
            second = KVEventPublisher(f"ipc://{short_tmp}/ev", topic="t")
        except ServerArgumentError:
            return
        second.close()
        pytest.fail("a second publisher took over a live publisher's ipc socket")
    finally:
        first.close()
