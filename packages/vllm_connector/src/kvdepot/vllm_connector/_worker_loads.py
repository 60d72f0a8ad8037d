"""The worker's load path: a step's loads from `start_load_kv` to `get_finished`'s report.

A load writes blocks of a request that vLLM keeps waiting, and that no other request can see,
until `get_finished` reports the load done or failed. Where it is copied:

- a hit that joins its step (`LoadOp.sync`): at once, on the engine's thread, before the forward
  pass; a failure is reported by its blocks in the same step;
- on a CPU engine: on the engine's thread at its steps' ends, within a share of each
  (`_paced_loads.py`);
- otherwise (a GPU, or the test knob that keeps loads in flight): on the worker's copy thread,
  after the work the engine queued so far.

While vLLM has released the KV cache (sleep mode) every load fails, and vLLM recomputes it.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, wait
from typing import TYPE_CHECKING, Any

from kvdepot.vllm_connector._paced_loads import PacedLoads

if TYPE_CHECKING:
    from kvdepot.vllm_connector._loads import Checked, PacedLoad
    from kvdepot.vllm_connector._meta import LoadOp
    from kvdepot.vllm_connector._pool_mapping import _PoolMapping
    from kvdepot.vllm_connector._worker import WorkerSide

log = logging.getLogger("vllm.kvdepot.worker")

#: A step that computes nothing waits this long at most for its loads before reporting them.
IDLE_STEP_LOAD_WAIT_S = 0.5


class WorkerLoads:
    """One worker's loads in flight (engine thread, but `load` and the hand-offs: copy thread)."""

    def __init__(
        self,
        worker: WorkerSide,
        *,
        fail_loads: bool,
        load_delay: float,
        load_step_share: float,
        engine_thread_loads: bool | None,
    ) -> None:
        """``worker``: its pool mapping, slots, copy thread, stats and failures (see `WorkerSide`)."""
        self.worker = worker
        self.fail_loads = fail_loads
        self.load_delay = load_delay
        self.load_step_share = load_step_share
        self.engine_thread_loads = engine_thread_loads
        self.in_flight: dict[str, tuple[LoadOp, Future[None]]] = {}
        self.paced = PacedLoads(share=load_step_share, check=self.check, loaded=self.loaded, hand_off=self.hand_off)

    def start(self, loads: list[LoadOp]) -> None:
        """Copy the loads that join this step now; start the others (`WorkerSide.start_load_kv`)."""
        worker = self.worker
        for op in loads:
            if op.sync:
                self.load_now(op)
        loads = [op for op in loads if not op.sync]
        if worker.suspended:  # reported as failed loads: vLLM recomputes them
            for op in loads:
                self.in_flight[op.req_id] = (op, worker.copier.submit(_refuse_asleep))
            return
        if self.on_engine_thread():
            for op in loads:
                self.in_flight[op.req_id] = (op, self.paced.add(op))
            return
        after = worker.slots.engine_event() if loads else None
        for op in loads:
            self.in_flight[op.req_id] = (op, worker.copier.submit(self.load, op, after))

    def load_now(self, op: LoadOp) -> None:
        """Copy a hit on the engine's thread before the step's forward pass (on CUDA, on the copier's
        side stream after the work queued so far, waited for); a failure is reported by its blocks
        in this step (`get_block_ids_with_load_errors`), and vLLM recomputes them."""
        worker = self.worker
        try:
            if worker.suspended:
                _refuse_asleep()
            with worker.pools.for_engine() as pool:
                if pool is None:
                    raise RuntimeError("the pool is not mapped, or a restarted server's pool waits to be mapped")
                checked = self.check(op, pool)
                worker.slots.scatter(
                    op, pool, worker.slots.engine_copiers(pool), checked, start=0, stop=len(checked.slots)
                )
            self.loaded(op, len(checked.slots))
        except Exception as exc:
            worker.failures.report(op, exc)

    def on_engine_thread(self) -> bool:
        """A CPU engine's loads are copied by the engine thread (`_paced_loads.py`), except with the
        test knob that keeps loads in flight on the copy thread."""
        if self.engine_thread_loads is not None:
            return self.engine_thread_loads
        return self.worker.slots.on_cpu and not self.load_delay

    def copy_paced(self, *, idle: bool) -> None:
        """The step's end: the engine's thread copies its share of the paced loads (an ``idle``
        step, which computes nothing, copies them whole)."""
        if self.paced:
            with self.worker.pools.for_engine() as pool:
                self.paced.copy(pool, self.worker.slots, whole=idle or self.load_step_share >= 1)

    def wait_all(self) -> None:
        """Wait a while for every load in flight (a step that computes nothing: its loads are
        reported from it rather than from a later one; the wait leaves the GIL to the copy thread)."""
        wait([future for _, future in self.in_flight.values()], timeout=IDLE_STEP_LOAD_WAIT_S)

    def take_done(self) -> set[str]:
        """The requests whose loads are done or failed since the last call (failures reported)."""
        done: set[str] = set()
        for req_id, (op, future) in list(self.in_flight.items()):
            if not future.done():
                continue
            del self.in_flight[req_id]
            done.add(req_id)
            exc = future.exception()
            if exc is not None:
                self.worker.failures.report(op, exc)
        return done

    def suspend(self) -> None:
        """The engine thread's loads not yet copied fail: vLLM recomputes them."""
        self.paced.fail_all(RuntimeError("the engine's KV cache was released (sleep mode) mid-load"))

    # -- on the copy thread ------------------------------------------------------------

    def load(self, op: LoadOp, after: Any = None) -> None:
        if self.load_delay:
            time.sleep(self.load_delay)
        pool = self.mapped_pool()
        checked = self.check(op, pool)
        self.worker.slots.scatter(op, pool, pool.copiers, checked, start=0, stop=len(checked.slots), after=after)
        self.loaded(op, len(checked.slots))

    def mapped_pool(self) -> _PoolMapping:
        """The mapped pool, the newest first (copy thread only); RuntimeError if none is."""
        pool = self.worker._current_pool()
        if self.worker.layout is None or pool is None:
            raise RuntimeError("the pool is not mapped")
        return pool

    def hand_off(self, paced: PacedLoad) -> None:
        """Finish a paced load on the copy thread (its first chunks already copied, if any)."""

        def finish() -> None:
            pool = self.mapped_pool()
            checked = self.check(paced.op, pool)
            total = len(checked.slots)
            self.worker.slots.scatter(paced.op, pool, pool.copiers, checked, start=paced.done_chunks, stop=total)
            self.loaded(paced.op, total)

        def settle(done: Future[None]) -> None:
            exc = done.exception()
            if exc is None:
                paced.future.set_result(None)
            else:
                paced.future.set_exception(exc)

        self.worker.copier.submit(finish).add_done_callback(settle)

    # -- any thread ----------------------------------------------------------------------

    def check(self, op: LoadOp, pool: _PoolMapping) -> Checked:
        """The load's slots, keys and blocks to skip per group, once it is checked against the mapped pool."""
        if self.fail_loads:
            raise RuntimeError("kvdepot.test.fail_loads is set")
        return self.worker.slots.check(op, pool, self.worker.strategy.kv_rank)

    def loaded(self, op: LoadOp, num_chunks: int) -> None:
        self.worker.count("loaded_tokens", op.num_tokens)
        self.worker.count("loaded_bytes", num_chunks * self.worker.chunk_bytes)


def _refuse_asleep() -> None:
    raise RuntimeError("the engine's KV cache is released (sleep mode): nothing was loaded")
