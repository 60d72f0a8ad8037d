"""Run one real vLLM engine in this process and write what it did as JSON.

Started as a subprocess by the `vllm_engine` fixture (tests/vllm/conftest.py), so engines never
share vLLM's process-global state (plugins, connector registry, distributed groups, the KV
transfer agent). Usage: `python _engine_runner.py SPEC.json RESULT.json`.

The spec (JSON object):
  model               path of a local model directory (required)
  prompts             list of prompts, each a list of token ids (required)
  max_tokens          tokens to generate per prompt (default 8)
  kv_transfer_config  dict for vLLM's KVTransferConfig, or null
  engine_kwargs       extra keyword arguments for vllm.LLM (e.g. enable_prefix_caching)
  sequential          true: each prompt runs to completion before the next is added (default);
                      false: all prompts are added at once and run as one batch
  abort_after_steps   {prompt index (as a string): engine steps after adding it}; 0 aborts it
                      before the engine ever schedules it
  cache_salts         optional list (one per prompt) of cache_salt strings or null
  collect_metrics     true: also return vLLM's metrics snapshot (counters and gauges)
  reset_after         {prompt index (as a string): perturb}: after that prompt (sequential runs), scale
                      every weight by `PERTURB_SCALE` if perturb is true (new weights, as an RL weight
                      sync loads), then call reset_prefix_cache(reset_connector=True)
  drain               true (default): after each sequential prompt and at the end, keep stepping an
                      in-process engine while its scheduler still holds finished requests (delayed
                      block frees, finished ids not yet sent to the worker)
  use_generate        true: each sequential prompt runs through `LLM.generate`, as RL frameworks call
                      it (no step after its output: no drain), instead of the engine's step loop
  sleep_after         {prompt index (as a string): level}: after that prompt (sequential runs), call
                      `LLM.sleep(level)`, then `wake_up()`, then scale every weight as `reset_after`
                      does (the weights an RL trainer syncs while the engine sleeps)
  pause_after         {prompt index (as a string): name}: after that prompt (sequential runs), write
                      NAME.paused in the working directory and wait (at most `MAX_PAUSE_S`) until the
                      test creates NAME.go: the test acts on the server between two prompts (the
                      file holds the prompts' kv_transfer_params so far, as JSON)
  busy_prompt         optional prompt (a list of token ids): while paused, the engine runs it again
                      and again (outputs not recorded) instead of standing idle, so that it keeps
                      stepping (a connector reads the server's changes at engine steps, stores
                      and looks up) until the test lets it go on; each run's first token differs
                      (10 + the run's number, modulo 1000), so no run is a prefix hit of another
  engine_kwargs.kv_events_config  a dict for vLLM's KVEventsConfig
  kv_transfer_params  optional list (one per prompt) of dicts or null: each prompt's
                      `kv_transfer_params` (as a proxy passes a prefill's into the decode request)

The result (JSON object): outputs (generated token ids per prompt), num_cached_tokens (per
prompt), finish_reasons, ttft_s (seconds from adding a prompt to its first token, null when none
came), engine_start_s, run_s, drain_steps, metrics, resets (what each reset returned),
kv_transfer_params (per prompt, what its finished output carried), error (a traceback string, or
null). Greedy sampling, with `ignore_eos`, so every finished prompt yields
exactly max_tokens tokens.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

# Engine defaults for tests: fp32 (greedy output matches the reference), no CUDA graphs or
# compilation, a modest context. Prefix caching stays at vLLM's default (on), as users run it;
# a test that needs every reuse to come from the connector turns it off itself.
# An explicit KV-cache size skips the CPU worker's check that `gpu_memory_utilization` (92% of the
# memory node by default) is free at start, which fails on a shared machine.
DEFAULT_ENGINE_KWARGS: dict[str, Any] = {
    "kv_cache_memory_bytes": 256 << 20,
    "dtype": "float32",
    "enforce_eager": True,
    "max_model_len": 4096,
    "seed": 0,
}
# A bound on engine steps per prompt, so a stuck engine (e.g. a lookup never answered) ends the
# run with an error instead of hanging until the harness kills it. Steps that produce nothing
# (every request waits for a load) are bounded in time instead: they take microseconds, and a
# load on a busy machine may take seconds.
MAX_STEPS_PER_PROMPT = 10_000
MAX_IDLE_S = 120.0
IDLE_STEP_SLEEP_S = 0.0005
# After the last output, an in-process engine is stepped until its scheduler holds nothing more
# (requests whose blocks a connector still holds, finished ids not yet sent to the worker), so
# that `get_finished` and `update_connector_output` run as they would in a serving engine.
# Bounded, with a short sleep between idle steps so an asynchronous store can complete.
MAX_DRAIN_STEPS = 2_000
MAX_DRAIN_S = 30.0
DRAIN_IDLE_SLEEP_S = 0.005
# How long `pause_after` waits for the test at most.
MAX_PAUSE_S = 300.0
# New weights for `reset_after`: every parameter scaled by this, enough to change greedy output.
PERTURB_SCALE = 1.05


def _perturb(model: Any) -> None:
    import torch

    with torch.no_grad():
        for param in model.parameters():
            param.mul_(PERTURB_SCALE)


def _metrics_snapshot(llm: Any) -> dict[str, float]:
    snapshot: dict[str, float] = {}
    for metric in llm.get_metrics():
        value = getattr(metric, "value", None)
        if isinstance(value, (int, float)):
            labels = getattr(metric, "labels", None) or {}
            suffix = ",".join(f"{k}={v}" for k, v in sorted(labels.items()) if k not in ("engine", "model_name"))
            snapshot[metric.name + (f"{{{suffix}}}" if suffix else "")] = float(value)
    return snapshot


def _pause(name: str, result: dict[str, Any], busy: Any = None) -> None:
    """Write NAME.paused (holding the prompts' `kv_transfer_params` so far, as JSON) and wait for
    NAME.go, calling `busy()` (one run of the busy prompt) meanwhile if given."""
    # Written whole, then renamed into place: a test that sees the file reads all of it.
    Path(f"{name}.paused.tmp").write_text(json.dumps(result["kv_transfer_params"]))
    os.replace(f"{name}.paused.tmp", f"{name}.paused")
    go, deadline = Path(f"{name}.go"), time.monotonic() + MAX_PAUSE_S
    while not go.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"the test never let the engine go on after pause {name!r}")
        if busy is not None:
            busy()
        else:
            time.sleep(0.05)


def run(spec: dict[str, Any], result: dict[str, Any]) -> None:
    """Run the spec, filling `result` as it goes (so a failure still returns what happened)."""
    from vllm.inputs import TokensPrompt

    from vllm import LLM, SamplingParams

    prompts: list[list[int]] = spec["prompts"]
    max_tokens = int(spec.get("max_tokens", 8))
    sequential = bool(spec.get("sequential", True))
    aborts = {int(k): int(v) for k, v in (spec.get("abort_after_steps") or {}).items()}
    salts: list[str | None] = spec.get("cache_salts") or [None] * len(prompts)
    collect_metrics = bool(spec.get("collect_metrics", False))
    drain_enabled = bool(spec.get("drain", True))
    resets = {int(k): bool(v) for k, v in (spec.get("reset_after") or {}).items()}
    sleeps = {int(k): int(v) for k, v in (spec.get("sleep_after") or {}).items()}
    pauses = {int(k): str(v) for k, v in (spec.get("pause_after") or {}).items()}
    use_generate = bool(spec.get("use_generate", False))
    transfer: list[dict[str, Any] | None] = spec.get("kv_transfer_params") or [None] * len(prompts)
    busy_prompt: list[int] | None = spec.get("busy_prompt")

    kwargs = dict(DEFAULT_ENGINE_KWARGS)
    kwargs.update(spec.get("engine_kwargs") or {})
    if isinstance(kwargs.get("kv_events_config"), dict):
        from vllm.config import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(**kwargs["kv_events_config"])
    if spec.get("kv_transfer_config") is not None:
        kwargs["kv_transfer_config"] = spec["kv_transfer_config"]
    if collect_metrics:
        kwargs["disable_log_stats"] = False

    result.update(
        {
            "outputs": [[] for _ in prompts],
            "num_cached_tokens": [None for _ in prompts],
            "finish_reasons": [None for _ in prompts],
            "ttft_s": [None for _ in prompts],
            "engine_start_s": None,
            "run_s": None,
            "drain_steps": 0,
            "metrics": None,
            "resets": [],
            "kv_transfer_params": [None for _ in prompts],
            "error": None,
        }
    )

    started = time.perf_counter()
    llm = LLM(model=spec["model"], **kwargs)
    result["engine_start_s"] = time.perf_counter() - started
    engine = llm.llm_engine

    def params_for(index: int) -> Any:
        extra = {"kv_transfer_params": transfer[index]} if transfer[index] is not None else None
        return SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False, extra_args=extra
        )

    def make_prompt(index: int) -> Any:
        prompt = TokensPrompt(prompt_token_ids=list(prompts[index]))
        if salts[index] is not None:
            prompt["cache_salt"] = salts[index]
        return prompt

    added_at: dict[str, float] = {}
    steps_since_added: dict[str, int] = {}
    index_of: dict[str, int] = {}

    def add(index: int) -> None:
        request_id = f"req-{index}"
        index_of[request_id] = index
        added_at[request_id] = time.perf_counter()
        steps_since_added[request_id] = 0
        engine.add_request(request_id, make_prompt(index), params_for(index))
        if aborts.get(index) == 0:
            engine.abort_request([request_id])

    busy_runs = iter(range(1 << 62))

    def busy() -> None:
        """One run of the busy prompt to its end, its outputs dropped."""
        assert busy_prompt is not None
        request_id = f"busy-{next(busy_runs)}"
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        tokens = [10 + int(request_id[5:]) % 1000, *busy_prompt[1:]]
        engine.add_request(request_id, TokensPrompt(prompt_token_ids=tokens), params)
        for _ in range(MAX_STEPS_PER_PROMPT):
            if not engine.has_unfinished_requests():
                return
            if not engine.step():
                time.sleep(IDLE_STEP_SLEEP_S)
        raise RuntimeError("the busy prompt did not finish")

    def drive(limit: int) -> None:
        steps, idle_s = 0, 0.0
        while engine.has_unfinished_requests():
            started = time.perf_counter()
            outputs = engine.step()
            if outputs:
                steps += 1
            else:  # every request waits (a load): count time, not steps
                time.sleep(IDLE_STEP_SLEEP_S)
                idle_s += time.perf_counter() - started
            if steps > limit or idle_s > MAX_IDLE_S:
                raise RuntimeError(f"engine did not finish within {limit} steps and {MAX_IDLE_S:.0f} s idle")
            now = time.perf_counter()
            for output in outputs:
                index = index_of[output.request_id]
                tokens = list(output.outputs[0].token_ids) if output.outputs else []
                if tokens and result["ttft_s"][index] is None:
                    result["ttft_s"][index] = now - added_at[output.request_id]
                result["outputs"][index] = tokens
                result["num_cached_tokens"][index] = output.num_cached_tokens
                if output.finished and output.outputs:
                    result["finish_reasons"][index] = output.outputs[0].finish_reason
                if output.finished:
                    result["kv_transfer_params"][index] = getattr(output, "kv_transfer_params", None)
            for request_id in list(steps_since_added):
                steps_since_added[request_id] += 1
                index = index_of[request_id]
                if aborts.get(index) == steps_since_added[request_id]:
                    engine.abort_request([request_id])
                    del steps_since_added[request_id]

    # The in-process scheduler, when the engine core runs in this process (else None: a separate
    # engine-core process keeps stepping on its own while its scheduler has requests).
    scheduler = getattr(getattr(getattr(engine, "engine_core", None), "engine_core", None), "scheduler", None)

    def drain() -> None:
        if not drain_enabled or scheduler is None:
            return
        deadline = time.perf_counter() + MAX_DRAIN_S
        steps = 0
        while scheduler.has_requests() and steps < MAX_DRAIN_STEPS and time.perf_counter() < deadline:
            engine.step()
            steps += 1
            time.sleep(DRAIN_IDLE_SLEEP_S)
        result["drain_steps"] += steps
        if scheduler.has_requests():
            raise RuntimeError(f"engine still holds finished requests after draining {steps} steps")

    run_started = time.perf_counter()

    def generate(index: int) -> None:
        added_at = time.perf_counter()
        (output,) = llm.generate([make_prompt(index)], params_for(index), use_tqdm=False)
        result["ttft_s"][index] = time.perf_counter() - added_at  # the whole request: max_tokens=1 runs only
        result["outputs"][index] = list(output.outputs[0].token_ids)
        result["num_cached_tokens"][index] = output.num_cached_tokens
        result["finish_reasons"][index] = output.outputs[0].finish_reason

    if sequential:
        for index in range(len(prompts)):
            if use_generate:
                generate(index)
            else:
                add(index)
                drive(MAX_STEPS_PER_PROMPT)
                drain()
            if index in sleeps:
                llm.sleep(level=sleeps[index])
                llm.wake_up()
                llm.apply_model(_perturb)
            if index in resets:
                if resets[index]:
                    llm.apply_model(_perturb)
                result["resets"].append(llm.reset_prefix_cache(reset_connector=True))
            if index in pauses:
                _pause(pauses[index], result, busy if busy_prompt is not None else None)
    else:
        for index in range(len(prompts)):
            add(index)
        drive(MAX_STEPS_PER_PROMPT * max(1, len(prompts)))
        drain()
    result["run_s"] = time.perf_counter() - run_started
    if collect_metrics:
        result["metrics"] = _metrics_snapshot(llm)


def main(argv: list[str]) -> int:
    spec_path, result_path = Path(argv[1]), Path(argv[2])
    spec = json.loads(spec_path.read_text())
    result: dict[str, Any] = {}
    try:
        run(spec, result)
    except BaseException:
        result["error"] = traceback.format_exc()
    result_path.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
