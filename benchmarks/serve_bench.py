"""kvdepot under a real client: vLLM's own `bench serve` against vLLM's OpenAI server.

The workload is `bench serve`'s ``prefix_repetition`` dataset: `--prefixes` shared prefixes of
`--prefix-len` tokens (default 8 of 1,536), each prompt one of them plus its own `--suffix-len`
tokens (256), `--output-len` tokens generated (vLLM's default, 128). The server runs the tests'
tiny Llama with vLLM's default CPU settings, eager mode and prefix caching on (vLLM's default),
in four configurations:

- ``none``: no connector, a KV cache of `--kv-cache` (16 MiB: too small to keep the prefixes,
  so what vLLM's own prefix cache serves is what stays resident between requests);
- ``kvdepot``: the same, with kvdepot (a fresh `kvdepot serve` per round);
- ``floor``: no connector, a KV cache of `--floor-kv-cache` (256 MiB) that keeps every prefix:
  reuse as good as it gets, the target;
- ``lmcache``: LMCache's multi-process mode (its `lmcache server`, a fresh one per round, and
  vLLM's ``LMCacheMPConnector``), where `--lmcache-python` imports lmcache and vllm (LMCache's
  in-process connector has no CPU path: it starts, and serves no hit);
- `--variant NAME:KEY=VALUE,...`: kvdepot again with these connector settings (measured beside
  the default, never instead).

At each concurrency (`--concurrency`, default 2 and 8; `--prompts` per level, default 64 and
128) the configurations run in alternating order over `--rounds` rounds (default 3), each run on
a freshly started vLLM server. For each run: median and p90 TTFT, median TPOT and requests/s from
`bench serve`'s result file, and the prompt tokens served from a cache, read from the server's
/metrics before and after (``vllm:prefix_cache_hits`` plus ``vllm:external_prefix_cache_hits``),
and where a request's time to its first token went, from the same /metrics: its mean time queued
(from arrival to first scheduled, a load's wait included) and in prefill (from then to its first
token).
The report gives each configuration's medians over rounds, its ratios to the floor, and the
share of the tokens that repeat an earlier prefix ((prompts - prefixes) x prefix length) that a
cache served.

vLLM's CPU worker reserves one core per rank for its scheduler, and one more when a connector
is configured (for NIXL); on a machine with too few cores the reservation is dropped, and the
engine with a connector computes on more OpenMP cores than the one without (docs/vllm.md,
"CPU engines: cores and threads"). `--env VLLM_CPU_NUM_OF_RESERVED_CPU=1` gives every configuration the same cores:
run it beside the defaults.

Run it in the test environment (it has vllm-cpu): ``.nox/tests-vllm-0-32-cpu/bin/python
benchmarks/serve_bench.py``; ``--quick`` runs one round of 32 prompts per level. Nothing is
left running, also on Ctrl-C or an error.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import structlog

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import progress, start_server, table
from kvdepot.server import parse_size

MODELS_DIR = Path.home() / ".cache" / "kvdepot" / "models"
CONFIGS = ("none", "kvdepot", "floor", "lmcache")
CACHE_METRICS = ("vllm:prefix_cache_hits_total", "vllm:external_prefix_cache_hits_total")
PHASE_METRICS = tuple(
    f"vllm:request_{phase}_time_seconds_{part}" for phase in ("queue", "prefill") for part in ("sum", "count")
)
SERVER_START_S = 600.0
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
# LMCache's processes: no usage reports (LMCache sends them by default), no banner.
LMCACHE_ENV = {**ENV, "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1", "LMCACHE_DISABLE_BANNER": "1"}
# `lmcache server`, run by the Python that has lmcache.
LMCACHE_CLI = "import sys; from lmcache.cli.main import main; sys.argv[0] = 'lmcache'; sys.exit(main())"
# `vllm bench serve` itself (vllm-cpu's `vllm` command cannot find the package named "vllm").
BENCH_SERVE = """
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


