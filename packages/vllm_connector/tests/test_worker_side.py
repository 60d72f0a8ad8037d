"""The worker half, against a real server process and its shared-memory pool.

A store's slots are asked for when the step starts (`step_started`), its blocks are gathered
by the step's end (`wait_for_save`) and the copy thread commits it. Loads run on the copy thread
on a GPU, while a CPU engine's loads are copied by the engine's thread at the end of its steps;
the step learns of them only through `get_finished` (and the failed blocks of a load in the
same pass).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch

import kvdepot.server
from kvdepot.core import ParallelStrategy
from kvdepot.transport import CacheClient
from kvdepot.vllm_connector._health import ServerHealth
from kvdepot.vllm_connector._meta import KVDepotMetadata, LoadOp, StoreOp
from kvdepot.vllm_connector._worker import WorkerSide
from kvdepot.vllm_connector.testing import standalone_worker

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

BLOCK, CHUNK = 16, 32
KEY = bytes(range(32))


@pytest.fixture
def server(short_tmp: Path) -> Iterator[kvdepot.server.ServerProcess]:
    with kvdepot.server.ServerProcess(f"ipc://{short_tmp}/kvdepot.sock", capacity="16MiB") as proc:
        yield proc


@pytest.fixture
def client(server: kvdepot.server.ServerProcess) -> Iterator[CacheClient]:
    with CacheClient(server.address, timeout=5.0) as c:
        yield c


def make_worker(
    client: CacheClient, kv: torch.Tensor | dict[str, torch.Tensor], *, layout_name: str = "test-layout", **kw: object
) -> WorkerSide:
    """A worker over one layer ``kv``, or over the layers of a dict."""
    return standalone_worker(
        client,
        kv if isinstance(kv, dict) else {"layers.0": kv},
        chunk_size=CHUNK,
        block_size=BLOCK,
        layout_name=layout_name,
        **{"prefault_pool": False, **kw},
    )


def leased_load(client: CacheClient, req_id: str, hit: Any, keys: list[bytes], block_ids: list[int]) -> LoadOp:
    """The load of a lookup's hit into ``block_ids``, as the scheduler side plans it."""
    slots = [slot.offset for slot in hit.slots]
    tokens = len(keys) * CHUNK
    return LoadOp(req_id, client.server_id or "", [slots], [block_ids], 0, tokens, hit.slots[0].length, "", [keys])


def forward_pass(worker: WorkerSide) -> None:
    """The step's forward pass. An engine's takes longer than the round trip that reserves the
    step's slots; here it lasts until the replies landed (at most 10 s), so a store is not skipped
    only because a loaded machine answered after the worker's own short wait (`RESERVE_WAIT_S`)."""
    worker.wait_for_reservations(timeout=10)


def save(worker: WorkerSide, *stores: StoreOp) -> None:
    """One engine step with ``stores``, in vLLM's order: metadata bound, the forward pass, its end."""
    meta = KVDepotMetadata(stores=list(stores))
    worker.step_started(meta)
    worker.start_load_kv(meta)
    forward_pass(worker)
    worker.wait_for_save(meta)
    worker.get_finished(set())


def store(worker: WorkerSide, req_id: str, keys: list[bytes], block_ids: list[int]) -> None:
    """Store ``block_ids`` under ``keys`` in one step, and wait until the copy thread committed it."""
    save(worker, StoreOp(req_id, "", [keys], [block_ids]))
    worker.wait_for_commits()


