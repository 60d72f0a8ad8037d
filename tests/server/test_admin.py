"""An operator's commands against real `kvdepot serve` processes: `kvdepot ping`, `kvdepot clear`
through every tier (two servers sharing a real Valkey, and a restart on the same disk tier), and
`kvdepot quota` (issue 34). The commands run as an operator runs them: the `kvdepot` CLI in a
child process, read back by its exit code, its JSON and its messages.
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from _chunks import POOL, extra, keys, lookup, store, wait_for

from kvdepot.transport import CacheClient

# These tests restart a server to read chunks back from the tiers below: its pool is not kept,
# so the restarted server's RAM starts empty (tests/server/test_kept_pool.py keeps it).
POOL = [*POOL, "--no-keep-pool"]

pytestmark = pytest.mark.integration

T = 20.0


def kvdepot(*args: str) -> subprocess.CompletedProcess[str]:
    """The `kvdepot` CLI in a child process; its exit code, stdout and stderr."""
    command = [sys.executable, "-m", "kvdepot.server._cli", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL, check=False)


def cleared(address: str, *args: str) -> dict:
    done = kvdepot("clear", "--address", address, "--json", *args)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def tiered_pair(serve, workdir: Path, url: str):
    """Two servers, each with a disk tier of its own, sharing one Valkey."""

    def disk(name: str) -> tuple[str, ...]:
        return ("--disk-dir", str(workdir / name), "--disk-capacity", "64MiB", "--remote", url)

    first = serve(*POOL, *disk("disk-a"))
    second = serve(*POOL, *disk("disk-b"), where=workdir / "b")
    return first, second, disk("disk-a")


def test_a_clear_with_tiers_leaves_no_server_a_way_to_hit_the_salt_and_keeps_the_others(serve, workdir, valkey_server):
    """`kvdepot clear --salt S --tiers` on server A removes S from A's RAM, A's disk and the shared
    Valkey: neither A, nor B (same Valkey), nor A restarted on the same disk hits S again, while
    salt T is still a hit everywhere."""
    first, second, first_args = tiered_pair(serve, workdir, valkey_server.url)
    gone, kept = keys("gone", 6), keys("kept", 4)
    store(first.address, "S", gone)
    store(first.address, "T", kept)
    wait_for(lambda: extra(first, "tier:disk:objects") == 10 and extra(first, "tier:remote:writes") == 10)

    report = cleared(first.address, "--salt", "S", "--tiers")
    assert report == {
        "salt": "S", "all": False, "ram": 6, "left": 0, "tiers": {"disk": 6, "remote": 6}, "tier_errors": {}
    }  # fmt: skip
    assert lookup(first.address, "S", gone) == (0, True)
    assert lookup(second.address, "S", gone) == (0, True)  # would have read the remote tier through
    assert lookup(second.address, "T", kept) == (4, True)
    first.stop()
    restarted = serve(*POOL, *first_args)
    assert restarted.stats().chunks == 0
    assert lookup(restarted.address, "S", gone) == (0, True)
    assert extra(restarted, "tier:disk:objects") == 4
    assert lookup(restarted.address, "T", kept) == (4, True)
    assert extra(restarted, "tier:disk:hits") == 4


def test_a_clear_of_ram_alone_leaves_the_tiers_and_says_so_in_its_help(serve, workdir, valkey_server):
    """Without --tiers a clear touches RAM only: the chunks come back from the disk tier. The help
    of --tiers says that the remote tier is shared."""
    first, _, _ = tiered_pair(serve, workdir, valkey_server.url)
    chunk_keys = keys("ram-only", 4)
    store(first.address, "S", chunk_keys)
    wait_for(lambda: extra(first, "tier:disk:objects") == 4 and extra(first, "tier:remote:writes") == 4)
    assert cleared(first.address, "--salt", "S")["tiers"] == {}
    assert first.stats().chunks == 0
    assert lookup(first.address, "S", chunk_keys) == (4, True)
    helptext = " ".join(kvdepot("clear", "--help").stdout.split())
    assert "The remote tier is shared" in helptext


def test_a_clear_of_everything_with_tiers_empties_ram_disk_and_valkey_but_not_others_keys(
    serve, workdir, valkey_server
):
    first, second, _ = tiered_pair(serve, workdir, valkey_server.url)
    with contextlib.closing(valkey_server.client()) as plain:
        plain.set("someone-elses-key", b"x")
        for salt, tag in (("S", "a"), ("T", "b")):
            store(first.address, salt, keys(tag, 3))
        wait_for(lambda: extra(first, "tier:remote:writes") == 6 and extra(first, "tier:disk:objects") == 6)
        report = cleared(first.address, "--all", "--tiers")
        assert (report["ram"], report["tiers"]) == (6, {"disk": 6, "remote": 6})
        assert plain.keys("*") == [b"someone-elses-key"]
    assert lookup(second.address, "T", keys("b", 3)) == (0, True)
    assert extra(first, "tier:disk:objects") == 0


def test_chunks_a_client_holds_are_cleared_once_let_go_and_the_command_says_what_is_left(serve):
    """A chunk leased by a client (an engine reading it) survives the clear while held: the command
    waits up to --wait, then exits 3 and says how many are left; once released, a clear removes it."""
    server = serve(*POOL)
    chunk_keys = keys("held", 3)
    store(server.address, "S", chunk_keys)
    with CacheClient(server.address, timeout=T) as reader:
        (res,) = reader.lookup([("S", chunk_keys[:1])]).result(T).results
        assert res.num_hits == 1
        held = kvdepot("clear", "--address", server.address, "--salt", "S", "--wait", "0.5", "--json")
        assert held.returncode == 3, held.stderr
        assert json.loads(held.stdout)["left"] == 1
        assert "1 chunks are still held by clients" in held.stderr
        reader.release([res.lease_id]).result(T)
    assert cleared(server.address, "--salt", "S")["ram"] == 1
    assert server.stats().chunks == 0


def test_a_clear_with_tiers_on_a_server_without_them_clears_ram_and_says_so(serve):
    server = serve(*POOL)
    store(server.address, "S", keys("no-tiers", 2))
    done = kvdepot("clear", "--address", server.address, "--salt", "S", "--tiers")
    assert done.returncode == 0, done.stderr
    assert "2 chunks from RAM" in done.stdout
    assert "no tiers below RAM" in done.stdout


def test_a_clear_whose_remote_tier_is_down_clears_the_rest_and_exits_3(serve, workdir, valkey_server):
    first, _, _ = tiered_pair(serve, workdir, valkey_server.url)
    store(first.address, "S", keys("down", 2))
    wait_for(lambda: extra(first, "tier:disk:objects") == 2 and extra(first, "tier:remote:writes") == 2)
    valkey_server.kill()
    done = kvdepot("clear", "--address", first.address, "--salt", "S", "--tiers", "--json")
    assert done.returncode == 3, done.stderr
    report = json.loads(done.stdout)
    assert report["tiers"] == {"disk": 2}
    assert "remote" in report["tier_errors"]
    assert "the remote tier was not cleared" in done.stderr
    assert first.alive()


def test_ping_exits_0_for_a_server_and_1_with_a_message_for_none(serve, workdir):
    server = serve(*POOL)
    up = kvdepot("ping", "--address", server.address, "--json")
    assert up.returncode == 0, up.stderr
    with CacheClient(server.address, timeout=T) as client:
        hello = client.hello().result(T)
    assert json.loads(up.stdout)["server_id"] == hello.server_id
    server.stop()
    down = kvdepot("ping", "--address", server.address, "--timeout", "1")
    assert down.returncode == 1
    assert f"no kvdepot server answered at {server.address}" in down.stderr


def test_quota_set_get_unset_round_trip_and_evicts_what_is_over(serve):
    server = serve(*POOL)
    store(server.address, "S", keys("quota", 8))  # 8 chunks of 64 KiB
    done = kvdepot("quota", "set", "S", "256KiB", "--address", server.address, "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"S": 256 << 10}
    assert server.stats().chunks <= 4
    listed = kvdepot("quota", "get", "--address", server.address)
    assert listed.returncode == 0, listed.stderr
    assert "'S'" in listed.stdout
    assert "256" in listed.stdout
    assert kvdepot("quota", "unset", "S", "--address", server.address).returncode == 0
    missing = kvdepot("quota", "get", "S", "--address", server.address)
    assert missing.returncode == 1
    assert "has no quota of its own" in missing.stderr
    bad = kvdepot("quota", "set", "S", "lots", "--address", server.address)
    assert bad.returncode == 2


@contextlib.contextmanager
def tcp_server(workdir: Path, secret: Path | None = None) -> Iterator[str]:
    """A server on a loopback tcp port, with a shared secret if given."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    auth = ("--auth-secret-file", str(secret)) if secret is not None else ()
    command = [sys.executable, "-m", "kvdepot.server", "serve", "--address", address, "--no-metrics",
               "--capacity", "4MiB", "--pool-dir", str(workdir), *auth]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: kvdepot("ping", "--address", address, *auth).returncode == 0, T)
        yield address
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)


