"""Random request lifecycles against the planner, checking its invariants."""

import itertools
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvdepot.core import Namespace, Planner, RequestState, chunk_keys

BLOCK, CHUNK = 4, 8
BPC = CHUNK // BLOCK


class Sim:
    """A toy engine scheduler that drives one planner the way vLLM drives the connector."""

    def __init__(self, rng: random.Random, fail_loads: bool) -> None:
        self.rng = rng
        self.fail_loads = fail_loads
        self.p = Planner(Namespace(model="m", kv_world_size=2), block_size=BLOCK, chunk_size=CHUNK)
        self.lease_ids = itertools.count(1)
        self.issued: list[int] = []
        self.released: list[int] = []
        self.pending_lookups: list[tuple[str, list[int], list[int]]] = []
        self.reqs: dict[str, dict] = {}
        self.next_block = itertools.count(1000)
        self.stored: dict[str, list[int]] = {}
        self.hit_chunks_seen: dict[str, set[int]] = {}
        self.had_failure: set[str] = set()
        # Leases of loads in flight (by request), and loads whose request ended while they ran.
        self.loading: dict[str, tuple[int, ...]] = {}
        self.orphan_loads: list[str] = []

    def collect(self) -> None:
        released = self.p.take_releases()
        in_flight = {lease for leases in self.loading.values() for lease in leases}
        assert not in_flight.intersection(released), "a lease was released while its load was in flight"
        self.released += released

    def new_request(self, name: str) -> None:
        n = self.rng.randrange(1, 60)
        self.reqs[name] = {"tokens": [self.rng.randrange(50) for _ in range(n)], "state": "waiting", "computed": 0}
        self.p.add_request(name, cache_salt=self.rng.choice(["", "a"]))
        self.stored[name] = []
        self.hit_chunks_seen[name] = set()

    def lookup(self, name: str) -> None:
        r = self.reqs[name]
        full_blocks = (len(r["tokens"]) - 1) // BLOCK
        r["local"] = self.rng.randrange(full_blocks + 1) * BLOCK if self.rng.random() < 0.5 else 0
        keys = self.p.start_lookup(name, r["tokens"], local_tokens=r["local"])
        if keys is None:
            r["state"] = "looked_up"
            return
        hits = [self.rng.randrange(len(keys[0]) + 1) for _ in keys]
        leases = [next(self.lease_ids) if h else 0 for h in hits]
        self.issued += [lease for lease in leases if lease]
        r["state"] = "prefetching"
        self.pending_lookups.append((name, hits, leases))

    def deliver_lookups(self) -> None:
        self.rng.shuffle(self.pending_lookups)
        keep = []
        for name, hits, leases in self.pending_lookups:
            if self.rng.random() < 0.3:
                keep.append((name, hits, leases))
                continue
            self.p.on_lookup_done(name, hits, leases)
            r = self.reqs.get(name)
            if r is not None and r["state"] == "prefetching":
                r["state"] = "looked_up"
                if min(hits):
                    self.hit_chunks_seen[name].update(range(self.p.get(name).lookup_first + min(hits)))
        self.pending_lookups = keep

    def admit(self, name: str) -> None:
        r = self.reqs[name]
        full_blocks = (len(r["tokens"]) - 1) // BLOCK
        # Mostly the local hit the lookup was told of; sometimes it changed meanwhile.
        engine_hit = r.get("local", 0) if self.rng.random() < 0.7 else self.rng.randrange(full_blocks + 1) * BLOCK
        load = self.p.num_tokens_to_load(name, engine_hit, len(r["tokens"]))
        if engine_hit < self.p.get(name).lookup_first * CHUNK:
            assert load == 0, "a hit that does not continue the engine's own hit was offered"
        blocks = [next(self.next_block) for _ in range(-(-len(r["tokens"]) // BLOCK))]
        plan = self.p.on_allocated(name, blocks, load)
        r.update(blocks=blocks, computed=engine_hit + load, state="loading" if plan else "running")
        if plan is not None:
            self.loading[name] = plan.lease_ids
            assert all(len(rank_slots) == plan.num_chunks for rank_slots in plan.slots)
            # never write a block the engine holds; cover every loaded token
            first_written = plan.first_chunk * BPC + plan.skip_blocks
            assert first_written * BLOCK == max(engine_hit, plan.first_chunk * CHUNK)
            assert blocks[first_written] == plan.block_ids[plan.skip_blocks]
            assert (plan.first_chunk + plan.num_chunks) * CHUNK >= engine_hit + load
            assert plan.first_chunk * CHUNK <= engine_hit
            for rank, keys in enumerate(plan.keys):
                ns = Namespace(model="m", kv_world_size=2, kv_rank=rank, cache_salt=self.p.get(name).cache_salt)
                expected = chunk_keys(ns, r["tokens"], CHUNK)[plan.first_chunk : plan.first_chunk + plan.num_chunks]
                assert list(keys) == expected

    def step(self, name: str) -> None:
        r = self.reqs[name]
        remaining = len(r["tokens"]) - r["computed"]
        n = self.rng.randrange(1, max(2, remaining + 1)) if remaining > 0 else 1
        new_blocks = []
        while (len(r["blocks"]) + len(new_blocks)) * BLOCK < r["computed"] + n:
            new_blocks.append(next(self.next_block))
        plan = self.p.on_scheduled(name, n, r["tokens"], new_blocks)
        r["blocks"] += new_blocks
        r["computed"] += n
        if plan is not None:
            end = plan.first_chunk + plan.num_chunks
            assert end * CHUNK <= r["computed"]
            assert end * CHUNK <= len(r["tokens"])
            assert plan.block_ids == tuple(r["blocks"][plan.first_chunk * BPC : end * BPC])
            self.stored[name] += range(plan.first_chunk, end)
        r["step_computed"] = r["computed"]
        if r["computed"] >= len(r["tokens"]):
            r["tokens"].append(self.rng.randrange(50))

    def load_ends(self, name: str) -> None:
        """The worker reports the request's load (asynchronous: the request did not run meanwhile)."""
        r = self.reqs[name]
        del self.loading[name]
        if self.fail_loads and self.rng.random() < 0.3:
            back = self.rng.randrange(r["computed"] + 1)
            back -= back % BLOCK
            self.p.on_load_failed(name, back)
            self.had_failure.add(name)
            r["computed"] = back
        else:
            self.p.on_load_done(name)
        r["state"] = "running"

    def end_orphan_load(self) -> None:
        name = self.orphan_loads.pop(self.rng.randrange(len(self.orphan_loads)))
        del self.loading[name]
        if self.rng.random() < 0.5:
            self.p.on_load_done(name)
        else:
            self.p.on_load_failed(name, 0)

    def run(self, steps: int) -> None:
        names = iter(f"r{i}" for i in itertools.count())
        for _ in range(steps):
            action = self.rng.random()
            live = list(self.reqs)
            if action < 0.15 or not live:
                self.new_request(next(names))
                continue
            name = self.rng.choice(live)
            r = self.reqs[name]
            if self.orphan_loads and action < 0.05:
                self.end_orphan_load()
            elif action < 0.2:
                if r["state"] == "loading":
                    self.orphan_loads.append(name)
                getattr(self.p, self.rng.choice(["finish", "abort"]))(name)
                self.finished(name)
            elif action < 0.25 and r["state"] == "running":
                self.p.on_preempted(name)
                r.update(state="waiting", computed=0, blocks=[], step_computed=0)
            elif r["state"] == "waiting":
                self.lookup(name)
            elif r["state"] == "prefetching":
                self.deliver_lookups()
            elif r["state"] == "looked_up":
                self.admit(name)
            elif r["state"] == "loading":
                self.load_ends(name)
            else:
                self.step(name)
            self.collect()
        for name in list(self.reqs):
            if self.reqs[name]["state"] == "loading":
                self.orphan_loads.append(name)
            self.p.abort(name)
            self.finished(name)
        while self.orphan_loads:
            self.end_orphan_load()
        self.pending_lookups, pending = [], self.pending_lookups
        for name, hits, leases in pending:
            self.p.on_lookup_done(name, hits, leases)
        self.collect()

    def finished(self, name: str) -> None:
        r = self.reqs.pop(name)
        stored = self.stored[name]
        if name not in self.had_failure:
            assert len(stored) == len(set(stored)), "a chunk was planned twice"
            covered = set(stored) | self.hit_chunks_seen[name]
            full = min(r.get("step_computed", 0), len(r["tokens"])) // CHUNK
            assert r.get("unplanned") or set(range(full)) <= covered, (full, covered)


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), fail_loads=st.booleans())
def test_random_lifecycles_keep_invariants(seed, fail_loads):
    """Chunked prefill, hits, preemption, aborts and load failures in any order keep every invariant."""
    sim = Sim(random.Random(seed), fail_loads)
    sim.run(300)
    assert len(sim.p) == 0
    assert sorted(sim.released) == sorted(sim.issued), "every lease is released exactly once"


@given(
    salts=st.lists(st.text(max_size=8), min_size=2, max_size=5, unique=True),
    tokens=st.lists(st.integers(0, 99), min_size=8, max_size=40),
)
def test_salts_never_share_keys(salts, tokens):
    """Different salts never produce the same key for the same tokens."""
    p = Planner(Namespace(model="m"), block_size=BLOCK, chunk_size=CHUNK)
    seen: set[bytes] = set()
    for i, salt in enumerate(salts):
        p.add_request(str(i), cache_salt=salt)
        keys = p.start_lookup(str(i), tokens)[0]
        assert not seen & set(keys)
        seen.update(keys)
    assert RequestState.PREFETCHING is p.get("0").state
