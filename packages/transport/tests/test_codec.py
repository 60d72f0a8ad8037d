"""Unit tests of the messages and the frame codec."""

from __future__ import annotations

import contextlib

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvdepot.transport as t
from kvdepot.transport._dispatch import peek_id
from kvdepot.transport._messages import REPLY_TYPES, REQUEST_TYPES
from kvdepot.transport.testing import key

REQUESTS = [
    t.Hello(t.PROTOCOL_VERSION, "ab" * 16, "engine-0", ""),
    t.Register("fp", 256, 1 << 20, 2, 1, "model"),
    t.Lookup([t.LookupItem("salt", [key(1), key(2)]), t.LookupItem("", [])]),
    t.Lookup([t.LookupItem("salt", [key(1)])], prefill_s_per_chunk=0.004),
    t.Reserve("salt", [key(3)], 4096),
    t.Commit(7, None),
    t.Commit(7, [0, 2]),
    t.Abort(7),
    t.Release([1, 2, 3]),
    t.EndSession(),
    t.Stats(),
    t.Clear(None),
    t.Clear("salt"),
    t.Ping(),
    t.SetQuota("salt", 1 << 30),
    t.SetQuota("salt", None),
    t.GetQuotas(),
    t.Query([t.LookupItem("salt", [key(1), key(2)])]),
    t.Query([t.LookupItem("", [key(1)])], tiers=False),
    t.Changes(0, [""]),
    t.Changes(7, ["a", "b"], limit=10, server_id="srv"),
]
REPLIES = [
    t.HelloReply(1, "0.1.0", "srv"),
    t.RegisterReply(256, t.PoolInfo("shm_file", "/dev/shm/x", 1 << 30), 64),
    t.LookupReply([t.LookupResult(2, 9, [t.Slot(0, 10), t.Slot(10, 10)]), t.LookupResult(0, 0, [])]),
    t.ReserveReply(3, [t.ReservedSlot(1, 0, 4096)], [0], True),
    t.CommitReply(1),
    t.AbortReply(2),
    t.ReleaseReply(3),
    t.EndSessionReply(),
    t.StatsReply(capacity_bytes=1, salt_bytes={"a": 1}, extra={"x": 1.5}),
    t.ClearReply(4),
    t.Pong(),
    t.QuotaReply({"a": 1}),
    t.QueryReply([t.QueryResult(2, 3, {"disk": 3, "remote": 1}), t.QueryResult(0)]),
    t.ChangesReply([t.Change(True, 0, key(1)), t.Change(False, 1, key(2))], 9),
    t.ChangesReply([], 3, lost=True),
    t.ErrorReply("unknown_lease", "gone", {"lease_id": 4, "flag": True, "none": None}),
]


def test_every_request_type_has_an_example_and_a_reply_type() -> None:
    """The examples cover the whole closed set, and every request names its reply type."""
    assert {type(r) for r in REQUESTS} == set(REQUEST_TYPES)
    assert {type(r) for r in REPLIES} == set(REPLY_TYPES)
    assert set(t.REPLY_FOR) == set(REQUEST_TYPES)


@pytest.mark.parametrize("body", REQUESTS, ids=lambda b: type(b).__name__)
def test_request_round_trip(body: t.RequestBody) -> None:
    """Every request body survives encode and decode unchanged."""
    frame = t.encode_request(t.Request(5, body))
    assert t.decode_request(frame) == t.Request(5, body)


@pytest.mark.parametrize("body", REPLIES, ids=lambda b: type(b).__name__)
def test_reply_round_trip(body: t.ReplyBody) -> None:
    """Every reply body survives encode and decode unchanged."""
    assert t.decode_reply(t.encode_reply(t.Reply(5, body))) == t.Reply(5, body)


def test_decode_into_the_wrong_envelope_is_a_remote_protocol_error() -> None:
    """A reply frame where a request belongs is refused with its id and tag named."""
    frame = t.encode_reply(t.Reply(9, t.Pong()))
    with pytest.raises(t.RemoteProtocolError) as info:
        t.decode_request(frame)
    assert info.value.request_id == 9
    assert info.value.tag == "pong"


