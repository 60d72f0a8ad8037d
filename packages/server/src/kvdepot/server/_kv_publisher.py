"""`kvdepot serve --kv-events ENDPOINT`: the RAM tier's changes as KV events, in vLLM's wire format.

For routers that understand a cache shared by a node's engines, and for operators. Each
chunk that becomes visible in RAM is a ``BlockStored``, each one evicted or cleared a
``BlockRemoved``, both with ``medium="CPU"`` and ``ownership="kvdepot"``. A chunk is named by its
kvdepot key (32 bytes, what `kvdepot.core` computes from the token ids under the engine's
namespace: see `Query`); the server never sees tokens, so ``token_ids`` is empty and
``block_size`` is 0. No salt is published: a key is a cryptographic digest that mixes the salt
in, so it says nothing of the tenant.

The wire is vLLM's (`vllm/distributed/kv_events.py`): a ZMQ PUB socket sends three frames per
batch (topic, sequence number as 8 big-endian bytes, payload), the payload a msgpack
``[ts, events, data_parallel_rank]`` of tagged maps (key ``"type"``). With a replay endpoint
(ROUTER), a subscriber that sees a gap sends the first sequence number it missed (8 bytes)
and gets every kept batch from there, then an end marker (sequence number -1, empty payload).

A reply to a replay request is one page: the kept batches from that number on, up to
`replay_page_bytes` of payload and `REPLAY_PAGE_BATCHES` batches (the first always), then the
end marker; a subscriber that wants more asks again from the number after the page's last, as
vLLM's subscribers do after a gap. A page is sent only when the peer has room for it in its
queue, so a peer that asks without reading gets nothing more (counted as ``unread``).

Bounds (each a flag of `kvdepot serve`, and a figure in /metrics): the loop only appends to a
queue of `MAX_PENDING` events (the oldest are dropped, and counted, if the publisher thread falls
behind); a batch holds at most `MAX_BATCH_EVENTS` events (`MAX_BATCH_BYTES`); a subscriber that
does not read holds at most ``subscriber_bytes`` queued (the PUB high-water mark, in batches;
past it ZMQ drops its batches, and it sees a gap); replay keeps the last batches up to
``replay_bytes`` and ``replay_batches``, and only with a replay endpoint; every tcp listener
takes at most ``max_connections`` connections (`CappedListener`); a subscription or a replay
request longer than any valid one (``ZMQ_MAXMSGSIZE``) disconnects its peer.

Subscriptions: the socket is an XPUB in manual mode (``ZMQ_XPUB_MANUAL``): libzmq applies no
subscription by itself, the publisher thread reads each one and applies, for its peer, only those
that can match what the server sends: prefixes of the topic, the empty one included. Every other
one (and any other message a peer sends) is dropped and counted, so the subscriptions that decide
where batches go hold at most ``len(topic) + 1`` distinct prefixes. libzmq still keeps a copy of
every subscription until its peer leaves, so a tcp peer that has sent more than
``subscriber_send_bytes`` is disconnected at the next refusal (`PeerBudget`).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import zmq

from kvdepot.core import KVDepotError
from kvdepot.server._errors import ServerArgumentError
from kvdepot.server._events import RAM, ChunkChange, Committed
from kvdepot.server._kv_listener import CappedListener
from kvdepot.server._kv_metrics import KVEventsCollector
from kvdepot.server._kv_peers import DEFAULT_SEND_BYTES, PeerBudget
from kvdepot.server._kv_replay import ReplayBuffer
from kvdepot.server._metrics_http import ListenerFigures
from kvdepot.transport import check_ipc_trusted, check_not_in_use, get_logger, is_loopback_tcp, secure_ipc_socket

log = get_logger(__name__)

#: Events waiting for the publisher thread; past this the oldest are dropped (and counted).
MAX_PENDING = 100_000
#: Events per published batch at most (one batch per loop pass otherwise): a full batch of
#: 32-byte keys encodes to about 40 KB, under `MAX_BATCH_BYTES`.
MAX_BATCH_EVENTS = 256
#: What one batch's payload may take at most: the unit of the subscriber's high-water mark.
MAX_BATCH_BYTES = 48 * 1024
#: How long the publisher gathers events after the first one before it sends them (seconds).
GATHER_S = 0.005
#: Batches kept for replay at most (and `DEFAULT_REPLAY_BYTES` of them at most).
REPLAY_BATCHES = 10_000
DEFAULT_REPLAY_BYTES = 64 << 20
#: Payload bytes of one reply to a replay request; and batches at most (the socket's high-water
#: mark fits two pages: libzmq sees what a peer read only every half mark).
DEFAULT_REPLAY_PAGE_BYTES = 256 << 10
REPLAY_PAGE_BATCHES = 32
REPLAY_HWM = 2 * (REPLAY_PAGE_BATCHES + 1) + 2
#: Replay requests answered per pass of the publisher thread, so that a flood of them never
#: holds back the events.
REPLAY_REQUESTS_PER_PASS = 64
#: What a subscriber that does not read may hold queued on the PUB socket (bytes; the high-water
#: mark is this many full batches).
DEFAULT_SUBSCRIBER_BYTES = 4 << 20
#: Connections each tcp listener (PUB, replay) takes at most; routers are few per node.
DEFAULT_MAX_CONNECTIONS = 64
#: The longest incoming frame: a replay request is 8 bytes; a subscription is a prefix of the
#: topic (longer ones match nothing). A peer that sends more is disconnected by libzmq.
REPLAY_MAX_FRAME = 64
MIN_SUBSCRIPTION_MAX_FRAME = 256
#: Incoming messages queued per peer (subscriptions, replay requests): few are ever needed.
RECEIVE_HWM = 16
#: Subscription messages the publisher thread reads per pass (it loops while more wait).
SUBSCRIPTIONS_PER_PASS = 256
_SUBSCRIBE, _UNSUBSCRIBE = b"\1", b"\0"  # the first byte of an XPUB's (un)subscription message
#: Milliseconds the publisher threads sleep at most when nothing happens (how late they see `close()`).
POLL_MS = 100
END_SEQ = (-1).to_bytes(8, "big", signed=True)
MEDIUM = "CPU"
OWNER = "kvdepot"


# The wire format of vLLM's events, declared here: the server never imports vLLM. Fields
# without a default are always sent (vLLM's decoder requires them); the rest are omitted.
class _Event(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


class BlockStored(_Event):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    ownership: str | None = None


class BlockRemoved(_Event):
    block_hashes: list[bytes]
    medium: str | None
    ownership: str | None = None


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved]
    data_parallel_rank: int | None = None


def default_topic() -> str:
    """``kv@node:<host name>@kvdepot``: llm-d's ``kv@<pod>@<model>`` form, for the node's shared cache."""
    return f"kv@node:{socket.gethostname()}@kvdepot"


class KVEventPublisher:
    """Publishes the index's RAM events on a PUB socket; call it with each batch of events (loop thread)."""

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str | None = None,
        max_pending: int = MAX_PENDING,
        replay_batches: int = REPLAY_BATCHES,
        replay_bytes: int = DEFAULT_REPLAY_BYTES,
        replay_page_bytes: int = DEFAULT_REPLAY_PAGE_BYTES,
        subscriber_bytes: int = DEFAULT_SUBSCRIBER_BYTES,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        subscriber_send_bytes: int = DEFAULT_SEND_BYTES,
    ) -> None:
        self.topic = default_topic() if topic is None else topic
        self._topic = self.topic.encode()
        self._pending: collections.deque[ChunkChange] = collections.deque(maxlen=max_pending)
        # Only a replay endpoint reads what is kept: without one, nothing is.
        self._replay_buffer = ReplayBuffer(replay_batches, replay_bytes) if replay_endpoint is not None else None
        self._page_bytes = replay_page_bytes
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.seq = 0  # the next batch's number
        self.dropped = 0
        self._gap = False  # events were dropped since the last batch: its number skips one
        self.published_events = 0
        self.replay_pages = 0
        self.replay_refused = {"bad_request": 0, "unread": 0}
        self.subscriptions_refused = 0  # subscriptions (and other messages) to the PUB socket not applied
        self.limits = {
            "max_connections": max_connections,
            "subscriber_bytes": subscriber_bytes,
            "replay_bytes": replay_bytes if replay_endpoint is not None else 0,
            "replay_page_bytes": replay_page_bytes,
            "subscriber_send_bytes": subscriber_send_bytes,
        }
        self._max_connections = max_connections
        self._listeners: dict[str, CappedListener] = {}
        self._context: zmq.Context[Any] = zmq.Context(io_threads=1)  # its own: closed with the publisher
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._woken = False
        self._replay: zmq.Socket[Any] | None = None
        try:
            self._pub = self._bind(zmq.XPUB, endpoint, "pub")
            pub_endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            self._peer_budget = (
                PeerBudget(int(pub_endpoint.rpartition(":")[2]), subscriber_send_bytes)
                if pub_endpoint.startswith("tcp://")
                else None
            )
            self._pub.setsockopt(zmq.SNDHWM, max(1, subscriber_bytes // MAX_BATCH_BYTES))
            if replay_endpoint is not None:
                self._replay = self._bind(zmq.ROUTER, replay_endpoint, "replay")
        except BaseException:
            self._close_sockets()
            raise
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay else None
        self._encoder = msgspec.msgpack.Encoder()
        self._thread = threading.Thread(target=self._run, name="kvdepot-kv-events", daemon=True)
        self._thread.start()
        self._cap_thread = threading.Thread(target=self._count_connections, name="kvdepot-kv-events-cap", daemon=True)
        self._cap_thread.start()
        log.info("kv_events_publishing", endpoint=self.endpoint, replay=self.replay_endpoint, topic=self.topic)

    def _bind(self, kind: int, endpoint: str, name: str) -> zmq.Socket[Any]:
        """A socket bound at ``endpoint``: an ipc path owner-only and never taken from a live
        process (as the server's own socket); a tcp address beyond loopback is allowed, with a
        warning (the events carry no salt and no tokens, but say what is cached); on tcp, at
        most `max_connections` connections."""
        path = Path(endpoint.removeprefix("ipc://")) if endpoint.startswith("ipc://") else None
        try:
            if path is not None:
                if str(path).startswith("@"):
                    raise ServerArgumentError("an abstract ipc socket cannot be made owner-only; give a path")
                check_ipc_trusted(path)
                check_not_in_use(path)
            elif endpoint.startswith("tcp://") and not is_loopback_tcp(endpoint):
                log.warning("kv_events_beyond_loopback", endpoint=endpoint)
        except (KVDepotError, OSError) as exc:
            message = getattr(exc, "message", str(exc))
            raise ServerArgumentError(f"cannot publish KV events on {endpoint}: {message}", endpoint=endpoint) from exc
        sock: zmq.Socket[Any] = self._context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
        if kind == zmq.ROUTER:
            sock.setsockopt(zmq.MAXMSGSIZE, REPLAY_MAX_FRAME)
            sock.setsockopt(zmq.SNDHWM, REPLAY_HWM)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full peer raises: its page is not sent
        else:
            sock.setsockopt(zmq.MAXMSGSIZE, max(MIN_SUBSCRIPTION_MAX_FRAME, len(self._topic) + 1))
            sock.setsockopt(zmq.XPUB_MANUAL, 1)  # subscriptions come to `_take_subscriptions`
        try:
            if endpoint.startswith("tcp://"):
                self._listeners[name] = CappedListener(self._context, sock, endpoint, self._max_connections, name)
            else:
                sock.bind(endpoint)
        except (zmq.ZMQError, ServerArgumentError) as exc:
            sock.close(linger=0)
            if isinstance(exc, ServerArgumentError):
                raise
            raise ServerArgumentError(f"cannot publish KV events on {endpoint}: {exc}", endpoint=endpoint) from exc
        if path is not None:
            secure_ipc_socket(path)  # its directory is owner-only already (check_ipc_trusted)
        return sock

    def take(self, events: Sequence[ChunkChange]) -> None:
        """Queue the RAM tier's events (loop thread); the publisher thread turns them into
        vLLM's and sends them. Past `max_pending` the oldest are dropped: the next batch then
        skips a sequence number, so subscribers see a gap (that replay cannot fill)."""
        ram = [event for event in events if event.tier == RAM]
        if not ram:
            return
        with self._lock:
            room = (self._pending.maxlen or 0) - len(self._pending)
            if len(ram) > room:
                self.dropped += len(ram) - room
                self._gap = True
            self._pending.extend(ram)
        self._wake()

    def _wake(self) -> None:
        if not self._woken:
            self._woken = True
            with contextlib.suppress(BlockingIOError):  # a full pipe wakes it as well
                os.write(self._wake_w, b"\0")

    def figures(self) -> dict[str, int]:
        figures = {
            "kv_events_batches": self.seq,
            "kv_events_sent": self.published_events,
            "kv_events_dropped": self.dropped,
            "kv_events_replay_buffer_bytes": self._replay_buffer.bytes if self._replay_buffer is not None else 0,
            "kv_events_replay_pages": self.replay_pages,
            "kv_events_subscriptions_refused": self.subscriptions_refused,
            "kv_events_subscribers_cut": self._peer_budget.cut if self._peer_budget is not None else 0,
        }
        for reason, count in self.replay_refused.items():
            figures[f"kv_events_replay_refused_{reason}"] = count
        for name, listener in self._listeners.items():
            figures[f"kv_events_{name}_connections"] = listener.connections
            figures[f"kv_events_{name}_accepted"] = listener.accepted
            figures[f"kv_events_{name}_full"] = listener.full
        return figures

    def collector(self) -> KVEventsCollector:
        """A prometheus-client collector of this publisher's figures, for the server's registry;
        its ``listeners`` are the tcp listeners' figures, shown as ``kvdepot_listener_*``
        (``kv_events_pub``, ``kv_events_replay``)."""
        return KVEventsCollector(self)

    def listener_figures(self) -> dict[str, Callable[[], ListenerFigures]]:
        """Each tcp listener's figures now, by its name in /metrics."""
        return {
            f"kv_events_{name}": functools.partial(_figures, listener) for name, listener in self._listeners.items()
        }

    def close(self) -> None:
        """Stop; what is queued is sent first."""
        self._stop.set()
        self._wake()
        self._thread.join(timeout=5.0)
        self._cap_thread.join(timeout=5.0)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (getattr(self, "_pub", None), self._replay):
            if sock is not None:
                sock.close(linger=0)
        for listener in self._listeners.values():
            listener.close()  # after its ZMQ socket: libzmq no longer polls the listening socket
        self._context.term()
        os.close(self._wake_r)
        os.close(self._wake_w)

    # -- the connection counter's thread -------------------------------------------------------

    def _count_connections(self) -> None:
        poller = zmq.Poller()
        by_monitor = {listener.monitor: listener for listener in self._listeners.values()}
        for monitor in by_monitor:
            poller.register(monitor, zmq.POLLIN)
        while by_monitor and not self._stop.is_set():
            for monitor, _ in poller.poll(POLL_MS):
                with contextlib.suppress(zmq.Again):
                    while True:
                        by_monitor[monitor].on_monitor_event(monitor.recv_multipart(zmq.NOBLOCK))

    # -- the publisher thread ---------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        poller.register(self._pub, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while not self._stop.is_set():
            ready = dict(poller.poll(POLL_MS))
            if self._pub in ready:
                self._take_subscriptions()
            if self._replay is not None and self._replay in ready:
                self._serve_replays()
            if self._wake_r not in ready:
                continue
            # Gather what the loop's next requests add: fewer, larger batches cost the loop less
            # (each wake and send takes the GIL from it) and delay an event by milliseconds at most.
            self._stop.wait(GATHER_S)
            os.read(self._wake_r, 4096)
            self._woken = False
            while batch := self._take():
                self._send(batch)
        while batch := self._take():  # closing: what the loop queued last
            self._send(batch)

    def _take(self) -> list[BlockStored | BlockRemoved]:
        with self._lock:
            count = min(len(self._pending), MAX_BATCH_EVENTS)
            taken = [self._pending.popleft() for _ in range(count)]
            if self._gap and taken:
                self._gap = False
                self.seq += 1  # a number no batch has: the subscriber sees that it missed events
        return [
            BlockStored([e.key], None, [], 0, None, MEDIUM, None, OWNER)
            if isinstance(e, Committed)
            else BlockRemoved([e.key], MEDIUM, OWNER)
            for e in taken
        ]

    def _send(self, events: list[BlockStored | BlockRemoved]) -> None:
        payload = self._encoder.encode(EventBatch(time.time(), events))
        seq = self.seq.to_bytes(8, "big")
        try:  # PUB does not block: a subscriber at its high-water mark misses the batch, and replays it
            self._pub.send_multipart((self._topic, seq, payload), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass
        except zmq.ZMQError as exc:  # never ends the thread: the batch stays in replay
            log.warning("kv_events_send_failed", error=str(exc), seq=self.seq)
        if self._replay_buffer is not None:
            self._replay_buffer.append(self.seq, payload)
        self.seq += 1
        self.published_events += len(events)

    def _take_subscriptions(self) -> None:
        """Apply, for the peer that sent it, each subscription that is a prefix of the topic (and
        each such unsubscription); count the rest, which libzmq then never matches against, and
        disconnect the tcp peers past their bytes."""
        refused = self.subscriptions_refused
        for _ in range(SUBSCRIPTIONS_PER_PASS):
            try:
                message = self._pub.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            kind, prefix = message[:1], message[1:]
            applies = self._topic.startswith(prefix)
            # For the last message's peer (none once it has left: libzmq then ignores the option).
            if kind == _SUBSCRIBE and applies:
                self._pub.setsockopt(zmq.SUBSCRIBE, prefix)
            elif kind == _UNSUBSCRIBE:
                if applies:  # any other was never applied
                    self._pub.setsockopt(zmq.UNSUBSCRIBE, prefix)
            else:
                self.subscriptions_refused += 1
        if self.subscriptions_refused != refused and self._peer_budget is not None:
            self._peer_budget.enforce()

    def _serve_replays(self) -> None:
        assert self._replay is not None
        for _ in range(REPLAY_REQUESTS_PER_PASS):
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._serve_replay(frames)

    def _serve_replay(self, frames: list[bytes]) -> None:
        """One page from the number asked for, then the end marker; nothing to a peer that has
        not read its last page (its queue is full)."""
        assert self._replay is not None
        assert self._replay_buffer is not None
        if len(frames) != 3 or len(frames[2]) != 8:
            self.replay_refused["bad_request"] += 1
            log.warning("kv_events_bad_replay_request", frames=len(frames))
            return
        client, _, first = frames
        page = self._replay_buffer.page(int.from_bytes(first, "big"), self._page_bytes, REPLAY_PAGE_BATCHES)
        try:
            for seq, payload in page:
                self._replay.send_multipart(
                    (client, b"", self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK
                )
            self._replay.send_multipart((client, b"", b"", END_SEQ, b""), flags=zmq.NOBLOCK)
        except zmq.Again:
            self.replay_refused["unread"] += 1
        except zmq.ZMQError:  # EHOSTUNREACH: the peer left
            pass
        else:
            self.replay_pages += 1


def _figures(listener: CappedListener) -> ListenerFigures:
    """A KV-events listener in /metrics: it refuses by a socket filter, so what it counts as
    ``full`` is the times it reached its cap and began refusing, not connections refused."""
    return ListenerFigures(listener.connections, listener.cap, dict(listener.refused))
