"""The scheduler half of the connector: it drives the planner from vLLM's scheduler hooks.

All accounting is `kvdepot.core.Planner`'s; this half turns vLLM's scheduler calls into
planner events and never waits on the server beyond one bounded moment per step:

- A request is keyed, and its lookup queued, when vLLM admits it (`on_new_request`). The
  chunks vLLM's own prefix cache already holds are not asked for. The queued lookups of a
  scheduling pass leave together, as one message, the first time vLLM asks for a match
  (`_lookups.py`; `_lookup_reply.py` reads the replies, `_lease_book.py` gives leases back).
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
  nothing, and waits for the chunks a request's parameters name (`_handoff.py`,
  `_handoff_wait.py`).
- With several KV-cache groups (a hybrid or sliding-window model) a chunk is loaded into, and
  stored from, the blocks of every group at its positions (`_step_ops.py`; `_groups.py` says
  what is done with blocks outside a window).
- A hit wholly in the server's RAM may load before the forward pass of the step that finds
  it, within a budget per pass (`_sync_loads.py`).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from typing import TYPE_CHECKING, Any

from kvdepot.core import Namespace, Planner, RequestState, RequestTracker
from kvdepot.vllm_connector._config import DEFAULT_SYNC_LOAD_SHARE
from kvdepot.vllm_connector._groups import CacheGroup, ours
from kvdepot.vllm_connector._handoff import DEFAULT_HANDOFF_TIMEOUT, handoff_params, namespace_digest
from kvdepot.vllm_connector._handoff_wait import Decision, HandoffWait
from kvdepot.vllm_connector._identity import lora_identity, request_marks
from kvdepot.vllm_connector._lease_book import LeaseBook
from kvdepot.vllm_connector._lookup_reply import hit_sources, outdated
from kvdepot.vllm_connector._lookups import Lookups
from kvdepot.vllm_connector._meta import KVDepotMetadata, KVDepotStats, KVDepotWorkerMetadata, LoadOp
from kvdepot.vllm_connector._prefill import PrefillRate
from kvdepot.vllm_connector._record import RUNNING, Record
from kvdepot.vllm_connector._step_ops import StorePlans, load_op
from kvdepot.vllm_connector._sync_loads import SyncLoads

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvdepot.transport import CacheClient
    from kvdepot.vllm_connector._health import ServerHealth
    from kvdepot.vllm_connector._kv_events import EventAnnouncer

log = logging.getLogger("vllm.kvdepot.scheduler")

#: A hit older than this (seconds, counted from when its lookup was sent) is looked up again
#: before it is loaded: its leases expire on the server after a minute (`kvdepot serve
#: --lease-ttl`), and an expired lease's slot may hold another chunk by then.
LEASE_REFRESH_S = 20.0
#: Once per scheduling pass the scheduler gives the pending lookups this long (seconds) to
#: land. The reply of a local server is usually a round trip (~0.1 ms) away; waiting on the
#: future reads it on the engine thread, so a hit or a miss costs the request no extra
#: engine step. The scheduler never waits longer than this for the server.
LOOKUP_YIELD_S = 0.002
#: A request's skipped stores (their slots came after the step's end, `_stores.py`) are planned
#: again at most this many times: enough for a busy moment, and no endless retries against a
#: server that is slow for good.
STORE_AGAIN_MAX = 3


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
        sync_load_share: float = DEFAULT_SYNC_LOAD_SHARE,
        slot_index: bool = True,
    ) -> None:
        """``events``: announces what kvdepot holds in the engine's KV events (`_kv_events.py`).
        ``loads``, ``stores``: what the engine's ``kv_role`` lets it do; ``producer``: a prefill
        engine, whose finished requests name their chunks for a decode engine (`_handoff.py`);
        ``handoff_timeout``: how long a handed-over request waits at most for those chunks.
        ``sync_load_bytes``: the most bytes of hits a step loads before its forward pass (0: none);
        ``sync_load_share``: while others run, the most those copies may add to a step (`_sync_budget.py`);
        ``slot_index``: answer lookups from the server's slot index when it offers one (`_index_lookups.py`)."""
        self.planner = Planner(namespace, block_size=block_size, chunk_size=chunk_size)
        self.loads, self.stores, self.producer = loads, stores, producer
        self.handoff_timeout = handoff_timeout
        self.groups = groups
        self.events = events
        self.health = health
        # The engine's compute time per token, from its steps (sent with each lookup).
        self.prefill = PrefillRate()
        self.stats = KVDepotStats()
        self.kv_cache_manager: Any = None  # vLLM's, for the local prefix-cache hit at admission
        self._records: dict[str, Record] = {}
        self._uncacheable: set[str] = set()
        self._loads: list[LoadOp] = []
        self.leases = LeaseBook(client, namespace.kv_world_size)
        self.lookups = Lookups(
            self.planner,
            client=client,
            health=health,
            leases=self.leases,
            prefill=self.prefill,
            events=events,
            lookup_timeout=lookup_timeout,
            count=self._count,
            slot_index=slot_index,
        )
        self.store_plans = StorePlans(self.planner, groups, events)
        # A load that may fail block by block alone joins its step: one full-attention group.
        self.sync = SyncLoads(0 if self.store_plans.windowed else sync_load_bytes, sync_load_share)
        self._yielded = False

    # -- vLLM scheduler hooks --------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        """vLLM admitted the request: key it and queue its lookup."""
        record = self._track(request)
        if record is not None and self.loads and not getattr(request, "skip_reading_prefix_cache", False):
            self.lookups.start(record, _local_hit_tokens(self.kv_cache_manager, request))

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        req_id = request.request_id
        if self.sync.guard.reaches(req_id, request.block_hashes, num_computed_tokens // self.planner.block_size):
            self.stats.add("sync_share_waits")  # its local hit takes blocks a sync load is still filling
            return None, False
        record = self._records.get(req_id) or self._track(request)
        if record is None:
            return 0, False
        tracker = self.planner.get(req_id)
        if tracker.state in RUNNING:  # back in the waiting queue: preempted, or after a failed load
            self.planner.on_preempted(req_id)
            self._flush_releases()
        # Whatever kvdepot adds, the engine's own hit counts as computed for store planning.
        self.planner.on_engine_hit(req_id, num_computed_tokens)
        if not self.loads or record.load_failed or getattr(request, "skip_reading_prefix_cache", False):
            return 0, False  # a request that skips reading is still stored
        if (not_now := self._look_up(record, tracker, num_computed_tokens)) is not None:
            return not_now
        num = self.planner.num_tokens_to_load(req_id, num_computed_tokens, request.num_tokens)
        if record.handoff is not None and self._handoff_pending(record, num_computed_tokens, num_computed_tokens + num):
            return None, False
        record.sync_load = num > 0 and self._joins_this_step(record, num_computed_tokens, num)
        return num, num > 0 and not record.sync_load

    def _look_up(
        self, record: Record, tracker: RequestTracker, num_computed_tokens: int
    ) -> tuple[int | None, bool] | None:
        """Look the request up, or again, until its reply is read; None once it is, else what vLLM
        is told meanwhile: "not yet" while the reply is on its way, a miss if the server is not usable."""
        for _ in range(2):  # a reply answered for a local hit vLLM has lost since is asked again
            stale = tracker.state is RequestState.LOOKED_UP and self._outdated(
                tracker, record.request.num_tokens, num_computed_tokens
            )
            if (tracker.state in (RequestState.NEW, RequestState.PREEMPTED) or stale) and not self.lookups.start(
                record, num_computed_tokens
            ):
                return 0, False
            if tracker.state is RequestState.PREFETCHING:
                self.lookups.send()
                if not self.lookups.settle(record, from_index=True):
                    self._yield_to(record)
                    if not self.lookups.settle(record):
                        return None, False
            if num_computed_tokens >= tracker.lookup_first * self.planner.chunk_size:
                break
        return None

    def _joins_this_step(self, record: Record, num_computed_tokens: int, num: int) -> bool:
        """Whether a hit loads before the forward pass of the step that schedules it: its chunks are
        all in the server's RAM (none just read back from a tier below), and fit in what is left
        of this pass's budget (`_sync_loads.py`)."""
        if record.read_back[1]:
            return False
        size = self.planner.chunk_size
        return self.sync.joins(num_computed_tokens, num, chunk_size=size, slot_bytes=record.slot_bytes)

    def _yield_to(self, record: Record) -> None:
        """Once per scheduling pass, give a pending lookup reply `LOOKUP_YIELD_S` to land."""
        future = record.lookup
        if future is not None and not future.done() and not self._yielded:
            self._yielded = True
            with contextlib.suppress(TimeoutError):
                future.exception(timeout=LOOKUP_YIELD_S)  # lets a reply on its way in arrive

    def _outdated(self, tracker: RequestTracker, num_tokens: int, num_computed_tokens: int) -> bool:
        """Whether the request's lookup reply is to be asked again (`_lookup_reply.outdated`)."""
        return outdated(
            tracker,
            num_tokens=num_tokens,
            num_computed_tokens=num_computed_tokens,
            chunk_size=self.planner.chunk_size,
            stores_ended_at=self.sync.stores_ended_at,
            now=time.monotonic(),
            refresh_s=LEASE_REFRESH_S,
        )

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
            if not self.lookups.start(record, num_computed_tokens):
                return False
            self.lookups.send()
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
            record = self._records[req_id]
            self._loads.append(load_op(plan, record, block_ids, self.planner.blocks_per_chunk))
            if record.sync_load:
                # Its blocks from the first loaded one on: the loaded ones, and those computed
                # over them in the same step, which vLLM caches now too.
                start = plan.first_chunk * self.planner.blocks_per_chunk
                self.sync.loading(req_id, request.block_hashes[start:], block_ids[0][start:])
        self._flush_releases()

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVDepotMetadata:
        self._yielded = False
        now = time.monotonic()
        idle = scheduler_output.total_num_scheduled_tokens == 0
        for req_id in self.sync.pass_started(now, idle=idle):  # the sync loads of the step that ended
            if self.planner.end_preempted_load(req_id):
                continue  # preempted before that step ended (and maybe loading again): its leases only
            if self.planner.is_loading(req_id):  # (also once the request finished: its leases go back)
                self.planner.on_load_done(req_id)
        self.prefill.step_started(scheduler_output.total_num_scheduled_tokens, now)
        self.lookups.collect_leases()  # given back at this pass's end when their hit is gone
        self.lookups.send()
        preempted = set(scheduler_output.preempted_req_ids or ())
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
        self.sync.pass_planned(bool(meta.stores))
        # A request preempted outside `schedule` (reset_prefix_cache(reset_running_requests=True))
        # is named preempted by the very pass that resumes it: it was admitted again (a load, or
        # scheduled new or resumed), and must not be taken for preempted now.
        readmitted = {op.req_id for op in meta.loads} | {new.req_id for new in scheduler_output.scheduled_new_reqs}
        for req_id in preempted - readmitted - set(cached.resumed_req_ids):
            if req_id in self.planner and self.planner.get(req_id).state in RUNNING:
                self.planner.on_preempted(req_id)
        self._flush_releases()
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        step_s = self.prefill.step_done(time.monotonic())
        if step_s is not None:
            self.sync.budget.step_took(step_s)
        worker_meta = output.kv_connector_worker_meta
        failed: set[str] = set()
        if isinstance(worker_meta, KVDepotWorkerMetadata):
            failed = worker_meta.failed
            self.sync.budget.copied(worker_meta.copied_bytes, worker_meta.copied_s)
            self._store_again(worker_meta.skipped)
        # A worker reports its failed load in the step it failed, and vLLM passes that on at once;
        # but it lists the load as finished only once every worker reported it, which with several
        # ranks can be steps later (and in a step whose reports say nothing of it): remember it.
        for req_id in failed:
            self.sync.evict_failed(req_id, self.kv_cache_manager)
            record = self._records.get(req_id)
            if record is not None and self.planner.is_loading(req_id):
                record.load_failed = True
                if record.sync_load:  # never in finished_recving: vLLM cut its computed tokens already
                    self.stats.add("load_failures")
                    self.planner.on_load_failed(req_id, record.request.num_computed_tokens)
        # vLLM has already cut a failed request's computed tokens back to its first failed block.
        self.lookups.collect_leases()  # before the loads that ended give theirs back
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

    def _store_again(self, skipped: dict[str, int]) -> None:
        """Plan again the stores a worker skipped because their slots came late (a busy server or
        host), from the request's next scheduled step, while it holds their blocks; at most
        `STORE_AGAIN_MAX` times a request, so a server slow for good is not asked again and again."""
        for req_id, first_chunk in skipped.items():
            record = self._records.get(req_id)
            if record is None or record.stores_again >= STORE_AGAIN_MAX:
                continue
            if self.planner.store_again(req_id, first_chunk):
                record.stores_again += 1
                self.stats.add("store_again")

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
        params = _handoff_of(request, self.planner, producer=self.producer, stores=self.stores)
        prefetching = self.planner.get(req_id).state is RequestState.PREFETCHING
        self.lookups.forget(req_id)
        if _was_aborted(request):
            self.planner.abort(req_id)
        else:
            self.planner.finish(req_id)
        if prefetching:
            # The lookup is queued or out: whatever leases its reply brings go back on arrival.
            self.planner.on_lookup_done(req_id, [0], ())
            self.lookups.release_on_arrival(record)
        self._flush_releases()
        # Its blocks go back to vLLM now: the workers read every store's blocks within its step. (A
        # request still loading keeps them through vLLM itself until the load is reported.)
        return False, params

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
            record.handoff = _handoff_wait(request, self.planner, self.handoff_timeout)
        return record

    def _plan_store(
        self, meta: KVDepotMetadata, req_id: str, num_tokens: int, block_ids: list[int], *, replace: bool
    ) -> None:
        record = self._records.get(req_id)
        if not self.stores or record is None:
            return
        op = self.store_plans.op(record, num_tokens, block_ids, replace=replace, manager=self.kv_cache_manager)
        if op is not None:
            meta.stores.append(op)

    def hit_sources(self, request: Request, num_external_tokens: int) -> dict[str, int]:
        """The tokens a load brings, by where the server had them (`_lookup_reply.hit_sources`)."""
        record = self._records.get(request.request_id)
        if record is None or not num_external_tokens:
            return hit_sources(0, num_external_tokens, (0, {}), self.planner.chunk_size)
        start = self.planner.get(request.request_id).engine_hit_tokens
        return hit_sources(start, num_external_tokens, record.read_back, self.planner.chunk_size)

    def _count(self, name: str, value: float = 1) -> None:
        self.stats.add(name, value)

    def _flush_releases(self) -> None:
        self.leases.release(self.planner.take_leases())


def _handoff_wait(request: Request, planner: Planner, timeout: float) -> HandoffWait | None:
    """A consumer's wait for the chunks a request's producer stored, if its parameters name any."""
    wait, why_not = HandoffWait.named_by(
        getattr(request, "kv_transfer_params", None),
        namespace_digest(planner.namespace, planner.chunk_size),  # the namespace now (a reset: another)
        num_tokens=request.num_tokens,
        chunk_size=planner.chunk_size,
        deadline=time.monotonic() + timeout,
    )
    if why_not is not None:
        log.warning("kvdepot: request %s is not waited for as a handoff: %s", request.request_id, why_not)
    return wait


def _handoff_of(request: Request, planner: Planner, *, producer: bool, stores: bool) -> dict[str, Any] | None:
    """A producer's parameters for the decode engine: the chunks of the request it stored (or
    found stored), under its namespace. Also for a ``kv_both`` engine's request that asks for
    them (``do_remote_decode``, as vLLM's proxies send the prefill request)."""
    asked = (getattr(request, "kv_transfer_params", None) or {}).get("do_remote_decode")
    if not stores or not (producer or asked) or _was_aborted(request):
        return None
    digest = namespace_digest(planner.namespace, planner.chunk_size)
    return handoff_params(digest, planner.get(request.request_id).next_store_chunk)


def _local_hit_tokens(manager: Any, request: Request) -> int:
    """Tokens vLLM's own prefix cache (``manager``: its KV-cache manager) holds for the request now (0 if unknown)."""
    if manager is None or not getattr(manager, "enable_caching", False):
        return 0
    try:
        hit: int = manager.coordinator.find_longest_cache_hit(request.block_hashes, request.num_tokens - 1)[1]
    except Exception:  # a vLLM whose internals differ: ask for every chunk
        return 0
    return hit


def _was_aborted(request: Request) -> bool:
    from vllm.v1.request import RequestStatus

    return bool(request.status == RequestStatus.FINISHED_ABORTED)
