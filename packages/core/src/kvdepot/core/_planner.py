"""Per-request trackers and the planner that decides what to load, store and release.

The planner is fed by the engine's scheduler (lookups, allocations, each step's
scheduled tokens, preemption, finish, abort) and answers with plain values:
`RetrievePlan`, `StorePlan`, and the leases to release, each as the pair of the server
instance that granted it and its id there (`take_leases`), so a lease is never given back
to another instance (a restarted server's leases died with it).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from kvdepot.core._errors import InvalidArgumentError, UnknownRequestError
from kvdepot.core._keys import DEFAULT_CHUNK_SIZE, KeyChain, Namespace
from kvdepot.core._plans import RetrievePlan, StorePlan
from kvdepot.core._state import TERMINAL, Event, RequestState, next_state


@attrs.define
class RequestTracker:
    """What the planner knows of one request. Mutated only by `Planner`."""

    req_id: str
    cache_salt: str
    chain: KeyChain
    #: What scopes the request's keys besides the planner's namespace: (salt, LoRA, digests).
    space: tuple[str, str, tuple[bytes, ...]] = ("", "", ())
    #: (token position, digest) of inputs the token ids do not capture (see `KeyChain`).
    marks: tuple[tuple[int, bytes], ...] = ()
    state: RequestState = RequestState.NEW
    hit_chunks: int = 0
    lease_ids: tuple[int, ...] = ()
    #: The lookup asked from this chunk on; the chunks before it were the engine's own hit.
    lookup_first: int = 0
    #: The epoch the lookup's keys were made in: a reply from an older epoch is no hit.
    lookup_epoch: str = ""
    #: Where the hit chunks lie, per KV rank (from ``lookup_first`` on), in which server
    #: instance, and when the lookup that found them was sent (the caller's clock).
    hit_slots: tuple[tuple[int, ...], ...] = ()
    hit_source: str = ""
    hit_at: float = 0.0
    engine_hit_tokens: int = 0
    num_external_tokens: int = 0
    #: Tokens whose KV is in the request's blocks once the last scheduled step has run.
    num_computed_tokens: int = 0
    block_ids: list[int] = attrs.Factory(list)
    #: Chunks below this index are stored, were hits, or are planned: never planned again.
    next_store_chunk: int = 0

    def move(self, event: Event) -> None:
        self.state = next_state(self.req_id, self.state, event)


#: Key spaces (salt, LoRA adapter, multimodal digests) whose namespaces are kept ready; past
#: this many the cache starts over, so a stream of distinct salts cannot grow it without bound.
MAX_KEY_SPACES = 4096


#: A lease held for a request: the server instance that granted it, and its id there.
Lease = tuple[str, int]
#: A request's key space: its cache salt, LoRA adapter and extra key inputs.
Space = tuple[str, str, tuple[bytes, ...]]


def _store_plan(tracker: RequestTracker, first: int, end: int, blocks_per_chunk: int) -> StorePlan:
    """A request's chunks ``first`` to ``end``, to store: their keys per rank and their blocks."""
    chain = tracker.chain
    return StorePlan(
        req_id=tracker.req_id,
        cache_salt=tracker.cache_salt,
        first_chunk=first,
        num_chunks=end - first,
        keys=tuple(tuple(chain.keys(rank)[first:end]) for rank in range(chain.num_namespaces)),
        block_ids=tuple(tracker.block_ids[first * blocks_per_chunk : end * blocks_per_chunk]),
    )


class _KeySpaces:
    """The namespaces (one per KV rank) of each key space seen lately, kept ready."""

    def __init__(self, namespace: Namespace) -> None:
        self.namespace = namespace
        self._spaces: dict[Space, list[Namespace]] = {}

    def reset(self, namespace: Namespace) -> None:
        self.namespace = namespace
        self._spaces.clear()

    def __call__(self, space: Space) -> list[Namespace]:
        spaces = self._spaces.get(space)
        if spaces is None:
            cache_salt, lora, extra = space
            base = attrs.evolve(self.namespace, cache_salt=cache_salt, lora=lora, extra=extra, kv_rank=0)
            spaces = [base.for_rank(rank) for rank in range(base.kv_world_size)]
            if len(self._spaces) >= MAX_KEY_SPACES:
                self._spaces.clear()
            self._spaces[space] = spaces
        return spaces


