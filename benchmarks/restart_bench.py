"""Restarts on a kept pool: how soon a restarted `kvdepot serve` answers, and what it still hits.

For each pool size (file-backed, in a directory on disk, so pools larger than RAM fit):

1. Fill: a `kvdepot serve` is filled to ~90% with committed chunks, stored as prompts of
   `--prompt-chunks` chunks under one salt (each chunk's bytes a function of its key, so a hit
   is checked byte for byte). Then the server is stopped (SIGTERM; `--kill`: SIGKILL) once
   its journal has every commit on file (`pool_journal_written` stops growing).
2. Restart: the same server is started again on the same pool and adopts it. Measured: wall
   time from starting the process to the first answered lookup of a stored prompt, and the
   server's own `pool_adopt_seconds`, chunks and bytes adopted (GB/s: bytes adopted over that
   time). Baseline, in the same run: the same start with `--fresh-pool`, of a server of the
   same capacity on a kept pool of its own (another address, so the filled pool stays). The
   two alternate for `--repeat` rounds, each restart after a stop like the first, so that
   the noise of this shared machine lands on both; the table has the medians and the median
   of the per-round ratios. `--cold` pushes the pool out of the page cache before each
   restart (a pool larger than RAM mostly is anyway).
3. Hits: `--requests` prompt lookups before the stop, and the first as many after the restart
   (the same prompts, in the same order): hit ratio (hit chunks / asked chunks) and median
   lookup round trip. Every `--verify-every`th request reads its hits through `PoolMapping`
   and compares them byte for byte (not timed). A kept pool's hit is answered from the index
   and its bytes are read by the engine from the pool; a disk tier's hit is copied into the
   pool before the lookup is answered, so its round trip includes that read.
4. Disk tier only (sizes up to `--disk-only-max`): `--no-keep-pool --disk-dir` with twice
   the size of disk tier, filled the same way; stopped once the write-behind has written
   every chunk; restarted (RAM empty, the disk tier rebuilds its index from the files); the
   same figures. Its baseline is a start of the same server on an empty disk directory. A
   lookup reads its misses back from the disk within `--tier-deadline` (0.5 s by default)
   and counts them as hits; a prompt that comes back short is looked up once more, as a
   connector does at its next scheduling step (the round trip counts both).

The baseline (a fresh start of the same capacity) maps a pool of its own beside the kept one:
a size without twice its capacity free runs without it (the restarts alone).

Run: python benchmarks/restart_bench.py [--quick] [--sizes 1GiB,16GiB,64GiB] [--pool-dir DIR]
     [--chunk-mib 2] [--repeat 3] [--kill] [--cold]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import attrs
import structlog

sys.path.insert(0, str(Path(__file__).parent))
from _util import drop_page_cache, progress, table
from kvdepot.core import SLOT_HEADER_BYTES
from kvdepot.server import PoolMapping, fetch_stats
from kvdepot.transport import CacheClient

T = 30.0  # seconds any one request may take
FILL = 0.90  # share of the pool's slots filled with committed chunks
PAGE = 64 << 20  # --page-size: whole 2 MiB slots, 32 to a page
SALT = "restart-bench"
BATCH_PROMPTS = 8  # prompts per Reserve message while filling
START_TIMEOUT = 600.0  # a restart adopting 64 GiB from disk may take minutes
GIB = 1 << 30
PROBE = hashlib.sha256(b"restart-bench probe").digest()  # a key never stored


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?)?\s*", text, re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 16GiB)")
    unit = (match.group(2) or "B")[0].upper()
    return int(float(match.group(1)) * {"B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[unit])


def show_size(size: int) -> str:
    return f"{size / GIB:.3g} GiB" if size >= GIB else f"{size >> 20} MiB"


def payload(key: bytes, size: int) -> bytes:
    """A chunk's bytes: its key's digest, repeated."""
    return (hashlib.sha256(key).digest() * (size // 32 + 1))[:size]


def write_payload(view: memoryview, key: bytes) -> None:
    """`payload(key, len(view))` straight into a slot: the digest, then doubling copies of it."""
    view[:32] = hashlib.sha256(key).digest()
    done = 32
    while done < len(view):
        step = min(done, len(view) - done)
        view[done : done + step] = view[:step]
        done += step


def prompt_keys(prompt: int, chunks: int) -> list[bytes]:
    return [hashlib.sha256(b"restart-bench|%d|%d" % (prompt, i)).digest() for i in range(chunks)]


class Server:
    """One `kvdepot serve` process, started without waiting; its stderr kept to say why it failed."""

    started_procs: list[subprocess.Popen[bytes]] = []  # every one, to kill whatever is left at the end

    def __init__(self, workdir: Path, pool_dir: Path, name: str, capacity: int, *flags: str) -> None:
        self.address = f"ipc://{workdir}/{name}.sock"
        self.socket = workdir / f"{name}.sock"
        self.log = workdir / f"{name}.log"
        cmd = [sys.executable, "-m", "kvdepot.server._cli", "serve", "--address", self.address]
        cmd += ["--pool-dir", str(pool_dir), "--capacity", str(capacity), "--page-size", str(PAGE)]
        cmd += ["--no-metrics", "--settings-file", "none", "--log-level", "warning", *flags]
        with contextlib.suppress(FileNotFoundError):
            self.socket.unlink()  # a killed server's: the next one's socket is then the only one
        with open(self.log, "wb") as log:
            self.started = time.perf_counter()
            self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
        Server.started_procs.append(self.proc)

    def why(self) -> str:
        lines = [ln for ln in self.log.read_text(errors="replace").splitlines() if "RuntimeWarning" not in ln]
        return (lines[-1] if lines else "").strip() or f"exit code {self.proc.returncode}"

    def first_lookup(self, keys: list[bytes]) -> float:
        """Seconds from the start to the first answered lookup of `keys`; `RuntimeError` with the
        server's last words when it exits first. Connects once its socket exists (a client of a
        socket not there yet would back off for up to a second between tries)."""
        deadline = self.started + START_TIMEOUT
        while not self.socket.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(self.why())
            if time.perf_counter() > deadline:
                raise RuntimeError(f"no socket after {START_TIMEOUT:.0f} s")
            time.sleep(0.002)
        with CacheClient(self.address, timeout=START_TIMEOUT) as client:
            (res,) = client.lookup([(SALT, keys)]).result(START_TIMEOUT).results
            took = time.perf_counter() - self.started
            if res.lease_id:
                client.release([res.lease_id]).result(T)
        return took

    def extra(self) -> dict:
        return fetch_stats(self.address, timeout=T).extra

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(120)


@attrs.frozen
class Requests:
    """What `--requests` prompt lookups found."""

    hits: int
    asked: int
    median_s: float
    read_back: int  # hit chunks read back from a tier below RAM
    retried: int  # prompts looked up twice (short the first time)

    @property
    def ratio(self) -> float:
        return self.hits / self.asked if self.asked else 0.0


def fill(address: str, capacity: int, chunk: int, per_prompt: int, label: str) -> int:
    """Store prompts until FILL of the pool's slots hold committed chunks; the prompts stored."""
    slot = -(-(chunk + SLOT_HEADER_BYTES) // 64) * 64
    prompts = int(FILL * (capacity // PAGE) * (PAGE // slot)) // per_prompt
    started = last = time.perf_counter()
    stored = 0
    with CacheClient(address, timeout=T, client_name="restart-bench") as client:
        reg = client.register("restart-bench", 256, chunk).result(T)
        with PoolMapping(reg.pool.path, reg.pool.size) as pool:
            batches = [range(p, min(prompts, p + BATCH_PROMPTS)) for p in range(0, prompts, BATCH_PROMPTS)]

            def reserve(batch: range):
                keys = [k for p in batch for k in prompt_keys(p, per_prompt)]
                return keys, client.reserve(SALT, keys, chunk)

            pending = reserve(batches[0])
            commits = []
            for n, batch in enumerate(batches):
                keys, future = pending
                res = future.result(T)
                if n + 1 < len(batches):
                    pending = reserve(batches[n + 1])  # in flight while this batch is copied
                for s in res.slots:
                    write_payload(pool.view(s.offset, chunk), keys[s.index])
                commits.append(client.commit(res.reservation_id))
                if len(res.slots) < len(keys):
                    raise RuntimeError(f"the pool took {len(res.slots)} of {len(keys)} chunks: is it full?")
                stored += len(batch)
                if time.perf_counter() - last > 5 or stored == prompts:
                    last = time.perf_counter()
                    done = stored * per_prompt * chunk
                    rate = done / (last - started)
                    progress(
                        f"fill {label}: {show_size(done)} of {show_size(prompts * per_prompt * chunk)}"
                        f" ({stored / prompts:.0%}), {rate / 1e6:.0f} MB/s"
                    )
            committed = sum(f.result(T).committed for f in commits)
    assert committed == prompts * per_prompt, f"{committed} of {prompts * per_prompt} chunks committed"
    return prompts


def settle(server: Server, what: str, done: Callable[[dict], bool]) -> None:
    """Wait until `done(stats extra)` holds and the figures stop moving for a second."""
    before = None
    started = time.perf_counter()
    while True:
        extra = server.extra()
        now = {k: v for k, v in extra.items() if k.startswith(("pool_journal", "tier:disk:"))}
        if done(extra) and now == before:
            progress(f"{what} settled after {time.perf_counter() - started:.1f} s")
            return
        before = now
        time.sleep(1.0)


def run_requests(address: str, prompts: list[int], chunk: int, per_prompt: int, verify_every: int) -> Requests:
    """Look up each prompt once (twice when it comes back short), checking some hits' bytes."""
    hits = asked = read_back = retried = 0
    took: list[float] = []
    with CacheClient(address, timeout=T, client_name="restart-bench") as client:
        reg = client.register("restart-bench", 256, chunk).result(T)
        with PoolMapping(reg.pool.path, reg.pool.size, writable=False) as pool:
            for n, prompt in enumerate(prompts):
                keys = prompt_keys(prompt, per_prompt)
                start = time.perf_counter()
                (res,) = client.lookup([(SALT, keys)]).result(T).results
                if res.num_hits < len(keys):  # as a connector would at its next step
                    retried += 1
                    if res.lease_id:
                        client.release([res.lease_id])
                    (res,) = client.lookup([(SALT, keys)]).result(T).results
                took.append(time.perf_counter() - start)
                hits += res.num_hits
                asked += len(keys)
                read_back += sum(res.read_back.values())
                if n % verify_every == 0:
                    for s, key in zip(res.slots, keys, strict=False):
                        if pool.read(s.offset, s.length) != payload(key, chunk):
                            raise RuntimeError(f"wrong bytes for prompt {prompt}, chunk {key.hex()[:12]}")
                if res.lease_id:
                    client.release([res.lease_id])
            client.ping().result(T)  # the releases are done
    return Requests(hits, asked, statistics.median(took), read_back, retried)


@attrs.frozen
class Args:
    workdir: Path
    pool_dir: Path
    chunk: int
    per_prompt: int
    requests: int
    verify_every: int
    sig: int
    cold: bool
    repeat: int


def pick(prompts: int, a: Args, size: int) -> tuple[list[int], int]:
    """The prompts asked before and after the restart, and one more to probe with (not among
    them when there are enough: a probe read back from a tier would make its prompt a RAM hit)."""
    order = random.Random(size).sample(range(prompts), min(a.requests + 1, prompts))
    return order[: a.requests], order[-1]


def uncache(a: Args) -> None:
    """With `--cold`, push the pool and the disk tier's files out of the page cache."""
    if a.cold:
        drop_page_cache([*a.pool_dir.glob("*.pool"), *(a.pool_dir / "disk" / "objects").rglob("*")])


@attrs.frozen
class Starts:
    """Seconds to the first answered lookup: restarts and fresh starts, paired; the restarts'
    stats figures; the first `--requests` lookups after the first restart."""

    restart: list[float]
    fresh: list[float]
    extras: list[dict]
    after: Requests


def paired_starts(
    a: Args, restart: Callable[[], Server], fresh: Callable[[], Server] | None, asked: list[int], probe: list[bytes]
) -> Starts:
    """`a.repeat` rounds of: restart (its server was stopped with `a.sig`), then a fresh start of
    an empty server of the same capacity, each timed to its first answered lookup of `probe`.
    Interleaved, so that the noise of this shared machine lands on both. The `asked` prompts
    are looked up right after the first restart. Without `fresh` (no room for its pool beside
    the kept one), the restarts alone."""
    restarts: list[float] = []
    fresh_starts: list[float] = []
    extras: list[dict] = []
    after = None
    for n in range(a.repeat):
        server = restart()
        restarts.append(server.first_lookup(probe))
        extras.append(server.extra())
        if after is None:
            after = run_requests(server.address, asked, a.chunk, a.per_prompt, a.verify_every)
        server.stop(a.sig)
        uncache(a)
        if fresh is not None:
            empty = fresh()
            fresh_starts.append(empty.first_lookup(probe))
            empty.stop()
        baseline = f"fresh start {fresh_starts[-1]:.2f} s" if fresh_starts else "no fresh start (no room)"
        progress(f"round {n + 1}/{a.repeat}: restart {restarts[-1]:.2f} s, {baseline}")
    assert after is not None
    return Starts(restarts, fresh_starts, extras, after)


def row(
    label: str, chunks: str, starts: Starts, before: Requests, adopt: tuple[str, str] = ("-", "-")
) -> tuple[str, ...]:
    restart_s = statistics.median(starts.restart)
    fresh_s = f"{statistics.median(starts.fresh):.2f}" if starts.fresh else "-"
    ratios = [r / f for r, f in zip(starts.restart, starts.fresh, strict=False)]
    return (
        label,
        chunks,
        f"{restart_s:.2f}",
        *adopt,
        fresh_s,
        f"{statistics.median(ratios):.1f}x" if ratios else "-",
        f"{before.ratio:.0%} / {starts.after.ratio:.0%}",
        f"{before.median_s * 1e3:.2f} / {starts.after.median_s * 1e3:.2f}",
    )


def kept_pool_run(a: Args, size: int, *, baseline: bool = True) -> tuple[str, ...]:
    """Steps 1-3 on a kept pool of `size`: one table row."""
    label = show_size(size)
    kept_files: set[str] = set()

    def others_removed() -> None:
        """Delete the fresh starts' pools: the next fresh start needs its capacity free again."""
        for path in a.pool_dir.glob("kvdepot-*"):
            if kept_files and path.name not in kept_files:
                path.unlink()

    def kept() -> Server:
        others_removed()
        return Server(a.workdir, a.pool_dir, "kept", size)

    def fresh() -> Server:
        """`--fresh-pool` on a kept pool of another address (the same start, on an empty pool)."""
        others_removed()
        return Server(a.workdir, a.pool_dir, "fresh", size, "--fresh-pool")

    server = kept()  # makes the kept pool (fallocated), then a restart on it while it is empty
    server.first_lookup([PROBE])
    kept_files.update(p.name for p in a.pool_dir.glob("kvdepot-*"))
    server.stop()
    server = kept()
    try:
        server.first_lookup([PROBE])
    except RuntimeError as exc:
        return (label, "-", f"a restart on the empty kept pool failed: {exc}")
    prompts = fill(server.address, size, a.chunk, a.per_prompt, label)
    settle(server, f"{label}: journal", lambda e: not e.get("pool_journal_behind"))
    asked, probe = pick(prompts, a, size)
    before = run_requests(server.address, asked, a.chunk, a.per_prompt, a.verify_every)
    server.stop(a.sig)
    uncache(a)
    progress(f"{label}: stopped with {signal.Signals(a.sig).name}; restarting on the kept pool")
    try:
        starts = paired_starts(a, kept, fresh if baseline else None, asked, prompt_keys(probe, a.per_prompt))
    except RuntimeError as exc:
        return (label, str(prompts * a.per_prompt), f"a start failed: {exc}")
    for n, extra in enumerate(starts.extras):
        dropped = {k: v for k, v in extra.items() if k.startswith("pool_dropped_") and v}
        progress(
            f"{label}: restart {n + 1} adopted {extra['pool_adopted_chunks']} chunks "
            f"({show_size(extra['pool_adopted_bytes'])}) in {extra['pool_adopt_seconds']:.2f} s; "
            f"dropped {dropped or 0}; fresh reason: {extra['pool_fresh_reason']}"
        )
    chunks, adopted = starts.extras[0]["pool_adopted_chunks"], starts.extras[0]["pool_adopted_bytes"]
    seconds = statistics.median(e["pool_adopt_seconds"] for e in starts.extras)
    adopt = (f"{seconds:.2f}", f"{adopted / seconds / 1e9:.2f}" if seconds else "-")
    return row(label, f"{prompts * a.per_prompt} ({chunks})", starts, before, adopt)


def disk_only_run(a: Args, size: int) -> tuple[str, ...]:
    """Step 4: the same on a pool for one run only, with a disk tier below it."""
    label = f"{show_size(size)} disk tier only"

    def make(name: str, disk: str) -> Callable[[], Server]:
        flags = ("--no-keep-pool", "--disk-dir", str(a.pool_dir / disk), "--disk-capacity", str(2 * size))
        return lambda: Server(a.workdir, a.pool_dir, name, size, *flags)

    server = make("disk", "disk")()
    server.first_lookup([PROBE])
    prompts = fill(server.address, size, a.chunk, a.per_prompt, label)
    chunks = prompts * a.per_prompt
    figures = ("writes", "failed_writes", "write_dropped", "write_skipped")

    def drained(extra: dict) -> bool:
        done = sum(extra[f"tier:disk:{k}"] for k in figures)
        return extra["tier:disk:write_queue"] == 0 and done >= chunks

    settle(server, f"{label}: write-behind", drained)
    extra = server.extra()
    on_disk = extra["tier:disk:objects"]
    progress(f"{label}: {on_disk} chunks on disk; " + ", ".join(f"{k} {extra['tier:disk:' + k]}" for k in figures))
    asked, probe = pick(prompts, a, size)
    before = run_requests(server.address, asked, a.chunk, a.per_prompt, a.verify_every)
    server.stop(a.sig)
    uncache(a)
    progress(f"{label}: stopped with {signal.Signals(a.sig).name}; restarting on the disk tier")
    starts = paired_starts(
        a, make("disk", "disk"), make("empty", "empty-disk"), asked, prompt_keys(probe, a.per_prompt)
    )
    extra = starts.extras[0]
    progress(
        f"{label}: after the first restart {starts.after.read_back} chunks read back from disk, "
        f"{starts.after.retried} prompts looked up twice, tier_read_late {extra['tier_read_late']}"
    )
    return row(label, f"{chunks} ({on_disk} on disk)", starts, before)


@contextlib.contextmanager
def scratch(parent: Path | None) -> Iterator[tuple[Path, Path]]:
    """A socket directory under /tmp and a pool directory on disk, both removed at the end."""
    workdir = Path(tempfile.mkdtemp(prefix="kvdepot-restart-"))
    pool_dir = Path(tempfile.mkdtemp(prefix="kvdepot-restart-bench-", dir=parent or "/var/tmp"))
    try:
        yield workdir, pool_dir
    finally:
        for proc in Server.started_procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
        shutil.rmtree(pool_dir, ignore_errors=True)
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 GiB only (a smoke run, about a minute)")
    parser.add_argument("--sizes", default="1GiB,16GiB,64GiB", help="pool sizes, comma-separated")
    parser.add_argument("--pool-dir", type=Path, default=None, help="a fresh directory is made in it (/var/tmp)")
    parser.add_argument("--chunk-mib", type=float, default=2.0, help="chunk size, its slot header included")
    parser.add_argument("--prompt-chunks", type=int, default=4, help="chunks per prompt")
    parser.add_argument("--requests", type=int, default=100, help="prompt lookups before and after the restart")
    parser.add_argument("--verify-every", type=int, default=10, help="check the bytes of every Nth request's hits")
    parser.add_argument("--repeat", type=int, default=3, help="starts timed, fresh and restarted (the median)")
    parser.add_argument("--kill", action="store_true", help="stop with SIGKILL instead of SIGTERM")
    parser.add_argument("--cold", action="store_true", help="drop the pool from the page cache before restarting")
    parser.add_argument("--disk-only-max", type=parse_size, default=GIB, help="sizes with the disk-tier comparison")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))  # warnings only
    sizes = [GIB] if args.quick else [parse_size(s) for s in args.sizes.split(",")]
    chunk = int(args.chunk_mib * (1 << 20)) - SLOT_HEADER_BYTES  # so that slots fill pages exactly
    rows: list[tuple[str, ...]] = []
    with scratch(args.pool_dir) as (workdir, pool_dir):
        sig = signal.SIGKILL if args.kill else signal.SIGTERM
        a = Args(
            workdir, pool_dir, chunk, args.prompt_chunks, args.requests, args.verify_every, sig, args.cold, args.repeat
        )
        for size in sizes:
            free = shutil.disk_usage(pool_dir).free
            if size + GIB > free:
                needs = f"needs {show_size(size + GIB)} free in {pool_dir}, has {show_size(free)}"
                print(f"{show_size(size)} skipped: {needs}")
                continue
            # The baseline, a fresh start of the same capacity, maps a pool of its own beside the kept one.
            baseline = 2 * size + GIB <= free
            if not baseline:
                print(f"{show_size(size)}: no fresh-start baseline (it needs {show_size(2 * size + GIB)} free)")
            rows.append(kept_pool_run(a, size, baseline=baseline))
            for path in pool_dir.glob("kvdepot-*"):  # this size's kept pool and journal
                path.unlink()
            if size <= args.disk_only_max:
                rows.append(disk_only_run(a, size))
                for name in ("disk", "empty-disk"):
                    shutil.rmtree(pool_dir / name, ignore_errors=True)
    stop = "SIGKILL" if args.kill else "SIGTERM"
    cache = ", pool dropped from the page cache" if args.cold else ""
    table(
        f"kvdepot serve restarted on a file-backed pool after {stop}{cache}: {args.chunk_mib:g} MiB chunks, "
        f"{args.prompt_chunks} per prompt, {args.requests} prompt lookups before/after",
        [r + ("",) * (9 - len(r)) for r in rows],
        (
            "pool",
            "chunks (adopted)",
            "restart s",
            "adopt s",
            "adopt GB/s",
            "fresh start s",
            "restart/fresh",
            "hits before / after",
            "lookup ms before / after",
        ),
    )
    print(
        "\nrestart s, fresh start s: from starting the process to the first answered lookup (a fresh start: "
        "--fresh-pool on an empty pool of the same capacity; disk tier only: the same server on an empty disk "
        "directory), medians of the rounds; restart/fresh: the median of the rounds' ratios; adopt s: the "
        "server's pool_adopt_seconds; hits: hit chunks / asked chunks; disk tier only: a prompt short after its "
        "lookup (the tier's reads past --tier-deadline) is looked up once more and its round trip counts both."
    )


if __name__ == "__main__":
    main()
