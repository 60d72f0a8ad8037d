"""The connector's scheduler half against a fake client: admission lookups, async loads, leases, outages.

A unit test: the client is a test double that records what would go to the server and lets the
test decide when and how replies arrive. The end-to-end tests in tests/vllm use a real server.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm.v1.request import RequestStatus

from kvdepot.core import Namespace, RequestState
from kvdepot.transport import LookupReply, LookupResult, Slot
from kvdepot.vllm_connector._health import ServerHealth
from kvdepot.vllm_connector._meta import KVDepotWorkerMetadata
from kvdepot.vllm_connector._scheduler import SchedulerSide

BLOCK, CHUNK = 4, 8


class FakeClient:
    """Records lookups and releases; replies are resolved by the test (or at once, with ``answer``)."""

    server_id = "server-1"
    address = "ipc:///fake"
    hello_reply = None  # offers no slot index: every lookup waits for its reply

    def __init__(self, fail: bool = False, answer=None) -> None:
        self.lookups: list[tuple[list, Future]] = []
        self.prefill_estimates: list[float | None] = []  # what each lookup said of the engine's speed
        self.released: list[int] = []
        self.pings = 0
        self.fail = fail
        self.answer = answer
        self.connected = True

    def lookup(self, items, *, prefill_s_per_chunk=None):
        if self.fail:
            raise ConnectionError("no server")
        self.prefill_estimates.append(prefill_s_per_chunk)
        future: Future = Future()
        self.lookups.append((list(items), future))
        if self.answer is not None:
            future.set_result(self.answer(items))
        return future

    def release(self, leases, *, server_id):
        assert server_id == self.server_id  # a release always names the instance that granted it
        self.released.extend(leases)
        done: Future = Future()
        done.set_result(None)
        return done

    def ping(self):
        self.pings += 1
        done: Future = Future()
        done.set_result(None)
        return done


class FakeCacheManager:
    """vLLM's KV cache manager as the scheduler side reads it: a local prefix hit of ``hit`` tokens."""

    enable_caching = True

    def __init__(self, hit: int) -> None:
        self.coordinator = SimpleNamespace(find_longest_cache_hit=lambda hashes, max_len: ((), min(hit, max_len), 0))


def request(req_id: str, n: int, **kw) -> SimpleNamespace:
    tokens = list(range(100, 100 + n))
    return SimpleNamespace(
        request_id=req_id,
        all_token_ids=tokens,
        num_tokens=n,
        cache_salt=kw.get("salt"),
        lora_request=None,
        mm_features=[],
        prompt_embeds=kw.get("prompt_embeds"),
        status=RequestStatus.WAITING,
        num_computed_tokens=0,
        block_hashes=[],
    )


def reply(*hits_and_leases: tuple[int, int]) -> LookupReply:
    return LookupReply(
        results=[LookupResult(h, lease, [Slot(i * 64, 64) for i in range(h)]) for h, lease in hits_and_leases]
    )


def output(new=(), cached=(), scheduled=None, preempted=None) -> SimpleNamespace:
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(b,)) for r, b in new],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _ in cached],
            new_block_ids=[(b,) if b is not None else None for _, b in cached],
            resumed_req_ids=set(),
        ),
        num_scheduled_tokens=scheduled or {},
        total_num_scheduled_tokens=sum((scheduled or {}).values()),
        preempted_req_ids=preempted,
    )


def side(client: FakeClient, timeout: float = 5.0) -> SchedulerSide:
    return SchedulerSide(
        Namespace(model="m"),
        block_size=BLOCK,
        chunk_size=CHUNK,
        client=client,
        lookup_timeout=timeout,
        health=ServerHealth(client, probe_interval=0.0),
    )


def answering_client() -> FakeClient:
    """A server that answers at once and holds every chunk asked for (lease 3)."""
    return FakeClient(answer=lambda items: reply(*[(len(i.keys), 3) for i in items]))


def finished(*, recving=(), failed=()) -> SimpleNamespace:
    """vLLM's connector output once every worker reported these loads (``failed`` among them)."""
    return SimpleNamespace(finished_recving=set(recving), kv_connector_worker_meta=KVDepotWorkerMetadata(set(failed)))