def finished(worker: WorkerSide, want: str, *, sending: bool, timeout: float = 10.0) -> None:
    """Step (as vLLM does, with empty metadata) until ``want`` is reported finished."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done_sending, done_recving = worker.get_finished(set())
        if want in ((done_sending if sending else done_recving) or set()):
            return
        worker.start_load_kv(KVDepotMetadata())
        time.sleep(0.01)
    raise AssertionError(f"{want} was not reported finished")


def test_store_then_load_round_trip(client: CacheClient) -> None:
    """A store is visible once committed, and no request is ever held for it; a load is reported once copied."""
    kv = torch.randn((8, 2, BLOCK, 64))
    worker = make_worker(client, kv)
    try:
        save(worker, StoreOp("a", "", [[KEY]], [[1, 2]]))
        assert worker.get_finished({"a"}) == (None, None)  # "a" finished: its blocks were never held
        worker.wait_for_commits()
        hit = client.lookup([("", [KEY])]).result(5).results[0]  # visible as soon as reported
        assert hit.num_hits == 1
        load = leased_load(client, "b", hit, [KEY], [5, 6])
        worker.start_load_kv(KVDepotMetadata(loads=[load]))
        finished(worker, "b", sending=False)
        assert worker.take_failed_blocks() == set()
        assert torch.equal(kv[5:7], kv[1:3])
        client.release([hit.lease_id]).result(5)
    finally:
        worker.shutdown()


def test_a_slot_of_another_length_is_a_failed_load(client: CacheClient) -> None:
    """A slot whose length is not this worker's chunk size (another layout's chunk) is never copied."""
    kv = torch.randn((8, 2, BLOCK, 64))
    worker = make_worker(client, kv)
    try:
        before = kv.clone()
        load = LoadOp("b", client.server_id or "", [[0]], [[5, 6]], 0, CHUNK, worker.chunk_bytes // 2)
        worker.start_load_kv(KVDepotMetadata(loads=[load]))
        finished(worker, "b", sending=False)
        assert worker.take_failed_blocks() == {5, 6}
        assert torch.equal(kv, before)
    finally:
        worker.shutdown()


def test_a_failed_load_is_reported_with_its_blocks(client: CacheClient) -> None:
    """A load that fails is reported finished, with its blocks as failed in the same pass."""
    worker = make_worker(client, torch.zeros((8, 2, BLOCK, 64)), fail_loads=True)
    try:
        load = LoadOp("b", client.server_id or "", [[0]], [[5, 6]], 1, CHUNK)
        worker.start_load_kv(KVDepotMetadata(loads=[load]))
        finished(worker, "b", sending=False)
        assert worker.take_failed_blocks() == {6}  # the first block was the engine's own hit
        meta = worker.take_worker_meta()
        assert meta is not None
        assert meta.failed == {"b"}
        stats = worker.take_stats()  # a failure is counted once, on the scheduler side, not per rank
        assert stats is None or stats.data.get("load_failures", 0) == 0
    finally:
        worker.shutdown()


def test_a_store_reads_its_blocks_before_its_step_ends(client: CacheClient) -> None:
    """Once `wait_for_save` returned, vLLM may zero the step's blocks, copy into them or hand them
    to another request (Model Runner V2 does before any connector hook of the next step): the
    store commits the bytes the step computed, however late the copy thread commits it."""
    kv = torch.randn((8, 2, BLOCK, 64))
    computed = kv[1:3].clone()
    worker = make_worker(client, kv)
    gate = threading.Event()
    try:
        worker._copier.submit(gate.wait)  # the copy thread is busy: the commit waits in its queue
        save(worker, StoreOp("a", "", [[KEY]], [[1, 2]]))
        kv[1:3] = 0  # the next step zeroes the blocks (or another request writes them)
        assert client.lookup([("", [KEY])]).result(5).results[0].num_hits == 0  # not committed yet
        gate.set()
        worker.wait_for_commits()
        hit = client.lookup([("", [KEY])]).result(5).results[0]
        assert hit.num_hits == 1
        worker.start_load_kv(KVDepotMetadata(loads=[leased_load(client, "b", hit, [KEY], [5, 6])]))
        finished(worker, "b", sending=False)
        assert torch.equal(kv[5:7], computed)
        client.release([hit.lease_id]).result(5)
    finally:
        gate.set()
        worker.shutdown()


def test_a_stores_slots_are_asked_for_when_its_step_starts(client: CacheClient) -> None:
    """`step_started` (vLLM binds the metadata, before the forward pass) sends the reservation, so its
    reply lands during the forward pass; a step bound again without its end gives the slots back."""
    worker = make_worker(client, torch.randn((8, 2, BLOCK, 64)))
    try:
        meta = KVDepotMetadata(stores=[StoreOp("a", "", [[KEY]], [[1, 2]])])
        worker.step_started(meta)
        deadline = time.monotonic() + 10
        while client.stats().result(5).reservations != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert client.stats().result(5).reservations == 1  # before the step's end
        worker.step_started(KVDepotMetadata())  # not vLLM's order: the first step's slots go back
        deadline = time.monotonic() + 10
        while client.stats().result(5).reservations != 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert client.stats().result(5).reservations == 0
        worker.wait_for_save(KVDepotMetadata())
        worker.wait_for_commits()
        assert client.lookup([("", [KEY])]).result(5).results[0].num_hits == 0
    finally:
        worker.shutdown()


def test_sleep_ends_every_copy_first_and_none_runs_until_wake_up(client: CacheClient) -> None:
    """vLLM's unregister_kv_caches (before sleep releases the KV cache) returns only once the copies in
    flight have ended; until restore_kv_caches nothing is copied (a load fails and is recomputed, a
    store is skipped); after it, copies run again."""
    kv = torch.randn((8, 2, BLOCK, 64))
    worker = make_worker(client, kv)
    gate = threading.Event()
    try:
        worker._copier.submit(gate.wait)  # the copy thread is busy: the commit waits in the queue
        save(worker, StoreOp("a", "", [[KEY]], [[1, 2]]))
        returned = threading.Event()
        sleeper = threading.Thread(target=lambda: (worker.suspend(), returned.set()))
        sleeper.start()
        assert not returned.wait(0.3)
        gate.set()
        assert returned.wait(10)
        hit = client.lookup([("", [KEY])]).result(5).results[0]
        assert hit.num_hits == 1  # the store in flight was committed before sleep went on
        # Asleep: the KV cache may be gone, so nothing touches it.
        kv[5:7] = 0
        worker.start_load_kv(KVDepotMetadata(loads=[leased_load(client, "b", hit, [KEY], [5, 6])]))
        finished(worker, "b", sending=False)
        assert worker.take_failed_blocks() == {5, 6}
        assert not kv[5:7].any()
        other = bytes(range(1, 33))
        save(worker, StoreOp("c", "", [[other]], [[3, 4]]))
        worker.suspend()  # idempotent, and nothing is queued
        assert client.lookup([("", [other])]).result(5).results[0].num_hits == 0
        # Awake again: the same load copies.
        worker.resume()
        worker.start_load_kv(KVDepotMetadata(loads=[leased_load(client, "d", hit, [KEY], [5, 6])]))
        finished(worker, "d", sending=False)
        assert worker.take_failed_blocks() == set()
        assert torch.equal(kv[5:7], kv[1:3])
        client.release([hit.lease_id]).result(5)
    finally:
        gate.set()
        worker.shutdown()


def test_stores_are_skipped_at_once_while_the_server_is_down(client: CacheClient) -> None:
    """After a timeout the worker skips stores without a message until a ping succeeds."""
    worker = make_worker(client, torch.zeros((8, 2, BLOCK, 64)))
    try:
        worker.health.report_timeout()
        worker.health._probe_sent = time.monotonic() + 60  # no probe in this test
        save(worker, StoreOp("a", "", [[KEY]], [[1, 2]]))
        worker.wait_for_commits()
        assert client.lookup([("", [KEY])]).result(5).results[0].num_hits == 0
        stats = worker.take_stats()
        assert stats is not None
        assert stats.data["store_skipped"] == 1
    finally:
        worker.shutdown()


def test_a_slot_reused_between_lookup_and_load_is_a_failed_load(client: CacheClient) -> None:
    """A lease that was given up (late or expired) names a slot now holding another chunk: nothing
    is copied from it, its blocks are reported failed, and the chunk before it is loaded."""
    kv = torch.randn((16, 2, BLOCK, 64))
    other = bytes(range(1, 33))
    worker = make_worker(client, kv)
    try:
        store(worker, "a", [KEY, other], [1, 2, 3, 4])
        hit = client.lookup([("", [KEY, other])]).result(5).results[0]
        assert hit.num_hits == 2
        client.release([hit.lease_id]).result(5)  # as if the lease expired before the load
        slot = hit.slots[1].offset
        client.clear().result(5)  # drops both chunks; the next store takes their slots again
        reused = client.lookup([("", [KEY])]).result(5).results[0]
        assert reused.num_hits == 0
        store(worker, "c", [KEY, bytes(32)], [1, 2, 9, 10])  # another chunk lands in the second slot
        assert client.lookup([("", [bytes(32)])]).result(5).results[0].slots[0].offset == slot
        before = kv.clone()
        worker.start_load_kv(KVDepotMetadata(loads=[leased_load(client, "b", hit, [KEY, other], [5, 6, 7, 8])]))
        finished(worker, "b", sending=False)
        assert worker.take_failed_blocks() == {7, 8}
        assert torch.equal(kv[5:7], kv[1:3])  # the first slot still held its chunk (stored again)
        assert torch.equal(kv[7:9], before[7:9])  # nothing was copied from the reused slot
    finally:
        worker.shutdown()


@pytest.mark.parametrize("engine_thread", [True, False], ids=["engine-thread", "copy-thread"])
def test_a_slot_reused_while_the_copy_reads_it_is_a_failed_load(client: CacheClient, engine_thread: bool) -> None:
    """The header is read again after the copy: a slot the server hands to another store during
    the copy fails the load, though it named the right chunk when the copy began."""
    kv = torch.randn((8, 2, BLOCK, 64))
    worker = make_worker(client, kv, engine_thread_loads=engine_thread)
    try:
        store(worker, "a", [KEY], [1, 2])
        hit = client.lookup([("", [KEY])]).result(5).results[0]
        pool = worker._copier.submit(worker._current_pool).result()
        assert pool is not None
        copiers = pool.engine_copiers if engine_thread else pool.copiers
        scatter = copiers[0].scatter

        def scatter_while_the_slot_is_reused(*args: Any, **kwargs: Any) -> Any:
            copy = scatter(*args, **kwargs)
            client.release([hit.lease_id]).result(5)  # the lease expires mid-copy ...
            client.clear().result(5)
            again = client.reserve("", [bytes(32)], worker.chunk_bytes).result(5)  # ... and the slot is reused
            assert again.slots[0].offset == hit.slots[0].offset
            return copy

        copiers[0].scatter = scatter_while_the_slot_is_reused  # type: ignore[method-assign]
        worker.start_load_kv(KVDepotMetadata(loads=[leased_load(client, "b", hit, [KEY], [5, 6])]))
        finished(worker, "b", sending=False)
        assert worker.take_failed_blocks() == {5, 6}
        meta = worker.take_worker_meta()
        assert meta is not None
        assert meta.failed == {"b"}
    finally:
        worker.shutdown()


def test_every_copy_waits_for_the_engine_work_queued_when_the_step_asked_for_it(
    client: CacheClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store's gather runs on the engine's thread, at the step's end, on the engine's own stream
    (nothing to wait for: on a GPU the copier's side stream follows the compute stream, which then
    waits for the copy). A load on the copy thread, whose current stream is not the engine's, waits
    for an event recorded on the engine's thread when vLLM asked for it (`compute_event`; on a CPU
    None: the step's work is done)."""
    import kvdepot.gpu

    events: list[tuple[str, Any]] = []  # (thread that recorded the event, event)

    def compute_event(device: torch.device) -> Any:
        event = object()
        events.append((threading.current_thread().name, event))
        return event

    assert kvdepot.gpu.compute_event(torch.device("cpu")) is None
    monkeypatch.setattr(kvdepot.gpu, "compute_event", compute_event)
    kv = torch.randn((8, 2, BLOCK, 64))
    worker = make_worker(client, kv, engine_thread_loads=False)
    try:
        pool = worker._copier.submit(worker._current_pool).result()
        assert pool is not None
        waited: list[tuple[str, str, Any]] = []  # (copy, thread, event it waited for)
        for copier in (pool.copiers[0], pool.engine_copiers[0]):
            for name in ("gather", "scatter"):
                real = getattr(copier, name)

                def copy(*args: Any, _name: str = name, _real: Any = real, after: Any = None, **kwargs: Any) -> Any:
                    waited.append((_name, threading.current_thread().name, after))
                    return _real(*args, **kwargs)

                setattr(copier, name, copy)
        store(worker, "a", [KEY], [1, 2])
        hit = client.lookup([("", [KEY])]).result(5).results[0]
        worker.start_load_kv(KVDepotMetadata(loads=[leased_load(client, "b", hit, [KEY], [5, 6])]))
        finished(worker, "b", sending=False)
        assert torch.equal(kv[5:7], kv[1:3])
        engine = threading.current_thread().name
        assert [thread for thread, _ in events] == [engine]
        assert waited[0] == ("gather", engine, None)
        assert waited[1][0] == "scatter"
        assert waited[1][1] != engine
        assert waited[1][2] is events[0][1]
        client.release([hit.lease_id]).result(5)
    finally:
        worker.shutdown()


