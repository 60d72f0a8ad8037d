"""The Grafana dashboard for a kvdepot server's metrics, built in code and shipped as JSON.

`build_dashboard()` builds it with grafana-foundation-sdk (`pip install 'kvdepot-server[dashboard]'`);
the package ships what it built, `dashboards/kvdepot.json`, so the server and `kvdepot dashboard`
never need the SDK. A test checks that building it again gives the shipped file byte for byte:
after a change here, write it again with `kvdepot dashboard --generate --output <that file>`.

Every query names the `$datasource` and `$instance` variables and only metrics `_metrics.py`
exports; `PANELS` lists them for the docs and the tests.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from importlib.resources import files
from pathlib import Path
from typing import Any

import attrs

#: The shipped dashboard: this file of this directory of the kvdepot.server package.
DASHBOARD_RESOURCE = ("dashboards", "kvdepot.json")
UID = "kvdepot"
# Salts drawn in the per-salt panels, as the `top_salts` variable offers them (first: default).
TOP_SALTS_CHOICES = ("10", "5", "20")


def _m(name: str, **labels: str) -> str:
    """A selector of `name` on the chosen instances; a value with `|` is matched as a regex."""
    matchers = ['instance=~"$instance"']
    matchers += [f'{key}{"=~" if "|" in value else "="}"{value}"' for key, value in labels.items()]
    return name + "{" + ",".join(matchers) + "}"


def _rate(selector: str) -> str:
    return f"rate({selector}[$__rate_interval])"


def _ratio(hits: str, misses: str, by: str = "") -> str:
    """hits / (hits + misses) of two counter selectors, summed `by` some labels."""
    agg = f"sum by ({by}) " if by else "sum"
    return f"{agg}({_rate(hits)}) / ({agg}({_rate(hits)}) + {agg}({_rate(misses)}))"


def _quantile(q: str, request: str) -> str:
    bucket = _m("kvdepot_request_duration_seconds_bucket", request=request)
    return f"histogram_quantile({q}, sum by (le) ({_rate(bucket)}))"


_SALT_HITS = _m("kvdepot_salt_hits_total")
_SALT_MISSES = _m("kvdepot_salt_misses_total")
_SALT_LOOKUPS = f"sum by (salt) ({_rate(_SALT_HITS)}) + sum by (salt) ({_rate(_SALT_MISSES)})"
_TRANSPORT_ERRORS = "errors|bad_frames|too_large|version_mismatches|unauthorized|handler_failures|peers_dropped"
_TIER_ERRORS = "errors|corrupt|late|failed_writes|write_dropped|skipped|outages"
_QUANTILES = (("0.5", "p50"), ("0.9", "p90"), ("0.99", "p99"))


@attrs.frozen
class Query:
    expr: str
    legend: str


@attrs.frozen
class PanelSpec:
    """One panel: its row, title, Grafana unit, what it shows, and its queries."""

    row: str
    title: str
    unit: str
    description: str
    queries: tuple[Query, ...]
    width: int = 12


def _panels() -> tuple[PanelSpec, ...]:
    q = Query
    latency = tuple(
        PanelSpec(
            "Latency",
            f"{request.capitalize()} latency",
            "s",
            f"Seconds the server's loop spent on a {request} (kvdepot_request_duration_seconds, "
            'request="'
            + request
            + '"): p50, p90, p99.'
            + (" A lookup's wait for the tiers below RAM is not in it." if request == "lookup" else ""),
            tuple(q(_quantile(quantile, request), legend) for quantile, legend in _QUANTILES),
            width=8,
        )
        for request in ("lookup", "reserve", "commit")
    )
    return (
        PanelSpec(
            "Hit ratio",
            "Hit ratio by tier",
            "percentunit",
            "Chunk keys found over keys looked up. RAM: kvdepot_hits_total and kvdepot_misses_total (chunks "
            "read back from a tier count as RAM hits). Tiers below RAM: kvdepot_tier figures hits and misses "
            "(of the keys asked from that tier).",
            (
                q(_ratio(_m("kvdepot_hits_total"), _m("kvdepot_misses_total")), "ram"),
                q(_ratio(_m("kvdepot_tier", figure="hits"), _m("kvdepot_tier", figure="misses"), "tier"), "{{tier}}"),
            ),
        ),
        PanelSpec(
            "Hit ratio",
            "Hit ratio by salt (busiest $top_salts)",
            "percentunit",
            "Per cache_salt label (a digest), for the $top_salts salts with the most keys looked up: "
            "kvdepot_salt_hits_total over kvdepot_salt_hits_total + kvdepot_salt_misses_total. The server "
            "names the 64 salts with the most lookups among the first 1024 it saw.",
            (
                q(
                    f"({_ratio(_SALT_HITS, _SALT_MISSES, 'salt')}) and topk($top_salts, {_SALT_LOOKUPS})",
                    "{{salt}}",
                ),
            ),
        ),
        PanelSpec(
            "Capacity",
            "Bytes per tier",
            "bytes",
            "RAM: kvdepot_used_bytes of kvdepot_capacity_bytes. Tiers below RAM: kvdepot_tier figures "
            "used_bytes and capacity (where the tier knows them).",
            (
                q(f"sum({_m('kvdepot_used_bytes')})", "ram used"),
                q(f"sum({_m('kvdepot_capacity_bytes')})", "ram capacity"),
                q(f"sum by (tier) ({_m('kvdepot_tier', figure='used_bytes')})", "{{tier}} used"),
                q(f"sum by (tier) ({_m('kvdepot_tier', figure='capacity')})", "{{tier}} capacity"),
            ),
        ),
        PanelSpec(
            "Capacity",
            "Chunks per tier",
            "short",
            "RAM: kvdepot_chunks (committed). Tiers below RAM: kvdepot_tier figure objects.",
            (
                q(f"sum({_m('kvdepot_chunks')})", "ram"),
                q(f"sum by (tier) ({_m('kvdepot_tier', figure='objects')})", "{{tier}}"),
            ),
        ),
        PanelSpec(
            "Capacity",
            "Bytes per salt (largest $top_salts)",
            "bytes",
            "kvdepot_salt_used_bytes per cache_salt label: the salts holding the most bytes.",
            (q(f"topk($top_salts, {_m('kvdepot_salt_used_bytes')})", "{{salt}}"),),
        ),
        PanelSpec(
            "Capacity",
            "Evictions and expiries",
            "ops",
            "Per second: chunks evicted to make room (kvdepot_evictions_total), leases and reservations "
            "that expired (kvdepot_expired_leases_total, kvdepot_expired_reservations_total), reserves that "
            "could not place every key (kvdepot_full_reserves_total).",
            (
                q(f"sum({_rate(_m('kvdepot_evictions_total'))})", "evicted chunks"),
                q(f"sum({_rate(_m('kvdepot_expired_leases_total'))})", "expired leases"),
                q(f"sum({_rate(_m('kvdepot_expired_reservations_total'))})", "expired reservations"),
                q(f"sum({_rate(_m('kvdepot_full_reserves_total'))})", "full reserves"),
            ),
        ),
        PanelSpec(
            "Capacity",
            "Chunks committed, read back, evicted, cleared",
            "ops",
            "Per second, from the index's event stream: chunks committed by clients, read back into RAM "
            "from a tier below it, evicted, and removed by a clear (kvdepot_chunk_changes_total).",
            (q(f"sum by (change) ({_rate(_m('kvdepot_chunk_changes_total'))})", "{{change}}"),),
        ),
        *latency,
        PanelSpec(
            "Latency",
            "Requests by type",
            "reqps",
            "Requests per second by type (kvdepot_request_duration_seconds_count).",
            (q(f"sum by (request) ({_rate(_m('kvdepot_request_duration_seconds_count'))})", "{{request}}"),),
            width=24,
        ),
        PanelSpec(
            "Tiers",
            "Read and write rates",
            "Bps",
            "Bytes per second. RAM: handed out by lookups (kvdepot_loaded_bytes_total) and committed "
            "(kvdepot_stored_bytes_total). Tiers below RAM: kvdepot_tier figures bytes_read and bytes_written.",
            (
                q(f"sum({_rate(_m('kvdepot_loaded_bytes_total'))})", "ram read"),
                q(f"sum({_rate(_m('kvdepot_stored_bytes_total'))})", "ram written"),
                q(f"sum by (tier) ({_rate(_m('kvdepot_tier', figure='bytes_read'))})", "{{tier}} read"),
                q(f"sum by (tier) ({_rate(_m('kvdepot_tier', figure='bytes_written'))})", "{{tier}} written"),
            ),
        ),
        PanelSpec(
            "Tiers",
            "Write-behind queue",
            "short",
            "Chunks waiting to be written to each tier below RAM (kvdepot_tier figure write_queue), and "
            "whether the tier is up (kvdepot_tier figure up: 1 or 0).",
            (
                q(f"sum by (tier) ({_m('kvdepot_tier', figure='write_queue')})", "{{tier}} queued"),
                q(f"min by (tier) ({_m('kvdepot_tier', figure='up')})", "{{tier}} up"),
            ),
        ),
        PanelSpec(
            "Errors",
            "Errors by kind",
            "ops",
            "Per second. Transport (kvdepot_transport_events_total): error replies, bad and oversized frames, "
            "version mismatches, refused secrets, handler failures, peers dropped for not reading. Tiers below "
            "RAM (kvdepot_tier): failed calls, corrupt objects, late reads, failed and dropped writes, reads "
            "skipped while down, outages.",
            (
                q(
                    f"sum by (event) ({_rate(_m('kvdepot_transport_events_total', event=_TRANSPORT_ERRORS))})",
                    "{{event}}",
                ),
                q(f"sum by (tier, figure) ({_rate(_m('kvdepot_tier', figure=_TIER_ERRORS))})", "{{tier}} {{figure}}"),
            ),
            width=24,
        ),
        PanelSpec(
            "Clients",
            "Clients, leases and reservations",
            "short",
            "kvdepot_clients (with a session), kvdepot_leases and kvdepot_reservations (live).",
            (
                q(f"sum({_m('kvdepot_clients')})", "clients"),
                q(f"sum({_m('kvdepot_leases')})", "leases"),
                q(f"sum({_m('kvdepot_reservations')})", "reservations"),
            ),
        ),
        PanelSpec(
            "Clients",
            "Leased, pending and quarantined chunks",
            "short",
            "kvdepot_leased_chunks (pinned by a lease), kvdepot_pending_chunks (reserved, not committed) and "
            "kvdepot_quarantined_chunks (slots of reservations that expired or whose client left).",
            (
                q(f"sum({_m('kvdepot_leased_chunks')})", "leased"),
                q(f"sum({_m('kvdepot_pending_chunks')})", "pending"),
                q(f"sum({_m('kvdepot_quarantined_chunks')})", "quarantined"),
            ),
        ),
    )


#: Every panel of the dashboard, in order.
PANELS: tuple[PanelSpec, ...] = _panels()


def build_dashboard() -> dict[str, Any]:
    """The dashboard as Grafana's JSON model (needs grafana-foundation-sdk)."""
    with warnings.catch_warnings():  # the classic model, which every Grafana imports, is "deprecated"
        warnings.simplefilter("ignore", DeprecationWarning)
        from grafana_foundation_sdk.builders import common as common_builders
        from grafana_foundation_sdk.builders import dashboard as builders
        from grafana_foundation_sdk.builders import prometheus, timeseries
        from grafana_foundation_sdk.cog.encoder import JSONEncoder
        from grafana_foundation_sdk.models import common
        from grafana_foundation_sdk.models import dashboard as models

    source = common.DataSourceRef(type_val="prometheus", uid="${datasource}")
    board = (
        builders.Dashboard("kvdepot")
        .uid(UID)
        .description("A kvdepot KV-cache server: hit ratios, capacity, latency, tiers below RAM, errors, clients.")
        .tags(["kvdepot", "vllm"])
        .refresh("30s")
        .time("now-1h", "now")
        .tooltip(models.DashboardCursorSync.CROSSHAIR)
        .with_variable(builders.DatasourceVariable("datasource").label("Data source").type("prometheus"))
        .with_variable(
            builders.QueryVariable("instance")
            .label("Instance")
            .datasource(source)
            .query("label_values(kvdepot_capacity_bytes, instance)")
            .refresh(models.VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(models.VariableSort.ALPHABETICAL_ASC)
            .multi(True)
            .include_all(True)
            .all_value(".*")
            .current(models.VariableOption(selected=True, text="All", value="$__all"))
        )
        .with_variable(
            builders.CustomVariable("top_salts")
            .label("Salts shown")
            .values(",".join(TOP_SALTS_CHOICES))
            .current(models.VariableOption(selected=True, text=TOP_SALTS_CHOICES[0], value=TOP_SALTS_CHOICES[0]))
        )
    )
    panel_id = 0
    row = None
    for spec in PANELS:
        if spec.row != row:
            row = spec.row
            panel_id += 1
            board = board.with_row(builders.Row(row).id(panel_id))
        panel_id += 1
        panel = (
            timeseries.Panel()
            .id(panel_id)
            .title(spec.title)
            .description(spec.description)
            .datasource(source)
            .unit(spec.unit)
            .span(spec.width)
            .height(8)
            .min(0)
            .fill_opacity(10)
            .legend(
                common_builders.VizLegendOptions()
                .show_legend(True)
                .display_mode(common.LegendDisplayMode.LIST)
                .placement(common.LegendPlacement.BOTTOM)
            )
            .tooltip(common_builders.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI))
        )
        if spec.unit == "percentunit":
            panel = panel.max(1)
        for ref, query in zip("ABCDEFGH", spec.queries, strict=False):
            panel = panel.with_target(
                prometheus.Dataquery().ref_id(ref).datasource(source).expr(query.expr).legend_format(query.legend)
            )
        board = board.with_panel(panel)
    model: dict[str, Any] = json.loads(JSONEncoder().encode(board.build()))
    return model