def log_tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_figures(port: int) -> dict[str, float]:
    """The server's figures so far: prompt tokens served from a cache (vLLM's own prefix cache plus
    the connector's, ``cached``), and the sums and counts of its requests' time queued (until
    first scheduled, a load's wait included) and in prefill (from then to the first token)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    figures = dict.fromkeys(("cached", *PHASE_METRICS), 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in CACHE_METRICS:
            figures["cached"] += float(line.rsplit(" ", 1)[1])
        elif name in PHASE_METRICS:
            figures[name] += float(line.rsplit(" ", 1)[1])
    return figures


def phase_ms(before: dict[str, float], after: dict[str, float], phase: str) -> float:
    """Mean milliseconds per request of ``phase`` (``queue`` or ``prefill``) between two snapshots."""
    name = f"vllm:request_{phase}_time_seconds"
    count = after[f"{name}_count"] - before[f"{name}_count"]
    return 1000 * (after[f"{name}_sum"] - before[f"{name}_sum"]) / count if count else float("nan")


def lmcache_installed(python: str) -> bool:
    """Whether ``python`` imports lmcache (and vllm)."""
    done = subprocess.run([python, "-c", "import lmcache, vllm"], capture_output=True, check=False, env=LMCACHE_ENV)
    return done.returncode == 0


def stop_group(proc: subprocess.Popen[bytes]) -> None:
    """Stop ``proc``'s process group: SIGINT, then SIGKILL if it has not ended within 30 s."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def wait_for_port(port: int, proc: subprocess.Popen[bytes], what: str, log_path: Path) -> None:
    """Return once something listens on 127.0.0.1:``port``; raise if ``proc`` exits first."""
    deadline = time.monotonic() + SERVER_START_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited:\n{log_tail(log_path)}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start:\n{log_tail(log_path)}")
        time.sleep(0.5)


@contextlib.contextmanager
def lmcache_server(args: argparse.Namespace, workdir: Path) -> Iterator[int]:
    """LMCache's multi-process server (`lmcache server`), its L1 in shared memory of ``--capacity``'s
    size, once it listens; its port. It copies through shared memory (``--supported-transfer-mode
    auto``: on a CPU engine LMCache's connector picks its engine-driven mode). Stopped afterwards."""
    port, http_port = free_port(), free_port()
    shm_name = f"kvd-bench-lmcache-{port}"
    cmd = [args.lmcache_python, "-c", LMCACHE_CLI, "server", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--http-port", str(http_port), "--l1-size-gb", f"{args.capacity_bytes / 2**30:g}"]
    cmd += ["--eviction-policy", "LRU", "--disable-metrics", "--supported-transfer-mode", "auto"]
    cmd += ["--shm-name", shm_name]
    log_path = workdir / f"lmcache-{port}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=LMCACHE_ENV)
        try:
            wait_for_port(port, proc, "lmcache server", log_path)
            yield port
        finally:
            stop_group(proc)
            for leftover in Path("/dev/shm").glob(f"*{shm_name}*"):
                leftover.unlink(missing_ok=True)


@contextlib.contextmanager
def transfer_config(args: argparse.Namespace, config: str, workdir: Path) -> Iterator[dict[str, Any] | None]:
    """The `--kv-transfer-config` of ``config`` (None: no connector), with its cache server
    started for this run (a fresh `kvdepot serve`, or LMCache's server), stopped afterwards."""
    if config == "kvdepot" or config in args.variants:
        proc, address = start_server(workdir, "--capacity", args.capacity)
        try:
            yield {
                "kv_connector": "KVDepotConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"kvdepot.address": address, **args.variants.get(config, {})},
            }
        finally:
            proc.terminate()
            proc.wait(30)
    elif config == "lmcache":
        with lmcache_server(args, workdir) as port:
            yield {
                "kv_connector": "LMCacheMPConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": port},
            }
    else:
        yield None


@contextlib.contextmanager
def vllm_server(args: argparse.Namespace, config: str, workdir: Path) -> Iterator[int]:
    """A `vllm serve` of the model in ``config``, once healthy; its port. Stopped afterwards."""
    port = free_port()
    python = args.lmcache_python if config == "lmcache" else sys.executable
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(args.model_dir)]
    cmd += ["--port", str(port)]
    cmd += ["--host", "127.0.0.1", "--enforce-eager", "--max-model-len", "4096", "--seed", "0"]
    kv_cache = args.floor_kv_cache if config == "floor" else args.kv_cache
    cmd += ["--kv-cache-memory-bytes", str(kv_cache)]
    log_path = workdir / f"vllm-{config}-{port}.log"
    env = {**(LMCACHE_ENV if config == "lmcache" else ENV), **args.env}
    with transfer_config(args, config, workdir) as transfer, log_path.open("wb") as log:
        if transfer is not None:
            cmd += ["--kv-transfer-config", json.dumps(transfer)]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        try:
            deadline = time.monotonic() + SERVER_START_S
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"vllm serve ({config}) exited:\n{log_tail(log_path)}")
                with contextlib.suppress(OSError), urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"vllm serve ({config}) did not become healthy:\n{log_tail(log_path)}")
                time.sleep(0.5)
            try:
                yield port
            except Exception:
                progress(f"vllm serve ({config}) failed; the end of its log:\n{log_tail(log_path)}")
                raise
        finally:
            stop_group(proc)


