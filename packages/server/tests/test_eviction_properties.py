"""Property test of eviction order: recency decides, page by page, across size classes."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from kvdepot.server import ChunkIndex, SlabAllocator

PAGE = 4096
PAGES = 4
# Three size classes: four, two and one slot per page.
SIZES = {"a": 1000, "b": 1000, "c": 1900, "d": 2500}
CLIENTS = sorted(SIZES)
SALTS = ["", "s"]

STORE = st.tuples(st.just("store"), st.sampled_from(CLIENTS), st.integers(1, 3), st.booleans())
op = st.one_of(
    STORE,
    STORE,  # twice as likely as the rest, so that the pool fills and evicts
    st.tuples(st.just("commit"), st.sampled_from(CLIENTS), st.integers(0, 20), st.none()),
    st.tuples(st.just("abort"), st.sampled_from(CLIENTS), st.integers(0, 20), st.none()),
    st.tuples(st.just("lookup"), st.sampled_from(CLIENTS), st.integers(0, 200), st.none()),
    st.tuples(st.just("release"), st.sampled_from(CLIENTS), st.integers(0, 20), st.none()),
    st.tuples(st.just("touch"), st.sampled_from(CLIENTS), st.integers(0, 200), st.none()),
)

EntryKey = tuple[str, bytes]


class Model:
    """What the test knows independently of the index: where each chunk lives, its state, and
    when it was last used (commit, a reserve that found it, or the end of its last lease)."""

    def __init__(self) -> None:
        self.clock = itertools.count(1)
        self.offset: dict[EntryKey, int] = {}  # every chunk in the pool, any state
        self.committed: set[EntryKey] = set()
        self.leases: dict[EntryKey, int] = {}
        self.used: dict[EntryKey, int] = {}
        self.known: list[EntryKey] = []  # every key ever stored, for lookups and touches
        self.owner: dict[EntryKey, tuple[str, int]] = {}  # the client that stored it, and its slot size

    def may_take_own(self, client: str, slot_size: int, count: int) -> bool:
        """Whether `client` storing `count` more slots may pass its fair share of the pool (the
        pool split evenly among the clients holding chunks), and so evict its own chunks first."""
        held: dict[str, int] = {}
        for ek in self.offset:
            owner, size = self.owner[ek]
            held[owner] = held.get(owner, 0) + size
        sharers = len(held) + (client not in held)
        return sharers > 1 and held.get(client, 0) + slot_size * count > PAGES * PAGE // sharers

    def page(self, ek: EntryKey) -> int:
        return self.offset[ek] // PAGE

    def use(self, ek: EntryKey) -> None:
        self.used[ek] = next(self.clock)

    def evictable_pages(self) -> dict[int, list[EntryKey]]:
        """Pages whose every chunk is committed and unleased, with their chunks."""
        pages: dict[int, list[EntryKey]] = {}
        pinned: set[int] = set()
        for ek in self.offset:
            pages.setdefault(self.page(ek), []).append(ek)
            if ek not in self.committed or self.leases.get(ek):
                pinned.add(self.page(ek))
        return {page: eks for page, eks in pages.items() if page not in pinned}


def check_victims(model: Model, evicted: set[EntryKey], placed_pages: set[int], before: dict, own: str) -> None:
    """No evicted chunk was used after every chunk of a page that could have been reclaimed
    instead, unless it was a chunk of `own`, a client past its fair share of the pool."""
    for ek in evicted:
        if model.owner[ek][0] == own:
            continue
        for page, eks in before.items():
            if page == model.page(ek) or page in placed_pages or all(e in evicted for e in eks):
                continue  # the victim's own page, a page that took a new slot, or a page reclaimed too
            newest = max(model.used[e] for e in eks)
            assert model.used[ek] < newest, (
                f"evicted {ek} (last used at {model.used[ek]}) while page {page} was all older (newest {newest})"
            )


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(op, min_size=10, max_size=80))
def test_a_chunk_fresher_than_a_whole_reclaimable_page_is_never_evicted(ops):
    """After any sequence of reserves, commits, aborts, lookups and releases in several size
    classes, an evicted chunk was never used more recently than every chunk of another page that
    could have been reclaimed instead, and pending or leased chunks are never evicted."""
    index = ChunkIndex(SlabAllocator(PAGES * PAGE, PAGE), lease_ttl=1e9, reservation_ttl=1e9, session_ttl=1e9)
    model = Model()
    reservations: dict[str, list[tuple[int, list[EntryKey]]]] = {c: [] for c in CLIENTS}
    leases: dict[str, list[tuple[int, EntryKey]]] = {c: [] for c in CLIENTS}
    fresh = itertools.count()
    for client in CLIENTS:
        index.register(client, SIZES[client], 0.0)

    def reserve(client: str, salt: str, keys: list[bytes]):
        before = model.evictable_pages()
        stored = set(model.committed)
        slot_size = index.allocator.slot_size(SIZES[client])
        own = client if model.may_take_own(client, slot_size, len(keys)) else ""
        out = index.reserve(client, salt, keys, SIZES[client], 0.0)
        for ek in list(model.offset):
            if ek not in index.chunks.entries:
                assert ek in stored, f"{ek} was evicted while pending"
                assert not model.leases.get(ek), f"{ek} was evicted while leased"
        evicted = {ek for ek in stored if ek not in index.chunks.entries}
        placed = {(salt, keys[i]): offset for i, offset, _ in out.slots}
        check_victims(model, evicted, {offset // PAGE for offset in placed.values()}, before, own)
        for ek in evicted:
            model.committed.discard(ek)
            del model.offset[ek]
        for i in out.present:
            ek = (salt, keys[i])
            if ek in model.committed and not model.leases.get(ek):
                model.use(ek)
        model.offset.update(placed)
        model.owner.update((ek, (client, slot_size)) for ek in placed)
        return out, list(placed)

    for name, client, arg, extra in ops:
        if name == "store":
            first = next(fresh)
            salt = SALTS[first % len(SALTS)]
            keys = [(first + i).to_bytes(4, "big") for i in range(arg)]
            for _ in range(arg - 1):
                next(fresh)
            out, placed = reserve(client, salt, keys)
            model.known.extend(placed)
            if out.reservation_id:
                if extra:
                    index.commit(client, out.reservation_id, None, 0.0)
                    for ek in placed:
                        model.committed.add(ek)
                        model.use(ek)
                else:
                    reservations[client].append((out.reservation_id, placed))
        elif name in ("commit", "abort") and reservations[client]:
            rid, placed = reservations[client].pop(arg % len(reservations[client]))
            if name == "commit":
                assert index.commit(client, rid, None, 0.0) == len(placed)
                for ek in placed:
                    model.committed.add(ek)
                    model.use(ek)
            else:
                assert index.abort(client, rid) == len(placed)
                for ek in placed:
                    del model.offset[ek]
        elif name == "lookup" and model.known:
            ek = model.known[arg % len(model.known)]
            (res,) = index.lookup(client, [(ek[0], [ek[1]])], 0.0)
            assert res.num_hits == (ek in model.committed), f"lookup of {ek} disagrees with the model"
            if res.num_hits:
                assert res.slots[0][0] == model.offset[ek]
                model.leases[ek] = model.leases.get(ek, 0) + 1
                leases[client].append((res.lease_id, ek))
        elif name == "release" and leases[client]:
            lid, ek = leases[client].pop(arg % len(leases[client]))
            assert index.release(client, [lid]) == 1
            model.leases[ek] -= 1
            if not model.leases[ek]:
                model.use(ek)
        elif name == "touch" and model.known:
            ek = model.known[arg % len(model.known)]
            if ek in model.committed:  # a reserve that finds the chunk stored counts as a use
                out, placed = reserve(client, ek[0], [ek[1]])
                assert out.present == [0]
                assert not placed
        index.check()
