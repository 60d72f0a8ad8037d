"""KV events end to end: real vLLM engines with ``kv_events_config`` and kvdepot, read by a real
ZMQ SUB socket and decoded with vLLM's own event classes, and the server's own publisher.

A router's index is rebuilt from each stream by the rules routers apply (a stored block is
kept only if its parent is known and its tokens are there), and checked against what the
server holds after each step: a store, a hit in a second engine, a clear, evictions, a server
restart.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from _pauses import Pauses, until

import kvdepot.server
import kvdepot.transport

pytestmark = [pytest.mark.vllm, pytest.mark.engine, pytest.mark.integration]

CHUNK = 256  # tokens per chunk: two CPU blocks of 128
BLOCK = 128
LENGTH = 1100  # four full chunks and a tail
SHORT = 100  # a prompt shorter than a chunk: it stores nothing, its steps let the engine publish
STEPS = 48  # tokens generated per prompt: engine steps in which the connector reads the server's changes


def prompt(seed: int, length: int = LENGTH) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 2000) for _ in range(length)]


class Subscriber:
    """A real ZMQ SUB socket on an events endpoint, decoding every batch with vLLM's classes."""

    def __init__(self, endpoint: str) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self._socket = zmq.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.connect(endpoint)
        self.batches: list[tuple[bytes, int, Any]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._socket.poll(50):
                topic, seq, payload = self._socket.recv_multipart()
                with self._lock:
                    self.batches.append((topic, int.from_bytes(seq, "big"), self._decoder.decode(payload)))

    def events(self) -> list[Any]:
        with self._lock:
            return [event for _, _, batch in self.batches for event in batch.events]

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._socket.close(linger=0)


class RouterIndex:
    """What a router would believe kvdepot holds, rebuilt from one stream: llm-d's rules."""

    def __init__(self) -> None:
        self.known: set[Any] = set()  # every block hash ever stored, any medium: possible parents
        # block hash -> its tokens, in kvdepot's RAM ("CPU") and in the tiers below it ("STORAGE")
        self.media: dict[str, dict[Any, tuple[int, ...]]] = {"CPU": {}, "STORAGE": {}}
        self.orphans = 0
        self.cleared_all = 0
        self.removed = 0

    @property
    def cpu(self) -> dict[Any, tuple[int, ...]]:
        return self.media["CPU"]

    def apply(self, events: list[Any]) -> RouterIndex:
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        for event in events:
            if isinstance(event, BlockStored):
                whole = len(event.token_ids) == event.block_size * len(event.block_hashes)
                if not whole or (event.parent_block_hash is not None and event.parent_block_hash not in self.known):
                    self.orphans += 1
                    continue
                for i, block in enumerate(event.block_hashes):
                    self.known.add(block)
                    if event.medium in self.media:
                        assert event.ownership == "kvdepot"
                        tokens = tuple(event.token_ids[i * event.block_size : (i + 1) * event.block_size])
                        self.media[event.medium][block] = tokens
            elif isinstance(event, BlockRemoved) and event.medium in self.media:
                for block in event.block_hashes:
                    self.removed += self.media[event.medium].pop(block, None) is not None
            elif isinstance(event, AllBlocksCleared):
                self.cleared_all += 1
        return self

    def chunks(self, medium: str = "CPU") -> int:
        assert len(self.media[medium]) % (CHUNK // BLOCK) == 0
        return len(self.media[medium]) // (CHUNK // BLOCK)

    def holds(self, tokens: list[int], medium: str = "CPU") -> int:
        """How many of the prompt's chunks the index says kvdepot holds in ``medium``."""
        blocks = set(self.media[medium].values())
        return sum(
            all(tuple(tokens[b * BLOCK : (b + 1) * BLOCK]) in blocks for b in range(c * 2, c * 2 + 2))
            for c in range(len(tokens) // CHUNK)
        )


def settled(events: Subscriber, done: Any) -> RouterIndex:
    """The index rebuilt from the stream once `done(index)` holds. The engine keeps stepping while
    paused (`busy_prompt`) and announces a change one or two steps after it, through vLLM's
    publisher thread: the stream is read again until it says what is expected (or the wait's bound)."""
    last: list[RouterIndex] = []

    def probe() -> bool:
        last[:] = [RouterIndex().apply(events.events())]
        return bool(done(last[0]))

    with contextlib.suppress(AssertionError):
        until(probe, "")
    return last[0]


@pytest.fixture
def workdir(short_tmp: Path) -> Path:
    return short_tmp


def events_config(endpoint: str) -> dict[str, Any]:
    return {"engine_kwargs": {"kv_events_config": {"enable_kv_cache_events": True, "endpoint": endpoint}}}


@pytest.fixture
def subscribers() -> Iterator[list[Subscriber]]:
    made: list[Subscriber] = []
    yield made
    for sub in made:
        sub.close()


@pytest.fixture
def node(workdir: Path, subscribers: list[Subscriber]) -> Iterator[Any]:
    """`node(*serve_args)`: a real `kvdepot serve` in `workdir` (stopped at the end), the connector
    config that reaches it, and two engines' event endpoints (``a``, ``b``) with a subscriber each."""
    servers: list[kvdepot.server.ServerProcess] = []

    def start(*args: str) -> tuple[kvdepot.server.ServerProcess, dict[str, Any], dict[str, tuple[str, Subscriber]]]:
        server = kvdepot.server.ServerProcess(
            f"ipc://{workdir}/kvdepot.sock",
            capacity="256MiB",
            args=["--no-metrics", *args],
            log_path=workdir / "server.log",
        )
        servers.append(server)
        server.start()
        config = {
            "kv_connector": "KVDepotConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"kvdepot.address": server.address},
        }
        streams = {}
        for name in ("a", "b"):
            endpoint = f"ipc://{workdir}/{name}-events"
            subscribers.append(Subscriber(endpoint))
            streams[name] = (endpoint, subscribers[-1])
        return server, config, streams

    yield start
    for server in servers:
        server.stop()


def test_engine_streams_say_what_kvdepot_holds(tiny_llama, vllm_engine, node, tmp_path):
    """Store, hit in a second engine, clear, evictions and a server restart, each checked against the
    server: the index a router rebuilds from the engine's stream holds exactly the server's chunks."""
    quota = 6  # chunks a salt may hold: the fourth prompt of four chunks evicts
    server, config, streams = node()
    (a_events, a), (b_events, b) = streams["a"], streams["b"]
    short = prompt(99, SHORT)
    first, others = prompt(1), [prompt(2), prompt(3), prompt(4)]
    prompts = [first, short, short, *others, short, short, short]
    pauses = Pauses(tmp_path / "engines")
    run = {
        "max_tokens": STEPS,
        "kv_transfer_config": config,
        "pause_after": {1: "stored", 2: "cleared", 6: "evicted", 8: "restarted"},
        "busy_prompt": short,
        **events_config(a_events),
    }
    with ThreadPoolExecutor(1) as pool:
        engine_a = pool.submit(vllm_engine, tiny_llama, prompts, **run)

        # 1. A store: every chunk of the first prompt, as the server holds them.
        pauses.wait("stored")
        index = settled(a, lambda i: i.chunks() == LENGTH // CHUNK)
        assert server.stats().chunks == LENGTH // CHUNK
        assert index.chunks() == LENGTH // CHUNK
        assert index.holds(first) == LENGTH // CHUNK
        assert index.orphans == 0  # each chunk's parent block was announced before it

        # 2. A hit in a second engine: its own stream announces what it can load from kvdepot.
        second = vllm_engine(
            tiny_llama, [first], max_tokens=STEPS, kv_transfer_config=config, **events_config(b_events)
        ).check()
        assert second.num_cached_tokens == [(LENGTH // CHUNK) * CHUNK]
        assert settled(b, lambda i: i.holds(first) == LENGTH // CHUNK).holds(first) == LENGTH // CHUNK

        # 3. A clear (an operator's, through the admin request): removals, never AllBlocksCleared.
        client = kvdepot.transport.CacheClient(server.address)
        chunk_bytes = server.stats().used_bytes // server.stats().chunks
        assert client.clear().result(10).removed == LENGTH // CHUNK
        client.set_quota("", quota * chunk_bytes).result(10)
        client.close()
        pauses.go("stored")
        pauses.wait("cleared")
        index = settled(a, lambda i: i.chunks() == 0)
        assert server.stats().chunks == 0
        assert index.chunks() == 0
        assert index.removed == LENGTH // CHUNK * 2
        assert index.cleared_all == 0

        # 4. Evictions: three more prompts under a quota of six chunks.
        pauses.go("cleared")
        pauses.wait("evicted")
        held = server.stats().chunks
        index = settled(a, lambda i: i.chunks() == held and i.holds(others[0]) == 0)
        assert held == quota
        assert index.chunks() == held
        assert index.holds(others[-1]) == LENGTH // CHUNK  # the newest stay, the oldest went
        assert index.holds(others[0]) == 0

        # 5. A server restart that lost its RAM (its kept pool removed, as after a reboot): the engine
        # notices and removes what it announced.
        server.stop()
        assert server.remove_kept_pool()
        server.start()
        pauses.go("evicted")
        pauses.wait("restarted")
        index = settled(a, lambda i: i.chunks() == 0)
        assert server.stats().chunks == 0
        assert index.chunks() == 0
        assert index.cleared_all == 0
        pauses.go("restarted")
        engine_a.result().check()
    for sub in (a, b):  # every batch of a stream, in order and without a gap
        seqs = [seq for _, seq, _ in sub.batches]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))


def test_chunks_that_leave_ram_for_the_disk_tier_are_announced_as_storage(
    tiny_llama, vllm_engine, workdir, node, tmp_path
):
    """RAM cleared, the disk tier keeps the chunks: the engine's stream moves them from CPU to
    STORAGE; a second engine that reads them back announces them in RAM again."""
    server, config, streams = node("--disk-dir", str(workdir / "disk"), "--disk-capacity", "1GiB")
    (a_events, a), (b_events, b) = streams["a"], streams["b"]
    first, short = prompt(11), prompt(98, SHORT)
    pauses = Pauses(tmp_path / "engines")
    run = {
        "max_tokens": STEPS,
        "kv_transfer_config": config,
        "pause_after": {1: "stored", 3: "moved"},
        "busy_prompt": short,
    }
    with ThreadPoolExecutor(1) as pool:
        engine_a = pool.submit(vllm_engine, tiny_llama, [first, short, short, short], **run, **events_config(a_events))
        pauses.wait("stored")
        deadline = time.monotonic() + 60
        while server.stats().extra.get("tier:disk:objects") != LENGTH // CHUNK:
            assert time.monotonic() < deadline, "the chunks never reached the disk tier"
            time.sleep(0.1)
        index = settled(a, lambda i: i.holds(first) == LENGTH // CHUNK)
        assert index.holds(first) == LENGTH // CHUNK
        assert index.chunks("STORAGE") == 0  # in RAM: announced there alone
        with kvdepot.transport.CacheClient(server.address) as client:
            assert client.clear().result(10).removed == LENGTH // CHUNK  # RAM only: the disk keeps them
        pauses.go("stored")
        pauses.wait("moved")
        index = settled(a, lambda i: i.chunks() == 0 and i.chunks("STORAGE") == LENGTH // CHUNK)
        assert index.chunks() == 0
        assert index.holds(first, "STORAGE") == LENGTH // CHUNK
        assert index.chunks("STORAGE") == LENGTH // CHUNK
        second = vllm_engine(
            tiny_llama, [first], max_tokens=STEPS, kv_transfer_config=config, **events_config(b_events)
        ).check()
        assert second.num_cached_tokens == [(LENGTH // CHUNK) * CHUNK]  # read back from the disk
        assert settled(b, lambda i: i.holds(first) == LENGTH // CHUNK).holds(first) == LENGTH // CHUNK
        pauses.go("moved")
        engine_a.result().check()