def looked_up(s: SchedulerSide, client: FakeClient, req, *hits_and_leases) -> tuple:
    """Admit ``req``, answer its lookup, and return what vLLM is told."""
    s.on_new_request(req)
    s.get_num_new_matched_tokens(req, 0)
    client.lookups[-1][1].set_result(reply(*hits_and_leases))
    return s.get_num_new_matched_tokens(req, 0)


def test_lookups_of_admitted_requests_go_in_one_message():
    """Requests admitted together are looked up in one message, sent when vLLM first asks for a match."""
    client = FakeClient()
    s = side(client)
    a, b = request("a", 20), request("b", 12)
    s.on_new_request(a)
    s.on_new_request(b)
    assert client.lookups == []
    assert s.get_num_new_matched_tokens(a, 0) == (None, False)  # not answered within the bounded yield
    assert s.get_num_new_matched_tokens(b, 0) == (None, False)
    assert len(client.lookups) == 1
    items, future = client.lookups[0]
    assert [len(item.keys) for item in items] == [2, 1]
    future.set_result(reply((2, 11), (0, 0)))
    assert s.get_num_new_matched_tokens(a, 0) == (16, True)  # loaded asynchronously
    assert s.get_num_new_matched_tokens(b, 0) == (0, False)


def test_an_answered_lookup_costs_no_engine_step():
    """When the server answers within the yield, vLLM gets the hit (or the miss) on its first ask."""
    client = answering_client()
    s = side(client)
    a = request("a", 20)
    s.on_new_request(a)
    assert s.get_num_new_matched_tokens(a, 0) == (16, True)


def test_no_lookup_for_chunks_vllms_prefix_cache_holds():
    """Chunks the engine's own prefix cache holds are not asked for; a fully covered request sends nothing."""
    client = answering_client()
    s = side(client)
    s.kv_cache_manager = FakeCacheManager(hit=16)
    covered = request("covered", 20)
    s.on_new_request(covered)
    assert s.get_num_new_matched_tokens(covered, 16) == (0, False)
    assert client.lookups == []
    s.kv_cache_manager = FakeCacheManager(hit=8)
    half = request("half", 20)
    s.on_new_request(half)
    assert s.get_num_new_matched_tokens(half, 8) == (8, True)
    ((items, _future),) = client.lookups
    assert [len(item.keys) for item in items] == [1]  # only the second chunk
    s.update_state_after_alloc(half, ([1, 2, 3, 4, 5],), 8)
    meta = s.build_connector_meta(output())
    assert meta.loads[0].slots == [[0]]  # the slot of the one chunk asked for
    assert meta.loads[0].block_ids == [[3, 4]]


def test_a_local_hit_that_shrank_is_looked_up_again_from_vllms_hit_now():
    """A lookup sent past a local hit that vLLM no longer has cannot be loaded as it is (the gap is
    not in its answer): the request is looked up again from vLLM's hit now, and the first answer's
    lease goes back."""
    client = answering_client()
    s = side(client)
    s.kv_cache_manager = FakeCacheManager(hit=8)
    a = request("a", 20)
    s.on_new_request(a)
    assert s.planner.get("a").lookup_first == 1
    assert s.get_num_new_matched_tokens(a, 0) == (16, True)
    assert s.planner.get("a").lookup_first == 0
    assert len(client.lookups) == 2
    assert len(client.released) == 1


def test_load_lease_is_released_once_every_worker_reported_the_load():
    """A hit is loaded asynchronously; its lease goes back when vLLM reports the load finished, not before."""
    client = FakeClient()
    s = side(client)
    a = request("a", 20)
    assert looked_up(s, client, a, (2, 11)) == (16, True)
    s.update_state_after_alloc(a, ([1, 2, 3, 4, 5],), 16)
    meta = s.build_connector_meta(output())
    assert [op.req_id for op in meta.loads] == ["a"]
    assert meta.loads[0].slots == [[0, 64]]
    assert meta.loads[0].server_id == "server-1"
    s.update_connector_output(finished())
    assert client.released == []
    s.update_connector_output(finished(recving={"a"}))
    assert client.released == [11]
    assert s.planner.get("a").state is RequestState.READY
    assert s.request_finished(a) == (False, None)
    assert client.released == [11]


