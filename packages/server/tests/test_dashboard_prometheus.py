"""Every query of the shipped dashboard returns data from a real Prometheus scraping a real server.

The Prometheus binary is ``$KVDEPOT_PROMETHEUS`` or ``prometheus`` on PATH (Debian: apt-get install
prometheus; CI installs it, see .ci/run); without one the test skips and says so.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvdepot.server import PoolMapping
from kvdepot.server._dashboard import shipped_dashboard
from kvdepot.server.testing import free_port
from kvdepot.transport import CacheClient, ReserveReply

pytestmark = [pytest.mark.integration, pytest.mark.slow]

T = 10.0
CHUNK = 960  # a slot of 1024 bytes with its header: 64 of them in the pool below
START_TIMEOUT = 30.0
# Seconds to wait for every query to have data: the first scrapes take a few seconds; a loaded
# CI machine may take many more.
DATA_TIMEOUT = 120.0
# What Grafana would put in for the dashboard's variables (`$instance` is the scraped target).
VARIABLES = {"__rate_interval": "1m", "top_salts": "5"}


def find_prometheus() -> str | None:
    return os.environ.get("KVDEPOT_PROMETHEUS") or shutil.which("prometheus")


def _get_json(url: str) -> dict:
    try:
        with urllib.request.urlopen(url, timeout=T) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return json.loads(exc.read())


def _events(path: Path) -> list[dict]:
    events = []
    for line in path.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            events.append(json.loads(line))
    return events


@contextlib.contextmanager
def running(cmd: list[str], log_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def wait_for(what: str, check, proc: subprocess.Popen[bytes], log_path: Path, timeout: float = START_TIMEOUT):
    """Poll `check()` until it returns a truthy value; fails if `proc` exits or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(OSError, ValueError):
            if value := check():
                return value
        if proc.poll() is not None or time.monotonic() > deadline:
            state = f"exited with {proc.returncode}" if proc.poll() is not None else "still running"
            pytest.fail(f"{what} did not happen ({state}); its log:\n{log_path.read_text(errors='replace')[-3000:]}")
        time.sleep(0.2)


def reserve(client: CacheClient, salt: str, keys: list[bytes]) -> ReserveReply:
    """Slots for ``keys``. A pool full of chunks that wait for the disk tier's write-behind gives
    none until the writer has caught up (a slow machine): asked again then, for `T` at most."""
    deadline = time.monotonic() + T
    while True:
        res = client.reserve(salt, keys, CHUNK).result(T)
        if res.slots or not res.full or time.monotonic() > deadline:
            return res
        time.sleep(0.05)


def store_and_look_up(address: str) -> None:
    """Chunks stored past the pool's 64 slots (evictions; the disk tier gets them written behind),
    then looked up under two salts: RAM hits, chunks read back from disk, and misses."""
    with CacheClient(address, timeout=T) as client:
        reg = client.register("layout", 256, CHUNK).result(T)
        with PoolMapping(reg.pool.path, reg.pool.size) as pool:
            for salt in ("tenant-a", "tenant-b"):
                for start in range(0, 48, 8):
                    keys = [f"{salt}-{i}".encode().ljust(32, b".") for i in range(start, start + 8)]
                    res = reserve(client, salt, keys)
                    for slot in res.slots:
                        pool.write(slot.offset, bytes([slot.index]) * slot.length)
                    if res.reservation_id:  # 0: nothing reserved
                        client.commit(res.reservation_id).result(T)
        for salt in ("tenant-a", "tenant-b"):
            keys = [f"{salt}-{i}".encode().ljust(32, b".") for i in range(56)]
            for start in (0, 40):
                reply = client.lookup([(salt, keys[start : start + 16])]).result(T)
                client.release([r.lease_id for r in reply.results if r.lease_id]).result(T)


def substitute(expr: str, instance: str) -> str:
    # As Grafana fills in a regex matcher: the value escaped, its backslashes doubled for PromQL's string.
    values = {**VARIABLES, "instance": re.escape(instance).replace("\\", "\\\\")}
    out = re.sub(r"\$\{?(\w+)\}?", lambda m: values.get(m.group(1), m.group(0)), expr)
    assert "$" not in out, f"a variable of the dashboard the test does not know: {out}"
    return out


def test_every_dashboard_query_returns_data_from_a_real_prometheus(short_tmp):
    """A real Prometheus scrapes a real `kvdepot serve` (with a disk tier) every second; once it
    has, each query of each panel of the shipped dashboard, its variables filled in as Grafana
    would, returns at least one series (a figure at 0 is data), and so does the instance picker."""
    binary = find_prometheus()
    if binary is None:
        pytest.skip("no prometheus binary: set KVDEPOT_PROMETHEUS, or apt-get install prometheus")
    server_log, prom_log = short_tmp / "server.log", short_tmp / "prometheus.log"
    serve = [sys.executable, "-m", "kvdepot.server", "serve", "--address", f"ipc://{short_tmp}/kvd.sock"]
    serve += ["--pool-dir", str(short_tmp), "--capacity", "64KiB", "--page-size", "4KiB", "--metrics-port", "0"]
    serve += ["--disk-dir", str(short_tmp / "disk"), "--disk-capacity", "16MiB", "--log-format", "json"]
    with running(serve, server_log) as server:

        def started() -> dict | None:
            return next((e for e in _events(server_log) if e.get("event") == "server_started"), None)

        event = wait_for("kvdepot serve starting", started, server, server_log)
        target = urllib.parse.urlsplit(event["metrics"]).netloc

        port = free_port()
        config = short_tmp / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            f"scrape_configs:\n  - job_name: kvdepot\n    static_configs:\n      - targets: ['{target}']\n"
        )
        prometheus = [binary, f"--config.file={config}", f"--storage.tsdb.path={short_tmp / 'tsdb'}"]
        prometheus += [f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"]
        with running(prometheus, prom_log) as prom:
            api = f"http://127.0.0.1:{port}/api/v1"

            def ready() -> bool:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=T) as resp:
                    return resp.status == 200

            wait_for("Prometheus becoming ready", ready, prom, prom_log)

            def instances() -> list[str]:
                query = urllib.parse.urlencode({"match[]": "kvdepot_capacity_bytes"})
                values: list[str] = _get_json(f"{api}/label/instance/values?{query}")["data"]
                return values

            assert wait_for("a first scrape of the server", instances, prom, prom_log) == [target]
            store_and_look_up(event["address"])  # after that scrape: the rates see it

            model = json.loads(shipped_dashboard())
            queries = {
                f"{panel['title']} / {t['legendFormat']}": substitute(t["expr"], target)
                for panel in model["panels"]
                for t in panel.get("targets", [])
            }

            def empty() -> dict[str, str]:
                out = {}
                for name, expr in queries.items():
                    answer = _get_json(f"{api}/query?{urllib.parse.urlencode({'query': expr})}")
                    assert answer["status"] == "success", f"{name}: {expr}: {answer}"
                    if not answer["data"]["result"]:
                        out[name] = expr
                return out

            deadline = time.monotonic() + DATA_TIMEOUT
            while (left := empty()) and time.monotonic() < deadline and prom.poll() is None:
                time.sleep(1.0)
            targets = _get_json(f"{api}/targets")["data"]["activeTargets"]
            assert not left, (
                f"queries still without data after {DATA_TIMEOUT:.0f} s: {json.dumps(left, indent=2)}\n"
                f"scrape targets: {[(t['health'], t['lastError']) for t in targets]}"
            )
