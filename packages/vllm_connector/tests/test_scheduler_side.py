"""The connector's scheduler half against a fake client: leases, batching, timeouts, failures.

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
from kvdepot.vllm_connector._meta import KVDepotWorkerMetadata
from kvdepot.vllm_connector._scheduler import SchedulerSide

BLOCK, CHUNK = 4, 8


class FakeClient:
    """Records lookups and releases; replies are resolved by the test."""

    server_id = "server-1"

    def __init__(self, fail: bool = False) -> None:
        self.lookups: list[tuple[list, Future]] = []
        self.released: list[int] = []
        self.fail = fail

    def lookup(self, items):
        if self.fail:
            raise ConnectionError("no server")
        future: Future = Future()
        self.lookups.append((list(items), future))
        return future

    def release(self, leases):
        self.released.extend(leases)
        done: Future = Future()
        done.set_result(None)
        return done


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
        preempted_req_ids=preempted,
    )


def side(client: FakeClient, timeout: float = 5.0) -> SchedulerSide:
    return SchedulerSide(
        Namespace(model="m"), block_size=BLOCK, chunk_size=CHUNK, client=client, lookup_timeout=timeout
    )


def test_lookups_of_a_step_go_in_one_message():
    """Two requests asking in one step share one Lookup message, sent at build_connector_meta."""
    client = FakeClient()
    s = side(client)
    a, b = request("a", 20), request("b", 12)
    assert s.get_num_new_matched_tokens(a, 0) == (None, False)
    assert s.get_num_new_matched_tokens(b, 0) == (None, False)
    assert client.lookups == []
    s.build_connector_meta(output())
    assert len(client.lookups) == 1
    items, future = client.lookups[0]
    assert [len(item.keys) for item in items] == [2, 1]
    future.set_result(reply((2, 11), (0, 0)))
    assert s.get_num_new_matched_tokens(a, 0) == (16, False)
    assert s.get_num_new_matched_tokens(b, 0) == (0, False)


def test_full_load_then_release_once():
    """A hit is planned for loading, and its lease is released once the workers report the load done."""
    client = FakeClient()
    s = side(client)
    a = request("a", 20)
    s.get_num_new_matched_tokens(a, 0)
    s.build_connector_meta(output())
    client.lookups[0][1].set_result(reply((2, 11)))
    assert s.get_num_new_matched_tokens(a, 0) == (16, False)
    s.update_state_after_alloc(a, [1, 2, 3, 4, 5], 16)
    meta = s.build_connector_meta(output(new=[("a", [1, 2, 3, 4, 5])], scheduled={"a": 4}))
    assert [op.req_id for op in meta.loads] == ["a"]
    assert meta.loads[0].slots == [[0, 64]]
    assert meta.loads[0].server_id == "server-1"
    assert client.released == []
    s.update_connector_output(SimpleNamespace(kv_connector_worker_meta=KVDepotWorkerMetadata(loaded={"a"})))
    assert client.released == [11]
    s.request_finished(a)
    assert client.released == [11]


def test_finish_with_lookup_in_flight_releases_the_late_lease():
    """A request that ends while its lookup is out gets the reply's lease released when it arrives."""
    client = FakeClient()
    s = side(client)
    a = request("a", 20)
    s.get_num_new_matched_tokens(a, 0)
    s.build_connector_meta(output())
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
    s.get_num_new_matched_tokens(a, 0)
    a.status = RequestStatus.FINISHED_ABORTED
    s.request_finished(a)
    s.build_connector_meta(output())
    assert client.lookups == []
    assert len(s.planner) == 0


def test_timeout_is_a_miss_and_the_late_lease_is_released():
    """A lookup that takes too long counts as a miss; a lease in its late reply is still released."""
    client = FakeClient()
    s = side(client, timeout=0.01)
    a = request("a", 20)
    s.get_num_new_matched_tokens(a, 0)
    s.build_connector_meta(output())
    time.sleep(0.02)
    assert s.get_num_new_matched_tokens(a, 0) == (0, False)
    client.lookups[0][1].set_result(reply((2, 31)))
    assert client.released == [31]
    assert s.stats.data["lookup_misses_timeout"] == 1


def test_unreachable_server_is_a_miss():
    """When the lookup cannot even be sent, the request goes on as a miss."""
    s = side(FakeClient(fail=True))
    a = request("a", 20)
    s.get_num_new_matched_tokens(a, 0)
    s.build_connector_meta(output())
    assert s.get_num_new_matched_tokens(a, 0) == (0, False)