def test_abort_while_loading_keeps_the_lease_until_the_copy_ends():
    """A request aborted while its load is copying keeps its lease until the workers report the copy."""
    client = FakeClient()
    s = side(client)
    a = request("a", 20)
    looked_up(s, client, a, (2, 11))
    s.update_state_after_alloc(a, ([1, 2, 3, 4, 5],), 16)
    s.build_connector_meta(output())
    a.status = RequestStatus.FINISHED_ABORTED
    assert s.request_finished(a) == (False, None)  # vLLM itself holds the blocks of a loading request
    assert client.released == []
    s.update_connector_output(finished(recving={"a"}))
    assert client.released == [11]
    assert not s.planner.is_loading("a")


def test_a_finished_request_gives_its_blocks_back_at_once_even_with_stores():
    """A request that planned stores gives its blocks back when it finishes, as one that planned none:
    the workers read a store's blocks within the step that planned it."""
    client = FakeClient(answer=lambda items: reply(*[(0, 0) for _ in items]))
    s = side(client)
    a, b = request("a", 20), request("b", 4)
    for r in (a, b):
        s.on_new_request(r)
        assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    s.update_state_after_alloc(a, (list(range(5)),), 0)
    s.update_state_after_alloc(b, ([9],), 0)
    meta = s.build_connector_meta(output(new=[("a", list(range(5))), ("b", [9])], scheduled={"a": 20, "b": 4}))
    assert [op.req_id for op in meta.stores] == ["a"]
    assert s.request_finished(a) == (False, None)
    assert s.request_finished(b) == (False, None)


def test_finish_with_lookup_in_flight_releases_the_late_lease():
    """A request that ends while its lookup is out gets the reply's lease released when it arrives."""
    client = FakeClient()
    s = side(client)
    a = request("a", 20)
    s.on_new_request(a)
    s.get_num_new_matched_tokens(a, 0)
    a.status = RequestStatus.FINISHED_ABORTED
    s.request_finished(a)
    assert client.released == []
    client.lookups[0][1].set_result(reply((2, 21)))
    assert client.released == [21]
    assert "a" not in s.planner


def test_finish_before_the_lookup_was_sent():
    """A request aborted before its lookup left the scheduler sends no lookup at all."""
    client = FakeClient()
    s = side(client)
    a = request("a", 20)
    s.on_new_request(a)
    a.status = RequestStatus.FINISHED_ABORTED
    s.request_finished(a)
    s.build_connector_meta(output())
    assert client.lookups == []
    assert len(s.planner) == 0


def test_timeout_is_a_miss_and_later_requests_do_not_wait():
    """A lookup that takes too long is a miss; until a ping succeeds, later requests are misses at once."""
    client = FakeClient()
    s = side(client, timeout=0.01)
    a = request("a", 20)
    s.on_new_request(a)
    s.get_num_new_matched_tokens(a, 0)
    time.sleep(0.02)
    assert s.get_num_new_matched_tokens(a, 0) == (0, False)
    client.lookups[0][1].set_result(reply((2, 31)))
    assert client.released == [31]  # the late reply's lease still goes back
    assert s.stats.data["lookup_misses_timeout"] == 1
    # The server is suspect: the next request sends nothing and is a miss at once.
    s.health._probe_sent = time.monotonic() + 60  # hold the probe back for this part
    b = request("b", 20)
    s.on_new_request(b)
    assert s.get_num_new_matched_tokens(b, 0) == (0, False)
    assert len(client.lookups) == 1
    assert s.stats.data["lookup_misses_server_down"] >= 1
    # A successful ping ends it: the next request is looked up again.
    s.health._probe_sent = 0.0
    assert not s.health.usable()  # sends the ping, which the fake answers at once
    assert client.pings == 1
    c = request("c", 20)
    s.on_new_request(c)
    s.get_num_new_matched_tokens(c, 0)
    assert len(client.lookups) == 2


