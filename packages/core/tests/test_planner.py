import pytest

from kvdepot.core import (
    InvalidArgumentError,
    InvalidTransitionError,
    Namespace,
    Planner,
    RequestState,
    UnknownRequestError,
    chunk_keys,
)

BLOCK, CHUNK = 4, 8  # two blocks per chunk
NS = Namespace(model="m", layout="l")


def planner(kv_world_size: int = 1) -> Planner:
    return Planner(Namespace(model="m", layout="l", kv_world_size=kv_world_size), block_size=BLOCK, chunk_size=CHUNK)


def admitted(p: Planner, req: str, tokens: list[int], hits: int, leases=(7,), engine_hit: int = 0, salt=None):
    """Add, look up, and allocate a request; returns (tokens to load, retrieve plan)."""
    p.add_request(req, cache_salt=salt)
    keys = p.start_lookup(req, tokens)
    if keys is not None:
        p.on_lookup_done(req, [hits] * len(keys), leases)
    load = p.num_tokens_to_load(req, engine_hit, len(tokens))
    blocks = list(range(100, 100 + -(-len(tokens) // BLOCK)))
    plan = p.on_allocated(req, blocks, load)
    return load, plan


def test_chunk_must_be_multiple_of_block():
    """A chunk size that is not a multiple of the block size is refused."""
    with pytest.raises(InvalidArgumentError):
        Planner(NS, block_size=16, chunk_size=24)


def test_lookup_keys_are_the_chunk_keys():
    """The lookup sends the namespace's keys of the prompt's full chunks."""
    p = planner()
    p.add_request("r")
    keys = p.start_lookup("r", list(range(20)))
    assert keys == [chunk_keys(NS, list(range(20)), CHUNK)]
    assert p.get("r").state is RequestState.PREFETCHING


def test_no_full_chunk_means_no_lookup():
    """A prompt shorter than one chunk is looked up locally with zero hits."""
    p = planner()
    p.add_request("r")
    assert p.start_lookup("r", [1, 2, 3]) is None
    assert p.get("r").state is RequestState.LOOKED_UP
    assert p.num_tokens_to_load("r", 0, 3) == 0


def test_salt_scopes_keys():
    """Requests with different salts get different keys for the same tokens."""
    p = planner()
    p.add_request("a", cache_salt="x")
    p.add_request("b", cache_salt="y")
    assert p.start_lookup("a", list(range(8))) != p.start_lookup("b", list(range(8)))


def test_tensor_parallel_ranks_get_distinct_keys_and_hit_is_minimum():
    """Each KV rank has its own keys; a chunk is a hit only when every rank has it."""
    p = planner(kv_world_size=2)
    p.add_request("r")
    keys = p.start_lookup("r", list(range(24)))
    assert len(keys) == 2
    assert keys[0][0] != keys[1][0]
    p.on_lookup_done("r", [3, 1], (5, 6))
    assert p.num_tokens_to_load("r", 0, 24) == 8


def test_full_hit_leaves_one_token_to_compute():
    """When every token hits, one token is still left for the engine."""
    p = planner()
    load, plan = admitted(p, "r", list(range(16)), hits=2)
    assert load == 15
    assert plan.first_chunk == 0
    assert plan.num_chunks == 2
    assert plan.block_ids == (100, 101, 102, 103)


def test_engine_prefix_hit_is_skipped_not_overwritten():
    """Blocks the engine's prefix cache holds are skipped by the retrieve."""
    p = planner()
    load, plan = admitted(p, "r", list(range(30)), hits=3, engine_hit=12)
    assert load == 24 - 12
    # chunk 1 holds tokens 8..15; the engine holds blocks 0..2 (tokens 0..11)
    assert plan.first_chunk == 1
    assert plan.num_chunks == 2
    assert plan.skip_blocks == 1
    assert plan.block_ids == (102, 103, 104, 105)
    assert plan.num_tokens == 12


def test_engine_hit_beyond_cache_hit_loads_nothing_and_releases():
    """If the engine already holds more than the cache, nothing loads and the lease returns at once."""
    p = planner()
    load, plan = admitted(p, "r", list(range(30)), hits=1, engine_hit=16)
    assert (load, plan) == (0, None)
    assert p.take_releases() == [7]
    assert p.get("r").state is RequestState.READY


def test_store_grows_by_scheduled_tokens_for_new_and_running():
    """Stores follow the scheduled tokens of every step (chunked prefill), never num_computed."""
    p = planner()
    tokens = list(range(20))
    admitted(p, "r", tokens, hits=0, leases=())
    assert p.on_scheduled("r", 6, tokens) is None  # 6 tokens: no full chunk
    plan = p.on_scheduled("r", 6, tokens)  # 12 tokens: chunk 0
    assert (plan.first_chunk, plan.num_chunks, plan.block_ids) == (0, 1, (100, 101))
    plan = p.on_scheduled("r", 8, tokens)  # 20 tokens: chunk 1
    assert (plan.first_chunk, plan.num_chunks) == (1, 1)
    assert plan.keys == (tuple(chunk_keys(NS, tokens, CHUNK)[1:2]),)


def test_a_skipped_store_is_planned_again_from_its_first_chunk():
    """A store the worker skipped is planned again at the request's next step, with the same keys
    and blocks; never for a request that no longer runs, nor for chunks not planned yet."""
    p = planner()
    tokens = list(range(24))
    admitted(p, "r", tokens, hits=0, leases=())
    first = p.on_scheduled("r", 16, tokens)
    assert (first.first_chunk, first.num_chunks) == (0, 2)
    assert p.store_again("r", 2) is False  # chunk 2 was never planned
    assert p.store_again("r", 1) is True
    plan = p.on_scheduled("r", 8, tokens)  # the next step: chunk 1 again, and the new chunk 2
    assert (plan.first_chunk, plan.num_chunks) == (1, 2)
    assert plan.keys[0][0] == first.keys[0][1]
    assert plan.block_ids[:2] == first.block_ids[2:]
    assert p.store_again("unknown", 0) is False
    with pytest.raises(InvalidArgumentError):
        p.store_again("r", -1)
    p.on_preempted("r")
    assert p.store_again("r", 0) is False  # its blocks went back to the engine
    p.finish("r")
    assert p.store_again("r", 0) is False


def test_store_bounded_by_known_tokens():
    """A chunk whose tokens are not all known yet is not stored."""
    p = planner()
    tokens = list(range(14))
    admitted(p, "r", tokens, hits=0, leases=())
    assert p.on_scheduled("r", 14, tokens).num_chunks == 1
    tokens += [99]
    assert p.on_scheduled("r", 1, tokens) is None  # 15 known tokens, 15 computed
    assert p.on_scheduled("r", 2, tokens) is None  # 16 computed (a draft token), 15 known
    tokens += [98]
    plan = p.on_scheduled("r", 0, tokens)
    assert plan.first_chunk == 1
    assert plan.keys[0] == tuple(chunk_keys(NS, tokens, CHUNK)[1:2])


def test_store_bounded_by_allocated_blocks():
    """Chunks beyond the allocated blocks are not stored until blocks arrive."""
    p = planner()
    tokens = list(range(16))
    p.add_request("r")
    p.start_lookup("r", tokens)
    p.on_lookup_done("r", [0], ())
    p.num_tokens_to_load("r", 0, 16)
    p.on_allocated("r", [100, 101, 102], 0)
    assert p.on_scheduled("r", 16, tokens).num_chunks == 1
    assert p.on_scheduled("r", 0, tokens, [103]).first_chunk == 1


def test_hits_are_not_stored_again_and_max_of_prefixes_is_used():
    """Hit chunks are skipped; the computed prefix is max(engine hit, cache hit), never their sum."""
    p = planner()
    tokens = list(range(40))
    load, _ = admitted(p, "r", tokens, hits=2, engine_hit=8)
    assert load == 8
    assert p.on_scheduled("r", 8, tokens) is None  # computed = 16 + 8 = 24, load unconfirmed
    p.on_load_done("r")
    plan = p.on_scheduled("r", 0, tokens)
    assert (plan.first_chunk, plan.num_chunks) == (2, 1)


def test_nothing_is_stored_while_a_load_is_unconfirmed():
    """Chunks computed over a load are stored only once the load is confirmed, never if it failed."""
    p = planner()
    tokens = list(range(48))
    admitted(p, "r", tokens, hits=2)
    assert p.on_scheduled("r", 16, tokens) is None  # 16 loaded + 16 computed: chunks 2, 3 wait
    assert p.on_scheduled("r", 8, tokens) is None  # a second step in flight (async scheduling)
    p.on_load_done("r")
    plan = p.on_scheduled("r", 0, tokens)
    assert (plan.first_chunk, plan.num_chunks) == (2, 3)

    q = planner()
    admitted(q, "q", tokens, hits=2)
    assert q.on_scheduled("q", 16, tokens) is None
    q.on_load_failed("q", 0)  # vLLM truncated at the first failed block
    plan = q.on_scheduled("q", 32, tokens)
    assert (plan.first_chunk, plan.num_chunks) == (0, 4)  # recomputed chunks are stored again


def test_each_chunk_planned_once():
    """A chunk planned for store is never planned again, however the steps fall."""
    p = planner()
    tokens = list(range(32))
    admitted(p, "r", tokens, hits=0, leases=())
    firsts = []
    for _ in range(8):
        plan = p.on_scheduled("r", 4, tokens)
        if plan:
            firsts.extend(range(plan.first_chunk, plan.first_chunk + plan.num_chunks))
    assert firsts == [0, 1, 2, 3]


def test_lease_released_after_load():
    """The lease of a load returns once the load is done, exactly once."""
    p = planner()
    admitted(p, "r", list(range(16)), hits=2)
    assert p.take_releases() == []
    p.on_scheduled("r", 1, list(range(16)))
    p.on_load_done("r")
    assert p.take_releases() == [7]
    p.finish("r")
    assert p.take_releases() == []


@pytest.mark.parametrize("stage", ["new", "prefetching", "looked_up", "waiting", "ready", "preempted"])
@pytest.mark.parametrize("end", ["finish", "abort"])
def test_end_in_every_state_releases_exactly_once(stage, end):
    """Finish or abort in any state releases each lease exactly once, including a lookup still in flight."""
    p = planner()
    tokens = list(range(24))
    p.add_request("r")
    if stage != "new":
        p.start_lookup("r", tokens)
    if stage in ("looked_up", "waiting", "ready", "preempted"):
        p.on_lookup_done("r", [2], (7,))
    if stage in ("waiting", "ready", "preempted"):
        p.on_allocated("r", list(range(6)), p.num_tokens_to_load("r", 0, 24))
    if stage in ("ready", "preempted"):
        p.on_load_done("r")
    if stage == "preempted":
        p.on_preempted("r")
    released = p.take_releases()
    assert getattr(p, end)("r") is True
    released += p.take_releases()
    if stage == "waiting":
        assert released == []  # the load may still be copying out of the leased slots
        p.on_load_done("r")  # the worker reports the copy ended
        released += p.take_releases()
    if stage == "prefetching":
        assert released == []
        p.on_lookup_done("r", [2], (7,))  # the reply arrives after the end
        released += p.take_releases()
    assert released == ([] if stage == "new" else [7])
    assert "r" not in p
    assert getattr(p, end)("r") is False  # a second end is a normal event


def test_preempted_request_looks_up_again_and_can_load():
    """A resumed request looks up again, may load again, and does not store its stored chunks twice."""
    p = planner()
    tokens = list(range(24))
    admitted(p, "r", tokens, hits=0, leases=())
    assert p.on_scheduled("r", 24, tokens).num_chunks == 3
    p.on_preempted("r")
    assert p.get("r").state is RequestState.PREEMPTED
    keys = p.start_lookup("r", [*tokens, 5])
    p.on_lookup_done("r", [len(keys[0])], (9,))
    load = p.num_tokens_to_load("r", 0, 25)
    assert load == 24
    plan = p.on_allocated("r", [200 + i for i in range(7)], load)
    assert plan.block_ids[:2] == (200, 201)
    assert p.on_scheduled("r", 1, [*tokens, 5], replace_blocks=True, new_block_ids=[200 + i for i in range(7)]) is None
    p.on_load_done("r")
    assert p.take_releases() == [9]


def test_load_failure_rolls_back_and_allows_restore():
    """After a failed load the recomputed chunks are stored again from the failure point."""
    p = planner()
    tokens = list(range(40))
    admitted(p, "r", tokens, hits=4)
    assert p.on_scheduled("r", 8, tokens) is None  # 32 loaded + 8 computed, load unconfirmed
    p.on_load_failed("r", 8)
    assert p.take_releases() == [7]
    plan = p.on_scheduled("r", 32, tokens)
    assert (plan.first_chunk, plan.num_chunks) == (1, 4)


def test_events_out_of_order_raise():
    """Events the table does not allow raise InvalidTransitionError."""
    p = planner()
    p.add_request("r")
    with pytest.raises(InvalidTransitionError):
        p.on_scheduled("r", 1, [1])
    with pytest.raises(InvalidTransitionError):
        p.on_load_done("r")
    with pytest.raises(InvalidTransitionError):
        p.on_preempted("r")


def test_unknown_request_raises():
    """Operations on an untracked request raise UnknownRequestError."""
    with pytest.raises(UnknownRequestError):
        planner().on_scheduled("nope", 1, [1])


def test_duplicate_request_raises():
    """Adding a request twice is a caller bug."""
    p = planner()
    p.add_request("r")
    with pytest.raises(InvalidArgumentError):
        p.add_request("r")


def test_server_claiming_more_hits_than_keys_is_clamped():
    """A reply with more hits than keys sent cannot make the engine load unknown chunks."""
    p = planner()
    p.add_request("r")
    p.start_lookup("r", list(range(16)))
    p.on_lookup_done("r", [50], (1,))
    assert p.num_tokens_to_load("r", 0, 100) == 16


def test_looking_up_again_releases_the_old_leases():
    """A request whose hit grew old while waiting for blocks looks up again; the old leases go back."""
    p = planner()
    tokens = list(range(24))
    p.add_request("r")
    p.start_lookup("r", tokens)
    p.on_lookup_done("r", [3], (7,))
    assert p.start_lookup("r", tokens) is not None
    assert p.take_releases() == [7]
    p.on_lookup_done("r", [1], (8,))
    assert p.num_tokens_to_load("r", 0, 24) == 8
    p.finish("r")
    assert p.take_releases() == [8]


def test_lookup_starts_past_the_engines_own_hit_and_the_plan_carries_slots():
    """Chunks the engine holds are not asked for; hits count on from there, and the plan says where they lie."""
    p = planner()
    tokens = list(range(30))
    p.add_request("r")
    keys = p.start_lookup("r", tokens, local_tokens=8)
    assert [len(k) for k in keys] == [2]  # chunks 1 and 2 of 3
    p.on_lookup_done("r", [2], (7,), slots=[[100, 200]], source="server-a", at=5.0)
    assert p.get("r").hit_chunks == 3
    assert p.get("r").hit_at == 5.0
    load = p.num_tokens_to_load("r", 8, 30)
    assert load == 16
    plan = p.on_allocated("r", list(range(8)), load)
    assert (plan.first_chunk, plan.num_chunks, plan.skip_blocks) == (1, 2, 0)
    assert plan.slots == ((100, 200),)
    assert plan.source == "server-a"
    assert plan.lease_ids == (7,)
    assert p.is_loading("r")


def test_nothing_to_ask_when_the_engine_holds_every_full_chunk():
    """A request whose full chunks the engine already holds is looked up with zero hits, no message."""
    p = planner()
    p.add_request("r")
    assert p.start_lookup("r", list(range(20)), local_tokens=16) is None
    assert p.get("r").state is RequestState.LOOKED_UP
    assert p.num_tokens_to_load("r", 16, 20) == 0


def test_a_hit_that_no_longer_continues_the_engines_hit_is_not_loaded():
    """If the engine's own hit shrank below the lookup's first chunk, the hit is not contiguous: load nothing."""
    p = planner()
    p.add_request("r")
    p.start_lookup("r", list(range(30)), local_tokens=8)
    p.on_lookup_done("r", [2], (7,), slots=[[100, 200]])
    assert p.num_tokens_to_load("r", 0, 30) == 0
    assert p.on_allocated("r", list(range(8)), 0) is None
    assert p.take_releases() == [7]


def test_abort_during_a_load_holds_its_lease_until_the_load_ends():
    """A request aborted while its load runs gives its lease back only when the load is reported."""
    p = planner()
    admitted(p, "r", list(range(16)), hits=2)
    assert p.abort("r") is True
    assert p.take_releases() == []
    assert p.is_loading("r")
    p.on_load_failed("r", 0)
    assert p.take_releases() == [7]
    assert not p.is_loading("r")
    with pytest.raises(UnknownRequestError):
        p.on_load_done("r")


def test_a_new_epoch_rekeys_every_request_and_drops_old_hits():
    """After a cache reset no key of the old epoch is used: hits are dropped, late replies are misses,
    and every chunk is stored again under the new keys."""
    p = planner()
    tokens = list(range(24))
    p.add_request("hit")
    p.start_lookup("hit", tokens)
    p.on_lookup_done("hit", [3], (7,), slots=[[1, 2, 3]])
    p.add_request("asking")
    old_keys = p.start_lookup("asking", tokens)
    p.add_request("stored")
    p.start_lookup("stored", tokens)
    p.on_lookup_done("stored", [0], ())
    p.on_allocated("stored", list(range(6)), 0)
    assert p.on_scheduled("stored", 24, tokens).num_chunks == 3
    p.new_epoch("e1")
    assert p.take_releases() == [7]
    assert p.num_tokens_to_load("hit", 0, 24) == 0
    p.on_lookup_done("asking", [3], (8,), slots=[[1, 2, 3]])  # the reply to a lookup of the old epoch
    assert p.take_releases() == [8]
    assert p.num_tokens_to_load("asking", 0, 24) == 0
    plan = p.on_scheduled("stored", 1, [*tokens, 1])
    assert (plan.first_chunk, plan.num_chunks) == (0, 3)
    assert plan.keys[0] != tuple(old_keys[0])
    p.add_request("new")
    assert p.start_lookup("new", tokens) != old_keys


def test_a_load_whose_request_was_preempted_keeps_its_leases_until_it_ends():
    """A synchronous load copies before its step's forward pass, and the engine may preempt the
    request in the next pass, before that step ends, then resume it at once: without a load (here
    vLLM's own cache holds the prefix now) or with another. The preempted load is no longer the
    request's (settling it used to move a READY request by LOAD_DONE: InvalidTransitionError, which
    killed the engine); its leases go back when it ends, and a new load keeps its own."""
    p = planner()
    tokens = list(range(24))
    admitted(p, "r", tokens, hits=2, leases=(7,))
    assert p.is_loading("r")
    p.on_preempted("r")
    assert not p.is_loading("r")
    assert p.take_releases() == []  # its copy may still run
    keys = p.start_lookup("r", [*tokens, 5])
    p.on_lookup_done("r", [len(keys[0])], (9,))
    assert p.on_allocated("r", [200 + i for i in range(7)], p.num_tokens_to_load("r", 24, 25)) is None
    assert p.get("r").state is RequestState.READY
    assert p.take_releases() == [9]  # the resumed lookup's lease: nothing to load past vLLM's hit
    assert p.end_preempted_load("r") is True  # the preempted load's step ended
    assert p.take_releases() == [7]
    assert p.end_preempted_load("r") is False


def test_a_request_preempted_twice_mid_load_gives_back_each_loads_leases_in_order():
    p = planner()
    tokens = list(range(24))
    admitted(p, "r", tokens, hits=2, leases=(7,))
    p.on_preempted("r")
    keys = p.start_lookup("r", tokens)
    p.on_lookup_done("r", [len(keys[0])], (9,))
    assert p.on_allocated("r", [300 + i for i in range(6)], p.num_tokens_to_load("r", 0, 24)) is not None
    assert p.is_loading("r")
    p.on_preempted("r")
    assert p.end_preempted_load("r") is True
    assert p.take_releases() == [7]
    assert p.end_preempted_load("r") is True
    assert p.take_releases() == [9]


def test_each_lease_goes_back_with_the_server_instance_that_granted_it():
    """The planner hands back (server instance, lease id) pairs: a lookup's leases carry its
    reply's source through a repeated lookup, a load, a preemption mid-load, a reply after the end
    and a reply from before a cache reset, so the caller needs no map of its own."""
    p = planner()
    tokens = list(range(24))
    p.add_request("r")
    p.start_lookup("r", tokens)
    p.on_lookup_done("r", [2], (7,), slots=[[0, 1]], source="a")
    p.start_lookup("r", tokens)  # looked up again (the server restarted meanwhile): the old lease goes back
    assert p.take_leases() == [("a", 7)]
    p.on_lookup_done("r", [2], (8,), slots=[[0, 1]], source="b")
    plan = p.on_allocated("r", list(range(6)), p.num_tokens_to_load("r", 0, 24))
    assert plan is not None
    assert (plan.source, plan.lease_ids) == ("b", (8,))
    p.on_preempted("r")
    assert p.end_preempted_load("r") is True
    assert p.take_leases() == [("b", 8)]
    p.start_lookup("r", tokens)
    p.abort("r")
    p.on_lookup_done("r", [2], (9, 0), source="c")  # a reply after the end: its leases (not 0) go back
    assert p.take_leases() == [("c", 9)]
    p.add_request("s")
    p.start_lookup("s", tokens)
    p.new_epoch("e2")
    p.on_lookup_done("s", [2], (10,), source="c")  # asked before the reset: no hit, the lease goes back
    assert p.take_leases() == [("c", 10)]
    assert p.get("s").hit_chunks == 0


def test_take_releases_gives_the_ids_alone_and_drains_the_same_leases():
    """For a caller with one server the ids are enough; either take drains what the planner holds."""
    p = planner()
    admitted(p, "r", list(range(16)), hits=0)
    assert p.take_releases() == [7]
    assert p.take_leases() == []


def test_leases_that_come_after_their_hit_are_held_with_it_or_given_back():
    """A lookup answered without leases (from the server's slot index): the reply's leases, when
    they land, are held with the hit while it waits for its blocks or loads, and go back with its
    load; they go back at once when the hit is gone, or is another instance's."""
    p = planner()
    tokens = list(range(24))
    p.add_request("r")
    p.start_lookup("r", tokens)
    p.on_lookup_done("r", [2], (0,), slots=[[0, 1]], source="a")
    p.add_leases("r", "a", [7])  # waiting for its blocks
    assert p.take_leases() == []
    plan = p.on_allocated("r", list(range(6)), p.num_tokens_to_load("r", 0, 24))
    assert plan is not None
    assert plan.lease_ids == (7,)
    p.add_leases("r", "a", [8])  # loading
    assert p.take_leases() == []
    p.on_load_done("r")
    assert p.take_leases() == [("a", 7), ("a", 8)]
    p.add_leases("r", "a", [9])  # loaded already
    assert p.take_leases() == [("a", 9)]
    p.add_request("s")
    p.start_lookup("s", tokens)
    p.on_lookup_done("s", [2], (0,), slots=[[0, 1]], source="a")
    p.add_leases("s", "b", [10])  # another instance's
    p.add_leases("gone", "a", [11])  # a request that ended
    assert p.take_leases() == [("b", 10), ("a", 11)]
