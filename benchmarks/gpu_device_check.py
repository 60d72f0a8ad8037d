"""The CUDA data path on a real GPU, checked in one command: tests, bandwidth, overlap, a server round trip.

kvdepot's CUDA copier (`kvdepot.gpu.CudaCopier`: a side stream, the pool registered with
cudaHostRegister, a Triton kernel and a DMA path) is checked here on whatever GPU machine
is at hand, in one run of a few minutes, and rehearsed on the CPU (`--dry-run`, which CI
runs) so that a broken bundle or script never costs GPU time. docs/gpu.md, "The device
check", says how to run it and holds the results.

Three commands:

    python benchmarks/gpu_device_check.py bundle     # here, with PyPI: wheels into .devcheck/
    bash benchmarks/gpu_device_check.sh              # there, from the repository root
    python benchmarks/gpu_device_check.py --dry-run  # here: the same run on the CPU

The GPU machine has Python 3.12, torch (CUDA), Triton, pytest, hypothesis, numpy, attrs,
xxhash and prometheus-client, and no network. `bundle` downloads what it lacks as wheels for
that Python (pyzmq, msgspec, structlog, at the versions installed here) and builds wheels of
kvdepot-core, kvdepot-transport and kvdepot-server. kvdepot-gpu is built *there*, from the
source that travels with the repository: its C extension (the CPU copy) must match that
machine's Python, and this one has another; Triton already needs the same C compiler and
Python headers there to build its launcher. Where the build fails, the CUDA steps still
run from the source tree (the CPU copy's tests then fail and say why).

Each run installs into a scratch directory (never into the machine's Python), then runs the
steps in a child process that sees only that directory and the machine's own packages:

1. `env`: Python, torch, CUDA, driver, Triton, the GPU, and where each kvdepot module came from.
2. `tests`: `pytest -m gpu packages/gpu/tests` (the CUDA path against the plain-torch
   reference, every layout and dtype, stream ordering), then the rest of the package's tests.
3. `bandwidth`: Llama-3-8B chunks (32 layers, 8 KV heads, head size 128, bf16, 16-token
   blocks, 256-token chunks: 32 MiB) gathered from random GPU blocks into the registered
   pool and scattered back, by each method (Triton, DMA), against a raw cudaMemcpyAsync of
   the same bytes between a GPU buffer and the same pool, in the same run: gather alone,
   scatter alone, then both at once.
4. `overlap`: bf16 matrix products on the compute stream, alone and while the copier
   gathers and scatters on its side stream: the products' slowdown.
5. `roundtrip`: a real `kvdepot serve`; GPU blocks into its pool (Reserve, gather, Commit)
   and back into other GPU blocks (Lookup, scatter, Release): bytes identical, GB/s.
6. `v2`: Model Runner V2's order, the guarantee kvdepot's worker gives it (`_stores.py`): a
   step's forward pass writes blocks on the compute stream; at the step's end the store's
   gather is queued on the copier's side stream and the compute stream waits for it (no host
   wait); the next step at once zeroes those blocks and writes another request's KV into them
   on the compute stream (V2's `update_requests`, then its forward); the commit follows on a
   host thread once the copy is done. Every committed chunk must hold the first step's bytes,
   through a real `kvdepot serve` and back; and the compute stream's delay for the copy.

Results go to `$OUT` (or `--out`): `gpu_check.json`, `gpu_check.md` (the table for
docs/gpu.md) and `gpu_check.log`. The exit status is 1 when a step failed (an error, a
failed test, bytes that differ); figures below their targets are marked in the table, not
failed. On the CPU (`--dry-run`, or no CUDA device) steps 3, 5 and 6 run at a small size on the
CPU copier so their code runs, and step 4 is skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BUNDLE = ROOT / ".devcheck"
# What the GPU machine lacks (docs/gpu.md); the rest of what kvdepot needs is there.
THIRD_PARTY = ("pyzmq", "msgspec", "structlog")
# kvdepot-gpu's build backend, for an offline build there (the machine's own may be older or absent).
BUILD_BACKEND = "setuptools"
CARRIED_PACKAGES = ("core", "transport", "server")
# The GPU machine's interpreter and platform, for `bundle`.
TARGET_PYTHON = "3.12"
TARGET_PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
STEPS = ("env", "tests", "v2", "bandwidth", "overlap", "roundtrip")
# Seconds a step needs at most on a GPU machine: a step is skipped when less is left of the budget.
STEP_SECONDS = {"env": 5, "tests": 60, "v2": 30, "bandwidth": 90, "overlap": 40, "roundtrip": 40}
BUDGET_S = 400.0  # the wrapper stops the run at 420 s
TARGETS = {"bandwidth": 0.90, "overlap": 0.05}
MIB = 1 << 20


def say(message: str) -> None:
    """Progress for the person watching; the log file keeps it too."""
    line = f"[{time.strftime('%H:%M:%S')}] {message}"
    print(line, flush=True)
    log_path = os.environ.get("KVDEPOT_CHECK_LOG")
    if log_path:
        with open(log_path, "a") as f:
            f.write(line + "\n")


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args], check=True)


# --- the bundle (here) ------------------------------------------------------------------


def make_bundle(bundle: Path, python: str = TARGET_PYTHON) -> dict[str, Any]:
    """Wheels of what the GPU machine lacks, for its Python, into `bundle`/wheels; returns the manifest."""
    wheels = bundle / "wheels"
    shutil.rmtree(bundle, ignore_errors=True)
    wheels.mkdir(parents=True)
    say(f"bundle: kvdepot wheels ({', '.join(CARRIED_PACKAGES)}) into {wheels}")
    pip("wheel", "--no-deps", "-w", str(wheels), *(str(ROOT / "packages" / p) for p in CARRIED_PACKAGES))
    pins = [_pin(name) for name in THIRD_PARTY]
    pip("download", "--no-deps", "--only-binary=:all:", "-d", str(wheels), f"{BUILD_BACKEND}=={_setuptools_version()}")
    say(f"bundle: {', '.join(pins)} for CPython {python}")
    platforms = [arg for p in TARGET_PLATFORMS for arg in ("--platform", p)]
    pip(
        "download", "--no-deps", "--only-binary=:all:", "--python-version", python, "--implementation", "cp",
        *platforms, "-d", str(wheels), *pins,
    )  # fmt: skip
    manifest = {"python": python, "pins": pins, "wheels": sorted(p.name for p in wheels.glob("*.whl"))}
    (bundle / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    say(f"bundle: {len(manifest['wheels'])} wheels, {sum(p.stat().st_size for p in wheels.iterdir()) / MIB:.1f} MiB")
    return manifest


def _pin(name: str) -> str:
    """`name==version` of the version installed here (the one kvdepot is tested with), else the newest."""
    try:
        return f"{name}=={metadata.version(name)}"
    except metadata.PackageNotFoundError:
        say(f"bundle: {name} is not installed in this interpreter: taking PyPI's newest")
        return name


def _setuptools_version() -> str:
    """The installed setuptools, if it can build kvdepot-gpu (its pyproject's floor), else that floor."""
    floor = "78.1.1"
    try:
        have = metadata.version("setuptools")
    except metadata.PackageNotFoundError:
        return floor
    return have if tuple(int(x) for x in have.split(".")[:2]) >= (77, 0) else floor


def check_bundle_for_target(bundle: Path, scratch: Path) -> None:
    """Install the bundle as the GPU machine's pip would see it (its Python, its platform), into a throwaway dir."""
    manifest = json.loads((bundle / "manifest.json").read_text())
    wheels = sorted(str(p) for p in (bundle / "wheels").glob("*.whl") if not p.name.startswith(BUILD_BACKEND))
    missing = [n for n in THIRD_PARTY if not any(Path(w).name.lower().startswith(n.lower()) for w in wheels)]
    if missing:
        raise SystemExit(f"the bundle lacks wheels of {missing}; run `python {Path(__file__).name} bundle` again")
    platforms = [arg for p in TARGET_PLATFORMS for arg in ("--platform", p)]
    pip(
        "install", "--no-index", "--no-deps", "--only-binary=:all:", "--python-version", manifest["python"],
        "--implementation", "cp", *platforms, "--target", str(scratch), *wheels,
    )  # fmt: skip
    say(f"bundle: all {len(wheels)} wheels install for CPython {manifest['python']} on {TARGET_PLATFORMS[0]}")


def host_wheels(bundle: Path, into: Path) -> list[str]:
    """For a dry run: the bundle's kvdepot wheels, and its third-party pins built for this interpreter."""
    into.mkdir(parents=True, exist_ok=True)
    manifest = json.loads((bundle / "manifest.json").read_text())
    pip("download", "--no-deps", "--only-binary=:all:", "-d", str(into), *manifest["pins"])
    kvdepot = [str(p) for p in (bundle / "wheels").glob("kvdepot_*.whl")]
    shutil.copy(next((bundle / "wheels").glob(f"{BUILD_BACKEND}-*.whl")), into)
    return kvdepot + sorted(str(p) for p in into.glob("*.whl"))


def install_site(site: Path, wheels: list[str]) -> dict[str, str]:
    """Build a kvdepot-gpu wheel from its source with this machine's compiler (offline: its build
    backend comes from the wheels), then install it and the other `wheels` into `site` in one go
    (pip --target replaces a namespace package's directory it finds there)."""
    built = site.parent / "gpu-wheel"
    links = sorted({str(Path(w).parent) for w in wheels})
    result = {"kvdepot_gpu": f"a wheel built on this machine from packages/gpu ({platform.python_version()})",
              "extra_path": ""}  # fmt: skip
    try:
        find = [arg for link in links for arg in ("--find-links", link)]
        pip("wheel", "--no-index", *find, "--no-deps", "-w", str(built), str(ROOT / "packages/gpu"))
        wheels = [*wheels, *(str(p) for p in built.glob("kvdepot_gpu-*.whl"))]
    except subprocess.CalledProcessError as exc:
        say(f"site: building kvdepot-gpu failed ({exc}); its CUDA path runs from the source tree, without the CPU copy")
        result = {
            "kvdepot_gpu": "source tree (its build failed: see the log)",
            "extra_path": str(ROOT / "packages/gpu/src"),
        }
    wheels = [w for w in wheels if not Path(w).name.startswith(BUILD_BACKEND)]
    pip("install", "--no-index", "--no-deps", "--no-compile", "--target", str(site), *wheels)
    say(f"site: {len(wheels)} wheels installed into {site}; kvdepot-gpu: {result['kvdepot_gpu']}")
    return result


# --- the steps (in the child process) ----------------------------------------------------


class _Tee:
    """A file that writes to a stream and appends to a log file."""

    def __init__(self, stream: Any, path: str) -> None:
        self.stream, self.path = stream, path

    def write(self, text: str) -> int:
        with open(self.path, "a") as f:
            f.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()


class Report:
    """Every step's status and rows, written out as JSON and Markdown after each step."""

    def __init__(self, out: Path, meta: dict[str, Any]) -> None:
        self.out = out
        self.data: dict[str, Any] = {"meta": meta, "targets": TARGETS, "steps": {}}

    def step(self, name: str, status: str, **fields: Any) -> None:
        self.data["steps"][name] = {"status": status, **fields}
        self.write()

    def write(self) -> None:
        (self.out / "gpu_check.json").write_text(json.dumps(self.data, indent=2, default=str) + "\n")
        (self.out / "gpu_check.md").write_text(markdown(self.data))

    @property
    def failed(self) -> list[str]:
        return [name for name, step in self.data["steps"].items() if step["status"] == "failed"]


def markdown(data: dict[str, Any]) -> str:
    meta, steps = data["meta"], data["steps"]
    lines = ["# kvdepot GPU device check", ""]
    lines += [f"- {key}: {value}" for key, value in meta.items()]
    lines += ["", "| step | status | detail |", "| --- | --- | --- |"]
    for name, step in steps.items():
        lines.append(f"| {name} | {step['status']} | {step.get('summary', step.get('reason', ''))} |")
    for name in ("bandwidth", "overlap", "roundtrip"):
        rows = steps.get(name, {}).get("rows")
        if rows:
            header = list(rows[0])
            lines += ["", f"## {name}", "", "| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
            lines += ["| " + " | ".join(_cell(row[k]) for k in header) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _cell(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def run_steps(args: argparse.Namespace) -> int:
    import logging

    import structlog
    import torch

    # kvdepot's own log lines (a pool registration that failed, say) go to the log file too.
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        logger_factory=structlog.PrintLoggerFactory(_Tee(sys.stdout, os.environ["KVDEPOT_CHECK_LOG"])),
    )

    out = Path(args.out)
    cuda = torch.cuda.is_available() and not args.dry_run
    device = torch.device("cuda" if cuda else "cpu")
    report = Report(
        out,
        {"device": torch.cuda.get_device_name() if cuda else "cpu (no CUDA device: a rehearsal)", "mode": args.mode},
    )
    for name in args.steps:
        left = args.budget - (time.time() - args.started)
        if left < STEP_SECONDS[name]:
            report.step(name, "skipped", reason=f"out of time: {left:.0f} s left of {args.budget:.0f}")
            continue
        say(f"step {name}: start")
        start = time.monotonic()
        try:
            STEP_FUNCTIONS[name](report, device, args)
        except Exception as exc:  # a broken step is a result too: record it and go on
            import traceback

            report.step(name, "failed", reason=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
        status = report.data["steps"].get(name, {}).get("status", "?")
        say(f"step {name}: {status} in {time.monotonic() - start:.1f} s")
    say(f"results: {out / 'gpu_check.md'}")
    print(markdown(report.data), flush=True)
    return 1 if report.failed else 0


def step_env(report: Report, device: Any, args: argparse.Namespace) -> None:
    import torch

    import kvdepot.core
    import kvdepot.gpu
    import kvdepot.server
    import kvdepot.transport
    from kvdepot.gpu import _triton

    modules = {m.__name__: os.path.dirname(m.__file__ or "") for m in (kvdepot.core, kvdepot.gpu, kvdepot.server,
                                                                      kvdepot.transport)}  # fmt: skip
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": __import__("triton").__version__ if _triton.available() else None,
        "modules": modules,
        "kvdepot_gpu": args.gpu_build,
    }
    try:
        from kvdepot.gpu import _rowcopy

        info["cpu_copy"] = f"loaded; OpenMP runtime {_rowcopy.openmp_library()}"
    except ImportError as exc:
        info["cpu_copy"] = f"not loaded: {exc}"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["gpu"] = f"{props.name}, {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs"
        smi = shutil.which("nvidia-smi")
        if smi:
            query = [smi, "--query-gpu=driver_version,pcie.link.gen.current,pcie.link.width.current", "--format=csv"]
            info["nvidia_smi"] = subprocess.run(query, capture_output=True, text=True, check=False).stdout.strip()
    # Every kvdepot module comes from the scratch site, except kvdepot.gpu where its build failed.
    allowed = {"kvdepot.gpu"} if args.gpu_build.startswith("source tree") else set()
    outside = {n: where for n, where in modules.items() if not where.startswith(args.site) and n not in allowed}
    if outside:
        report.step("env", "failed", reason=f"kvdepot modules from outside the site {args.site}: {outside}", **info)
        return
    report.data["meta"].update({k: info[k] for k in ("python", "torch", "cuda", "triton") if info.get(k)})
    report.data["meta"].update({k: info[k] for k in ("gpu", "nvidia_smi") if k in info})
    report.step("env", "passed", summary=f"torch {torch.__version__}, kvdepot-gpu {args.gpu_build}", **info)


def step_tests(report: Report, device: Any, args: argparse.Namespace) -> None:
    import xml.etree.ElementTree as ET

    runs = {"gpu": ["-m", "gpu"], "rest": ["-m", "not gpu"]}
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, marker in runs.items():
            junit = Path(tmp) / f"{name}.xml"
            cmd = [sys.executable, *args.python_flags, "-m", "pytest", "packages/gpu/tests", *marker, "-q",
                   "-p", "no:cacheprovider", "-p", "no:kvdepot_vllm", f"--junitxml={junit}",
                   "-o", "faulthandler_timeout=60"]  # fmt: skip
            # (kvdepot-vllm's pytest plugin is not carried; a dry run's interpreter may have it.)
            say(f"  pytest {' '.join(marker)} packages/gpu/tests")
            try:
                proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False, timeout=150)
            except subprocess.TimeoutExpired as exc:  # a hang must not take the measuring steps' time
                results[name] = {"exit": "timed out after 150 s", "error": str(exc.stdout or "")[-2000:]}
                continue
            with open(os.environ["KVDEPOT_CHECK_LOG"], "a") as f:
                f.write(proc.stdout[-20000:] + proc.stderr[-5000:])
            if not junit.exists():
                results[name] = {"exit": proc.returncode, "error": (proc.stdout + proc.stderr)[-2000:]}
                continue
            suite = ET.parse(junit).getroot()
            suite = suite if suite.tag == "testsuite" else suite[0]
            failed = [
                f"{case.get('classname')}::{case.get('name')}"
                for case in suite.iter("testcase")
                if case.find("failure") is not None or case.find("error") is not None
            ]
            counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
            results[name] = {"exit": proc.returncode, **counts, "failed": failed}
    ok = all(r["exit"] == 0 for r in results.values())
    gpu = results.get("gpu", {})
    summary = (
        f"-m gpu: {gpu.get('tests', 0) - gpu.get('skipped', 0)} ran, {gpu.get('skipped', '?')} skipped; "
        f"the rest: {results.get('rest', {}).get('tests', '?')}; failed: "
        f"{sum(len(r.get('failed', [])) for r in results.values())}"
    )
    ran_on_gpu = device.type == "cuda" and gpu.get("skipped", 1) == 0
    if device.type == "cuda" and not ran_on_gpu:
        ok = False
        summary += " (the gpu tests were skipped on a CUDA machine)"
    report.step("tests", "passed" if ok else "failed", summary=summary, runs=results)


def _kv_cache(kind: str, layers: int, blocks: int, device: Any) -> dict[str, Any]:
    """Llama-3-8B-shaped paged KV caches, random bf16 bits: flash-attention or flashinfer layout."""
    import torch

    shape = (2, blocks, 16, 8, 128) if kind == "flash_attn" else (blocks, 2, 16, 8, 128)
    kv = {}
    for i in range(layers):
        t = torch.empty(shape, dtype=torch.bfloat16, device=device)
        t.view(torch.int16).random_(-(2**15), 2**15 - 1)
        kv[f"model.layers.{i}.self_attn.attn"] = t
    return kv


class Timer:
    """Wall time of queued work: what a caller that queues copies and waits for them sees."""

    def __init__(self, device: Any) -> None:
        self.device = device

    def sync(self) -> None:
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)

    def best(self, fn: Callable[[int], Any], count: int, rounds: int) -> tuple[float, float]:
        """(best, median) seconds per call of `fn(i)` over `rounds` rounds of `count` calls, after one warm-up round."""
        import statistics

        times = []
        for r in range(rounds + 1):
            self.sync()
            start = time.perf_counter()
            for i in range(count):
                fn(i)
            self.sync()
            if r:
                times.append((time.perf_counter() - start) / count)
        return min(times), statistics.median(times)


def _bandwidth_setup(device: Any, kind: str, quick: bool) -> dict[str, Any]:
    import mmap

    import torch

    from kvdepot.gpu import KVLayout

    layers, blocks, slots = (32, 2048, 16) if device.type == "cuda" else (4, 256, 8)  # 2 * slots chunks fit
    if quick:
        layers = min(layers, 8)
    kv = _kv_cache(kind, layers, blocks, device)
    layout = KVLayout.from_kv_caches(kv, 16, backend_hint="FLASH_ATTN" if kind == "flash_attn" else "FLASHINFER")
    per_chunk = 16  # 256 tokens
    size = layout.chunk_bytes(per_chunk)
    mapping = mmap.mmap(-1, slots * size)
    pool = torch.frombuffer(mapping, dtype=torch.uint8)
    pool.fill_(1)  # fault the pages in, as a running server's pool is
    # Random blocks, no block in two chunks: a scatter of several chunks writes each block once.
    perm = torch.randperm(blocks, generator=torch.Generator().manual_seed(0)).tolist()
    ids = [perm[j * per_chunk : (j + 1) * per_chunk] for j in range(2 * slots)]
    return {"kv": kv, "layout": layout, "size": size, "slots": slots, "pool": pool, "mapping": mapping, "ids": ids}


def _methods(device: Any) -> list[str]:
    """The copy paths measured: DMA, then the Triton kernel at its default number of programs and
    at others ("triton@N": N programs; "triton@0": one per tile), which trade copy speed for SMs."""
    from kvdepot.gpu import _triton

    if device.type != "cuda":
        return ["auto"]  # the CPU copier: one path
    if not _triton.available():
        return ["dma"]
    return ["dma", "triton", *(f"triton@{n}" for n in TRITON_PROGRAMS if n != _triton.PROGRAMS)]  # DMA first


# The Triton kernel's program counts measured beside its default.
TRITON_PROGRAMS = (4, 8, 16, 32, 0)


def _open(layout: Any, pool: Any, method: str, **kwargs: Any) -> Any:
    """`open_copier` for a measured path ("triton@N" names the number of programs)."""
    from kvdepot.gpu import open_copier

    name, _, programs = method.partition("@")
    return open_copier(layout, pool, method=name, programs=int(programs) if programs else None, **kwargs)


def step_bandwidth(report: Report, device: Any, args: argparse.Namespace) -> None:
    rows: list[dict[str, Any]] = []
    for kind in ("flash_attn", "flashinfer"):
        _bandwidth_of(kind, device, args, rows, lambda: report.step("bandwidth", "running", rows=rows))
    best: dict[tuple[str, str], dict[str, Any]] = {}
    for row in rows:
        key = (row["layout"], row["copy"])
        if "error" not in row and (key not in best or row["ratio"] > best[key]["ratio"]):
            best[key] = row
    alone = [r for r in best.values() if "both" not in r["copy"]]
    picks = sorted({(r["copy"], r["method"]) for r in alone})
    summary = "faster: " + ", ".join(f"{c} by {m}" for c, m in picks)
    if device.type == "cuda":
        low = [r for r in alone if r["ratio"] < TARGETS["bandwidth"]]
        summary += (
            f"; under {TARGETS['bandwidth']:.0%} of cudaMemcpyAsync: {len(low)} of {len(alone)} (one way at a time)"
        )
    errors = [r for r in rows if "error" in r]
    report.step("bandwidth", "failed" if errors else "passed", summary=summary, rows=rows)


def _bandwidth_of(kind: str, device: Any, args: argparse.Namespace, rows: list[dict[str, Any]], saved: Any) -> None:
    """Each method's gather, scatter and both at once, against raw copies of the same bytes, for one layout."""
    import torch

    timer, rounds = Timer(device), (3 if args.quick else 7)
    s = _bandwidth_setup(device, kind, args.quick)
    size, slots, pool = s["size"], s["slots"], s["pool"]
    say(f"  {kind}: {s['layout'].num_layers} layers, {size / MIB:.0f} MiB chunks, {slots} per round")
    buffers = [torch.empty(size * BATCH, dtype=torch.uint8, device=device) for _ in range(2)]
    streams = [torch.cuda.Stream(device) for _ in range(2)] if device.type == "cuda" else [None, None]

    def on(stream: Any) -> Any:
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def raw_d2h(i: int, n: int) -> None:  # n chunks' bytes, one cudaMemcpyAsync each
        with on(streams[0]):
            for k in range(n):
                pool[((i * n + k) % slots) * size :][:size].copy_(buffers[0][k * size :][:size], non_blocking=True)

    def raw_h2d(i: int, n: int) -> None:
        with on(streams[1]):
            for k in range(n):
                buffers[1][k * size :][:size].copy_(pool[((i * n + k + 1) % slots) * size :][:size], non_blocking=True)

    raws = {"d2h": raw_d2h, "h2d": raw_h2d}
    for method in _methods(device):
        try:
            with contextlib.closing(_copy_cases(s, method, raws)) as cases:
                for what, raw, ours, per_call in cases:
                    raw_t, _ = timer.best(raw, slots // per_call, rounds)
                    t, median = timer.best(ours, slots // per_call, rounds)
                    moved = size * per_call * (2 if "both" in what else 1)
                    rows.append({
                        "layout": kind, "method": method, "copy": what, "chunk MiB": size / MIB,
                        "GB/s": moved / t / 1e9, "raw GB/s": moved / raw_t / 1e9, "ratio": raw_t / t,
                        "median GB/s": moved / median / 1e9,
                    })  # fmt: skip
                    say(f"    {method:6s} {what:58s} {moved / t / 1e9:7.2f} GB/s, raw {moved / raw_t / 1e9:7.2f} GB/s")
                    saved()
        except Exception as exc:  # one method's failure leaves the other's figures
            rows.append({"layout": kind, "method": method, "copy": "-", "error": f"{type(exc).__name__}: {exc}"})
            say(f"    {method}: failed: {type(exc).__name__}: {exc}")
            saved()


# Chunks per call in the batched cases: a connector stores and loads a step's chunks in one call.
BATCH = 8


def _copy_cases(s: dict[str, Any], method: str, raw: dict[str, Any]) -> Any:
    """(what, raw copy, kvdepot's copy, chunks per call) for one method: one way, then both at once.

    A generator, so that the copiers it opens close (and unregister the pool) however the caller stops."""

    size, slots, ids = s["size"], s["slots"], s["ids"]
    with contextlib.ExitStack() as stack:
        copier = stack.enter_context(_open(s["layout"], s["pool"], method))
        say(f"    {method}: {copier.describe()}")
        try:  # a second copier, with its own side stream, on the pool the first one registered
            second = stack.enter_context(_open(s["layout"], s["pool"], method, register=False))
        except Exception as exc:
            say(f"    {method}: no second copier on the registered pool: {type(exc).__name__}: {exc}")
            second = None

        def gather(i: int, n: int = 1, c: Any = copier) -> None:
            first = i * n
            c.gather([ids[(first + k) % len(ids)] for k in range(n)], [((first + k) % slots) * size for k in range(n)])

        def scatter(i: int, n: int = 1, c: Any = copier) -> None:
            first = i * n + 1
            c.scatter(
                [((first + k) % slots) * size for k in range(n)],
                [ids[(first + k + slots) % len(ids)] for k in range(n)],
            )

        def both(i: int, c: Any) -> None:
            gather(i)
            scatter(i, 1, c)

        yield "gather (GPU to pool), 1 chunk a call", lambda i: raw["d2h"](i, 1), gather, 1
        yield "scatter (pool to GPU), 1 chunk a call", lambda i: raw["h2d"](i, 1), scatter, 1
        yield (f"gather (GPU to pool), {BATCH} chunks a call", lambda i: raw["d2h"](i, BATCH),
               lambda i: gather(i, BATCH), BATCH)  # fmt: skip
        yield (f"scatter (pool to GPU), {BATCH} chunks a call", lambda i: raw["h2d"](i, BATCH),
               lambda i: scatter(i, BATCH), BATCH)  # fmt: skip
        raw_both = lambda i: (raw["d2h"](i, 1), raw["h2d"](i, 1))  # noqa: E731
        yield "both at once, one side stream (today's connector)", raw_both, lambda i: both(i, copier), 1
        if second is not None:
            yield "both at once, a side stream each way", raw_both, lambda i: both(i, second), 1


def step_overlap(report: Report, device: Any, args: argparse.Namespace) -> None:
    import statistics

    import torch

    from kvdepot.gpu import compute_event

    if device.type != "cuda":
        report.step("overlap", "skipped", reason="needs a CUDA device (streams)")
        return
    s = _bandwidth_setup(device, "flash_attn", args.quick)
    size, slots, pool, ids = s["size"], s["slots"], s["pool"], s["ids"]
    n = 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    products = 300 if args.quick else 700  # about 0.4 s and 1 s of an H100
    compute = torch.cuda.current_stream(device)

    def matmuls() -> tuple[Any, Any]:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(compute)
        for _ in range(products):
            torch.matmul(a, b)
        end.record(compute)
        return start, end

    def alone() -> float:
        start, end = matmuls()
        end.synchronize()
        return start.elapsed_time(end)

    alone()
    base = statistics.median(alone() for _ in range(3))
    rows = []
    for method in _methods(device):
        with _open(s["layout"], pool, method) as copier:
            copier.gather([ids[0]], [0]).wait()  # compiled and warm
            copier.scatter([0], [ids[1]]).wait()
            samples, counts, rates = [], [], []
            for _ in range(3):
                ready = compute_event(device)  # the blocks are written: copies need not wait for the products
                start, end = matmuls()
                copies, moved, t0 = [], 0, time.perf_counter()
                while not end.query():
                    i = len(copies)
                    if i % 2:
                        handle = copier.scatter([(i % slots) * size], [ids[i % len(ids)]], after=ready)
                    else:
                        handle = copier.gather([ids[i % len(ids)]], [(i % slots) * size], after=ready)
                    copies.append(handle)
                    moved += size
                    if len(copies) > 4:
                        copies[-4].wait()  # at most four chunks queued, like a connector's in-flight copies
                end.synchronize()
                samples.append(start.elapsed_time(end))
                for h in copies:
                    h.wait()
                counts.append(len(copies))
                rates.append(moved / (time.perf_counter() - t0) / 1e9)
            with_copies = statistics.median(samples)
            slowdown = with_copies / base - 1
            rows.append({
                "method": method, "path": copier.describe(), "products ms alone": base,
                "products ms while copying": with_copies, "slowdown": slowdown,
                "chunks copied (median)": statistics.median(counts), "copy GB/s meanwhile": statistics.median(rates),
            })  # fmt: skip
            say(f"    {method}: {base:.1f} ms alone, {with_copies:.1f} ms copying {counts} chunks ({slowdown:+.1%})")
            report.step("overlap", "running", rows=rows)
    worst = max(r["slowdown"] for r in rows)
    report.step(
        "overlap", "passed", rows=rows,
        summary=f"{products} bf16 {n}x{n} products; worst slowdown {worst:+.1%} "
        f"(target: under {TARGETS['overlap']:.0%}); "
        + ", ".join(f"{r['method']} {r['slowdown']:+.1%} at {r['copy GB/s meanwhile']:.1f} GB/s" for r in rows),
    )  # fmt: skip


def step_roundtrip(report: Report, device: Any, args: argparse.Namespace) -> None:
    import hashlib

    import torch

    from kvdepot.gpu import KVLayout, open_copier
    from kvdepot.transport import CacheClient

    layers, blocks = (32, 1024) if device.type == "cuda" else (4, 512)
    kv = _kv_cache("flash_attn", layers, blocks, device)
    layout = KVLayout.from_kv_caches(kv, 16, backend_hint="FLASH_ATTN")
    per_chunk, chunks = 16, 16
    size = layout.chunk_bytes(per_chunk)
    gen = torch.Generator().manual_seed(1)
    order = torch.randperm(blocks, generator=gen).tolist()
    source = [order[i * per_chunk : (i + 1) * per_chunk] for i in range(chunks)]
    target = [order[(chunks + i) * per_chunk : (chunks + i + 1) * per_chunk] for i in range(chunks)]
    rows = []
    with _served(args, size, chunks) as address, CacheClient(address) as client:
        reg = client.register(layout.fingerprint(), per_chunk * 16, size).result(30)
        with _mapped_pool(reg) as pool, open_copier(layout, pool) as copier:
            path = copier.describe()
            for round_ in range(3):
                salt = f"check-{round_}"
                keys = [hashlib.sha256(f"{salt}/{i}".encode()).digest() for i in range(chunks)]
                t0 = time.perf_counter()
                r = client.reserve(salt, keys, size).result(30)
                offsets = [slot.offset for slot in sorted(r.slots, key=lambda x: x.index)]
                if len(offsets) != chunks:
                    raise RuntimeError(f"the server reserved {len(offsets)} of {chunks} slots; give it more")
                copier.gather(source, offsets, slot_size=size).wait()
                client.commit(r.reservation_id).result(30)
                t1 = time.perf_counter()
                (hit,) = client.lookup([(salt, keys)]).result(30).results
                copier.scatter([slot.offset for slot in hit.slots], target, slot_size=size).wait()
                client.release([hit.lease_id]).result(30)
                t2 = time.perf_counter()
                same = all(  # as bits: random bf16 bits hold NaNs, which equal nothing
                    torch.equal(t.view(torch.int16)[:, src], t.view(torch.int16)[:, dst])
                    for t in kv.values()
                    for src, dst in zip(source, target, strict=True)
                )
                rows.append({
                    "round": round_, "chunks": chunks, "chunk MiB": size / MIB, "hit chunks": len(hit.slots),
                    "store GB/s": chunks * size / (t1 - t0) / 1e9, "load GB/s": chunks * size / (t2 - t1) / 1e9,
                    "bytes identical": same, "path": path,
                })  # fmt: skip
                say(f"    round {round_}: store {rows[-1]['store GB/s']:.2f} GB/s, load "
                    f"{rows[-1]['load GB/s']:.2f} GB/s, identical: {same}")  # fmt: skip
                for t in kv.values():  # the next round's targets start different again
                    t[:, [b for chunk in target for b in chunk]] = 0
    ok = all(r["bytes identical"] and r["hit chunks"] == chunks for r in rows)
    best = max(rows, key=lambda r: r["store GB/s"] + r["load GB/s"])
    summary = (
        f"{chunks} x {size / MIB:.0f} MiB through kvdepot serve: store {best['store GB/s']:.2f} GB/s, "
        f"load {best['load GB/s']:.2f} GB/s, bytes identical: {ok}"
    )
    report.step("roundtrip", "passed" if ok else "failed", summary=summary, rows=rows)


@contextlib.contextmanager
def _served(args: argparse.Namespace, size: int, chunks: int) -> Any:
    """A real `kvdepot serve` with room for ``chunks`` slots of ``size`` bytes, on a private ipc socket;
    its address."""
    from kvdepot.server import fetch_stats

    with tempfile.TemporaryDirectory() as tmp:
        address = f"ipc://{tmp}/kvdepot.sock"
        # The pool where production keeps it (shared memory), where there is room.
        shm = Path("/dev/shm")
        pool_dir = str(shm) if shm.is_dir() and shutil.disk_usage(shm).free > 4 * chunks * size else tmp
        page = 4 * (size + 4096)  # four slots and their headers
        cmd = [sys.executable, *args.python_flags, "-m", "kvdepot.server", "serve", "--address", address,
               "--capacity", str(page * (chunks // 2)), "--page-size", str(page), "--pool-dir", pool_dir,
               "--no-metrics", "--log-level", "warning", "--no-keep-pool"]  # fmt: skip
        log = open(os.environ["KVDEPOT_CHECK_LOG"], "a")  # noqa: SIM115 - the server's lifetime
        server = subprocess.Popen(cmd, stdout=log, stderr=log)
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    fetch_stats(address, timeout=1.0)
                    break
                except Exception:
                    if time.monotonic() > deadline or server.poll() is not None:
                        raise
                    time.sleep(0.2)
            yield address
        finally:
            server.terminate()
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
            log.close()


@contextlib.contextmanager
def _mapped_pool(reply: Any) -> Any:
    """The server's pool, mapped as a worker maps it: a uint8 tensor over the whole mapping."""
    import mmap

    import torch

    from kvdepot.server import open_pool_file

    fd = open_pool_file(reply.pool.path)
    try:
        mapping = mmap.mmap(fd, reply.pool.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    export = memoryview(mapping)
    pool = torch.frombuffer(export, dtype=torch.uint8)
    try:
        yield pool
    finally:
        del pool
        export.release()
        mapping.close()


def step_v2(report: Report, device: Any, args: argparse.Namespace) -> None:
    """Model Runner V2's order on the device (docstring, step 6)."""
    import hashlib
    import threading

    import torch

    from kvdepot.gpu import KVLayout, open_copier
    from kvdepot.transport import CacheClient

    layers, blocks = (32, 1024) if device.type == "cuda" else (4, 256)
    if args.quick:
        layers = min(layers, 8)
    kv = _kv_cache("flash_attn", layers, blocks, device)
    layout = KVLayout.from_kv_caches(kv, 16, backend_hint="FLASH_ATTN")
    per_chunk, chunks = 16, 8
    size = layout.chunk_bytes(per_chunk)
    ids = torch.randperm(blocks, generator=torch.Generator().manual_seed(2)).tolist()
    stored = [ids[i * per_chunk : (i + 1) * per_chunk] for i in range(chunks)]
    loaded = [ids[(chunks + i) * per_chunk : (chunks + i + 1) * per_chunk] for i in range(chunks)]
    flat = [b for chunk in stored for b in chunk]
    busy = torch.randn(2048, 2048, device=device)  # the forward pass: compute queued ahead of the copy
    rows = []
    with _served(args, size, chunks * 2) as address, CacheClient(address) as client:
        reg = client.register(layout.fingerprint(), per_chunk * 16, size).result(30)
        with _mapped_pool(reg) as pool, open_copier(layout, pool) as copier:
            for round_ in range(3):
                salt = f"v2-{round_}"
                keys = [hashlib.sha256(f"{salt}/{i}".encode()).digest() for i in range(chunks)]
                reserved = client.reserve(salt, keys, size)  # asked for as the step starts
                for _ in range(4 if device.type == "cuda" else 1):  # step N's forward pass
                    busy = busy @ busy / busy.norm()
                for t in kv.values():
                    t[:, flat] = t[:, flat].roll(1, dims=-1)  # writes this step's KV into the stored blocks
                computed = [t[:, flat].clone() for t in kv.values()]  # (compute stream: before the zeroing)
                offsets = [s.offset for s in sorted(reserved.result(30).slots, key=lambda x: x.index)]
                # wait_for_save: the gather on the side stream, after the forward; the compute stream waits for it.
                queued = time.perf_counter()
                handle = copier.gather(stored, offsets, slot_size=size)
                if hasattr(handle, "wait_stream"):
                    handle.wait_stream()
                returned = time.perf_counter()
                # Step N+1, at once: V2 zeroes the handed-out blocks, then another request's forward writes them.
                for t in kv.values():
                    t[:, flat] = 0
                    t[:, flat] = 1

                def commit(reply_id: int = reserved.result().reservation_id, h: Any = handle) -> None:
                    h.wait()  # the copy thread: the commit once the copy is done
                    client.commit(reply_id).result(30)

                committer = threading.Thread(target=commit, daemon=True)
                committer.start()
                committer.join(60)
                (hit,) = client.lookup([(salt, keys)]).result(30).results
                copier.scatter([s.offset for s in hit.slots], loaded, slot_size=size).wait()
                client.release([hit.lease_id]).result(30)
                same = all(  # as bits: random bf16 bits hold NaNs, which equal nothing
                    torch.equal(want.view(torch.int16), t.view(torch.int16)[:, [b for chunk in loaded for b in chunk]])
                    for want, t in zip(computed, kv.values(), strict=True)
                )
                rows.append({
                    "round": round_, "chunks": chunks, "chunk MiB": size / MIB, "hit chunks": len(hit.slots),
                    "queue ms": (returned - queued) * 1e3, "bytes as computed": same, "path": copier.describe(),
                })  # fmt: skip
                say(f"    round {round_}: {len(hit.slots)} chunks back, bytes as computed: {same}")
    ok = all(r["bytes as computed"] and r["hit chunks"] == chunks for r in rows)
    summary = (
        f"{chunks} x {size / MIB:.0f} MiB gathered at the step's end, the blocks zeroed and rewritten at once by "
        f"the next step: every chunk as computed: {ok}; queueing the copy took "
        f"{min(r['queue ms'] for r in rows):.2f} ms"
    )
    report.step("v2", "passed" if ok else "failed", summary=summary, rows=rows)


STEP_FUNCTIONS: dict[str, Callable[[Report, Any, argparse.Namespace], None]] = {
    "env": step_env,
    "tests": step_tests,
    "v2": step_v2,
    "bandwidth": step_bandwidth,
    "overlap": step_overlap,
    "roundtrip": step_roundtrip,
}


# --- the command line ----------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", nargs="?", choices=["run", "bundle", "steps"], default="run")
    parser.add_argument("--dry-run", action="store_true", help="rehearse on the CPU: build the bundle, check it, run")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "gpu-check-out"))
    parser.add_argument("--bundle", default=str(BUNDLE), help="the carried wheels (default .devcheck)")
    parser.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated, of {','.join(STEPS)}")
    parser.add_argument("--quick", action="store_true", help="fewer layers and rounds")
    parser.add_argument(
        "--python", default=TARGET_PYTHON, help=f"bundle: the GPU machine's Python (default {TARGET_PYTHON})"
    )
    # Set by `run` for the child process:
    parser.add_argument("--site", default="", help=argparse.SUPPRESS)
    parser.add_argument("--gpu-build", default="", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="", help=argparse.SUPPRESS)
    parser.add_argument("--started", type=float, default=time.time(), help=argparse.SUPPRESS)
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for install and steps (default 400)")
    parser.add_argument("--python-flag", dest="python_flags", action="append", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.steps = [s for s in args.steps.split(",") if s]
    unknown = set(args.steps) - set(STEPS)
    if unknown:
        parser.error(f"unknown steps {sorted(unknown)}; the steps are {', '.join(STEPS)}")
    if args.command == "bundle":
        make_bundle(Path(args.bundle), args.python)
        return 0
    if args.command == "steps":
        return run_steps(args)
    return run(args)


def run(args: argparse.Namespace) -> int:
    """Install into a scratch site, then run the steps in a child that sees that site."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "gpu_check.log"
    log_path.write_text("")
    os.environ["KVDEPOT_CHECK_LOG"] = str(log_path)
    bundle = Path(args.bundle)
    with tempfile.TemporaryDirectory(prefix="kvdepot-check-") as tmp:
        site = Path(tmp) / "site"
        child_env = dict(os.environ)
        flags: list[str] = []
        if args.dry_run:
            mode = "dry run on the CPU"
            bundle = Path(tmp) / "bundle"  # always fresh, so a broken bundle is caught here
            make_bundle(bundle)
            check_bundle_for_target(bundle, Path(tmp) / "target-check")
            wheels = host_wheels(bundle, Path(tmp) / "host")
            # The child sees this interpreter's packages only as a plain path, without .pth files
            # (-S): a development checkout's editable installs of kvdepot stay out, as on the GPU machine.
            import sysconfig

            flags = ["-S"]
            machine_packages = sysconfig.get_paths()["purelib"]
        else:
            mode = "GPU machine"
            if not (bundle / "manifest.json").exists():
                raise SystemExit(
                    f"no bundle at {bundle}: run `python benchmarks/{Path(__file__).name} bundle` where PyPI is "
                    "reachable, and carry .devcheck with the repository"
                )
            wheels = sorted(str(p) for p in (bundle / "wheels").glob("*.whl"))
            machine_packages = ""
        built = install_site(site, wheels)
        path = [str(site), built["extra_path"], machine_packages, child_env.get("PYTHONPATH", "")]
        child_env["PYTHONPATH"] = os.pathsep.join(p for p in path if p)
        child_env.setdefault("PYTHONUNBUFFERED", "1")
        cmd = [sys.executable, *flags, __file__, "steps", "--out", str(out), "--steps", ",".join(args.steps),
               "--site", str(site), "--gpu-build", built["kvdepot_gpu"], "--mode", mode]  # fmt: skip
        cmd += [f"--python-flag={f}" for f in flags] + [f"--started={args.started}", f"--budget={args.budget}"]
        cmd += ["--dry-run"] * args.dry_run + ["--quick"] * args.quick
        say(f"{mode}: running steps {', '.join(args.steps)}")
        return subprocess.run(cmd, env=child_env, cwd=ROOT, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