def hybrid_worker(client: CacheClient, t0: torch.Tensor, t1: torch.Tensor) -> WorkerSide:
    """A worker of a Gemma-2-like model: layers 0 and 2 slide, 1 and 3 attend to everything; as in
    vLLM, one layer of each group shares each tensor (a block belongs to one group at a time)."""
    from kvdepot.vllm_connector._groups import CacheGroup

    groups = (CacheGroup(("l.0", "l.2"), "sliding_window", 64), CacheGroup(("l.1", "l.3"), "full"))
    return make_worker(client, {"l.0": t0, "l.1": t0, "l.2": t1, "l.3": t1}, layout_name="test-hybrid", groups=groups)


def test_a_hybrid_chunk_holds_every_groups_blocks_and_loads_skip_the_null_block(
    client: CacheClient, caplog: pytest.LogCaptureFixture
) -> None:
    """A chunk of a model with two KV-cache groups holds both groups' blocks of every layer; a load
    writes each group's blocks, except vLLM's null block (block 0) outside the window."""
    t0, t1 = torch.randn((8, 2, BLOCK, 64)), torch.randn((8, 2, BLOCK, 64))
    before = (t0.clone(), t1.clone())
    worker = hybrid_worker(client, t0, t1)
    try:
        assert worker.chunk_bytes == 2 * 2 * 2 * t0[0].numel() * 4  # 2 groups x 2 layers x 2 blocks
        assert worker.fingerprint().startswith("sliding_window64x2:")
        save(worker, StoreOp("a", "", [[KEY]], [[1, 2], [3, 4]]))
        worker.wait_for_commits()
        hit = client.lookup([("", [KEY])]).result(5).results[0]
        load = LoadOp("b", client.server_id or "", [[hit.slots[0].offset]], [[0, 5], [6, 7]], 0, CHUNK,
                      hit.slots[0].length, "", [[KEY]])  # fmt: skip
        worker.start_load_kv(KVDepotMetadata(loads=[load]))
        finished(worker, "b", sending=False)
        assert worker.take_failed_requests() == set()
        for tensor, original in zip((t0, t1), before, strict=True):
            assert torch.equal(tensor[5], original[2])  # the window's block
            assert torch.equal(tensor[6:8], original[3:5])  # the full-attention group's blocks
            assert torch.equal(tensor[0], original[0])  # vLLM's null block was not written
        client.release([hit.lease_id]).result(5)

        # A null block after a block to load is no window: the load fails, reported per request.
        bad = LoadOp("c", client.server_id or "", [[hit.slots[0].offset]], [[5, 0], [6, 7]], 0, CHUNK,
                     hit.slots[0].length, "", [[KEY]])  # fmt: skip
        worker.start_load_kv(KVDepotMetadata(loads=[bad]))
        finished(worker, "c", sending=False)
        assert worker.take_failed_requests() == {"c"}
        assert "null block lies after a block to load" in caplog.text
        assert worker.take_failed_blocks() == set()  # block ids are per group: never reported as blocks
    finally:
        worker.shutdown()


