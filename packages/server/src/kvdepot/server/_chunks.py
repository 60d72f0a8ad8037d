"""The index's chunks: which (salt, key) is in which slot, in which state, and the figures per salt.

`ChunkTable` is where chunks live and move; `ChunkIndex` (`_index.py`) decides who may move
them. It places a new chunk's slot (within its salt's quota, evicting what the
`EvictionPolicy` picks), moves chunks by the table in `_chunk_state.py` (`step`, the one place
a state changes), frees their slots, and counts what depends on their state: chunks per state,
slot bytes and visible chunks per salt. What others must know (a chunk committed, evicted or
cleared) it queues as events (`_events.py`) for the index's `take_events`.

Pure state, like the index that owns it.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Iterator, Sequence

from kvdepot.server._chunk_state import LIVE, MOVES, VISIBLE, ChunkEvent, ChunkState, move
from kvdepot.server._errors import ServerError
from kvdepot.server._events import Committed, Evicted, IndexEvent
from kvdepot.server._eviction import EvictionPolicy
from kvdepot.server._pool import SlotHeaders
from kvdepot.server._pool_journal import COMMITTED, Record
from kvdepot.server._records import Entry
from kvdepot.server._results import AdoptOutcome
from kvdepot.server._sessions import Sessions
from kvdepot.server._slabs import SlabAllocator

EntryKey = tuple[str, bytes]
# Module globals: cheaper than an Enum class's attributes on the hot paths.
_FREE, _PENDING, _COMMITTED, _LEASED = ChunkState.FREE, ChunkState.PENDING, ChunkState.COMMITTED, ChunkState.LEASED
_RESERVE, _COMMIT, _ABORT, _REMOVE = ChunkEvent.RESERVE, ChunkEvent.COMMIT, ChunkEvent.ABORT, ChunkEvent.REMOVE
_LEASE, _UNLEASE = ChunkEvent.LEASE, ChunkEvent.UNLEASE


class ChunkTable:
    """The chunks in the pool, by name and by slot, with their figures (module docstring)."""

    def __init__(
        self,
        allocator: SlabAllocator,
        headers: SlotHeaders,
        sessions: Sessions,
        *,
        default_quota: int | None,
        events: bool,
    ) -> None:
        self.allocator = allocator
        self.headers = headers  # each slot's header says what it holds
        self.default_quota = default_quota  # bytes of a salt without a quota of its own (None: no limit)
        self.policy = EvictionPolicy(allocator, self._residents, sessions)
        self.entries: dict[EntryKey, Entry] = {}
        self._by_offset: dict[int, Entry] = {}
        self.in_state = dict.fromkeys(LIVE, 0)  # chunks per state
        self.events: list[IndexEvent] | None = [] if events else None
        self.salt_bytes: dict[str, int] = {}  # slot bytes per salt, pending chunks included
        self.salt_chunks: dict[str, int] = {}  # visible chunks per salt
        self.quotas: dict[str, int] = {}
        self.evictions = 0

    def step(self, entry: Entry, event: ChunkEvent) -> None:
        """Move `entry` by the state table, and keep every figure that depends on its state."""
        old = entry.state
        try:
            new, pinned, visible = MOVES[old, event]
        except KeyError:
            move(old, event)  # raises InvalidTransitionError, which says what was asked
            raise
        entry.state = new
        in_state = self.in_state
        if old is not _FREE:
            in_state[old] -= 1
        if new is not _FREE:
            in_state[new] += 1
        self.policy.moved(entry, old, new, pinned)
        if visible:
            add(self.salt_chunks, entry.salt, visible)

    def prefix(self, salt: str, keys: Sequence[bytes]) -> list[Entry]:
        """The visible chunks of `keys`' longest visible prefix."""
        hits: list[Entry] = []
        entries = self.entries
        for key in keys:
            entry = entries.get((salt, key))
            if entry is None or entry.state not in VISIBLE:
                break
            hits.append(entry)
        return hits

    def lease(self, entries: list[Entry]) -> None:
        """Count one more lease on each of `entries` (visible): the first makes it LEASED."""
        step = self.step
        for entry in entries:
            entry.leases += 1
            if entry.leases == 1:
                step(entry, _LEASE)

    def unlease(self, entries: list[Entry]) -> None:
        """Count one lease less on each of `entries`: the last makes it COMMITTED (evictable) again."""
        for entry in entries:
            entry.leases -= 1
            if not entry.leases:
                assert self.entries.get((entry.salt, entry.key)) is entry, "a leased chunk left the index"
                self.step(entry, _UNLEASE)

    # -- slots ----------------------------------------------------------------------------

    def place(self, salt: str, slot_size: int, owner: str) -> int | None:
        """A free slot for a new chunk of `salt`, evicting as the quota and the policy allow."""
        quota = self.quotas.get(salt, self.default_quota)
        if quota is not None:
            if slot_size > quota:
                return None
            over = self.salt_bytes.get(salt, 0) + slot_size > quota
            if over and not self._slot_possible(salt, slot_size):
                return None  # the salt's chunks would be evicted for a slot that cannot be had
            if not self.fit_quota(salt, quota - slot_size):
                return None
        while (offset := self.allocator.allocate(slot_size)) is None:
            victims = self.policy.victims(owner, slot_size)
            if not victims:
                return None
            for victim in victims:
                self.evict(victim)
        return offset

    def fit_quota(self, salt: str, max_bytes: int) -> bool:
        """Evict `salt`'s oldest chunks until it holds at most `max_bytes`; whether it does."""
        while self.salt_bytes.get(salt, 0) > max_bytes:
            if (oldest := self.policy.quota_victim(salt)) is None:
                return False
            self.evict(oldest)
        return True

    def _slot_possible(self, salt: str, slot_size: int) -> bool:
        """Whether a slot of `slot_size` is free, can be freed by the policy, or is what evicting
        the salt's own oldest chunk frees (the quota's first victim)."""
        if self.allocator.can_allocate(slot_size) or self.policy.can_free(slot_size):
            return True
        oldest = self.policy.quota_victim(salt)
        return oldest is not None and oldest.slot_size == slot_size

    def add(self, entry: Entry, *, write_header: bool = True) -> Entry:
        """Put a placed chunk in the table, PENDING; its slot's header names it (an adopted
        slot's header already does)."""
        self.entries[(entry.salt, entry.key)] = entry
        self._by_offset[entry.offset] = entry
        self.policy.own(entry.owner, entry.slot_size)
        add(self.salt_bytes, entry.salt, entry.slot_size)
        self.step(entry, _RESERVE)
        if write_header:
            self.headers.writing(entry.offset, entry.salt, entry.key, entry.length)
        return entry

    def evict(self, entry: Entry) -> None:
        self.remove(entry)
        self.evictions += 1
        if self.events is not None:
            self.events.append(Evicted(entry.salt, entry.key, entry.length))

    def remove(self, entry: Entry) -> None:
        """Take a committed, unleased chunk out and free its slot (evicted or cleared)."""
        self.step(entry, _REMOVE)
        self._free_slot(entry)
        self.policy.removed(entry)

    def drop_pending(self, entry: Entry) -> None:
        """Take a pending chunk out and free its slot (its reservation was aborted)."""
        self.step(entry, _ABORT)
        self._free_slot(entry)

    def _free_slot(self, entry: Entry) -> None:
        del self.entries[(entry.salt, entry.key)]
        del self._by_offset[entry.offset]
        self.policy.own(entry.owner, -entry.slot_size)
        self.allocator.free(entry.offset)
        self.headers.freed(entry.offset)
        add(self.salt_bytes, entry.salt, -entry.slot_size)

    def _residents(self, page: int) -> Iterator[Entry]:
        """The chunks in `page`'s slots."""
        for offset in self.allocator.page_slots(page):
            if (entry := self._by_offset.get(offset)) is not None:
                yield entry

    def adopt(
        self, committed: Sequence[Record], pending: Sequence[Record], *, owners: tuple[str, str]
    ) -> tuple[AdoptOutcome, list[Entry]]:
        """Put a kept pool's verified slots in a table that holds nothing yet: `committed`
        COMMITTED in order, owned by `owners[0]`; `pending` PENDING, owned by `owners[1]` and
        returned for their holder (`ChunkIndex.adopt`). Records that break a quota, repeat a
        chunk, or claim a slot another record has are refused, by reason."""
        assert not self.entries, "adopt runs on an empty index"
        outcome = AdoptOutcome()
        wanted = self._adoptable(committed, pending, outcome.refused)
        held: list[Entry] = []
        accepted = self.allocator.adopt((record.slot, slot_size) for record, slot_size in wanted)
        for (record, slot_size), ok in zip(wanted, accepted, strict=True):
            if not ok:
                add(outcome.refused, "overlap", 1)
                continue
            outcome.records.append(record)
            kept = record.kind == COMMITTED
            owner = owners[0] if kept else owners[1]
            entry = Entry(record.salt, record.key, record.slot, record.length, slot_size, owner)
            self.add(entry, write_header=False)  # its header names it already
            if not kept:
                held.append(entry)
                continue
            self.step(entry, _COMMIT)
            outcome.chunks += 1
            outcome.bytes += entry.length
            if self.events is not None:
                self.events.append(Committed(entry.salt, entry.key, entry.length, entry.owner, False))
        outcome.pending = len(held)
        return outcome, held

    def _adoptable(
        self, committed: Sequence[Record], pending: Sequence[Record], refused: dict[str, int]
    ) -> list[tuple[Record, int]]:
        """The records `adopt` may take, with their slot sizes; the others counted in `refused`."""
        wanted: list[tuple[Record, int]] = []
        seen: set[EntryKey] = set()
        usage: dict[str, int] = {}
        for record in (*committed, *pending):
            try:
                slot_size = self.allocator.slot_size(record.length)
            except ServerError:
                add(refused, "layout", 1)
                continue
            quota = self.quotas.get(record.salt, self.default_quota)
            if (record.salt, record.key) in seen:
                add(refused, "duplicate", 1)
            elif quota is not None and usage.get(record.salt, 0) + slot_size > quota:
                add(refused, "quota", 1)
            else:
                seen.add((record.salt, record.key))
                add(usage, record.salt, slot_size)
                wanted.append((record, slot_size))
        return wanted

    # -- quotas and figures ---------------------------------------------------------------

    def set_quota(self, salt: str, max_bytes: int | None) -> dict[str, int]:
        """Limit the bytes `salt` may hold (None removes the limit); evicts its LRU chunks now.
        Returns every quota."""
        if max_bytes is None:
            self.quotas.pop(salt, None)
            return dict(self.quotas)
        assert max_bytes >= 0, "a quota is a number of bytes"
        self.quotas[salt] = max_bytes
        self.fit_quota(salt, max_bytes)
        return dict(self.quotas)

    def take_events(self) -> list[IndexEvent]:
        """What happened since the last call, oldest first."""
        events = self.events
        if not events:
            return []
        self.events = []
        return events

    def per_salt(self, salts: Iterable[str] | None) -> tuple[dict[str, int], dict[str, int]]:
        """(slot bytes, visible chunks) per salt, of every salt or of `salts` only (cheap)."""
        if salts is None:
            return dict(self.salt_bytes), dict(self.salt_chunks)
        salt_bytes = {salt: self.salt_bytes[salt] for salt in salts if salt in self.salt_bytes}
        return salt_bytes, {salt: self.salt_chunks.get(salt, 0) for salt in salt_bytes}

    def visible(self, salt: str | None = None) -> int:
        """Committed chunks of ``salt`` (None: of every salt) in RAM, leased or not."""
        return sum(self.salt_chunks.values()) if salt is None else self.salt_chunks.get(salt, 0)

    def largest_salts(self, count: int) -> list[str]:
        """The `count` salts holding the most bytes, most first (O(salts): not per request)."""
        return heapq.nlargest(count, self.salt_bytes, key=self.salt_bytes.__getitem__)

    def check(self, pending: list[Entry]) -> None:
        """Assert that every chunk has its own slot and that the figures match the chunks;
        `pending`: the reservations' chunks (for tests)."""
        entries = list(self.entries.values())
        self._check_slots(entries)
        in_state = dict.fromkeys(LIVE, 0)
        salt_chunks: dict[str, int] = {}
        for entry in entries:
            in_state[entry.state] += 1  # a FREE entry in the index fails here
            assert (entry.state is _LEASED) == (entry.leases > 0), "a chunk's state disagrees with its leases"
            if entry.state in VISIBLE:
                add(salt_chunks, entry.salt, 1)
        assert in_state == self.in_state
        assert salt_chunks == self.salt_chunks
        assert all(e.state is _PENDING for e in pending)
        assert len(pending) == in_state[_PENDING]

    def _check_slots(self, entries: list[Entry]) -> None:
        """Assert that every chunk has its own slot, of its size class, inside the pool."""
        spans = []
        for entry in entries:
            assert self.entries[(entry.salt, entry.key)] is entry
            assert self._by_offset[entry.offset] is entry
            assert self.allocator.page_slot_size(self.allocator.page_of(entry.offset)) == entry.slot_size
            assert entry.offset + entry.slot_size <= self.allocator.capacity
            spans.append((entry.offset, entry.offset + entry.slot_size))
        spans.sort()
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert end <= start, "two chunks share bytes"
        assert sum(entry.slot_size for entry in entries) == self.allocator.used_bytes == sum(self.salt_bytes.values())
        assert len(self._by_offset) == len(self.entries)


def add(counts: dict[str, int], name: str, delta: int) -> None:
    """Add `delta` to `counts[name]`, dropping names that reach zero (so figures stay small)."""
    left = counts.get(name, 0) + delta
    if left:
        counts[name] = left
    else:
        del counts[name]
