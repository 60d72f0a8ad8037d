"""An engine's KV events and its server's /metrics name a tenant by one label (issue 45): the
server's keyed label, whose key the engine gets in the handshake. A real `kvdepot serve` and a
real client; the announcer alone (no engine)."""

from __future__ import annotations

import hashlib
import os
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from kvdepot.core import salt_label
from kvdepot.server import ServerProcess
from kvdepot.server.testing import free_port, metrics_salt_labels
from kvdepot.transport import CacheClient
from kvdepot.vllm_connector._kv_events import EventAnnouncer

pytestmark = pytest.mark.integration

T = 10.0
TENANT = "tenant-42"
BLOCK, CHUNK = 4, 8


def test_kv_events_and_metrics_give_a_salt_the_same_label(short_tmp):
    """A chunk the engine stored under a salt appears in /metrics and in the engine's
    `BlockStored` under one label, which is not the salt's unkeyed digest."""
    port = free_port()
    args = ["--page-size", "1MiB", "--pool-dir", str(short_tmp), "--metrics-port", str(port)]
    args += ["--label-key-file", str(short_tmp / "label.key")]
    with (
        ServerProcess(f"ipc://{short_tmp}/kvd.sock", capacity="4MiB", args=args) as proc,
        CacheClient(proc.address, timeout=T) as client,
    ):
        client.register("layout", CHUNK, 4096).result(T)
        key = os.urandom(32)
        res = client.reserve(TENANT, [key], 4096).result(T)
        client.commit(res.reservation_id).result(T)
        (metrics_label,) = metrics_salt_labels(f"http://127.0.0.1:{port}/metrics")
        events = EventAnnouncer(client, block_size=BLOCK, chunk_size=CHUNK)
        tokens = list(range(CHUNK))
        hashes = [hashlib.sha256(bytes([b])).digest() for b in range(CHUNK // BLOCK)]
        req = SimpleNamespace(block_hashes=hashes, all_token_ids=tokens, lora_request=None)
        events.hit(req, 0, [[key]], TENANT)  # type: ignore[arg-type]
        stored = events.take()
    assert stored[0].extra_keys[0] == (metrics_label,)
    assert metrics_label != salt_label(TENANT)
