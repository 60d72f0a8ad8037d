"""The `kvdepot` command: `serve`, `stats`, `query`, `ping`, `clear`, `quota`, and subcommands other distributions add.

Adding a subcommand from another distribution: expose an object (a module or any object)
with `name: str`, `help: str`, `configure(parser: argparse.ArgumentParser) -> None` and
`run(args: argparse.Namespace) -> int`, and name it in that distribution's pyproject::

    [project.entry-points."kvdepot.commands"]
    demo = "kvdepot.vllm_connector._demo:command"

Built-in commands win over entry points of the same name; an entry point that fails to load
is skipped (with a warning on stderr unless the command run is a built-in), so a broken
plugin never breaks `serve` or `stats`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points
from pathlib import Path
from typing import Protocol

import attrs

from kvdepot.server import _admin_cli, _dashboard, _label_key, _query_cli, _serve_cli
from kvdepot.server._cli_args import configure_logging, read_secret_file, seconds_arg
from kvdepot.server._version import __version__

ENTRY_POINT_GROUP = "kvdepot.commands"


class Command(Protocol):
    """What a `kvdepot` subcommand provides (see the module docstring)."""

    @property
    def name(self) -> str: ...

    @property
    def help(self) -> str: ...

    def configure(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


@attrs.frozen
class SimpleCommand:
    """A subcommand made of two functions."""

    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# -- stats --------------------------------------------------------------------------------


def _configure_stats(parser: argparse.ArgumentParser) -> None:
    from kvdepot.transport import default_address

    parser.add_argument("--address", default=None, help=f"server address (default {default_address()})")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--timeout", type=seconds_arg, default=3.0, help="seconds to wait for the server")
    parser.add_argument(
        "--auth-secret-file",
        type=Path,
        default=None,
        help="file with the shared secret of a tcp server started with --auth-secret-file",
    )


def _run_stats(args: argparse.Namespace) -> int:
    from kvdepot.server._stats import fetch_stats, format_stats, stats_dict

    configure_logging("pretty", "warning", "stderr")
    try:
        secret = read_secret_file(args.auth_secret_file)
        reply = fetch_stats(args.address, timeout=args.timeout, auth_secret=secret)
    except Exception as exc:
        sys.stderr.write(f"kvdepot stats: {getattr(exc, 'message', None) or exc}\n")
        return 1
    if args.json:
        sys.stdout.write(json.dumps(stats_dict(reply), indent=2, sort_keys=True) + "\n")
    else:
        sys.stdout.write(format_stats(reply))
    return 0


# -- the command --------------------------------------------------------------------------

BUILTIN_COMMANDS: list[Command] = [
    SimpleCommand("serve", "run a kvdepot cache server", _serve_cli.configure, _serve_cli.run),
    SimpleCommand("stats", "print the figures of a running server", _configure_stats, _run_stats),
    SimpleCommand(
        "query", "how long a prefix of a prompt a server holds, in RAM and below", _query_cli.configure, _query_cli.run
    ),
    SimpleCommand(
        "ping", "exit 0 when a server answers (for health probes)", _admin_cli.configure_ping, _admin_cli.run_ping
    ),
    SimpleCommand(
        "clear",
        "remove a salt's chunks, or all, from RAM and with --tiers from the tiers below",
        _admin_cli.configure_clear,
        _admin_cli.run_clear,
    ),
    SimpleCommand("quota", "get, set or unset a salt's quota", _admin_cli.configure_quota, _admin_cli.run_quota),
    SimpleCommand(
        "label", "print the label /metrics, logs and KV events give a salt", _label_key.configure, _label_key.run
    ),
    _dashboard.command,
]


def discover_commands() -> tuple[list[Command], list[str]]:
    """Built-in commands plus those from the `kvdepot.commands` entry points, and load errors."""
    commands = list(BUILTIN_COMMANDS)
    names = {c.name for c in commands}
    problems: list[str] = []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in names:
            continue
        try:
            command = ep.load()
            if callable(command) and not hasattr(command, "run"):
                command = command()
            for attr in ("name", "help", "configure", "run"):
                if not hasattr(command, attr):
                    raise TypeError(f"has no {attr!r}")
        except Exception as exc:
            problems.append(f"subcommand {ep.name!r} from {ep.value} is unavailable: {exc}")
            continue
        commands.append(command)
        names.add(command.name)
    return commands, problems


def build_parser(commands: Sequence[Command]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvdepot", description="kvdepot: a KV-cache server for vLLM.")
    parser.add_argument("--version", action="version", version=f"kvdepot-server {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in commands:
        child = sub.add_parser(command.name, help=command.help, description=command.help)
        command.configure(child)
        child.set_defaults(_run=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `kvdepot` console script; returns the exit code."""
    commands, problems = discover_commands()
    parser = build_parser(commands)
    args = parser.parse_args(argv)
    for problem in problems:
        if args.command not in {command.name for command in BUILTIN_COMMANDS}:
            sys.stderr.write(f"kvdepot: warning: {problem}\n")
    code: int = args._run(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
