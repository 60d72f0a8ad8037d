"""What `kvdepot clear --tiers` costs in the remote tier, against a plain delete of the same keys.

A Valkey holds N objects of `--salts` salts, written by `RemoteTier` (each header carries its
salt's tag). Three ways to delete in the same run, each on a fresh fill:

1. baseline: a plain redis-py pipeline of UNLINKs of one salt's keys, their names known in
   advance (what a clear would cost if a per-tenant list of names were kept on every write);
2. `RemoteTier.clear(salt)`: SCAN of every key under the prefix, GETRANGE of each object's
   16 tag bytes, UNLINK of the salt's;
3. `RemoteTier.clear(None)`: SCAN and UNLINK of every object.

It prints each one's time, objects scanned per second and the ratio to the baseline. The
extra cost per write is the 16 tag bytes in each header (no command, no round trip).

Run: python benchmarks/clear_bench.py [--objects 200000] [--salts 10] [--size 1024]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from pathlib import Path

import structlog

sys.path.insert(0, str(Path(__file__).parent))

from _util import progress, table
from kvdepot.server import ChunkWrite, RemoteTier, object_name
from kvdepot.server.testing import ValkeyNode, find_valkey_server, missing_reason

BATCH = 256


def fill(tier: RemoteTier, objects: int, salts: int, size: int) -> None:
    payload = b"\x5a" * size
    batch: list[ChunkWrite] = []
    for i in range(objects):
        batch.append(ChunkWrite(f"tenant-{i % salts}", i.to_bytes(32, "little"), payload, b"f" * 32))
        if len(batch) == BATCH:
            assert all(tier.write(batch))
            batch = []
    if batch:
        assert all(tier.write(batch))


def salt_keys(objects: int, salts: int, salt: int) -> list[str]:
    return ["kvd:" + object_name(f"tenant-{salt}", i.to_bytes(32, "little")) for i in range(salt, objects, salts)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, default=200_000, help="objects in Valkey (all salts)")
    parser.add_argument("--salts", type=int, default=10, help="salts they belong to, evenly")
    parser.add_argument("--size", type=int, default=1024, help="payload bytes per object")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    if (reason := missing_reason()) is not None:
        sys.exit(f"clear_bench: {reason}")
    binary = find_valkey_server()
    assert binary is not None
    import redis

    rows = []
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        node = ValkeyNode(binary, Path(tmp) / "valkey").start()
        stack.callback(node.stop)
        plain = redis.Redis(port=node.port)
        stack.callback(plain.close)
        tier = stack.enter_context(RemoteTier(node.url))
        per_salt = args.objects // args.salts

        def timed(label: str, fn) -> float:
            progress(f"filling {args.objects:,} objects of {args.size} bytes in {args.salts} salts")
            plain.flushdb()
            fill(tier, args.objects, args.salts, args.size)
            progress(label)
            start = time.perf_counter()
            deleted = fn()
            elapsed = time.perf_counter() - start
            progress(f"{label}: {deleted:,} objects deleted in {elapsed:.2f} s")
            return elapsed

        def plain_unlink() -> int:
            keys = salt_keys(args.objects, args.salts, 3)
            deleted = 0
            for start in range(0, len(keys), 1000):
                pipe = plain.pipeline(transaction=False)
                for key in keys[start : start + 1000]:
                    pipe.unlink(key)
                deleted += sum(pipe.execute())
            return deleted

        base = timed("baseline: UNLINK of one salt's known keys", plain_unlink)
        one = timed("RemoteTier.clear(one salt)", lambda: tier.clear("tenant-3"))
        everything = timed("RemoteTier.clear(None)", lambda: tier.clear(None))
        for label, seconds, deleted in (
            ("baseline: UNLINK of one salt's known keys", base, per_salt),
            ("clear one salt (scan, tag, unlink)", one, per_salt),
            ("clear every object (scan, unlink)", everything, args.objects),
        ):
            rows.append(
                (
                    label,
                    f"{seconds:.2f} s",
                    f"{deleted:,}",
                    f"{args.objects / seconds:,.0f}" if "baseline" not in label else "-",
                    f"{seconds / base:.1f}x",
                )
            )
    table(
        f"Clearing the remote tier: {args.objects:,} objects, {args.salts} salts, {args.size} B each",
        rows,
        ("what", "time", "deleted", "scanned/s", "vs baseline"),
    )


if __name__ == "__main__":
    main()
