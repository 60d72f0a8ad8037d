"""Soak: hostile local users of every listener of a real `kvdepot serve` while good clients work.

The server runs with its metrics endpoint on a loopback port and KV events on loopback tcp
(PUB and replay), so every listener a local user can reach without a secret exists; by default
it runs with a file limit of 1,024 it cannot raise (systemd's default soft limit, which issue 45's
server had when idle connections made libzmq abort it). Eighteen processes attack it for a
bounded time (`_soak_peers.py`): on the cache socket, random and mutated frames, requests whose
replies are never read, unterminated multipart messages, Hello churn, stores under thousands of
salts, messages of 4,096 `changes` frames of limit 16,384, and floods of one-byte requests; on
the metrics port, 1,100 idle connections, header lines dripped every 3 s, and 6.4 MB heads that
never end; on the KV-events ports, 1,100 idle tcp connections and subscribers that never read
(PUB), 16 MiB subscriptions, "from 0" replay requests from peers that never read, and 4 x 64 MiB
replay messages that never end.

Meanwhile the good side works: a cache client (`CacheClient`) stores chunks whose bytes are a
function of their key, looks them up, reads every byte back and releases; a scraper reads
/metrics every 0.25 s; and a new cache client connects over ipc every 0.5 s (the client that
used to abort the server). The same good side first runs alone against the idle server: its
round trips there are the baseline. Reported: the good client's lookup round trip p50/p99 under
attack against idle (target: p99 within 10x), its errors and wrong bytes (target: 0 and 0), the
scrapes and fresh connections that failed (target: 0), the server's RSS and private (anonymous)
memory before the attack, at its peak and after it (once the attackers have left, a fresh client
was answered and `--settle` seconds passed), the peak against a bound worked out from the
server's limits, what the server refused, and the count of aborted servers (target: 0; an
aborted server is started again so the run goes on).

Every hostile process runs in a session of its own, as another user's processes would: in
the good client's session, Linux's autogroup scheduling counted their CPU load against the good
client's own group, and its round trips waited on the OS rather than on the server (p99 13-15
ms instead of 4-5 on this machine). A last phase measures the same client against the idle
server while plain busy loops take the CPU the attack took (with --pin: one loop on the
server's CPU, which the server's own work on hostile traffic occupies; without: one loop per
hostile process, each in a session of its own and busy for the share of a CPU that process
used, so the OS shares the CPUs among as many groups as under attack). That is the share of
the figure that belongs to the OS scheduler, not to the server: on a 2-core machine a single
busy loop beside the client puts its p99 near 10x idle.

Run: python benchmarks/soak_bench.py [--quick] [--seconds N] [--pin] [--settle S] [--nofile N]
                                     [--attackers KIND,...]

With --pin the hostile peers run on the last CPU and the server and the good client on the
others, so the figure shows what the server does (fair queueing, bounded work per message)
rather than how the OS shares a CPU among busy processes.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import multiprocessing as mp
import os
import re
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import structlog

sys.path.insert(0, str(Path(__file__).parent))

import kvdepot.server
from _soak_peers import ATTACK, KINDS, Tally, Targets, connect_afresh, fill_change_log, good_side, hostile
from _util import progress, table
from kvdepot.server import ServerProcess
from kvdepot.server._kv_publisher import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_REPLAY_BYTES,
    DEFAULT_SUBSCRIBER_BYTES,
    MAX_BATCH_BYTES,
    REPLAY_HWM,
)
from kvdepot.server._metrics_http import DEFAULT_MAX_CONNECTIONS as METRICS_MAX_CONNECTIONS
from kvdepot.server._metrics_http import DEFAULT_MAX_HEADER_BYTES
from kvdepot.server.testing import free_port
from kvdepot.transport import CacheClient, TransportError
from kvdepot.transport._dispatch import MAX_MESSAGE_BYTES
from kvdepot.transport._server import MAX_UNREAD_BYTES

CHUNK = 64 * 1024 - 64
CAPACITY = "256MiB"
P99_TARGET = 10.0
#: The server's file limit, soft and hard: systemd's default soft limit, which the server of issue
#: 45's finding 1 had (here it cannot raise it either).
NOFILE = 1024
#: The period of a busy loop that takes part of a CPU (`spin`).
SPIN_PERIOD_S = 0.01
#: The hostile kinds that talk to the cache socket: each may hold its unread replies.
CACHE_KINDS = {"fuzz", "deaf", "multipart", "churn", "salts", "changes", "one-byte"}
#: Counters worth showing after the attack: what the server refused, dropped or cut.
REFUSALS = re.compile(r"refused|full|dropped|too_large|bad_frames|unread|gone|unauthorized")
LISTENER_REFUSED = re.compile(r'^kvdepot_listener_refused_total\{listener="(\w+)",reason="(\w+)"\} (\S+)$', re.M)
# Starts `kvdepot serve` (the rest of argv) with a soft and hard file limit of argv[1].
_WITH_FILE_LIMIT = (
    "import os, resource, sys; n = int(sys.argv[1]); "
    "resource.setrlimit(resource.RLIMIT_NOFILE, (n, n)); os.execv(sys.argv[2], sys.argv[2:])"
)


class Server(ServerProcess):
    """`kvdepot serve` with metrics and KV events on loopback tcp, and a file limit of `nofile`."""

    def __init__(self, workdir: Path, nofile: int) -> None:
        self.targets = Targets(f"ipc://{workdir}/kvdepot.sock", free_port(), free_port(), free_port())
        self.nofile = nofile
        super().__init__(
            self.targets.address,
            capacity=CAPACITY,
            args=[
                *("--metrics-port", str(self.targets.metrics_port)),
                *("--kv-events", f"tcp://127.0.0.1:{self.targets.pub_port}"),
                *("--kv-events-replay", f"tcp://127.0.0.1:{self.targets.replay_port}"),
                *("--log-level", "warning", "--log-format", "json"),
            ],
            log_path=workdir / "server.log",
        )

    def command(self) -> list[str]:
        command = super().command()
        return [sys.executable, "-c", _WITH_FILE_LIMIT, str(self.nofile), *command] if self.nofile else command


def memory(pid: int) -> tuple[int, int]:
    """`pid`'s resident bytes, and those of them that are private (anonymous: not the pool)."""
    fields = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "RssAnon"):
                fields[name] = int(value.split()[0]) * 1024
    return fields.get("VmRSS", 0), fields.get("RssAnon", 0)


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of every thread of `pid` so far (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def chunk_bytes(key: bytes) -> bytes:
    return hashlib.sha256(key).digest() * (CHUNK // 32) + b"\0" * (CHUNK % 32)


# -- the good side ---------------------------------------------------------------------------------


def good_client(address: str, seconds: float) -> dict[str, object]:
    """Stores, looks up, verifies and releases chunks for `seconds`; a failed request is an error,
    and so is a failed connection or Register (tried again 0.1 s later)."""
    rtts: list[float] = []
    errors = wrong = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            with CacheClient(address, timeout=5.0) as client:
                reply = client.register("good", 256, CHUNK).result(5)
                with kvdepot.server.PoolMapping(reply.pool.path, reply.pool.size) as pool:
                    while time.monotonic() < end:
                        keys = [os.urandom(32) for _ in range(4)]
                        try:
                            res = client.reserve("good", keys, CHUNK).result(5)
                            for slot in res.slots:
                                pool.write(slot.offset, chunk_bytes(keys[slot.index]))
                            if res.reservation_id:
                                client.commit(res.reservation_id).result(5)
                            start = time.perf_counter()
                            (hit,) = client.lookup([("good", keys)]).result(5).results
                            rtts.append(time.perf_counter() - start)
                            for key, found in zip(keys, hit.slots, strict=False):
                                wrong += pool.read(found.offset, found.length) != chunk_bytes(key)
                            if hit.lease_id:
                                client.release([hit.lease_id]).result(5)
                        except TransportError:
                            errors += 1
        except Exception:  # no client (the server is gone or did not answer Register)
            errors += 1
            time.sleep(0.1)
    return {"rtts": rtts, "errors": errors, "wrong": wrong}


def run_phase(targets: Targets, seconds: float) -> tuple[dict[str, object], dict[str, Tally]]:
    """The good cache client here, the scraper and the fresh clients beside it, for `seconds`."""
    receive, send = mp.Pipe(duplex=False)
    side = mp.Process(target=good_side, args=(targets, seconds, send), daemon=True)
    side.start()
    result = good_client(targets.address, seconds)
    tallies = receive.recv() if receive.poll(seconds + 30) else {"scrapes": Tally(), "fresh": Tally()}
    side.join(10)
    return result, tallies


def spin(cpus: set[int], seconds: float, duty: float = 1.0) -> None:
    """A plain busy loop in a session of its own, busy `duty` of each `SPIN_PERIOD_S` (sleeping
    the rest): the OS's share of the figure, without any kvdepot traffic."""
    os.setsid()
    os.sched_setaffinity(0, cpus)
    end = time.monotonic() + seconds
    while (now := time.monotonic()) < end:
        while time.monotonic() < now + duty * SPIN_PERIOD_S:
            pass
        if duty < 1:
            time.sleep((1 - duty) * SPIN_PERIOD_S)


# -- after the attack ------------------------------------------------------------------------------


def settle(server: Server, seconds: float) -> float | None:
    """Seconds until a fresh client was answered (None: not within 30 s), then `seconds` more."""
    start = time.monotonic()
    answered = None
    while time.monotonic() < start + 30:
        try:
            connect_afresh(server.address)
        except Exception:  # not yet: try again
            time.sleep(0.2)
            continue
        answered = time.monotonic() - start
        break
    time.sleep(seconds)
    return answered


def refusals(server: Server) -> list[tuple[str, str]]:
    """The server's counters of what it refused, dropped or cut (those not zero)."""
    counted: dict[str, float] = {}
    try:
        for name, value in server.stats().extra.items():
            if isinstance(value, int | float) and not isinstance(value, bool) and REFUSALS.search(name):
                counted[name] = value
        with urllib.request.urlopen(server.targets.metrics_url, timeout=5) as resp:
            text = resp.read().decode()
        for match in LISTENER_REFUSED.finditer(text):
            counted[f"{match.group(1)} listener: {match.group(2)}"] = float(match.group(3))
    except Exception as exc:  # the figures are missing, not the run
        return [("(could not read the counters)", f"{type(exc).__name__}: {exc}"[:100])]
    return [(name, f"{value:,.0f}") for name, value in counted.items() if value]


def rss_bound(base: int, kinds: list[str]) -> int:
    """What the server may hold by its limits: the pool; each hostile cache peer's unread
    replies besides its latest two reply messages; the replay buffer, every PUB connection's
    queue and every replay connection's queue; every metrics connection's head."""
    cache_peers = sum(kind in CACHE_KINDS for kind in kinds)
    return (
        base
        + kvdepot.server.parse_size(CAPACITY)
        + cache_peers * (MAX_UNREAD_BYTES + 2 * MAX_MESSAGE_BYTES)
        + DEFAULT_REPLAY_BYTES
        + DEFAULT_MAX_CONNECTIONS * (DEFAULT_SUBSCRIBER_BYTES + REPLAY_HWM * MAX_BATCH_BYTES)
        + METRICS_MAX_CONNECTIONS * DEFAULT_MAX_HEADER_BYTES
    )


# -- the run -----------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10 s phases instead of 30 s")
    parser.add_argument("--seconds", type=float, default=None)
    parser.add_argument(
        "--pin",
        action="store_true",
        help="hostile peers on the last CPU, the server and the good client on the others: what the server "
        "does for fairness, without the OS scheduler's share of the CPU in the figure",
    )
    parser.add_argument(
        "--settle", type=float, default=5.0, help="seconds after the attack before the RSS is read (default 5)"
    )
    parser.add_argument(
        "--nofile",
        type=int,
        default=NOFILE,
        help=f"the server's soft and hard file limit (default {NOFILE}; 0: this process's own)",
    )
    parser.add_argument(
        "--attackers",
        default=",".join(ATTACK),
        help=f"hostile processes, one per name (default: all of them); kinds: {', '.join(KINDS)}",
    )
    args = parser.parse_args()
    args.attackers = [kind for kind in args.attackers.split(",") if kind]
    if unknown := set(args.attackers) - set(KINDS):
        parser.error(f"unknown attackers: {', '.join(sorted(unknown))}")
    return args


class Watch:
    """Samples the server's memory (peaks) and the hostile processes' CPU time, every 0.1 s."""

    def __init__(self, server: Server, procs: Sequence[mp.process.BaseProcess]) -> None:
        assert server.pid is not None
        self.pid = server.pid
        self.procs = procs
        self.peak = memory(self.pid)
        self.hostile_cpu: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(OSError):
                rss, anon = memory(self.pid)
                self.peak = (max(self.peak[0], rss), max(self.peak[1], anon))
            for proc in self.procs:
                if proc.pid and (used := cpu_seconds(proc.pid)):
                    self.hostile_cpu[proc.pid] = used
            time.sleep(0.1)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def main() -> None:
    args = parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))  # the clients' own: warnings
    seconds = args.seconds or (10.0 if args.quick else 30.0)
    workdir = Path(tempfile.mkdtemp(prefix="kvd-soak-"))
    os.chmod(workdir, 0o700)
    print(
        f"kvdepot soak: the good side alone, then under {len(args.attackers)} hostile processes, {seconds:.0f} s each",
        flush=True,
    )
    server = Server(workdir, args.nofile)
    targets = server.targets
    aborted: list[str] = []

    def check(phase: str) -> None:
        """An aborted server is counted, and started again so the run goes on."""
        if not server.alive():
            assert server.process is not None
            log = server.log_path.read_text(errors="replace").strip() if server.log_path else ""
            last = log.splitlines()[-1][-200:] if log else "(no log)"
            aborted.append(f"{phase}: exit {server.process.returncode}, last log line: {last}")
            progress(f"the server ABORTED {aborted[-1]}; starting it again")
            server.start()

    with server:
        assert server.pid is not None
        start_rss = memory(server.pid)
        progress(f"idle server (file limit {args.nofile or 'inherited'}): the good side alone")
        cpu = {"idle": -cpu_seconds(server.pid)}
        idle, idle_side = run_phase(targets, seconds)
        cpu["idle"] += cpu_seconds(server.pid)
        cpus = sorted(os.sched_getaffinity(0))
        pinned = args.pin and len(cpus) > 1
        hostile_cpus = {cpus[-1]} if pinned else set(cpus)
        if pinned:
            for task in Path(f"/proc/{server.pid}/task").iterdir():  # every thread of the server
                os.sched_setaffinity(int(task.name), set(cpus[:-1]))
            os.sched_setaffinity(0, set(cpus[:-1]))
            progress(f"pinned: hostile peers on CPU {cpus[-1]}, the server and the good client on {cpus[:-1]}")
        if "changes" in args.attackers:
            progress("the change log filled past what one `changes` reads (one-byte chunks)")
            fill_change_log(targets.address)
        progress(f"under attack: {', '.join(args.attackers)} (one process each)")
        procs = [
            mp.Process(target=hostile, args=(kind, targets, seconds, i, hostile_cpus), daemon=True)
            for i, kind in enumerate(args.attackers)
        ]
        before = memory(server.pid)
        watch = Watch(server, procs)
        for proc in procs:
            proc.start()
        cpu["attack"] = -cpu_seconds(server.pid)
        attacked, attacked_side = run_phase(targets, seconds)
        cpu["attack"] += cpu_seconds(server.pid)
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
        watch.stop()
        check("under attack")
        progress(f"the attackers have left: a fresh client, then {args.settle:.0f} s")
        answered = settle(server, args.settle)
        check("after the attack")
        assert server.pid is not None
        after = memory(server.pid)
        restarted = ", a server started again" if aborted else ""
        refused = refusals(server)
        chunks = server.stats().chunks
        duties = [min(1.0, watch.hostile_cpu.get(proc.pid or 0, 0.0) / seconds) for proc in procs]
        spinners = (
            [mp.Process(target=spin, args=(set(cpus[:-1]), seconds), daemon=True)]
            if pinned
            else [mp.Process(target=spin, args=(hostile_cpus, seconds, duty), daemon=True) for duty in duties]
        )
        progress(
            f"idle server again, {len(spinners)} plain busy loop(s) where the attack's CPU load was "
            f"(the attackers used {sum(duties):.1f} CPUs)"
        )
        for proc in spinners:
            proc.start()
        cpu["busy"] = -cpu_seconds(server.pid)
        busy, busy_side = run_phase(targets, seconds)
        cpu["busy"] += cpu_seconds(server.pid)
        for proc in spinners:
            proc.join(seconds + 5)
        check("beside busy loops")
    report(
        seconds,
        cpu,
        {"idle": idle, "busy": busy, "attack": attacked},
        {"idle": idle_side, "busy": busy_side, "attack": attacked_side},
    )
    bound = rss_bound(start_rss[0], args.attackers)
    mib = 2**20
    table(
        "Server memory (RSS; private: anonymous memory, not the shared pool)",
        [
            ("at start", f"{start_rss[0] / mib:.0f} MiB", f"{start_rss[1] / mib:.0f} MiB"),
            ("before the attack", f"{before[0] / mib:.0f} MiB", f"{before[1] / mib:.0f} MiB"),
            ("peak under attack", f"{watch.peak[0] / mib:.0f} MiB", f"{watch.peak[1] / mib:.0f} MiB"),
            (f"after the attack (+{args.settle:.0f} s){restarted}", f"{after[0] / mib:.0f} MiB",
             f"{after[1] / mib:.0f} MiB"),
            ("after - before", f"{(after[0] - before[0]) / mib:+.0f} MiB", f"{(after[1] - before[1]) / mib:+.0f} MiB"),
            ("bound by the server's limits", f"{bound / mib:.0f} MiB", ""),
            ("peak within the bound", "yes" if watch.peak[0] <= bound else "NO", ""),
            ("chunks at the end", str(chunks), ""),
        ],
        ("figure", "RSS", "private"),
    )  # fmt: skip
    used: dict[str, float] = {}
    for kind, duty in zip(args.attackers, duties, strict=True):
        used[kind] = used.get(kind, 0.0) + duty
    table(
        "Hostile processes",
        [(kind, str(args.attackers.count(kind)), KINDS[kind] or "-", f"{share:.0%}") for kind, share in used.items()],
        ("kind", "processes", "issue 45 finding", "CPU used (of one CPU)"),
    )
    table(
        "What the server refused, dropped or cut (counted up to the end of the attack)",
        refused or [("(nothing)", "")],
        ("counter", "count"),
    )
    table(
        "Aborted servers",
        [
            ("aborted servers", str(len(aborted)), "met" if not aborted else "MISSED"),
            (
                "a fresh client after the attack",
                f"answered in {answered:.2f} s" if answered is not None else "NOT answered in 30 s",
                "met" if answered is not None else "MISSED",
            ),
            *((f"abort {i + 1}", text, "") for i, text in enumerate(aborted)),
        ],
        ("figure", "value", "target (0; answered)"),
    )