def test_a_failed_load_of_a_sliding_window_model_is_reported_per_request(client: CacheClient) -> None:
    """With a window, a load cut back to its first failed block would reach into blocks vLLM dropped:
    the request is reported failed (vLLM recomputes it), never its blocks."""
    from kvdepot.vllm_connector._groups import CacheGroup

    groups = (CacheGroup(("layers.0",), "sliding_window", 64),)
    worker = make_worker(client, torch.zeros((8, 2, BLOCK, 64)), fail_loads=True, groups=groups)
    try:
        load = LoadOp("b", client.server_id or "", [[0]], [[5, 6]], 1, CHUNK)
        worker.start_load_kv(KVDepotMetadata(loads=[load]))
        finished(worker, "b", sending=False)
        assert worker.take_failed_blocks() == set()
        assert worker.take_failed_requests() == {"b"}
    finally:
        worker.shutdown()


@pytest.mark.parametrize("old_pool", ["left behind", "removed"])
def test_a_server_restart_during_registration_never_maps_the_old_pool_under_the_new_id(old_pool, short_tmp):
    """The server restarts right after answering the worker's Register: the reply names the old
    instance's pool, and the client has already greeted the new one. The worker must not map that
    pool under the new instance's id (its stores would go into a file nobody serves, and their
    commits to the new instance would make its never-written slots hits); the registration the
    reconnection brings is the one that counts. The old pool file is either left behind (another
    --pool-dir) or removed by the new instance."""
    base = short_tmp
    dirs = [base / "pool-a", base / ("pool-b" if old_pool == "left behind" else "pool-a")]
    for d in dirs:
        d.mkdir(mode=0o700, exist_ok=True)
    address = f"ipc://{base}/kvdepot.sock"
    old = kvdepot.server.ServerProcess(address, capacity="16MiB", args=["--no-metrics", "--pool-dir", str(dirs[0])])
    new = kvdepot.server.ServerProcess(address, capacity="16MiB", args=["--no-metrics", "--pool-dir", str(dirs[1])])
    old.start()
    reconnected = threading.Event()
    workers: list[WorkerSide] = []

    def on_reconnect(hello: Any, register: Any) -> None:
        workers[0].on_reconnect(hello, register)
        reconnected.set()

    client = CacheClient(address, timeout=5.0, heartbeat_interval=0.1, on_reconnect=on_reconnect)
    register = client.register

    def register_then_restart(*args: Any, **kwargs: Any) -> Any:
        reply = register(*args, **kwargs).result(10)  # the old instance's pool
        old.kill()
        new.start()
        assert reconnected.wait(20)
        done: Future[Any] = Future()
        done.set_result(reply)
        return done

    client.register = register_then_restart  # type: ignore[method-assign]
    kv = torch.randn((8, 2, BLOCK, 64))
    workers.append(
        WorkerSide(
            client=client,
            health=ServerHealth(client),
            strategy=ParallelStrategy.from_config(1, 0, 1, 1, False),
            chunk_size=CHUNK,
            block_size=BLOCK,
            layout_name="test-layout",
            model="m",
            backend_hint=None,
            prefault_pool=False,
        )
    )
    try:
        workers[0].register_kv_caches({"layers.0": kv})
        store(workers[0], "s", [KEY], [1, 2])
        with CacheClient(address, timeout=5.0) as other:
            kv2 = torch.zeros((8, 2, BLOCK, 64))
            reader = make_worker(other, kv2)
            workers.append(reader)
            hit = other.lookup([("", [KEY])]).result(5).results[0]
            assert hit.num_hits == 1  # stored through the new instance's pool
            reader.start_load_kv(KVDepotMetadata(loads=[leased_load(other, "l", hit, [KEY], [5, 6])]))
            finished(reader, "l", sending=False)
            assert not reader.take_failed_blocks()
            assert torch.equal(kv2[5:7], kv[1:3])
    finally:
        for worker in workers:
            worker.shutdown()
        client.close()
        new.stop()
        old.kill()


