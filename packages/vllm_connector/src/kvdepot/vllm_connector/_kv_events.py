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

from kvdepot.core import InvalidArgumentError, SaltLabeler
from kvdepot.transport import MAX_ITEMS_PER_LOOKUP, MAX_SALTS_PER_CHANGES, LookupItem

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from kvdepot.transport import CacheClient

log = logging.getLogger("vllm.kvdepot.events")

#: The scheduler asks the server for changes at most this often (seconds).
POLL_S = 0.05
#: Chunks watched at most (about 3 KiB each: their tokens and block hashes).
MAX_WATCHED = 8192
#: A planned chunk not yet seen committed is asked about after a second, and given up after a
#: minute; one seen go is given up a minute later unless a commit brings it back.
CHECK_AFTER_S = 1.0
PENDING_TTL_S = 60.0
#: An announced chunk is asked about again this often (seconds), whatever the changes said: a
#: bound on how long any announcement can outlive its chunk.
RECHECK_S = 30.0
#: Chunks asked about per poll at most, in RAM and in the tiers below each (a check of the
#: tiers may cost the server a remote round trip), besides the check of every chunk after a gap.
CHECKS_PER_POLL = 1024
#: Changes asked per poll; a poll that gets this many asks again at the next step.
CHANGES_PER_POLL = 4096
#: A chunk announced in the tiers below RAM is asked about again this often (seconds): how long
#: a router may believe in a chunk the remote tier's own eviction (Valkey's LRU) took.
STORAGE_CHECK_S = 30.0
MEDIUM = "CPU"
STORAGE = "STORAGE"
OWNER = "kvdepot"


def _same(block_hash: Any) -> Any:
    return block_hash


def _low_64_bits(block_hash: bytes) -> int:
    return int.from_bytes(block_hash, "big") & ((1 << 64) - 1)


