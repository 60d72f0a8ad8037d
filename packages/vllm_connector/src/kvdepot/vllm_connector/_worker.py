"""The worker half of the connector: maps the pool, and moves blocks in and out of it.

Loads on a GPU, and the commits of stores, run on one copy thread of the worker's own, in the
order the steps asked for them, while the engine goes on with its next steps. Loads on a CPU
engine run on the engine's thread, at the end of a step, with torch's own OpenMP team
(`_paced_loads.py`); stores read the KV cache on the engine's thread, within their step:

- A load (`start_load_kv`) writes blocks of a request that vLLM keeps waiting, and that no
  other request can see, until `get_finished` reports the load done or failed. On a CPU, a
  step that computes nothing copies its loads whole; a step that computes copies whole
  chunks of them for at most `load_step_share` of its own time, so running requests' steps
  stay as fast as without a load (a copy beside the forward pass would take a core from it).
- A store reads the engine's KV cache only within the step that scheduled it (`_stores.py`):
  its slots are reserved when the step starts, its blocks are gathered at `wait_for_save` on
  the engine's thread (on CUDA on a side stream the compute stream then waits for), and the
  copy thread commits it after the step. vLLM may then hand out, zero, copy into or free any
  block at once, on either model runner: nothing is held and nothing waits at preemption.
- The pool is mapped, and remapped after a server restart, on the copy thread only; the
  engine thread copies only while it holds the mapping's lock, so no copy ever runs on a
  mapping that is being closed (`_pool_mapping.PoolSwitch`).

With several KV-cache groups (a hybrid model) each group has its own `KVLayout` and copier
over the same pool mapping: a slot holds the chunk's blocks of group 0, then group 1, ...
(`_chunk_slots.SlotLayout`: the checks and copies that depend on that arrangement alone).

A failed load is reported, never hidden.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

from kvdepot.core import ParallelStrategy
from kvdepot.transport import DeadlineExceededError
from kvdepot.vllm_connector._chunk_slots import SlotLayout
from kvdepot.vllm_connector._config import DEFAULT_LOAD_STEP_SHARE
from kvdepot.vllm_connector._groups import CacheGroup
from kvdepot.vllm_connector._loads import Checked, LoadFailures, PacedLoad
from kvdepot.vllm_connector._meta import KVDepotMetadata, KVDepotStats, KVDepotWorkerMetadata, LoadOp
from kvdepot.vllm_connector._paced_loads import PacedLoads
from kvdepot.vllm_connector._pool_mapping import PoolSwitch, _PoolMapping
from kvdepot.vllm_connector._stores import StepStores

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from kvdepot.gpu import KVLayout
    from kvdepot.transport import CacheClient, HelloReply, RegisterReply
    from kvdepot.vllm_connector._health import ServerHealth

log = logging.getLogger("vllm.kvdepot.worker")


#: A step that computes nothing waits this long at most for its loads before reporting them.
IDLE_STEP_LOAD_WAIT_S = 0.5


class WorkerSide:
    """Moves one rank's chunks between its paged KV cache and the server's pool."""

    def __init__(
        self,
        *,
        client: CacheClient,
        health: ServerHealth,
        strategy: ParallelStrategy,
        chunk_size: int,
        block_size: int,
        layout_name: str,
        model: str,
        backend_hint: str | None,
        fail_loads: bool = False,
        load_delay: float = 0.0,
        prefault_pool: bool = True,
        groups: tuple[CacheGroup, ...] = (CacheGroup(()),),
        num_blocks: int | None = None,
        load_step_share: float = DEFAULT_LOAD_STEP_SHARE,
        engine_thread_loads: bool | None = None,
        pin_s: float = 0.0,
        before_commit: Callable[[], None] | None = None,
        skip_layers: frozenset[str] = frozenset(),
    ) -> None:
        """``num_blocks``: the engine's blocks (vLLM's `KVCacheConfig.num_blocks`), which every
        group's layout must have; None leaves that unchecked. ``load_step_share``: see
        `DEFAULT_LOAD_STEP_SHARE` (1 copies every load whole in the step that starts it).
        ``engine_thread_loads``: loads are copied by the engine's thread (`_paced_loads.py`) rather
        than the copy thread; None: on a CPU, unless ``load_delay`` keeps loads in flight.
        ``pin_s``: the server keeps each store's chunks from eviction that long (a prefill
        engine's, until the decode engine has looked them up). ``skip_layers``: layers of the
        groups vLLM does not let an offloader store (`_groups.unserved_layers`): never copied.
        ``before_commit``: a test's hook, run on the copy thread before each store's commit."""
        self.client = client
        self.pin_s = pin_s
        self.before_commit = before_commit
        self.health = health
        self.strategy = strategy
        self.chunk_size = chunk_size
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.blocks_per_chunk = chunk_size // block_size
        self.layout_name = layout_name
        self.model = model
        self.backend_hint = backend_hint
        self.fail_loads = fail_loads
        self.load_delay = load_delay
        self.prefault_pool = prefault_pool
        self.load_step_share = load_step_share
        self.engine_thread_loads = engine_thread_loads
        self.groups = groups
        self.skip_layers = skip_layers
        self.layout: KVLayout | None = None  # group 0's (the only one without a hybrid model)
        self.slots = SlotLayout.of([], self.blocks_per_chunk)  # every group's, once registered
        self._stats = KVDepotStats()
        self._stats_lock = threading.Lock()
        self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvdepot-copy")
        # Engine thread only: loads in flight, and this step's stores from `step_started` to `wait_for_save`.
        self._loads: dict[str, tuple[LoadOp, Future[None]]] = {}
        self._step_stores: StepStores | None = None
        self._paced = PacedLoads(  # a CPU engine's loads, copied by its own thread
            share=load_step_share, check=self._check_load, loaded=self._loaded, hand_off=self._handoff
        )
        self.failures = LoadFailures(
            per_block=len(groups) == 1 and groups[0].stable, blocks_per_chunk=self.blocks_per_chunk
        )
        # Set between the engine's steps (and before the first): the pool's prefault runs only then.
        self._between_steps = threading.Event()
        self._between_steps.set()
        self.pools = PoolSwitch(prefault=prefault_pool, may_run=self._between_steps)
        # This step computes no tokens: its `get_finished` waits for the loads in flight (engine thread).
        self._idle_step = False
        # Between vLLM's `unregister_kv_caches` (sleep) and `restore_kv_caches` (wake-up) the KV
        # cache's memory may be gone: nothing is copied then (engine thread only).
        self._suspended = False

    # -- set-up ---------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layouts = self._layouts(kv_caches)
        self.slots = SlotLayout.of(layouts, self.blocks_per_chunk)
        self.layout = layouts[0]
        before = self.client.server_id
        try:
            reply = self.client.register(
                self.layout_name,
                self.chunk_size,
                self.chunk_bytes,
                self.strategy.kv_world_size,
                self.strategy.kv_rank,
                self.model,
                fingerprint=self.fingerprint(),
            ).result()
        except Exception as exc:
            log.warning(
                "kvdepot worker could not register with %s; running without the cache until it answers: %s",
                self.client.address,
                exc,
            )
            return
        after = self.client.server_id
        if before is None or after == before:  # a reply paired with the id of the server that sent it
            self.pools.offer(reply, after or "", unless_pending=True)  # else on_reconnect brings one
        pool = self._copier.submit(self._current_pool).result()
        log.info(
            "kvdepot worker rank %d registered: %s, %d bytes per chunk, pool %s, copies: %s",
            self.strategy.rank,
            self.fingerprint(),
            self.chunk_bytes,
            reply.pool.path,
            pool.copiers[0].describe() if pool is not None else "none (pool not mapped)",
        )

    def _layouts(self, kv_caches: dict[str, torch.Tensor]) -> list[KVLayout]:
        """Each KV-cache group's layout of the engine's tensors; refused unless each has the engine's blocks."""
        from kvdepot.gpu import KVLayout, UnsupportedLayoutError

        if len(self.groups) == 1:  # every layer, and layers that share another's KV as aliases
            per_group = [{n: t for n, t in kv_caches.items() if n not in self.skip_layers}]
        else:  # layers of different groups share tensors (one block belongs to one group at a time)
            per_group = [{n: kv_caches[n] for n in group.layer_names if n in kv_caches} for group in self.groups]
        # The engine's block size: vLLM splits an engine block into smaller kernel blocks where the
        # attention backend needs them (FlashMLA 64, FlashInfer at most 64, CPU multiples of 32),
        # while block ids count engine blocks; the layout merges the kernel blocks back.
        layouts = [
            KVLayout.from_kv_caches(caches, self.block_size, backend_hint=self.backend_hint) for caches in per_group
        ]
        for layout in layouts:
            if self.num_blocks is not None and layout.num_blocks != self.num_blocks:
                raise UnsupportedLayoutError(
                    f"the KV cache tensors hold {layout.num_blocks} blocks of {layout.block_size} tokens, the engine "
                    f"{self.num_blocks} of {self.block_size}: kvdepot cannot map its block ids to them"
                )
        return layouts

    @property
    def chunk_bytes(self) -> int:
        """A slot's payload: every group's blocks of one chunk (0 before registration)."""
        return self.slots.chunk_bytes

    @property
    def layouts(self) -> tuple[KVLayout, ...]:
        return self.slots.layouts

    @property
    def _pool(self) -> _PoolMapping | None:
        return self.pools.mapping

    def fingerprint(self) -> str:
        """The layout's fingerprint: every group's, with what kind of attention it is."""
        return self.slots.fingerprint(self.groups)

    def on_reconnect(self, hello: HelloReply, register: RegisterReply | None) -> None:
        """The client re-registered with a (possibly restarted) server; runs on the transport's settler thread."""
        if register is not None:
            self.pools.offer(register, hello.server_id)

    def _current_pool(self) -> _PoolMapping | None:
        """The mapped pool, first switching to a newly registered one (copy thread only)."""
        return self.pools.current(self.slots.layouts)

    def _add(self, name: str, value: float = 1) -> None:
        with self._stats_lock:
            self._stats.add(name, value)

    # -- the engine's step ------------------------------------------------------------

    def step_started(self, meta: KVDepotMetadata) -> None:
        """The engine binds a step's metadata, before its forward pass: the slots of the step's
        stores are asked for now, and the prefault pauses until `get_finished`, at the step's end."""
        self._between_steps.clear()
        self._idle_step = meta.idle
        self._paced.step_started_at = time.monotonic()
        if self._step_stores is not None:  # a step bound again without its wait_for_save: not in vLLM
            self._step_stores.abort()
        self._step_stores = self._reserve(meta)

    def _reserve(self, meta: KVDepotMetadata) -> StepStores | None:
        """The step's stores, their slots asked for; None when there are none, or no usable server."""
        if not meta.stores or not self.strategy.stores:
            return None
        pool = self._pool
        remap_pending = self.pools.remap_pending()
        if remap_pending:  # a restarted server's pool: mapped on the copy thread, used from the next step
            self._copier.submit(self._current_pool)
        if (
            self._suspended
            or self.layout is None
            or pool is None
            or remap_pending
            or self.client.server_id != pool.server_id
            or not self.health.usable()
        ):
            self._add("store_skipped", len(meta.stores))
            return None
        try:
            return StepStores.reserve(
                self.client, meta.stores, rank=self.strategy.kv_rank, chunk_bytes=self.chunk_bytes,
                server_id=pool.server_id,
            )  # fmt: skip
        except Exception as exc:  # the client is closed
            log.warning("kvdepot stores of this step skipped, the slots could not be asked for: %s", exc)
            self._add("store_skipped", len(meta.stores))
            return None

    def start_load_kv(self, meta: KVDepotMetadata) -> None:
        """Hits that join this step are copied now, before its forward pass (vLLM calls this before
        it when the step has any: `has_sync_kv_loads`); the others start, and are reported in
        `get_finished`."""
        for op in meta.loads:
            if op.sync:
                self._load_now(op)
        loads = [op for op in meta.loads if not op.sync]
        if self._suspended:  # reported as failed loads: vLLM recomputes them
            for op in loads:
                self._loads[op.req_id] = (op, self._copier.submit(self._refuse_asleep))
            return
        if self._loads_on_engine_thread():
            for op in loads:
                self._loads[op.req_id] = (op, self._paced.add(op))
            return
        after = self._engine_event() if loads else None
        for op in loads:
            self._loads[op.req_id] = (op, self._copier.submit(self._load, op, after))

    def _load_now(self, op: LoadOp) -> None:
        """Copy a hit on the engine's thread before the step's forward pass (on CUDA, on the copier's
        side stream after the work queued so far, waited for); a failure is reported by its blocks
        in this step (`get_block_ids_with_load_errors`), and vLLM recomputes them."""
        try:
            if self._suspended:
                self._refuse_asleep()
            with self.pools.for_engine() as pool:
                if pool is None:
                    raise RuntimeError("the pool is not mapped, or a restarted server's pool waits to be mapped")
                checked = self._check_load(op, pool)
                self.slots.scatter(op, pool, self._engine_copiers(pool), checked, start=0, stop=len(checked.slots))
            self._loaded(op, len(checked.slots))
        except Exception as exc:
            self.failures.report(op, exc)

    def _engine_copiers(self, pool: _PoolMapping) -> list[Any]:
        """The copiers the engine's thread uses: on a CPU with torch's OpenMP team, on CUDA the side streams'."""
        return pool.engine_copiers if self.layout is not None and self.layout.device.type == "cpu" else pool.copiers

    def _loads_on_engine_thread(self) -> bool:
        """A CPU engine's loads are copied by the engine thread (`_paced_loads.py`), except with the
        test knob that keeps loads in flight on the copy thread."""
        if self.engine_thread_loads is not None:
            return self.engine_thread_loads
        return self.layout is not None and self.layout.device.type == "cpu" and not self.load_delay

    def wait_for_save(self, meta: KVDepotMetadata) -> None:
        """The step's forward pass wrote its blocks: gather its stores now (the engine's thread),
        so no store reads a block after the step; the copy thread commits them."""
        stores, self._step_stores = self._step_stores, None
        if stores is None:
            return
        if self._suspended:
            self._add("store_skipped", len(stores.pending))
            stores.abort()
            return
        with self.pools.lock:  # no remap under the copy
            pool = self._pool
            if pool is None or pool.server_id != stores.server_id:
                self._add("store_skipped", len(stores.pending))
                stores.abort()
                return
            copiers = self._engine_copiers(pool)
            stores.gather(
                lambda op, reply: self.slots.gather(op, reply, copiers),
                reservation_ttl=pool.reservation_ttl,
                count=self._add,
                server_failed=self._server_failed,
            )
        if stores.gathered:
            self._copier.submit(
                stores.commit, pin_s=self.pin_s, count=self._add, chunk_bytes=self.chunk_bytes,
                server_failed=self._server_failed, before_commit=self.before_commit,
            )  # fmt: skip

    def wait_for_commits(self) -> None:
        """Return once every store gathered so far is committed (or aborted): the copy thread's
        queue runs in order. Nothing in vLLM's step needs this; tests and tools that look a
        store up at once do."""
        self._copier.submit(lambda: None).result()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(None: no request waits for a store, loads done or failed since the last call); the step's end."""
        if self._paced:
            with self.pools.for_engine() as pool:
                self._paced.copy(pool, self.slots, whole=self._idle_step or self.load_step_share >= 1)
        self._between_steps.set()
        if self._idle_step and self._loads:
            # Nothing else runs in this step: its loads are reported from it rather than from a
            # later one (waiting on the futures leaves the GIL to the copy thread meanwhile).
            self._idle_step = False
            wait([future for _, future in self._loads.values()], timeout=IDLE_STEP_LOAD_WAIT_S)
        recving: set[str] = set()
        for req_id, (op, future) in list(self._loads.items()):
            if not future.done():
                continue
            del self._loads[req_id]
            recving.add(req_id)
            exc = future.exception()
            if exc is not None:
                self.failures.report(op, exc)
        return None, recving or None  # a store never holds a request's blocks past its step

    # -- sleep mode (vLLM 0.33+: `unregister_kv_caches`, `restore_kv_caches`) ------------------

    def suspend(self) -> None:
        """vLLM is about to release the KV cache's memory (sleep): every copy in flight ends first.

        Loads and stores already queued run to their end (a load's outcome is still reported in
        `get_finished`); until `resume`, loads fail (vLLM recomputes) and stores are skipped.
        """
        self._suspended = True
        if self._step_stores is not None:
            self._step_stores.abort()
            self._step_stores = None
        # The engine thread's loads not yet copied fail: vLLM recomputes them.
        self._paced.fail_all(RuntimeError("the engine's KV cache was released (sleep mode) mid-load"))
        self._copier.submit(lambda: None).result()  # the copy thread runs its queue in order
        log.info("kvdepot worker rank %d: copies drained, the KV cache may be released", self.strategy.rank)

    def resume(self) -> None:
        """vLLM restored the KV cache (wake-up) at the same addresses: copies may run again."""
        self._suspended = False
        log.info("kvdepot worker rank %d: KV cache restored, copies resume", self.strategy.rank)

    @staticmethod
    def _refuse_asleep() -> None:
        raise RuntimeError("the engine's KV cache is released (sleep mode): nothing was loaded")

    def _engine_event(self) -> Any:
        """The end of the work the engine queued so far (on this, its thread's stream): the copy
        thread's copies wait for it, on a GPU, or a store could read blocks before this step's
        layers wrote them, and a load write blocks kernels queued earlier still use."""
        from kvdepot.gpu import compute_event

        return compute_event(self.layout.device) if self.layout is not None else None

    # -- on the copy thread ------------------------------------------------------------

    def _load(self, op: LoadOp, after: Any = None) -> None:
        if self.load_delay:
            time.sleep(self.load_delay)
        pool = self._mapped_pool()
        checked = self._check_load(op, pool)
        self.slots.scatter(op, pool, pool.copiers, checked, start=0, stop=len(checked.slots), after=after)
        self._loaded(op, len(checked.slots))

    def _loaded(self, op: LoadOp, num_chunks: int) -> None:
        self._add("loaded_tokens", op.num_tokens)
        self._add("loaded_bytes", num_chunks * self.chunk_bytes)

    def _mapped_pool(self) -> _PoolMapping:
        """The mapped pool, the newest first (copy thread only); RuntimeError if none is."""
        pool = self._current_pool()
        if self.layout is None or pool is None:
            raise RuntimeError("the pool is not mapped")
        return pool

    def _check_load(self, op: LoadOp, pool: _PoolMapping) -> Checked:
        """The load's slots, keys and blocks to skip per group, once it is checked against the mapped pool."""
        if self.fail_loads:
            raise RuntimeError("kvdepot.test.fail_loads is set")
        return self.slots.check(op, pool, self.strategy.kv_rank)

    def _handoff(self, paced: PacedLoad) -> None:
        """Finish a paced load on the copy thread (its first chunks already copied, if any)."""

        def finish() -> None:
            pool = self._mapped_pool()
            checked = self._check_load(paced.op, pool)
            total = len(checked.slots)
            self.slots.scatter(paced.op, pool, pool.copiers, checked, start=paced.done_chunks, stop=total)
            self._loaded(paced.op, total)

        def settle(done: Future[None]) -> None:
            exc = done.exception()
            if exc is None:
                paced.future.set_result(None)
            else:
                paced.future.set_exception(exc)

        self._copier.submit(finish).add_done_callback(settle)

    def _server_failed(self, exc: BaseException) -> None:
        if isinstance(exc, DeadlineExceededError):
            self.health.report_timeout()

    # -- step results -------------------------------------------------------------------

    def take_worker_meta(self) -> KVDepotWorkerMetadata | None:
        return self.failures.take_meta()

    def take_failed_blocks(self) -> set[int]:
        return self.failures.take_blocks()

    def take_failed_requests(self) -> set[str]:
        """Requests whose load failed, with several KV-cache groups or a window (else their blocks are reported)."""
        return self.failures.take_requests()

    def take_stats(self) -> KVDepotStats | None:
        with self._stats_lock:
            if self._stats.is_empty():
                return None
            out, self._stats = self._stats, KVDepotStats()
        return out

    def shutdown(self) -> None:
        if self._step_stores is not None:
            self._step_stores.abort()
        self._copier.shutdown(wait=True, cancel_futures=True)
        self.pools.close()
