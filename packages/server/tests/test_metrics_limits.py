"""The metrics endpoint is bounded against a hostile local user: connections, time and bytes per
request, and the server's file limit, against a real `kvdepot serve` process."""

from __future__ import annotations

import contextlib
import json
import re
import resource
import select
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvdepot.server import ServerProcess, main
from kvdepot.server._metrics import Metrics
from kvdepot.server._metrics_http import FILE_LIMIT_SHARE, HTTP_WORKERS, HTTPLimits
from kvdepot.transport import CacheClient

pytestmark = pytest.mark.integration

T = 10.0
# The soft file limit systemd gives a service, which the finding's server had.
SYSTEMD_SOFT_NOFILE = 1024
# Idle connections that filled that limit and made libzmq abort the server.
IDLE_CONNECTIONS = 1100


@contextlib.contextmanager
def soft_file_limit(soft: int) -> Iterator[None]:
    """This process's soft RLIMIT_NOFILE set to `soft` (children started meanwhile inherit it)."""
    before, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (before, hard))


def _hard_limit_at_least(count: int) -> int:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < count:
        pytest.skip(f"the hard file limit ({hard}) is below the {count} this test needs")
    return hard


@contextlib.contextmanager
def metrics_server(workdir: Path, *args: str, nofile: int | None = None) -> Iterator[tuple[ServerProcess, str]]:
    """A `kvdepot serve` process with metrics on a free port (started with a soft file limit of
    `nofile` if given), and its metrics URL."""
    log_path = workdir / "server.log"
    server = ServerProcess(
        f"ipc://{workdir}/kvd.sock",
        capacity="1MiB",
        args=["--page-size", "64KiB", "--pool-dir", str(workdir), "--metrics-port", "0", "--log-format", "json", *args],
        log_path=log_path,
    )
    with contextlib.ExitStack() as stack:
        if nofile is not None:
            stack.enter_context(soft_file_limit(nofile))
        server.start()
    with server:
        yield server, _event(log_path, "server_started")["metrics"]


def _event(log_path: Path, name: str) -> dict:
    for line in log_path.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            event = json.loads(line)
            if event.get("event") == name:
                return dict(event)
    raise AssertionError(f"no {name} event in the server's log: {log_path.read_text()[-2000:]}")


def _status_field(pid: int, field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+)", Path(f"/proc/{pid}/status").read_text(), re.MULTILINE)
    assert match is not None
    return int(match.group(1))


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=T) as resp:
        assert resp.status == 200
        return str(resp.read().decode())


def _scrape_or_503(url: str) -> str | None:
    """The scrape, or None when the endpoint answered 503 (at its cap)."""
    try:
        return _scrape(url)
    except urllib.error.HTTPError as exc:
        if exc.code != 503:
            raise
        return None


def _refused(text: str, reason: str) -> float:
    match = re.search(rf'^kvdepot_listener_refused_total{{listener="metrics",reason="{reason}"}} (\S+)$', text, re.M)
    assert match is not None, f"no refused counter for {reason!r} in /metrics"
    return float(match.group(1))


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/", 1)[0])


def _connect(url: str) -> socket.socket:
    return socket.create_connection(("127.0.0.1", _port(url)), timeout=T)


def _reply(sock: socket.socket) -> bytes:
    """What the server sends until it closes (bounded by the socket's timeout)."""
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            data += chunk
    return data


def test_idle_connections_past_the_file_limit_neither_kill_nor_lock_out(short_tmp):
    """1,100 idle connections to the metrics port of a server started with systemd's soft file limit
    (1,024) hold no thread each and no more than the cap's descriptors: an ipc client is still
    served (libzmq used to abort the server), /metrics still answers at once, the server's threads
    stay a fixed few, and the connections dropped past the cap are counted."""
    hard = _hard_limit_at_least(IDLE_CONNECTIONS + 200)
    cap = 32
    with contextlib.ExitStack() as stack:
        stack.enter_context(soft_file_limit(hard))  # room for this test's own sockets
        server, url = stack.enter_context(
            metrics_server(short_tmp, "--metrics-max-connections", str(cap), nofile=SYSTEMD_SOFT_NOFILE)
        )
        assert server.pid is not None
        threads_before = _status_field(server.pid, "Threads")
        idle = [stack.enter_context(_connect(url)) for _ in range(IDLE_CONNECTIONS)]
        with CacheClient(server.address, timeout=T) as client:
            client.ping()
        text = _scrape(url)
        assert server.alive()
        assert _status_field(server.pid, "Threads") <= threads_before + HTTP_WORKERS
        dropped = _refused(text, "displaced") + _refused(text, "deadline")
        assert dropped >= len(idle) + 1 - cap
        connections = re.search(r'^kvdepot_listener_connections{listener="metrics"} (\S+)$', text, re.M)
        assert connections is not None
        assert float(connections.group(1)) <= cap


def test_a_header_dripped_slowly_is_cut_off_by_the_whole_request_deadline(short_tmp):
    """A peer sending a header line every quarter second (each read on time) is answered 408 and
    closed once its head has taken longer than --metrics-request-deadline in all; meanwhile a
    scrape is answered."""
    with metrics_server(short_tmp, "--metrics-request-deadline", "1") as (_, url), _connect(url) as slow:
        slow.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
        lines_sent = 0
        for lines_sent in range(1, 61):  # 15 s of dripping at most, far past the 1 s deadline
            if select.select([slow], [], [], 0.25)[0]:
                break
            if lines_sent == 2:
                assert "kvdepot_capacity_bytes" in _scrape(url)  # the drip holds nothing others need
            with contextlib.suppress(OSError):
                slow.sendall(f"X-Drip-{lines_sent}: {lines_sent}\r\n".encode())
        answer = _reply(slow)
        assert answer.startswith(b"HTTP/1.0 408"), (lines_sent, answer[:200])
        assert lines_sent < 60
        assert _refused(_scrape(url), "deadline") >= 1


