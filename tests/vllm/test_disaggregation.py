"""Prefill on one engine, decode on another, through kvdepot (issue 35), on real vLLM engines.

As vLLM's proxies run it: the prompt goes to the prefill engine (`kv_role: kv_producer`) with
`max_tokens=1`, and the `kv_transfer_params` of that response go with the same prompt to the
decode engine (`kv_role: kv_consumer`). Every decode output is compared with the same prompt run
whole by an engine without kvdepot. Engines run with vLLM's defaults (prefix caching on).
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import kvdepot.server

pytestmark = [pytest.mark.vllm, pytest.mark.engine, pytest.mark.integration]

CHUNK = 256  # tokens per chunk (two CPU blocks of 128)
LENGTHS = (700, 530)  # two full chunks and a tail each


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 2000) for _ in range(length)]


PROMPTS = [prompt(length, seed) for seed, length in enumerate(LENGTHS, start=50)]


class Server(kvdepot.server.ServerProcess):
    def __init__(self, workdir: Path, *args: str) -> None:
        workdir.mkdir(mode=0o700, exist_ok=True)
        super().__init__(
            f"ipc://{workdir}/kvdepot.sock", capacity="512MiB", args=["--no-metrics", *args], log_path=workdir / "log"
        )

    def config(self, role: str, **extra: object) -> dict[str, object]:
        return {
            "kv_connector": "KVDepotConnector",
            "kv_role": role,
            "kv_connector_extra_config": {"kvdepot.address": self.address, **extra},
        }


@pytest.fixture
def server(short_tmp: Path) -> Iterator[Server]:
    with Server(short_tmp / "one") as one:
        yield one


def test_decode_engine_loads_what_the_prefill_engine_stored_and_computes_only_the_tail(
    tiny_llama, vllm_engine, server, tmp_path
):
    """The decode engine's greedy output equals a single engine's; it computes only the prompt's
    last partial chunk; the server moved no chunk between the engines (the decode side stored
    nothing: it read the prefill engine's chunks from the same shared memory). The prefill's
    chunks are pinned (leased to the server itself, for `kvdepot.handoff_pin`) until the decode
    engine has them; the decode engine leaves no lease of its own. Then the server restarts
    before the second prompt's decode and loses its RAM (its kept pool removed): its chunks are
    gone, and the decode engine computes that prompt whole, with the same output."""
    whole = vllm_engine(tiny_llama, PROMPTS).check()
    # The pins outlast the prefill engine's shutdown on a slow machine: the server's most, 60 s
    # (the default 10 s did not, on a loaded CI machine running two engines at once).
    producer = server.config("kv_producer", **{"kvdepot.handoff_pin": 60.0})
    prefill = vllm_engine(tiny_llama, PROMPTS, max_tokens=1, kv_transfer_config=producer).check()
    assert [out[0] for out in whole.outputs] == [out[0] for out in prefill.outputs]
    params = prefill.kv_transfer_params
    assert [p["kvdepot"]["chunks"] for p in params] == [n // CHUNK for n in LENGTHS]
    after_prefill = server.stats()
    assert after_prefill.leases >= len(LENGTHS)  # a pin per store at least: the chunks wait for the decode engine
    assert after_prefill.chunks == sum(n // CHUNK for n in LENGTHS)
    ran: dict[str, object] = {}
    consumer = server.config("kv_consumer", **{"kvdepot.handoff_timeout": 3.0})
    decode = threading.Thread(
        target=lambda: ran.update(decode=vllm_engine(
            tiny_llama, PROMPTS, kv_transfer_config=consumer, kv_transfer_params=params, pause_after={0: "first"}
        ))
    )  # fmt: skip
    decode.start()
    engines = tmp_path / "engines"
    try:
        wait_until(lambda: (engines / "first.paused").exists() or not decode.is_alive(), "the first decode")
        after_decode = server.stats()
        assert after_decode.bytes_stored == after_prefill.bytes_stored  # the decode engine stored nothing
        assert after_decode.chunks == after_prefill.chunks
        assert after_decode.bytes_loaded > 0
        assert after_decode.leases <= after_prefill.leases  # the pins (or fewer, as they end); none of the decode's
        assert after_decode.reservations == 0
        server.kill()
        assert server.remove_kept_pool()  # its RAM lost too (a kept pool would be adopted: test_kept_pool.py)
        server.start()
    finally:
        (engines / "first.go").touch()
        decode.join(600)
    result = ran["decode"].check()  # type: ignore[attr-defined]
    assert result.outputs == whole.outputs
    assert result.num_cached_tokens == [(LENGTHS[0] // CHUNK) * CHUNK, 0]
    assert server.stats().chunks == 0  # the decode engine stored nothing on the new instance either


def test_across_two_servers_sharing_valkey_the_decode_engine_reads_the_handoff_through(
    tiny_llama, vllm_engine, short_tmp, valkey_server
):
    """Prefill on server 1, decode on server 2; they share only a Valkey. The decode engine's
    server reads the chunks through from Valkey (waiting for the write-behind if it has not
    landed yet), with the same output as a single engine."""
    whole = vllm_engine(tiny_llama, PROMPTS).check()
    with (
        Server(short_tmp / "p", "--remote", valkey_server.url) as one,
        Server(short_tmp / "d", "--remote", valkey_server.url) as two,
    ):
        prefill = vllm_engine(tiny_llama, PROMPTS, max_tokens=1, kv_transfer_config=one.config("kv_producer")).check()
        params = prefill.kv_transfer_params
        decode = vllm_engine(
            tiny_llama, PROMPTS, kv_transfer_config=two.config("kv_consumer"), kv_transfer_params=params
        ).check()
        assert decode.outputs == whole.outputs
        assert decode.num_cached_tokens == [(n // CHUNK) * CHUNK for n in LENGTHS]
        assert two.stats().extra["tier_read_hits"] == sum(n // CHUNK for n in LENGTHS)


def wait_until(predicate: Callable[[], object], what: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_the_decode_engine_waits_for_a_prefill_whose_stores_have_not_landed_yet(
    tiny_llama, vllm_engine, server, tmp_path
):
    """The prefill engine has answered, but its stores are held back (a test gate on its copy
    thread), as a slow store would be. The decode engine, started meanwhile, is told "not yet"
    and keeps looking (the server counts its lookups' misses) instead of recomputing; once the
    stores land it loads every chunk, and its output equals a single engine's."""
    whole = vllm_engine(tiny_llama, PROMPTS).check()
    engines = tmp_path / "engines"  # where the vllm_engine fixture runs its engines
    gate = tmp_path / "stores.go"
    ran: dict[str, object] = {}

    def run(name: str, **kwargs: object) -> None:
        ran[name] = vllm_engine(tiny_llama, PROMPTS[:1], **kwargs)

    producer = server.config("kv_producer", **{"kvdepot.test.store_gate": str(gate)})
    prefill = threading.Thread(
        target=run, args=("prefill",), kwargs={"max_tokens": 1, "kv_transfer_config": producer,
                                               "pause_after": {0: "prefilled"}},
    )  # fmt: skip
    prefill.start()
    try:
        paused = engines / "prefilled.paused"
        wait_until(lambda: paused.exists() or not prefill.is_alive(), "the prefill engine's answer")
        assert paused.exists(), ran["prefill"]
        params = json.loads(paused.read_text())
        assert params[0]["kvdepot"]["chunks"] == LENGTHS[0] // CHUNK
        assert server.stats().chunks == 0  # its stores wait at the gate
        misses = server.stats().misses
        consumer = server.config("kv_consumer", **{"kvdepot.handoff_timeout": 300.0})
        decode = threading.Thread(
            target=run, args=("decode",), kwargs={"kv_transfer_config": consumer, "kv_transfer_params": params}
        )
        decode.start()
        # The decode engine looks again and again while the chunks are missing.
        wait_until(lambda: server.stats().misses >= misses + 10 or not decode.is_alive(), "the decode engine's polls")
        assert decode.is_alive()
        gate.touch()
        decode.join(600)
        result = ran["decode"].check()  # type: ignore[attr-defined]
        assert result.outputs == whole.outputs[:1]
        assert result.num_cached_tokens == [(LENGTHS[0] // CHUNK) * CHUNK]
    finally:
        gate.touch()
        (engines / "prefilled.go").touch()
        prefill.join(600)
    ran["prefill"].check()  # type: ignore[attr-defined]


def kill_engines_in(workdir: Path) -> int:
    """SIGKILL every engine the vllm_engine fixture runs in ``workdir`` (each leads a process
    group of its own, with its engine core and workers); how many there were."""
    killed = 0
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"_engine_runner.py") for a in args) and any(str(workdir).encode() in a for a in args):
            os.killpg(int(cmdline.parent.name), signal.SIGKILL)
            killed += 1
    return killed


def test_a_prefill_engine_killed_mid_store_costs_the_decode_a_recompute_and_leaves_nothing_held(
    tiny_llama, vllm_engine, server, tmp_path
):
    """The prefill engine answered, reserved and copied its chunks, and is SIGKILLed before it
    commits them. The decode engine waits for them until its deadline, then computes the whole
    prompt with the same output; the dead engine's reservation is reclaimed by the server."""
    whole = vllm_engine(tiny_llama, PROMPTS).check()
    engines = tmp_path / "engines"
    producer = server.config("kv_producer", **{"kvdepot.test.store_gate": str(tmp_path / "never")})
    prefill = threading.Thread(
        target=vllm_engine, args=(tiny_llama, PROMPTS[:1]),
        kwargs={"max_tokens": 1, "kv_transfer_config": producer, "pause_after": {0: "prefilled"}},
    )  # fmt: skip
    prefill.start()
    try:
        paused = engines / "prefilled.paused"
        wait_until(lambda: paused.exists() or not prefill.is_alive(), "the prefill engine's answer")
        params = json.loads(paused.read_text())
        wait_until(lambda: server.stats().reservations == 1, "the prefill's reservation")
        assert kill_engines_in(engines) == 1
    finally:
        prefill.join(600)
    consumer = server.config("kv_consumer", **{"kvdepot.handoff_timeout": 3.0})
    decode = vllm_engine(tiny_llama, PROMPTS[:1], kv_transfer_config=consumer, kv_transfer_params=params).check()
    assert decode.outputs == whole.outputs[:1]
    assert decode.num_cached_tokens == [0]
    assert decode.log_path is not None
    assert "it computes the rest" in decode.log_path.read_text(errors="replace")
    stats = server.stats()
    assert (stats.chunks, stats.reservations, stats.leases) == (0, 0, 0)
