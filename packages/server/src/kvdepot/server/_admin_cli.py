"""`kvdepot ping`, `kvdepot clear` and `kvdepot quota`: a running server's administration.

Each is one short-lived `CacheClient`, so it reaches a server wherever a client can (ipc, or
tcp with `--auth-secret-file`) under the same rules as the client API: `clear` and `quota`
change what every tenant has, so a server on tcp without a shared secret refuses them.

Exit codes: 0 done; 1 no answer, refused or failed (the message says which); 2 a usage
error; 3 `clear` did part of it (chunks still held by a client, or a tier it could not clear).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

from kvdepot.server._cli_args import configure_logging, read_secret_file, seconds_arg
from kvdepot.server._errors import ServerArgumentError
from kvdepot.server._units import format_size, parse_size

EXIT_FAILED = 1
EXIT_PARTIAL = 3
# Seconds past the request's own timeout to wait for its future (the client fails it first).
RESULT_SLACK_S = 1.0
# Seconds between two clears of chunks a client still holds.
RETRY_INTERVAL_S = 0.2

T = TypeVar("T")


class _Failed(Exception):
    """A command's failure, already worded for the operator."""


def _common(parser: argparse.ArgumentParser, *, timeout: float = 3.0) -> None:
    from kvdepot.transport import default_address

    parser.add_argument("--address", default=None, help=f"server address (default {default_address()})")
    parser.add_argument(
        "--timeout", type=seconds_arg, default=timeout, help=f"seconds to wait for the server ({timeout:g})"
    )
    parser.add_argument(
        "--auth-secret-file",
        type=Path,
        default=None,
        help="file with the shared secret of a tcp server started with --auth-secret-file",
    )
    parser.add_argument("--json", action="store_true", help="print JSON")


def _bytes(text: str) -> int:
    try:
        return parse_size(text)
    except ServerArgumentError as exc:
        raise argparse.ArgumentTypeError(exc.message) from None


def _run(name: str, args: argparse.Namespace, body: Callable[[Any], int]) -> int:
    """Open a client for ``args``, run ``body(client)``, and turn every failure into a message."""
    from kvdepot.transport import CacheClient, default_address

    configure_logging("pretty", "warning", "stderr")
    args.address = args.address or default_address()
    client = None
    try:
        secret = read_secret_file(args.auth_secret_file)
        client = CacheClient(args.address, timeout=args.timeout, client_name=f"kvdepot-{name}", auth_secret=secret)
        return body(client)
    except _Failed as exc:
        sys.stderr.write(f"kvdepot {name}: {exc}\n")
    except Exception as exc:
        sys.stderr.write(f"kvdepot {name}: {_explain(exc, args)}\n")
    finally:
        if client is not None:
            client.close()
    return EXIT_FAILED


def _explain(exc: BaseException, args: argparse.Namespace) -> str:
    """What went wrong, and what to do about it."""
    from kvdepot.transport import DeadlineExceededError, UnauthorizedError

    message = getattr(exc, "message", None) or str(exc) or type(exc).__name__
    if isinstance(exc, UnauthorizedError):
        if args.auth_secret_file is None and "secret" in message:
            return f"{message}; pass --auth-secret-file with the server's secret"
        return message
    if isinstance(exc, TimeoutError) and not isinstance(exc, DeadlineExceededError):
        return (
            f"no kvdepot server answered at {args.address} within {args.timeout:g} s; is it running "
            f"(`kvdepot serve --address {args.address}`), and is --address right?"
        )
    return message


def _result(future: Future[T], args: argparse.Namespace) -> T:
    return future.result(args.timeout + RESULT_SLACK_S)


def _print(data: dict[str, Any] | list[Any]) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=True) + "\n")


# -- ping ---------------------------------------------------------------------------------


def configure_ping(parser: argparse.ArgumentParser) -> None:
    _common(parser)


def run_ping(args: argparse.Namespace) -> int:
    """Exit 0 once the server answers a handshake (secret included); for probes and scripts."""

    def ping(client: Any) -> int:
        started = time.perf_counter()
        hello = _result(client.hello(), args)
        elapsed_ms = (time.perf_counter() - started) * 1000
        if args.json:
            _print(
                {
                    "address": args.address,
                    "server_version": hello.server_version,
                    "server_id": hello.server_id,
                    "protocol_version": hello.protocol_version,
                    "round_trip_ms": round(elapsed_ms, 3),
                }
            )
        else:
            sys.stdout.write(
                f"kvdepot-server {hello.server_version} at {args.address} answered in {elapsed_ms:.1f} ms "
                f"(server id {hello.server_id})\n"
            )
        return 0

    return _run("ping", args, ping)


# -- clear --------------------------------------------------------------------------------