def test_size_is_checked_before_decoding() -> None:
    """An oversized frame raises FrameTooLargeError even when its bytes are garbage."""
    with pytest.raises(t.FrameTooLargeError) as info:
        t.decode_request(b"\xff" * 101, max_frame_bytes=100)
    assert (info.value.size, info.value.limit) == (101, 100)


def test_encoding_past_the_bound_fails_locally() -> None:
    """A request too large to send raises FrameTooLargeError with a hint, before any I/O."""
    with pytest.raises(t.FrameTooLargeError, match="split"):
        t.encode_request(t.Request(1, t.Reserve("s", [key(i) for i in range(100)], 1)), max_frame_bytes=1000)


@pytest.mark.parametrize("size", [0, 31, 33])
def test_keys_must_be_32_bytes(size: int) -> None:
    """Keys of any other length are refused while decoding."""
    frame = msgspec.msgpack.encode([1, {"type": "reserve", "salt": "", "keys": [b"k" * size], "chunk_bytes": 1}])
    with pytest.raises(t.RemoteProtocolError):
        t.decode_request(frame)


def test_negative_counts_are_refused() -> None:
    """Counts and ids are non-negative."""
    frame = msgspec.msgpack.encode([1, {"type": "abort", "reservation_id": -1}])
    with pytest.raises(t.RemoteProtocolError):
        t.decode_request(frame)


@pytest.mark.parametrize("value", [-0.001, 1e9, "fast"])
def test_an_impossible_prefill_estimate_is_refused(value: object) -> None:
    """A lookup's compute-time estimate is a number of seconds, at least 0 and at most an hour."""
    frame = msgspec.msgpack.encode([1, {"type": "lookup", "items": [], "prefill_s_per_chunk": value}])
    with pytest.raises(t.RemoteProtocolError):
        t.decode_request(frame)


def test_unknown_fields_are_refused_except_in_hello() -> None:
    """Bodies are strict, but a newer Hello still decodes so its version can be compared."""
    strict = msgspec.msgpack.encode([1, {"type": "abort", "reservation_id": 1, "new": 1}])
    with pytest.raises(t.RemoteProtocolError):
        t.decode_request(strict)
    newer = msgspec.msgpack.encode([1, {"type": "hello", "protocol_version": 9, "client_id": "x", "new": [1]}])
    assert t.decode_request(newer).body == t.Hello(9, "x")


def test_huge_claimed_lengths_do_not_allocate() -> None:
    """An array header claiming four billion items is refused as truncated."""
    with pytest.raises(t.RemoteProtocolError):
        t.decode_request(b"\x92\x01\x82\xa4type\xa6lookup\xa5items\xdd\xff\xff\xff\xff")


@pytest.mark.parametrize(("value", "frame_head"), [(5, b"\x92\x05"), (300, b"\x92\xcd\x01\x2c"), (1 << 40, None)])
def test_peek_id_reads_the_id_without_decoding(value: int, frame_head: bytes | None) -> None:
    """peek_id finds the id at the head of any envelope, whatever follows."""
    frame = t.encode_request(t.Request(value, t.Ping()))
    if frame_head is not None:
        assert frame.startswith(frame_head)
    assert peek_id(frame + b"garbage") == value
    assert peek_id(b"\x93\x05") == 0
    assert peek_id(b"") == 0


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_only_raise_protocol_errors(frame: bytes) -> None:
    """Whatever the bytes, decoding either succeeds or raises RemoteProtocolError."""
    with contextlib.suppress(t.RemoteProtocolError):
        t.decode_request(frame)


def test_messages_are_not_tracked_by_the_cyclic_gc() -> None:
    """Message structs hold no cycles; leaving them untracked keeps collections off the hot path."""
    import gc

    request = t.Request(1, t.Lookup([t.LookupItem("salt", [b"k" * 32])]))
    reply = t.decode_reply(t.encode_reply(t.Reply(1, t.LookupReply([t.LookupResult(1, 7, [t.Slot(0, 4096)])]))))
    for message in (request, request.body, request.body.items[0], reply, reply.body, reply.body.results[0]):
        assert not gc.is_tracked(message), type(message).__name__
