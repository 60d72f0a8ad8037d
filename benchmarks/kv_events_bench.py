"""What KV events cost per stored chunk, against the same work without them, measured in one run.

1. The server: chunks committed per second through `kvdepot serve` with `--kv-events` (a real
   ZMQ SUB subscriber reading every batch) and without, in alternating rounds. Each round
   reserves and commits `--batch` chunks per message, then clears them (a `BlockStored` and
   a `BlockRemoved` per chunk). The difference is the events' cost per chunk on the server's loop.
2. The engine's scheduler: what the connector does per chunk it announces (a store planned, its
   commit read from the server's changes, vLLM's `BlockStored` built), against vLLM's own
   `BlockStored` for the same blocks (what vLLM's prefix cache spends per chunk on its events).

Run: `python benchmarks/kv_events_bench.py [--quick]`. This machine is shared: compare ratios.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import structlog

from _util import start_server
from kvdepot.transport import CacheClient


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
                self.events += len(self.decode(payload)[1])

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.sock.close(0)


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
    announcer._apply(_Poll(done(reply), [], [], [], [], "s"), time.monotonic())  # type: ignore[arg-type]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run)")
    parser.add_argument("--batch", type=int, default=16, help="chunks per Reserve/Commit message")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    messages, rounds = (100, 3) if args.quick else (300, 7)
    workdir = Path(tempfile.mkdtemp(prefix="kvde-", dir="/tmp"))
    try:
        say(f"[1/2] the server: {rounds} rounds of {messages} x {args.batch} commits, with and without --kv-events ...")
        server = server_part(workdir, args.batch, messages, rounds)
        plain, events = server["plain"], server["events"]
        per_chunk = messages * args.batch
        say("[2/2] the engine's scheduler: announcing 4,096 chunks ...")
        runs = [engine_part(4096, 128, 256) for _ in range(4)][1:]  # the first run warms the allocator up
        ours, vllm_own = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
    finally:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
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
    width = max(len(r[0]) for r in rows)
    sys.stdout.write("\n".join(f"{a:<{width}}  {b:>18}  {c}" for a, b, c in rows) + "\n")


if __name__ == "__main__":
    main()
