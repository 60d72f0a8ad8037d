"""Round-trip and batched-lookup throughput of kvdepot.transport, against bare pyzmq.

Run: python benchmarks/transport_bench.py [--quick]

1. Unbatched round trip: one Lookup of one key through `CacheClient` (futures, shared I/O
   thread, codec, dispatcher, handler) versus a bare pyzmq DEALER/ROUTER echo of the same
   frame, both against a server in a separate process; a raw DEALER sending that frame to
   the kvdepot endpoint shows the server's share. Samples are interleaved so that noise
   from other processes hits all three alike. Target: ratio <= 1.5.
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
    EndSession,
    EndSessionReply,
    ErrorReply,
    Hello,
    HelloReply,
    Lookup,
    LookupItem,
    LookupReply,
    LookupResult,
    Request,
    Slot,
    encode_request,
    open_endpoint,
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
        if isinstance(body, EndSession):
            return EndSessionReply()
        return ErrorReply("invalid_argument", f"the benchmark handler does not do {type(body).__name__}")

    def peer_gone(self, peer: Any) -> None:
        pass


def _serve_endpoint(address: str, ready: Any) -> None:
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    ep = open_endpoint(address, _Handler())
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


def _lookup_frame() -> bytes:
    return encode_request(Request(2, Lookup([LookupItem("salt", [b"k" * 32])])))


def round_trips(bare_addr: str, kv_addr: str, client: CacheClient, rounds: int, n: int) -> dict[str, list[float]]:
    """Seconds per round trip, `rounds` samples of `n` each, the three ways interleaved (noise hits all alike).

    - bare: a DEALER sends the Lookup frame to a bare ROUTER echo process;
    - raw: a DEALER sends the same frame to the kvdepot endpoint process (decode, handler, encode);
    - client: `CacheClient.lookup(...).result()` against that endpoint.
    """
    ctx: zmq.Context[Any] = zmq.Context()
    bare = ctx.socket(zmq.DEALER)
    raw = ctx.socket(zmq.DEALER)
    for sock in (bare, raw):
        sock.setsockopt(zmq.LINGER, 0)
    raw.setsockopt(zmq.ROUTING_ID, b"bench-raw-peer")
    bare.connect(bare_addr)
    raw.connect(kv_addr)
    raw.send(encode_request(Request(1, Hello(PROTOCOL_VERSION, "bench-raw-peer"))))
    raw.recv()
    frame = _lookup_frame()
    item = [("salt", [b"k" * 32])]

    def socket_loop(sock: Any) -> None:
        for _ in range(n):
            sock.send(frame)
            sock.recv()

    def client_loop() -> None:
        for _ in range(n):
            client.lookup(item).result(5)

    ways = {"bare": lambda: socket_loop(bare), "raw": lambda: socket_loop(raw), "client": client_loop}
    for fn in ways.values():  # warm up
        fn()
    samples: dict[str, list[float]] = {name: [] for name in ways}
    for r in range(rounds):
        for name, fn in ways.items():
            t0 = time.perf_counter()
            fn()
            samples[name].append((time.perf_counter() - t0) / n)
        print(f"  round {r + 1}/{rounds}", end="\r", flush=True)
    print()
    bare.close()
    raw.close()
    ctx.term()
    return samples


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
    n = 200 if args.quick else 500
    rounds = 5 if args.quick else 30
    messages = 50 if args.quick else 400

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    tmp = tempfile.mkdtemp(prefix="kvt-bench-")
    if args.transport == "ipc":
        bare_addr, kv_addr = f"ipc://{tmp}/bare.sock", f"ipc://{tmp}/kv.sock"
    else:
        bare_addr, kv_addr = "tcp://127.0.0.1:47811", "tcp://127.0.0.1:47812"

    print(f"transport bench over {args.transport}: {rounds} interleaved rounds of {n} round trips", flush=True)
    procs = [_start(_serve_bare, bare_addr), _start(_serve_endpoint, kv_addr)]
    try:
        client = CacheClient(kv_addr, timeout=10)
        print("[1/3] unbatched round trips: bare pyzmq, raw frame to kvdepot, CacheClient ...", flush=True)
        samples = round_trips(bare_addr, kv_addr, client, rounds, n)
        results = {}
        for step, per_message in ((2, 32), (3, 128)):
            print(
                f"[{step}/3] batched lookups, {per_message} requests x {KEYS_PER_REQUEST} keys per message ...",
                flush=True,
            )
            results[per_message] = batched_keys_per_s(client, per_message, messages)
        client.close()
    finally:
        for proc in procs:
            proc.kill()
            proc.join(5)

    med = {k: statistics.median(v) for k, v in samples.items()}
    best = {k: min(v) for k, v in samples.items()}
    # each round's three samples were taken back to back: their ratios are the least noisy
    ratios = {
        k: statistics.median(c / b for c, b in zip(samples[k], samples["bare"], strict=True)) for k in ("raw", "client")
    }
    ratio = ratios["client"]
    print()
    load = os.getloadavg()[0]
    print(
        f"summary (median of rounds, best round in brackets; ratios are medians of per-round ratios; load {load:.1f})"
    )
    if load > (os.cpu_count() or 1) * 0.75:
        print("  warning: the machine is busy; round-trip times and ratios are noisy")
    print(f"  bare pyzmq DEALER/ROUTER round trip   {med['bare'] * 1e6:7.1f} us  [{best['bare'] * 1e6:6.1f}]")
    print(
        f"  raw frame to the kvdepot endpoint     {med['raw'] * 1e6:7.1f} us  [{best['raw'] * 1e6:6.1f}]"
        f"  ratio {ratios['raw']:4.2f}x  (the server's share)"
    )
    print(
        f"  CacheClient.lookup round trip         {med['client'] * 1e6:7.1f} us  [{best['client'] * 1e6:6.1f}]"
        f"  ratio {ratio:4.2f}x  (target <= 1.5x)"
        f"  {'OK' if ratio <= 1.5 else 'MISSED'}"
    )
    per_round = sorted(c / b for c, b in zip(samples["client"], samples["bare"], strict=True))
    if len(per_round) >= 4:
        q1, q3 = per_round[len(per_round) // 4], per_round[(3 * len(per_round)) // 4]
        print(f"    per-round client/bare ratios: quartiles {q1:4.2f}-{q3:4.2f}, {len(per_round)} rounds")
    for per_message, rate in results.items():
        print(
            f"  batched lookup, {per_message:3d} requests/message  {rate / 1e3:7.1f} k keys/s"
            f"  (target >= 100k)  {'OK' if rate >= 100_000 else 'MISSED'}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
