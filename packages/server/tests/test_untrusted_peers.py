"""What a peer that needs no secret can make a real `kvdepot serve` do (issue 45): the work of a
`changes` request is bounded by its message's budget, and Stats names no tenant's salt to it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq

from kvdepot.core import SaltLabeler, salt_label
from kvdepot.server import ServerProcess
from kvdepot.server._change_log import CHANGE_WORK_BYTES
from kvdepot.server.testing import free_port
from kvdepot.transport import PROTOCOL_VERSION, CacheClient, LookupItem
from kvdepot.transport._codec import decode_reply, encode_request
from kvdepot.transport._dispatch import MAX_FRAMES_PER_MESSAGE, MAX_MESSAGE_BYTES
from kvdepot.transport._flood import MAX_BAD_FRAMES
from kvdepot.transport._messages import (
    MAX_CHANGES_PER_REPLY,
    Changes,
    ChangesReply,
    ErrorReply,
    Hello,
    HelloReply,
    Ping,
    Pong,
    Request,
)

pytestmark = pytest.mark.integration

T = 10.0
#: How long a reply to one hostile message is waited for: on the code before the fix, a message
#: of `changes` frames held the loop for seconds (3.7 s on the issue's machine).
HOSTILE_REPLY_S = 120.0
TENANT = "tenant-42"


@pytest.fixture
def server(short_tmp: Path) -> Iterator[ServerProcess]:
    """A server over ipc (every peer is its owner) with a pool of small chunks."""
    args = ["--no-metrics", "--page-size", "1MiB", "--pool-dir", str(short_tmp)]
    with ServerProcess(f"ipc://{short_tmp}/kvd.sock", capacity="8MiB", args=args) as proc:
        yield proc


def _churn(client: CacheClient, chunks: int) -> int:
    """Commits ``chunks`` one-byte chunks (the pool evicts as it fills); the change numbering's head."""
    client.register("tiny", 256, 1).result(T)
    for _ in range(chunks // 1024):
        res = client.reserve("", [os.urandom(32) for _ in range(1024)], 1).result(T)
        client.commit(res.reservation_id).result(T)
    return int(client.changes(0, [""]).result(T).next)


def _raw_peer(address: str) -> zmq.Socket:
    """A DEALER that said Hello (it needs nothing else to send `changes`)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    sock.send(encode_request(Request(1, Hello(PROTOCOL_VERSION, os.urandom(16).hex(), "hostile"))))
    assert sock.poll(int(T * 1000)), "no reply to Hello"
    assert isinstance(decode_reply(sock.recv()).body, HelloReply)
    return sock


def test_a_message_of_changes_frames_does_a_bounded_amount_of_work(server):
    """A message of 4,095 `changes` frames each asking for the most changes (16,384) and a Ping: the
    frames whose reading would pass the message's work budget are answered `too_large` without
    being read (counted as `work_refused`); past `MAX_BAD_FRAMES` such refusals the peer is muted,
    the rest of its message read and dropped unanswered, and another client is served. The changes
    read for the whole message stay within the budget (it was 4,095 x 16,384 reads: seconds of
    loop). What the vLLM connector sends each poll (a `changes` of 4,096 per group of salts, with
    queries, in one message) still fits: every part of it is answered."""
    limit = MAX_CHANGES_PER_REPLY
    with CacheClient(server.address, timeout=T) as client:
        head = _churn(client, 2 * limit)
        muted_before = client.stats().result(T).extra.get("transport_peers_muted", 0)
    assert head > limit  # every frame below reads `limit` changes
    sock = _raw_peer(server.address)
    try:
        frames = [
            encode_request(Request(i + 2, Changes(head - limit, ["not-a-tenant"], limit=limit)))
            for i in range(MAX_FRAMES_PER_MESSAGE - 1)
        ]
        frames.append(encode_request(Request(99_999, Ping())))
        sock.send_multipart(frames)
        assert sock.poll(int(HOSTILE_REPLY_S * 1000)), "no reply to the message"
        replies = [decode_reply(frame) for frame in sock.recv_multipart()]
    finally:
        sock.close(0)
    read = [r for r in replies if isinstance(r.body, ChangesReply)]
    refused = [r for r in replies if isinstance(r.body, ErrorReply)]
    assert all(r.body.next == head for r in read)  # each read all `limit` of them
    assert 1 <= len(read) <= MAX_MESSAGE_BYTES // (limit * CHANGE_WORK_BYTES) + 1  # the first is always read
    assert {r.body.code for r in refused} == {"too_large"}
    assert refused[0].body.fields["work"] == limit * CHANGE_WORK_BYTES
    assert len(read) + len(refused) == len(replies)
    assert len(refused) == MAX_BAD_FRAMES + 1  # then muted: the rest, the Ping too, unanswered
    with CacheClient(server.address, timeout=T) as other:
        assert isinstance(other.ping().result(T), Pong)
        assert other.stats().result(T).extra["transport_peers_muted"] == muted_before + 1

    with CacheClient(server.address, timeout=T) as engine:
        with engine.batch() as batch:
            futures = [batch.changes(head - 4096, [f"tenant-{i}", ""], limit=4096) for i in range(8)]
            query = batch.query([LookupItem("", [os.urandom(32)])])
        polled = [f.result(T) for f in futures]
        query.result(T)
        assert all(len(r.changes) == 4096 and r.next == head for r in polled)
    assert server.stats(T).extra["transport_work_refused"] == len(refused)


def _stats_text(address: str) -> tuple[dict[str, int], bytes]:
    with CacheClient(address, timeout=T) as client:
        client.register("layout", 256, 4096).result(T)
        res = client.reserve(TENANT, [os.urandom(32) for _ in range(3)], 4096).result(T)
        client.commit(res.reservation_id).result(T)
        stats = client.stats().result(T)
    return stats.salt_bytes, msgspec.json.encode(stats)


def test_stats_names_salts_only_by_label_to_a_peer_that_may_not_be_the_owner(short_tmp, server):
    """Over tcp without a shared secret (any local user may connect), Stats lists each tenant by the
    keyed label /metrics uses (not its unkeyed digest), and its salt appears nowhere in the reply;
    over the owner-only ipc socket, it still names the salt (`kvdepot stats` for the operator)."""
    address = f"tcp://127.0.0.1:{free_port()}"
    key_file = short_tmp / "label.key"
    args = ["--no-metrics", "--pool-dir", str(short_tmp), "--label-key-file", str(key_file)]
    with ServerProcess(address, capacity="4MiB", args=args) as proc:
        salt_bytes, text = _stats_text(proc.address)
    assert list(salt_bytes) == [SaltLabeler(key_file.read_bytes())(TENANT)]  # keyed: no guess reverses it
    assert salt_label(TENANT) not in text.decode()
    assert TENANT.encode() not in text
    salt_bytes, _ = _stats_text(server.address)
    assert list(salt_bytes) == [TENANT]
