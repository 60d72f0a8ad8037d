"""Round-trip and batched-lookup throughput of kvdepot.transport, against bare pyzmq.

Run: python benchmarks/transport_bench.py [--quick]

1. Unbatched round trip: one Lookup of one key through `CacheClient` (futures, shared I/O
   thread, codec, dispatcher, handler) versus a bare pyzmq DEALER/ROUTER echo of a frame of
   the same size, both against a server in a separate process. Target: ratio <= 1.5.
2. Batched lookups: Lookup messages carrying 32 and 128 requests of 16 keys each, several
   in flight, in chunk keys per second. Target: >= 100k keys/s.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import zmq

from kvdepot.transport import (
    PROTOCOL_VERSION,
    CacheClient,
    Hello,
    HelloReply,
    Lookup,
    LookupReply,
    LookupResult,
    ServerEndpoint,
    Slot,
)

KEYS_PER_REQUEST = 16
IN_FLIGHT = 4


class _Handler:
    """A trivial handler: every key hits, with a fixed slot; no real index behind it."""

    def handle(self, peer: Any, body: Any) -> Any:
        if isinstance(body, Hello):
            return HelloReply(PROTOCOL_VERSION, "bench", "bench")
        if isinstance(body, Lookup):
            return LookupReply([LookupResult(len(i.keys), 1, [Slot(0, 4096)] * len(i.keys)) for i in body.items])
        raise ValueError(type(body).__name__)

    def peer_gone(self, peer: Any) -> None:
        pass


def _serve_endpoint(address: str, ready: Any) -> None:
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    ep = ServerEndpoint(address, _Handler())
    ready.set()
    ep.serve_forever()


def _serve_bare(address: str, ready: Any) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address)
    ready.set()
    while True:
        msg = sock.recv_multipart()
        sock.send_multipart(msg)


def _start(target: Any, address: str) -> mp.Process:
    ready = mp.get_context("spawn").Event()
    proc = mp.get_context("spawn").Process(target=target, args=(address, ready), daemon=True)
    proc.start()
    if not ready.wait(30):
        raise RuntimeError("server process did not start")
    return proc


def bare_round_trip(address: str, n: int, frame: bytes) -> float:
    """Median seconds per round trip of a bare DEALER against a ROUTER echo."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    for _ in range(200):
        sock.send(frame)
        sock.recv()
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            sock.send(frame)
            sock.recv()
        samples.append((time.perf_counter() - t0) / n)
    sock.close()
    ctx.term()
    return statistics.median(samples)


def client_round_trip(client: CacheClient, n: int) -> float:
    """Median seconds per unbatched one-key Lookup through CacheClient."""
    item = [("salt", [b"k" * 32])]
    for _ in range(200):
        client.lookup(item).result(5)
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            client.lookup(item).result(5)
        samples.append((time.perf_counter() - t0) / n)
    return statistics.median(samples)


def batched_keys_per_s(client: CacheClient, per_message: int, messages: int) -> float:
    """Chunk keys per second with `per_message` requests per Lookup, IN_FLIGHT messages outstanding."""
    items = [(f"s{i % 4}", [os.urandom(32) for _ in range(KEYS_PER_REQUEST)]) for i in range(per_message)]
    client.lookup(items).result(5)
    t0 = time.perf_counter()
    pending: list[Any] = []
    for _ in range(messages):
        pending.append(client.lookup(items))
        if len(pending) >= IN_FLIGHT:
            reply: LookupReply = pending.pop(0).result(10)
            assert len(reply.results) == per_message
    for fut in pending:
        fut.result(10)
    elapsed = time.perf_counter() - t0
    return messages * per_message * KEYS_PER_REQUEST / elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer iterations (a smoke run)")
    parser.add_argument("--transport", default="ipc", choices=["ipc", "tcp"])
    args = parser.parse_args()
    n = 300 if args.quick else 2000
    messages = 50 if args.quick else 400

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    tmp = tempfile.mkdtemp(prefix="kvt-bench-")
    if args.transport == "ipc":
        bare_addr, kv_addr = f"ipc://{tmp}/bare.sock", f"ipc://{tmp}/kv.sock"
    else:
        bare_addr, kv_addr = "tcp://127.0.0.1:47811", "tcp://127.0.0.1:47812"

    print(f"transport bench over {args.transport}, {n} round trips x 5 samples (median)", flush=True)
    procs = [_start(_serve_bare, bare_addr), _start(_serve_endpoint, kv_addr)]
    try:
        client = CacheClient(kv_addr, timeout=10)
        frame_size = len(__import__("kvdepot.transport", fromlist=["encode"]).encode([1, Lookup([])])) + 40
        print("[1/4] bare pyzmq DEALER/ROUTER round trip ...", flush=True)
        bare = bare_round_trip(bare_addr, n, b"x" * frame_size)
        print("[2/4] CacheClient.lookup round trip ...", flush=True)
        ours = client_round_trip(client, n)
        results = {}
        for step, per_message in ((3, 32), (4, 128)):
            print(
                f"[{step}/4] batched lookups, {per_message} requests x {KEYS_PER_REQUEST} keys per message ...",
                flush=True,
            )
            results[per_message] = batched_keys_per_s(client, per_message, messages)
        client.close()
    finally:
        for proc in procs:
            proc.kill()
            proc.join(5)

    ratio = ours / bare
    print()
    print("summary")
    print(f"  bare pyzmq round trip          {bare * 1e6:8.1f} us")
    print(
        f"  CacheClient round trip         {ours * 1e6:8.1f} us   ratio {ratio:4.2f}x  (target <= 1.5x)"
        f"  {'OK' if ratio <= 1.5 else 'MISSED'}"
    )
    for per_message, rate in results.items():
        print(
            f"  batched lookup, {per_message:3d} req/msg   {rate / 1e3:8.1f} k keys/s  (target >= 100k)"
            f"  {'OK' if rate >= 100_000 else 'MISSED'}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