def _leases(source: str, lease_ids: Sequence[int]) -> list[Lease]:
    """The leases among ``lease_ids`` (0: none) of server instance ``source``."""
    return [(source, lease) for lease in lease_ids if lease]


def _non_negative(name: str, value: int) -> None:
    if value < 0:
        raise InvalidArgumentError(f"{name} must not be negative, got {value}", field=name, got=value)


class Planner:
    """Store and retrieve planning for every request of one engine.

    ``namespace`` names the model and KV layout; its ``kv_world_size`` says how many
    KV ranks hold distinct shards (each gets its own keys), and its ``cache_salt``,
    ``lora`` and ``extra`` are replaced per request.
    """

    def __init__(self, namespace: Namespace, *, block_size: int, chunk_size: int = DEFAULT_CHUNK_SIZE) -> None:
        if block_size < 1 or chunk_size < 1 or chunk_size % block_size:
            raise InvalidArgumentError(
                f"chunk_size ({chunk_size}) must be a positive multiple of block_size ({block_size})",
                chunk_size=chunk_size,
                block_size=block_size,
            )
        self.namespace = namespace
        self.block_size = block_size
        self.chunk_size = chunk_size
        self.blocks_per_chunk = chunk_size // block_size
        self._requests: dict[str, RequestTracker] = {}
        self._namespaces = _KeySpaces(namespace)
        self._releases: list[Lease] = []
        # Requests that ended while their lookup was in flight: its lease is released on arrival.
        self._orphans: set[str] = set()
        # Leases of loads in flight, by request: given back when the load ends, not before,
        # even if the request itself ends (aborted) while its copy runs.
        self._loading: dict[str, list[Lease]] = {}
        # Leases of loads whose request the engine preempted before the step copying them had
        # ended (a synchronous load copies before its step's forward pass, and the engine may
        # preempt the request in the next pass, before that step is over), oldest first: given
        # back as those loads end (`end_preempted_load`), never before.
        self._preempted_loads: dict[str, list[list[Lease]]] = {}

    # -- bookkeeping ---------------------------------------------------------------

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def get(self, req_id: str) -> RequestTracker:
        try:
            return self._requests[req_id]
        except KeyError:
            raise UnknownRequestError(
                f"request {req_id!r} is not tracked; call add_request first", req_id=req_id
            ) from None

    def is_loading(self, req_id: str) -> bool:
        """True while a load planned for the request has not been reported done or failed."""
        return req_id in self._loading

    def end_preempted_load(self, req_id: str) -> bool:
        """The oldest load of ``req_id`` still in flight when the request was preempted has ended
        (copied or failed): its leases go back. False when there is none."""
        loads = self._preempted_loads.get(req_id)
        if not loads:
            return False
        self._releases.extend(loads.pop(0))
        if not loads:
            del self._preempted_loads[req_id]
        return True

    def take_leases(self) -> list[Lease]:
        """Leases to release, each exactly once: (the server instance that granted it, its id),
        the instance being the ``source`` of the lookup reply that brought it."""
        out, self._releases = self._releases, []
        return out

    def take_releases(self) -> list[int]:
        """The ids alone of the leases to release (`take_leases`), for a caller with one server."""
        return [lease for _source, lease in self.take_leases()]

    def _release(self, tracker: RequestTracker) -> None:
        self._releases.extend(_leases(tracker.hit_source, tracker.lease_ids))
        tracker.lease_ids = ()

    def new_epoch(self, epoch: str) -> None:
        """From now on every key is in ``epoch``: nothing stored before can be a hit, nor stored again.

        For a cache reset (new weights). Every tracked request is keyed anew; hits and leases
        found under the old epoch are dropped (a load already in flight keeps its lease).
        """
        self.namespace = attrs.evolve(self.namespace, epoch=epoch)
        self._namespaces.reset(self.namespace)
        for tracker in self._requests.values():
            tracker.chain = KeyChain(self._namespaces(tracker.space), self.chunk_size, tracker.marks)
            self._release(tracker)
            tracker.hit_chunks = 0
            tracker.hit_slots, tracker.hit_source = (), ""
            tracker.next_store_chunk = 0

    # -- scheduler events ----------------------------------------------------------

    def add_request(
        self,
        req_id: str,
        *,
        cache_salt: str | None = None,
        lora: str | None = None,
        extra: Sequence[bytes] = (),
        marks: Sequence[tuple[int, bytes]] = (),
    ) -> RequestTracker:
        """Track a new request; its keys are scoped by salt, LoRA adapter and extra digests, and
        from each mark's position on by the mark's digest (multimodal inputs, see `KeyChain`)."""
        if req_id in self._requests:
            raise InvalidArgumentError(f"request {req_id!r} is already tracked", req_id=req_id)
        self._orphans.discard(req_id)
        space = (cache_salt or "", lora or "", tuple(extra))
        chain = KeyChain(self._namespaces(space), self.chunk_size, marks)
        tracker = RequestTracker(req_id=req_id, cache_salt=space[0], chain=chain, space=space, marks=tuple(marks))
        self._requests[req_id] = tracker
        return tracker

    def start_lookup(
        self, req_id: str, all_token_ids: Sequence[int], *, local_tokens: int = 0
    ) -> list[list[bytes]] | None:
        """Keys to look up, one list per KV rank, or None when there is nothing to ask.

        ``local_tokens`` are the tokens the engine's own prefix cache already holds: the
        chunks they cover are not asked for, and hits count on from there. A request that
        may load nothing (no full chunk beyond its local hit, leaving one token to compute)
        gets None and is already looked up with zero hits. A request already looked up may
        look up again (its hit grew old waiting for blocks); its leases are released.
        """
        tracker = self.get(req_id)
        _non_negative("local_tokens", local_tokens)
        tracker.move(Event.LOOKUP_SENT)
        self._release(tracker)  # a repeated lookup gives back the leases of the previous one
        tracker.hit_chunks = 0
        tracker.hit_slots, tracker.hit_source = (), ""
        tracker.chain.update(all_token_ids)
        first = local_tokens // self.chunk_size
        tracker.lookup_first = first
        tracker.lookup_epoch = self.namespace.epoch
        if first >= tracker.chain.num_chunks:
            self.on_lookup_done(req_id, [0], ())
            return None
        return [list(tracker.chain.keys(rank)[first:]) for rank in range(tracker.chain.num_namespaces)]

    def on_lookup_done(
        self,
        req_id: str,
        hit_chunks: Sequence[int],
        lease_ids: Sequence[int],
        *,
        slots: Sequence[Sequence[int]] = (),
        source: str = "",
        at: float = 0.0,
    ) -> None:
        """Record a lookup reply: hits per KV rank (a chunk is a hit only if every rank has it).

        Hits count from the lookup's first chunk; ``slots[r]`` are rank ``r``'s pool offsets
        of those chunks in server instance ``source``; ``at`` is when the lookup was sent.
        """
        if req_id in self._orphans:
            self._orphans.discard(req_id)
            self._releases.extend(_leases(source, lease_ids))
            return
        tracker = self.get(req_id)
        tracker.move(Event.LOOKUP_DONE)
        if tracker.lookup_epoch != self.namespace.epoch:  # asked before a cache reset
            self._releases.extend(_leases(source, lease_ids))
            hit_chunks, lease_ids, slots = (0,), (), ()
        hits = min(hit_chunks, default=0)
        _non_negative("hit_chunks", hits)
        hits = min(hits, tracker.chain.num_chunks - tracker.lookup_first, *(len(s) for s in slots))
        tracker.hit_chunks = tracker.lookup_first + hits if hits > 0 else 0
        tracker.lease_ids = tuple(lease_ids)
        tracker.hit_slots = tuple(tuple(rank_slots[:hits]) for rank_slots in slots)
        tracker.hit_source = source
        tracker.hit_at = at

    def add_leases(self, req_id: str, source: str, lease_ids: Sequence[int]) -> None:
        """Leases that came after the hit they cover (its lookup was answered without them, from
        the server's slot index): held with the hit wherever it is now, waiting to be allocated or
        loading, and given back with it; given back at once when the hit is gone (loaded, failed,
        ended, looked up again) or came from another server instance than ``source``."""
        if req_id in self._loading:  # also after the request ended: its copy still reads the slots
            self._loading[req_id].extend(_leases(source, lease_ids))
            return
        tracker = self._requests.get(req_id)
        if (
            tracker is not None
            and tracker.state is RequestState.LOOKED_UP
            and tracker.hit_chunks
            and tracker.hit_source == source
        ):
            tracker.lease_ids = tuple(lease for lease in (*tracker.lease_ids, *lease_ids) if lease)
            return
        self._releases.extend(_leases(source, lease_ids))

    def on_engine_hit(self, req_id: str, engine_hit_tokens: int) -> None:
        """The engine's own prefix cache holds ``engine_hit_tokens`` of the request (counted as computed)."""
        _non_negative("engine_hit_tokens", engine_hit_tokens)
        self.get(req_id).engine_hit_tokens = engine_hit_tokens

    def num_tokens_to_load(self, req_id: str, engine_hit_tokens: int, num_tokens: int) -> int:
        """Tokens the cache can supply beyond the engine's own prefix-cache hit.

        At least one token of the request is always left for the engine to compute.
        """
        self.on_engine_hit(req_id, engine_hit_tokens)
        tracker = self.get(req_id)
        if tracker.state is not RequestState.LOOKED_UP:
            return 0
        if engine_hit_tokens < tracker.lookup_first * self.chunk_size:
            return 0  # the engine's own hit shrank since the lookup: the hit is not contiguous
        usable = min(tracker.hit_chunks * self.chunk_size, num_tokens - 1)
        return max(0, usable - engine_hit_tokens)

    def on_allocated(self, req_id: str, block_ids: Sequence[int], num_external_tokens: int) -> RetrievePlan | None:
        """The engine allocated ``block_ids`` and will load ``num_external_tokens`` from the cache."""
        tracker = self.get(req_id)
        _non_negative("num_external_tokens", num_external_tokens)
        tracker.block_ids = list(block_ids)
        tracker.num_external_tokens = num_external_tokens
        tracker.num_computed_tokens = tracker.engine_hit_tokens + num_external_tokens
        tracker.next_store_chunk = max(tracker.next_store_chunk, tracker.hit_chunks)
        if num_external_tokens == 0:
            tracker.move(Event.ALLOCATED)
            self._release(tracker)
            return None
        load_end = tracker.num_computed_tokens
        if load_end > tracker.hit_chunks * self.chunk_size:
            raise InvalidArgumentError(
                f"request {req_id!r} asks to load up to token {load_end} but only "
                f"{tracker.hit_chunks * self.chunk_size} tokens were hits",
                req_id=req_id,
            )
        bpc = self.blocks_per_chunk
        first = tracker.engine_hit_tokens // self.chunk_size
        end = -(-load_end // self.chunk_size)
        if len(block_ids) < end * bpc:
            raise InvalidArgumentError(
                f"request {req_id!r} has {len(block_ids)} blocks but loading {end} chunks needs {end * bpc}",
                req_id=req_id,
            )
        tracker.move(Event.ALLOCATED_WITH_LOAD)
        lease_ids, tracker.lease_ids = tracker.lease_ids, ()
        self._loading[req_id] = _leases(tracker.hit_source, lease_ids)
        offset = tracker.lookup_first
        return RetrievePlan(
            req_id=req_id,
            cache_salt=tracker.cache_salt,
            first_chunk=first,
            num_chunks=end - first,
            keys=tuple(tuple(tracker.chain.keys(rank)[first:end]) for rank in range(tracker.chain.num_namespaces)),
            block_ids=tuple(block_ids[first * bpc : end * bpc]),
            skip_blocks=(tracker.engine_hit_tokens - first * self.chunk_size) // self.block_size,
            num_tokens=num_external_tokens,
            lease_ids=lease_ids,
            slots=tuple(tuple(rank_slots[first - offset : end - offset]) for rank_slots in tracker.hit_slots),
            source=tracker.hit_source,
        )

    def on_scheduled(
        self,
        req_id: str,
        num_scheduled_tokens: int,
        all_token_ids: Sequence[int],
        new_block_ids: Sequence[int] = (),
        *,
        replace_blocks: bool = False,
    ) -> StorePlan | None:
        """A step computes ``num_scheduled_tokens`` more tokens; returns the chunks to store.

        New and running requests alike grow by the step's scheduled tokens. Chunks are
        stored only when full, only once, and never beyond the tokens whose keys are
        known, the blocks allocated, or the tokens computed once this step has run. While a
        load is unconfirmed nothing is stored; the first step after `on_load_done` stores
        everything computed meanwhile.
        """
        tracker = self.get(req_id)
        _non_negative("num_scheduled_tokens", num_scheduled_tokens)
        tracker.move(Event.SCHEDULED)
        if replace_blocks:
            tracker.block_ids = list(new_block_ids)
        elif new_block_ids:
            tracker.block_ids.extend(new_block_ids)
        tracker.num_computed_tokens += num_scheduled_tokens
        chain = tracker.chain
        if len(all_token_ids) - chain.num_tokens_hashed >= self.chunk_size:
            chain.update(all_token_ids)
        if tracker.state is RequestState.WAITING_FOR_LOAD:
            # Tokens computed over a load that is not confirmed yet (on every rank, before a
            # later step was scheduled) are stored only once it is: a failed load must never
            # leave chunks computed over garbage in the cache.
            return None
        limit = min(chain.num_tokens_hashed, len(tracker.block_ids) * self.block_size, tracker.num_computed_tokens)
        end = limit // self.chunk_size
        first = tracker.next_store_chunk
        if end <= first:
            return None
        tracker.next_store_chunk = end
        return _store_plan(tracker, first, end, self.blocks_per_chunk)

    def _load_ended(self, req_id: str) -> RequestTracker | None:
        """Gives the load's leases back; the tracker, or None if the request ended meanwhile."""
        leases = self._loading.pop(req_id, None)
        tracker = self._requests.get(req_id)
        if leases is None and tracker is None:
            raise UnknownRequestError(f"request {req_id!r} has no load in flight", req_id=req_id)
        self._releases.extend(leases or ())
        return tracker

    def on_load_done(self, req_id: str) -> None:
        """The chunks of the request's retrieve plan are in its blocks; its leases go back.

        Also for a request that ended while its load ran: only the leases go back then.
        """
        tracker = self._load_ended(req_id)
        if tracker is not None:
            tracker.move(Event.LOAD_DONE)

    def on_load_failed(self, req_id: str, num_computed_tokens: int) -> None:
        """The load failed; the engine recomputes from ``num_computed_tokens`` (see `recover_load_failures`)."""
        _non_negative("num_computed_tokens", num_computed_tokens)
        tracker = self._load_ended(req_id)
        if tracker is None:
            return
        tracker.move(Event.LOAD_FAILED)
        tracker.num_computed_tokens = min(tracker.num_computed_tokens, num_computed_tokens)
        # Recomputed chunks may be stored again; the server skips keys it already has.
        tracker.next_store_chunk = min(tracker.next_store_chunk, tracker.num_computed_tokens // self.chunk_size)
        tracker.hit_chunks = min(tracker.hit_chunks, tracker.next_store_chunk)

    def store_again(self, req_id: str, first_chunk: int) -> bool:
        """A worker skipped the store of chunks ``first_chunk`` on (its slots came too late): plan
        them again, from the request's next scheduled step, while it still holds their blocks.

        True if the request will store them again; False if it is not tracked, is not running
        (finished, preempted, still waiting for its load: its blocks are gone or not its own
        yet), or plans nothing from there anyway. The server skips any chunk it already has.
        """
        _non_negative("first_chunk", first_chunk)
        tracker = self._requests.get(req_id)
        if tracker is None or tracker.state is not RequestState.READY or first_chunk >= tracker.next_store_chunk:
            return False
        tracker.next_store_chunk = first_chunk
        return True

    def on_preempted(self, req_id: str) -> None:
        """The engine took the request's blocks back; it will look up again when resumed.

        A load still in flight is no longer the request's: the request may plan another when it
        is resumed, but this one's leases stay held until it ends (`end_preempted_load`)."""
        tracker = self.get(req_id)
        tracker.move(Event.PREEMPTED)
        if (leases := self._loading.pop(req_id, None)) is not None:
            self._preempted_loads.setdefault(req_id, []).append(leases)
        self._release(tracker)
        tracker.block_ids = []
        tracker.hit_chunks = tracker.engine_hit_tokens = tracker.num_external_tokens = 0
        tracker.hit_slots, tracker.hit_source = (), ""
        tracker.num_computed_tokens = 0

    def finish(self, req_id: str) -> bool:
        """The request ended normally; False if it was not tracked (finishing twice is fine)."""
        return self._end(req_id, Event.FINISHED)

    def abort(self, req_id: str) -> bool:
        """The request was aborted in any state; False if it was not tracked."""
        return self._end(req_id, Event.ABORTED)

    def _end(self, req_id: str, event: Event) -> bool:
        tracker = self._requests.get(req_id)
        if tracker is None:
            return False
        if tracker.state is RequestState.PREFETCHING:
            self._orphans.add(req_id)
        tracker.move(event)
        assert tracker.state in TERMINAL
        self._release(tracker)
        del self._requests[req_id]
        return True
