"""What kvdepot holds for this engine, in the engine's own KV event stream (``--kv-events-config``).

vLLM publishes what its prefix cache gains and loses as KV events, which KV-aware routers
(llm-d's indexer, Dynamo's router) read. With events enabled, the connector adds kvdepot's part
through `take_events()`, so the same stream also says which prompt prefixes this engine can
load from kvdepot's RAM:

- a chunk is announced as ``BlockStored`` once every KV rank's copy of it is committed on the
  server (a store of this engine), or when a lookup of this engine hits it; one event per chunk
  and KV-cache group, naming vLLM's own block hashes of the chunk's blocks (and the hash of the
  block before it as the parent), with its token ids and vLLM's block size, ``medium="CPU"``,
  ``locality="LOCAL"`` and ``ownership="kvdepot"``;
- a ``BlockRemoved`` follows when the server evicts or clears any rank's copy of an announced
  chunk, or restarts without it. kvdepot never sends ``AllBlocksCleared``;
- a chunk that leaves RAM while the tiers below it (disk, remote) hold every rank's copy is
  announced there: ``BlockStored`` with ``medium="STORAGE"``, until a check finds it gone from
  them (``BlockRemoved``, ``"STORAGE"``). The tiers evict on their own (the disk by capacity,
  Valkey by its LRU) without telling anyone, so such a chunk is asked about every
  `STORAGE_CHECK_S`: a router may believe in it that long after the tier dropped it. A chunk
  in RAM is announced in RAM alone.

How it learns what went: the server numbers every chunk that becomes visible or goes in its
RAM (`kvdepot.transport.Changes`); once per `POLL_S` at most, at an engine step, the scheduler
sends one message asking for the changes of its salts since the last number it saw, and reads
the reply at a later step, never waiting for it. So an event is published one or two engine
steps after the change, an idle engine publishes nothing until its next step, and events of one
chunk keep the server's order. If the server's log has moved past the last number (it keeps
the last 131,072 changes) or the server restarted, nothing is lost silently: the next poll asks
the server which watched chunks it holds (`Query`, in the same message as the changes, so both
answer the same moment) and announces or removes the difference.

Each announced chunk is also asked about every `RECHECK_S`, whatever the changes said: no
announcement outlives its chunk by longer, whatever went wrong in between. A poll asks about
at most `CHECKS_PER_POLL` chunks (a check of every chunk, after a gap or a restart, is spread
over polls), and the salts go `MAX_SALTS_PER_CHANGES` to a `Changes` request, several in one
message if need be.

Each watched chunk has a phase (announced nowhere, in RAM, below, in both), and what moves it,
with its events and its next checks, is a table in `_chunk_phases.py`; `EventAnnouncer` polls
the server, feeds the table what it read, and carries out the moves.

Bounds: at most `MAX_WATCHED` chunks are watched; past that the oldest is forgotten, with a
``BlockRemoved`` if it was announced (a router under-counts rather than over-counts). A chunk
planned for a store that never shows up (its store failed, or another engine's copy was there
first) is checked with the server after `CHECK_AFTER_S`, and forgotten after `PENDING_TTL_S`.

Tenancy: vLLM puts a request's ``cache_salt`` in plaintext in the first block's extra keys.
kvdepot's events carry its label instead: the server's keyed label (`kvdepot.core.SaltLabeler`
with the key the server hands its owner's engines in `HelloReply.label_key`), the one its
/metrics shows, so subscribers can tell tenants apart but never learn a salt, even from a list
of guesses. A server that keeps its key (tcp without a shared secret), or one too old to send
it, leaves the salt out of the extra keys: an unkeyed digest of a guessable salt would name it.
A router that rebuilds block keys from the extra keys will therefore not match kvdepot's salted
chunks to vLLM's; routers that use vLLM's block hashes do (they are salted digests already).
"""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import attrs

from kvdepot.transport import MAX_ITEMS_PER_LOOKUP, MAX_SALTS_PER_CHANGES, LookupItem
from kvdepot.vllm_connector._chunk_phases import (
    CHECK_AFTER_S,
    Check,
    Chunk,
    Phase,
    Seen,
    check_time,
    due,
    move,
)
from kvdepot.vllm_connector._kv_event_blocks import BlockEvents

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from kvdepot.transport import CacheClient

log = logging.getLogger("vllm.kvdepot.events")

#: The scheduler asks the server for changes at most this often (seconds).
POLL_S = 0.05
#: Chunks watched at most (about 3 KiB each: their tokens and block hashes).
MAX_WATCHED = 8192
#: Chunks asked about per poll at most, in RAM and in the tiers below each (a check of the
#: tiers may cost the server a remote round trip), besides the check of every chunk after a gap.
CHECKS_PER_POLL = 1024
#: Changes asked per poll; a poll that gets this many asks again at the next step.
CHANGES_PER_POLL = 4096


