"""The eviction policy: which committed chunks give way when a new chunk needs a slot.

The index asks, the policy answers with victims, the index evicts them (as vLLM's offloading
manager asks its LRU or ARC policy). The rules, in order:

- a salt over its quota gives up its own oldest chunk (`quota_victim`);
- a client past its fair share of the pool (the pool split evenly among the clients with a
  session that hold chunks they stored) gives up its own oldest chunk of that slot size;
- otherwise the oldest chunk of that slot size goes, or every chunk of the page whose newest
  chunk is older still, so that the page can take slots of another size. Pages holding a
  pending or leased chunk are pinned and never emptied.

The policy owns the use order and the pins per page; the index tells it how chunks move
(`moved`, `hold`, `unhold`, `own`) and asks it for victims, never editing its state.
Pure state, like the index that owns it.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Iterator

from kvdepot.server._chunk_state import PINNED, VISIBLE, ChunkState
from kvdepot.server._order import UseOrder
from kvdepot.server._records import Entry
from kvdepot.server._slabs import SlabAllocator

_COMMITTED = ChunkState.COMMITTED


class EvictionPolicy:
    """Picks victims from the use order, by quota, fair share and page recency."""

    def __init__(
        self,
        allocator: SlabAllocator,
        residents: Callable[[int], Iterator[Entry]],
        live: Container[str],
    ) -> None:
        self.allocator = allocator
        self.order = UseOrder(allocator.num_pages, allocator.page_size)  # evictable chunks, oldest use first
        self._residents = residents  # the chunks in a page's slots
        self._live = live  # clients with a session
        self._owner_bytes: dict[str, int] = {}  # slot bytes per client that stored them
        self._sharers = 0  # clients with a session that own bytes: the pool's fair share is split among them
        self._page_size = allocator.page_size
        # Per page: how many of its slots hold a pending or leased chunk (which pins the page).
        self._page_pinned: list[int] = [0] * allocator.num_pages

    def moved(self, entry: Entry, old: ChunkState, new: ChunkState, pinned: int) -> None:
        """Note that `entry` moved from `old` to `new`, which pins its page by `pinned` (+1, 0 or
        -1, from the chunk state table): a committed chunk joins the order, one that leaves
        that state leaves it. The index's hot path: one call per move."""
        if old is _COMMITTED:
            self.order.drop(entry)
        if pinned:
            self._page_pinned[entry.offset // self._page_size] += pinned
        if new is _COMMITTED:
            self.order.add(entry)

    def hold(self, entry: Entry) -> None:
        """Keep a committed chunk out of eviction for the rest of a call (a reserve that found it)."""
        self.order.drop(entry)
        self._page_pinned[entry.offset // self._page_size] += 1

    def unhold(self, entry: Entry) -> None:
        """The end of `hold`: the chunk is evictable again, as just used."""
        self._page_pinned[entry.offset // self._page_size] -= 1
        self.order.add(entry)

    def evictable(self, salt: str | None, limit: int) -> list[Entry]:
        """Up to `limit` chunks that may go now (of `salt`, or of any), oldest first per list."""
        return self.order.evictable(salt, limit)

    def can_free(self, slot_size: int) -> bool:
        """Whether `victims` would find something to evict for a slot of `slot_size`, without
        its side effects."""
        order = self.order
        return order.oldest_of_size(slot_size) is not None or order.pages.oldest(self._page_pinned) is not None

    def own(self, owner: str, delta: int) -> None:
        """Count `delta` slot bytes to the client that stored them."""
        before = self._owner_bytes.get(owner, 0)
        after = before + delta
        if after:
            self._owner_bytes[owner] = after
        else:
            del self._owner_bytes[owner]
        if owner in self._live and bool(before) != bool(after):
            self._sharers += 1 if after else -1

    def session_changed(self, client: str, opened: bool) -> None:
        """Note that `client`'s session opened or closed (it shares the pool while open)."""
        if client in self._owner_bytes:
            self._sharers += 1 if opened else -1

    def quota_victim(self, salt: str) -> Entry | None:
        """The chunk a salt over its quota gives up: its own oldest."""
        return self.order.oldest_of_salt(salt)

    def victims(self, owner: str, slot_size: int) -> list[Entry]:
        """The chunks to evict so that a slot of `slot_size` may free up; [] when none may go."""
        if self._over_share(owner, slot_size) and (own := self.order.oldest_of_owner(owner, slot_size)):
            return [own]  # a client past its fair share makes room from its own chunks
        oldest = self.order.oldest_of_size(slot_size)
        found = self.order.pages.oldest(self._page_pinned)
        if oldest is not None and (found is None or oldest.used <= found[0]):
            return [oldest]
        if found is None:
            return []
        # The whole page, whose newest chunk is older than any chunk of this size. A page
        # holding a chunk used just now goes only when every other choice is fresher.
        page = found[1]
        self.order.pages.reset(page, 0)  # first, so that no eviction of its chunks looks for the newest
        return list(self._residents(page))

    def removed(self, entry: Entry) -> None:
        """Keep the page's stamp that of its newest visible chunk once `entry` left it."""
        page = entry.offset // self.allocator.page_size
        if entry.used == self.order.pages.newest(page):
            stamps = (e.used for e in self._residents(page) if e.state in VISIBLE)
            self.order.pages.reset(page, max(stamps, default=0))

    def _over_share(self, owner: str, slot_size: int) -> bool:
        """Whether `owner` holding one more slot passes its share of the pool."""
        held = self._owner_bytes.get(owner, 0)
        sharers = self._sharers + (0 if held and owner in self._live else 1)
        return sharers > 1 and held + slot_size > self.allocator.capacity // sharers

    def check(self, entries: Iterable[Entry], clients: Iterable[str]) -> None:
        """Assert that pins, page stamps, the order and the shares match `entries` (for tests)."""
        page_size = self.allocator.page_size
        pinned = [0] * self.allocator.num_pages
        owners: dict[str, int] = {}
        evictable = 0
        stamps = []
        for entry in entries:
            pinned[entry.offset // page_size] += entry.state in PINNED
            owners[entry.owner] = owners.get(entry.owner, 0) + entry.slot_size
            assert (entry in self.order) == (entry.state not in PINNED), "the order holds exactly the evictable"
            evictable += entry.state not in PINNED
            stamps.append((entry.offset // page_size, entry.used))
        assert pinned == self._page_pinned
        self.order.pages.check(stamps)
        self.order.check(evictable)
        assert owners == self._owner_bytes
        assert self._sharers == sum(1 for c in clients if c in self._owner_bytes)
