"""One vLLM engine, kept alive in its own process, that runs prompt batches on command.

Started by benchmarks/vllm_bench.py, one process per engine configuration, so engines never share
vLLM's process-global state, and one engine can serve several measurements (interleaved with
another engine's) without paying its start-up again.

Usage: `python _vllm_bench_worker.py SPEC.json RESULT_FD`. The spec (JSON object) holds `model`,
`engine_kwargs` (for vllm.LLM), `kv_transfer_config` (a dict or null) and `profile` (true: time
every connector method vLLM calls, returned per command as {"methods": {"side.method": [seconds,
calls]}, "lookup_waits": [seconds from the first matched-tokens question to a number, per request]}). Commands arrive on
stdin, one JSON object a line; each answer is one JSON line on the file descriptor RESULT_FD
(vLLM's own logging goes to stdout/stderr, which the parent sends to a log file):

  {"op": "run", "prompts": [[ids...], ...], "max_tokens": N, "sequential": bool, "salt": str | null}
      -> {"ok": true, "outputs", "ttft_s", "num_cached_tokens", "batch_s", "drain_s", "drain_steps",
                  "steps", "idle_steps", "idle_s", "profile"}
      A salt is vLLM's `cache_salt` for every prompt of the command: a fresh one keeps vLLM's own
      prefix cache from serving anything computed before under another salt.
  {"op": "timeline", "adds": [{"at_step": S, "prompts": [[ids...], ...], "max_tokens": N}, ...],
   "reset_prefix_cache": bool}
      Adds each group of prompts just before engine step S (counted from 0 in this command), steps
      until every request finished, and answers {"ok": true, "steps": [[wall_s, scheduled_tokens,
      scheduled_requests, unscheduled, loading], ...] (one per step), "ttft_s", "num_cached_tokens"
      (per prompt, in the order of `adds`), "profile"}. `unscheduled`: requests added but never
      scheduled yet (looking up, loading, or waiting for budget); `loading`: those among them in
      vLLM's WAITING_FOR_REMOTE_KVS state after the step. With `reset_prefix_cache`, vLLM's own
      prefix cache is emptied first (the connector's state is left alone).
  {"op": "quit"}  -> the process exits

The first line on RESULT_FD is {"ok": true, "ready": true, "engine_start_s", "torch_threads"} once the engine
is built (or {"ok": false, "error": ...}). A failed command answers {"ok": false, "error": ...}
and the engine stays up. Greedy sampling with `ignore_eos`: every prompt yields max_tokens tokens.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from typing import Any

# A bound on engine steps per prompt, so a stuck engine ends the command with an error.
MAX_STEPS_PER_PROMPT = 20_000
# After the last output, the engine is stepped while its scheduler still holds finished requests
# (blocks a connector still uses, finished ids not yet sent to the worker), as a serving engine
# would; bounded in steps and seconds.
MAX_DRAIN_STEPS = 2_000
MAX_DRAIN_S = 30.0
DRAIN_IDLE_SLEEP_S = 0.001
# The connector methods vLLM calls (scheduler side and worker side) that `profile` times.
PROFILED_METHODS = (
    "on_new_request",
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",
    "bind_connector_metadata",
    "handle_preemptions",
    "clear_connector_metadata",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_finished",
    "get_transfer_results",
    "get_block_ids_with_load_errors",
    "build_connector_worker_meta",
    "get_kv_connector_stats",
)


class Profile:
    """Seconds and calls per connector method, by wrapping the methods of the live instances."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        # kvdepot's copies run on its copy thread: their timings arrive from there.
        self.lock = threading.Lock()
        # Per request: when the scheduler first asked the connector for matched tokens, and how long
        # until it got a number instead of "ask again" (None): the wait for the lookup reply.
        self.first_asked: dict[str, float] = {}
        self.lookup_waits: list[float] = []

    def wrap(self, instance: Any, side: str) -> None:
        for name in PROFILED_METHODS:
            method = getattr(instance, name, None)
            if callable(method):
                timed = self._timed(f"{side}.{name}", method)
                if side == "scheduler" and name == "get_num_new_matched_tokens":
                    timed = self._lookup_watch(timed)
                setattr(instance, name, timed)
        # kvdepot's copies on their own (CPU copies finish inside the call). They run on the
        # connector's copy thread, off the engine thread, while the engine steps on.
        # A CPU engine's loads run on the engine thread, inside get_finished ("copier.engine").
        pool = getattr(getattr(instance, "_worker", None), "_pool", None)
        for kind, label in (("copiers", "copier"), ("engine_copiers", "copier.engine")):
            for copier in getattr(pool, kind, None) or ():  # one per KV-cache group
                for name in ("gather", "scatter"):
                    setattr(copier, name, self._timed(f"{side}.{label}.{name}", getattr(copier, name)))

    def _lookup_watch(self, method: Any) -> Any:
        def watched(request: Any, *args: Any, **kwargs: Any) -> Any:
            req_id = request.request_id
            if req_id not in self.first_asked:
                self.first_asked[req_id] = time.perf_counter()
            result = method(request, *args, **kwargs)
            if result[0] is not None and self.first_asked.get(req_id) is not None:
                self.lookup_waits.append(time.perf_counter() - self.first_asked[req_id])
                self.first_asked[req_id] = None  # type: ignore[assignment]  # answered; a preemption asks again
            return result

        return watched

    def _timed(self, key: str, method: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - started
                with self.lock:
                    self.seconds[key] = self.seconds.get(key, 0.0) + elapsed
                    self.calls[key] = self.calls.get(key, 0) + 1

        return timed

    def take(self) -> dict[str, Any]:
        with self.lock:
            out: dict[str, Any] = {k: [self.seconds[k], self.calls[k]] for k in self.seconds}
            self.seconds.clear()
            self.calls.clear()
        waits, self.lookup_waits = self.lookup_waits, []
        return {"methods": out, "lookup_waits": waits}


class Engine:
    """A vllm.LLM in this process and the loop that drives it request by request."""

    def __init__(self, spec: dict[str, Any]) -> None:
        from vllm import LLM, SamplingParams

        kwargs = dict(spec.get("engine_kwargs") or {})
        if spec.get("kv_transfer_config") is not None:
            kwargs["kv_transfer_config"] = spec["kv_transfer_config"]
        started = time.perf_counter()
        self.llm = LLM(model=spec["model"], **kwargs)
        self.start_s = time.perf_counter() - started
        self.engine = self.llm.llm_engine
        self.sampling_params = SamplingParams
        # The in-process scheduler (VLLM_ENABLE_V1_MULTIPROCESSING=0), or None.
        core = getattr(getattr(self.engine, "engine_core", None), "engine_core", None)
        self.scheduler = getattr(core, "scheduler", None)
        self.counter = 0
        # Tokens the scheduler put into the last step: a step with none is idle (the engine only
        # waited, e.g. for a lookup answer or a load, or had only finished requests to clean up).
        self.last_scheduled = 0
        self.last_scheduled_ids: dict[str, int] = {}  # tokens per request in the last step
        if self.scheduler is not None:
            schedule = self.scheduler.schedule

            def counted_schedule(*args: Any, **kwargs: Any) -> Any:
                output = schedule(*args, **kwargs)
                self.last_scheduled = int(getattr(output, "total_num_scheduled_tokens", 0) or 0)
                self.last_scheduled_ids = dict(getattr(output, "num_scheduled_tokens", None) or {})
                return output

            self.scheduler.schedule = counted_schedule
        self.profile: Profile | None = None
        if spec.get("profile") and spec.get("kv_transfer_config") is not None:
            from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group, has_kv_transfer_group

            self.profile = Profile()
            if self.scheduler is not None and getattr(self.scheduler, "connector", None) is not None:
                self.profile.wrap(self.scheduler.connector, "scheduler")
            if has_kv_transfer_group():
                self.profile.wrap(get_kv_transfer_group(), "worker")

    def _params(self, max_tokens: int) -> Any:
        return self.sampling_params(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)

    def _add(self, prompt: list[int], params: Any, salt: str | None = None) -> tuple[str, str]:
        """Adds a request: (our id, which outputs carry; vLLM's internal id, which the scheduler uses)."""
        from vllm.inputs import TokensPrompt

        self.counter += 1
        request_id = f"bench-{self.counter}"
        tokens = TokensPrompt(prompt_token_ids=list(prompt))
        if salt:
            tokens["cache_salt"] = salt
        internal_id = self.engine.add_request(request_id, tokens, params)
        return request_id, str(internal_id or request_id)

    def _drain(self) -> tuple[float, int]:
        """Steps the engine while its scheduler still holds finished requests: (seconds, steps)."""
        if self.scheduler is None:
            return 0.0, 0
        started = time.perf_counter()
        deadline = started + MAX_DRAIN_S
        steps = 0
        while self.scheduler.has_requests() and steps < MAX_DRAIN_STEPS and time.perf_counter() < deadline:
            self.engine.step()
            steps += 1
            time.sleep(DRAIN_IDLE_SLEEP_S)
        if self.scheduler.has_requests():
            raise RuntimeError(f"engine still holds finished requests after draining {steps} steps")
        return time.perf_counter() - started, steps

    def run(self, prompts: list[list[int]], max_tokens: int, sequential: bool, salt: str | None) -> dict[str, Any]:
        params = self._params(max_tokens)
        outputs: list[list[int]] = [[] for _ in prompts]
        ttft: list[float | None] = [None for _ in prompts]
        cached: list[int | None] = [None for _ in prompts]
        added_at: dict[str, float] = {}
        index_of: dict[str, int] = {}
        drain_s = 0.0
        drain_steps = 0
        total_steps = 0
        idle_steps = 0
        idle_s = 0.0

        def add(index: int) -> None:
            started = time.perf_counter()
            request_id, _ = self._add(prompts[index], params, salt)
            index_of[request_id] = index
            added_at[request_id] = started

        def drive(limit: int) -> None:
            nonlocal total_steps, idle_steps, idle_s
            steps = 0
            while self.engine.has_unfinished_requests():
                steps += 1
                total_steps += 1
                if steps > limit:
                    raise RuntimeError(f"engine did not finish within {limit} steps")
                self.last_scheduled = -1
                step_started = time.perf_counter()
                step_outputs = self.engine.step()
                now = time.perf_counter()
                if self.last_scheduled == 0:
                    idle_steps += 1
                    idle_s += now - step_started
                for output in step_outputs:
                    index = index_of[output.request_id]
                    tokens = list(output.outputs[0].token_ids) if output.outputs else []
                    if tokens and ttft[index] is None:
                        ttft[index] = now - added_at[output.request_id]
                    outputs[index] = tokens
                    cached[index] = output.num_cached_tokens

        def drain() -> None:
            nonlocal drain_s, drain_steps
            seconds, steps = self._drain()
            drain_s += seconds
            drain_steps += steps

        if self.profile is not None:
            self.profile.take()
        started = time.perf_counter()
        if sequential:
            for index in range(len(prompts)):
                add(index)
                drive(MAX_STEPS_PER_PROMPT)
                drain()
        else:
            for index in range(len(prompts)):
                add(index)
            drive(MAX_STEPS_PER_PROMPT * max(1, len(prompts)))
            drain()
        total_s = time.perf_counter() - started
        return {
            "ok": True,
            "outputs": outputs,
            "ttft_s": ttft,
            "num_cached_tokens": cached,
            "batch_s": total_s - drain_s,
            "drain_s": drain_s,
            "drain_steps": drain_steps,
            "steps": total_steps,
            "idle_steps": idle_steps,
            "idle_s": idle_s,
            "profile": self.profile.take() if self.profile is not None else None,
        }

    def timeline(self, adds: list[dict[str, Any]], reset_prefix_cache: bool) -> dict[str, Any]:
        """Requests added at given steps; every step's wall time and what it scheduled."""
        from vllm.v1.request import RequestStatus

        if self.scheduler is None:
            raise RuntimeError("timeline needs the in-process scheduler (VLLM_ENABLE_V1_MULTIPROCESSING=0)")
        if reset_prefix_cache and not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM did not reset its prefix cache")
        at_step: dict[int, list[tuple[int, list[int], Any]]] = {}
        count = 0
        for add in adds:
            params = self._params(int(add["max_tokens"]))
            for prompt in add["prompts"]:
                at_step.setdefault(int(add["at_step"]), []).append((count, prompt, params))
                count += 1
        ttft: list[float | None] = [None] * count
        cached: list[int | None] = [None] * count
        index_of: dict[str, int] = {}
        added_at: dict[str, float] = {}
        unscheduled: set[str] = set()
        steps: list[list[float]] = []
        if self.profile is not None:
            self.profile.take()
        limit = MAX_STEPS_PER_PROMPT * max(1, count)
        while at_step or self.engine.has_unfinished_requests():
            if len(steps) > limit:
                raise RuntimeError(f"timeline did not finish within {limit} steps")
            for index, prompt, params in at_step.pop(len(steps), ()):
                started = time.perf_counter()
                request_id, internal_id = self._add(prompt, params)
                index_of[request_id], added_at[request_id] = index, started
                unscheduled.add(internal_id)
            self.last_scheduled, self.last_scheduled_ids = -1, {}
            step_started = time.perf_counter()
            step_outputs = self.engine.step()
            now = time.perf_counter()
            unscheduled -= self.last_scheduled_ids.keys()
            loading = sum(
                1
                for r in unscheduled
                if getattr(self.scheduler.requests.get(r), "status", None) == RequestStatus.WAITING_FOR_REMOTE_KVS
            )
            steps.append(
                [now - step_started, self.last_scheduled, len(self.last_scheduled_ids), len(unscheduled), loading]
            )
            for output in step_outputs:
                index = index_of[output.request_id]
                if output.outputs and output.outputs[0].token_ids and ttft[index] is None:
                    ttft[index] = now - added_at[output.request_id]
                cached[index] = output.num_cached_tokens
        self._drain()
        return {
            "ok": True,
            "steps": steps,
            "ttft_s": ttft,
            "num_cached_tokens": cached,
            "profile": self.profile.take() if self.profile is not None else None,
        }


def main(argv: list[str]) -> int:
    with open(argv[1]) as spec_file:
        spec = json.load(spec_file)
    out = os.fdopen(int(argv[2]), "w", buffering=1)

    def answer(obj: dict[str, Any]) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    try:
        engine = Engine(spec)
    except BaseException:
        answer({"ok": False, "error": traceback.format_exc()})
        return 1
    import torch

    answer({"ok": True, "ready": True, "engine_start_s": engine.start_s, "torch_threads": torch.get_num_threads()})
    for line in sys.stdin:
        if not line.strip():
            continue
        command = json.loads(line)
        if command.get("op") == "quit":
            break
        try:
            if command.get("op") == "timeline":
                answer(engine.timeline(command["adds"], bool(command.get("reset_prefix_cache"))))
            else:
                answer(
                    engine.run(
                        command["prompts"], int(command["max_tokens"]), bool(command["sequential"]), command.get("salt")
                    )
                )
        except Exception:
            answer({"ok": False, "error": traceback.format_exc()})
    answer({"ok": True, "bye": True})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
