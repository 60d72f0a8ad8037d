"""`kvdepot stats`: ask a running server for its figures and print them."""

from __future__ import annotations

from typing import Any

import msgspec

from kvdepot.server._units import format_size
from kvdepot.transport import CacheClient, DeadlineExceededError, StatsReply, default_address

# Seconds past its own deadline that a Stats request's future is waited for: the client fails
# it at the deadline with a typed error that names the address; this only bounds a stuck loop.
RESULT_SLACK_S = 1.0


def fetch_stats(address: str | None = None, *, timeout: float = 3.0, auth_secret: str | None = None) -> StatsReply:
    """One Stats request through a short-lived `CacheClient` (Hello with `auth_secret`, Stats
    and EndSession in one message), so it reaches any server a client can: tcp with a secret
    included. No server within `timeout` seconds: `DeadlineExceededError` naming the address
    and the command that starts one."""
    address = address or default_address()
    client = CacheClient(address, timeout=timeout, client_name="kvdepot-stats", auth_secret=auth_secret)
    try:
        with client.batch() as batch:
            stats = batch.stats()
            batch.end_session()  # in the same message: the server forgets this client at once
        return stats.result(timeout + RESULT_SLACK_S)
    except DeadlineExceededError:
        raise  # the client's own, which says why (no server, a refused handshake, a slow one)
    except TimeoutError:
        raise DeadlineExceededError(
            f"no kvdepot server answered at {address} within {timeout:g} s; start one with "
            f"`kvdepot serve --address {address}` or pass the right --address",
            address=address,
            timeout=timeout,
        ) from None
    finally:
        client.close(end_session=False)


def stats_dict(reply: StatsReply) -> dict[str, Any]:
    """The reply as plain JSON-able data, with the hit ratio added."""
    data: dict[str, Any] = msgspec.to_builtins(reply)
    data.pop("type", None)
    looked = reply.hits + reply.misses
    data["hit_ratio"] = reply.hits / looked if looked else None
    return data


def format_stats(reply: StatsReply) -> str:
    """A readable table of the figures `kvdepot stats` prints."""
    extra = reply.extra
    looked = reply.hits + reply.misses
    ratio = f"{reply.hits / looked:.1%}" if looked else "-"
    used = f"{format_size(reply.used_bytes)} of {format_size(reply.capacity_bytes)}"
    if reply.capacity_bytes:
        used += f" ({reply.used_bytes / reply.capacity_bytes:.1%})"
    rows: list[tuple[str, str]] = [
        ("server", f"kvdepot {extra.get('server_version', '?')}, up {extra.get('uptime_s', '?')} s"),
        ("pool", str(extra.get("pool_path", "?"))),
        ("used", used),
        (
            "pages free",
            f"{extra.get('pages_free', '?')} of {extra.get('pages_total', '?')}"
            f" ({format_size(int(extra.get('page_size') or 0))} each)",
        ),
        (
            "chunks",
            f"{reply.chunks} committed, {extra.get('pending_chunks', 0)} pending, "
            f"{extra.get('leased_chunks', 0)} leased, {extra.get('quarantined_chunks', 0)} quarantined",
        ),
        ("hit ratio", f"{ratio} ({reply.hits} hits, {reply.misses} misses)"),
        ("stored", format_size(reply.bytes_stored)),
        ("loaded", format_size(reply.bytes_loaded)),
        ("evictions", str(reply.evictions)),
        ("leases", f"{reply.leases} live, {extra.get('expired_leases', 0)} expired"),
        ("reservations", f"{reply.reservations} live, {extra.get('expired_reservations', 0)} expired"),
        ("clients", str(reply.clients)),
        ("bad frames", str(extra.get("transport_bad_frames", 0))),
    ]
    rows += _tier_rows(extra)
    width = max(len(name) for name, _ in rows)
    lines = [f"{name:<{width}}  {value}" for name, value in rows]
    if reply.salt_bytes:
        lines.append("")
        lines.append(f"{'cache_salt':<24} {'used':>12} {'chunks':>8} {'quota':>12}")
        for salt, used_bytes in sorted(reply.salt_bytes.items(), key=lambda kv: -kv[1]):
            quota = extra.get(f"quota:{salt}")
            label = salt if salt else "(none)"
            lines.append(
                f"{label[:24]:<24} {format_size(used_bytes):>12} {extra.get(f'salt_chunks:{salt}', 0)!s:>8} "
                f"{format_size(int(quota)) if isinstance(quota, int) else '-':>12}"
            )
    return "\n".join(lines) + "\n"


def _tier_rows(extra: dict[str, Any]) -> list[tuple[str, str]]:
    """One row per tier below RAM, from the `tier:KIND:FIGURE` entries of Stats' extra."""
    kinds = sorted({name.split(":")[1] for name in extra if name.startswith("tier:")})
    rows = []
    for kind in kinds:
        f = {name.split(":", 2)[2]: value for name, value in extra.items() if name.startswith(f"tier:{kind}:")}
        used = f"{format_size(int(f['used_bytes'] or 0))}" if f.get("used_bytes") is not None else "?"
        if f.get("capacity"):
            used += f" of {format_size(int(f['capacity']))}"
        rows.append(
            (
                f"tier {kind}",
                f"{f.get('state')}, {used}, {f.get('objects', '?')} chunks, {f.get('hits', 0)} hits, "
                f"{f.get('misses', 0)} misses ({f.get('late', 0)} late, {f.get('corrupt', 0)} corrupt, "
                f"{f.get('unknown_format', 0)} of an unknown format), "
                f"read {format_size(int(f.get('bytes_read') or 0))}, "
                f"written {format_size(int(f.get('bytes_written') or 0))}, "
                f"queue {f.get('write_queue', 0)} ({f.get('write_dropped', 0)} dropped), {f.get('errors', 0)} errors",
            )
        )
    return rows