def test_over_tcp_admin_commands_need_the_secret_and_say_so(workdir):
    """A tcp server with a shared secret: without it every command says to pass the secret; with
    it they work. A tcp server without a secret refuses clear and quota (anyone on the host could
    send them), and ping still answers."""
    secret = workdir / "secret"
    secret.write_text("s3cret\n")
    secret.chmod(0o600)
    with tcp_server(workdir, secret) as address:
        for command in (["ping"], ["clear", "--all"], ["quota", "get"]):
            refused = kvdepot(*command, "--address", address, "--timeout", "3")
            assert refused.returncode == 1, (command, refused.stdout)
            assert "--auth-secret-file" in refused.stderr, (command, refused.stderr)
            allowed = kvdepot(*command, "--address", address, "--auth-secret-file", str(secret))
            assert allowed.returncode == 0, (command, allowed.stderr)
    (workdir / "open").mkdir(mode=0o700)
    with tcp_server(workdir / "open") as address:
        assert kvdepot("ping", "--address", address).returncode == 0
        for command in (["clear", "--all"], ["quota", "set", "S", "1MiB"], ["quota", "get"]):
            refused = kvdepot(*command, "--address", address)
            assert refused.returncode == 1, (command, refused.stdout)
            assert "ipc socket" in refused.stderr, (command, refused.stderr)


