"""Small helpers shared by the benchmark scripts: timing, a readable table, a server process."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path


def best_of(fn: Callable[[], object], *, repeat: int = 7, number: int = 100) -> float:
    """Seconds per call: the median of ``repeat`` runs of ``number`` calls each."""
    runs = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        runs.append((time.perf_counter() - start) / number)
    return statistics.median(runs)


def progress(message: str) -> None:
    print(f"  .. {message}", flush=True)


def table(title: str, rows: list[tuple[str, ...]], header: tuple[str, ...]) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    print(f"\n{title}")
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))
    print(line)
    print("-" * len(line))
    for row in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)))


def drop_page_cache(paths: Iterable[Path]) -> int:
    """Writes out each file among `paths` and drops it from the page cache (posix_fadvise
    DONTNEED: these files alone), so that its next read comes from the device; answers how many
    files (other paths are passed over)."""
    count = 0
    for path in paths:
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            count += 1
    return count


def start_server(workdir: Path, *args: str, name: str = "kvdepot") -> tuple[subprocess.Popen[bytes], str]:
    """A `kvdepot serve` process on ``ipc://WORKDIR/NAME.sock`` (its pool in ``workdir``, for this
    run only, no metrics, warnings only, and ``args``), once it answers; with its address."""
    from kvdepot.server import fetch_stats

    address = f"ipc://{workdir}/{name}.sock"
    cmd = [sys.executable, "-m", "kvdepot.server._cli", "serve", "--address", address, "--pool-dir", str(workdir)]
    cmd += ["--no-metrics", "--log-level", "warning", "--no-keep-pool", *args]  # a fresh pool each start
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while True:
        try:
            fetch_stats(address, timeout=0.5)
            return proc, address
        except Exception:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise
            time.sleep(0.1)
