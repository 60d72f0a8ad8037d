"""The worker half of the connector: maps the pool, and moves blocks in and out of it.

Stores, and loads on a GPU, run on one copy thread of the worker's own, in the order the
steps asked for them, while the engine goes on with its next steps. Loads on a CPU engine run
on the engine's thread, at the end of a step, with torch's own OpenMP team (`PacedLoad`):

- A load (`start_load_kv`) writes blocks of a request that vLLM keeps waiting, and that no
  other request can see, until `get_finished` reports the load done or failed. On a CPU, a
  step that computes nothing copies its loads whole; a step that computes copies whole
  chunks of them for at most `load_step_share` of its own time, so running requests' steps
  stay as fast as without a load (a copy beside the forward pass would take a core from it).
- A store (`wait_for_save`, after the forward pass wrote the blocks) reserves slots, copies
  and commits. Its blocks cannot change under it: a running request's full blocks are never
  rewritten, a finished request's blocks are held until its stores are reported done, and a
  preempted request's stores are waited for before the step may reuse its blocks
  (`handle_preemptions`).
- The pool is mapped, and remapped after a server restart, on the copy thread only; the
  engine thread copies only while it holds the mapping's lock, so no copy ever runs on a
  mapping that is being closed.

With several KV-cache groups (a hybrid model) each group has its own `KVLayout` and copier
over the same pool mapping: a slot holds the chunk's blocks of group 0, then group 1, ...

A failed load is reported, never hidden.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

from kvdepot.core import SLOT_HEADER_BYTES, ParallelStrategy, slot_digest, slot_header_holds
from kvdepot.server import PoolError
from kvdepot.transport import DeadlineExceededError
from kvdepot.vllm_connector._config import DEFAULT_LOAD_STEP_SHARE
from kvdepot.vllm_connector._groups import NULL_BLOCK_ID, CacheGroup
from kvdepot.vllm_connector._handoff import wait_for_gate
from kvdepot.vllm_connector._loads import Checked, PacedLoad, SlotChangedError, leading_nulls
from kvdepot.vllm_connector._meta import KVDepotMetadata, KVDepotStats, KVDepotWorkerMetadata, LoadOp, StoreOp
from kvdepot.vllm_connector._pool_mapping import _PoolMapping

if TYPE_CHECKING:
    import torch

    from kvdepot.gpu import KVLayout
    from kvdepot.transport import CacheClient, HelloReply, RegisterReply
    from kvdepot.vllm_connector._health import ServerHealth

log = logging.getLogger("vllm.kvdepot.worker")


#: A step that computes nothing waits this long at most for its loads before reporting them.
IDLE_STEP_LOAD_WAIT_S = 0.5
#: A hybrid layout's fingerprint longer than this is sent as its digest (the wire allows 1024).
FINGERPRINT_MAX = 512
# A store copies into its reserved slots only within this fraction of the server's reservation
# TTL since it asked for them: the copy then has the rest of the TTL, and the quarantine's one
# more TTL, to land before the slots can go to another client.
LATE_COPY_FRACTION = 0.5


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
        store_gate: str | None = None,
    ) -> None:
        """``num_blocks``: the engine's blocks (vLLM's `KVCacheConfig.num_blocks`), which every
        group's layout must have; None leaves that unchecked. ``load_step_share``: see
        `DEFAULT_LOAD_STEP_SHARE` (1 copies every load whole in the step that starts it).
        ``engine_thread_loads``: loads are copied by the engine's thread (`_copy_paced`) rather
        than the copy thread; None: on a CPU, unless ``load_delay`` keeps loads in flight.
        ``pin_s``: the server keeps each store's chunks from eviction that long (a prefill
        engine's, until the decode engine has looked them up)."""
        self.client = client
        self.pin_s = pin_s
        self.store_gate = store_gate
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
        # A failed load is reported by its blocks only with one full-attention group: block ids
        # are per group, and a window cut back to a failed block would hold vLLM's null block.
        self._per_block_failures = len(groups) == 1 and groups[0].stable
        self.layout: KVLayout | None = None  # group 0's (the only one without a hybrid model)
        self.layouts: list[KVLayout] = []
        # Per group: where its blocks start in a slot, and how many bytes they take.
        self.group_offsets: list[int] = []
        self.group_bytes: list[int] = []
        self.chunk_bytes = 0
        self._stats = KVDepotStats()
        self._stats_lock = threading.Lock()
        self._pool: _PoolMapping | None = None
        # Held by the engine thread while it copies, and by the copy thread while it swaps mappings.
        self._pool_lock = threading.Lock()
        # A re-registration reply from the transport's settler thread, mapped by the copy thread
        # before its next copy (never while a copy may use the old mapping).
        self._lock = threading.Lock()
        self._pending: tuple[RegisterReply, str] | None = None
        self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvdepot-copy")
        # Engine thread only: copies in flight, and finished requests whose blocks we hold.
        self._loads: dict[str, tuple[LoadOp, Future[None]]] = {}
        self._stores: dict[str, list[Future[None]]] = {}
        self._held: set[str] = set()
        self._paced: list[PacedLoad] = []  # a CPU engine's loads, copied by its own thread (oldest first)
        self._step_started_at = time.monotonic()
        self._failed_blocks: set[int] = set()
        self._failed_requests: set[str] = set()
        self._step_meta = KVDepotWorkerMetadata()
        # Set between the engine's steps (and before the first): the pool's prefault runs only then.
        self._between_steps = threading.Event()
        self._between_steps.set()
        # This step computes no tokens: its `get_finished` waits for the loads in flight (engine thread).
        self._idle_step = False
        # Between vLLM's `unregister_kv_caches` (sleep) and `restore_kv_caches` (wake-up) the KV
        # cache's memory may be gone: nothing is copied then (engine thread only).
        self._suspended = False

    # -- set-up ---------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from kvdepot.gpu import KVLayout, UnsupportedLayoutError

        if len(self.groups) == 1:  # every layer, and layers that share another's KV as aliases
            per_group = [kv_caches]
        else:  # layers of different groups share tensors (one block belongs to one group at a time)
            per_group = [{n: kv_caches[n] for n in group.layer_names if n in kv_caches} for group in self.groups]
        # The engine's block size: vLLM splits an engine block into smaller kernel blocks where the
        # attention backend needs them (FlashMLA 64, FlashInfer at most 64, CPU multiples of 32),
        # while block ids count engine blocks; the layout merges the kernel blocks back.
        self.layouts = [
            KVLayout.from_kv_caches(caches, self.block_size, backend_hint=self.backend_hint) for caches in per_group
        ]
        for layout in self.layouts:
            if self.num_blocks is not None and layout.num_blocks != self.num_blocks:
                raise UnsupportedLayoutError(
                    f"the KV cache tensors hold {layout.num_blocks} blocks of {layout.block_size} tokens, the engine "
                    f"{self.num_blocks} of {self.block_size}: kvdepot cannot map its block ids to them"
                )
        self.layout = self.layouts[0]
        self.group_bytes = [layout.chunk_bytes(self.blocks_per_chunk) for layout in self.layouts]
        self.group_offsets = [sum(self.group_bytes[:i]) for i in range(len(self.group_bytes))]
        self.chunk_bytes = sum(self.group_bytes)
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
        with self._lock:  # a reply paired with the id of the server that sent it; else on_reconnect brings one
            if self._pending is None and (before is None or after == before):
                self._pending = (reply, after or "")
        pool = self._copier.submit(self._current_pool).result()
        log.info(
            "kvdepot worker rank %d registered: %s, %d bytes per chunk, pool %s, copies: %s",
            self.strategy.rank,
            self.fingerprint(),
            self.chunk_bytes,
            reply.pool.path,
            pool.copiers[0].describe() if pool is not None else "none (pool not mapped)",
        )

    def fingerprint(self) -> str:
        """The layout's fingerprint: every group's, with what kind of attention it is."""
        if len(self.layouts) == 1:
            return self.layouts[0].fingerprint()
        pairs = zip(self.groups, self.layouts, strict=True)
        text = "|".join(f"{group.describe()}:{layout.fingerprint()}" for group, layout in pairs)
        if len(text) > FINGERPRINT_MAX:
            text = f"hybrid{len(self.layouts)}:sha256:{hashlib.sha256(text.encode()).hexdigest()}"
        return text

    def on_reconnect(self, hello: HelloReply, register: RegisterReply | None) -> None:
        """The client re-registered with a (possibly restarted) server; runs on the transport's settler thread."""
        if register is not None:
            with self._lock:
                self._pending = (register, hello.server_id)

    def _current_pool(self) -> _PoolMapping | None:
        """The mapped pool, first switching to a newly registered one (copy thread only)."""
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is None or self.layout is None:
            return self._pool
        reply, server_id = pending
        if self._pool is not None and self._pool.server_id == server_id and self._pool.path == reply.pool.path:
            return self._pool
        try:
            pool = _PoolMapping(
                reply.pool.path, reply.pool.size, server_id, self.layouts,
                prefault=self.prefault_pool, may_run=self._between_steps,
            )  # fmt: skip
            pool.reservation_ttl = reply.reservation_ttl_s
        except (OSError, PoolError) as exc:
            log.warning("kvdepot worker could not map the pool %s: %s", reply.pool.path, exc)
            return self._pool
        with self._pool_lock:  # never under the engine thread's copy
            old, self._pool = self._pool, pool
            if old is not None:
                old.close()
        return pool

    def _add(self, name: str, value: float = 1) -> None:
        with self._stats_lock:
            self._stats.add(name, value)

    # -- the engine's step ------------------------------------------------------------

    def handle_preemptions(self, meta: KVDepotMetadata) -> None:
        """Before the step reuses blocks (preempted requests', or a window's), their stores must have read them."""
        for req_id in meta.preempted | meta.flush:
            for future in self._stores.pop(req_id, ()):
                future.exception()  # waits; a failure was logged by the copy itself

    def step_started(self, meta: KVDepotMetadata) -> None:
        """The engine binds a step's metadata, before its forward pass: the prefault pauses
        until `get_finished`, at the step's end."""
        self._between_steps.clear()
        self._idle_step = meta.idle
        self._step_started_at = time.monotonic()

    def start_load_kv(self, meta: KVDepotMetadata) -> None:
        self._held |= meta.held
        if self._suspended:  # reported as failed loads: vLLM recomputes them
            for op in meta.loads:
                self._loads[op.req_id] = (op, self._copier.submit(self._refuse_asleep))
            return
        if self._loads_on_engine_thread():
            for op in meta.loads:
                paced = PacedLoad(op)
                self._paced.append(paced)
                self._loads[op.req_id] = (op, paced.future)
            return
        after = self._engine_event() if meta.loads else None
        for op in meta.loads:
            self._loads[op.req_id] = (op, self._copier.submit(self._load, op, after))

    def _loads_on_engine_thread(self) -> bool:
        """A CPU engine's loads are copied by the engine thread (`_copy_paced`), except with the
        test knob that keeps loads in flight on the copy thread."""
        if self.engine_thread_loads is not None:
            return self.engine_thread_loads
        return self.layout is not None and self.layout.device.type == "cpu" and not self.load_delay

    def wait_for_save(self, meta: KVDepotMetadata) -> None:
        if not meta.stores or not self.strategy.stores:
            return
        if self._suspended:
            self._add("store_skipped", len(meta.stores))
            return
        future = self._copier.submit(self._store_all, meta.stores, self._engine_event())
        for op in meta.stores:
            self._stores.setdefault(op.req_id, []).append(future)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(held requests whose stores are done, loads done or failed) since the last call; the step's end."""
        if self._paced:
            self._copy_paced(whole=self._idle_step or self.load_step_share >= 1)
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
                log.warning("kvdepot load of %s failed; vLLM recomputes it: %s", req_id, exc)
                if self._per_block_failures:  # vLLM keeps what loaded before the first failed block
                    first = exc.first_chunk * self.blocks_per_chunk if isinstance(exc, SlotChangedError) else 0
                    self._failed_blocks.update(op.block_ids[0][max(first, op.skip_blocks) :])
                else:
                    self._failed_requests.add(req_id)  # vLLM recomputes the request
                self._step_meta.failed.add(req_id)  # counted once, by the scheduler side
        for req_id in [r for r, futures in self._stores.items() if all(f.done() for f in futures)]:
            del self._stores[req_id]
        sending = {req_id for req_id in self._held if req_id not in self._stores}
        self._held -= sending
        return sending or None, recving or None

    # -- sleep mode (vLLM 0.33+: `unregister_kv_caches`, `restore_kv_caches`) ------------------

    def suspend(self) -> None:
        """vLLM is about to release the KV cache's memory (sleep): every copy in flight ends first.

        Loads and stores already queued run to their end (a load's outcome is still reported in
        `get_finished`); until `resume`, loads fail (vLLM recomputes) and stores are skipped.
        """
        self._suspended = True
        for paced in self._paced:  # the engine thread's loads not yet copied fail: vLLM recomputes them
            paced.future.set_exception(RuntimeError("the engine's KV cache was released (sleep mode) mid-load"))
        self._paced.clear()
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
        self._copy_load(op, pool, pool.copiers, checked, start=0, stop=len(checked.slots), after=after)
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
        if not op.server_id or op.server_id != pool.server_id:
            raise RuntimeError(f"the lease is from server {op.server_id!r}, the mapped pool from {pool.server_id!r}")
        if op.slot_bytes != self.chunk_bytes:
            raise RuntimeError(f"the slots hold {op.slot_bytes} bytes, this worker's chunks are {self.chunk_bytes}")
        slots, keys = op.slots[self.strategy.kv_rank], op.keys[self.strategy.kv_rank]
        bpc = self.blocks_per_chunk
        if len(op.block_ids) != len(self.layouts):
            raise RuntimeError(f"blocks of {len(op.block_ids)} KV-cache groups for {len(self.layouts)} groups")
        if any(len(slots) * bpc != len(ids) for ids in op.block_ids) or len(keys) != len(slots):
            raise RuntimeError(f"{len(slots)} slots and {len(keys)} keys for {[len(i) for i in op.block_ids]} blocks")
        # vLLM's null block stands for blocks outside a sliding window: always leading, never written.
        skips = [max(op.skip_blocks, leading_nulls(ids)) for ids in op.block_ids]
        if any(NULL_BLOCK_ID in ids[skip:] for ids, skip in zip(op.block_ids, skips, strict=True)):
            raise RuntimeError("vLLM's null block lies after a block to load")
        if any(offset < SLOT_HEADER_BYTES or offset + self.chunk_bytes > pool.size for offset in slots):
            raise RuntimeError("a slot lies outside the mapped pool")
        return Checked(list(slots), list(keys), skips)

    def _copy_load(
        self, op: LoadOp, pool: _PoolMapping, copiers: list[Any], checked: Checked, *, start: int, stop: int,
        after: Any = None,
    ) -> None:  # fmt: skip
        """Copy the load's chunks ``start`` to ``stop`` from their slots into their blocks.

        The seqlock (kvdepot.core._slots): only chunks whose slots say they hold them are
        copied, and only those whose header did not change while the copy read them are kept.
        Raises `SlotChangedError` at the first that is not: the chunks before it are loaded.
        """
        bpc = self.blocks_per_chunk
        slots, keys, skips = checked
        before = [pool.header(offset) for offset in slots[start:stop]]
        held = [
            slot_header_holds(h, slot_digest(op.salt, k), self.chunk_bytes)
            for h, k in zip(before, keys[start:stop], strict=True)
        ]
        good = start + (held.index(False) if False in held else len(held))
        if good > start:
            for copier, ids, skip, at, size in zip(
                copiers, op.block_ids, skips, self.group_offsets, self.group_bytes, strict=True
            ):
                blocks = [ids[i * bpc : (i + 1) * bpc] for i in range(start, good)]
                offsets = [offset + at for offset in slots[start:good]]
                # The load's first `skip` blocks are vLLM's (computed, or its null block): not written.
                skip_blocks = max(0, skip - start * bpc)
                copier.scatter(offsets, blocks, skip_blocks=skip_blocks, slot_size=size, after=after).wait()
            good = next((i for i in range(start, good) if pool.header(slots[i]) != before[i - start]), good)
        if good < stop:
            raise SlotChangedError(good, len(slots))

    # -- on the engine thread (CPU) --------------------------------------------------------

    def _copy_paced(self, *, whole: bool) -> None:
        """Copy the loads waiting for the engine thread, oldest first: all of them (``whole``),
        or whole chunks until `load_step_share` of the step's time so far is spent, one at least."""
        started = time.monotonic()
        budget = (started - self._step_started_at) * self.load_step_share
        copied = False  # one chunk at least per step, whatever its budget
        with self._lock:
            remap_pending = self._pending is not None
        with self._pool_lock:
            pool = self._pool
            while self._paced:
                paced = self._paced[0]
                if remap_pending or pool is None or paced.op.server_id != pool.server_id:
                    # A newer mapping waits on the copy thread (a server restart): it loads this one.
                    self._paced.pop(0)
                    self._handoff(paced)
                    continue
                try:
                    if paced.checked is None:
                        paced.checked = self._check_load(paced.op, pool)
                    total = len(paced.checked.slots)
                    while paced.done_chunks < total:
                        if not whole and copied and time.monotonic() - started >= budget:
                            return  # the budget is spent: the next step goes on
                        start = paced.done_chunks
                        self._copy_load(paced.op, pool, pool.engine_copiers, paced.checked, start=start, stop=start + 1)
                        paced.done_chunks += 1
                        copied = True
                except Exception as exc:
                    self._paced.pop(0)
                    paced.future.set_exception(exc)
                    continue
                self._paced.pop(0)
                self._loaded(paced.op, total)
                paced.future.set_result(None)

    def _handoff(self, paced: PacedLoad) -> None:
        """Finish a paced load on the copy thread (its first chunks already copied, if any)."""

        def finish() -> None:
            pool = self._mapped_pool()
            checked = self._check_load(paced.op, pool)
            total = len(checked.slots)
            self._copy_load(paced.op, pool, pool.copiers, checked, start=paced.done_chunks, stop=total)
            self._loaded(paced.op, total)

        def settle(done: Future[None]) -> None:
            exc = done.exception()
            if exc is None:
                paced.future.set_result(None)
            else:
                paced.future.set_exception(exc)

        self._copier.submit(finish).add_done_callback(settle)

    def _store_all(self, ops: list[StoreOp], after: Any = None) -> None:
        """Reserve one step's chunks in one message, copy each request's, and commit them.

        Returns once the commits are answered, so a store reported done (`get_finished`) is
        visible to lookups; only the copy thread waits for that.
        """
        pool = self._current_pool()
        if self.layout is None or pool is None or self.client.server_id != pool.server_id or not self.health.usable():
            self._add("store_skipped", len(ops))
            return
        rank = self.strategy.kv_rank
        asked = time.monotonic()  # the reservations expire no sooner than their TTL from now
        with self.client.batch() as batch:
            futures = [batch.reserve(op.salt, op.keys[rank], self.chunk_bytes, server_id=pool.server_id) for op in ops]
        answers = []
        for op, future in zip(ops, futures, strict=True):
            # Each reply on its own: a failed reserve skips only its own store, and every
            # reservation that was granted is committed or aborted, never left to expire.
            try:
                reply = future.result()
            except Exception as exc:
                self._server_failed(exc)
                log.warning("kvdepot store of %s skipped, the server did not reserve: %s", op.req_id, exc)
                self._add("store_skipped")
                continue
            if reply.slots:
                answers.append(self._store(op, reply, pool, after, asked))
        for answer in answers:
            try:
                answer.result()
            except Exception as exc:
                self._server_failed(exc)
                log.warning("kvdepot commit or abort failed; the chunks stay invisible and expire: %s", exc)

    def _store(self, op: StoreOp, reply: Any, pool: _PoolMapping, after: Any, asked: float) -> Future[Any]:
        """Copy the reserved chunks into their slots; the future of the commit (or of the abort).

        No copy starts past half the reservation's TTL since it was asked for (a process paused,
        a copy thread stalled): the server hands expired slots out again after one more TTL of
        quarantine, and a copy landing then would overwrite another client's chunk.
        """
        bpc = self.blocks_per_chunk
        try:
            for copier, ids, at, size in zip(
                pool.copiers, op.block_ids, self.group_offsets, self.group_bytes, strict=True
            ):
                if pool.reservation_ttl and time.monotonic() - asked > pool.reservation_ttl * LATE_COPY_FRACTION:
                    self._add("store_late")
                    log.warning(
                        "kvdepot store of %s dropped: its reservation is %.1f s old, the server keeps it %.1f s",
                        op.req_id,
                        time.monotonic() - asked,
                        pool.reservation_ttl,
                    )
                    return self.client.abort(reply.reservation_id, server_id=pool.server_id)
                blocks = [ids[s.index * bpc : (s.index + 1) * bpc] for s in reply.slots]
                copier.gather(blocks, [s.offset + at for s in reply.slots], slot_size=size, after=after).wait()
        except Exception as exc:
            log.warning("kvdepot gather for %s failed, aborting its reservation: %s", op.req_id, exc)
            return self.client.abort(reply.reservation_id, server_id=pool.server_id)
        if self.store_gate is not None:
            wait_for_gate(self.store_gate)
        self._add("stored_chunks", len(reply.slots))
        self._add("stored_bytes", len(reply.slots) * self.chunk_bytes)
        return self.client.commit(reply.reservation_id, server_id=pool.server_id, pin_s=self.pin_s)

    def _server_failed(self, exc: BaseException) -> None:
        if isinstance(exc, DeadlineExceededError):
            self.health.report_timeout()

    # -- step results -------------------------------------------------------------------

    def take_worker_meta(self) -> KVDepotWorkerMetadata | None:
        meta, self._step_meta = self._step_meta, KVDepotWorkerMetadata()
        return meta if meta.failed else None

    def take_failed_blocks(self) -> set[int]:
        out, self._failed_blocks = self._failed_blocks, set()
        return out

    def take_failed_requests(self) -> set[str]:
        """Requests whose load failed, with several KV-cache groups or a window (else their blocks are reported)."""
        out, self._failed_requests = self._failed_requests, set()
        return out

    def take_stats(self) -> KVDepotStats | None:
        with self._stats_lock:
            if self._stats.is_empty():
                return None
            out, self._stats = self._stats, KVDepotStats()
        return out

    def shutdown(self) -> None:
        self._copier.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()