def test_kernel_blocks_are_merged_into_the_engines_blocks(client):
    """vLLM splits an engine block into kernel blocks where the attention backend needs smaller
    ones, and registers views of those; block ids still count engine blocks. A load of engine
    blocks 1 and 2 into engine blocks 5 and 6 moves exactly those (it moved kernel blocks 5 and
    6, halves of other engine blocks, and stored half a chunk)."""
    kernel = BLOCK // 2
    kv = torch.randn((8 * 2, 2, kernel, 64))  # 8 engine blocks as 16 kernel blocks
    engine = kv.view(8, 2, 2, kernel, 64)
    worker = make_worker(client, kv, num_blocks=8)
    try:
        assert (worker.layout.block_size, worker.layout.num_blocks) == (BLOCK, 8)
        store(worker, "s", [KEY], [1, 2])
        hit = client.lookup([("", [KEY])]).result(5).results[0]
        worker.start_load_kv(KVDepotMetadata(loads=[leased_load(client, "l", hit, [KEY], [5, 6])]))
        finished(worker, "l", sending=False)
        assert not worker.take_failed_blocks()
        assert torch.equal(engine[5:7], engine[1:3])
    finally:
        worker.shutdown()


def test_kv_tensors_with_another_number_of_blocks_than_the_engine_are_refused(client):
    """Blocks that do not tile the engine's (or another count of them) cannot be mapped to the
    engine's block ids: refused at start, never copied wrong."""
    from kvdepot.gpu import UnsupportedLayoutError

    with pytest.raises(UnsupportedLayoutError, match="engine 9 of"):
        make_worker(client, torch.randn((8, 2, BLOCK, 64)), num_blocks=9)


