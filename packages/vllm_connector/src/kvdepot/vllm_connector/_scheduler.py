"""The scheduler half of the connector: lookups, planning, and lease bookkeeping.

All accounting is `kvdepot.core.Planner`'s; this half turns vLLM's scheduler calls into
planner events, batches a step's lookups into one message, and never waits on the server.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import threading
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import attrs

from kvdepot.core import Namespace, Planner, RequestState
from kvdepot.transport import LookupItem
from kvdepot.vllm_connector._meta import KVDepotMetadata, KVDepotStats, KVDepotWorkerMetadata, LoadOp, StoreOp

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvdepot.transport import CacheClient

log = logging.getLogger("vllm.kvdepot.scheduler")

_RUNNING = (RequestState.READY, RequestState.WAITING_FOR_LOAD)
#: A hit older than this (seconds) is looked up again before it is loaded: its leases expire on
#: the server after a minute (`kvdepot serve --lease-ttl`), and an expired lease's slot may hold
#: another chunk by then.
LEASE_REFRESH_S = 20.0
#: Once per scheduling pass the scheduler gives a pending lookup this long (seconds) to land.
#: The reply is usually on the socket already, or a round trip away; waiting on the future
#: reads it on the engine thread, where the transport's I/O thread would first have to win
#: the GIL from the engine. The scheduler never waits longer than this for the server.
LOOKUP_YIELD_S = 0.002


def request_extra_digests(request: Request) -> tuple[bytes, ...] | None:
    """Digests of what the KV depends on besides token ids; None if the request cannot be cached.

    Multimodal inputs are identified by vLLM's content hashes and their positions. Prompt
    embeddings have no token ids at all (vLLM reports zeros), so such requests are not cached.
    """
    if getattr(request, "prompt_embeds", None) is not None:
        return None
    digests = []
    for feature in getattr(request, "mm_features", None) or ():
        pos = getattr(feature, "mm_position", None)
        text = f"{feature.identifier}|{getattr(pos, 'offset', '')}|{getattr(pos, 'length', '')}"
        digests.append(hashlib.sha256(text.encode()).digest())
    return tuple(digests)


def lora_identity(request: Request) -> str | None:
    """The LoRA adapter as name, id and path, so two adapters with one name never share keys."""
    lora = getattr(request, "lora_request", None)
    if lora is None:
        return None
    return f"{lora.lora_name}|{getattr(lora, 'lora_int_id', '')}|{getattr(lora, 'lora_path', '')}"


@attrs.define
class _Lookup:
    """A lookup on its way: sent (or about to be) to one server instance."""

    future: Future[Any] | None
    first: int
    sent_at: float
    server_id: str


@attrs.define
class _Hit:
    """What a lookup found: slots per KV rank on one server instance, and when."""

    slots: list[list[int]]
    server_id: str
    at: float


class SchedulerSide:
    """Drives the planner from vLLM's scheduler hooks."""

    def __init__(
        self, namespace: Namespace, *, block_size: int, chunk_size: int, client: CacheClient, lookup_timeout: float
    ) -> None:
        self.planner = Planner(namespace, block_size=block_size, chunk_size=chunk_size)
        self.client = client
        self.kv_world_size = namespace.kv_world_size
        self.lookup_timeout = lookup_timeout
        self.stats = KVDepotStats()
        self._requests: dict[str, Request] = {}
        self._uncacheable: set[str] = set()
        # Lookups of this step, sent together by build_connector_meta.
        self._batch: list[tuple[str, str, list[list[bytes]]]] = []
        self._lookups: dict[str, _Lookup] = {}
        self._hits: dict[str, _Hit] = {}
        self._loads: list[LoadOp] = []
        # The planner sees lease handles unique across server instances; each names the
        # server that granted it, so a lease is never released to a restarted server.
        self._handles = itertools.count(1)
        self._leases: dict[int, tuple[str, int]] = {}
        self._leases_lock = threading.Lock()
        self._yielded = False

    # -- vLLM scheduler hooks --------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        req_id = request.request_id
        if req_id in self._uncacheable:
            return 0, False
        if req_id not in self.planner:
            digests = request_extra_digests(request)
            if digests is None:
                self._uncacheable.add(req_id)
                return 0, False
            self.planner.add_request(req_id, cache_salt=request.cache_salt, lora=lora_identity(request), extra=digests)
            self._requests[req_id] = request
        if getattr(request, "skip_reading_prefix_cache", False):
            return 0, False  # vLLM would not use a hit; the request is still stored
        tracker = self.planner.get(req_id)
        if tracker.state in _RUNNING:  # back in the waiting queue: it was preempted
            self.planner.on_preempted(req_id)
            self._hits.pop(req_id, None)
            self._flush_releases()
        hit = self._hits.get(req_id)
        stale = (
            tracker.state is RequestState.LOOKED_UP and hit is not None and time.monotonic() - hit.at > LEASE_REFRESH_S
        )
        if tracker.state in (RequestState.NEW, RequestState.PREEMPTED) or stale:
            self._hits.pop(req_id, None)
            keys = self.planner.start_lookup(req_id, request.all_token_ids)
            self._flush_releases()
            if keys is not None:
                self._batch.append((req_id, tracker.cache_salt, keys))
                self._lookups[req_id] = _Lookup(None, 0, time.monotonic(), "")
                return None, False
        if tracker.state is RequestState.PREFETCHING and not self._poll_lookup(req_id):
            return None, False
        return self.planner.num_tokens_to_load(req_id, num_computed_tokens, request.num_tokens), False

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        req_id = request.request_id
        if req_id in self._uncacheable or req_id not in self.planner:
            return
        tracker = self.planner.get(req_id)
        if tracker.state not in (RequestState.LOOKED_UP, RequestState.NEW, RequestState.PREEMPTED):
            return  # a second call for the same allocation
        plan = self.planner.on_allocated(req_id, block_ids, num_external_tokens)
        hit = self._hits.pop(req_id, None)
        if plan is not None:
            assert hit is not None
            end = plan.first_chunk + plan.num_chunks
            self._loads.append(
                LoadOp(
                    req_id=req_id,
                    server_id=hit.server_id,
                    slots=[rank_slots[plan.first_chunk : end] for rank_slots in hit.slots],
                    block_ids=list(plan.block_ids),
                    skip_blocks=plan.skip_blocks,
                    num_tokens=plan.num_tokens,
                )
            )
        self._flush_releases()

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVDepotMetadata:
        self._yielded = False
        self._send_lookups()
        meta = KVDepotMetadata(loads=self._loads)
        self._loads = []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            self._plan_store(meta, new.req_id, scheduled.get(new.req_id, 0), new.block_ids[0], replace=True)
        cached = scheduler_output.scheduled_cached_reqs
        for index, req_id in enumerate(cached.req_ids):
            new_blocks = cached.new_block_ids[index]
            resumed = req_id in cached.resumed_req_ids
            self._plan_store(
                meta, req_id, scheduled.get(req_id, 0), new_blocks[0] if new_blocks else [], replace=resumed
            )
        for req_id in scheduler_output.preempted_req_ids or ():
            if req_id in self.planner and self.planner.get(req_id).state in _RUNNING:
                self.planner.on_preempted(req_id)
        self._flush_releases()
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        worker_meta = output.kv_connector_worker_meta
        if isinstance(worker_meta, KVDepotWorkerMetadata):
            for req_id in worker_meta.failed:
                request = self._requests.get(req_id)
                if request is not None and self._waiting_for_load(req_id):
                    self.planner.on_load_failed(req_id, request.num_computed_tokens)
                    self.stats.add("load_failures")
            for req_id in worker_meta.loaded - worker_meta.failed:
                if self._waiting_for_load(req_id):
                    self.planner.on_load_done(req_id)
        self._flush_releases()

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        self._uncacheable.discard(req_id)
        self._requests.pop(req_id, None)
        self._hits.pop(req_id, None)
        self._batch = [item for item in self._batch if item[0] != req_id]
        pending = self._lookups.pop(req_id, None)
        ended = self.planner.abort(req_id) if _was_aborted(request) else self.planner.finish(req_id)
        if ended and pending is not None:
            # The lookup is still out: whatever leases its reply brings are released on arrival.
            self.planner.on_lookup_done(req_id, [0], ())
            self._release_on_arrival(pending)
        self._flush_releases()
        # Stores finish inside the step that planned them (wait_for_save), so blocks can go at once.
        return False, None

    def shutdown(self) -> None:
        for req_id in list(self._requests):
            self.planner.abort(req_id)
        self._flush_releases()

    # -- internals --------------------------------------------------------------------

    def _waiting_for_load(self, req_id: str) -> bool:
        return req_id in self.planner and self.planner.get(req_id).state is RequestState.WAITING_FOR_LOAD

    def _plan_store(
        self, meta: KVDepotMetadata, req_id: str, num_tokens: int, block_ids: list[int], *, replace: bool
    ) -> None:
        if req_id not in self.planner or self.planner.get(req_id).state not in _RUNNING:
            return
        request = self._requests[req_id]
        plan = self.planner.on_scheduled(req_id, num_tokens, request.all_token_ids, block_ids, replace_blocks=replace)
        if plan is not None:
            meta.stores.append(
                StoreOp(
                    req_id=req_id,
                    salt=plan.cache_salt,
                    keys=[list(k) for k in plan.keys],
                    block_ids=list(plan.block_ids),
                )
            )

    def _send_lookups(self) -> None:
        if not self._batch:
            return
        batch, self._batch = self._batch, []
        items = [LookupItem(salt=salt, keys=rank_keys) for _req, salt, keys in batch for rank_keys in keys]
        server_id = self.client.server_id or ""
        try:
            future: Future[Any] = self.client.lookup(items)
        except Exception as exc:  # the server is unreachable: every lookup is a miss
            log.warning("kvdepot lookup could not be sent, counting %d requests as misses: %s", len(batch), exc)
            future = Future()
            future.set_exception(exc)
        for index, (req_id, _salt, _keys) in enumerate(batch):
            lookup = self._lookups[req_id]
            lookup.future, lookup.first, lookup.server_id = future, index * self.kv_world_size, server_id

    def _poll_lookup(self, req_id: str) -> bool:
        """Apply the lookup reply if it is in; True once the request is looked up."""
        lookup = self._lookups[req_id]
        if lookup.future is not None and not lookup.future.done() and not self._yielded:
            self._yielded = True
            with contextlib.suppress(TimeoutError):
                lookup.future.exception(timeout=LOOKUP_YIELD_S)  # reads the reply on this thread
        if lookup.future is None or not lookup.future.done():
            if time.monotonic() - lookup.sent_at < self.lookup_timeout:
                return False
            log.warning("kvdepot lookup for %s took over %.1fs; counting it as a miss", req_id, self.lookup_timeout)
            self.stats.add("lookup_misses_timeout")
            del self._lookups[req_id]
            self._release_on_arrival(lookup)
            self.planner.on_lookup_done(req_id, [0], ())
            return True
        del self._lookups[req_id]
        hits, handles, slots = [0], [], []
        try:
            results = lookup.future.result().results[lookup.first : lookup.first + self.kv_world_size]
        except Exception as exc:
            log.warning("kvdepot lookup for %s failed, counting it as a miss: %s", req_id, exc)
            results = []
        # The slots are only meaningful in the pool of the server that answered: if the
        # client reconnected to another instance meanwhile, the reply counts as a miss.
        same_server = bool(lookup.server_id) and lookup.server_id == self.client.server_id
        if len(results) == self.kv_world_size and same_server:
            hits = [r.num_hits for r in results]
            handles = [self._handle(lookup.server_id, r.lease_id) for r in results]
            slots = [[s.offset for s in r.slots] for r in results]
        self.planner.on_lookup_done(req_id, hits, handles)
        tracker = self.planner.get(req_id)
        self.stats.add("lookups")
        self.stats.add("lookup_seconds_sum", time.monotonic() - lookup.sent_at)
        self.stats.add("lookup_hit_tokens", tracker.hit_chunks * self.planner.chunk_size)
        if tracker.hit_chunks:
            self._hits[req_id] = _Hit(
                [rank_slots[: tracker.hit_chunks] for rank_slots in slots], lookup.server_id, time.monotonic()
            )
        return True

    def _handle(self, server_id: str, lease_id: int) -> int:
        if not lease_id:
            return 0
        handle = next(self._handles)
        with self._leases_lock:
            self._leases[handle] = (server_id, lease_id)
        return handle

    def _release_on_arrival(self, lookup: _Lookup) -> None:
        """Release whatever leases a reply we no longer wait for brings when it arrives."""
        future, first, world, server_id = lookup.future, lookup.first, self.kv_world_size, lookup.server_id
        if future is None:
            return

        def release(done: Future[Any]) -> None:  # runs on whichever thread reads the reply
            try:
                leases = [r.lease_id for r in done.result().results[first : first + world] if r.lease_id]
            except Exception:
                return
            if leases and server_id == self.client.server_id:
                self._send_release(leases)

        future.add_done_callback(release)

    def _flush_releases(self) -> None:
        handles = self.planner.take_releases()
        if not handles:
            return
        current = self.client.server_id
        with self._leases_lock:
            owned = [self._leases.pop(h) for h in handles if h in self._leases]
        # Leases of a server instance that is gone died with it; never release them elsewhere.
        leases = [lease for server_id, lease in owned if server_id == current]
        if leases:
            self._send_release(leases)

    def _send_release(self, leases: list[int]) -> None:
        try:
            self.client.release(leases)
        except Exception as exc:  # the server expires them by itself
            log.warning("kvdepot could not release %d leases (they will expire): %s", len(leases), exc)


def _was_aborted(request: Request) -> bool:
    from vllm.v1.request import RequestStatus

    return bool(request.status == RequestStatus.FINISHED_ABORTED)