def configure_clear(parser: argparse.ArgumentParser) -> None:
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--salt", help="the cache_salt whose chunks to remove ('' for requests without one)")
    which.add_argument("--all", action="store_true", help="remove every salt's chunks")
    parser.add_argument(
        "--tiers",
        action="store_true",
        help="also drop the writes queued for the tiers below RAM and delete the chunks there: this "
        "server's disk tier, and the remote tier. The remote tier is shared: its copies go for every "
        "server using it (each server's RAM and disk are its own: clear each server to remove a "
        "tenant everywhere)",
    )

    parser.add_argument(
        "--wait",
        type=seconds_arg,
        default=30.0,
        help="seconds to keep clearing chunks that a client holds while they are read (30)",
    )
    _common(parser, timeout=60.0)


def run_clear(args: argparse.Namespace) -> int:
    """Clear RAM slice by slice; with --tiers, the tiers once RAM is done; then what clients held."""
    salt = None if args.all else args.salt

    def clear(client: Any) -> int:
        removed, tiers, errors = 0, {}, {}
        ask_tiers = args.tiers
        deadline = time.monotonic() + args.wait
        while True:
            reply = _result(client.clear(salt, tiers=ask_tiers), args)
            removed += reply.removed
            if reply.more:
                continue
            if ask_tiers:  # the last slice's reply: the tiers are done
                tiers, errors, ask_tiers = dict(reply.tiers), dict(reply.tier_errors), False
            if not reply.left or time.monotonic() >= deadline:
                break
            time.sleep(RETRY_INTERVAL_S)
        report = {"salt": salt, "all": salt is None, "ram": removed, "left": reply.left}
        return _report_clear(args, {**report, "tiers": tiers, "tier_errors": errors})

    return _run("clear", args, clear)


def _report_clear(args: argparse.Namespace, report: dict[str, Any]) -> int:
    tiers: dict[str, int] = report["tiers"]
    errors: dict[str, str] = report["tier_errors"]
    left: int = report["left"]
    if args.json:
        _print(report)
    else:
        what = "every salt" if report["all"] else f"salt {report['salt']!r}"
        lines = [f"cleared {what}: {report['ram']} chunks from RAM"]
        lines += [f"  {kind}: {count} objects deleted" for kind, count in sorted(tiers.items())]
        if args.tiers and not tiers and not errors:
            lines.append("  (this server has no tiers below RAM)")
        sys.stdout.write("\n".join(lines) + "\n")
    for kind, why in sorted(errors.items()):
        sys.stderr.write(f"kvdepot clear: the {kind} tier was not cleared: {why}; run the clear again\n")
    if left:
        sys.stderr.write(
            f"kvdepot clear: {left} chunks are still held by clients after {args.wait:g} s; run the clear again\n"
        )
    return EXIT_PARTIAL if left or errors else 0


# -- quota --------------------------------------------------------------------------------


def configure_quota(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    get = actions.add_parser("get", help="print one salt's quota, or every quota")
    get.add_argument("salt", nargs="?", default=None, help="a cache_salt (default: every salt with a quota)")
    set_ = actions.add_parser(
        "set",
        help="limit the bytes a salt holds in RAM, on this server's disk tier and in the remote tier "
        "(counted there across the servers that share it); its oldest chunks go now if it is over",
    )
    set_.add_argument("salt", help="a cache_salt")
    set_.add_argument("bytes", type=_bytes, help="bytes, e.g. 4GiB or 500MB (0 keeps none)")
    unset = actions.add_parser("unset", help="remove a salt's own quota (--default-quota, if set, applies)")
    unset.add_argument("salt", help="a cache_salt")
    for sub in (get, set_, unset):
        _common(sub)


def run_quota(args: argparse.Namespace) -> int:
    def quota(client: Any) -> int:
        if args.action == "get":
            quotas = _result(client.get_quotas(), args).quotas
            if args.salt is not None:
                if args.salt not in quotas:
                    raise _Failed(f"salt {args.salt!r} has no quota of its own")
                quotas = {args.salt: quotas[args.salt]}
        else:
            limit = args.bytes if args.action == "set" else None
            quotas = _result(client.set_quota(args.salt, limit), args).quotas
            quotas = {args.salt: quotas[args.salt]} if args.salt in quotas else {}
        if args.json:
            _print(quotas)
        elif args.action == "unset":
            sys.stdout.write(f"salt {args.salt!r} has no quota of its own now\n")
        elif not quotas:
            sys.stdout.write("no salt has a quota of its own\n")
        else:
            width = max(len(repr(salt)) for salt in quotas)
            for salt, limit in sorted(quotas.items()):
                sys.stdout.write(f"{salt!r:<{width}}  {format_size(limit)} ({limit} bytes)\n")
        return 0

    return _run("quota", args, quota)