def test_a_store_that_would_copy_past_half_its_reservations_ttl_is_dropped(short_tmp: Path) -> None:
    """A step stalled between its start (the reserve) and its end (the copy), as in a paused process:
    the server's reservation TTL, told at Register, bounds it. No byte lands in the pool, the
    reservation is aborted, and the store counts as late; a store in time goes through."""
    args = ("--no-metrics", "--reservation-ttl", "1")
    with (
        kvdepot.server.ServerProcess(f"ipc://{short_tmp}/kvdepot.sock", capacity="16MiB", args=args) as proc,
        CacheClient(proc.address, timeout=5.0) as client,
    ):
        kv = torch.randn((8, 2, BLOCK, 64))
        worker = make_worker(client, kv)
        try:
            pool = worker._copier.submit(worker._current_pool).result()
            assert pool.reservation_ttl == 1.0
            meta = KVDepotMetadata(stores=[StoreOp("late", "", [[KEY]], [[1, 2]])])
            worker.step_started(meta)
            assert worker._step_stores is not None
            reply = worker._step_stores.pending[0][1].result(5)  # the slots, once reserved
            slots = [(s.offset, bytes(pool.mmap[s.offset : s.offset + s.length])) for s in reply.slots]
            time.sleep(0.7)  # past half the TTL, before the step's end
            worker.wait_for_save(meta)
            worker.wait_for_commits()
            assert slots
            assert all(bytes(pool.mmap[at : at + len(was)]) == was for at, was in slots)  # nothing copied
            assert worker.take_stats().data["store_late"] == 1
            assert client.lookup([("", [KEY])]).result(5).results[0].num_hits == 0
            deadline = time.monotonic() + 10
            while client.stats().result(5).reservations and time.monotonic() < deadline:
                time.sleep(0.01)  # the abort is on its way
            stats = client.stats().result(5)
            assert (stats.reservations, stats.extra["pending_chunks"], stats.extra["quarantined_chunks"]) == (0, 0, 0)

            store(worker, "in-time", [KEY], [1, 2])
            assert client.lookup([("", [KEY])]).result(5).results[0].num_hits == 1
        finally:
            worker.shutdown()


def test_the_pool_prefault_runs_only_between_the_engines_steps(client: CacheClient) -> None:
    """The worker pauses its pool's prefault from a step's start (`step_started`, when vLLM binds
    the step's metadata) to its end (`get_finished`), so the prefault never competes with a
    forward pass for the address space."""
    worker = make_worker(client, torch.zeros((8, 2, BLOCK, 64)), prefault_pool=True)
    try:
        worker.step_started(KVDepotMetadata())
        worker.start_load_kv(KVDepotMetadata())
        assert not worker._between_steps.is_set()
        worker.get_finished(set())
        assert worker._between_steps.is_set()
        pool = worker._copier.submit(worker._current_pool).result()
        assert pool is not None
        assert pool.prefault is not None
        assert [copier.threads for copier in pool.copiers] == [1]  # the copy thread starts no OpenMP team
        pool.prefault.join(30)
        assert not pool.prefault.is_alive()
    finally:
        worker.shutdown()


