"""Size-class slab allocation of the pool's byte range (pure bookkeeping, no memory).

The pool is cut into pages of one fixed size. A page, while in use, belongs to exactly one
size class and is carved into equal slots of that class's slot size. A page whose last slot is
freed goes back to the free-page list at once, so any class can take it next. Chunks of
different sizes therefore never fragment each other: a class needs either a free slot in one
of its pages or one whole free page, and the index frees a whole page by evicting the chunks
in it (see `ChunkIndex`). docs/server.md explains the trade-offs.
"""

from __future__ import annotations

import attrs

from kvdepot.server._errors import ChunkTooLargeError, ServerArgumentError

# Slot offsets and sizes are multiples of this: a cache line, so that copies into a slot
# never share a line with a neighbour's.
SLOT_ALIGNMENT = 64
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
        """The slot size that holds `chunk_bytes`, or `ChunkTooLargeError` when no page can."""
        if chunk_bytes <= 0:
            raise ServerArgumentError(f"chunk_bytes must be positive, got {chunk_bytes}", chunk_bytes=chunk_bytes)
        size = align_up(chunk_bytes)
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
