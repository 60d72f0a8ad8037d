"""Property tests of the chunk index against a model of what clients write into the pool."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvdepot.server import ChunkIndex, SlabAllocator

PAGE = 4096
CLIENTS = ["a", "b", "c"]
SALTS = st.sampled_from(["", "s", "t"])
SIZES = {"a": 1000, "b": 1000, "c": 2500}  # two size classes share the pages

op = st.one_of(
    st.tuples(st.just("reserve"), st.sampled_from(CLIENTS), SALTS, st.lists(st.integers(0, 5), max_size=4)),
    st.tuples(st.just("commit"), st.sampled_from(CLIENTS), st.integers(0, 20), st.booleans()),
    st.tuples(st.just("abort"), st.sampled_from(CLIENTS), st.integers(0, 20), st.none()),
    st.tuples(st.just("lookup"), st.sampled_from(CLIENTS), SALTS, st.lists(st.integers(0, 5), max_size=4)),
    st.tuples(st.just("release"), st.sampled_from(CLIENTS), st.integers(0, 20), st.none()),
    st.tuples(st.just("quota"), st.sampled_from(CLIENTS), SALTS, st.sampled_from([None, 0, 2048, 8192])),
    st.tuples(st.just("tick"), st.sampled_from(CLIENTS), st.floats(0, 20), st.none()),
    st.tuples(st.just("close"), st.sampled_from(CLIENTS), st.none(), st.none()),
)


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(op, min_size=20, max_size=80))
def test_any_sequence_keeps_salts_apart_and_data_intact(ops):
    """Whatever clients do, a hit always returns bytes written for the same (salt, key), the pool
    bound holds, quotas are never broken by a reserve, and everything held returns at the end."""
    index = ChunkIndex(SlabAllocator(3 * PAGE, PAGE), lease_ttl=30.0, reservation_ttl=30.0, session_ttl=1e9)
    memory: dict[int, tuple[str, bytes]] = {}  # slot offset -> what a client wrote there
    reservations: dict[str, list[int]] = {c: [] for c in CLIENTS}
    leases: dict[str, list[tuple[int, list[tuple[int, int]], str, list[bytes]]]] = {c: [] for c in CLIENTS}
    now = 0.0
    for name, client, arg, extra in ops:
        if not index.is_registered(client):
            index.register(client, SIZES[client], now)
        if name == "reserve":
            keys = [i.to_bytes(4, "big") for i in extra]
            used_before = index.stats().per_salt.get(arg)
            out = index.reserve(client, arg, keys, SIZES[client], now)
            quota = index.quotas().get(arg)
            if quota is not None and out.slots:
                assert index.stats().per_salt[arg].bytes <= quota or used_before is None
            for i, offset, length in out.slots:
                assert length == SIZES[client]
                memory[offset] = (arg, keys[i])
            if out.reservation_id:
                reservations[client].append(out.reservation_id)
        elif name in ("commit", "abort") and reservations[client]:
            rid = reservations[client][arg % len(reservations[client])]
            if name == "abort" or extra:
                reservations[client].remove(rid)
                if name == "abort":
                    index.abort(client, rid)
                else:
                    index.commit(client, rid, None, now)
            else:
                index.commit(client, rid, [0, 1], now)
                if rid not in index.sessions.reservations:  # nothing left pending: the reservation ended
                    reservations[client].remove(rid)
        elif name == "lookup":
            keys = [i.to_bytes(4, "big") for i in extra]
            (res,) = index.lookup(client, [(arg, keys)], now)
            for (offset, _), key in zip(res.slots, keys, strict=False):
                assert memory[offset] == (arg, key), "a hit returned another chunk's bytes"
            if res.lease_id:
                leases[client].append((res.lease_id, res.slots, arg, keys))
        elif name == "release" and leases[client]:
            lid, slots, salt, keys = leases[client].pop(arg % len(leases[client]))
            for (offset, _), key in zip(slots, keys, strict=False):
                assert memory[offset] == (salt, key), "a leased chunk was overwritten"
            index.release(client, [lid])
        elif name == "quota":
            index.set_quota(arg, extra)
        elif name == "tick":
            now += arg
            gone = index.expire(now)
            if gone.leases or gone.reservations:
                # expired: the model forgets what the index forgot
                live = set(index.sessions.leases)
                for c in CLIENTS:
                    leases[c] = [lease for lease in leases[c] if lease[0] in live]
                    reservations[c] = [r for r in reservations[c] if r in index.sessions.reservations]
        elif name == "close":
            index.close_session(client, 0.0)
            leases[client].clear()
            reservations[client].clear()
        index.check()
        assert index.stats().used_bytes <= index.allocator.capacity
    for client in CLIENTS:
        index.close_session(client, now)
    index.expire(now + 3600)  # the quarantined slots of reservations left open return
    stats = index.stats()
    assert (stats.leases, stats.reservations, stats.pending_chunks, stats.leased_chunks) == (0, 0, 0, 0)
    index.clear()
    assert index.stats().used_bytes == 0
    assert index.allocator.free_pages == index.allocator.num_pages


@settings(max_examples=100, deadline=None)
@given(
    salts=st.lists(st.text(max_size=8), min_size=2, max_size=6, unique=True),
    key_ids=st.lists(st.integers(0, 3), min_size=1, max_size=4),
)
def test_random_salts_never_share_a_chunk(salts, key_ids):
    """The same keys stored under distinct salts live in distinct slots, and each salt sees only its own."""
    index = ChunkIndex(SlabAllocator(64 * PAGE, PAGE))
    index.register("a", 512, 0.0)
    keys = [i.to_bytes(32, "big") for i in dict.fromkeys(key_ids)]
    owner: dict[int, str] = {}
    for salt in salts:
        out = index.reserve("a", salt, keys, 512, 0.0)
        assert out.present == [], "a key stored under another salt was reported present"
        for _, offset, _ in out.slots:
            assert offset not in owner
            owner[offset] = salt
        index.commit("a", out.reservation_id, None, 0.0)
    for salt in salts:
        (res,) = index.lookup("a", [(salt, keys)], 0.0)
        assert res.num_hits == len(keys)
        assert all(owner[offset] == salt for offset, _ in res.slots)
