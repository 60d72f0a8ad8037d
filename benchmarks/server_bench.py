"""Benchmark of the kvdepot server against baselines measured in the same run.

1. Round trips: an unbatched Ping and an unbatched one-key Lookup through `CacheClient`
   against a bare ZMQ DEALER/ROUTER echo between two Python processes (target: within 1.5x).
2. Batched lookups: chunk keys looked up per second, many requests per message
   (target: at least 100,000 keys/s).
3. Store and retrieve through the shared pool: reserve, copy into the slots, commit; and
   lookup, copy out of the slots, release; against a plain memcpy of the same bytes between
   two already-touched buffers (target: at least 90%).

Run: `python benchmarks/server_bench.py [--quick]`. The server and the echo run in their own
processes, as in production; this hardware is shared, so compare only the ratios.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import structlog

from _util import start_server
from kvdepot.server import PoolMapping
from kvdepot.transport import (
    PROTOCOL_VERSION,
    CacheClient,
    Hello,
    Lookup,
    LookupItem,
    Ping,
    Request,
    decode_reply,
    encode_request,
)

ECHO = """
import sys, zmq
ctx = zmq.Context()
sock = ctx.socket(zmq.ROUTER)
sock.setsockopt(zmq.LINGER, 0)
sock.bind(sys.argv[1])
print("ready", flush=True)
while True:
    msg = sock.recv_multipart()
    if msg[1] == b"stop":
        break
    sock.send_multipart(msg)
