"""Tiers below RAM in a real `kvdepot serve`: write-behind, read-through, restarts, sharing across
servers, a remote tier that dies and comes back, and corrupted objects (issue: tiers below RAM).

Chunk bytes are a function of their key, so every hit is checked byte for byte.
"""

from __future__ import annotations

import contextlib
import signal

import pytest
from _chunks import CHUNK, POOL, SMALL, T, extra, keys, lookup, payload, store, wait_for

from kvdepot.server import PoolMapping
from kvdepot.transport import CacheClient

# These tests restart a server to read chunks back from the tiers below: its pool is not kept,
# so the restarted server's RAM starts empty (tests/server/test_kept_pool.py keeps it).
POOL = [*POOL, "--no-keep-pool"]

pytestmark = pytest.mark.integration


def test_disk_tier_survives_a_sigkill_and_a_restart_hits_again(serve, workdir):
    """Chunks written behind to the disk tier are hits, byte for byte, for a server restarted on
    the same --disk-dir after a SIGKILL; the restarted server reads them through on a lookup."""
    disk = workdir / "disk"
    first = serve(*POOL, "--disk-dir", str(disk), "--disk-capacity", "64MiB")
    chunk_keys = keys("restart", 12)
    store(first.address, "t", chunk_keys)
    wait_for(lambda: extra(first, "tier:disk:objects") == 12)
    assert first.stop(signal.SIGKILL) == -signal.SIGKILL
    second = serve(*POOL, "--disk-dir", str(disk), "--disk-capacity", "64MiB")
    assert second.stats().chunks == 0  # RAM starts empty
    assert lookup(second.address, "t", chunk_keys) == (12, True)
    assert lookup(second.address, "other-salt", chunk_keys) == (0, True)  # a salt finds only its own
    stats = second.stats()
    assert stats.chunks == 12
    assert stats.extra["tier_read_hits"] == 12


def test_an_engine_that_recomputes_faster_than_the_tier_reads_is_not_kept_waiting(serve, workdir):
    """A lookup that says the engine computes a chunk in no time gets no read-through (the tier
    cannot beat that): the chunks are late misses. Without that word, the same chunks hit."""
    disk = workdir / "disk"
    tier = ("--disk-dir", str(disk), "--disk-capacity", "64MiB")
    first = serve(*POOL, *tier)
    chunk_keys = keys("fast-engine", 6)
    store(first.address, "t", chunk_keys)
    wait_for(lambda: extra(first, "tier:disk:objects") == 6)
    first.stop()
    second = serve(*POOL, *tier)
    assert lookup(second.address, "t", chunk_keys, prefill_s_per_chunk=0.0) == (0, True)
    assert extra(second, "tier_read_late") == 6
    assert second.stats().chunks == 0  # no slot was taken for them
    assert lookup(second.address, "t", chunk_keys) == (6, True)


def test_a_corrupted_disk_object_is_a_miss_and_is_deleted(serve, workdir):
    """A flipped byte in an object on disk makes that chunk (and so the rest of the prefix) a miss."""
    disk = workdir / "disk"
    first = serve(*POOL, "--disk-dir", str(disk), "--disk-capacity", "64MiB")
    chunk_keys = keys("corrupt", 4)
    store(first.address, "t", chunk_keys)
    wait_for(lambda: extra(first, "tier:disk:objects") == 4)
    first.stop()
    files = sorted(p for p in (disk / "objects").rglob("*") if p.is_file())
    assert len(files) == 4
    from kvdepot.core import slot_digest

    victim = next(p for p in files if slot_digest("t", chunk_keys[2]).hex() in p.name)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    second = serve(*POOL, "--disk-dir", str(disk), "--disk-capacity", "64MiB")
    assert lookup(second.address, "t", chunk_keys) == (2, True)
    assert extra(second, "tier:disk:corrupt") == 1
    assert not victim.exists()