def test_the_commands_exist_in_the_help():
    helptext = kvdepot("--help").stdout
    for name in ("ping", "clear", "quota"):
        assert name in helptext


def quotas(address: str) -> dict:
    done = kvdepot("quota", "get", "--address", address, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_quotas_survive_a_restart(serve, workdir, stop):
    """Quotas set and removed with `kvdepot quota` are in force again after the server restarts,
    stopped cleanly or killed right after the change: nobody sets them twice."""
    server = serve(*POOL)
    for salt, size in (("S", "256KiB"), ("T", "1MiB"), ("U", "2MiB")):
        assert kvdepot("quota", "set", salt, size, "--address", server.address).returncode == 0
    assert kvdepot("quota", "unset", "U", "--address", server.address).returncode == 0
    server.stop(stop)
    again = serve(*POOL)
    assert quotas(again.address) == {"S": 256 << 10, "T": 1 << 20}
    with CacheClient(again.address, timeout=T) as client:  # the quota is in force, not just listed
        client.register("layout", 256, 64 << 10).result(T)
        capped = client.reserve("S", keys("after-restart", 8), 64 << 10).result(T)
        roomy = client.reserve("T", keys("after-restart", 8), 64 << 10).result(T)
    assert capped.full
    assert len(capped.slots) < 4  # 256 KiB holds fewer than four 64 KiB chunks and their headers
    assert len(roomy.slots) == 8
    assert (workdir / "settings.json").stat().st_mode & 0o777 == 0o600


def test_a_server_without_a_settings_file_starts_with_no_quotas(serve):
    """`--settings-file none` keeps quotas in memory only, as before."""
    server = serve(*POOL, "--settings-file", "none")
    assert kvdepot("quota", "set", "S", "1MiB", "--address", server.address).returncode == 0
    server.stop()
    assert quotas(serve(*POOL, "--settings-file", "none").address) == {}


@pytest.mark.parametrize(
    ("content", "mode", "said"),
    [
        (b'{"version": 1, "quotas": {"S": 1}}', 0o644, "it must be yours alone"),
        (b'{"version": 99, "quotas": {}}', 0o600, "written by a newer kvdepot"),
        (b'{"version": 1, "quotas": {"S": -5}}', 0o600, "is not a settings file"),
        (b"\x00not json", 0o600, "is not a settings file"),
    ],
    ids=["readable-by-others", "newer-format", "negative-quota", "garbage"],
)
def test_a_settings_file_the_server_cannot_trust_stops_its_start_with_a_clear_message(workdir, content, mode, said):
    """A settings file of another format, others can read, or that is not one: the server says
    why and does not start (exit 2), rather than run without the operator's quotas."""
    path = workdir / "settings.json"
    path.write_bytes(content)
    path.chmod(mode)
    address = f"ipc://{workdir}/kvdepot.sock"
    done = kvdepot("serve", "--address", address, *POOL, "--no-metrics", "--settings-file", str(path))
    assert done.returncode == 2
    assert said in done.stderr
    assert str(path) in done.stderr
    assert path.read_bytes() == content  # left as it was


def test_a_quota_that_cannot_be_kept_is_not_set(serve, workdir):
    """When the settings file cannot be written, `kvdepot quota set` fails, says why, and the
    quota is not in force: what an operator is told has been set always survives a restart."""
    state = workdir / "state"
    server = serve(*POOL, "--settings-file", str(state / "settings.json"))
    assert kvdepot("quota", "set", "S", "1MiB", "--address", server.address).returncode == 0
    (state / "settings.json").unlink()
    state.rmdir()
    state.write_bytes(b"")  # a file where the directory was: nothing can be written under it
    done = kvdepot("quota", "set", "T", "1MiB", "--address", server.address)
    assert done.returncode != 0
    assert "was not made" in done.stderr
    assert quotas(server.address) == {"S": 1 << 20}
