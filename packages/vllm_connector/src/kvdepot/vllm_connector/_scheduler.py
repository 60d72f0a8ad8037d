"""The scheduler half of the connector: lookups and planning (leases: `_lease_book.py`).

All accounting is `kvdepot.core.Planner`'s; this half turns vLLM's scheduler calls into
planner events and never waits on the server beyond one bounded moment per step:

- A request is keyed, and its lookup queued, when vLLM admits it (`on_new_request`). The
  chunks vLLM's own prefix cache already holds are not asked for. The queued lookups of a
  scheduling pass leave together, as one message, the first time vLLM asks for a match.
- Hits are loaded asynchronously: the request waits in vLLM's waiting-for-remote-KV state,
  the worker copies them (on a GPU on its copy thread; on a CPU on the engine's thread at a
  step's end, paced), and vLLM adds the blocks to its prefix cache only
  once every worker has reported the copy. The leases are given back only then.
- A finished or preempted request's blocks go back to vLLM at once: the workers read a
  store's blocks within the step that scheduled it (`_stores.py`), so vLLM may hand them on,
  zero them or copy into them from the next step on, whichever model runner it uses.
- While the server is down or stuck, lookups are misses at once (`ServerHealth`).
- Roles (vLLM's ``kv_role``): a ``kv_producer`` stores and loads nothing, and names what it
  stored in its finished requests' ``kv_transfer_params``; a ``kv_consumer`` loads and stores
  nothing, and waits for the chunks a request's parameters name (`_handoff.py`).
- With several KV-cache groups (a hybrid or sliding-window model) the planner accounts
  for the request's positions; a chunk is loaded into, and stored from, the blocks of every
  group at those positions (`_groups.py` says what is done with blocks outside a window).
  A sliding-window block may go back to vLLM's pool while its request runs: a store takes a
  chunk only if vLLM's block table still holds every one of its blocks when it is planned.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import secrets
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from kvdepot.core import Namespace, Planner, RequestState, RequestTracker
from kvdepot.transport import DeadlineExceededError, LookupItem
from kvdepot.vllm_connector._groups import NULL_BLOCK_ID, CacheGroup, ours
from kvdepot.vllm_connector._handoff import DEFAULT_HANDOFF_TIMEOUT, handoff_params, namespace_digest
from kvdepot.vllm_connector._handoff_wait import Decision, HandoffWait
from kvdepot.vllm_connector._identity import lora_identity, request_marks
from kvdepot.vllm_connector._lease_book import LeaseBook
from kvdepot.vllm_connector._lookup_reply import LookupStatus, hit_sources, lookup_status, read_reply
from kvdepot.vllm_connector._meta import KVDepotMetadata, KVDepotStats, KVDepotWorkerMetadata, LoadOp, StoreOp
from kvdepot.vllm_connector._prefill import PrefillRate
from kvdepot.vllm_connector._record import Record
from kvdepot.vllm_connector._sync_guard import SyncGuard

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvdepot.transport import CacheClient
    from kvdepot.vllm_connector._health import ServerHealth
    from kvdepot.vllm_connector._kv_events import EventAnnouncer

log = logging.getLogger("vllm.kvdepot.scheduler")

_RUNNING = (RequestState.READY, RequestState.WAITING_FOR_LOAD)
#: A hit older than this (seconds, counted from when its lookup was sent) is looked up again
#: before it is loaded: its leases expire on the server after a minute (`kvdepot serve
#: --lease-ttl`), and an expired lease's slot may hold another chunk by then.
LEASE_REFRESH_S = 20.0
#: Once per scheduling pass the scheduler gives the pending lookups this long (seconds) to
#: land. The reply of a local server is usually a round trip (~0.1 ms) away; waiting on the
#: future reads it on the engine thread, so a hit or a miss costs the request no extra
#: engine step. The scheduler never waits longer than this for the server.
LOOKUP_YIELD_S = 0.002


class SchedulerSide:
    """Drives the planner from vLLM's scheduler hooks."""

    def __init__(
        self,
        namespace: Namespace,
        *,
        block_size: int,
        chunk_size: int,
        client: CacheClient,
        lookup_timeout: float,
        health: ServerHealth,
        groups: tuple[CacheGroup, ...] = (CacheGroup(()),),
        events: EventAnnouncer | None = None,
        loads: bool = True,
        stores: bool = True,
        producer: bool = False,
        handoff_timeout: float = DEFAULT_HANDOFF_TIMEOUT,
        sync_load_bytes: int = 0,
    ) -> None:
        """``events``: announces what kvdepot holds in the engine's KV events (`_kv_events.py`).
        ``loads``, ``stores``: what the engine's ``kv_role`` lets it do; ``producer``: a prefill
        engine, whose finished requests name their chunks for a decode engine (`_handoff.py`);
        ``handoff_timeout``: how long a handed-over request waits at most for those chunks.
        ``sync_load_bytes``: the most bytes of hits a step loads before its forward pass (0: none)."""
        self.planner = Planner(namespace, block_size=block_size, chunk_size=chunk_size)
        self.loads, self.stores, self.producer = loads, stores, producer
        self.handoff_timeout = handoff_timeout
        self.groups = groups
        self.events = events
        # With several groups, or one whose blocks vLLM may drop while their request runs (a
        # window), the blocks of each store are read from vLLM's block table when it is planned.
        self._windowed = len(groups) > 1 or not groups[0].stable
        self.client = client
        self.health = health
        self.kv_world_size = namespace.kv_world_size
        self.lookup_timeout = lookup_timeout
        # The engine's compute time per token, from its steps: sent with each lookup, so that a
        # server reading chunks through from a lower tier never waits longer than recomputing.
        self.prefill = PrefillRate()
        self.stats = KVDepotStats()
        self.kv_cache_manager: Any = None  # vLLM's, for the local prefix-cache hit at admission
        self._records: dict[str, Record] = {}
        self._uncacheable: set[str] = set()
        # Lookups keyed but not sent yet: they leave together (`_send_lookups`).
        self._queued: list[tuple[str, str, list[list[bytes]]]] = []
        self._loads: list[LoadOp] = []
        # Hits that join the step that finds them: the bytes this pass may still load so, and this
        # pass's such loads.
        self.sync_load_bytes = sync_load_bytes
        self._sync_budget = sync_load_bytes
        self._sync_loading: list[str] = []
        self._sync_guard = SyncGuard()  # their blocks, kept from other requests until known good
        # The last two steps scheduled: (whether it stored, its sync loads). A step has ended by the
        # time the one after the next is scheduled, with async scheduling too (one step in flight):
        # then its sync loads are done (their leases go back), and if it stored, waiting requests
        # whose hit stopped short look up again (`_stores_ended_at`).
        self._recent_steps: collections.deque[tuple[bool, list[str]]] = collections.deque()
        self._stores_ended_at = 0.0
        self.leases = LeaseBook(client, namespace.kv_world_size)
        self._yielded = False

    # -- vLLM scheduler hooks --------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        """vLLM admitted the request: key it and queue its lookup."""
        record = self._track(request)
        if record is not None and self.loads and not getattr(request, "skip_reading_prefix_cache", False):
            self._start_lookup(record, self._local_hit_tokens(request))

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        req_id = request.request_id
        if self._sync_guard.reaches(req_id, request.block_hashes, num_computed_tokens // self.planner.block_size):
            self.stats.add("sync_share_waits")  # its local hit takes blocks a sync load is still filling
            return None, False
        record = self._records.get(req_id) or self._track(request)
        if record is None:
            return 0, False
        tracker = self.planner.get(req_id)
        if tracker.state in _RUNNING:  # back in the waiting queue: preempted, or after a failed load
            self.planner.on_preempted(req_id)
            self._flush_releases()
        # Whatever kvdepot adds, the engine's own hit counts as computed for store planning.
        self.planner.on_engine_hit(req_id, num_computed_tokens)
        if not self.loads or record.load_failed or getattr(request, "skip_reading_prefix_cache", False):
            return 0, False  # a request that skips reading is still stored
        for _ in range(2):  # a reply answered for a local hit vLLM has lost since is asked again
            outdated = tracker.state is RequestState.LOOKED_UP and self._outdated(tracker, request, num_computed_tokens)
            if (tracker.state in (RequestState.NEW, RequestState.PREEMPTED) or outdated) and not self._start_lookup(
                record, num_computed_tokens
            ):
                return 0, False
            if tracker.state is RequestState.PREFETCHING:
                self._send_lookups()
                if not self._poll_lookup(record):
                    return None, False
            if num_computed_tokens >= tracker.lookup_first * self.planner.chunk_size:
                break
        num = self.planner.num_tokens_to_load(req_id, num_computed_tokens, request.num_tokens)
        if record.handoff is not None and self._handoff_pending(record, num_computed_tokens, num_computed_tokens + num):
            return None, False
        record.sync_load = num > 0 and self._joins_this_step(record, num_computed_tokens, num)
        return num, num > 0 and not record.sync_load

    def _joins_this_step(self, record: Record, num_computed_tokens: int, num: int) -> bool:
        """Whether a hit loads before the forward pass of the step that schedules it: its chunks are
        all in the server's RAM (none just read back from a tier below), the model has one
        full-attention KV-cache group (a failed load is then reported block by block), and its
        bytes fit in what is left of this pass's `sync_load_bytes`."""
        if not self.sync_load_bytes or self._windowed or record.read_back[1]:
            return False
        size = self.planner.chunk_size
        chunks = -(-(num_computed_tokens + num) // size) - num_computed_tokens // size
        need = chunks * record.slot_bytes
        if need > self._sync_budget:
            return False
        self._sync_budget -= need
        return True

    def _outdated(self, tracker: RequestTracker, request: Request, num_computed_tokens: int) -> bool:
        """True when a request's lookup reply, read while it waited, may no longer be what the
        server holds for it now that vLLM asks again (it is then looked up again):

        - vLLM's own prefix hit shrank below the chunks the lookup left out (they were in vLLM's
          cache at admission, evicted since): the hit no longer follows on from it;
        - the hit stops short of the prompt's last full chunk, and a step of this engine that
          stored chunks has ended since the lookup went out: a request with the same prefix
          that ran meanwhile may have committed the rest (what a queue of requests sharing
          prefixes does under a small KV cache);
        - its leases are close to expiring (`LEASE_REFRESH_S`).
        """
        size = self.planner.chunk_size
        if num_computed_tokens < tracker.lookup_first * size:
            return True
        if tracker.hit_chunks < (request.num_tokens - 1) // size and self._stores_ended_at > tracker.hit_at:
            return True
        return bool(time.monotonic() - tracker.hit_at > LEASE_REFRESH_S)

    def _handoff_pending(self, record: Record, num_computed_tokens: int, have: int) -> bool:
        """True while a handed-over request should wait (`_handoff_wait.py` decides; this supplies
        the clock, looks the request up again, and says why it stopped waiting)."""
        assert record.handoff is not None
        decision = record.handoff.step(have, time.monotonic(), record.sent_at)
        if decision is Decision.GIVE_UP:
            self.stats.add("handoff_timeouts")
            log.warning(
                "kvdepot: request %s waited %.1f s for the %d tokens its prefill engine stored and found %d; "
                "it computes the rest (kv_load_failure_policy=recompute)",
                record.request.request_id,
                self.handoff_timeout,
                record.handoff.tokens,
                have,
            )
        elif decision is Decision.POLL:  # the producer's store may have landed
            self.stats.add("handoff_polls")
            if not self._start_lookup(record, num_computed_tokens):
                return False
            self._send_lookups()
        return decision.waits

    def update_state_after_alloc(
        self, request: Request, block_ids: tuple[list[int], ...], num_external_tokens: int
    ) -> None:
        """vLLM allocated the request's blocks, one list per KV-cache group (vLLM's, all of them)."""
        req_id = request.request_id
        block_ids = ours(self.groups, block_ids)
        if req_id not in self._records:
            return
        tracker = self.planner.get(req_id)
        if tracker.state not in (RequestState.LOOKED_UP, RequestState.NEW, RequestState.PREEMPTED):
            return  # a request promoted after its load, or after a failed one, is allocated again
        plan = self.planner.on_allocated(req_id, block_ids[0], num_external_tokens)
        if plan is not None:
            bpc = self.planner.blocks_per_chunk
            start, end = plan.first_chunk * bpc, (plan.first_chunk + plan.num_chunks) * bpc
            self._loads.append(
                LoadOp(
                    req_id=req_id,
                    server_id=plan.source,
                    slots=[list(rank_slots) for rank_slots in plan.slots],
                    block_ids=[list(group[start:end]) for group in block_ids],
                    skip_blocks=plan.skip_blocks,
                    num_tokens=plan.num_tokens,
                    slot_bytes=self._records[req_id].slot_bytes,
                    salt=plan.cache_salt,
                    keys=[list(rank_keys) for rank_keys in plan.keys],
                    sync=self._records[req_id].sync_load,
                )
            )
            if self._records[req_id].sync_load:
                self._sync_loading.append(req_id)
                # Its blocks from the first loaded one on: the loaded ones, and those computed
                # over them in the same step, which vLLM caches now too.
                self._sync_guard.loading(req_id, request.block_hashes[start:], block_ids[0][start:])
        self._flush_releases()

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVDepotMetadata:
        self._yielded = False
        self._sync_budget = self.sync_load_bytes
        if len(self._recent_steps) >= 2:  # that step has ended
            stored, synced = self._recent_steps.popleft()
            if stored:
                self._stores_ended_at = time.monotonic()
            for req_id in synced:  # copied (a failure was reported already)
                self._sync_guard.settle(req_id)
                if self.planner.end_preempted_load(req_id):
                    continue  # preempted before that step ended (and maybe loading again): its leases only
                if self.planner.is_loading(req_id):  # (also once the request finished: its leases go back)
                    self.planner.on_load_done(req_id)
        self.prefill.step_started(scheduler_output.total_num_scheduled_tokens, time.monotonic())
        self._send_lookups()
        preempted = set(scheduler_output.preempted_req_ids or ())
        idle = scheduler_output.total_num_scheduled_tokens == 0
        meta = KVDepotMetadata(loads=self._loads, idle=idle)
        self._loads = []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            first = ours(self.groups, new.block_ids)[0]
            self._plan_store(meta, new.req_id, scheduled.get(new.req_id, 0), first, replace=True)
        cached = scheduler_output.scheduled_cached_reqs
        for index, req_id in enumerate(cached.req_ids):
            new_blocks = ours(self.groups, cached.new_block_ids[index])
            resumed = req_id in cached.resumed_req_ids
            self._plan_store(
                meta, req_id, scheduled.get(req_id, 0), new_blocks[0] if new_blocks else [], replace=resumed
            )
        # A request preempted outside `schedule` (reset_prefix_cache(reset_running_requests=True))
        # is named preempted by the very pass that resumes it: it was admitted again (a load, or
        # scheduled new or resumed), and must not be taken for preempted now.
        self._recent_steps.append((bool(meta.stores), self._sync_loading))
        self._sync_loading = []
        readmitted = {op.req_id for op in meta.loads} | {new.req_id for new in scheduler_output.scheduled_new_reqs}
        for req_id in preempted - readmitted - set(cached.resumed_req_ids):
            if req_id in self.planner and self.planner.get(req_id).state in _RUNNING:
                self.planner.on_preempted(req_id)
        self._flush_releases()
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self.prefill.step_done(time.monotonic())
        worker_meta = output.kv_connector_worker_meta
        failed = worker_meta.failed if isinstance(worker_meta, KVDepotWorkerMetadata) else set()
        # A worker reports its failed load in the step it failed, and vLLM passes that on at once;
        # but it lists the load as finished only once every worker reported it, which with several
        # ranks can be steps later (and in a step whose reports say nothing of it): remember it.
        for req_id in failed:
            self._evict_failed_sync_load(req_id)
            record = self._records.get(req_id)
            if record is not None and self.planner.is_loading(req_id):
                record.load_failed = True
                if record.sync_load:  # never in finished_recving: vLLM cut its computed tokens already
                    self.stats.add("load_failures")
                    self.planner.on_load_failed(req_id, record.request.num_computed_tokens)
        # vLLM has already cut a failed request's computed tokens back to its first failed block.
        for req_id in output.finished_recving or ():
            if not self.planner.is_loading(req_id):
                self.planner.end_preempted_load(req_id)  # preempted while it loaded: its leases go back
                continue
            record = self._records.get(req_id)
            if req_id in failed or (record is not None and record.load_failed):
                self.stats.add("load_failures")
                if record is not None:
                    record.load_failed = True
                computed = record.request.num_computed_tokens if record is not None else 0
                self.planner.on_load_failed(req_id, computed)
            else:
                self.planner.on_load_done(req_id)
        self._flush_releases()

    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...] = ()
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM is done with the request: (False, the parameters a decode engine needs, if any).

        ``block_ids``: its blocks, one list per KV-cache group, as vLLM frees them; never held.
        """
        req_id = request.request_id
        self._uncacheable.discard(req_id)
        record = self._records.pop(req_id, None)
        if record is None:
            return False, None
        params = self._handoff_of(request)
        prefetching = self.planner.get(req_id).state is RequestState.PREFETCHING
        self._queued = [item for item in self._queued if item[0] != req_id]
        if _was_aborted(request):
            self.planner.abort(req_id)
        else:
            self.planner.finish(req_id)
        if prefetching:
            # The lookup is queued or out: whatever leases its reply brings go back on arrival.
            self.planner.on_lookup_done(req_id, [0], ())
            self._release_on_arrival(record)
        self._flush_releases()
        # Its blocks go back to vLLM now: the workers read every store's blocks within its step. (A
        # request still loading keeps them through vLLM itself until the load is reported.)
        return False, params

    def _handoff_of(self, request: Request) -> dict[str, Any] | None:
        """A producer's parameters for the decode engine: the chunks of the request it stored (or
        found stored), under its namespace. Also for a ``kv_both`` engine's request that asks for
        them (``do_remote_decode``, as vLLM's proxies send the prefill request)."""
        asked = (getattr(request, "kv_transfer_params", None) or {}).get("do_remote_decode")
        if not self.stores or not (self.producer or asked) or _was_aborted(request):
            return None
        return handoff_params(self._handoff_digest(), self.planner.get(request.request_id).next_store_chunk)

    def _handoff_digest(self) -> str:
        """The digest of the keys' namespace now (a cache reset starts a new epoch: a new digest)."""
        return namespace_digest(self.planner.namespace, self.planner.chunk_size)

    def reset(self) -> bool:
        """Make everything stored before unreachable from this engine (new weights): a fresh epoch."""
        # vLLM runs this even when its own prefix-cache reset failed because blocks are in use
        # (`reset_connector_cache() and reset_successful`). Requests running through it would
        # then store KV computed before the reset (old weights) under the new epoch's keys, so
        # refuse on vLLM's own condition: any block in use besides the null block.
        pool = getattr(self.kv_cache_manager, "block_pool", None)
        if pool is not None and pool.get_num_free_blocks() < pool.num_gpu_blocks - 1:
            log.warning("kvdepot cache reset refused: vLLM still holds KV blocks, so its own reset failed too")
            return False
        self.planner.new_epoch(secrets.token_hex(16))
        self._flush_releases()
        if self.events is not None:
            self.events.reset()
        log.info("kvdepot cache reset: this engine's keys start a new epoch; nothing stored before can be a hit")
        return True

    def shutdown(self) -> None:
        for req_id in list(self._records):
            self.planner.abort(req_id)
        self._flush_releases()

    # -- internals --------------------------------------------------------------------

    def _evict_failed_sync_load(self, req_id: str) -> None:
        """Take a failed sync load's blocks out of vLLM's prefix cache (`_sync_guard.py`): the
        request recomputes into them, and nobody else can take them for a hit in the meantime,
        nor after it was aborted."""
        blocks = self._sync_guard.failed(req_id)
        if not blocks:
            return
        try:
            self.kv_cache_manager.evict_blocks(set(blocks))
        except Exception:  # a vLLM without it: the blocks stay cached, as vLLM's own recovery leaves them
            log.exception("kvdepot: could not take the blocks of %s's failed load out of vLLM's prefix cache", req_id)

    def _track(self, request: Request) -> Record | None:
        """The request's record, created on first sight; None if it cannot be cached."""
        req_id = request.request_id
        if req_id in self._uncacheable:
            return None
        marks = request_marks(request)
        if marks is None:
            self._uncacheable.add(req_id)
            return None
        self.planner.add_request(req_id, cache_salt=request.cache_salt, lora=lora_identity(request), marks=marks)
        record = self._records[req_id] = Record(request)
        if self.loads:
            params = getattr(request, "kv_transfer_params", None)
            record.handoff, why_not = HandoffWait.named_by(
                params,
                self._handoff_digest(),
                num_tokens=request.num_tokens,
                chunk_size=self.planner.chunk_size,
                deadline=time.monotonic() + self.handoff_timeout,
            )
            if why_not is not None:
                log.warning("kvdepot: request %s is not waited for as a handoff: %s", req_id, why_not)
        return record

    def _local_hit_tokens(self, request: Request) -> int:
        """Tokens vLLM's own prefix cache holds for the request now (0 if unknown)."""
        manager = self.kv_cache_manager
        if manager is None or not getattr(manager, "enable_caching", False):
            return 0
        try:
            hit: int = manager.coordinator.find_longest_cache_hit(request.block_hashes, request.num_tokens - 1)[1]
        except Exception:  # a vLLM whose internals differ: ask for every chunk
            return 0
        return hit

    def _start_lookup(self, record: Record, local_tokens: int) -> bool:
        """Queue a lookup of the chunks past the local hit; False if the server is not usable."""
        if not self.health.usable():
            self.stats.add("lookup_misses_server_down")
            return False
        req_id = record.request.request_id
        keys = self.planner.start_lookup(req_id, record.request.all_token_ids, local_tokens=local_tokens)
        self._flush_releases()  # a repeated lookup gives back the old leases
        if keys is not None:
            record.lookup, record.sent_at, record.keys = None, time.monotonic(), keys
            self._queued.append((req_id, self.planner.get(req_id).cache_salt, keys))
        return True

    def _plan_store(
        self, meta: KVDepotMetadata, req_id: str, num_tokens: int, block_ids: list[int], *, replace: bool
    ) -> None:
        record = self._records.get(req_id)
        if not self.stores or record is None or self.planner.get(req_id).state not in _RUNNING:
            return
        if len(getattr(record.request, "mm_features", None) or ()) != len(self.planner.get(req_id).marks):
            return  # a streaming session got media after it was keyed: its keys no longer describe its KV
        plan = self.planner.on_scheduled(
            req_id, num_tokens, record.request.all_token_ids, block_ids, replace_blocks=replace
        )
        if plan is None:
            return
        keys, blocks = [list(k) for k in plan.keys], [list(plan.block_ids)]
        if self.events is not None:
            self.events.expect(record.request, plan.first_chunk, keys, plan.cache_salt)
        if self._windowed:
            keys, blocks = self._windowed_store(req_id, plan.first_chunk, keys)
            if not blocks[0]:
                return
        meta.stores.append(StoreOp(req_id=req_id, salt=plan.cache_salt, keys=keys, block_ids=blocks))

    def _windowed_store(
        self, req_id: str, first_chunk: int, keys: list[list[bytes]]
    ) -> tuple[list[list[bytes]], list[list[int]]]:
        """The chunks of a store whose blocks still hold their tokens in every group, from vLLM's block table.

        A chunk with a block vLLM dropped from the window (its null block) is not stored by
        this request; the blocks still in the table are read by the workers within this step.
        """
        manager = self.kv_cache_manager
        groups = ours(self.groups, manager.get_block_ids(req_id)) if manager is not None else ()
        bpc = self.planner.blocks_per_chunk
        kept: list[int] = []
        blocks: list[list[int]] = [[] for _ in self.groups]
        for index in range(len(keys[0])):
            start = (first_chunk + index) * bpc
            chunk = [group[start : start + bpc] for group in groups]
            if len(chunk) != len(self.groups) or any(
                len(ids) != bpc or NULL_BLOCK_ID in ids for ids in chunk
            ):  # fmt: skip
                continue
            kept.append(index)
            for out, ids in zip(blocks, chunk, strict=True):
                out.extend(ids)
        return [[rank_keys[i] for i in kept] for rank_keys in keys], blocks

    def _send_lookups(self) -> None:
        """Sends every queued lookup as one message."""
        if not self._queued:
            return
        queued, self._queued = self._queued, []
        items = [LookupItem(salt=salt, keys=rank_keys) for _req, salt, keys in queued for rank_keys in keys]
        server_id = self.client.server_id or ""
        try:
            per_chunk = self.prefill.seconds_for(self.planner.chunk_size)
            future: Future[Any] = self.client.lookup(items, prefill_s_per_chunk=per_chunk)
        except Exception as exc:  # the client is closed: every lookup is a miss
            log.warning("kvdepot lookup could not be sent, counting %d requests as misses: %s", len(queued), exc)
            future = Future()
            future.set_exception(exc)
        for index, (req_id, _salt, _keys) in enumerate(queued):
            record = self._records[req_id]
            record.lookup, record.first_item, record.server_id = future, index * self.kv_world_size, server_id

    def _poll_lookup(self, record: Record) -> bool:
        """Apply the lookup reply if it is in; True once the request is looked up (`_lookup_reply.py`
        reads the reply, this is the I/O around it)."""
        future = record.lookup
        assert future is not None
        if not future.done() and not self._yielded:
            self._yielded = True
            with contextlib.suppress(TimeoutError):
                future.exception(timeout=LOOKUP_YIELD_S)  # lets a reply on its way in arrive
        status = lookup_status(future.done(), time.monotonic() - record.sent_at, self.lookup_timeout)
        if status is LookupStatus.TIMED_OUT:
            req_id = record.request.request_id
            log.warning("kvdepot lookup for %s took over %.1fs; counting it as a miss", req_id, self.lookup_timeout)
            self.health.report_timeout()
            self.stats.add("lookup_misses_timeout")
            self._release_on_arrival(record)
            self.planner.on_lookup_done(req_id, [0], ())
        elif status is LookupStatus.ANSWERED:
            record.lookup = None
            self._apply_reply(record, self._reply_results(record, future))
        return status is not LookupStatus.WAITING

    def _apply_reply(self, record: Record, results: list[Any]) -> None:
        """Feed a request's lookup reply, read (`read_reply`), to the planner, its record, its KV
        events and the counters."""
        req_id = record.request.request_id
        tracker = self.planner.get(req_id)
        reading = read_reply(
            results,
            record.first_item,
            world=self.kv_world_size,
            # The slots are only meaningful in the pool of the server that answered: if the
            # client reconnected to another instance meanwhile, the reply counts as a miss.
            same_server=bool(record.server_id) and record.server_id == self.client.server_id,
            lookup_first=tracker.lookup_first,
        )
        record.slot_bytes, record.read_back = reading.slot_bytes, reading.read_back
        if self.events is not None and reading.hit_chunks > 0:
            hit_keys = [rank_keys[: reading.hit_chunks] for rank_keys in record.keys]
            self.events.hit(record.request, tracker.lookup_first, hit_keys, tracker.cache_salt)
        self.planner.on_lookup_done(
            req_id, reading.hits, reading.leases, slots=reading.slots, source=record.server_id, at=record.sent_at
        )
        self.stats.add("lookups")
        self.stats.add("lookup_seconds_sum", time.monotonic() - record.sent_at)
        hit_chunks = tracker.hit_chunks - tracker.lookup_first if tracker.hit_chunks else 0
        self.stats.add("lookup_hit_tokens", hit_chunks * self.planner.chunk_size)

    def _reply_results(self, record: Record, future: Future[Any]) -> list[Any]:
        """The results of a lookup reply that is in; none (a miss) if the lookup failed."""
        try:
            results: list[Any] = future.result().results
        except Exception as exc:
            if isinstance(exc, DeadlineExceededError):
                self.health.report_timeout()
            log.warning("kvdepot lookup for %s failed, counting it as a miss: %s", record.request.request_id, exc)
            return []
        return results

    def hit_sources(self, request: Request, num_external_tokens: int) -> dict[str, int]:
        """The tokens a load brings, by where the server had them (`_lookup_reply.hit_sources`)."""
        record = self._records.get(request.request_id)
        if record is None or not num_external_tokens:
            return hit_sources(0, num_external_tokens, (0, {}), self.planner.chunk_size)
        start = self.planner.get(request.request_id).engine_hit_tokens
        return hit_sources(start, num_external_tokens, record.read_back, self.planner.chunk_size)

    def _release_on_arrival(self, record: Record) -> None:
        """Release whatever leases a reply we no longer wait for brings when it arrives."""
        future, record.lookup = record.lookup, None
        if future is not None:
            self.leases.release_on_arrival(future, record.first_item, record.server_id)

    def _flush_releases(self) -> None:
        if leases := self.planner.take_leases():
            self.leases.release(leases)


def _was_aborted(request: Request) -> bool:
    from vllm.v1.request import RequestStatus

    return bool(request.status == RequestStatus.FINISHED_ABORTED)