def test_engines_with_other_chunk_sizes_each_hit_their_own_chunks_below_ram(serve, workdir, valkey_server):
    """Two engines of other models on one server store chunks of other sizes. Read back from the
    disk tier (by a restarted server) and from the remote tier (by another server), each engine
    hits all of its own, whichever of them registered last, and no object is taken for corrupt
    (and deleted). Lookups come from a client that never registers, as vLLM's scheduler's."""
    disk = ("--disk-dir", str(workdir / "disk"), "--disk-capacity", "64MiB")
    first = serve(*POOL, *disk, "--remote", valkey_server.url)
    engines = {"model-a": (SMALL, keys("small", 4)), "model-b": (CHUNK, keys("large", 4))}
    for layout, (size, chunk_keys) in engines.items():
        store(first.address, "t", chunk_keys, size=size, layout=layout)
    wait_for(lambda: extra(first, "tier:disk:objects") == 8 and extra(first, "tier:remote:writes") == 8)
    first.stop()
    restarted = serve(*POOL, *disk)
    other = serve(*POOL, "--remote", valkey_server.url, where=workdir / "s2")
    for server, tier in ((restarted, "disk"), (other, "remote")):
        with contextlib.ExitStack() as stack:
            pools = {}
            for layout, (size, _) in engines.items():  # the workers of both engines; model-b's last
                worker = stack.enter_context(CacheClient(server.address, timeout=T))
                reg = worker.register(layout, 256, size).result(T)
                pools[layout] = stack.enter_context(PoolMapping(reg.pool.path, reg.pool.size, writable=False))
            scheduler = stack.enter_context(CacheClient(server.address, timeout=T))
            for layout, (size, chunk_keys) in engines.items():
                (res,) = scheduler.lookup([("t", chunk_keys)]).result(T).results
                assert (tier, layout, res.num_hits) == (tier, layout, 4)
                assert [s.length for s in res.slots] == [size] * 4
                assert all(
                    pools[layout].read(s.offset, s.length) == payload(k, size)
                    for s, k in zip(res.slots, chunk_keys, strict=True)
                )
                scheduler.release([res.lease_id]).result(T)
        assert (extra(server, f"tier:{tier}:hits"), extra(server, f"tier:{tier}:corrupt")) == (8, 0)
    assert len(valkey_server.client().keys("*")) == 8  # nothing deleted


def store_past_the_quota(server, written: str, quiet: list[bytes], busy: list[bytes]) -> None:
    """`quiet` under salt b, then `busy` under salt a four at a time, each batch written behind
    (the tier counter `written` counts it) before the next."""
    store(server.address, "b", quiet)
    for n in range(0, len(busy), 4):
        store(server.address, "a", busy[n : n + 4])
        wait_for(lambda n=n: extra(server, written) == len(quiet) + n + 4 and not server.stats().leases)


def test_quotas_hold_in_the_disk_tier_too(serve, workdir):
    """A salt that stores far more than its quota keeps at most its quota on disk too (its own
    oldest chunks go), and another salt's chunks there stay: a restarted server still hits them."""
    disk = workdir / "disk"
    args = (*POOL, "--disk-dir", str(disk), "--disk-capacity", "64MiB", "--default-quota", "512KiB")
    first = serve(*args)
    quiet, busy = keys("quiet", 4), keys("busy", 20)
    store_past_the_quota(first, "tier:disk:writes", quiet, busy)
    assert extra(first, "tier:disk:objects") == 4 + 7  # 512 KiB hold 7 files of 64 KiB and a header
    first.stop()
    second = serve(*args)
    assert lookup(second.address, "b", quiet) == (4, True)
    assert lookup(second.address, "a", busy[13:]) == (7, True)
    assert lookup(second.address, "a", busy[:4]) == (0, True)


def stored_on_one_of_two(serve, workdir, url: str, tag: str, n: int):
    """Two servers with their own pools and one remote tier; `n` chunks stored on the first and
    written behind. Returns (the second server, the keys)."""
    first = serve(*POOL, "--remote", url)
    second = serve(*POOL, "--remote", url, where=workdir / "s2")
    chunk_keys = keys(tag, n)
    store(first.address, "t", chunk_keys)
    wait_for(lambda: extra(first, "tier:remote:writes") == n)
    return second, chunk_keys


def test_two_servers_share_chunks_through_a_remote_tier(serve, workdir, valkey_server):
    """What an engine stored on server 1 is a hit on server 2 (its own pool, same remote tier)."""
    second, chunk_keys = stored_on_one_of_two(serve, workdir, valkey_server.url, "shared", 8)
    assert lookup(second.address, "t", chunk_keys) == (8, True)
    assert lookup(second.address, "u", chunk_keys) == (0, True)


def test_quotas_hold_in_a_shared_remote_tier_too(serve, workdir, valkey_server):
    """A salt that stores far more than its quota keeps at most its quota in the remote tier
    (its own oldest chunks go), counted in Valkey for every server that shares it; another
    salt's chunks there stay, and a second server hits them."""
    args = (*POOL, "--remote", valkey_server.url, "--default-quota", "512KiB")
    first = serve(*args)
    quiet, busy = keys("quiet-r", 4), keys("busy-r", 20)
    store_past_the_quota(first, "tier:remote:writes", quiet, busy)
    second = serve(*args, where=workdir / "s2")
    assert lookup(second.address, "b", quiet) == (4, True)
    assert lookup(second.address, "a", busy[12:]) == (8, True)  # 512 KiB hold 8 chunks of 64 KiB less 64 B
    assert lookup(second.address, "a", busy[:4]) == (0, True)


