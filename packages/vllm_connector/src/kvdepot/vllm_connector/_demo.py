"""`kvdepot demo`: the whole system on this machine, in one command.

Builds a small local model, starts a kvdepot server, runs a real vLLM engine on a long
prompt twice in two separate engines (the second loads what the first stored), and shows
time to first token on the miss and on the hit, the hit tokens, the bytes moved, and that
the outputs are identical. Everything it starts, it stops.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, TextIO

from kvdepot.server import ServerProcess, ServerStartError, SimpleCommand, configure_logging, format_size

#: vLLM settings of both engines: fp32 greedy decoding is exact on CPU, and with vLLM's own
#: prefix cache off every reuse comes from kvdepot.
_ENGINE_ARGS: dict[str, Any] = {
    "dtype": "float32",
    "enforce_eager": True,
    "enable_prefix_caching": False,
    "kv_cache_memory_bytes": 512 * 2**20,
    "max_model_len": 8192,
    "disable_log_stats": True,
}
_ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
_STEPS = 5


class _Screen:
    """Progress lines and the summary, for a person watching a terminal."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.started = time.monotonic()

    def step(self, number: int, text: str) -> None:
        self.out.write(f"[{number}/{_STEPS}] {text}\n")
        self.out.flush()

    def note(self, text: str) -> None:
        self.out.write(f"      {text}\n")
        self.out.flush()


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt-tokens", type=int, default=4000, help="length of the long prompt (default 4000)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens to generate (default 16)")
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="where the demo model is built and kept (default ~/.cache/kvdepot/models)",
    )
    parser.add_argument("--keep-logs", action="store_true", help="keep the server and engine logs")


def run(args: argparse.Namespace) -> int:
    from kvdepot.vllm_connector._model import TINY_LLAMA, build_tiny_llama

    configure_logging("auto", "warning", stream="stderr")
    screen = _Screen(sys.stdout)
    work = Path(tempfile.mkdtemp(prefix="kvdepot-demo-"))
    os.chmod(work, 0o700)
    model_dir = args.model_dir or Path.home() / ".cache" / "kvdepot" / "models"
    server: ServerProcess | None = None
    try:
        screen.step(1, f"building the small local model in {model_dir / 'tiny-llama'}")
        model = build_tiny_llama(model_dir / "tiny-llama", **TINY_LLAMA)

        address = f"ipc://{work}/kvdepot.sock"
        screen.step(2, f"starting a kvdepot server at {address}")
        # A pool for this run only: nothing will start a server at this address again.
        server = ServerProcess(
            address, capacity="1GiB", args=("--no-metrics", "--no-keep-pool"), log_path=work / "server.log"
        ).start()

        rng = random.Random(0)
        prompt = [rng.randrange(10, 2000) for _ in range(args.prompt_tokens)]
        config = {
            "kv_connector": "KVDepotConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"kvdepot.address": address},
        }
        screen.step(3, f"engine 1: a {len(prompt)}-token prompt, nothing cached yet (computes and stores)")
        miss = _run_engine(work, "miss", model, prompt, args.max_tokens, config)
        screen.note(f"time to first token {miss['ttft_s'] * 1000:.0f} ms, engine started in {miss['start_s']:.1f} s")
        screen.step(4, "engine 2: a separate engine, the same prompt (loads from kvdepot)")
        hit = _run_engine(work, "hit", model, prompt, args.max_tokens, config)
        screen.note(
            f"time to first token {hit['ttft_s'] * 1000:.0f} ms, {hit['num_cached_tokens']} tokens from the cache"
        )

        screen.step(5, "reading the server's figures and stopping it")
        stats = server.stats()
        server.stop()
        server = None
        same = miss["output"] == hit["output"]
        rows = [
            ("time to first token, miss", f"{miss['ttft_s'] * 1000:.0f} ms"),
            ("time to first token, hit", f"{hit['ttft_s'] * 1000:.0f} ms"),
            ("speed-up", f"{miss['ttft_s'] / max(hit['ttft_s'], 1e-9):.1f}x"),
            ("hit tokens", f"{hit['num_cached_tokens']} of {len(prompt)}"),
            ("bytes stored", format_size(stats.bytes_stored)),
            ("bytes loaded", format_size(stats.bytes_loaded)),
            ("chunks in the server", str(stats.chunks)),
            ("outputs identical", "yes" if same else "NO"),
        ]
        width = max(len(name) for name, _ in rows)
        sys.stdout.write("\nkvdepot demo summary\n" + "-" * (width + 20) + "\n")
        for name, value in rows:
            sys.stdout.write(f"{name.ljust(width)}  {value}\n")
        sys.stdout.write(f"\n(finished in {time.monotonic() - screen.started:.0f} s; nothing left running)\n")
        return 0 if same and hit["num_cached_tokens"] > 0 else 1
    except (_DemoError, ServerStartError) as exc:
        sys.stderr.write(f"kvdepot demo failed: {exc}\n")
        return 1
    finally:
        if server is not None:
            server.stop()
            server.kill()
        if args.keep_logs:
            sys.stdout.write(f"logs kept in {work}\n")
        else:
            shutil.rmtree(work, ignore_errors=True)


class _DemoError(Exception):
    pass


def _run_engine(  # noqa: PLR0917 (one engine run's whole description)
    work: Path, name: str, model: Path, prompt: list[int], max_tokens: int, config: dict[str, Any]
) -> dict[str, Any]:
    spec = work / f"{name}.json"
    result = work / f"{name}.result.json"
    spec.write_text(json.dumps({"model": str(model), "prompt": prompt, "max_tokens": max_tokens, "config": config}))
    log = work / f"{name}.log"
    with log.open("wb") as out:
        code = subprocess.run(
            [sys.executable, "-m", "kvdepot.vllm_connector._demo", str(spec), str(result)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **_ENGINE_ENV},
            check=False,
            timeout=600,
        ).returncode
    if code != 0 or not result.exists():
        raise _DemoError(f"engine {name} failed (exit {code}); its log ends with:\n{log.read_text()[-3000:]}")
    data: dict[str, Any] = json.loads(result.read_text())
    return data


def _engine_main(spec_path: str, result_path: str) -> int:
    """Runs one engine (in its own process) and writes time to first token and the output."""
    from vllm.inputs import TokensPrompt

    from vllm import LLM, SamplingParams

    spec = json.loads(Path(spec_path).read_text())
    started = time.perf_counter()
    llm = LLM(model=spec["model"], kv_transfer_config=spec["config"], **_ENGINE_ARGS)
    start_s = time.perf_counter() - started
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
    added = time.perf_counter()
    engine.add_request("demo", TokensPrompt(prompt_token_ids=spec["prompt"]), params)
    ttft = None
    output: list[int] = []
    cached = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = list(out.outputs[0].token_ids)
            if tokens and ttft is None:
                ttft = time.perf_counter() - added
            output, cached = tokens, out.num_cached_tokens or 0
    Path(result_path).write_text(
        json.dumps({"ttft_s": ttft, "output": output, "num_cached_tokens": cached, "start_s": start_s})
    )
    return 0


command = SimpleCommand(
    name="demo", help="run vLLM twice on a long prompt and show kvdepot's cache hit", configure=configure, run=run
)

if __name__ == "__main__":
    sys.exit(_engine_main(sys.argv[1], sys.argv[2]))