def test_lookups_tell_the_server_how_fast_the_engine_computes_a_chunk():
    """No estimate before the engine ran a step of enough tokens; after one, each lookup carries
    the seconds a chunk takes, from the step's tokens and time."""
    client = FakeClient()
    s = side(client)
    looked_up(s, client, request("a", 20), (2, 3))
    assert client.prefill_estimates == [None]
    s.build_connector_meta(output(scheduled={"a": 800}))
    time.sleep(0.02)
    s.update_connector_output(finished())
    b = request("b", 20)
    s.on_new_request(b)
    s.get_num_new_matched_tokens(b, 0)
    estimate = client.prefill_estimates[-1]
    assert estimate is not None
    assert CHUNK * 0.02 / 800 <= estimate < CHUNK * 0.5 / 800  # the step's seconds per token, times a chunk


def test_disconnected_server_is_a_miss_without_a_message():
    """While the client has no connection, requests are misses at once and nothing is sent."""
    client = FakeClient()
    client.connected = False
    s = side(client)
    a = request("a", 20)
    s.on_new_request(a)
    assert s.get_num_new_matched_tokens(a, 0) == (0, False)
    s.update_state_after_alloc(a, (list(range(5)),), 0)
    s.build_connector_meta(output())
    assert client.lookups == []


def test_unsendable_lookup_is_a_miss():
    """When the lookup cannot even be sent, the request goes on as a miss."""
    s = side(FakeClient(fail=True))
    a = request("a", 20)
    s.on_new_request(a)
    assert s.get_num_new_matched_tokens(a, 0) == (0, False)


@pytest.mark.parametrize("local_hit", [0, 8])
def test_failed_load_releases_and_recomputes_from_vllms_count(local_hit):
    """A failed load releases its lease and rolls back; the request, re-admitted with nothing valid (and
    perhaps a local hit another request computed meanwhile), is never offered a hit again and stores
    every chunk it computes."""
    client = FakeClient()
    s = side(client)
    a = request("a", 24)
    assert looked_up(s, client, a, (3, 41)) == (23, True)
    s.update_state_after_alloc(a, (list(range(6)),), 23)
    s.build_connector_meta(output())
    a.num_computed_tokens = 0  # vLLM truncated at the first failed block, the first one
    s.update_connector_output(finished(recving={"a"}, failed={"a"}))
    assert client.released == [41]
    assert s.stats.data["load_failures"] == 1
    assert s.planner.get("a").state is RequestState.READY
    # vLLM freed the blocks and admits the request again.
    assert s.get_num_new_matched_tokens(a, local_hit) == (0, False)
    s.update_state_after_alloc(a, (list(range(10, 16)),), 0)
    meta = s.build_connector_meta(output(new=[("a", list(range(10, 16)))], scheduled={"a": 24 - local_hit}))
    assert [(op.req_id, len(op.keys[0])) for op in meta.stores] == [("a", 3)]
    assert len(client.lookups) == 1


def test_a_load_that_failed_on_one_rank_steps_before_the_others_finished_is_a_failure():
    """With several ranks, one rank's failure reaches the scheduler in the step it failed, and vLLM
    lists the load as finished only once the last rank reported, steps later. The load is still
    a failure: nothing of the hit is counted as computed beyond vLLM's cut-back count, and every
    chunk the request computes again is stored, none before it is computed."""
    client = FakeClient()
    s = side(client)  # blocks of 4 tokens, chunks of 8
    a = request("a", 40)
    assert looked_up(s, client, a, (4, 11)) == (32, True)
    blocks = list(range(1, 11))
    s.update_state_after_alloc(a, (blocks,), 32)
    assert len(s.build_connector_meta(output()).loads) == 1
    a.num_computed_tokens = 8  # one rank failed from the second chunk on: vLLM cut back to 8 tokens
    s.update_connector_output(finished(failed={"a"}))  # that rank's report; the load is not finished yet
    s.update_connector_output(SimpleNamespace(finished_recving={"a"}, kv_connector_worker_meta=None))
    assert s.stats.data["load_failures"] == 1
    assert client.released == [11]
    assert s.planner.get("a").state is RequestState.READY
    # vLLM resumes the request from token 8, 8 tokens this step: chunk 1 (tokens 8-15) is stored.
    s.update_state_after_alloc(a, (blocks,), 0)
    meta = s.build_connector_meta(output(new=[("a", blocks)], scheduled={"a": 8}))
    assert [(op.req_id, op.block_ids[0]) for op in meta.stores] == [("a", blocks[2:4])]