"""


def say(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def best_rate(fn: Callable[[], int], repeats: int) -> float:
    """Items per second of the fastest of `repeats` runs of `fn` (which returns its item count)."""
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        items = fn()
        rates.append(items / (time.perf_counter() - start))
    return max(rates)


class Dealer:
    """A bare DEALER socket that sends one frame and waits for one reply frame."""

    def __init__(self, address: str) -> None:
        import zmq

        self._zmq = zmq
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def call(self, frame: bytes) -> bytes:
        self.sock.send(frame)
        if not self.sock.poll(5000):
            raise TimeoutError("no answer")
        reply: bytes = self.sock.recv()
        return reply

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def interleaved_latencies(calls: dict[str, Callable[[], object]], count: int, rounds: int = 10) -> dict[str, float]:
    """Median latency of each call, measured in alternating rounds so machine noise hits all alike."""
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for fn in calls.values():
        for _ in range(200):  # warm up
            fn()
    for _ in range(rounds):
        for name, fn in calls.items():
            for _ in range(max(1, count // rounds)):
                start = time.perf_counter()
                fn()
                samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in samples.items()}


def key(salt: str, i: int) -> bytes:
    return hashlib.sha256(f"{salt}/{i}".encode()).digest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run)")
    parser.add_argument("--batches", default="16,64", help="chunks per Reserve/Lookup message, comma-separated")
    parser.add_argument("--chunk-mib", type=float, default=2.0, help="chunk size in MiB for the copy benchmark")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    rt_count = 500 if args.quick else 3000
    repeats = 2 if args.quick else 5
    chunk = int(args.chunk_mib * (1 << 20))
    chunks = 64 if args.quick else 128  # per pass; 128 x 2 MiB = 256 MiB
    results: list[tuple[str, str, str, str]] = []

    workdir = Path(tempfile.mkdtemp(prefix="kvdb-", dir="/tmp"))
    server = None
    try:
        say("[1/4] starting a bare ZMQ echo and kvdepot serve ...")
        echo_address = f"ipc://{workdir}/echo.sock"
        echo = subprocess.Popen([sys.executable, "-c", ECHO, echo_address], stdout=subprocess.PIPE, text=True)
        assert echo.stdout is not None
        echo.stdout.readline()
        # Room for every chunk pending at once (a pass reserves its next batch before it commits
        # this one): the server bounds one client's pending bytes at half its capacity, and a
        # slot is a little more than its chunk.
        capacity_mib = max(256, (chunks * chunk) >> 20) * 4
        server, address = start_server(workdir, "--capacity", f"{capacity_mib}MiB", "--page-size", "64MiB")
        with CacheClient(address, timeout=10.0, client_name="bench") as client:
            reg = client.register("bench-layout", 256, chunk).result(10)
            res = client.reserve("s", [key("s", 0)], chunk).result(10)
            client.commit(res.reservation_id).result(10)

            say("[2/4] unbatched round trips, interleaved with the bare ZMQ baseline ...")
            bare_sock = Dealer(echo_address)
            raw_sock = Dealer(address)  # the server's share, without the client library
            raw_sock.call(encode_request(Request(1, Hello(PROTOCOL_VERSION, os.urandom(16).hex(), "bench-raw"))))
            ping_frame = encode_request(Request(2, Ping()))
            lookup_frame = encode_request(Request(3, Lookup([LookupItem("s", [key("nope", 0)])])))
            payload = b"x" * len(lookup_frame)
            lat = interleaved_latencies(
                {
                    "bare": lambda: bare_sock.call(payload),
                    "raw ping": lambda: decode_reply(raw_sock.call(ping_frame)),
                    "raw lookup": lambda: decode_reply(raw_sock.call(lookup_frame)),
                    "client ping": lambda: client.ping().result(10),
                    "client lookup": lambda: client.lookup([("s", [key("s", 0)])]).result(10),
                },
                rt_count,
            )
            bare_sock.sock.send(b"stop")
            bare_sock.close()
            raw_sock.close()
            echo.wait(10)
            client.clear("s").result(10)
            bare = lat["bare"]
            results.append(("bare ZMQ DEALER/ROUTER round trip (baseline)", f"{bare * 1e6:.0f} us", "1.00x", ""))
            for name, label in (
                ("raw ping", "bare DEALER -> kvdepot serve, Ping"),
                ("raw lookup", "bare DEALER -> kvdepot serve, 1-key Lookup"),
                ("client ping", "CacheClient -> kvdepot serve, Ping"),
                ("client lookup", "CacheClient -> kvdepot serve, 1-key Lookup"),
            ):
                value = lat[name]
                results.append((label, f"{value * 1e6:.0f} us", f"{value / bare:.2f}x bare", "<= 1.5x"))

            say("[3/4] batched lookups ...")
            small = 4096
            lookup_keys = [key("lk", i) for i in range(1024)]
            client.register("bench-layout", 256, small).result(10)
            for start in range(0, len(lookup_keys), 256):
                r = client.reserve("lk", lookup_keys[start : start + 256], small).result(10)
                client.commit(r.reservation_id).result(10)
            items = [("lk", lookup_keys[i : i + 16]) for i in range(0, 1024, 16)]  # 64 requests x 16 chunks

            def batched() -> int:
                total = 0
                for _ in range(20):
                    reply = client.lookup(items).result(10)
                    client.release([r.lease_id for r in reply.results])
                    total += sum(r.num_hits for r in reply.results)
                client.ping().result(10)  # the releases are done too
                return total

            keys_per_s = best_rate(batched, repeats)
            results.append(
                (
                    "batched Lookup (64 requests x 16 keys)",
                    f"{keys_per_s:,.0f} keys/s",
                    f"{keys_per_s / 100_000:.2f}x target",
                    ">= 100,000 keys/s",
                )
            )
            client.clear("lk").result(10)
            client.register("bench-layout", 256, chunk).result(10)

            say(f"[4/4] store and retrieve of {chunks} x {chunk >> 20} MiB chunks vs memcpy ...")
            pool = PoolMapping(reg.pool.path, reg.pool.size)
            source = bytearray(os.urandom(1 << 20)) * (chunks * chunk >> 20)
            dest = bytearray(len(source))
            # Every copy, baseline included, is one ctypes.memmove per chunk: a plain memcpy that
            # releases the GIL, so the client's I/O thread can talk to the server meanwhile.
            src_anchor = (ctypes.c_char * len(source)).from_buffer(source)
            dst_anchor = (ctypes.c_char * len(dest)).from_buffer(dest)
            src_at, dst_at, pool_at = ctypes.addressof(src_anchor), ctypes.addressof(dst_anchor), pool.address
            memmove = ctypes.memmove
            keys = [key("copy", i) for i in range(chunks)]

            def memcpy() -> int:
                for at in range(0, chunks * chunk, chunk):
                    memmove(dst_at + at, src_at + at, chunk)
                return chunks * chunk

            def store_all(batch: int) -> int:
                # Pipelined like a connector: the next Reserve is in flight while this batch is
                # copied, and commits are only waited for at the end.
                starts = list(range(0, chunks, batch))
                pending = client.reserve("copy", keys[0:batch], chunk)
                commits = []
                for n, start in enumerate(starts):
                    r = pending.result(10)
                    if n + 1 < len(starts):
                        pending = client.reserve("copy", keys[starts[n + 1] : starts[n + 1] + batch], chunk)
                    for slot in r.slots:
                        memmove(pool_at + slot.offset, src_at + (start + slot.index) * chunk, chunk)
                    commits.append(client.commit(r.reservation_id))
                assert sum(f.result(10).committed for f in commits) == chunks
                return chunks * chunk

            def retrieve_all(batch: int) -> int:
                starts = list(range(0, chunks, batch))
                pending = client.lookup([("copy", keys[0:batch])])
                lease_ids = []
                for n, start in enumerate(starts):
                    (hit,) = pending.result(10).results
                    if n + 1 < len(starts):
                        pending = client.lookup([("copy", keys[starts[n + 1] : starts[n + 1] + batch])])
                    for i, slot in enumerate(hit.slots):
                        memmove(dst_at + (start + i) * chunk, pool_at + slot.offset, chunk)
                    lease_ids.append(hit.lease_id)
                client.release(lease_ids).result(10)
                return chunks * chunk

            # Touch every page of the pool and of the buffers once, so no run pays first-touch faults.
            store_all(chunks)
            retrieve_all(chunks)
            memcpy()
            batches = [int(b) for b in args.batches.split(",")]
            # Each repetition measures the baseline and every variant back to back and keeps their
            # ratios; the medians over repetitions resist the noise of this shared machine.
            copy_rates: list[float] = []
            ratios: dict[tuple[str, int], list[float]] = {}
            rates: dict[tuple[str, int], list[float]] = {}
            for _ in range(repeats * 2 + 1):
                base = best_rate(memcpy, 1)
                copy_rates.append(base)
                for b in batches:
                    for what, fn in (("store", store_all), ("retrieve", retrieve_all)):
                        if what == "store":
                            client.clear("copy").result(10)  # so that every key is stored again
                        rate = best_rate(lambda fn=fn, b=b: fn(b), 1)
                        rates.setdefault((what, b), []).append(rate)
                        ratios.setdefault((what, b), []).append(rate / base)
            assert dest == source, "retrieved bytes differ from the stored ones"
            copy_rate = statistics.median(copy_rates)
            results.append(
                (f"memcpy of the same {chunk >> 20} MiB pieces (baseline)", f"{copy_rate / 1e9:.2f} GB/s", "100%", "")
            )
            for b in batches:
                for what in ("store", "retrieve"):
                    results.append(
                        (
                            f"{what} via pool, {b} chunks/message",
                            f"{statistics.median(rates[what, b]) / 1e9:.2f} GB/s",
                            f"{statistics.median(ratios[what, b]):.0%}",
                            ">= 90%",
                        )
                    )
            del src_anchor, dst_anchor
            pool.close()
    finally:
        if server is not None:
            server.terminate()
            server.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)

    widths = [max(len(row[i]) for row in results) for i in range(4)]
    print()
    print("kvdepot server benchmark (ratios against baselines measured in this run)")
    for row in results:
        print("  " + "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)))


if __name__ == "__main__":
    main()
