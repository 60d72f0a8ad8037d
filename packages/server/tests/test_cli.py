"""The `kvdepot` command line: flags, exit codes, subcommand discovery, stats formatting."""

from __future__ import annotations

import argparse
import json

import pytest

from kvdepot.server import SimpleCommand, format_stats, main
from kvdepot.server import _cli as cli
from kvdepot.transport import StatsReply


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--capacity", "lots"],
        ["serve", "--capacity", "0"],
        ["serve", "--metrics-port", "70000"],
        ["serve", "--chunk-size", "-3"],
        ["serve", "--log-format", "xml"],
        ["serve", "--bogus"],
        ["nosuchcommand"],
        [],
    ],
)
def test_bad_flags_exit_2_with_a_message(argv, capsys):
    """Unreadable flags stop before anything starts, with exit code 2 and a message on stderr."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert "error" in capsys.readouterr().err


def test_capacity_below_a_page_exits_2(tmp_path, capsys):
    """A capacity that cannot hold one page is a usage error (exit 2) that says what to change."""
    code = main(["serve", "--capacity", "4KiB", "--page-size", "1MiB", "--pool-dir", str(tmp_path), "--no-metrics"])
    assert code == 2
    assert "--capacity" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_stats_without_server_exits_1_naming_the_command(tmp_path, capsys):
    """`kvdepot stats` against nothing fails within its timeout and names `kvdepot serve`."""
    code = main(["stats", "--address", f"ipc://{tmp_path}/none.sock", "--timeout", "0.3"])
    assert code == 1
    assert "kvdepot serve" in capsys.readouterr().err


def test_stats_reaches_a_tcp_server_with_a_secret(make_server, tmp_path, capsys):
    """`kvdepot stats --auth-secret-file` says Hello with the server's secret; without it, it is refused."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = make_server(address=f"tcp://127.0.0.1:{port}", auth_secret="s3cret")
    secret_file = tmp_path / "secret"
    secret_file.write_text("s3cret\n")
    code = main(["stats", "--address", server.address, "--auth-secret-file", str(secret_file), "--json"])
    out = capsys.readouterr().out  # the server thread's log lines come first
    assert code == 0
    assert json.loads(out[out.index('{\n  "') :])["clients"] >= 1
    assert main(["stats", "--address", server.address, "--timeout", "1"]) == 1
    err = capsys.readouterr().err
    assert "kvdepot stats: " in err
    assert "secret" in err


def test_fetch_stats_leaves_no_thread_behind(make_server, tmp_path):
    """Repeated Stats probes (the connector's on-demand start asks in a loop) start no threads
    past the transport's shared ones, and each ends its session on the server."""
    import threading

    from kvdepot.server import fetch_stats

    server = make_server(address=f"ipc://{tmp_path}/stats.sock")
    fetch_stats(server.address, timeout=5.0)  # starts the transport's shared threads, once
    threads = threading.active_count()
    for _ in range(5):
        assert fetch_stats(server.address, timeout=5.0).clients == 1  # only the asking client
    assert threading.active_count() == threads


def test_stats_with_an_unreadable_secret_file_exits_1(tmp_path, capsys):
    """A secret file that cannot be read fails before any connection, naming the option."""
    code = main(["stats", "--auth-secret-file", str(tmp_path / "missing"), "--timeout", "0.3"])
    assert code == 1
    assert "--auth-secret-file" in capsys.readouterr().err


def test_entry_point_commands_are_added_and_broken_ones_skipped(monkeypatch, capsys):
    """Subcommands from the kvdepot.commands group run; a plugin that fails to load is skipped."""

    class FakeEP:
        def __init__(self, name, target):
            self.name, self.value, self._target = name, f"fake:{name}", target

        def load(self):
            if isinstance(self._target, Exception):
                raise self._target
            return self._target

    def run(args: argparse.Namespace) -> int:
        print(f"hello {args.who}")
        return 7

    demo = SimpleCommand("demo", "say hello", lambda p: p.add_argument("--who", default="x"), run)
    monkeypatch.setattr(
        cli, "entry_points", lambda group: [FakeEP("demo", demo), FakeEP("broken", ImportError("no vllm"))]
    )
    assert main(["demo", "--who", "kv"]) == 7
    captured = capsys.readouterr()
    assert "hello kv" in captured.out
    assert "broken" in captured.err


def test_stats_table_shows_the_figures():
    """The stats table shows use, hit ratio and per-salt usage with quotas."""
    reply = StatsReply(
        capacity_bytes=1 << 30,
        used_bytes=1 << 29,
        chunks=10,
        hits=3,
        misses=1,
        salt_bytes={"tenant": 1 << 20},
        extra={"quota:tenant": 2 << 20, "salt_chunks:tenant": 4},
    )
    text = format_stats(reply)
    assert "512.0 MiB of 1.0 GiB (50.0%)" in text
    assert "75.0%" in text
    assert "tenant" in text
    assert "2.0 MiB" in text


def test_stats_json_is_plain_data():
    """The JSON form carries every field plus the hit ratio."""
    from kvdepot.server._stats import stats_dict

    data = stats_dict(StatsReply(hits=1, misses=1))
    assert json.loads(json.dumps(data))["hit_ratio"] == 0.5


def test_busy_explicit_metrics_port_exits_2(tmp_path, capsys):
    """An explicitly requested metrics port that is taken is a usage error naming --no-metrics."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = main(
            [
                "serve",
                "--address",
                f"ipc://{tmp_path}/s.sock",
                "--capacity",
                "1MiB",
                "--pool-dir",
                str(tmp_path),
                "--metrics-port",
                str(port),
            ]
        )
    assert code == 2
    assert "--no-metrics" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.pool"))