def test_preempted_request_looks_up_again():
    """A running request that comes back to the waiting queue is looked up again and can load."""
    client = FakeClient()
    s = side(client)
    a = request("a", 20)
    assert looked_up(s, client, a, (0, 0)) == (0, False)
    s.update_state_after_alloc(a, (list(range(5)),), 0)
    meta = s.build_connector_meta(output(new=[("a", list(range(5)))], scheduled={"a": 20}))
    assert len(meta.stores) == 1
    s.build_connector_meta(output(preempted={"a"}))
    assert s.planner.get("a").state is RequestState.PREEMPTED
    assert s.get_num_new_matched_tokens(a, 0) == (None, False)
    assert len(client.lookups) == 2


def test_prompt_embeds_are_not_cached():
    """A request given as prompt embeddings has zero token ids: it is neither looked up nor stored."""
    client = FakeClient()
    s = side(client)
    e = request("e", 20, prompt_embeds=object())
    s.on_new_request(e)
    assert s.get_num_new_matched_tokens(e, 0) == (0, False)
    s.update_state_after_alloc(e, (list(range(5)),), 0)
    meta = s.build_connector_meta(output(new=[("e", list(range(5)))], scheduled={"e": 20}))
    assert client.lookups == []
    assert meta.stores == []


@pytest.mark.parametrize("restart", ["before_the_reply_is_read", "after_the_hit"])
def test_a_server_restart_drops_the_old_instances_leases(restart):
    """After a restart, a reply read late is a miss, and no old lease is released to the new instance."""
    client = FakeClient()
    s = side(client)
    a = request("a", 20)
    s.on_new_request(a)
    s.get_num_new_matched_tokens(a, 0)
    client.lookups[0][1].set_result(reply((2, 5)))
    if restart == "after_the_hit":
        assert s.get_num_new_matched_tokens(a, 0) == (16, True)
    client.server_id = "server-2"  # the client reconnected to a restarted server
    if restart == "before_the_reply_is_read":
        assert s.get_num_new_matched_tokens(a, 0) == (0, False)
    s.request_finished(a)
    assert client.released == []


def test_an_old_hit_is_looked_up_again(monkeypatch):
    """A hit that waited longer than the refresh age for blocks is looked up again; its old lease goes back."""
    from kvdepot.vllm_connector import _scheduler

    client = FakeClient()
    s = side(client)
    a = request("a", 20)
    assert looked_up(s, client, a, (2, 5)) == (16, True)
    monkeypatch.setattr(_scheduler, "LEASE_REFRESH_S", 0.0)
    assert s.get_num_new_matched_tokens(a, 0) == (None, False)
    assert client.released == [5]
    assert len(client.lookups) == 2


def test_skip_reading_prefix_cache_is_stored_but_not_looked_up():
    """A request that must not read cached prefixes is not looked up, and its chunks are still stored."""
    client = FakeClient()
    s = side(client)
    a = request("a", 20)
    a.skip_reading_prefix_cache = True
    s.on_new_request(a)
    assert s.get_num_new_matched_tokens(a, 0) == (0, False)
    s.update_state_after_alloc(a, (list(range(5)),), 0)
    meta = s.build_connector_meta(output(new=[("a", list(range(5)))], scheduled={"a": 20}))
    assert client.lookups == []
    assert len(meta.stores) == 1


