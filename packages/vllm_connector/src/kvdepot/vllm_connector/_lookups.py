"""The scheduler side's lookups: queued as requests are keyed, sent together, their replies fed on.

A path through one lookup:

1. `Lookups.start` (vLLM admitted the request, or it must be asked again) keys the chunks past
   vLLM's own prefix-cache hit (`kvdepot.core.Planner.start_lookup`) and queues them.
2. `Lookups.send` sends every queued lookup of the scheduling pass as one message, the first
   time vLLM asks for a match; each request's `Record` keeps the reply's future, where its
   items are in it, and the server instance asked.
3. `Lookups.settle` reads the reply once it is in. Before the reply, the server's slot index
   in shared memory may answer at once (`_index_lookups.py`); else vLLM asks for the match
   again after the scheduler side gave the reply one bounded moment to land. The reply is
   read: `_lookup_reply.py` says what it means, and this feeds that to the planner (hits,
   leases, slots, source), the record, the KV events and the counters. A reply later than the
   lookup timeout is a miss; whatever leases it brings go back when it lands
   (`release_on_arrival`).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from kvdepot.transport import DeadlineExceededError, LookupItem
from kvdepot.vllm_connector._index_lookups import IndexReader
from kvdepot.vllm_connector._lookup_reply import LookupReading, LookupStatus, lookup_status, read_reply

if TYPE_CHECKING:
    from collections.abc import Callable

    from kvdepot.core import Planner
    from kvdepot.transport import CacheClient
    from kvdepot.vllm_connector._health import ServerHealth
    from kvdepot.vllm_connector._kv_events import EventAnnouncer
    from kvdepot.vllm_connector._lease_book import LeaseBook
    from kvdepot.vllm_connector._prefill import PrefillRate
    from kvdepot.vllm_connector._record import Record

log = logging.getLogger("vllm.kvdepot.scheduler")


class Lookups:
    """The lookups of one engine's requests, from queued to fed to the planner."""

    def __init__(
        self,
        planner: Planner,
        *,
        client: CacheClient,
        health: ServerHealth,
        leases: LeaseBook,
        prefill: PrefillRate,
        events: EventAnnouncer | None,
        lookup_timeout: float,
        count: Callable[[str, float], None],
        slot_index: bool = True,
    ) -> None:
        """``prefill``: the engine's compute time per token, sent with each lookup (a server
        reading chunks through from a tier below never waits longer than recomputing);
        ``count``: adds to the scheduler side's counters; ``slot_index``: answer from the server's
        slot index while a reply is not in (`_index_lookups.py`)."""
        self.planner = planner
        self.client, self.health, self.leases = client, health, leases
        self.prefill, self.events, self.count = prefill, events, count
        self.lookup_timeout = lookup_timeout
        self.kv_world_size = planner.namespace.kv_world_size
        self.index = IndexReader(client) if slot_index else None
        # Replies to lookups the slot index answered, by request: their leases join the hit as
        # they land (`collect_leases`). (future, where the request's results start, server instance)
        self._unleased: dict[str, tuple[Future[Any], int, str]] = {}
        # Lookups keyed but not sent yet: they leave together (`send`).
        self._queued: list[tuple[Record, str, list[list[bytes]]]] = []

    def start(self, record: Record, local_tokens: int) -> bool:
        """Queue a lookup of the chunks past the local hit; False if the server is not usable."""
        if not self.health.usable():
            self.count("lookup_misses_server_down", 1)
            return False
        req_id = record.request.request_id
        self._drop_unleased(req_id)
        keys = self.planner.start_lookup(req_id, record.request.all_token_ids, local_tokens=local_tokens)
        self.leases.release(self.planner.take_leases())  # a repeated lookup gives back the old leases
        if keys is not None:
            record.lookup, record.sent_at, record.keys = None, time.monotonic(), keys
            record.index_asked = False
            self._queued.append((record, self.planner.get(req_id).cache_salt, keys))
        return True

    def forget(self, req_id: str) -> None:
        """The request ended: its lookup, if still queued, is not sent."""
        self._queued = [item for item in self._queued if item[0].request.request_id != req_id]
        # A reply to its lookup the slot index answered stays in `_unleased`: if the request
        # ended while its load copies, the lease is held until the copy ends (`collect_leases`).

    def collect_leases(self) -> None:
        """The leases of the replies landed since to lookups the slot index answered go to the
        planner, which holds them with the hit, or gives them back when it is gone."""
        for req_id, (future, first, server_id) in list(self._unleased.items()):
            if not future.done():
                continue
            del self._unleased[req_id]
            try:
                results = future.result().results[first : first + self.kv_world_size]
            except Exception:  # noqa: S112 - a failed reply brings no lease
                continue
            if leases := [r.lease_id for r in results if r.lease_id]:
                self.planner.add_leases(req_id, server_id, leases)

    def _drop_unleased(self, req_id: str) -> None:
        """The request is looked up again: its index-answered lookup's leases go back."""
        if (pending := self._unleased.pop(req_id, None)) is not None:
            self.leases.release_on_arrival(*pending)

    def send(self) -> None:
        """Sends every queued lookup as one message."""
        if not self._queued:
            return
        queued, self._queued = self._queued, []
        items = [LookupItem(salt=salt, keys=rank_keys) for _record, salt, keys in queued for rank_keys in keys]
        server_id = self.client.server_id or ""
        try:
            per_chunk = self.prefill.seconds_for(self.planner.chunk_size)
            future: Future[Any] = self.client.lookup(items, prefill_s_per_chunk=per_chunk)
        except Exception as exc:  # the client is closed: every lookup is a miss
            log.warning("kvdepot lookup could not be sent, counting %d requests as misses: %s", len(queued), exc)
            future = Future()
            future.set_exception(exc)
        for index, (record, _salt, _keys) in enumerate(queued):
            record.lookup, record.first_item, record.server_id = future, index * self.kv_world_size, server_id

    def settle(self, record: Record, *, from_index: bool = False) -> bool:
        """Apply the request's lookup reply if it is in, or (``from_index``) the slot index's
        answer while it is not; True once the request is looked up."""
        future = record.lookup
        assert future is not None
        status = lookup_status(future.done(), time.monotonic() - record.sent_at, self.lookup_timeout)
        if status is LookupStatus.WAITING and from_index and self.index is not None and not record.index_asked:
            record.index_asked = True
            req_id = record.request.request_id
            tracker = self.planner.get(req_id)
            reading = self.index.read(
                tracker.cache_salt, record.keys, lookup_first=tracker.lookup_first, server_id=record.server_id
            )
            if reading is not None:
                # The answer has no lease; the reply's join the hit when it lands (`collect_leases`).
                self._unleased[req_id] = (future, record.first_item, record.server_id)
                record.lookup = None
                self.count("lookups_from_index", 1)
                self._apply(record, reading)
                return True
        if status is LookupStatus.TIMED_OUT:
            req_id = record.request.request_id
            log.warning("kvdepot lookup for %s took over %.1fs; counting it as a miss", req_id, self.lookup_timeout)
            self.health.report_timeout()
            self.count("lookup_misses_timeout", 1)
            self.release_on_arrival(record)
            self.planner.on_lookup_done(req_id, [0], ())
        elif status is LookupStatus.ANSWERED:
            record.lookup = None
            tracker = self.planner.get(record.request.request_id)
            reading = read_reply(
                self._results(record, future),
                record.first_item,
                world=self.kv_world_size,
                # The slots are only meaningful in the pool of the server that answered: if the
                # client reconnected to another instance meanwhile, the reply counts as a miss.
                same_server=bool(record.server_id) and record.server_id == self.client.server_id,
                lookup_first=tracker.lookup_first,
            )
            self._apply(record, reading)
        return status is not LookupStatus.WAITING

    def release_on_arrival(self, record: Record) -> None:
        """Release whatever leases a reply we no longer wait for brings when it arrives."""
        future, record.lookup = record.lookup, None
        if future is not None:
            self.leases.release_on_arrival(future, record.first_item, record.server_id)

    def _apply(self, record: Record, reading: LookupReading) -> None:
        """Feed a request's lookup reply, read (`read_reply`) or answered by the slot index, to
        the planner, its record, its KV events and the counters."""
        req_id = record.request.request_id
        tracker = self.planner.get(req_id)
        record.slot_bytes, record.read_back = reading.slot_bytes, reading.read_back
        if self.events is not None and reading.hit_chunks > 0:
            hit_keys = [rank_keys[: reading.hit_chunks] for rank_keys in record.keys]
            self.events.hit(record.request, tracker.lookup_first, hit_keys, tracker.cache_salt)
        self.planner.on_lookup_done(
            req_id, reading.hits, reading.leases, slots=reading.slots, source=record.server_id, at=record.sent_at
        )
        self.count("lookups", 1)
        self.count("lookup_seconds_sum", time.monotonic() - record.sent_at)
        hit_chunks = tracker.hit_chunks - tracker.lookup_first if tracker.hit_chunks else 0
        self.count("lookup_hit_tokens", hit_chunks * self.planner.chunk_size)

    def _results(self, record: Record, future: Future[Any]) -> list[Any]:
        """The results of a lookup reply that is in; none (a miss) if the lookup failed."""
        try:
            results: list[Any] = future.result().results
        except Exception as exc:
            if isinstance(exc, DeadlineExceededError):
                self.health.report_timeout()
            log.warning("kvdepot lookup for %s failed, counting it as a miss: %s", record.request.request_id, exc)
            return []
        return results