@pytest.mark.parametrize("idle", [True, False])
def test_a_load_in_a_step_that_computes_nothing_is_reported_from_that_step(client: CacheClient, idle: bool) -> None:
    """A step that computes no tokens waits in `get_finished` for the loads it started, so the
    hit is reported from that step and scheduled in the next; a step that computes (running
    requests decode) never waits: its load, kept in flight here, is reported by a later step."""
    kv = torch.randn((8, 2, BLOCK, 64))
    worker = make_worker(client, kv, load_delay=0.0 if idle else 3.0)
    try:
        store(worker, "a", [KEY], [1, 2])
        hit = client.lookup([("", [KEY])]).result(5).results[0]
        step = KVDepotMetadata(loads=[leased_load(client, "b", hit, [KEY], [5, 6])], idle=idle)
        worker.step_started(step)
        worker.start_load_kv(step)
        _, recving = worker.get_finished(set())
        if idle:
            assert recving == {"b"}
            assert torch.equal(kv[5:7], kv[1:3])
        else:
            assert recving is None
            finished(worker, "b", sending=False)
        client.release([hit.lease_id]).result(5)
    finally:
        worker.shutdown()


def three_chunk_hit(client: CacheClient, worker: WorkerSide) -> tuple[Any, list[bytes]]:
    """Three chunks stored from blocks 1-6, and a lookup's lease on them."""
    keys = [bytes([i]) * 32 for i in (1, 2, 3)]
    store(worker, "a", keys, [1, 2, 3, 4, 5, 6])
    hit = client.lookup([("", keys)]).result(5).results[0]
    assert hit.num_hits == 3
    return hit, keys


def computing_step(worker: WorkerSide, meta: KVDepotMetadata) -> set[str] | None:
    """One engine step that computes tokens, as vLLM calls the worker's hooks; the loads it reports."""
    worker.step_started(meta)
    worker.start_load_kv(meta)
    return worker.get_finished(set())[1]


def test_a_cpu_engines_load_is_copied_by_its_own_thread_a_chunk_per_step_while_steps_compute(
    client: CacheClient,
) -> None:
    """On a CPU the engine's thread copies loads at its steps' ends, with torch's OpenMP team
    (not the copy thread, whose threaded copy would start a second team). A step that computes
    copies whole chunks for at most `load_step_share` of its time, one chunk at least: with a
    vanishing share, one chunk per step, in order, and the load is reported with its last."""
    kv = torch.randn((24, 2, BLOCK, 64))
    worker = make_worker(client, kv, load_step_share=1e-9)
    try:
        hit, keys = three_chunk_hit(client, worker)
        pool = worker._copier.submit(worker._current_pool).result()
        assert pool is not None
        assert [copier.threads for copier in pool.engine_copiers] == [None]  # torch's team, where it can share it
        threads: list[str] = []
        scatter = pool.engine_copiers[0].scatter

        def recorded(*args: Any, **kwargs: Any) -> Any:
            threads.append(threading.current_thread().name)
            return scatter(*args, **kwargs)

        pool.engine_copiers[0].scatter = recorded  # type: ignore[method-assign]
        before = kv.clone()
        reported = [
            computing_step(worker, KVDepotMetadata(loads=[leased_load(client, "b", hit, keys, list(range(11, 17)))]))
        ]
        for copied in (2, 3):
            assert torch.equal(kv[11 : 11 + 2 * (copied - 1)], kv[1 : 1 + 2 * (copied - 1)])
            assert torch.equal(kv[11 + 2 * (copied - 1) : 17], before[11 + 2 * (copied - 1) : 17])
            reported.append(computing_step(worker, KVDepotMetadata()))
        assert reported == [None, None, {"b"}]
        assert torch.equal(kv[11:17], kv[1:7])
        assert threads == [threading.current_thread().name] * 3
        assert worker.take_failed_blocks() == set()
        client.release([hit.lease_id]).result(5)
    finally:
        worker.shutdown()


@pytest.mark.parametrize(("idle", "share"), [(True, 1e-9), (False, 1.0)], ids=["idle-step", "share-1"])
def test_a_cpu_engines_load_is_copied_whole_by_a_step_that_computes_nothing(
    client: CacheClient, idle: bool, share: float
) -> None:
    """A step that computes nothing (every request waits) copies its loads whole, whatever the
    share, and reports them; so does any step with `load_step_share` 1."""
    kv = torch.randn((24, 2, BLOCK, 64))
    worker = make_worker(client, kv, load_step_share=share)
    try:
        hit, keys = three_chunk_hit(client, worker)
        step = KVDepotMetadata(loads=[leased_load(client, "b", hit, keys, list(range(11, 17)))], idle=idle)
        assert computing_step(worker, step) == {"b"}
        assert torch.equal(kv[11:17], kv[1:7])
        client.release([hit.lease_id]).result(5)
    finally:
        worker.shutdown()


