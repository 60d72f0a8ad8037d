"""kvdepot.gpu: gather and scatter of realistic chunks against a plain copy of the same bytes.

CPU: one chunk per call between a paged KV cache and a pool slot, against a plain
contiguous memcpy (torch `copy_`) of the same number of bytes, measured in the same run
and interleaved with it. Both walk a working set far larger than the CPU caches, so
every copy reads and writes cold memory as it would in a server. CUDA (when present):
the same against a raw pinned `cudaMemcpyAsync` of the same bytes.

Run: python benchmarks/gpu_bench.py [--quick]
"""

from __future__ import annotations

import argparse
import mmap
import statistics
import sys
import time
from collections.abc import Callable

import torch

from kvdepot.gpu import KVLayout, open_copier

TARGET = 0.90
WORKING_SET = 384 << 20  # bytes of KV cache and of pool per case, well past the last-level cache


def log(message: str) -> None:
    print(message, flush=True)


def kv_caches(layers: int, blocks: int, heads: int, tokens: int, head: int, *, shared: bool, device: str) -> dict:
    """A vLLM-CPU-shaped cache: [blocks, heads, tokens, 2 * head] bf16 per layer."""
    shape = (blocks, heads, tokens, 2 * head)
    if shared:  # one storage, layer-major (what vLLM >= 0.2x allocates)
        buf = torch.empty((layers, *shape), dtype=torch.bfloat16, device=device)
        buf.view(torch.int16).random_(-(2**15), 2**15 - 1)
        return {f"layers.{i}": buf[i] for i in range(layers)}
    caches = {}
    for i in range(layers):
        t = torch.empty(shape, dtype=torch.bfloat16, device=device)
        t.view(torch.int16).random_(-(2**15), 2**15 - 1)
        caches[f"layers.{i}"] = t
    return caches


def interleaved(
    op: Callable[[int], None], base: Callable[[int], None], rounds: int, reps: int
) -> tuple[float, float, float]:
    """(best seconds per call of `op`, of `base`, median of paired ratios base/op).

    Each round times `base` and `op` back to back, alternating which goes first, so a
    slow spell of a shared machine hits both sides of a pair alike; the median of the
    per-round ratios is the comparison, the best times give the absolute rates.
    """
    op(0)
    base(0)
    op_times, base_times, ratios = [], [], []
    i = 0
    for round_ in range(rounds):
        pair = {}
        order = ((op, "op"), (base, "base")) if round_ % 2 else ((base, "base"), (op, "op"))
        for fn, name in order:
            start = time.perf_counter()
            for _ in range(reps):
                fn(i)
                i += 1
            pair[name] = (time.perf_counter() - start) / reps
        op_times.append(pair["op"])
        base_times.append(pair["base"])
        ratios.append(pair["base"] / pair["op"])
    return min(op_times), min(base_times), statistics.median(ratios)


