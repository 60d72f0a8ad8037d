"""kvdepot.gpu: gather and scatter of realistic chunks against a plain copy of the same bytes.

CPU: one chunk per call between a paged KV cache and a pool slot, against a plain
memcpy (libc, through `ctypes.memmove`, as in server_bench.py) of the same number of
bytes between the same two memory areas, measured in the same run and interleaved with
it. torch's multi-threaded `copy_` of the same bytes is timed alongside, as a stricter
second reference. Everything walks a working set far larger than the CPU caches, so
every copy reads and writes cold memory as it would in a server. CUDA (when present):
the same against a raw pinned `cudaMemcpyAsync` of the same bytes.

The KV caches sit on transparent huge pages (docs/gpu.md: no gain at vLLM CPU's block size)
(`THP_MEM_ALLOC_ENABLE=1`, read by torch's CPU allocator at its first allocation, so it
is set here before torch is imported); `--no-thp` measures without them. Blocks of a few
KiB at random addresses otherwise pay a TLB miss each.

Run: python benchmarks/gpu_bench.py [--quick] [--no-thp]
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import sys
import time
from collections.abc import Callable

if "--no-thp" not in sys.argv:
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

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
    op: Callable[[int], None], bases: dict[str, Callable[[int], None]], rounds: int, reps: int
) -> tuple[float, dict[str, float], dict[str, float]]:
    """(best seconds per call of `op`, of each base, median of paired ratios base/op per base).

    Each round times `op` and every base back to back, rotating which goes first, so a
    slow spell of a shared machine hits all sides of a round alike; the median of the
    per-round ratios is the comparison, the best times give the absolute rates.
    """
    fns = {"op": op, **bases}
    for fn in fns.values():
        fn(0)
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    i = 0
    for round_ in range(rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            fn = fns[name]
            start = time.perf_counter()
            for _ in range(reps):
                fn(i)
                i += 1
            times[name].append((time.perf_counter() - start) / reps)
    best = {name: min(times[name]) for name in bases}
    paired = {name: statistics.median(b / o for b, o in zip(times[name], times["op"], strict=True)) for name in bases}
    return min(times["op"]), best, paired


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

    def pieces(i: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(KV cache bytes, pool bytes) pairs, contiguous on both sides, adding up to one call's bytes."""
        if batch > 1:
            j = (i * batch) % (slots - batch)
            return [(whole[((i * 7) % (slots - batch)) * size :][: batch * size], pool[j * size : (j + batch) * size])]
        j = i % slots
        out, done, k = [], 0, i
        while done < size:  # per-layer tensors may hold less than a chunk: go on in the next layers
            src = kv_range(k)[: size - done]
            out.append((src, pool[j * size + done : j * size + done + src.numel()]))
            done += src.numel()
            k += 1
        return out

    memmove = ctypes.memmove

    def memcpy(i: int) -> None:
        for kv_bytes, pool_bytes in pieces(i):
            memmove(pool_bytes.data_ptr(), kv_bytes.data_ptr(), kv_bytes.numel())

    def memcpy_back(i: int) -> None:
        for kv_bytes, pool_bytes in pieces(i):
            memmove(kv_bytes.data_ptr(), pool_bytes.data_ptr(), kv_bytes.numel())

    def torch_copy(i: int) -> None:
        for kv_bytes, pool_bytes in pieces(i):
            pool_bytes.copy_(kv_bytes)

    def torch_copy_back(i: int) -> None:
        for kv_bytes, pool_bytes in pieces(i):
            kv_bytes.copy_(pool_bytes)

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
            for op, call, bases in (
                ("gather", gather_call, {"memcpy": memcpy, "copy_": torch_copy}),
                ("scatter", scatter_call, {"memcpy": memcpy_back, "copy_": torch_copy_back}),
            ):
                t, best, paired = interleaved(lambda i, ids=ids, call=call: call(i, ids), bases, rounds, reps)
                moved = size * batch
                row = (
                    f"{name}, {ids_name}",
                    op,
                    moved,
                    moved / t / 1e9,
                    moved / best["memcpy"] / 1e9,
                    best["memcpy"] / t,
                    paired["memcpy"],
                    paired["copy_"],
                )
                log(
                    f"  {row[0]:52s} {op:8s} {row[3]:6.2f} GB/s vs memcpy {row[4]:6.2f} GB/s  "
                    f"ratio {row[5]:.2f} (paired median {row[6]:.2f}; vs torch copy_ {row[7]:.2f})"
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
                ratio = base[op] / t
                row = (f"{name}, {method}", op, size, size / t / 1e9, size / base[op] / 1e9, ratio, ratio, float("nan"))
                rate, base_rate = row[3], row[4]
                log(f"  {row[0]:52s} {op:8s} {rate:6.2f} GB/s vs raw {base_rate:6.2f} GB/s  ratio {row[5]:.2f}")
                results.append(row)
    return results


def _huge_pages_kib() -> int:
    """AnonHugePages of this process, in KiB (0 where the kernel does not say)."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (noisier)")
    parser.add_argument("--no-thp", action="store_true", help="KV caches on ordinary 4 KiB pages")
    args = parser.parse_args()
    rounds = 10 if args.quick else 60
    threads = torch.get_num_threads()
    log(f"kvdepot.gpu benchmark: torch {torch.__version__}, {threads} CPU threads, target ratio {TARGET}")
    probe = torch.empty(8 << 20, dtype=torch.uint8).fill_(0)
    log(
        f"KV caches on transparent huge pages: {'yes' if _huge_pages_kib() >= 4096 else 'no'}"
        f" (THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', 'unset')}, --no-thp to turn off)"
    )
    del probe
    results = []
    cases = [
        # name, layers, heads, tokens, head size, blocks per chunk, one shared storage, chunks per call
        ("CPU 16 blocks x 2 MiB (32 layers), one storage", 32, 8, 16, 128, 16, True, 1),
        ("CPU 16 blocks x 2 MiB (32 layers), tensor per layer", 32, 8, 16, 128, 16, False, 1),
        ("CPU 64 blocks x 32 KiB (8 layers), one storage", 8, 1, 16, 64, 64, True, 1),
        ("CPU 64 blocks x 32 KiB (8 layers), one storage, 8 chunks/call", 8, 1, 16, 64, 64, True, 8),
        ("CPU 64 blocks x 32 KiB (8 layers), tensor per layer", 8, 1, 16, 64, 64, False, 1),
        # vLLM's CPU backend: 128-token blocks, so a layer-block of 1 KV head of 64 is 32 KiB
        ("CPU 8 blocks x 256 KiB (8 layers, 128-token blocks), one storage", 8, 1, 128, 64, 8, True, 1),
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
    log(
        "GB/s and ratio: best round of each side against a plain memcpy (CUDA: raw cudaMemcpyAsync); paired:"
        " median over rounds of base/kvdepot timed back to back; copy_: the same against torch's threaded copy_"
    )
    log(
        f"{'case':68s} {'op':8s} {'chunk':>8s} {'GB/s':>6s} {'base':>6s} {'ratio':>6s} {'paired':>6s}"
        f" {'copy_':>6s}  target"
    )
    for case_name, op, size, rate, base_rate, ratio, paired, vs_copy in results:
        mark = "ok" if paired >= TARGET else "BELOW"
        mib = size / 2**20
        log(
            f"{case_name:68s} {op:8s} {mib:6.1f}Mi {rate:6.2f} {base_rate:6.2f} {ratio:6.2f} {paired:6.2f}"
            f" {vs_copy:6.2f}  {mark}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
