"""A client process for the server's reliability tests: `python _worker.py MODE ADDRESS [options]`.

Modes:
- `churn`: stores and looks up chunks for `--seconds`, checking every byte it reads; the bytes
  of a chunk are a function of (salt, key), so any process can check any chunk.
- `hold`: reserves keys (writing half of them) and leases committed chunks, prints READY,
  then sleeps until it is killed.
- `fuzz`: sends `--frames` malformed or hostile frames from a raw DEALER socket.
Prints one JSON line with its counts at the end (churn, fuzz) or at READY (hold).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import time

import msgspec
import structlog
import zmq

from kvdepot.core import SLOT_HEADER_BYTES
from kvdepot.server import PoolMapping
from kvdepot.transport import (
    PROTOCOL_VERSION,
    CacheClient,
    Hello,
    Lookup,
    LookupItem,
    Register,
    Release,
    Request,
    Reserve,
    encode_request,
)

TIMEOUT = 10.0


def chunk_key(salt: str, i: int) -> bytes:
    return hashlib.sha256(f"{salt}/{i}".encode()).digest()


def chunk_bytes_of(salt: str, key: bytes, size: int) -> bytes:
    """The only bytes ever stored under (salt, key)."""
    seed = hashlib.sha256(salt.encode() + key).digest()
    return (seed * (size // 32 + 1))[:size]


def churn(args: argparse.Namespace) -> dict[str, int]:
    rng = random.Random(args.seed)
    counts = dict.fromkeys(
        ("stores", "committed", "present", "full", "lookups", "hits", "verified", "mismatches", "errors"), 0
    )
    salts = [f"tenant-{i}" for i in range(args.salts)]
    with CacheClient(args.address, timeout=TIMEOUT, client_name=f"churn-{os.getpid()}") as client:
        reg = client.register("test-layout", 256, args.chunk_bytes).result(TIMEOUT)
        pool = PoolMapping(reg.pool.path, reg.pool.size)
        deadline = time.monotonic() + args.seconds
        while time.monotonic() < deadline:
            salt = rng.choice(salts)
            start = rng.randrange(args.keys)
            keys = [chunk_key(salt, (start + j) % args.keys) for j in range(rng.randint(1, 4))]
            try:
                if rng.random() < 0.5:
                    res = client.reserve(salt, keys, args.chunk_bytes).result(TIMEOUT)
                    counts["stores"] += 1
                    counts["present"] += len(res.present)
                    counts["full"] += res.full
                    for slot in res.slots:
                        data = chunk_bytes_of(salt, keys[slot.index], slot.length)
                        half = slot.length // 2
                        pool.write(slot.offset, data[:half])
                        if args.slow_writes and rng.random() < 0.1:
                            time.sleep(0.002)  # widen the window in which a chunk is half-written
                        pool.write(slot.offset + half, data[half:])
                    if res.reservation_id:
                        counts["committed"] += client.commit(res.reservation_id).result(TIMEOUT).committed
                else:
                    (hit,) = client.lookup([(salt, keys)]).result(TIMEOUT).results
                    counts["lookups"] += 1
                    counts["hits"] += hit.num_hits
                    for slot, key in zip(hit.slots, keys, strict=False):
                        if pool.read(slot.offset, slot.length) == chunk_bytes_of(salt, key, slot.length):
                            counts["verified"] += 1
                        else:
                            counts["mismatches"] += 1
                    if hit.lease_id:
                        client.release([hit.lease_id]).result(TIMEOUT)
            except Exception as exc:
                counts["errors"] += 1
                sys.stderr.write(f"churn error: {exc!r}\n")
        pool.close()
    return counts


def hold(args: argparse.Namespace) -> dict[str, int]:
    client = CacheClient(args.address, timeout=TIMEOUT, client_name="holder")
    reg = client.register("test-layout", 256, args.chunk_bytes).result(TIMEOUT)
    pool = PoolMapping(reg.pool.path, reg.pool.size)
    # mid-store: reserved, half written, never committed
    res = client.reserve("hold", [chunk_key("hold", i) for i in range(args.keys)], args.chunk_bytes).result(TIMEOUT)
    for slot in res.slots:
        pool.write(slot.offset, b"\xee" * (slot.length // 2))
    # mid-retrieve: leases on chunks someone else committed
    (hit,) = client.lookup([(args.salt, [chunk_key(args.salt, i) for i in range(args.keys)])]).result(TIMEOUT).results
    print(json.dumps({"reserved": len(res.slots), "leased": hit.num_hits}), flush=True)
    time.sleep(3600)
    return {}


def hostile_corpus(rng: random.Random) -> list[bytes]:
    """Frames that must each get an error reply (or be dropped), never crash or confuse the server."""
    key = b"k" * 32
    valid = [
        encode_request(Request(1, Hello(PROTOCOL_VERSION, "f" * 32, "fuzz"))),
        encode_request(Request(2, Register("l", 256, 1000))),
        encode_request(Request(3, Lookup([LookupItem("s", [key] * 4)]))),
        encode_request(Request(4, Reserve("s", [key], 1000))),
        encode_request(Request(5, Release([1, 2, 3]))),
    ]
    corpus: list[bytes] = []
    for _ in range(300):
        corpus.append(rng.randbytes(rng.randint(0, 64)))
    for frame in valid:
        for _ in range(60):
            mutated = bytearray(frame)
            for _ in range(rng.randint(1, 4)):
                mutated[rng.randrange(len(mutated))] = rng.randrange(256)
            corpus.append(bytes(mutated))
            corpus.append(frame[: rng.randrange(len(frame))])
    encoder = msgspec.msgpack.Encoder()
    corpus += [
        b"",
        b"\xc1",  # never-used msgpack byte
        b"\xdd\xff\xff\xff\xff",  # array header claiming 4G elements
        b"\xdb\xff\xff\xff\xff",  # str header claiming 4 GiB
        b"\x91" * 5000,  # deep nesting
        encoder.encode([1, {"type": "nope"}]),
        encoder.encode([-1, {"type": "ping"}]),
        encoder.encode([2**64 - 1, {"type": "ping"}]),
        encoder.encode([1, {"type": "hello", "protocol_version": 999, "client_id": "x"}]),
        encoder.encode([1, {"type": "reserve", "salt": "s", "keys": [b"short"], "chunk_bytes": 10}]),
        encoder.encode([1, {"type": "reserve", "salt": "s", "keys": [key], "chunk_bytes": 2**62}]),
        encoder.encode([1, {"type": "lookup", "items": [["s", [key] * 10]] * 10, "extra": 1}]),
        encoder.encode([1, {"type": "commit", "reservation_id": -5}]),
        encoder.encode({"id": 1, "body": {"type": "ping"}}),
        encoder.encode([1, {"type": "stats"}, "trailing"]),
    ]
    return corpus


def fuzz(args: argparse.Namespace) -> dict[str, int]:
    rng = random.Random(args.seed)
    corpus = hostile_corpus(rng)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(args.address)
    sent = replies = 0
    per_message = 50
    # Some peers greet first, so that hostile but well-formed requests reach the handler.
    if args.seed % 2:
        sock.send(encode_request(Request(1, Hello(PROTOCOL_VERSION, os.urandom(16).hex(), "fuzz"))))
        sock.poll(int(TIMEOUT * 1000))
        sock.recv_multipart()
    while sent < args.frames:
        batch = [rng.choice(corpus) for _ in range(min(per_message, args.frames - sent))]
        sock.send_multipart(batch)
        sent += len(batch)
        # Read replies as they come, so queues stay small; give up on a reply after the timeout.
        while sock.poll(0 if sent < args.frames else int(TIMEOUT * 1000)):
            replies += len(sock.recv_multipart())
            if replies >= sent:
                break
    sock.close(0)
    ctx.term()
    return {"sent": sent, "replies": replies}


def main() -> None:
    structlog.configure(
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        wrapper_class=structlog.make_filtering_bound_logger(30),  # warnings and up; stdout carries results
    )
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["churn", "hold", "fuzz"])
    parser.add_argument("address")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keys", type=int, default=64)
    parser.add_argument("--salts", type=int, default=2)
    parser.add_argument("--salt", default="tenant-0")
    parser.add_argument("--chunk-bytes", type=int, default=64 * 1024 - SLOT_HEADER_BYTES)  # 64 KiB slots
    parser.add_argument("--slow-writes", action="store_true")
    parser.add_argument("--frames", type=int, default=1000)
    args = parser.parse_args()
    counts = {"churn": churn, "hold": hold, "fuzz": fuzz}[args.mode](args)
    print(json.dumps(counts), flush=True)


if __name__ == "__main__":
    main()
