"""The tcp cache endpoint of `kvdepot serve` takes at most `--max-connections` connections, within
the process's file limit, against a real server process: a flood of plain tcp connections neither
kills it nor fills its file table, and /metrics shows the cap and the refusals."""

from __future__ import annotations

import contextlib
import errno
import json
import re
import socket
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvdepot.server import ServerProcess
from kvdepot.server._cli import BUILTIN_COMMANDS, build_parser
from kvdepot.server._file_limit import CACHE_FILE_LIMIT_SHARE, RESERVED_FILES
from kvdepot.server._metrics_http import FILE_LIMIT_SHARE
from kvdepot.server.testing import free_port
from kvdepot.transport import MAX_CONNECTIONS, CacheClient

pytestmark = pytest.mark.integration

T = 10.0
# A file limit the server cannot raise: an old server's tcp listener took connections until it had
# none left, then spun on its failing accept and locked every new client out.
HARD_NOFILE = 256
_LIMITED = (
    "import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_NOFILE, ({n}, {n})); "
    "sys.argv[0] = 'kvdepot'; runpy.run_module('kvdepot.server', run_name='__main__', alter_sys=True)"
)


_LOG = ("--log-format", "json")


class LimitedServer(ServerProcess):
    """`kvdepot serve` with a hard file limit of `HARD_NOFILE`."""

    def command(self) -> list[str]:
        command = super().command()
        return [sys.executable, "-c", _LIMITED.format(n=HARD_NOFILE), *command[3:]]


@contextlib.contextmanager
def tcp_server(workdir: Path, *args: str) -> Iterator[tuple[ServerProcess, str]]:
    """A server on a loopback tcp port, with a file limit of `HARD_NOFILE` and metrics on a free
    port; and its metrics URL."""
    metrics_port = free_port()
    server = LimitedServer(
        f"tcp://127.0.0.1:{free_port()}",
        capacity="8MiB",
        args=["--page-size", "1MiB", "--pool-dir", str(workdir), "--metrics-port", str(metrics_port), *_LOG, *args],
        log_path=workdir / "server.log",
    )
    with server:
        yield server, f"http://127.0.0.1:{metrics_port}/metrics"


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=T) as resp:
        assert resp.status == 200
        return str(resp.read().decode())


def _cache_figures(url: str) -> dict[str, float]:
    """The cache listener's figures in /metrics: connections, max_connections, refused_<reason>
    (none where the server shows no cache listener, or does not answer)."""
    try:
        text = _scrape(url)
    except OSError:
        return {}
    figures = {}
    for name, reason, value in re.findall(
        r'^kvdepot_listener_(connections|max_connections|refused_total)\{listener="cache"(?:,reason="(\w+)")?\} (\S+)$',
        text,
        re.M,
    ):
        figures[f"refused_{reason}" if reason else name] = float(value)
    return figures


def wait_for(predicate, timeout: float = T):
    deadline = time.monotonic() + timeout
    while not (value := predicate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


def test_a_flood_of_tcp_connections_stops_at_the_cap_and_clients_are_served(short_tmp):
    """More plain tcp connections to the cache port than the server's file limit allows (the old
    server took them all, then spun on its accept and locked new clients out): the port takes at
    most its cap, the rest wait unanswered, the server stays up and serves the client it had, and
    /metrics shows the cap and that it was full; once they close, a new tcp client is served."""
    cap = 32
    with tcp_server(short_tmp, "--max-connections", str(cap)) as (server, url):
        host, port = server.address.removeprefix("tcp://").rsplit(":", 1)
        with CacheClient(server.address, timeout=T) as good:
            good.ping().result(T)
            flood = []
            try:
                for _ in range(HARD_NOFILE + 64):
                    sock = socket.socket()
                    sock.setblocking(False)
                    assert sock.connect_ex((host, int(port))) in (0, errno.EINPROGRESS)
                    flood.append(sock)
                figures = wait_for(lambda: (f := _cache_figures(url)).get("refused_full", 0) >= 1 and f)
                assert figures, f"/metrics never showed the cache listener full: {_cache_figures(url)}"
                assert figures["max_connections"] == cap
                # the cap, and what libzmq accepted in the moment before the filter was on: never the flood
                assert cap <= figures["connections"] < len(flood)
                assert server.alive()
                good.ping().result(T)  # a connection made before the flood is served through it
            finally:
                for sock in flood:
                    sock.close()
            assert wait_for(lambda: _cache_figures(url).get("connections") == 1), "the flood's connections stay"
        with CacheClient(server.address, timeout=T) as late:
            late.ping().result(T)
        assert server.alive()


def test_max_connections_stays_within_the_file_limit(short_tmp):
    """However many connections --max-connections asks, the tcp cache endpoint keeps at most half of
    what the file limit leaves after the metrics endpoint's cap and the reserve, and says so."""
    with tcp_server(short_tmp, "--max-connections", "100000") as (server, url):
        metrics_cap = int(HARD_NOFILE * FILE_LIMIT_SHARE)
        expected = int((HARD_NOFILE - metrics_cap - RESERVED_FILES) * CACHE_FILE_LIMIT_SHARE)
        assert _cache_figures(url)["max_connections"] == expected
        assert server.stats(T).extra["cache_max_connections"] == expected
        assert server.log_path is not None
        lines = server.log_path.read_text().splitlines()
        capped = [json.loads(line) for line in lines if "cache_connections_capped" in line]
        assert [event["cap"] for event in capped] == [expected]


def test_an_ipc_server_shows_no_cache_listener(short_tmp):
    """ipc's directory is owner-only, so an ipc cache endpoint has no connection cap to show."""
    metrics_port = free_port()
    server = ServerProcess(
        f"ipc://{short_tmp}/kvd.sock",
        capacity="8MiB",
        args=["--page-size", "1MiB", "--pool-dir", str(short_tmp), "--metrics-port", str(metrics_port)],
    )
    with server:
        text = _scrape(f"http://127.0.0.1:{metrics_port}/metrics")
        assert 'kvdepot_listener_max_connections{listener="metrics"}' in text
        assert 'listener="cache"' not in text
        assert "cache_connections" not in server.stats(T).extra


def test_the_flag_defaults_to_the_endpoints_cap():
    """`kvdepot serve` takes `MAX_CONNECTIONS` tcp connections unless told otherwise."""
    args = build_parser(BUILTIN_COMMANDS).parse_args(["serve"])
    assert args.max_connections == MAX_CONNECTIONS