def test_a_corrupted_remote_object_is_a_miss(serve, workdir, valkey_server):
    """A remote object changed behind the servers' back is a miss (from that chunk on), counted."""
    second, chunk_keys = stored_on_one_of_two(serve, workdir, valkey_server.url, "remote-corrupt", 3)
    from kvdepot.core import slot_digest

    client = valkey_server.client()
    name = next(k for k in client.keys("*") if slot_digest("t", chunk_keys[1]).hex().encode() in k)
    client.setrange(name, 4096, b"\x00\x01\x02")
    assert lookup(second.address, "t", chunk_keys) == (1, True)
    assert extra(second, "tier:remote:corrupt") == 1


def test_a_dead_remote_tier_costs_nothing_and_writes_resume_when_it_is_back(serve, workdir, valkey_server):
    """With the remote tier down, stores and lookups are answered at once (RAM only) and counted;
    once it is back, the server writes behind again by itself."""
    server = serve(*POOL, "--remote", valkey_server.url)
    store(server.address, "t", keys("before", 2))
    wait_for(lambda: extra(server, "tier:remote:writes") == 2)
    valkey_server.kill()
    store(server.address, "t", keys("during", 2))  # each within the client's request timeout, or it raises
    assert lookup(server.address, "t", keys("during", 2)) == (2, True)
    assert lookup(server.address, "t", keys("cold", 3)) == (0, True)
    wait_for(lambda: extra(server, "tier:remote:state") == "down")
    valkey_server.start()
    wait_for(lambda: extra(server, "tier:remote:state") == "up", timeout=30)
    store(server.address, "t", keys("after", 2))
    wait_for(lambda: extra(server, "tier:remote:writes") >= 4)