def test_a_multimodal_input_keys_only_the_chunks_from_its_position_on():
    """Two requests with the same text prefix and different images at token 12 share the first
    chunk's key (tokens 0..7) and nothing from the image's chunk on; the same image shares all."""
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    def with_image(req_id: str, identifier: str) -> SimpleNamespace:
        req = request(req_id, 33)
        req.mm_features = [MultiModalFeatureSpec(None, "image", identifier, PlaceholderRange(offset=12, length=8))]
        return req

    client = FakeClient()
    s = side(client)
    for req in (with_image("a", "cat"), with_image("b", "dog"), with_image("c", "cat"), request("d", 33)):
        s.on_new_request(req)
    s.get_num_new_matched_tokens(request("a", 33), 0)  # sends the queued lookups
    keys = {req_id: item.keys for req_id, item in zip("abcd", client.lookups[-1][0], strict=True)}
    assert len(keys["a"]) == 4
    assert keys["a"][0] == keys["b"][0] == keys["d"][0]  # text before the image is shared
    assert all(x != y for x, y in zip(keys["a"][1:], keys["b"][1:], strict=True))
    assert all(x != y for x, y in zip(keys["a"][1:], keys["d"][1:], strict=True))
    assert keys["a"] == keys["c"]


def test_a_streaming_session_stops_storing_once_media_arrive_after_it_was_keyed():
    """vLLM's streaming-input sessions append tokens and media to the same request and schedule it
    again without a new lookup. Its keys were made from the media it had then, so chunks holding
    the new media would be stored under keys that do not name them: two sessions with different
    audio would share them. Such chunks are not stored."""
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    def second_turn_keys(s: SchedulerSide, req_id: str, media: str) -> list[bytes]:
        req = request(req_id, 2 * CHUNK)  # turn 1: two chunks of text, the same in every session
        s.on_new_request(req)
        assert s.get_num_new_matched_tokens(req, 0) == (0, False)
        s.update_state_after_alloc(req, (list(range(4)),), 0)
        s.build_connector_meta(output(new=[(req_id, list(range(4)))], scheduled={req_id: 2 * CHUNK}))
        req.all_token_ids += [7] * (2 * CHUNK)  # turn 2: audio placeholders, and the audio itself
        req.num_tokens = len(req.all_token_ids)
        req.mm_features.append(
            MultiModalFeatureSpec(None, "audio", media, PlaceholderRange(offset=2 * CHUNK, length=2 * CHUNK))
        )
        s.update_state_after_alloc(req, (list(range(8)),), 0)
        meta = s.build_connector_meta(output(new=[(req_id, list(range(8)))], scheduled={req_id: 2 * CHUNK}))
        return [key for op in meta.stores for key in op.keys[0]]

    s = side(FakeClient(answer=lambda items: reply(*[(0, 0) for _ in items])))
    assert second_turn_keys(s, "a", "audio-of-a") == []
    assert second_turn_keys(s, "b", "audio-of-b") == []


@pytest.mark.parametrize(
    ("read_back", "local_hit", "expected"),
    [
        ({}, 0, {"host": 31}),  # all from the server's RAM (the last token is left to compute)
        ({"disk": 2}, 0, {"host": 16, "disk": 15}),  # chunks 2-3 were read back from the disk
        ({"disk": 1, "remote": 1}, 0, {"host": 16, "disk": 8, "remote": 7}),
        ({"remote": 4}, 8, {"remote": 23}),  # the engine's own hit covers the first chunk
    ],
)
def test_hits_are_counted_by_the_source_the_server_had_them_in(read_back, local_hit, expected):
    """A lookup reply says which of its hits the server just read back from a tier below RAM;
    the load's tokens are split by source (RAM, disk, remote), summing to what vLLM loads."""
    client = FakeClient()
    s = side(client)
    s.kv_cache_manager = FakeCacheManager(local_hit)
    req = request("r", 4 * CHUNK)
    s.on_new_request(req)
    s.get_num_new_matched_tokens(req, local_hit)
    first = local_hit // CHUNK
    hits = 4 - first
    result = LookupResult(hits, 3, [Slot(i * 64, 64) for i in range(hits)], read_back)
    client.lookups[-1][1].set_result(LookupReply(results=[result]))
    loaded, _ = s.get_num_new_matched_tokens(req, local_hit)
    assert loaded == 4 * CHUNK - 1 - local_hit
    assert s.hit_sources(req, loaded) == expected
    assert sum(expected.values()) == loaded


