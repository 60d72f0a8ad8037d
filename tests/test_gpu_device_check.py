"""The GPU device check's dry run (`benchmarks/gpu_device_check.py --dry-run`, docs/gpu.md).

The check runs on a GPU machine with no network, from wheels carried beside the repository.
Its dry run builds that bundle afresh, installs it as the GPU machine's pip would (CPython
3.12, manylinux), then runs every step that needs no CUDA device from a scratch install,
so a broken bundle or a broken step is found here rather than in scarce GPU time.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_the_device_check_runs_every_step_it_can_on_the_cpu_from_its_bundle(tmp_path: Path) -> None:
    cmd = [sys.executable, "benchmarks/gpu_device_check.py", "--dry-run", "--quick", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    output = proc.stdout[-6000:] + proc.stderr[-6000:]
    assert proc.returncode == 0, output
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    steps = results["steps"]
    statuses = {name: step["status"] for name, step in steps.items()}
    assert statuses == {
        "env": "passed", "tests": "passed", "v2": "passed", "bandwidth": "passed", "overlap": "skipped",
        "roundtrip": "passed",
    }, output  # fmt: skip

    # Every kvdepot module came from the scratch install of the bundle, none from this checkout.
    site = steps["env"]["modules"]["kvdepot.core"].split("/kvdepot/")[0]
    assert "kvdepot-check-" in site
    assert all(path.startswith(site) for path in steps["env"]["modules"].values())
    assert steps["env"]["cpu_copy"].startswith("loaded")

    # The gpu package's tests ran from that install: the CUDA ones skipped here, the rest passed.
    runs = steps["tests"]["runs"]
    assert runs["gpu"]["tests"] > 0
    assert runs["gpu"]["skipped"] == runs["gpu"]["tests"]
    assert runs["rest"]["tests"] > 100
    assert runs["rest"]["failures"] == runs["rest"]["errors"] == 0

    # The measuring steps ran their code: each copy against its baseline, bytes through a real server.
    rows = steps["bandwidth"]["rows"]
    assert not [row for row in rows if "error" in row]
    copies = {(row["layout"], row["copy"]) for row in rows}
    assert len(copies) == 12  # two layouts x (each way, 1 and 8 chunks a call; both ways, 1 and 2 side streams)
    assert all(row["GB/s"] > 0 and row["raw GB/s"] > 0 for row in rows)
    assert all(row["bytes identical"] and row["hit chunks"] == row["chunks"] for row in steps["roundtrip"]["rows"])
    table = (tmp_path / "gpu_check.md").read_text()
    assert "## bandwidth" in table
    assert "## roundtrip" in table
    assert "step roundtrip: passed" in (tmp_path / "gpu_check.log").read_text()