def test_failed_load_releases_and_recomputes_from_vllms_count():
    """A load reported failed releases its lease and rolls the planner back to vLLM's computed tokens."""
    client = FakeClient()
    s = side(client)
    a = request("a", 24)
    s.get_num_new_matched_tokens(a, 0)
    s.build_connector_meta(output())
    client.lookups[0][1].set_result(reply((3, 41)))
    assert s.get_num_new_matched_tokens(a, 0) == (23, False)
    s.update_state_after_alloc(a, list(range(6)), 23)
    s.build_connector_meta(output(new=[("a", list(range(6)))], scheduled={"a": 1}))
    a.num_computed_tokens = 4  # vLLM truncated at the first failed block
    s.update_connector_output(SimpleNamespace(kv_connector_worker_meta=KVDepotWorkerMetadata(failed={"a"})))
    assert client.released == [41]
    tracker = s.planner.get("a")
    assert tracker.state is RequestState.READY
    assert tracker.num_computed_tokens == 4
    meta = s.build_connector_meta(output(cached=[("a", None)], scheduled={"a": 20}))
    assert [(op.req_id, len(op.keys[0])) for op in meta.stores] == [("a", 3)]


def test_preempted_request_looks_up_again():
    """A running request that comes back to the waiting queue is looked up again and can load."""
    client = FakeClient()
    s = side(client)
    a = request("a", 20)
    s.get_num_new_matched_tokens(a, 0)
    s.build_connector_meta(output())
    client.lookups[0][1].set_result(reply((0, 0)))
    s.get_num_new_matched_tokens(a, 0)
    s.update_state_after_alloc(a, list(range(5)), 0)
    meta = s.build_connector_meta(output(new=[("a", list(range(5)))], scheduled={"a": 20}))
    assert len(meta.stores) == 1
    s.build_connector_meta(output(preempted={"a"}))
    assert s.planner.get("a").state is RequestState.PREEMPTED
    assert s.get_num_new_matched_tokens(a, 0) == (None, False)
    s.build_connector_meta(output())
    assert len(client.lookups) == 2


def test_prompt_embeds_are_not_cached():
    """A request given as prompt embeddings has zero token ids: it is neither looked up nor stored."""
    client = FakeClient()
    s = side(client)
    e = request("e", 20, prompt_embeds=object())
    assert s.get_num_new_matched_tokens(e, 0) == (0, False)
    s.update_state_after_alloc(e, list(range(5)), 0)
    meta = s.build_connector_meta(output(new=[("e", list(range(5)))], scheduled={"e": 20}))
    assert client.lookups == []
    assert meta.stores == []


@pytest.mark.parametrize("restart", ["before_the_reply_is_read", "after_the_hit"])
def test_a_server_restart_drops_the_old_instances_leases(restart):
    """After a restart, a reply read late is a miss, and no old lease is released to the new instance."""
    client = FakeClient()
    s = side(client)
    a = request("a", 20)
    s.get_num_new_matched_tokens(a, 0)
    s.build_connector_meta(output())
    client.lookups[0][1].set_result(reply((2, 5)))
    if restart == "after_the_hit":
        assert s.get_num_new_matched_tokens(a, 0) == (16, False)
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
    s.get_num_new_matched_tokens(a, 0)
    s.build_connector_meta(output())
    client.lookups[0][1].set_result(reply((2, 5)))
    assert s.get_num_new_matched_tokens(a, 0) == (16, False)
    monkeypatch.setattr(_scheduler, "LEASE_REFRESH_S", 0.0)
    assert s.get_num_new_matched_tokens(a, 0) == (None, False)
    assert client.released == [5]
    s.build_connector_meta(output())
    assert len(client.lookups) == 2


def test_skip_reading_prefix_cache_is_stored_but_not_looked_up():
    """A request that must not read cached prefixes is not looked up, and its chunks are still stored."""
    client = FakeClient()
    s = side(client)
    a = request("a", 20)
    a.skip_reading_prefix_cache = True
    assert s.get_num_new_matched_tokens(a, 0) == (0, False)
    s.update_state_after_alloc(a, list(range(5)), 0)
    meta = s.build_connector_meta(output(new=[("a", list(range(5)))], scheduled={"a": 20}))
    assert client.lookups == []
    assert len(meta.stores) == 1