def private_ca_and_certificate(where):
    """A private CA and a certificate it signed for 127.0.0.1 (PEM files): (ca, cert, key)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvdepot test CA")])

    def signed(subject, public_key, extension, critical: bool):
        return (
            x509.CertificateBuilder().subject_name(subject).issuer_name(ca_name).public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(extension, critical=critical)
            .sign(ca_key, hashes.SHA256())
        )  # fmt: skip

    ca = signed(ca_name, ca_key.public_key(), x509.BasicConstraints(ca=True, path_length=None), True)
    localhost = x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    cert = signed(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]), key.public_key(), localhost, False)
    paths = (where / "ca.pem", where / "server.pem", where / "server.key")
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return paths


class TlsFront:
    """TLS in front of a plain Valkey (the bundled one is built without TLS): a thread that
    accepts TLS connections on `port` and relays each to `upstream`."""

    def __init__(self, cert, key, upstream: int) -> None:
        import asyncio
        import ssl
        import threading

        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(cert, key)
        self.upstream = upstream
        self.loop = asyncio.new_event_loop()
        self.server = self.loop.run_until_complete(asyncio.start_server(self._relay, "127.0.0.1", 0, ssl=self.context))
        self.port = self.server.sockets[0].getsockname()[1]
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    async def _relay(self, reader, writer) -> None:
        import asyncio

        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream)

        async def pump(src, dst) -> None:
            with contextlib.suppress(Exception):
                while data := await src.read(1 << 16):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def test_a_tls_remote_tier_signed_by_a_private_ca(serve, workdir, valkey_server):
    """rediss:// to a Valkey behind TLS whose certificate a private CA signed: with
    --remote-ca-file the server verifies it and writes behind to it, and another server reads
    the chunks back through it; without the CA the tier stays down (the certificate is not
    trusted) and the server serves from RAM as ever."""
    ca, cert, key = private_ca_and_certificate(workdir)
    front = TlsFront(cert, key, valkey_server.port)
    try:
        url = f"rediss://127.0.0.1:{front.port}"
        first = serve(*POOL, "--remote", url, "--remote-ca-file", str(ca))
        chunk_keys = keys("tls", 3)
        store(first.address, "t", chunk_keys)
        wait_for(lambda: extra(first, "tier:remote:writes") == 3)
        second = serve(*POOL, "--remote", url, "--remote-ca-file", str(ca), where=workdir / "s2")
        assert lookup(second.address, "t", chunk_keys) == (3, True)
        untrusting = serve(*POOL, "--remote", url, where=workdir / "s3")
        assert lookup(untrusting.address, "t", chunk_keys) == (0, True)
        assert extra(untrusting, "tier:remote:state") == "down"
        store(untrusting.address, "t", keys("ram-only", 1))
        assert lookup(untrusting.address, "t", keys("ram-only", 1)) == (1, True)
    finally:
        front.close()


def test_kvdepot_stats_shows_each_tier(serve, workdir, valkey_server):
    """`kvdepot stats` has a row per tier: state, use, chunks, hits, misses, bytes, queue, errors."""
    import subprocess
    import sys

    server = serve(
        *POOL, "--disk-dir", str(workdir / "disk"), "--disk-capacity", "64MiB", "--remote", valkey_server.url
    )
    store(server.address, "t", keys("stats", 2))
    wait_for(lambda: extra(server, "tier:disk:objects") == 2 and extra(server, "tier:remote:writes") == 2)
    out = subprocess.run(
        [sys.executable, "-m", "kvdepot.server", "stats", "--address", server.address],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    disk = next(line for line in out.splitlines() if line.startswith("tier disk"))
    remote = next(line for line in out.splitlines() if line.startswith("tier remote"))
    assert "up, " in disk
    assert "2 chunks" in disk
    assert "up, " in remote
    assert "queue 0" in remote


def test_a_query_reports_ram_disk_and_remote_per_salt_and_leases_nothing(serve, workdir, valkey_server):
    """A router's Query to a real server with both tiers: what RAM holds, then the run below it,
    and each tier's part, per salt; a second server that shares only the remote tier sees only
    that. Nothing is leased or counted, and a lookup right after hits what the query said."""
    args = (*POOL, "--disk-dir", str(workdir / "disk"), "--remote", valkey_server.url)
    first = serve(*args)
    a, b = keys("query-a", 6), keys("query-b", 3)
    store(first.address, "tenant-a", a)
    store(first.address, "tenant-b", b)
    wait_for(lambda: extra(first, "tier:disk:objects") == 9 and extra(first, "tier:remote:writes") == 9)
    with CacheClient(first.address, timeout=T) as client:
        assert client.clear_all("tenant-a") == 6  # RAM only: the tiers keep them
        store(first.address, "tenant-a", a[:2])
        # the write-behind holds the new commit's chunks until its tiers have them: let it finish
        wait_for(lambda: client.stats().result(T).leases == 0)
        before = client.stats().result(T)
        items = [("tenant-a", a), ("tenant-b", [*b, *a]), ("tenant-c", a)]
        results = client.query(items).result(T).results
        assert [(r.ram, r.below, r.tiers) for r in results] == [
            (2, 4, {"disk": 4, "remote": 4}),
            (3, 0, {"disk": 0, "remote": 0}),  # tenant-a's chunks are not tenant-b's
            (0, 0, {"disk": 0, "remote": 0}),
        ]
        ram_only = client.query(items, tiers=False).result(T).results
        assert [(r.ram, r.below) for r in ram_only] == [(2, 0), (3, 0), (0, 0)]
        after = client.stats().result(T)
        assert (after.leases, after.hits, after.misses) == (before.leases, before.hits, before.misses)
    assert lookup(first.address, "tenant-a", a) == (6, True)
    second = serve(*POOL, "--remote", valkey_server.url, where=workdir / "s2")
    with CacheClient(second.address, timeout=T) as client:
        (result,) = client.query([("tenant-a", a)]).result(T).results
        assert (result.ram, result.below, result.tiers) == (0, 6, {"remote": 6})


def test_kvdepot_query_keys_a_prompt_as_an_engine_does_and_prints_each_salt(serve, workdir):
    """`kvdepot query` computes the prompt's chunk keys with kvdepot.core under the engine's
    namespace and each salt, and prints what the server holds of it, RAM and disk."""
    import json
    import subprocess
    import sys

    from kvdepot.core import Namespace, chunk_keys

    server = serve(*POOL, "--disk-dir", str(workdir / "disk"))
    tokens = list(range(1000, 2280))  # five chunks of 256, and a partial one that has no key
    prompt = chunk_keys(Namespace(model="m", layout="l", cache_salt="tenant-a"), tokens, chunk_size=256)
    store(server.address, "tenant-a", prompt)
    wait_for(lambda: extra(server, "tier:disk:objects") == 5)
    with CacheClient(server.address, timeout=T) as client:
        client.clear_all("tenant-a")
    store(server.address, "tenant-a", prompt[:3])
    command = [sys.executable, "-m", "kvdepot.server", "query", "--address", server.address]
    command += ["--model", "m", "--layout", "l", "--salt", "tenant-a", "--salt", "tenant-b"]
    command += ["--tokens", ",".join(map(str, tokens))]
    rows = json.loads(
        subprocess.run([*command, "--json"], capture_output=True, text=True, timeout=60, check=True).stdout
    )
    assert [(r["salt"], r["chunks"], r["ram"], r["below"], r["tiers"], r["hit_tokens"]) for r in rows] == [
        ("tenant-a", 5, 3, 2, {"disk": 2}, 1280),
        ("tenant-b", 5, 0, 0, {"disk": 0}, 0),
    ]
    table = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True).stdout
    assert table.splitlines()[0].split() == ["salt", "chunks", "ram", "below", "disk", "hit", "tokens"]
    bad = subprocess.run([*command[:-2], "--tokens", "1,x"], capture_output=True, text=True, timeout=60, check=False)
    assert bad.returncode == 1
    assert bad.stderr.startswith("kvdepot query:")