def render(model: dict[str, Any]) -> str:
    """The dashboard's JSON text, as shipped: sorted keys, two-space indent, a final newline."""
    return json.dumps(model, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def shipped_dashboard() -> str:
    """The JSON text the package ships."""
    folder, name = DASHBOARD_RESOURCE
    return files("kvdepot.server").joinpath(folder).joinpath(name).read_text(encoding="utf-8")


@attrs.frozen
class DashboardCommand:
    """`kvdepot dashboard` (a `kvdepot.server._cli.Command`; `_cli` imports this module, so it
    does not import `_cli`)."""

    name: str = "dashboard"
    help: str = "print the Grafana dashboard for kvdepot's metrics (JSON), or write it to a file"

    def configure(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--output", "-o", type=Path, default=None, help="write it to FILE, not stdout")
        parser.add_argument(
            "--generate",
            action="store_true",
            help="build it anew with grafana-foundation-sdk (pip install 'kvdepot-server[dashboard]') "
            "instead of the copy this package ships",
        )

    def run(self, args: argparse.Namespace) -> int:
        if args.generate:
            try:
                text = render(build_dashboard())
            except ImportError as exc:
                sys.stderr.write(
                    f"kvdepot dashboard: --generate needs grafana-foundation-sdk ({exc}); "
                    "pip install 'kvdepot-server[dashboard]', or leave out --generate for the shipped copy\n"
                )
                return 1
        else:
            text = shipped_dashboard()
        if args.output is None:
            sys.stdout.write(text)
            return 0
        try:
            args.output.write_text(text, encoding="utf-8")
        except OSError as exc:
            sys.stderr.write(f"kvdepot dashboard: cannot write {args.output}: {exc.strerror}\n")
            return 1
        return 0


command = DashboardCommand()