def test_a_load_not_yet_copied_when_the_engine_sleeps_is_a_failed_load(client: CacheClient) -> None:
    """vLLM releases the KV cache after `suspend` (sleep mode): a load the engine's thread has not
    finished copying is reported failed (vLLM recomputes it), and nothing more is written."""
    kv = torch.randn((24, 2, BLOCK, 64))
    worker = make_worker(client, kv, load_step_share=1e-9)
    try:
        hit, keys = three_chunk_hit(client, worker)
        assert (
            computing_step(worker, KVDepotMetadata(loads=[leased_load(client, "b", hit, keys, list(range(11, 17)))]))
            is None
        )
        worker.suspend()
        before = kv.clone()
        assert computing_step(worker, KVDepotMetadata()) == {"b"}
        assert worker.take_failed_blocks() == set(range(11, 17))
        assert torch.equal(kv, before)
        client.release([hit.lease_id]).result(5)
    finally:
        worker.shutdown()


def test_a_synchronous_load_is_copied_before_start_load_kv_returns_and_never_reported(client: CacheClient) -> None:
    """A hit that joins its step (`LoadOp.sync`) is in its blocks when `start_load_kv` returns, before the
    step's forward pass; vLLM counts it computed, so `get_finished` never names it."""
    kv = torch.randn((8, 2, BLOCK, 64))
    worker = make_worker(client, kv)
    try:
        store(worker, "a", [KEY], [1, 2])
        hit = client.lookup([("", [KEY])]).result(5).results[0]
        load = leased_load(client, "b", hit, [KEY], [5, 6])
        load.sync = True
        worker.start_load_kv(KVDepotMetadata(loads=[load]))
        assert torch.equal(kv[5:7], kv[1:3])
        assert worker.get_finished(set()) == (None, None)
        assert worker.take_failed_blocks() == set()
        # The copy's bytes and time go to the scheduler side (the rate bounding synchronous loads).
        meta = worker.take_worker_meta()
        assert meta is not None
        assert (meta.failed, meta.copied_bytes) == (set(), worker.chunk_bytes)
        assert meta.copied_s > 0
        assert worker.take_worker_meta() is None  # taken: nothing copied since
        client.release([hit.lease_id]).result(5)
    finally:
        worker.shutdown()


def test_a_synchronous_load_that_fails_reports_its_blocks_from_the_same_step(client: CacheClient) -> None:
    """A synchronous load that fails writes nothing, and its blocks (past the engine's own hit) are
    reported failed from the same step, with the request for the scheduler side's count."""
    kv = torch.zeros((8, 2, BLOCK, 64))
    worker = make_worker(client, kv, fail_loads=True)
    try:
        load = LoadOp("b", client.server_id or "", [[0]], [[5, 6]], 1, CHUNK, sync=True)
        worker.start_load_kv(KVDepotMetadata(loads=[load]))
        assert worker.take_failed_blocks() == {6}
        meta = worker.take_worker_meta()
        assert meta is not None
        assert (meta.failed, meta.copied_bytes) == ({"b"}, 0)  # nothing was copied
        assert worker.get_finished(set()) == (None, None)
    finally:
        worker.shutdown()


def _frozen(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def test_a_store_whose_slots_come_late_is_reported_for_planning_again(
    server: kvdepot.server.ServerProcess, client: CacheClient
) -> None:
    """A server that cannot answer before the step's end (frozen here, busy in real life) costs the
    store, not the step: it is skipped, counted, and named to the scheduler with its first chunk,
    which plans it again; the late reply's slots go back, and the store made again commits."""
    import os
    import signal

    worker = make_worker(client, torch.randn((8, 2, BLOCK, 64)))
    assert server.pid is not None
    try:
        meta = KVDepotMetadata(stores=[StoreOp("a", "", [[KEY]], [[1, 2]], first_chunk=3)])
        os.kill(server.pid, signal.SIGSTOP)
        try:
            while not _frozen(server.pid):
                time.sleep(0.001)
            worker.step_started(meta)  # the reserve waits in the frozen server's socket
            worker.start_load_kv(meta)
            worker.wait_for_save(meta)  # the step's end: no slots, the store is skipped
            worker.get_finished(set())
        finally:
            os.kill(server.pid, signal.SIGCONT)
        report = worker.take_worker_meta()
        assert report is not None
        assert report.skipped == {"a": 3}
        assert worker.take_worker_meta() is None  # reported once
        stats = worker.take_stats()
        assert stats is not None
        assert stats.data["store_skipped"] == 1
        assert client.lookup([("", [KEY])]).result(5).results[0].num_hits == 0
        while client.stats().result(5).reservations:  # the late reply's slots go back as it lands
            time.sleep(0.01)
        save(worker, StoreOp("a", "", [[KEY]], [[1, 2]], first_chunk=3))  # the scheduler's plan, again
        worker.wait_for_commits()
        assert client.lookup([("", [KEY])]).result(5).results[0].num_hits == 1
        assert worker.take_worker_meta() is None
    finally:
        worker.shutdown()