def bench_serve(args: argparse.Namespace, port: int, concurrency: int, prompts: int, out: Path) -> dict[str, Any]:
    """One `vllm bench serve` run; its result JSON."""
    cmd = [sys.executable, "-c", BENCH_SERVE, "--backend", "vllm"]
    cmd += ["--base-url", f"http://127.0.0.1:{port}", "--model", str(args.model_dir)]
    cmd += ["--dataset-name", "prefix_repetition", "--num-prompts", str(prompts)]
    cmd += ["--prefix-repetition-prefix-len", str(args.prefix_len)]
    cmd += ["--prefix-repetition-suffix-len", str(args.suffix_len)]
    cmd += ["--prefix-repetition-num-prefixes", str(args.prefixes)]
    cmd += ["--prefix-repetition-output-len", str(args.output_len)]
    cmd += ["--max-concurrency", str(concurrency), "--seed", "0", "--disable-tqdm"]
    cmd += ["--percentile-metrics", "ttft,tpot", "--metric-percentiles", "50,90"]
    cmd += ["--save-result", "--result-dir", str(out.parent), "--result-filename", out.name]
    log_path = out.parent / f"{out.stem}.log"
    with log_path.open("wb") as log:
        done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=False, env=ENV)
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed ({done.returncode}):\n{log_tail(log_path)}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


Runs = dict[str, list[dict[str, float]]]


def run_level(args: argparse.Namespace, concurrency: int, prompts: int, workdir: Path) -> Runs:
    configs = list(args.configs)
    runs: Runs = {c: [] for c in configs}
    for round_ in range(args.rounds):
        order = configs if round_ % 2 == 0 else configs[::-1]
        for config in order:
            progress(f"concurrency {concurrency}, round {round_ + 1}/{args.rounds}: {config}")
            with vllm_server(args, config, workdir) as port:
                before = server_figures(port)
                out = workdir / f"c{concurrency}-r{round_}-{config}.json"
                result = bench_serve(args, port, concurrency, prompts, out)
                after = server_figures(port)
                served = after["cached"] - before["cached"]
            runs[config].append(
                {
                    "median_ttft_ms": float(result["median_ttft_ms"]),
                    "p90_ttft_ms": float(result["p90_ttft_ms"]),
                    "request_throughput": float(result["request_throughput"]),
                    "median_tpot_ms": float(result["median_tpot_ms"]),
                    "cached_tokens": served,
                    "queue_ms": phase_ms(before, after, "queue"),
                    "prefill_ms": phase_ms(before, after, "prefill"),
                }
            )
            row = runs[config][-1]
            progress(
                f"  median TTFT {row['median_ttft_ms']:.1f} ms, p90 {row['p90_ttft_ms']:.1f} ms, "
                f"{row['request_throughput']:.2f} req/s, TPOT {row['median_tpot_ms']:.1f} ms, "
                f"{served:,.0f} prompt tokens from a cache; mean queued {row['queue_ms']:.1f} ms, "
                f"in prefill {row['prefill_ms']:.1f} ms"
            )
    return runs


