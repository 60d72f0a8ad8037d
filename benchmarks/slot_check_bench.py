"""The load-time slot check: what reading each slot's header before and after the copy costs.

Against a real `kvdepot serve` process and its shared-memory pool, a real connector worker
(`WorkerSide`) stores chunks of a vLLM-CPU-shaped KV cache, looks them up, and loads them
back the way the copy thread does (`WorkerSide._load`: the header check, the scatter, the
second read of the headers). The baseline, measured in the same run and interleaved with it,
is the same scatter of the same chunks into the same blocks with no check at all. The ratio
is what a load costs with the check over without it; the check alone is also timed per chunk.

Run: python benchmarks/slot_check_bench.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import kvdepot.server
from _util import progress, table
from kvdepot.core import slot_digest, slot_header_holds
from kvdepot.transport import CacheClient
from kvdepot.vllm_connector._meta import KVDepotMetadata, LoadOp, StoreOp
from kvdepot.vllm_connector.testing import standalone_worker

BLOCK, CHUNK = 16, 256
BPC = CHUNK // BLOCK
#: (name, layers, KV heads, head size): one KV rank's share of a chunk of 256 tokens, bf16.
CASES = [
    ("tiny (2 layers, 2x64)", 2, 2, 64),
    ("1B-like (16 layers, 8x64)", 16, 8, 64),
    ("8B-like (32 layers, 8x128)", 32, 8, 128),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    args = parser.parse_args()
    rounds = 7 if args.quick else 21
    workdir = Path(tempfile.mkdtemp(prefix="kvd-slotbench-"))
    os.chmod(workdir, 0o700)
    print("kvdepot slot check: a load with the header check against the same scatter without it", flush=True)
    rows = []
    with kvdepot.server.ServerProcess(
        f"ipc://{workdir}/kvdepot.sock", capacity="3GiB", args=("--no-metrics", "--no-keep-pool")
    ) as server:
        for name, layers, heads, head in CASES:
            progress(f"{name}: storing chunks through a real worker")
            rows.append(run_case(server.address, name, layers, heads, head, rounds=rounds))
    table(
        "Load of 4 chunks (one request's hit): with the slot check vs the scatter alone",
        rows,
        ("case", "chunk", "load+check", "scatter", "ratio (median)", "check per chunk", "check / scatter"),
    )


def run_case(address: str, name: str, layers: int, heads: int, head: int, *, rounds: int) -> tuple[str, ...]:
    chunks = 4
    blocks = 4 * chunks * BPC + 1
    kv = {
        f"layers.{i}": torch.randn((blocks, heads, BLOCK, 2 * head)).to(torch.bfloat16) for i in range(layers)
    }  # the CPU backend's [blocks, heads, tokens, K|V] per layer
    with CacheClient(address, timeout=10.0) as client:
        worker = standalone_worker(
            client, kv, chunk_size=CHUNK, block_size=BLOCK, layout_name=f"bench-{name}", model="bench",
            backend_hint="CPU_ATTN", prefault_pool=False,
        )  # fmt: skip
        try:
            keys = [os.urandom(32) for _ in range(chunks)]
            src = list(range(1, 1 + chunks * BPC))
            worker.wait_for_save(KVDepotMetadata(stores=[StoreOp("s", "", [keys], [src])]))
            worker._copier.submit(lambda: None).result()  # the store has run
            hit = client.lookup([("", keys)]).result(10).results[0]
            assert hit.num_hits == chunks, hit
            slots = [s.offset for s in hit.slots]
            dst = list(range(1 + chunks * BPC, 1 + 2 * chunks * BPC))
            op = LoadOp("l", client.server_id or "", [slots], [dst], 0, chunks * CHUNK, worker.chunk_bytes, "", [keys])
            pool = worker._copier.submit(worker._current_pool).result()
            assert pool is not None
            blocks_of = [dst[i * BPC : (i + 1) * BPC] for i in range(chunks)]

            def checked() -> None:
                worker._load(op)

            def plain() -> None:
                pool.copiers[0].scatter(slots, blocks_of, skip_blocks=0, slot_size=worker.chunk_bytes).wait()

            def check_only() -> None:
                before = [pool.header(s) for s in slots]
                digests = [slot_digest("", k) for k in keys]
                assert all(slot_header_holds(h, d, worker.chunk_bytes) for h, d in zip(before, digests, strict=True))
                assert all(pool.header(s) == h for s, h in zip(slots, before, strict=True))

            ratios, with_check, without, check = [], [], [], []
            for r in range(rounds):
                order = [(checked, with_check), (plain, without)]
                for fn, out in order if r % 2 else order[::-1]:
                    start = time.perf_counter()
                    fn()
                    out.append(time.perf_counter() - start)
                ratios.append(with_check[-1] / without[-1])
                start = time.perf_counter()
                check_only()
                check.append((time.perf_counter() - start) / chunks)
            assert torch.equal(kv["layers.0"][dst[0]], kv["layers.0"][src[0]])
            client.release([hit.lease_id]).result(10)
        finally:
            worker.shutdown()
    ratio = statistics.median(ratios)
    return (
        name,
        f"{worker.chunk_bytes / 2**20:.1f} MiB",
        f"{min(with_check) * 1e3:.2f} ms",
        f"{min(without) * 1e3:.2f} ms",
        f"{ratio:.3f}x",
        f"{statistics.median(check) * 1e6:.1f} us",
        f"{statistics.median(check) * chunks / statistics.median(without):.2%}",
    )


if __name__ == "__main__":
    main()
