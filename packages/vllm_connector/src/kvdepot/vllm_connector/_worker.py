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
  The load path is `_worker_loads.WorkerLoads`.
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
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from kvdepot.core import ParallelStrategy
from kvdepot.transport import DeadlineExceededError
from kvdepot.vllm_connector._chunk_slots import SlotLayout
from kvdepot.vllm_connector._config import DEFAULT_LOAD_STEP_SHARE
from kvdepot.vllm_connector._groups import CacheGroup
from kvdepot.vllm_connector._loads import LoadFailures
from kvdepot.vllm_connector._meta import KVDepotMetadata, KVDepotStats, KVDepotWorkerMetadata, LoadOp
from kvdepot.vllm_connector._pool_mapping import PoolSwitch, _PoolMapping
from kvdepot.vllm_connector._stores import StepStores
from kvdepot.vllm_connector._worker_loads import WorkerLoads

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from kvdepot.gpu import KVLayout
    from kvdepot.transport import CacheClient, HelloReply, RegisterReply
    from kvdepot.vllm_connector._health import ServerHealth

log = logging.getLogger("vllm.kvdepot.worker")


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
        self.prefault_pool = prefault_pool
        self.groups = groups
        self.skip_layers = skip_layers
        self.layout: KVLayout | None = None  # group 0's (the only one without a hybrid model)
        self.slots = SlotLayout.of([], self.blocks_per_chunk)  # every group's, once registered
        self._stats = KVDepotStats()
        self._stats_lock = threading.Lock()
        self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvdepot-copy")
        # Engine thread only: this step's stores from `step_started` to `wait_for_save`.
        self._step_stores: StepStores | None = None
        # Stores skipped since the last report because their slots came late: request -> first chunk.
        self._skipped: dict[str, int] = {}
        self.loads = WorkerLoads(
            self, fail_loads=fail_loads, load_delay=load_delay, load_step_share=load_step_share,
            engine_thread_loads=engine_thread_loads,
        )  # fmt: skip
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
        self.suspended = False

    # -- set-up ---------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layouts = self._layouts(kv_caches)
        self.slots = SlotLayout.of(layouts, self.blocks_per_chunk, self.slots.meter)
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

    @property
    def copier(self) -> ThreadPoolExecutor:
        """The copy thread: loads off the engine's thread, commits, and pool mappings, in order."""
        return self._copier

    def count(self, name: str, value: float = 1) -> None:
        """Add to a statistic (any thread)."""
        with self._stats_lock:
            self._stats.add(name, value)

    # -- the engine's step ------------------------------------------------------------

    def step_started(self, meta: KVDepotMetadata) -> None:
        """The engine binds a step's metadata, before its forward pass: the slots of the step's
        stores are asked for now, and the prefault pauses until `get_finished`, at the step's end."""
        self._between_steps.clear()
        self._idle_step = meta.idle
        self.loads.paced.step_started_at = time.monotonic()
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
            self.suspended
            or self.layout is None
            or pool is None
            or remap_pending
            or self.client.server_id != pool.server_id
            or not self.health.usable()
        ):
            self.count("store_skipped", len(meta.stores))
            return None
        try:
            return StepStores.reserve(
                self.client, meta.stores, rank=self.strategy.kv_rank, chunk_bytes=self.chunk_bytes,
                server_id=pool.server_id,
            )  # fmt: skip
        except Exception as exc:  # the client is closed
            log.warning("kvdepot stores of this step skipped, the slots could not be asked for: %s", exc)
            self.count("store_skipped", len(meta.stores))
            return None

    def start_load_kv(self, meta: KVDepotMetadata) -> None:
        """Hits that join this step are copied now, before its forward pass (vLLM calls this before
        it when the step has any: `has_sync_kv_loads`); the others start, and are reported in
        `get_finished` (`_worker_loads.py`)."""
        self.loads.start(meta.loads)

    def wait_for_save(self, meta: KVDepotMetadata) -> None:
        """The step's forward pass wrote its blocks: gather its stores now (the engine's thread),
        so no store reads a block after the step; the copy thread commits them."""
        stores, self._step_stores = self._step_stores, None
        if stores is None:
            return
        if self.suspended:
            self.count("store_skipped", len(stores.pending))
            stores.abort()
            return
        with self.pools.lock:  # no remap under the copy
            pool = self._pool
            if pool is None or pool.server_id != stores.server_id:
                self.count("store_skipped", len(stores.pending))
                stores.abort()
                return
            copiers = self.slots.engine_copiers(pool)
            stores.gather(
                lambda op, reply: self.slots.gather(op, reply, copiers),
                reservation_ttl=pool.reservation_ttl,
                count=self.count,
                server_failed=self._server_failed,
            )
        for op in stores.skipped:  # the scheduler plans them again (`take_worker_meta`)
            self._skipped[op.req_id] = min(op.first_chunk, self._skipped.get(op.req_id, op.first_chunk))
        if stores.gathered:
            self._copier.submit(
                stores.commit, pin_s=self.pin_s, count=self.count, chunk_bytes=self.chunk_bytes,
                server_failed=self._server_failed, before_commit=self.before_commit,
            )  # fmt: skip

    def wait_for_reservations(self, timeout: float) -> None:
        """Return once the server answered every reserve of the step bound last (at most
        ``timeout`` seconds). An engine's forward pass outlasts that round trip; a test that drives
        a step by hand calls this as its forward pass, so that a loaded machine's late answer does
        not skip the store (``wait_for_save`` waits only ``RESERVE_WAIT_S``)."""
        stores = self._step_stores
        if stores is not None:
            futures.wait([future for _, future in stores.pending], timeout=timeout)

    def wait_for_commits(self) -> None:
        """Return once every store gathered so far is committed (or aborted): the copy thread's
        queue runs in order. Nothing in vLLM's step needs this; tests and tools that look a
        store up at once do."""
        self._copier.submit(lambda: None).result()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(None: no request waits for a store, loads done or failed since the last call); the step's end."""
        self.loads.copy_paced(idle=self._idle_step)
        self._between_steps.set()
        if self._idle_step and self.loads.in_flight:
            self._idle_step = False
            self.loads.wait_all()
        recving = self.loads.take_done()
        return None, recving or None  # a store never holds a request's blocks past its step

    # -- sleep mode (vLLM 0.33+: `unregister_kv_caches`, `restore_kv_caches`) ------------------

    def suspend(self) -> None:
        """vLLM is about to release the KV cache's memory (sleep): every copy in flight ends first.

        Loads and stores already queued run to their end (a load's outcome is still reported in
        `get_finished`); until `resume`, loads fail (vLLM recomputes) and stores are skipped.
        """
        self.suspended = True
        if self._step_stores is not None:
            self._step_stores.abort()
            self._step_stores = None
        self.loads.suspend()
        self._copier.submit(lambda: None).result()  # the copy thread runs its queue in order
        log.info("kvdepot worker rank %d: copies drained, the KV cache may be released", self.strategy.rank)

    def resume(self) -> None:
        """vLLM restored the KV cache (wake-up) at the same addresses: copies may run again."""
        self.suspended = False
        log.info("kvdepot worker rank %d: KV cache restored, copies resume", self.strategy.rank)

    def _load(self, op: LoadOp, after: Any = None) -> None:
        """Copy a load on the copy thread (`WorkerLoads.load`)."""
        self.loads.load(op, after)

    def _server_failed(self, exc: BaseException) -> None:
        if isinstance(exc, DeadlineExceededError):
            self.health.report_timeout()

    # -- step results -------------------------------------------------------------------

    def take_worker_meta(self) -> KVDepotWorkerMetadata | None:
        """The loads that failed, how many bytes of hits were copied in how long, and the stores
        skipped because their slots came late, since the last call."""
        failed = self.failures.take_meta()
        nbytes, seconds = self.slots.meter.take()
        skipped, self._skipped = self._skipped, {}
        if failed is None and not nbytes and not skipped:
            return None
        return KVDepotWorkerMetadata(failed.failed if failed else set(), nbytes, seconds, skipped)

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
