"""kvdepot.core costs against baselines measured in the same run.

1. Keying a 4,096-token prompt (target at most 50 us), against hashlib.sha256 over
   the same packed bytes.
2. The planner's scheduler-side cost per request per step at 256 running requests
   (target at most 10 us), against an empty loop over the same requests.
"""

from __future__ import annotations

import hashlib
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _util import best_of, progress, table
from kvdepot.core import Namespace, Planner, chunk_keys, pack_tokens

TOKENS = 4096
RUNNING = 256
BLOCK, CHUNK = 16, 256


def bench_keys() -> tuple[float, float]:
    rng = random.Random(0)
    tokens = [rng.randrange(128_000) for _ in range(TOKENS)]
    ns = Namespace(model="bench", layout="fp16:L32", cache_salt="tenant")
    packed = pack_tokens(tokens)
    progress("keying a 4,096-token prompt")
    keyed = best_of(lambda: chunk_keys(ns, tokens, CHUNK), number=200)
    baseline = best_of(lambda: hashlib.sha256(packed).digest(), number=200)
    return keyed, baseline


def bench_planner() -> tuple[float, float]:
    rng = random.Random(1)
    p = Planner(Namespace(model="bench"), block_size=BLOCK, chunk_size=CHUNK)
    reqs = []
    for i in range(RUNNING):
        name = f"req-{i}"
        tokens = [rng.randrange(128_000) for _ in range(rng.randrange(512, 4096))]
        p.add_request(name)
        p.start_lookup(name, tokens)
        p.on_lookup_done(name, [0], ())
        p.num_tokens_to_load(name, 0, len(tokens))
        p.on_allocated(name, list(range(-(-len(tokens) // BLOCK) + 64)), 0)
        p.on_scheduled(name, len(tokens), tokens)
        reqs.append((name, tokens))
    steps = 64
    progress(f"planning {steps} decode steps of {RUNNING} running requests")

    def decode_steps() -> None:
        for _ in range(steps):
            for name, tokens in reqs:
                tokens.append(7)
                p.on_scheduled(name, 1, tokens)
        p.take_releases()

    def empty_steps() -> None:
        for _ in range(steps):
            for _name, tokens in reqs:
                tokens.append(7)

    per_planned = best_of(decode_steps, repeat=5, number=1) / (steps * RUNNING)
    per_empty = best_of(empty_steps, repeat=5, number=1) / (steps * RUNNING)
    return per_planned, per_empty


def main() -> None:
    print("kvdepot.core benchmark")
    keyed, sha = bench_keys()
    planned, empty = bench_planner()
    table(
        "results",
        [
            (
                "key 4,096 tokens",
                f"{keyed * 1e6:.1f} us",
                f"sha256 of same bytes {sha * 1e6:.1f} us",
                f"{keyed / sha:.2f}x",
                "<= 50 us",
                "ok" if keyed <= 50e-6 else "MISSED",
            ),
            (
                "planner per request per step",
                f"{planned * 1e6:.2f} us",
                f"empty loop {empty * 1e6:.2f} us",
                f"{planned / empty:.1f}x",
                "<= 10 us",
                "ok" if planned <= 10e-6 else "MISSED",
            ),
        ],
        ("what", "measured", "baseline (same run)", "ratio", "target", "verdict"),
    )


if __name__ == "__main__":
    main()
