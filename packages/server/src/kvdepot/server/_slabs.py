"""Size-class slab allocation of the pool's byte range (pure bookkeeping, no memory).

The pool is cut into pages of one fixed size. A page, while in use, belongs to exactly one
size class and is carved into equal slots of that class's slot size. A page whose last slot is
freed goes back to the free-page list at once, so any class can take it next. Chunks of
different sizes therefore never fragment each other: a class needs either a free slot in one
of its pages or one whole free page, and the index frees a whole page by evicting the chunks
in it (see `ChunkIndex`). `PageRecency` ranks pages by their most recently used chunk, so the
index can pick the page whose chunks were all used longest ago. docs/server.md explains the
trade-offs.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence

import attrs

from kvdepot.core import SLOT_HEADER_BYTES
from kvdepot.server._errors import ChunkTooLargeError, ServerArgumentError

# Slot offsets and sizes are multiples of this: a cache line, so that copies into a slot
# never share a line with a neighbour's.
SLOT_ALIGNMENT = 64
# Smallest slot: bounds the number of chunks, and so the index's memory (under 1 KiB per chunk),
# by the pool's size, however small the chunks a client registers.
MIN_SLOT_BYTES = 1024
# Most slots on one page: a slot is at least 1/4,096 of a page. Giving a page to another size
# class evicts every chunk on it within one request, and this bounds that work (4,096 chunks,
# ~20 ms of Python; a 16 MiB page of 1 KiB slots took 85 ms, stalling every client). Chunks
# smaller than that only in pools of 4 GiB and more (256 MiB pages: 64 KiB slots at least).
MAX_SLOTS_PER_PAGE = 4096
# Largest page the automatic choice picks: waste per page is below one slot, so large pages
# keep the waste small for chunks of tens of MiB (a 256-token chunk of an 8B model is 32 MiB).
MAX_AUTO_PAGE_SIZE = 256 << 20
# The automatic choice keeps at least this many pages, so several size classes can coexist.
MIN_AUTO_PAGES = 16
# ... and never goes below this page size, so that common chunks still fit in a page.
MIN_AUTO_PAGE_SIZE = 1 << 20


def align_up(value: int, alignment: int = SLOT_ALIGNMENT) -> int:
    """Round `value` up to a multiple of `alignment`."""
    return -(-value // alignment) * alignment


def auto_page_size(capacity: int) -> int:
    """The page size for a pool of `capacity` bytes: a power of two, at most 256 MiB, 16+ pages."""
    size = MAX_AUTO_PAGE_SIZE
    while size > MIN_AUTO_PAGE_SIZE and capacity // size < MIN_AUTO_PAGES:
        size //= 2
    return max(SLOT_ALIGNMENT, min(size, align_up(capacity) if capacity > 0 else SLOT_ALIGNMENT))


@attrs.define
class _SizeClass:
    slot_size: int
    slots_per_page: int
    # page -> free slot numbers within that page, for pages with at least one free slot
    partial: dict[int, list[int]] = attrs.field(factory=dict)
    pages: set[int] = attrs.field(factory=set)


class SlabAllocator:
    """Hands out slots (byte offsets) of a fixed-capacity range, grouped in size-class pages.

    Offsets plus slot sizes never pass `capacity`, and no two live slots overlap.
    """

    def __init__(self, capacity: int, page_size: int | None = None) -> None:
        if page_size is None:
            page_size = auto_page_size(capacity)
        if page_size <= 0 or page_size % SLOT_ALIGNMENT:
            raise ServerArgumentError(
                f"page size {page_size} must be a positive multiple of {SLOT_ALIGNMENT} bytes",
                page_size=page_size,
            )
        if capacity < page_size:
            raise ServerArgumentError(
                f"capacity {capacity} bytes is smaller than one page ({page_size} bytes); "
                "raise --capacity or lower --page-size",
                capacity=capacity,
                page_size=page_size,
            )
        self.page_size = page_size
        self.num_pages = capacity // page_size
        # Only whole pages are used; the tail of the range past the last page stays unused.
        self.capacity = self.num_pages * page_size
        self._free_pages: list[int] = list(range(self.num_pages - 1, -1, -1))
        self._page_class: list[int] = [0] * self.num_pages  # slot size of the page's class, 0 = free
        self._page_used: list[int] = [0] * self.num_pages
        self._classes: dict[int, _SizeClass] = {}
        self.used_bytes = 0

    # -- queries --------------------------------------------------------------------------

    def slot_size(self, chunk_bytes: int) -> int:
        """The slot size that holds a header and `chunk_bytes`, or `ChunkTooLargeError` when no page can."""
        if chunk_bytes <= 0:
            raise ServerArgumentError(f"chunk_bytes must be positive, got {chunk_bytes}", chunk_bytes=chunk_bytes)
        size = max(
            MIN_SLOT_BYTES, align_up(self.page_size // MAX_SLOTS_PER_PAGE), align_up(SLOT_HEADER_BYTES + chunk_bytes)
        )
        if size > self.page_size:
            raise ChunkTooLargeError(
                f"a chunk of {chunk_bytes} bytes does not fit in a page of {self.page_size} bytes; "
                f"restart the server with --page-size of at least {size} bytes",
                chunk_bytes=chunk_bytes,
                page_size=self.page_size,
            )
        return size

    @property
    def free_pages(self) -> int:
        return len(self._free_pages)

    def page_of(self, offset: int) -> int:
        return offset // self.page_size

    def page_slot_size(self, page: int) -> int:
        """Slot size of the class that owns `page`, 0 when the page is free."""
        return self._page_class[page]

    def page_used(self, page: int) -> int:
        """How many slots of `page` are allocated (0 when the page is free)."""
        return self._page_used[page]

    def page_slots(self, page: int) -> range:
        """The slot offsets of `page` under its current class (empty when the page is free)."""
        size = self._page_class[page]
        if not size:
            return range(0)
        start = page * self.page_size
        return range(start, start + (self.page_size // size) * size, size)

    def can_allocate(self, slot_size: int) -> bool:
        """True when `allocate(slot_size)` would succeed without freeing anything."""
        cls = self._classes.get(slot_size)
        return bool(self._free_pages) or (cls is not None and bool(cls.partial))

    # -- allocation -----------------------------------------------------------------------

    def allocate(self, slot_size: int) -> int | None:
        """A free slot of `slot_size` bytes (already aligned), or None when none is free."""
        cls = self._classes.get(slot_size)
        if cls is None:
            cls = self._classes[slot_size] = _SizeClass(slot_size, self.page_size // slot_size)
        if not cls.partial:
            if not self._free_pages:
                return None
            page = self._free_pages.pop()
            self._page_class[page] = slot_size
            cls.pages.add(page)
            # Reversed so that pop() hands out the lowest slot first.
            cls.partial[page] = list(range(cls.slots_per_page - 1, -1, -1))
        page = next(iter(cls.partial))
        free = cls.partial[page]
        slot = free.pop()
        if not free:
            del cls.partial[page]
        self._page_used[page] += 1
        self.used_bytes += slot_size
        return page * self.page_size + slot * slot_size

    def adopt(self, slots: Iterable[tuple[int, int]]) -> list[bool]:
        """Take the given (offset, slot size) slots of a kept pool, on an allocator that has
        handed out nothing yet (a restarted server adopting what its pool holds).

        A page takes the class of its first slot here; a slot that is not a slot start of its
        page's class, lies outside the pages or overlaps one taken before is refused. Returns,
        per slot in order, whether it was taken. One pass, whatever the number of slots."""
        assert self.used_bytes == 0, "adopt runs before any allocation"
        taken: dict[int, set[int]] = {}  # page -> slot numbers taken
        accepted: list[bool] = []
        for offset, slot_size in slots:
            page, within = divmod(offset, self.page_size)
            slot, rem = divmod(within, slot_size) if slot_size > 0 else (0, 1)
            ok = 0 <= page < self.num_pages and not rem and slot < self.page_size // slot_size
            ok = ok and self._page_class[page] in (0, slot_size)
            ok = ok and slot not in taken.get(page, ())
            accepted.append(ok)
            if ok:
                self._page_class[page] = slot_size
                taken.setdefault(page, set()).add(slot)
        for page, numbers in taken.items():
            slot_size = self._page_class[page]
            cls = self._classes.get(slot_size)
            if cls is None:
                cls = self._classes[slot_size] = _SizeClass(slot_size, self.page_size // slot_size)
            cls.pages.add(page)
            free = [n for n in range(cls.slots_per_page - 1, -1, -1) if n not in numbers]
            if free:
                cls.partial[page] = free
            self._page_used[page] = len(numbers)
            self.used_bytes += len(numbers) * slot_size
        self._free_pages = [page for page in self._free_pages if page not in taken]
        return accepted

    def free(self, offset: int) -> None:
        """Give back the slot at `offset`; a page left empty returns to the free pages."""
        page = offset // self.page_size
        slot_size = self._page_class[page]
        assert slot_size, f"free of offset {offset} in free page {page}"
        cls = self._classes[slot_size]
        slot, rem = divmod(offset - page * self.page_size, slot_size)
        assert rem == 0, f"offset {offset} is not a slot start"
        assert slot < cls.slots_per_page, f"offset {offset} is in the unused tail of page {page}"
        self._page_used[page] -= 1
        self.used_bytes -= slot_size
        if self._page_used[page] == 0:
            cls.partial.pop(page, None)
            cls.pages.discard(page)
            self._page_class[page] = 0
            self._free_pages.append(page)
            return
        cls.partial.setdefault(page, []).append(slot)

    def check(self) -> None:
        """Assert the bookkeeping is consistent (for tests)."""
        used = 0
        for page in range(self.num_pages):
            size = self._page_class[page]
            if not size:
                assert self._page_used[page] == 0
                assert page in self._free_pages
                continue
            cls = self._classes[size]
            assert page in cls.pages
            free = len(cls.partial.get(page, []))
            assert free + self._page_used[page] == cls.slots_per_page
            used += self._page_used[page] * size
        assert used == self.used_bytes
        assert len(set(self._free_pages)) == len(self._free_pages)


class PageRecency:
    """Per page, the use stamp of its most recently used chunk; finds the page where it is oldest.

    Stamps are positive integers that the caller draws from one increasing counter; 0 means the
    page holds nothing that was used. A use only writes the page's stamp. A min-heap holds, for
    every page with a stamp, at least one item (stamp, page) no newer than the page's stamp;
    `oldest` moves items that fell behind to their place as it meets them, so each use costs
    O(1) and each search O(log pages) per item it moves or skips. The heap is rebuilt from the
    stamps when items outnumber pages twice over.
    """

    def __init__(self, num_pages: int) -> None:
        self._newest: list[int] = [0] * num_pages
        self._heap: list[tuple[int, int]] = []

    def newest(self, page: int) -> int:
        return self._newest[page]

    def used(self, page: int, stamp: int) -> None:
        """A chunk of `page` was used at `stamp` (newer than every stamp given before)."""
        if not self._newest[page]:
            self._push(stamp, page)  # items left from before the page emptied are too old
        self._newest[page] = stamp

    def reset(self, page: int, stamp: int) -> None:
        """Lower the page's stamp after its newest chunk left (0: nothing used remains)."""
        assert stamp <= self._newest[page], "reset only lowers a stamp"
        self._newest[page] = stamp
        if stamp:
            self._push(stamp, page)

    def oldest(self, pinned: Sequence[int]) -> tuple[int, int] | None:
        """(stamp, page) of the page with the oldest stamp among pages whose `pinned` count is
        0, or None. Pinned pages met on the way stay in the heap."""
        heap, skipped, found = self._heap, [], None
        while heap:
            stamp, page = heap[0]
            newest = self._newest[page]
            if stamp != newest:
                heapq.heappop(heap)
                if stamp < newest:  # used since: move it to its place
                    heapq.heappush(heap, (newest, page))
                # else the page emptied, or its stamp was lowered, which pushed another item
            elif pinned[page]:
                skipped.append(heapq.heappop(heap))
            else:
                found = (stamp, page)
                break
        for item in skipped:
            heapq.heappush(heap, item)
        return found

    def _push(self, stamp: int, page: int) -> None:
        heapq.heappush(self._heap, (stamp, page))
        if len(self._heap) > 2 * len(self._newest) + 64:
            self._heap = [(s, p) for p, s in enumerate(self._newest) if s]
            heapq.heapify(self._heap)

    def check(self, uses: Iterable[tuple[int, int]]) -> None:
        """Assert each page's stamp is the newest of its (page, stamp) `uses`, and every stamped
        page has a heap item no newer (for tests)."""
        newest = [0] * len(self._newest)
        for page, stamp in uses:
            newest[page] = max(newest[page], stamp)
        assert self._newest == newest
        lowest: dict[int, int] = {}
        for stamp, page in self._heap:
            lowest[page] = min(stamp, lowest.get(page, stamp))
        assert all(p in lowest and lowest[p] <= s for p, s in enumerate(self._newest) if s)
