"""`kvdepot query`: how long a prefix of a prompt a server holds, in RAM and in each tier below.

The prompt's chunk keys are computed here with `kvdepot.core`, under the namespace an engine
uses: its model identity, KV layout name and KV world size, which the connector logs at start
(`kvdepot: chunk keys use namespace ...`), and the request's cache salt. One row per salt.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvdepot.core import DEFAULT_CHUNK_SIZE, Namespace, chunk_keys
from kvdepot.server._cli_args import configure_logging, read_secret_file


def configure(parser: argparse.ArgumentParser) -> None:
    from kvdepot.transport import default_address

    parser.add_argument("--address", default=None, help=f"server address (default {default_address()})")
    parser.add_argument("--model", required=True, help="the engine's model identity, as the connector logs it")
    parser.add_argument("--layout", required=True, help="the engine's KV layout name, as the connector logs it")
    parser.add_argument("--kv-world-size", type=int, default=1, help="the engine's KV world size (default 1)")
    parser.add_argument("--kv-rank", type=int, default=0, help="whose chunks to ask about (default rank 0)")
    parser.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE, help="tokens per chunk (default 256)")
    parser.add_argument(
        "--salt", action="append", default=None, help="a cache_salt to ask under (repeatable; default: none)"
    )
    tokens = parser.add_mutually_exclusive_group(required=True)
    tokens.add_argument("--tokens", help="the prompt's token ids, comma-separated")
    tokens.add_argument("--tokens-file", type=Path, help="a JSON file with the prompt's token ids (a list of ints)")
    parser.add_argument("--ram-only", action="store_true", help="ask about RAM only, not the tiers below")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the server")
    parser.add_argument("--auth-secret-file", type=Path, default=None, help="the shared secret of a tcp server")


def run(args: argparse.Namespace) -> int:
    from kvdepot.transport import query_prefixes

    configure_logging("pretty", "warning", "stderr")
    try:
        tokens = _tokens(args)
        salts = args.salt or [""]
        items = []
        for salt in salts:
            ns = Namespace(
                model=args.model,
                layout=args.layout,
                kv_world_size=args.kv_world_size,
                kv_rank=args.kv_rank,
                cache_salt=salt,
            )
            items.append((salt, chunk_keys(ns, tokens, chunk_size=args.chunk_size)))
        results = query_prefixes(
            args.address,
            items,
            tiers=not args.ram_only,
            timeout=args.timeout,
            auth_secret=read_secret_file(args.auth_secret_file),
        )
    except Exception as exc:
        sys.stderr.write(f"kvdepot query: {getattr(exc, 'message', None) or exc}\n")
        return 1
    rows = [_row(salt, len(keys), r, args.chunk_size) for (salt, keys), r in zip(items, results, strict=True)]
    if args.json:
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
    else:
        sys.stdout.write(_table(rows))
    return 0


def _tokens(args: argparse.Namespace) -> list[int]:
    if args.tokens_file is not None:
        tokens = json.loads(args.tokens_file.read_text())
    else:
        tokens = [int(t) for t in args.tokens.replace(" ", "").split(",") if t]
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise ValueError("the token ids must be a list of ints")
    return tokens


def _row(salt: str, chunks: int, result: Any, chunk_size: int) -> dict[str, Any]:
    return {
        "salt": salt,
        "chunks": chunks,
        "ram": result.ram,
        "below": result.below,
        "tiers": dict(result.tiers),
        "hit_tokens": (result.ram + result.below) * chunk_size,
    }


def _table(rows: list[dict[str, Any]]) -> str:
    kinds = sorted({kind for row in rows for kind in row["tiers"]})
    head = ["salt", "chunks", "ram", "below", *kinds, "hit tokens"]
    lines = [head]
    for row in rows:
        lines.append(
            [
                row["salt"] or "(none)",
                str(row["chunks"]),
                str(row["ram"]),
                str(row["below"]),
                *[str(row["tiers"].get(kind, "-")) for kind in kinds],
                str(row["hit_tokens"]),
            ]
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "".join(
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip() + "\n" for line in lines
    )
