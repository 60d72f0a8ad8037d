"""Fuzzing the server side with bad frames while a well-behaved client keeps being served."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvdepot.transport as t
from kvdepot.transport._dispatch import Dispatcher
from kvdepot.transport.testing import DictHandler, MemoryPair, TransportPair, ZmqPair, hello_frame, key

pytestmark = [pytest.mark.timeout(180)]

MAX_FRAME = 2048
_VALID = [
    t.Request(11, t.Ping()),
    t.Request(12, t.Commit(987654, None)),  # unknown reservation
    t.Request(13, t.Abort(1 << 40)),
    t.Request(14, t.Release([5, 6, 7])),  # unknown leases
    t.Request(15, t.Lookup([t.LookupItem("s", [key(1)])])),  # not registered
    t.Request(16, t.Stats()),
    t.Request(17, t.SetQuota("s", 10)),
]
_VALID_FRAMES = [t.encode_request(r) for r in _VALID]


def _wrong_types(rng: random.Random) -> bytes:
    shapes = [
        [1, {"type": "abort", "reservation_id": "seven"}],
        [1, {"type": "lookup", "items": [["salt", [b"short"]]]}],
        [1, {"type": "no_such_request"}],
        [-1, {"type": "ping"}],
        [1 << 64 - 1, {"type": "ping"}],
        {"id": 1, "body": {"type": "ping"}},
        [1, {"type": "reserve", "salt": 5, "keys": [], "chunk_bytes": 1}],
        [1, {"type": "commit", "reservation_id": 1, "indices": [-4]}],
        [1, [1, 2, 3]],
        [1, None],
        "just a string",
    ]
    return msgspec.msgpack.encode(rng.choice(shapes))


def make_frame(rng: random.Random) -> bytes:
    """One bad (or valid but unwelcome) frame of a random kind."""
    kind = rng.randrange(10)
    if kind == 0:
        return rng.randbytes(rng.randrange(0, 200))
    if kind == 1:
        frame = rng.choice(_VALID_FRAMES)
        return frame[: rng.randrange(0, len(frame))]
    if kind == 2:
        frame = bytearray(rng.choice(_VALID_FRAMES))
        frame[rng.randrange(len(frame))] = rng.randrange(256)
        return bytes(frame)
    if kind == 3:
        return hello_frame(rng.randrange(1, 1000), "fuzz", version=rng.choice([0, 2, 99, -1 & 0xFFFF]))
    if kind == 4:
        return rng.randbytes(rng.randrange(MAX_FRAME + 1, 3 * MAX_FRAME))  # oversized
    if kind == 5:
        return _wrong_types(rng)
    if kind == 6:
        return b"\x91" * rng.randrange(1, 3000) + b"\xc0"  # deep nesting
    if kind == 7:
        return t.encode_reply(t.Reply(rng.randrange(100), t.Pong()))  # a reply, not a request
    return rng.choice(_VALID_FRAMES)  # valid frames with unknown ids or unregistered


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.one_of(st.binary(max_size=64), st.integers(0, 1 << 30).map(lambda s: make_frame(random.Random(s)))),
        min_size=1,
        max_size=25,
    )
)
def test_dispatcher_answers_every_frame(frames: list[bytes]) -> None:
    """Any list of frames gets exactly as many decodable replies, and a Ping still gets a Pong after."""
    d = Dispatcher(DictHandler(), clock=lambda: 0.0, max_frame_bytes=MAX_FRAME)
    d.dispatch(b"peer", [hello_frame(1, "peer")])
    replies = d.dispatch(b"peer", frames)
    assert len(replies) == len(frames)
    for reply in replies:
        t.decode_reply(reply)
    (pong,) = d.dispatch(b"peer", [t.encode_request(t.Request(99, t.Ping()))])
    assert t.decode_reply(pong) == t.Reply(99, t.Pong())


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("make_pair", [MemoryPair, ZmqPair], ids=["memory", "ipc"])
def test_endpoint_survives_ten_thousand_bad_frames(make_pair: Callable[[], TransportPair]) -> None:
    """10,000 bad frames get one reply each while a good client keeps getting correct answers
    (with the bad-frame bound off: at it, a peer is muted, `test_bad_frames_past_the_bound_mute_the_peer`)."""
    rng = random.Random(1234)
    with make_pair() as pair:
        endpoint = pair.start_server(DictHandler(), max_frame_bytes=MAX_FRAME, limits=t.PeerLimits(bad_frames=0))
        good = pair.client()
        good.register("fp", 256, 4096).result(5)
        stop = threading.Event()
        good_errors: list[BaseException] = []
        good_count = [0]

        def well_behaved() -> None:
            i = 0
            while not stop.is_set():
                i += 1
                try:
                    quotas = good.set_quota(f"g{i % 50}", i).result(5).quotas
                    assert quotas[f"g{i % 50}"] == i
                    good_count[0] += 1
                except BaseException as exc:
                    good_errors.append(exc)
                    return

        worker = threading.Thread(target=well_behaved)
        worker.start()
        greeted, stranger = pair.raw_peer(), pair.raw_peer()
        greeted.send([hello_frame(1, "fuzzer")])
        assert greeted.recv(5) is not None
        sent = 0
        try:
            while sent < 10_000:
                peer = greeted if rng.random() < 0.8 else stranger
                frames = [make_frame(rng) for _ in range(rng.randrange(1, 40))]
                peer.send(frames)
                replies = peer.recv(5)
                assert replies is not None, f"no reply after {sent} frames"
                assert len(replies) == len(frames)
                for reply in replies:
                    t.decode_reply(reply)
                sent += len(frames)
        finally:
            stop.set()
            worker.join(10)
        assert not good_errors, good_errors
        assert good_count[0] > 0
        assert endpoint.counters["bad_frames"] > 1000
        assert isinstance(good.ping().result(5), t.Pong)


@pytest.mark.integration
def test_bad_frames_past_the_bound_mute_the_peer(monkeypatch) -> None:
    """A peer that sends more frames that are not requests than `PeerLimits.bad_frames` allows gets
    replies up to the frame past the bound and none after it: it is muted, its messages discarded
    unread (`bad_discarded`), its session ended (`peers_muted`); a good client is served throughout."""
    import time

    monkeypatch.setattr("kvdepot.transport._server.BAD_MUTE_S", 3600.0)  # muted for the whole test
    with ZmqPair() as pair:
        endpoint = pair.start_server(DictHandler(), limits=t.PeerLimits(bad_frames=10))
        good = pair.client()
        good.register("fp", 256, 4096).result(5)
        peer = pair.raw_peer()
        peer.send([hello_frame(1, "fuzzer")])
        assert peer.recv(5) is not None
        peer.send([b"\x00"] * 100)
        replies = peer.recv(5)
        assert replies is not None
        assert len(replies) == 11  # the frames up to the one past the bound, each answered `protocol`
        peer.send([hello_frame(2, "fuzzer")])
        deadline = time.monotonic() + 10
        while endpoint.counters["bad_discarded"] < 1:  # muted: discarded unread
            assert time.monotonic() < deadline, "the muted peer's message was not discarded"
            time.sleep(0.05)
        assert peer.recv(0) is None
        assert good.set_quota("g", 1).result(5).quotas["g"] == 1
        counters = endpoint.counters
    assert counters["peers_muted"] == 1
    assert counters["bad_discarded"] == 1
    assert counters["peers_gone"] == 1  # the greeted peer's session ended