def report(
    seconds: float, cpu: dict[str, float], runs: dict[str, dict[str, object]], sides: dict[str, dict[str, Tally]]
) -> None:
    rtts: dict[str, list[float]] = {phase: run["rtts"] for phase, run in runs.items()}  # type: ignore[misc]
    p50 = {phase: percentile(values, 0.5) for phase, values in rtts.items()}
    p99 = {phase: percentile(values, 0.99) for phase, values in rtts.items()}
    phases = ("idle", "busy", "attack")
    ratio = p99["attack"] / p99["idle"]

    def ms(values: dict[str, float], digits: int = 2) -> list[str]:
        return [f"{values[p] * 1e3:.{digits}f} ms" if values[p] == values[p] else "none" for p in phases]  # NaN: none

    def times(a: float, b: float) -> str:
        return f"{a / b:.1f}x" if a / b == a / b else "n/a"  # not NaN: both phases had round trips

    def side(name: str, figure: str) -> list[str]:
        tallies = [sides[phase][name] for phase in phases]
        if figure == "ok":
            return [str(len(t.times)) for t in tallies]
        if figure == "failed":
            return [str(t.failures) for t in tallies]
        return ms({phase: percentile(t.times, 0.99) for phase, t in zip(phases, tallies, strict=True)}, 1)

    failed = sides["attack"]["scrapes"].failures + sides["attack"]["fresh"].failures
    table(
        "Good clients under hostile peers",
        [
            ("lookup round trip p50", *ms(p50), times(p50["attack"], p50["idle"]), times(p50["attack"], p50["busy"]),
             ""),
            ("lookup round trip p99", *ms(p99), times(p99["attack"], p99["idle"]), times(p99["attack"], p99["busy"]),
             "met" if ratio <= P99_TARGET else "MISSED"),
            ("longest round trip", *ms({p: max(v, default=float("nan")) for p, v in rtts.items()}, 1), "", "", ""),
            ("server CPU use", *(f"{cpu[phase] / seconds:.0%}" for phase in phases), "", "", ""),
            ("round trips", *(str(len(rtts[phase])) for phase in phases), "", "", ""),
            ("errors", *(str(runs[phase]["errors"]) for phase in phases), "", "",
             "met" if not runs["attack"]["errors"] else "MISSED"),
            ("wrong bytes (chunks)", *(str(runs[phase]["wrong"]) for phase in phases), "", "",
             "met" if not runs["attack"]["wrong"] else "MISSED"),
            ("/metrics scrapes answered", *side("scrapes", "ok"), "", "", ""),
            ("/metrics scrape p99", *side("scrapes", "p99"), "", "", ""),
            ("/metrics scrapes failed", *side("scrapes", "failed"), "", "",
             "met" if not sides["attack"]["scrapes"].failures else "MISSED"),
            ("fresh ipc clients answered", *side("fresh", "ok"), "", "", ""),
            ("fresh ipc client p99", *side("fresh", "p99"), "", "", ""),
            ("fresh ipc clients failed", *side("fresh", "failed"), "", "",
             "met" if not sides["attack"]["fresh"].failures else "MISSED"),
        ],
        ("figure", "idle", "busy loops", "under attack", "attack/idle", "attack/busy",
         f"target (p99 <= {P99_TARGET:.0f}x idle, 0, 0)"),
    )  # fmt: skip
    if failed:
        for name in ("scrapes", "fresh"):
            if first := sides["attack"][name].first_failure:
                print(f"  first failed {name} under attack: {first}")


if __name__ == "__main__":
    main()