def test_oversized_heads_get_431_and_their_bytes_are_not_kept(short_tmp):
    """A 20 KiB header line (short of the stdlib's 64 KiB line limit) gets 431; forty peers each
    sending 6 MB of header lines that never end leave the server's memory where it was (each
    head is dropped at --metrics-max-header-bytes, 16 KiB by default)."""
    with metrics_server(short_tmp) as (server, url):
        assert server.pid is not None
        with _connect(url) as sock:
            sock.sendall(b"GET /metrics HTTP/1.1\r\nX-Big: " + b"a" * 20 * 1024 + b"\r\n\r\n")
            assert _reply(sock).startswith(b"HTTP/1.0 431")
        _scrape(url)
        rss_before = _status_field(server.pid, "VmRSS") * 1024
        line = b"X-Fill: " + b"b" * 60 * 1024 + b"\r\n"
        with contextlib.ExitStack() as stack:
            peers = [stack.enter_context(_connect(url)) for _ in range(40)]
            for sock in peers:
                sock.sendall(b"GET /metrics HTTP/1.1\r\n")
                with contextlib.suppress(OSError):  # the server may close it while we send
                    for _ in range(99):
                        sock.sendall(line)
            grown = _status_field(server.pid, "VmRSS") * 1024 - rss_before
            assert grown < 32 * 2**20, f"the server kept {grown / 2**20:.0f} MiB of unfinished heads"
            answers = [_reply(sock)[:12] for sock in peers]
        assert all(a == b"HTTP/1.0 431" for a in answers), set(answers)
        assert _refused(_scrape(url), "header_bytes") >= 41


def test_serve_raises_its_soft_file_limit_to_the_hard_limit(short_tmp):
    """`kvdepot serve` started with a soft file limit of 1,024 runs with the hard limit, and logs it."""
    hard = _hard_limit_at_least(SYSTEMD_SOFT_NOFILE + 1)
    with metrics_server(short_tmp, nofile=SYSTEMD_SOFT_NOFILE) as (server, _):
        limits = Path(f"/proc/{server.pid}/limits").read_text()
        match = re.search(r"^Max open files\s+(\S+)\s+(\S+)", limits, re.MULTILINE)
        assert match is not None
        assert match.group(1) == match.group(2)
        if hard != resource.RLIM_INFINITY:
            assert int(match.group(1)) == hard
        assert server.log_path is not None
        event = _event(server.log_path, "file_limit_set")
        assert event["soft_before"] == SYSTEMD_SOFT_NOFILE
        assert event["soft"] == int(match.group(1))


def test_at_the_cap_with_every_request_answering_a_new_connection_gets_503():
    """When every connection under the cap is being answered (none to displace), the next one gets
    503 at once, without a thread, and is counted as "full"; the cap's answers still complete."""
    entered, release = threading.Event(), threading.Event()

    def slow_health() -> str | None:
        entered.set()
        release.wait(T)
        return None

    metrics = Metrics(health=slow_health)
    url = metrics.serve(0, limits=HTTPLimits(max_connections=1))
    health = url.removesuffix("/metrics") + "/healthz"
    try:
        answers: list[int] = []
        held = threading.Thread(target=lambda: answers.append(urllib.request.urlopen(health, timeout=T).status))
        held.start()
        assert entered.wait(T)
        with _connect(url) as sock:
            assert _reply(sock).startswith(b"HTTP/1.0 503")
        release.set()
        held.join(T)
        assert answers == [200]
        # The server closes the held connection just after its answer: until then a scrape is
        # refused too (counted), which happens under a loaded machine's scheduling.
        late = 0
        while (text := _scrape_or_503(url)) is None and late < 500:
            late += 1
            time.sleep(0.01)
        assert text is not None
        assert _refused(text, "full") == 1 + late
    finally:
        release.set()
        metrics.close()


def test_a_request_with_a_body_gets_400():
    """GET with a body (Content-Length or chunked) gets 400: the endpoint reads no bodies."""
    metrics = Metrics()
    url = metrics.serve(0)
    try:
        for header in (b"Content-Length: 5\r\n", b"Transfer-Encoding: chunked\r\n"):
            with _connect(url) as sock:
                sock.sendall(b"GET /metrics HTTP/1.1\r\n" + header + b"\r\nhello")
                assert _reply(sock).startswith(b"HTTP/1.0 400")
        assert _refused(_scrape(url), "body") == 2
    finally:
        metrics.close()


def test_the_connection_cap_stays_within_a_share_of_the_file_limit():
    """Whatever --metrics-max-connections asks, the endpoint keeps at most FILE_LIMIT_SHARE of the
    soft file limit, leaving the rest to the cache socket and the other listeners; /metrics shows it."""
    metrics = Metrics()
    with soft_file_limit(256):
        url = metrics.serve(0, limits=HTTPLimits(max_connections=1000))
    try:
        text = _scrape(url)
        assert f'kvdepot_listener_max_connections{{listener="metrics"}} {256 * FILE_LIMIT_SHARE:.1f}' in text
    finally:
        metrics.close()


@pytest.mark.parametrize(
    "flag", ["--metrics-max-connections=0", "--metrics-request-deadline=0", "--metrics-max-header-bytes=0"]
)
def test_metrics_bounds_must_be_positive(flag, capsys):
    """A bound of zero is a usage error (exit 2) naming the flag and why, before anything starts."""
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", flag, "--no-metrics"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert flag.split("=")[0] in err
    assert "must be" in err  # a bound refused, not a flag unknown