def cpu_case(  # noqa: PLR0917 - one row of the case table
    name: str, layers: int, heads: int, tokens: int, head: int, per_chunk: int, shared: bool, batch: int, *, rounds: int
):
    block_bytes = heads * tokens * 2 * head * 2
    blocks = max(WORKING_SET // (layers * block_bytes), 4 * per_chunk)
    kv = kv_caches(layers, blocks, heads, tokens, head, shared=shared, device="cpu")
    layout = KVLayout.from_kv_caches(kv, backend_hint="CPU_ATTN")
    size = layout.chunk_bytes(per_chunk)
    slots = max(WORKING_SET // size, 2)
    pool = torch.frombuffer(mmap.mmap(-1, slots * size), dtype=torch.uint8)
    pool.fill_(1)  # fault the pages in, as a long-running server's pool would be
    # The baseline copies the same number of bytes between the same two memory areas:
    # contiguous ranges of the KV cache's own storage and the same pool slots.
    storages = [t.view(-1).view(torch.uint8) for t in kv.values()]
    whole = storages[0] if shared else None
    if whole is not None:
        whole = torch.empty(0, dtype=torch.uint8).set_(whole.untyped_storage())
    gen = torch.Generator().manual_seed(0)
    perm = torch.randperm(blocks, generator=gen).tolist()
    scattered = [perm[(i * per_chunk) % (blocks - per_chunk) :][:per_chunk] for i in range(slots)]
    runs = [
        list(range(s, s + per_chunk)) for s in torch.randint(0, blocks - per_chunk, (slots,), generator=gen).tolist()
    ]

    def kv_range(i: int) -> torch.Tensor:
        if whole is not None:
            start = (i * 7919 % max(1, whole.numel() // size - 1)) * size
            return whole[start : start + size]
        layer = storages[i % len(storages)]  # a layer tensor may hold less than a chunk: wrap to the next
        if layer.numel() <= size:
            return layer
        start = (i * 7919 % max(1, layer.numel() // size - 1)) * size
        return layer[start : start + size]

    def memcpy(i: int) -> None:
        if batch > 1:  # one plain copy of all the call's bytes
            j = (i * batch) % (slots - batch)
            pool[j * size : (j + batch) * size].copy_(whole[((i * 7) % (slots - batch)) * size :][: batch * size])
            return
        j = i % slots
        src = kv_range(i)
        pool[j * size : j * size + src.numel()].copy_(src)
        if src.numel() < size:  # per-layer tensors: copy the rest from the next layers
            done = src.numel()
            k = i + 1
            while done < size:
                nxt = kv_range(k)[: size - done]
                pool[j * size + done : j * size + done + nxt.numel()].copy_(nxt)
                done += nxt.numel()
                k += 1

    def memcpy_back(i: int) -> None:
        if batch > 1:
            j = (i * batch) % (slots - batch)
            whole[((i * 7) % (slots - batch)) * size :][: batch * size].copy_(pool[j * size : (j + batch) * size])
            return
        j = i % slots
        src = kv_range(i)
        src.copy_(pool[j * size : j * size + src.numel()])

    results = []
    reps = max(1, (4 << 20) // (size * batch))

    def call_args(i: int, ids: list[list[int]], shift: int) -> tuple[list[list[int]], list[int]]:
        first = (i * batch) % (slots - batch + 1)
        return [ids[(first + k + shift) % slots] for k in range(batch)], [(first + k) * size for k in range(batch)]

    def gather_call(i: int, ids: list[list[int]]) -> None:
        chunk_ids, offsets = call_args(i, ids, 0)
        copier.gather(chunk_ids, offsets)

    def scatter_call(i: int, ids: list[list[int]]) -> None:
        chunk_ids, offsets = call_args(i, ids, 3)
        if batch > 1:  # one scatter never writes a block twice
            seen: set[int] = set()
            chunk_ids = [c for c in chunk_ids if not (seen & set(c)) and not seen.update(c)]
            offsets = offsets[: len(chunk_ids)]
        copier.scatter(offsets, chunk_ids)

    with open_copier(layout, pool) as copier:
        for ids_name, ids in (("random ids", scattered), ("consecutive ids", runs)):
            gather_s, base_g, ratio_g = interleaved(lambda i, ids=ids: gather_call(i, ids), memcpy, rounds, reps)
            scatter_s, base_s, ratio_s = interleaved(
                lambda i, ids=ids: scatter_call(i, ids),
                memcpy_back if whole is not None else memcpy,
                rounds,
                reps,
            )
            moved = size * batch
            for op, t, b, paired in (("gather", gather_s, base_g, ratio_g), ("scatter", scatter_s, base_s, ratio_s)):
                row = (f"{name}, {ids_name}", op, moved, moved / t / 1e9, moved / b / 1e9, b / t, paired)
                log(
                    f"  {row[0]:52s} {op:8s} {row[3]:6.2f} GB/s vs memcpy {row[4]:6.2f} GB/s  "
                    f"ratio {row[5]:.2f} (paired median {row[6]:.2f})"
                )
                results.append(row)
    return results


def cuda_case(  # noqa: PLR0917 - one row of the case table
    name: str, layers: int, heads: int, tokens: int, head: int, per_chunk: int, hint: str, *, rounds: int
):
    device = "cuda"
    if hint == "FLASH_ATTN":
        kv = {}
        for i in range(layers):
            t = torch.empty((2, 4096, tokens, heads, head), dtype=torch.bfloat16, device=device)
            t.view(torch.int16).random_(-(2**15), 2**15 - 1)
            kv[f"layers.{i}"] = t
    else:
        kv = kv_caches(layers, 4096, heads, tokens, head, shared=True, device=device)
    layout = KVLayout.from_kv_caches(kv, backend_hint=hint)
    size = layout.chunk_bytes(per_chunk)
    slots = 8
    mapping = mmap.mmap(-1, slots * size)
    pool = torch.frombuffer(mapping, dtype=torch.uint8)
    pool.fill_(1)
    device_src = torch.empty(size, dtype=torch.uint8, device=device)
    pinned = torch.empty(slots * size, dtype=torch.uint8).pin_memory()
    stream = torch.cuda.Stream()
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randperm(4096, generator=gen)[:per_chunk].tolist() for _ in range(slots)]
    results = []

    def timed(fn: Callable[[int], None], reps: int = 20) -> float:
        fn(0)
        torch.cuda.synchronize()
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            for i in range(reps):
                fn(i)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) / reps)
        return min(times)

    def raw_d2h(i: int) -> None:
        with torch.cuda.stream(stream):
            pinned[(i % slots) * size :][:size].copy_(device_src, non_blocking=True)

    def raw_h2d(i: int) -> None:
        with torch.cuda.stream(stream):
            device_src.copy_(pinned[(i % slots) * size :][:size], non_blocking=True)

    base = {"gather": timed(raw_d2h), "scatter": timed(raw_h2d)}
    for method in ("triton", "dma"):
        try:
            copier = open_copier(layout, pool, method=method)
        except Exception as exc:  # report and go on with the other method
            log(f"  {name} {method}: unavailable ({exc})")
            continue
        with copier:
            ops = {
                "gather": lambda i, c=copier: c.gather([ids[i % slots]], [(i % slots) * size]),
                "scatter": lambda i, c=copier: c.scatter([(i % slots) * size], [ids[(i + 1) % slots]]),
            }
            for op, fn in ops.items():
                t = timed(fn)
                row = (f"{name}, {method}", op, size, size / t / 1e9, size / base[op] / 1e9, base[op] / t, base[op] / t)
                rate, base_rate = row[3], row[4]
                log(f"  {row[0]:52s} {op:8s} {rate:6.2f} GB/s vs raw {base_rate:6.2f} GB/s  ratio {row[5]:.2f}")
                results.append(row)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (noisier)")
    args = parser.parse_args()
    rounds = 10 if args.quick else 60
    threads = torch.get_num_threads()
    log(f"kvdepot.gpu benchmark: torch {torch.__version__}, {threads} CPU threads, target ratio {TARGET}")
    results = []
    cases = [
        # name, layers, heads, tokens, head size, blocks per chunk, one shared storage, chunks per call
        ("CPU 16 blocks x 2 MiB (32 layers), one storage", 32, 8, 16, 128, 16, True, 1),
        ("CPU 16 blocks x 2 MiB (32 layers), tensor per layer", 32, 8, 16, 128, 16, False, 1),
        ("CPU 64 blocks x 32 KiB (8 layers), one storage", 8, 1, 16, 64, 64, True, 1),
        ("CPU 64 blocks x 32 KiB (8 layers), one storage, 8 chunks/call", 8, 1, 16, 64, 64, True, 8),
        ("CPU 64 blocks x 32 KiB (8 layers), tensor per layer", 8, 1, 16, 64, 64, False, 1),
    ]
    for i, case in enumerate(cases, 1):
        log(f"[{i}/{len(cases)}] {case[0]}")
        results += cpu_case(*case, rounds=rounds)
    if torch.cuda.is_available():
        gpu_cases = [
            ("CUDA 16 blocks x 2 MiB (32 layers), flash-attn", 32, 8, 16, 128, 16, "FLASH_ATTN"),
            ("CUDA 64 blocks x 32 KiB (8 layers), one storage", 8, 1, 16, 64, 64, "bhnc"),
        ]
        for i, case in enumerate(gpu_cases, 1):
            log(f"[cuda {i}/{len(gpu_cases)}] {case[0]} on {torch.cuda.get_device_name()}")
            results += cuda_case(*case, rounds=rounds)
    else:
        log("no CUDA device: CUDA cases skipped")

    log("")
    log("GB/s and ratio: best round of each side; paired: median over rounds of base/kvdepot timed back to back")
    log(f"{'case':68s} {'op':8s} {'chunk':>8s} {'GB/s':>6s} {'base':>6s} {'ratio':>6s} {'paired':>6s}  target")
    for case_name, op, size, rate, base_rate, ratio, paired in results:
        mark = "ok" if ratio >= TARGET else "BELOW"
        mib = size / 2**20
        log(f"{case_name:68s} {op:8s} {mib:6.1f}Mi {rate:6.2f} {base_rate:6.2f} {ratio:6.2f} {paired:6.2f}  {mark}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