def report(args: argparse.Namespace, concurrency: int, prompts: int, runs: Runs) -> None:
    def med(config: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[config])

    repeats = (prompts - args.prefixes) * args.prefix_len
    floor = "floor" in runs
    rows = []
    for config in runs:
        keys = ("median_ttft_ms", "p90_ttft_ms", "request_throughput", "median_tpot_ms", "cached_tokens")
        ttft, p90, rps, tpot, cached = (med(config, k) for k in keys)
        queue, prefill = med(config, "queue_ms"), med(config, "prefill_ms")
        rows.append(
            (
                config,
                f"{ttft:.1f}",
                f"{p90:.1f}",
                f"{rps:.2f}",
                f"{tpot:.1f}",
                f"{queue:.1f} + {prefill:.1f}",
                f"{cached:,.0f} ({cached / max(repeats, 1):.1%})",
                f"{ttft / med('floor', 'median_ttft_ms'):.2f}x" if floor else "-",
                f"{rps / med('floor', 'request_throughput'):.2f}x" if floor else "-",
            )
        )
    title = (
        f"concurrency {concurrency}: {prompts} prompts, {args.prefixes} prefixes of {args.prefix_len} tokens + "
        f"{args.suffix_len}, {args.output_len} out; medians of {args.rounds} rounds; "
        f"tokens repeating an earlier prefix: {repeats:,}"
    )
    header = (
        "config",
        "median TTFT ms",
        "p90 TTFT ms",
        "req/s",
        "median TPOT ms",
        "mean ms queued + in prefill",
        "prompt tokens from a cache",
        "TTFT/floor",
        "req/s/floor",
    )
    table(title, rows, header)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--prompts", type=int, nargs="+", help="prompts per concurrency level (default 64 and 128)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prefixes", type=int, default=8)
    parser.add_argument("--prefix-len", type=int, default=1536)
    parser.add_argument("--suffix-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--kv-cache", type=int, default=16 << 20, help="bytes of KV cache (none, kvdepot, lmcache)")
    parser.add_argument("--floor-kv-cache", type=int, default=256 << 20, help="bytes of KV cache for the floor")
    parser.add_argument("--capacity", default="2GiB", help="kvdepot serve --capacity, and LMCache's L1 size")
    parser.add_argument(
        "--lmcache-python",
        default=sys.executable,
        help="a Python that imports both vllm and lmcache, to run the lmcache configuration "
        "(docs/vllm.md says how to make one beside the test environment)",
    )
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME:KEY=VALUE[,KEY=VALUE]",
        help="another kvdepot configuration, with these kv_connector_extra_config keys "
        "(e.g. sync:kvdepot.sync_load_bytes=67108864)",
    )
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an environment variable for every vLLM server, e.g. VLLM_CPU_NUM_OF_RESERVED_CPU=1: the same "
        "OpenMP cores with and without a connector (vLLM reserves one more core per rank for a connector)",
    )
    parser.add_argument("--quick", action="store_true", help="one round of 32 prompts per level")
    parser.add_argument("--keep-logs", type=Path, default=None, metavar="DIR", help="keep the logs and results in DIR")
    parser.add_argument("--model-dir", type=Path, default=MODELS_DIR / "tiny-llama")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds = 1
        args.prompts = args.prompts or [32] * len(args.concurrency)
    if args.prompts is None:
        args.prompts = [64 if c <= 2 else 128 for c in args.concurrency]
    if len(args.prompts) != len(args.concurrency):
        parser.error("--prompts takes one count per --concurrency level")
    args.env = dict(item.split("=", 1) for item in args.env)
    args.variants = {}
    for item in args.variant:
        name, sep, pairs = item.partition(":")
        if not sep or name in CONFIGS:
            parser.error(f"--variant takes NAME:KEY=VALUE[,KEY=VALUE] with a new name, got {item!r}")
        settings = dict(pair.split("=", 1) for pair in pairs.split(","))
        args.variants[name] = {
            k: json.loads(v) if v[:1].isdigit() or v in ("true", "false") else v for k, v in settings.items()
        }
        args.configs.append(name)
    if "lmcache" in args.configs and not lmcache_installed(args.lmcache_python):
        args.configs = [c for c in args.configs if c != "lmcache"]
        progress(f"{args.lmcache_python} cannot import lmcache: its configuration is left out")
    args.capacity_bytes = parse_size(args.capacity)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    from kvdepot.vllm_connector.testing import build_tiny_llama

    progress(f"building (or reusing) the model in {args.model_dir}")
    build_tiny_llama(args.model_dir)
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        if args.keep_logs is not None:  # the vLLM servers' and bench serve's logs and results stay there
            args.keep_logs.mkdir(parents=True, exist_ok=True)
            workdir = args.keep_logs
        else:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvd-serve-")))
        results = []
        for concurrency, prompts in zip(args.concurrency, args.prompts, strict=True):
            results.append((concurrency, prompts, run_level(args, concurrency, prompts, workdir)))
        for concurrency, prompts, runs in results:
            report(args, concurrency, prompts, runs)
    print(f"\n{len(args.configs)} configurations, {args.rounds} round(s), {time.monotonic() - started:.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
