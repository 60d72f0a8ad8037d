"""GET /healthz on the metrics port: 200 while the loop turns and the pool is whole, 503 and why not."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvdepot.server import CacheServer, ServerConfig
from kvdepot.transport import CacheClient

T = 5.0
START_TIMEOUT = 30.0


def get(url: str) -> tuple[int, str, str]:
    """(status, content type, body) of a GET, error statuses included."""
    try:
        with urllib.request.urlopen(url, timeout=T) as resp:
            return resp.status, resp.headers["Content-Type"], resp.read().decode()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.headers["Content-Type"], exc.read().decode()


def health_url(metrics_url: str) -> str:
    return metrics_url.removesuffix("/metrics") + "/healthz"


def wait_for_health(url: str, status: int, timeout: float = 30.0) -> str:
    """Poll /healthz until it answers `status`; returns the body (fails with the last answer)."""
    deadline = time.monotonic() + timeout
    while True:
        got, _, body = get(url)
        if got == status:
            return body
        assert time.monotonic() < deadline, f"/healthz kept answering {got} {body!r}, not {status}"
        time.sleep(0.05)


@contextlib.contextmanager
def serve_process(workdir: Path, *args: str) -> Iterator[tuple[subprocess.Popen[bytes], dict]]:
    """A `kvdepot serve` child process with metrics on a free port, and its start event (JSON log)."""
    log_path = workdir / "server.log"
    cmd = [sys.executable, "-m", "kvdepot.server", "serve", "--address", f"ipc://{workdir}/kvd.sock"]
    cmd += ["--pool-dir", str(workdir), "--metrics-port", "0", "--log-format", "json", *args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            started = [e for e in _events(log_path) if e.get("event") == "server_started"]
            if started:
                break
            assert proc.poll() is None, f"kvdepot serve exited with {proc.returncode}: {log_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"kvdepot serve did not start: {log_path.read_text()[-3000:]}"
            time.sleep(0.05)
        yield proc, started[0]
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _events(path: Path) -> list[dict]:
    events = []
    for line in path.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            events.append(json.loads(line))
    return events


@pytest.mark.integration
def test_real_server_process_is_healthy_and_serves_metrics_beside(short_tmp):
    """A `kvdepot serve` process answers /healthz with 200 "ok", /metrics with the text format, and
    any other path with 404; once it stops, nothing answers on the port."""
    with serve_process(short_tmp, "--capacity", "1MiB", "--page-size", "64KiB") as (proc, started):
        metrics = started["metrics"]
        assert metrics.startswith("http://127.0.0.1:")
        assert wait_for_health(health_url(metrics), 200) == "ok\n"
        status, ctype, body = get(metrics)
        assert (status, ctype.split(";")[0]) == (200, "text/plain")
        assert "kvdepot_capacity_bytes 1.048576e+06" in body
        assert get(metrics.removesuffix("/metrics") + "/nothing-here")[0] == 404
        proc.terminate()
        assert proc.wait(10) == 0
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(health_url(metrics), timeout=T)


def test_healthz_answers_503_while_the_loop_is_stalled(make_server):
    """A request that holds the loop (the server's Stats hook made to block) turns /healthz to 503
    once the loop has not turned for `health_stall` seconds; 200 again once the loop turns."""
    server = make_server(metrics_port=0, health_stall=0.5)
    url = health_url(server.metrics_url)
    wait_for_health(url, 200)
    entered, release = threading.Event(), threading.Event()
    figures = server.handler.extra_stats

    def blocking_figures():
        entered.set()
        release.wait(60)
        return figures()

    server.handler.extra_stats = blocking_figures
    with CacheClient(server.address, timeout=60) as client:
        reply = client.stats()
        assert entered.wait(T), "the Stats request never reached the loop"
        try:
            assert "the loop has not turned for" in wait_for_health(url, 503)
        finally:
            release.set()
        assert reply.result(T).capacity_bytes == server.allocator.capacity
    assert wait_for_health(url, 200) == "ok\n"


def test_healthz_answers_503_once_the_pool_is_truncated(make_server):
    """With its pool file truncated under it, the server is unhealthy at once (whatever its loop
    does), and its loop stops serving that pool."""
    server = make_server(metrics_port=0)
    url = health_url(server.metrics_url)
    wait_for_health(url, 200)
    entered, release = threading.Event(), threading.Event()
    figures = server.handler.extra_stats

    def blocking_figures():
        entered.set()
        release.wait(60)
        return figures()

    server.handler.extra_stats = blocking_figures
    with CacheClient(server.address, timeout=60) as client:
        client.stats()
        assert entered.wait(T), "the Stats request never reached the loop"
        try:
            os.truncate(server.pool.path, 0)  # while the loop is held: it cannot stop the server yet
            status, _, body = get(url)
            assert status == 503
            assert f"the pool {server.pool.path} is unmapped or truncated" in body
        finally:
            release.set()
    deadline = time.monotonic() + 10
    while server.failure is None:
        assert time.monotonic() < deadline, "the loop never noticed the truncated pool"
        time.sleep(0.05)
    assert "truncated" in server.failure


def test_healthz_answers_503_before_the_loop_starts(tmp_path):
    """A server whose loop has not turned yet is not healthy: it would not answer a client."""
    config = ServerConfig(
        address="memory://health-not-started", capacity=64 * 4096, page_size=4096, pool_dir=tmp_path, metrics_port=0
    )
    with CacheServer(config) as server:
        assert server.metrics_url is not None
        assert get(health_url(server.metrics_url)) == (503, "text/plain; charset=utf-8", "the loop has not started\n")