# -- prefill/decode roles and the handoff (`_handoff.py`) ---------------------------------------


def role_side(client: FakeClient, **kw) -> SchedulerSide:
    return SchedulerSide(
        Namespace(model="m"),
        block_size=BLOCK,
        chunk_size=CHUNK,
        client=client,
        lookup_timeout=5.0,
        health=ServerHealth(client, probe_interval=0.0),
        **kw,
    )


def produced(n: int = 20) -> tuple[dict, FakeClient]:
    """A prefill engine's run of one request of ``n`` tokens: its kv_transfer_params, and its client."""
    client = FakeClient()
    producer = role_side(client, loads=False, producer=True)
    a = request("a", n)
    producer.on_new_request(a)
    assert producer.get_num_new_matched_tokens(a, 0) == (0, False)
    producer.update_state_after_alloc(a, (list(range(6)),), 0)
    meta = producer.build_connector_meta(output(new=[("a", list(range(6)))], scheduled={"a": n}))
    assert [len(op.keys[0]) for op in meta.stores] == [n // CHUNK]
    hold, params = producer.request_finished(a)
    assert not hold  # its blocks go back at once: the workers read them within their steps
    return params, client


def test_a_producer_looks_nothing_up_stores_every_full_chunk_and_names_them_for_the_consumer():
    params, client = produced(20)
    assert client.lookups == []
    assert params["kvdepot"]["chunks"] == 2
    assert params["kvdepot"]["version"] == 1


def test_a_consumer_waits_for_the_named_chunks_and_looks_again_until_they_are_there():
    """The server holds one of the two chunks the producer stored: "not yet" (None), and a new
    lookup after the poll interval; once both are there, both load. The consumer stores nothing."""
    params, _ = produced(20)
    client = FakeClient()
    consumer = role_side(client, stores=False)
    d = request("a", 20)
    d.kv_transfer_params = params
    consumer.on_new_request(d)
    assert consumer.get_num_new_matched_tokens(d, 0) == (None, False)
    client.lookups[-1][1].set_result(reply((1, 5)))
    assert consumer.get_num_new_matched_tokens(d, 0) == (None, False)  # one chunk of two: wait
    time.sleep(0.03)
    assert consumer.get_num_new_matched_tokens(d, 0) == (None, False)  # and look again
    assert len(client.lookups) == 2
    assert client.released == [5]  # the first lookup's lease goes back
    client.lookups[-1][1].set_result(reply((2, 6)))
    assert consumer.get_num_new_matched_tokens(d, 0) == (16, True)
    consumer.update_state_after_alloc(d, (list(range(6)),), 16)
    meta = consumer.build_connector_meta(output(new=[("a", list(range(6)))], scheduled={"a": 4}))
    assert [op.req_id for op in meta.loads] == ["a"]
    assert meta.stores == []
    assert consumer.stats.data["handoff_polls"] == 1


def test_a_consumer_stops_waiting_at_its_deadline_and_computes_the_rest():
    params, _ = produced(20)
    client = FakeClient(answer=lambda items: reply(*[(1, 7) for _ in items]))
    consumer = role_side(client, stores=False, handoff_timeout=0.05)
    d = request("a", 20)
    d.kv_transfer_params = params
    consumer.on_new_request(d)
    deadline = time.monotonic() + 5
    while (answer := consumer.get_num_new_matched_tokens(d, 0)) == (None, False):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert answer == (8, True)  # the chunk that is there; vLLM computes the second
    assert consumer.stats.data["handoff_timeouts"] == 1


def test_a_handoff_under_another_namespace_or_malformed_is_not_waited_for():
    params, _ = produced(20)
    for bad in (
        {"kvdepot": {**params["kvdepot"], "namespace": "0" * 32}},
        {"kvdepot": {**params["kvdepot"], "version": 99}},
        {"kvdepot": {**params["kvdepot"], "chunks": "two"}},
        {"kvdepot": "nonsense"},
    ):
        client = FakeClient(answer=lambda items: reply(*[(0, 0) for _ in items]))
        consumer = role_side(client, stores=False)
        d = request("a", 20)
        d.kv_transfer_params = bad
        consumer.on_new_request(d)
        assert consumer.get_num_new_matched_tokens(d, 0) == (0, False), bad


def test_a_kv_both_engine_names_its_chunks_only_when_asked_and_an_aborted_request_names_none():
    client = FakeClient(answer=lambda items: reply(*[(0, 0) for _ in items]))
    both = role_side(client)
    plain, asked = request("plain", 20), request("asked", 20)
    asked.kv_transfer_params = {"do_remote_decode": True}
    for r in (plain, asked):
        both.on_new_request(r)
        both.get_num_new_matched_tokens(r, 0)
    assert both.request_finished(plain)[1] is None
    assert both.request_finished(asked)[1]["kvdepot"]["chunks"] == 0  # nothing was scheduled
    producer = role_side(FakeClient(), loads=False, producer=True)
    gone = request("gone", 20, status=None)
    gone.status = RequestStatus.FINISHED_ABORTED
    producer.on_new_request(gone)
    assert producer.request_finished(gone)[1] is None


def test_a_store_a_worker_skipped_is_planned_again_while_the_request_runs():
    """A worker that got a store's slots too late (a busy server) names the store in its report; the
    request plans it again at its next step, same keys and blocks, at most STORE_AGAIN_MAX times."""
    from kvdepot.vllm_connector._scheduler import STORE_AGAIN_MAX

    client = FakeClient(answer=lambda items: reply(*[(0, 0) for _ in items]))
    s = side(client)  # blocks of 4 tokens, chunks of 8
    a = request("a", 24)
    s.on_new_request(a)
    assert s.get_num_new_matched_tokens(a, 0) == (0, False)
    blocks = list(range(1, 7))
    s.update_state_after_alloc(a, (blocks,), 0)
    first = s.build_connector_meta(output(new=[("a", blocks)], scheduled={"a": 16}))
    assert [(op.req_id, op.first_chunk, op.block_ids[0]) for op in first.stores] == [("a", 0, blocks[:4])]

    def skipped(chunk: int) -> SimpleNamespace:
        report = KVDepotWorkerMetadata(skipped={"a": chunk})
        return SimpleNamespace(finished_recving=set(), kv_connector_worker_meta=report)

    s.update_connector_output(skipped(1))  # chunk 1 of that store came late on some worker
    meta = s.build_connector_meta(output(cached=[("a", None)], scheduled={"a": 8}))
    (again,) = meta.stores
    assert (again.first_chunk, again.keys[0][0], again.block_ids[0]) == (1, first.stores[0].keys[0][1], blocks[2:6])
    for _ in range(STORE_AGAIN_MAX):  # later steps' stores skipped too
        s.update_connector_output(skipped(1))
        s.build_connector_meta(output(cached=[("a", None)], scheduled={"a": 1}))
    assert s.stats.data["store_again"] == STORE_AGAIN_MAX
    assert s.build_connector_meta(output(cached=[("a", None)], scheduled={"a": 1})).stores == []
    s.update_connector_output(skipped(0))  # no more: the server is slow for good
    assert s.build_connector_meta(output(cached=[("a", None)], scheduled={"a": 1})).stores == []
    assert s.stats.data["store_again"] == STORE_AGAIN_MAX


def test_skipped_stores_of_several_workers_aggregate_to_the_earliest_chunk():
    """Each worker names the stores it skipped; vLLM's aggregate keeps each request's earliest chunk."""
    one = KVDepotWorkerMetadata(skipped={"r": 3, "s": 1})
    other = KVDepotWorkerMetadata(skipped={"r": 2, "t": 5})
    assert one.aggregate(other).skipped == {"r": 2, "s": 1, "t": 5}
