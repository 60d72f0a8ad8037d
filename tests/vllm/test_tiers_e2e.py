"""Tiers below RAM end to end on real vLLM: a disk tier that outlives a server restart, a Valkey
cluster shared by two servers, a remote tier killed mid-run, and corrupted objects.

Every engine runs with vLLM's defaults (prefix caching on); every output is compared with the
same prompt recomputed by an engine without kvdepot.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import kvdepot.server

pytestmark = [pytest.mark.vllm, pytest.mark.engine, pytest.mark.integration]

CHUNK = 256  # tokens per chunk (two CPU blocks of 128)
LENGTH = 1100  # four full chunks and a tail


def prompt(seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(10, 2000) for _ in range(LENGTH)]


class TierServer(kvdepot.server.ServerProcess):
    """A real `kvdepot serve` with tiers below RAM, in a private directory."""

    def __init__(self, workdir: Path, *tier_args: str) -> None:
        workdir.mkdir(mode=0o700, exist_ok=True)
        super().__init__(
            f"ipc://{workdir}/kvdepot.sock",
            capacity="512MiB",
            # A restarted server reads back from its tiers: its RAM is not kept (test_e2e.py keeps it).
            args=["--no-metrics", "--no-keep-pool", *tier_args],
            log_path=workdir / "server.log",
        )

    def config(self) -> dict[str, object]:
        return {
            "kv_connector": "KVDepotConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"kvdepot.address": self.address},
        }

    def figure(self, name: str):
        return self.stats().extra.get(name)

    def wait_for(self, name: str, value: object, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while self.figure(name) != value:
            assert time.monotonic() < deadline, f"{name} is {self.figure(name)!r}, not {value!r}"
            time.sleep(0.1)


@pytest.fixture
def workdir(short_tmp: Path) -> Path:
    """A short private directory for the servers' sockets, pools and disk tiers, removed at the end."""
    return short_tmp


_BASELINES: dict[int, list[list[int]]] = {}


@pytest.fixture
def baseline(tiny_llama, vllm_engine):
    """Outputs of an engine without kvdepot for the prompts asked, by seed, in one engine run."""

    def outputs(*seeds: int) -> list[list[int]]:
        todo = [seed for seed in seeds if seed not in _BASELINES]
        if todo:
            result = vllm_engine(tiny_llama, [prompt(seed) for seed in todo]).check()
            _BASELINES.update(zip(todo, ([out] for out in result.outputs), strict=True))
        return [out for seed in seeds for out in _BASELINES[seed]]

    return outputs