@attrs.frozen
class _Poll:
    """One message in flight: the changes, RAM queries of ``ram`` and tier queries of ``below``."""

    changes: list[Future[Any]]  # one per `MAX_SALTS_PER_CHANGES` salts
    ram_queries: list[Future[Any]]
    ram: list[tuple[Chunk, bytes]]
    tier_queries: list[Future[Any]]
    below: list[Chunk]
    server: str
    since: int

    def done(self) -> bool:
        return all(f.done() for f in (*self.changes, *self.ram_queries, *self.tier_queries))

    def results(self) -> tuple[list[Any], list[Any], list[Any]]:
        """The replies to the changes, and the results of the RAM and the tier queries (raises what a future raised)."""
        return (
            [future.result() for future in self.changes],
            [result for query in self.ram_queries for result in query.result().results],
            [result for query in self.tier_queries for result in query.result().results],
        )


class EventAnnouncer:
    """Turns kvdepot's stores, hits and the server's changes into vLLM KV events (scheduler thread)."""

    def __init__(
        self,
        client: CacheClient,
        *,
        block_size: int,
        chunk_size: int,
        num_groups: int = 1,
        max_watched: int = MAX_WATCHED,
    ) -> None:
        self._blocks = BlockEvents(client, block_size=block_size, chunk_size=chunk_size, num_groups=num_groups)
        self.client = client
        self.block_size = block_size
        self.chunk_size = chunk_size
        self.blocks_per_chunk = chunk_size // block_size
        self.num_groups = num_groups
        self.max_watched = max_watched
        self._chunks: collections.OrderedDict[bytes, Chunk] = collections.OrderedDict()  # by first rank's key
        self._by_key: dict[bytes, Chunk] = {}
        self._outbox: list[Any] = []
        self._since = 0
        self._server = ""
        self._check_all = False
        self._polled_at = float("-inf")
        self._poll: _Poll | None = None
        # When chunks are due to be asked about, in RAM and in the tiers below: (time, n, chunk),
        # an entry stale once the chunk's own time differs, so a poll never walks every chunk.
        self._ram_due: list[tuple[float, int, Chunk]] = []
        self._below_due: list[tuple[float, int, Chunk]] = []
        self._order = itertools.count()
        self._salts: collections.Counter[str] = collections.Counter()
        self._finer_hashes_logged = False

    # -- what the scheduler tells it ------------------------------------------------------

    def expect(self, request: Request, first_chunk: int, keys: Sequence[Sequence[bytes]], salt: str) -> None:
        """A store of chunks ``first_chunk`` on (``keys``: one list per KV rank) is planned."""
        now = time.monotonic()
        for chunk in self._chunks_of(request, first_chunk, keys, salt):
            self._feed(chunk, Seen.PLANNED, now)
        self._trim(now)

    def hit(self, request: Request, first_chunk: int, keys: Sequence[Sequence[bytes]], salt: str) -> None:
        """A lookup found chunks ``first_chunk`` on in the server's RAM: announce them."""
        now = time.monotonic()
        for chunk in self._chunks_of(request, first_chunk, keys, salt):
            chunk.present.update(chunk.keys)
            self._feed(chunk, Seen.ALL_IN_RAM, now)
        self._trim(now)

    def reset(self) -> None:
        """The engine's keys start a new epoch: nothing watched can be hit by it any more."""
        now = time.monotonic()
        for chunk in list(self._chunks.values()):
            self._feed(chunk, Seen.DROPPED, now)
        self._chunks.clear()
        self._by_key.clear()
        self._salts.clear()
        self._ram_due.clear()
        self._below_due.clear()

    def take(self) -> list[Any]:
        """The events since the last call (vLLM's `take_events`, once per engine step)."""
        self._pump(time.monotonic())
        out, self._outbox = self._outbox, []
        return out

    # -- internals --------------------------------------------------------------------------

    def _chunks_of(self, request: Request, first_chunk: int, keys: Sequence[Sequence[bytes]], salt: str) -> list[Chunk]:
        """The watched chunk of each chunk index (created on first sight)."""
        out: list[Chunk] = []
        hashes = request.block_hashes
        if len(hashes) > len(request.all_token_ids) // self.block_size:
            # vLLM hashes finer than its blocks (a hash block size below the block size, for
            # hybrid models): its events name blocks this announcer cannot tell apart. None sent.
            if not self._finer_hashes_logged:
                self._finer_hashes_logged = True
                log.warning("kvdepot events: vLLM hashes blocks finer than its block size; kvdepot announces nothing")
            return out
        for offset in range(len(keys[0]) if keys else 0):
            index = first_chunk + offset
            rank_keys = tuple(rank[offset] for rank in keys)
            chunk = self._chunks.get(rank_keys[0])
            if chunk is None:
                if (index + 1) * self.blocks_per_chunk > len(hashes):
                    continue  # vLLM has not hashed these blocks (a different hash block size)
                chunk = self._watch(request, index, rank_keys, salt)
            else:
                self._chunks.move_to_end(rank_keys[0])
            out.append(chunk)
        return out

    def _watch(self, request: Request, index: int, keys: tuple[bytes, ...], salt: str) -> Chunk:
        now = time.monotonic()
        chunk = self._blocks.chunk(request, index, keys, salt, now)
        self._chunks[keys[0]] = chunk
        for key in keys:
            self._by_key[key] = chunk
        self._salts[salt] += 1
        self._check_ram(chunk, now + CHECK_AFTER_S)
        return chunk

    def _check_ram(self, chunk: Chunk, at: float) -> None:
        chunk.check_at = at
        heapq.heappush(self._ram_due, (at, next(self._order), chunk))

    def _check_below(self, chunk: Chunk, at: float) -> None:
        chunk.storage_check_at = at
        if at != float("inf"):
            heapq.heappush(self._below_due, (at, next(self._order), chunk))

    def _watched(self, chunk: Chunk) -> bool:
        return self._chunks.get(chunk.keys[0]) is chunk

    def _due(
        self, heap: list[tuple[float, int, Chunk]], now: float, wanted: Callable[[Chunk, float], bool]
    ) -> list[Chunk]:
        """The chunks whose time in ``heap`` has come (once each; stale entries dropped), at
        most `CHECKS_PER_POLL`: the rest stay due for the next polls."""
        out: dict[int, Chunk] = {}
        while heap and heap[0][0] <= now and len(out) < CHECKS_PER_POLL:
            at, _, chunk = heapq.heappop(heap)
            if self._watched(chunk) and wanted(chunk, at):
                out[id(chunk)] = chunk
        return list(out.values())

    def _trim(self, now: float) -> None:
        """Forget the oldest chunks past `max_watched` (announced ones with a removal)."""
        while len(self._chunks) > self.max_watched:
            self._feed(next(iter(self._chunks.values())), Seen.DROPPED, now)

    def _feed(self, chunk: Chunk, seen: Seen, now: float) -> None:
        """Carry out what ``seen`` does to ``chunk`` (`_chunk_phases.TRANSITIONS`): its events,
        its next checks, and forgetting it where it is gone."""
        step = move(chunk.phase, seen)
        chunk.phase = step.phase
        if step.restart:
            chunk.since = now
        for emit in step.emit:
            self._outbox.extend(self._blocks.events(chunk, emit))
        if step.ram is not Check.KEEP:
            self._check_ram(chunk, check_time(step.ram, now, chunk.since))
        if step.below is not Check.KEEP:
            self._check_below(chunk, check_time(step.below, now, chunk.since))
        if step.phase is Phase.GONE:
            self._forget(chunk)

    def _forget(self, chunk: Chunk) -> None:
        if self._chunks.pop(chunk.keys[0], None) is chunk:
            self._salts[chunk.salt] -= 1
            if not self._salts[chunk.salt]:
                del self._salts[chunk.salt]
        for key in chunk.keys:
            if self._by_key.get(key) is chunk:
                del self._by_key[key]

    def _saw(self, chunk: Chunk, key: bytes, in_ram: bool, now: float) -> None:
        """The server holds ``key``, one rank's copy of ``chunk``, in RAM (``in_ram``), or not."""
        if not in_ram:
            chunk.present.discard(key)
            self._feed(chunk, Seen.KEY_GONE, now)
            return
        chunk.present.add(key)
        if chunk.present.issuperset(chunk.keys):
            self._feed(chunk, Seen.ALL_IN_RAM, now)

    def _pump(self, now: float) -> None:
        if self._poll is not None:
            if not self._poll.done():
                return
            poll, self._poll = self._poll, None
            self._apply(poll, now)
        if now - self._polled_at >= POLL_S and self._chunks:
            self._send(now)

    def _send(self, now: float) -> None:
        """One message: the changes since the last number, then queries of the chunks to check
        in RAM, and of those to check in the tiers below."""
        self._polled_at = now
        server = self.client.server_id or ""
        since = self._changes_from(server, now)
        due, below = self._checks_due(now)
        ram = [(chunk, key) for chunk in due for key in chunk.keys]
        salts = sorted(self._salts)
        try:
            with self.client.batch() as batch:
                changes = [
                    batch.changes(since, salts[i : i + MAX_SALTS_PER_CHANGES], limit=CHANGES_PER_POLL, server_id=server)
                    for i in range(0, max(1, len(salts)), MAX_SALTS_PER_CHANGES)
                ]
                ram_queries = self._queries(batch, ram, tiers=False)
                tier_queries = self._queries(batch, [(c, key) for c in below for key in c.keys], tiers=True)
        except Exception as exc:  # the client is closed or the server down: try again later
            log.debug("kvdepot events: changes not asked: %s", exc)
            self._retry(due, below, now)
            return
        self._poll = _Poll(changes, ram_queries, ram, tier_queries, below, server, since)

    def _changes_from(self, server: str, now: float) -> int:
        """The number to ask the changes from. After a gap or a restart (a new server instance:
        its numbering and its RAM are new), every chunk is asked about again, CHECKS_PER_POLL a
        poll, and the changes are read from where the server stands now (0: the queries cover the rest)."""
        if server != self._server:
            self._check_all = True
        if not self._check_all:
            return self._since
        self._check_all = False
        for chunk in self._chunks.values():
            self._feed(chunk, Seen.CHECK_ALL, now)
        return 0

    def _checks_due(self, now: float) -> tuple[list[Chunk], list[Chunk]]:
        """The chunks to ask about in RAM and in the tiers below in this poll; those planned or
        gone a minute ago, and never seen committed since, are forgotten instead."""
        due_ram = self._due(self._ram_due, now, lambda c, at: c.check_at == at)
        below = self._due(self._below_due, now, lambda c, at: c.storage_check_at == at)
        for chunk in due_ram:
            self._feed(chunk, due(chunk.since, now), now)
        for chunk in below:
            if self._watched(chunk):
                self._feed(chunk, Seen.BELOW_CHECK_DUE, now)
        return [c for c in due_ram if self._watched(c)], below

    def _retry(self, due: list[Chunk], below: list[Chunk], now: float) -> None:
        """A poll that failed: its checks are due again a second later (and the poll with them)."""
        self._polled_at = now + CHECK_AFTER_S - POLL_S
        for chunk in due:
            if self._watched(chunk):
                self._feed(chunk, Seen.RAM_CHECK_FAILED, now)
        for chunk in below:
            if self._watched(chunk):
                self._feed(chunk, Seen.BELOW_CHECK_FAILED, now)

    @staticmethod
    def _queries(batch: Any, keys: list[tuple[Chunk, bytes]], *, tiers: bool) -> list[Future[Any]]:
        """Queries of one key each (so each answer is that key's alone), as few messages as the protocol allows."""
        return [
            batch.query(
                [LookupItem(chunk.salt, [key]) for chunk, key in keys[i : i + MAX_ITEMS_PER_LOOKUP]], tiers=tiers
            )
            for i in range(0, len(keys), MAX_ITEMS_PER_LOOKUP)
        ]

    def _apply(self, poll: _Poll, now: float) -> None:
        try:
            replies, ram, below = poll.results()
        except Exception as exc:
            log.debug("kvdepot events: changes not read: %s", exc)
            self._retry([chunk for chunk, _ in poll.ram], poll.below, now)
            return
        reply = replies[0]  # each asked the same numbers, of other salts
        self._server = poll.server
        self._since = reply.next
        if reply.lost:
            self._check_all = True  # what was missed is asked next time, with the changes after it
        self._apply_changes(replies, now)
        self._apply_below(poll.below, below, now)
        if (poll.since and reply.next - poll.since >= CHANGES_PER_POLL) or reply.lost:
            # More changes to read, or missed: the RAM answers describe another moment than the
            # changes read so far. Ask again at the next step, those chunks with it.
            self._polled_at = float("-inf")
            for chunk, _ in poll.ram:
                if self._watched(chunk):
                    self._feed(chunk, Seen.RAM_CHECK_AGAIN, now)
        else:
            self._apply_ram(poll.ram, ram, now)

    def _apply_ram(self, asked: list[tuple[Chunk, bytes]], results: list[Any], now: float) -> None:
        """The RAM queries' answers, one per (chunk, key) asked."""
        for (chunk, key), result in zip(asked, results, strict=False):
            if self._by_key.get(key) is chunk:
                self._saw(chunk, key, bool(result.ram), now)

    def _apply_changes(self, replies: list[Any], now: float) -> None:
        for change in (change for r in replies for change in r.changes):
            chunk = self._by_key.get(change.key)
            if chunk is not None:  # keys are salted digests: a known key is this chunk, whatever salt asked
                self._saw(chunk, change.key, change.stored, now)

    def _apply_below(self, chunks: list[Chunk], results: list[Any], now: float) -> None:
        """The tiers' answers for ``chunks``, their keys' in order. A key in RAM is taken as held
        below too: it was read back, or is written behind."""
        at = 0
        for chunk in chunks:
            mine, at = results[at : at + len(chunk.keys)], at + len(chunk.keys)
            if self._watched(chunk) and len(mine) == len(chunk.keys):
                held = all(r.ram or r.below for r in mine)
                self._feed(chunk, Seen.HELD_BELOW if held else Seen.NOT_BELOW, now)
