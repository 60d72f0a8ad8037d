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

Bounds: the loop only appends to a queue of `MAX_PENDING` events (the oldest are dropped, and
counted, if the publisher thread falls behind); the PUB socket drops what a slow subscriber
cannot take at its high-water mark, as ZMQ does; replay keeps the last `REPLAY_BATCHES` batches.
"""

from __future__ import annotations

import collections
import contextlib
import socket
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import structlog
import zmq

from kvdepot.core import KVDepotError
from kvdepot.server._errors import ServerArgumentError
from kvdepot.server._events import RAM, ChunkChange, Committed
from kvdepot.transport import check_ipc_trusted, check_not_in_use, is_loopback_tcp, secure_ipc_socket

log = structlog.get_logger(__name__)

#: Events waiting for the publisher thread; past this the oldest are dropped (and counted).
MAX_PENDING = 100_000
#: Events per published batch at most (one batch per loop pass otherwise).
MAX_BATCH_EVENTS = 4096
#: How long the publisher gathers events after the first one before it sends them (seconds).
GATHER_S = 0.005
#: Batches kept for replay.
REPLAY_BATCHES = 10_000
#: The PUB socket's high-water mark (messages per subscriber), as vLLM's default.
PUB_HWM = 100_000
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
    ) -> None:
        self.topic = default_topic() if topic is None else topic
        self._topic = self.topic.encode()
        self._pending: collections.deque[ChunkChange] = collections.deque(maxlen=max_pending)
        self._replay_buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=replay_batches)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.seq = 0  # the next batch's number
        self.dropped = 0
        self._gap = False  # events were dropped since the last batch: its number skips one
        self.published_events = 0
        self._context: zmq.Context[Any] = zmq.Context.instance()
        self._pub = self._bind(zmq.PUB, endpoint)
        self._pub.setsockopt(zmq.SNDHWM, PUB_HWM)
        self._replay: zmq.Socket[Any] | None = None
        try:
            if replay_endpoint is not None:
                self._replay = self._bind(zmq.ROUTER, replay_endpoint)
                self._replay.setsockopt(zmq.SNDHWM, 2 * (replay_batches + 1))  # a whole replay and its end
        except BaseException:
            self._pub.close(linger=0)
            raise
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay else None
        self._encoder = msgspec.msgpack.Encoder()
        self._thread = threading.Thread(target=self._run, name="kvdepot-kv-events", daemon=True)
        self._thread.start()
        log.info("kv_events_publishing", endpoint=self.endpoint, replay=self.replay_endpoint, topic=self.topic)

    def _bind(self, kind: int, endpoint: str) -> zmq.Socket[Any]:
        """A socket bound at ``endpoint``: an ipc path owner-only and never taken from a live
        process (as the server's own socket); a tcp address beyond loopback is allowed, with a
        warning (the events carry no salt and no tokens, but say what is cached)."""
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
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise ServerArgumentError(f"cannot publish KV events on {endpoint}: {exc}", endpoint=endpoint) from exc
        if path is not None:
            secure_ipc_socket(path)  # its directory is owner-only already (check_ipc_trusted)
        return sock

    def __call__(self, events: Sequence[ChunkChange]) -> None:
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
        self._wake.set()

    def figures(self) -> dict[str, int]:
        return {
            "kv_events_batches": self.seq,
            "kv_events_sent": self.published_events,
            "kv_events_dropped": self.dropped,
        }

    def close(self) -> None:
        """Stop; what is queued is sent first."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5.0)
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)

    # -- the publisher thread ---------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while not self._stop.is_set():
            if self._replay is not None:
                with contextlib.suppress(zmq.ZMQError):
                    if poller.poll(0):
                        self._serve_replay()
            if not self._wake.wait(0.05):
                continue
            # Gather what the loop's next requests add: fewer, larger batches cost the loop less
            # (each wake and send takes the GIL from it) and delay an event by milliseconds at most.
            self._stop.wait(GATHER_S)
            self._wake.clear()
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
        self._replay_buffer.append((self.seq, payload))
        self.seq += 1
        self.published_events += len(events)

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("kv_events_bad_replay_request", frames=len(frames))
            return
        client, _, first = frames
        start = int.from_bytes(first, "big")
        for seq, payload in list(self._replay_buffer):
            if seq >= start:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