def _block_hash_converter(vllm_convert: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """vLLM's conversion of a block hash for its events (bytes, or by default their low 64 bits as
    an int), without its cost: vLLM reads its environment on every call, which costs more than
    the rest of an announcement. Checked against vLLM's own on a probe; vLLM's is used if they differ."""
    probe = bytes(range(32))
    for convert in (_same, _low_64_bits):
        if convert(probe) == vllm_convert(probe):
            return convert
    return vllm_convert


@attrs.define(eq=False)
class _Chunk:
    """One chunk of this engine's requests: its key per KV rank, which are committed, what its events say."""

    keys: tuple[bytes, ...]
    salt: str
    hashes: list[Any]  # vLLM's hashes of its blocks, as its events name them
    parent: Any
    tokens: tuple[int, ...]
    lora: tuple[int | None, str | None]
    extra: list[tuple[Any, ...] | None] | None
    present: set[bytes] = attrs.Factory(set)
    #: Announced in RAM (medium CPU); announced in a tier below (medium STORAGE).
    announced: bool = False
    storage: bool = False
    #: When it was planned, or last seen go; and when the server is asked about it next (monotonic).
    since: float = 0.0
    check_at: float = 0.0
    #: When the tiers below are asked whether they hold it (never unless it left RAM or is in them).
    storage_check_at: float = float("inf")


@attrs.frozen
class _Poll:
    """One message in flight: the changes, RAM queries of ``ram`` and tier queries of ``below``."""

    changes: list[Future[Any]]  # one per `MAX_SALTS_PER_CHANGES` salts
    ram_queries: list[Future[Any]]
    ram: list[tuple[_Chunk, bytes]]
    tier_queries: list[Future[Any]]
    below: list[_Chunk]
    server: str
    since: int

    def done(self) -> bool:
        return all(f.done() for f in (*self.changes, *self.ram_queries, *self.tier_queries))


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
        from vllm.distributed.kv_events import BlockRemoved, BlockStored
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        self._stored_cls, self._removed_cls = BlockStored, BlockRemoved
        self._convert = _block_hash_converter(maybe_convert_block_hash)
        fields = set(BlockStored.__struct_fields__)
        self._extra = {name: value for name, value in (("locality", "LOCAL"), ("ownership", OWNER)) if name in fields}
        self.client = client
        self.block_size = block_size
        self.chunk_size = chunk_size
        self.blocks_per_chunk = chunk_size // block_size
        self.num_groups = num_groups
        self.max_watched = max_watched
        self._chunks: collections.OrderedDict[bytes, _Chunk] = collections.OrderedDict()  # by first rank's key
        self._by_key: dict[bytes, _Chunk] = {}
        self._outbox: list[Any] = []
        self._since = 0
        self._server = ""
        self._check_all = False
        self._polled_at = float("-inf")
        self._poll: _Poll | None = None
        # When chunks are due to be asked about, in RAM and in the tiers below: (time, n, chunk),
        # an entry stale once the chunk's own time differs, so a poll never walks every chunk.
        self._ram_due: list[tuple[float, int, _Chunk]] = []
        self._below_due: list[tuple[float, int, _Chunk]] = []
        self._order = itertools.count()
        self._salts: collections.Counter[str] = collections.Counter()
        self._finer_hashes_logged = False
        self._labeler: SaltLabeler | None = None  # keyed by the server's label key, once it sent one

    # -- what the scheduler tells it ------------------------------------------------------

    def expect(self, request: Request, first_chunk: int, keys: Sequence[Sequence[bytes]], salt: str) -> None:
        """A store of chunks ``first_chunk`` on (``keys``: one list per KV rank) is planned."""
        now = time.monotonic()
        for chunk in self._chunks_of(request, first_chunk, keys, salt):
            if not chunk.announced:
                chunk.since = now
                self._check_ram(chunk, now + CHECK_AFTER_S)
        self._trim()

    def hit(self, request: Request, first_chunk: int, keys: Sequence[Sequence[bytes]], salt: str) -> None:
        """A lookup found chunks ``first_chunk`` on in the server's RAM: announce them."""
        for chunk in self._chunks_of(request, first_chunk, keys, salt):
            chunk.present.update(chunk.keys)
            self._announce(chunk)
        self._trim()

    def reset(self) -> None:
        """The engine's keys start a new epoch: nothing watched can be hit by it any more."""
        for chunk in self._chunks.values():
            self._unannounce(chunk)
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

    def _chunks_of(
        self, request: Request, first_chunk: int, keys: Sequence[Sequence[bytes]], salt: str
    ) -> list[_Chunk]:
        """The watched chunk of each chunk index (created on first sight)."""
        out: list[_Chunk] = []
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

    def _watch(self, request: Request, index: int, keys: tuple[bytes, ...], salt: str) -> _Chunk:
        first_block = index * self.blocks_per_chunk
        blocks = range(first_block, first_block + self.blocks_per_chunk)
        lora = getattr(request, "lora_request", None)
        lora_name = lora.name if lora is not None else None
        extra: list[tuple[Any, ...] | None] = []
        for block in blocks:
            label = self._label(salt) if block == 0 and salt else None
            keys_of_block = ([lora_name] if lora_name else []) + ([label] if label else [])
            extra.append(tuple(keys_of_block) or None)
        now = time.monotonic()
        chunk = _Chunk(
            keys,
            salt,
            hashes=[self._convert(request.block_hashes[block]) for block in blocks],
            parent=self._convert(request.block_hashes[first_block - 1]) if first_block else None,
            tokens=tuple(request.all_token_ids[index * self.chunk_size : (index + 1) * self.chunk_size]),
            lora=(lora.adapter_id if lora is not None else None, lora_name),
            extra=extra if any(extra) else None,
            since=now,
        )
        self._chunks[keys[0]] = chunk
        for key in keys:
            self._by_key[key] = chunk
        self._salts[salt] += 1
        self._check_ram(chunk, now + CHECK_AFTER_S)
        return chunk

    def _label(self, salt: str) -> str | None:
        """The server's label of ``salt`` (as its /metrics names it); None without its key."""
        key = self.client.label_key
        if not key:
            return None
        if self._labeler is None or self._labeler.key != key:  # first, or a server with a new key
            try:
                self._labeler = SaltLabeler(key)
            except InvalidArgumentError:  # too short to be a key: no label rather than a guessable one
                return None
        return self._labeler(salt)

    def _check_ram(self, chunk: _Chunk, at: float) -> None:
        chunk.check_at = at
        heapq.heappush(self._ram_due, (at, next(self._order), chunk))

    def _check_below(self, chunk: _Chunk, at: float) -> None:
        chunk.storage_check_at = at
        if at != float("inf"):
            heapq.heappush(self._below_due, (at, next(self._order), chunk))

    def _watched(self, chunk: _Chunk) -> bool:
        return self._chunks.get(chunk.keys[0]) is chunk

    def _due(
        self, heap: list[tuple[float, int, _Chunk]], now: float, wanted: Callable[[_Chunk, float], bool]
    ) -> list[_Chunk]:
        """The chunks whose time in ``heap`` has come (once each; stale entries dropped), at
        most `CHECKS_PER_POLL`: the rest stay due for the next polls."""
        out: dict[int, _Chunk] = {}
        while heap and heap[0][0] <= now and len(out) < CHECKS_PER_POLL:
            at, _, chunk = heapq.heappop(heap)
            if self._watched(chunk) and wanted(chunk, at):
                out[id(chunk)] = chunk
        return list(out.values())

    def _stored(self, chunk: _Chunk, medium: str = MEDIUM) -> list[Any]:
        tokens = list(chunk.tokens)
        return [
            self._stored_cls(
                block_hashes=chunk.hashes,
                parent_block_hash=chunk.parent,
                token_ids=tokens,
                block_size=self.block_size,
                lora_id=chunk.lora[0],
                medium=medium,
                lora_name=chunk.lora[1],
                extra_keys=chunk.extra,
                group_idx=group,
                **self._extra,
            )
            for group in range(self.num_groups)
        ]

    def _removed(self, chunk: _Chunk, medium: str = MEDIUM) -> list[Any]:
        return [
            self._removed_cls(block_hashes=chunk.hashes, medium=medium, group_idx=group, **self._extra)
            for group in range(self.num_groups)
        ]

    def _trim(self) -> None:
        """Forget the oldest chunks past `max_watched` (announced ones with a removal)."""
        while len(self._chunks) > self.max_watched:
            self._forget(next(iter(self._chunks.values())))

    def _unannounce(self, chunk: _Chunk) -> None:
        if chunk.announced:
            self._outbox.extend(self._removed(chunk))
        if chunk.storage:
            self._outbox.extend(self._removed(chunk, STORAGE))
        chunk.announced = chunk.storage = False

    def _forget(self, chunk: _Chunk) -> None:
        self._unannounce(chunk)
        if self._chunks.pop(chunk.keys[0], None) is chunk:
            self._salts[chunk.salt] -= 1
            if not self._salts[chunk.salt]:
                del self._salts[chunk.salt]
        for key in chunk.keys:
            if self._by_key.get(key) is chunk:
                del self._by_key[key]

    def _announce(self, chunk: _Chunk) -> None:
        if not chunk.announced and chunk.present.issuperset(chunk.keys):
            chunk.announced = True
            self._outbox.extend(self._stored(chunk))
            self._check_ram(chunk, time.monotonic() + RECHECK_S)

    def _went(self, chunk: _Chunk, key: bytes, now: float) -> None:
        chunk.present.discard(key)
        if chunk.announced:  # watched again as if just planned: a new commit announces it again
            chunk.announced = False
            chunk.since = now  # a commit in the changes announces it again; forgotten if none comes
            self._outbox.extend(self._removed(chunk))
            self._check_ram(chunk, self._next_check(chunk, now))
            self._check_below(chunk, now)  # is it still in a tier below?

    def _below(self, chunk: _Chunk, held: bool, now: float) -> None:
        """The tiers below RAM hold every rank's copy of the chunk (``held``), or not."""
        went = chunk.storage and not held
        if held and not chunk.storage:
            self._outbox.extend(self._stored(chunk, STORAGE))
        elif went:
            self._outbox.extend(self._removed(chunk, STORAGE))
        chunk.storage = held
        self._check_below(chunk, now + STORAGE_CHECK_S if held else float("inf"))
        if went and not chunk.announced:
            chunk.since = now  # in no tier: forgotten in a minute unless a commit brings it back
            self._check_ram(chunk, self._next_check(chunk, now))

    def _next_check(self, chunk: _Chunk, now: float) -> float:
        """When to ask the server whether RAM holds the chunk next."""
        if chunk.announced:
            return now + RECHECK_S
        if chunk.storage:
            return float("inf")  # the changes say when it is back in RAM; the tiers' check when it goes
        # planned or gone: asked a second after it was, then given up a minute on
        return max(now + CHECK_AFTER_S, chunk.since + PENDING_TTL_S)

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
        if server != self._server:
            self._check_all = True  # a new server instance: its numbering and its RAM are new
        since = self._since
        if self._check_all:
            # After a gap or a restart: every chunk is asked about again, CHECKS_PER_POLL a poll,
            # and the changes are read from where the server stands now (the queries cover the rest).
            since, self._check_all = 0, False
            for chunk in self._chunks.values():
                self._check_ram(chunk, now)
                if chunk.storage:
                    self._check_below(chunk, now)
        due = self._due(self._ram_due, now, lambda c, at: c.check_at == at)
        below = self._due(self._below_due, now, lambda c, at: c.storage_check_at == at)
        for chunk in [c for c in due if not (c.announced or c.storage) and now - c.since >= PENDING_TTL_S]:
            self._forget(chunk)  # planned or gone a minute ago, and never seen committed since
        due = [c for c in due if self._watched(c)]
        for chunk in due:
            self._check_ram(chunk, self._next_check(chunk, now))
        for chunk in below:
            self._check_below(chunk, now + STORAGE_CHECK_S)  # until its answer comes
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

    def _retry(self, due: list[_Chunk], below: list[_Chunk], now: float) -> None:
        """A poll that failed: its checks are due again a second later (and the poll with them)."""
        self._polled_at = now + CHECK_AFTER_S - POLL_S
        for chunk in due:
            if self._watched(chunk):
                self._check_ram(chunk, now + CHECK_AFTER_S)
        for chunk in below:
            if self._watched(chunk):
                self._check_below(chunk, now + CHECK_AFTER_S)

    @staticmethod
    def _queries(batch: Any, keys: list[tuple[_Chunk, bytes]], *, tiers: bool) -> list[Future[Any]]:
        """Queries of one key each (so each answer is that key's alone), as few messages as the protocol allows."""
        return [
            batch.query(
                [LookupItem(chunk.salt, [key]) for chunk, key in keys[i : i + MAX_ITEMS_PER_LOOKUP]], tiers=tiers
            )
            for i in range(0, len(keys), MAX_ITEMS_PER_LOOKUP)
        ]

    def _apply(self, poll: _Poll, now: float) -> None:
        try:
            replies = [future.result() for future in poll.changes]
            ram = [result for query in poll.ram_queries for result in query.result().results]
            below = [result for query in poll.tier_queries for result in query.result().results]
        except Exception as exc:
            log.debug("kvdepot events: changes not read: %s", exc)
            self._retry([chunk for chunk, _ in poll.ram], poll.below, now)
            return
        reply = replies[0]  # each asked the same numbers, of other salts
        if poll.server != self._server:
            self._server = poll.server
        self._since = reply.next
        if reply.lost:
            self._check_all = True  # what was missed is asked next time, with the changes after it
        for change in (change for r in replies for change in r.changes):
            chunk = self._by_key.get(change.key)
            if chunk is None:
                continue  # keys are salted digests: a known key is this chunk, whatever salt asked
            if change.stored:
                chunk.present.add(change.key)
                self._announce(chunk)
            else:
                self._went(chunk, change.key, now)
        at = 0
        for chunk in poll.below:  # a key in RAM is taken as held below too: it was read back, or is written behind
            results, at = below[at : at + len(chunk.keys)], at + len(chunk.keys)
            if self._watched(chunk) and len(results) == len(chunk.keys):
                self._below(chunk, all(r.ram or r.below for r in results), now)
        if (poll.since and reply.next - poll.since >= CHANGES_PER_POLL) or reply.lost:
            # More changes to read, or missed: the RAM answers describe another moment than the
            # changes read so far. Ask again at the next step, those chunks with it.
            self._polled_at = float("-inf")
            for chunk, _ in poll.ram:
                if self._watched(chunk):
                    self._check_ram(chunk, now)
            return
        for (chunk, key), result in zip(poll.ram, ram, strict=False):
            if self._by_key.get(key) is not chunk:
                continue
            if result.ram:
                chunk.present.add(key)
                self._announce(chunk)
            else:
                self._went(chunk, key, now)
