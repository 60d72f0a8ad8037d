"""Lookups the server's slot index answers in the scheduling pass that asks, against a real server
that cannot answer meanwhile (stopped with SIGSTOP), inside vLLM's own scheduler.

Without the index, a request whose lookup reply is not in after the scheduler's short wait is
told "not yet" and starts a step later (`_index_lookups.py`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _scheduling import CHUNK, make_request, make_scheduler, runner_output, store_prefix

import kvdepot.server

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

#: Synchronous loads as by default (`_scheduling.make_scheduler` turns them off unless asked).
SYNC = {"kvdepot.sync_load_bytes": 256 << 20}


@contextlib.contextmanager
def stopped(server: kvdepot.server.ServerProcess) -> Iterator[None]:
    """The server process, stopped: it answers nothing until the block ends."""
    assert server.pid is not None
    os.kill(server.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.pid, signal.SIGCONT)


def wait_for_no_leases(server: kvdepot.server.ServerProcess) -> int:
    deadline = time.monotonic() + 10
    while (leases := server.stats().leases) and time.monotonic() < deadline:
        time.sleep(0.02)
    return leases


@pytest.fixture
def server(short_tmp: Path) -> Iterator[kvdepot.server.ServerProcess]:
    with kvdepot.server.ServerProcess(f"ipc://{short_tmp}/kvdepot.sock", capacity="64MiB") as proc:
        yield proc


def test_hits_and_misses_are_answered_from_the_slot_index_in_the_pass_that_asks(
    tiny_llama, server, stub_connector_registry
):
    """With the server stopped, a hit in its RAM joins the first pass as a synchronous load, and a
    miss computes in that pass too (the index is complete: the server has no tier below RAM). The
    server's late reply brings the hit's lease, held with the load until its step has ended."""
    scheduler: Any = make_scheduler(tiny_llama, server.address, sync=True, connector=SYNC)
    prefix = [29 + i % 1900 for i in range(3 * CHUNK)]
    assert store_prefix(scheduler, server.address, prefix) == 3
    hit = make_request(scheduler, "hit", [*prefix, 5, 6, 7], max_tokens=1)
    miss = make_request(scheduler, "miss", [31 + i % 1700 for i in range(2 * CHUNK + 3)], max_tokens=1)
    with stopped(server):
        scheduler.add_request(hit)
        scheduler.add_request(miss)
        out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"hit": 3, "miss": 2 * CHUNK + 3}
    assert [(op.req_id, op.sync, op.num_tokens) for op in out.kv_connector_metadata.loads] == [("hit", True, 3 * CHUNK)]
    side = scheduler.connector._scheduler
    assert side.stats.data["lookups_from_index"] == 2
    side.lookups._unleased["hit"][0].result(10)  # the reply landed (the server runs again)
    scheduler.update_from_output(out, runner_output(out, prefilling=scheduler.requests))
    out = scheduler.schedule()  # the load's step has not ended yet: its lease is held with it
    assert side.planner.is_loading("hit")
    assert server.stats().leases == 1
    scheduler.update_from_output(out, runner_output(out, prefilling=scheduler.requests))
    scheduler.schedule()  # now it has: the lease goes back with the load
    assert not side.planner.is_loading("hit")
    assert wait_for_no_leases(server) == 0
    scheduler.shutdown()


def test_a_partial_hit_waits_for_the_reply_when_a_tier_below_may_hold_the_rest(
    tiny_llama, short_tmp, stub_connector_registry
):
    """A server with a disk tier: the index holds only RAM, so a hit shorter than the lookup waits
    for the server's reply (which reads the disk), and one that covers every chunk asked does not."""
    args = ("--no-metrics", "--disk-dir", str(short_tmp / "disk"), "--disk-capacity", "64MiB")
    with kvdepot.server.ServerProcess(f"ipc://{short_tmp}/kvdepot.sock", capacity="64MiB", args=args) as server:
        scheduler: Any = make_scheduler(tiny_llama, server.address, sync=True, connector=SYNC)
        prefix = [37 + i % 1900 for i in range(3 * CHUNK)]
        other = [41 + i % 1900 for i in range(2 * CHUNK)]
        store_prefix(scheduler, server.address, prefix)
        store_prefix(scheduler, server.address, other)
        whole = make_request(scheduler, "whole", [*prefix, 5, 6, 7], max_tokens=1)
        part = make_request(scheduler, "part", [*other, *range(40, 40 + CHUNK), 5], max_tokens=1)
        with stopped(server):
            scheduler.add_request(whole)
            scheduler.add_request(part)
            out = scheduler.schedule()
            assert out.num_scheduled_tokens == {"whole": 3}  # "part" is told "not yet"
        assert [op.req_id for op in out.kv_connector_metadata.loads] == ["whole"]
        loads: list[tuple[str, int]] = []
        for _ in range(200):  # the reply lands once the server runs again
            scheduler.update_from_output(out, runner_output(out, prefilling=scheduler.requests))
            out = scheduler.schedule()
            loads = [(op.req_id, op.num_tokens) for op in out.kv_connector_metadata.loads]
            if loads:
                break
        assert loads == [("part", 2 * CHUNK)]  # what the reply said: the two chunks in RAM
        scheduler.shutdown()