def test_a_restarted_server_hits_its_disk_tier(tiny_llama, vllm_engine, workdir, baseline):
    """Engine A stores through server 1; the server is killed (SIGKILL) and started again on the
    same --disk-dir; a fresh engine hits every chunk A stored, with identical output."""
    tier = ("--disk-dir", str(workdir / "disk"), "--disk-capacity", "1GiB")
    with TierServer(workdir / "a", *tier) as server:
        first = vllm_engine(tiny_llama, [prompt(1)], kv_transfer_config=server.config()).check()
        assert first.num_cached_tokens == [0]
        server.wait_for("tier:disk:objects", LENGTH // CHUNK)
        server.kill()
    with TierServer(workdir / "a", *tier) as server:
        assert server.stats().chunks == 0
        second = vllm_engine(tiny_llama, [prompt(1)], kv_transfer_config=server.config(), collect_metrics=True).check()
        assert second.num_cached_tokens == [(LENGTH // CHUNK) * CHUNK]
        assert server.figure("tier_read_hits") == LENGTH // CHUNK
    assert first.outputs == second.outputs == baseline(1)
    # vLLM's hits by source name the disk tier for every token the restarted server read back.
    by_source = {k: v for k, v in second.metrics.items() if k.startswith("vllm:prompt_tokens_cached_by_source")}
    assert by_source.get("vllm:prompt_tokens_cached_by_source{source=disk}") == (LENGTH // CHUNK) * CHUNK, by_source
    assert not by_source.get("vllm:prompt_tokens_cached_by_source{source=host}"), by_source


def test_an_engine_on_another_server_hits_through_a_valkey_cluster(
    tiny_llama, vllm_engine, workdir, valkey_cluster, baseline
):
    """Two servers with their own pools share a three-master Valkey cluster: an engine on server 2
    hits what an engine on server 1 stored, with identical output."""
    with (
        TierServer(workdir / "n1", "--remote", valkey_cluster.url) as one,
        TierServer(workdir / "n2", "--remote", valkey_cluster.url) as two,
    ):
        vllm_engine(tiny_llama, [prompt(2)], kv_transfer_config=one.config()).check()
        one.wait_for("tier:remote:writes", LENGTH // CHUNK)
        other = vllm_engine(tiny_llama, [prompt(2)], kv_transfer_config=two.config()).check()
        assert other.num_cached_tokens == [(LENGTH // CHUNK) * CHUNK]
        assert other.outputs == baseline(2)


def test_a_remote_tier_killed_mid_run_fails_no_request(tiny_llama, vllm_engine, workdir, valkey_server, baseline):
    """The remote tier dies while the server runs: every request completes with identical output
    (RAM only meanwhile); once it is back, the server writes behind again by itself."""
    with TierServer(workdir / "k", "--remote", valkey_server.url) as server:
        vllm_engine(tiny_llama, [prompt(3)], kv_transfer_config=server.config()).check()
        server.wait_for("tier:remote:writes", LENGTH // CHUNK)
        valkey_server.kill()
        during = vllm_engine(
            tiny_llama, [prompt(3), prompt(4)], kv_transfer_config=server.config()
        ).check()  # one RAM hit, one new prompt
        assert during.num_cached_tokens[0] == (LENGTH // CHUNK) * CHUNK
        assert during.outputs == baseline(3, 4)
        server.wait_for("tier:remote:state", "down")
        valkey_server.start()
        server.wait_for("tier:remote:state", "up", timeout=60)
        vllm_engine(tiny_llama, [prompt(5)], kv_transfer_config=server.config()).check()
        server.wait_for("tier:remote:writes", 2 * (LENGTH // CHUNK))  # what came during the outage stays in RAM


def test_corrupted_objects_in_either_tier_are_misses_never_wrong_output(
    tiny_llama, vllm_engine, workdir, valkey_server, baseline
):
    """A flipped byte in every object, on disk and in the remote tier: each is a miss (counted, and
    deleted), so the engine recomputes the prompt, with identical output."""
    disk = workdir / "disk"
    tiers = ("--disk-dir", str(disk), "--disk-capacity", "1GiB", "--remote", valkey_server.url)
    p = prompt(6)
    with TierServer(workdir / "c", *tiers) as server:
        vllm_engine(tiny_llama, [p], kv_transfer_config=server.config()).check()
        server.wait_for("tier:disk:objects", LENGTH // CHUNK)
        server.wait_for("tier:remote:writes", LENGTH // CHUNK)
    files = [path for path in (disk / "objects").rglob("*") if path.is_file()]
    for path in files:
        data = bytearray(path.read_bytes())
        data[-100] ^= 0xFF
        path.write_bytes(bytes(data))
    client = valkey_server.client()
    remote = client.keys("*")
    for key in remote:
        client.setrange(key, client.strlen(key) - 100, bytes([client.getrange(key, -100, -100)[0] ^ 0xFF]))
    assert len(files) == len(remote) == LENGTH // CHUNK
    with TierServer(workdir / "c", *tiers) as server:
        again = vllm_engine(tiny_llama, [p], kv_transfer_config=server.config()).check()
        assert again.num_cached_tokens == [0]
        assert again.outputs == baseline(6)
        assert server.figure("tier:disk:corrupt") >= 1
        assert server.figure("tier:remote:corrupt") >= 1
