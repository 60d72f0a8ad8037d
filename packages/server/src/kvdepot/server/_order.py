"""The eviction order: committed chunks with no lease, oldest use first.

One use clock stamps every chunk when it is committed or used again. The same chunks are
listed three ways, each oldest first, so that each eviction rule finds its victim in O(1):

- per slot size: the global LRU, for a slot of that size;
- per salt: a salt over its quota evicts its own oldest chunk;
- per owner (the client that stored the chunk) and slot size: a client over its fair share of
  the pool evicts its own oldest chunk, whatever salts it used.

Per page, `PageRecency` keeps the stamp of its newest chunk, so a page whose chunks are all
old can be emptied for a slot of another size. Pure state, like the index that owns it.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

from kvdepot.server._records import Entry
from kvdepot.server._slabs import PageRecency

EntryKey = tuple[str, bytes]


class UseOrder:
    """The evictable chunks (committed, no lease) in order of last use."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.page_size = page_size
        self.clock = 0  # the last use stamp handed out
        self.pages = PageRecency(num_pages)
        self._by_size: defaultdict[int, OrderedDict[EntryKey, Entry]] = defaultdict(OrderedDict)
        self._by_salt: defaultdict[str, OrderedDict[bytes, Entry]] = defaultdict(OrderedDict)
        self._by_owner: defaultdict[tuple[str, int], OrderedDict[EntryKey, Entry]] = defaultdict(OrderedDict)

    def __len__(self) -> int:
        return sum(map(len, self._by_size.values()))

    def __contains__(self, entry: Entry) -> bool:
        return (entry.salt, entry.key) in self._by_size.get(entry.slot_size, {})

    def add(self, entry: Entry) -> None:
        """Make `entry` the most recently used evictable chunk."""
        self.clock += 1
        entry.used = self.clock
        key = (entry.salt, entry.key)
        self._by_size[entry.slot_size][key] = entry
        self._by_salt[entry.salt][entry.key] = entry
        self._by_owner[(entry.owner, entry.slot_size)][key] = entry
        self.pages.used(entry.offset // self.page_size, self.clock)

    def drop(self, entry: Entry) -> None:
        """Take `entry` out of the order (it is leased, removed, or used again)."""
        key = (entry.salt, entry.key)
        del self._by_size[entry.slot_size][key]  # a size class's list is kept: there are few
        _pop(self._by_salt, entry.salt, entry.key)
        _pop(self._by_owner, (entry.owner, entry.slot_size), key)

    def oldest_of_size(self, slot_size: int) -> Entry | None:
        return _first(self._by_size.get(slot_size))

    def oldest_of_salt(self, salt: str) -> Entry | None:
        return _first(self._by_salt.get(salt))

    def oldest_of_owner(self, owner: str, slot_size: int) -> Entry | None:
        return _first(self._by_owner.get((owner, slot_size)))

    def evictable(self, salt: str | None = None, limit: int | None = None) -> list[Entry]:
        """Up to `limit` evictable chunks (of `salt`, or of any salt), oldest first per list."""
        lists: Iterable[Mapping[Any, Entry]] = self._by_size.values() if salt is None else [self._by_salt.get(salt, {})]
        out: list[Entry] = []
        for order in lists:
            for entry in order.values():
                if limit is not None and len(out) >= limit:
                    return out
                out.append(entry)
        return out

    def check(self, committed_unleased: int) -> None:
        """Assert that the three views list the same chunks, each in order of use."""
        views: list[Mapping[Any, Mapping[Any, Entry]]] = [self._by_size, self._by_salt, self._by_owner]
        for view in views:
            lists = [[e.used for e in order.values()] for order in view.values()]
            assert all(uses == sorted(uses) for uses in lists), "an LRU list is out of order"
            assert sum(map(len, lists)) == committed_unleased
        assert all(self._by_salt.values()), "an empty list was kept"
        assert all(self._by_owner.values()), "an empty list was kept"


def _first(order: OrderedDict[EntryKey, Entry] | OrderedDict[bytes, Entry] | None) -> Entry | None:
    return next(iter(order.values())) if order else None


def _pop(view: defaultdict, name: object, key: object) -> None:  # type: ignore[type-arg]
    order = view[name]
    del order[key]
    if not order:
        del view[name]
