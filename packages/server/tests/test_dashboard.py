"""The Grafana dashboard: built from code, shipped as JSON, printed by `kvdepot dashboard`, and
querying only series a real server exports."""

from __future__ import annotations

import json
import re
import time

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvdepot.server import PoolMapping
from kvdepot.server._cli import build_parser
from kvdepot.server._dashboard import DASHBOARD_RESOURCE, PANELS, build_dashboard, command, render, shipped_dashboard
from kvdepot.transport import CacheClient

T = 5.0
CHUNK = 960  # a slot of 1024 bytes with its header
SELECTOR = re.compile(r"\b(kvdepot_[a-z_]+)(?:\{([^}]*)\})?")
MATCHER = re.compile(r'(\w+)(=~|!~|!=|=)"([^"]*)"')


def _targets(model: dict) -> list[str]:
    return [t["expr"] for p in model["panels"] for t in p.get("targets", [])]


def test_shipped_dashboard_is_what_the_code_builds():
    """Building the dashboard again gives the shipped JSON byte for byte."""
    pytest.importorskip("grafana_foundation_sdk", reason="pip install 'kvdepot-server[dashboard]'")
    path = "packages/server/src/kvdepot/server/" + "/".join(DASHBOARD_RESOURCE)
    assert render(build_dashboard()) == shipped_dashboard(), (
        f"the shipped dashboard is stale; write it again: kvdepot dashboard --generate --output {path}"
    )


def test_dashboard_has_a_datasource_variable_and_every_panel_uses_it():
    """Every panel and query reads from the `$datasource` variable, a Prometheus data source."""
    model = json.loads(shipped_dashboard())
    variables = {v["name"]: v for v in model["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    panels = [p for p in model["panels"] if p["type"] != "row"]
    assert len(panels) == len(PANELS)
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"]
            assert 'instance=~"$instance"' in target["expr"]
    assert len({p["id"] for p in model["panels"]}) == len(model["panels"])


def test_dashboard_command_prints_or_writes_the_shipped_json(tmp_path, capsys):
    """`kvdepot dashboard` prints the shipped JSON; `--output FILE` writes it there instead."""
    parser = build_parser([command])
    args = parser.parse_args(["dashboard"])
    assert args._run(args) == 0
    assert capsys.readouterr().out == shipped_dashboard()
    out = tmp_path / "kvdepot.json"
    args = parser.parse_args(["dashboard", "--output", str(out)])
    assert args._run(args) == 0
    assert capsys.readouterr().out == ""
    assert json.loads(out.read_text())["uid"] == "kvdepot"


def test_dashboard_command_generates_it_anew(capsys):
    """`kvdepot dashboard --generate` builds it with the SDK: the same text as the shipped one."""
    pytest.importorskip("grafana_foundation_sdk", reason="pip install 'kvdepot-server[dashboard]'")
    args = build_parser([command]).parse_args(["dashboard", "--generate"])
    assert args._run(args) == 0
    assert capsys.readouterr().out == shipped_dashboard()


def _exported(server) -> list[tuple[str, dict[str, str]]]:
    text = generate_latest(server.metrics.registry).decode()
    return [(s.name, s.labels) for family in text_string_to_metric_families(text) for s in family.samples]


def _matches(labels: dict[str, str], matchers: list[tuple[str, str, str]]) -> bool:
    for key, op, value in matchers:
        got = labels.get(key, "")
        if op == "=" and got != value:
            return False
        if op == "=~" and not re.fullmatch(value, got):
            return False
    return True


def test_every_query_selects_series_a_real_server_exports(make_server, tmp_path):
    """Each metric selector in the dashboard (its labels too, `instance` apart, which Prometheus
    adds) matches a series of a real server with a disk tier after some stores and lookups."""
    server = make_server(metrics_port=0, disk_dir=tmp_path / "disk", disk_capacity=1 << 20)
    with CacheClient(server.address, timeout=T) as client:
        reg = client.register("layout", 256, CHUNK).result(T)
        res = client.reserve("tenant", [bytes([i]) * 32 for i in range(4)], CHUNK).result(T)
        with PoolMapping(reg.pool.path, reg.pool.size) as pool:
            for slot in res.slots:
                pool.write(slot.offset, b"x" * slot.length)
        client.commit(res.reservation_id).result(T)
        (hit,) = client.lookup([("tenant", [bytes([i]) * 32 for i in range(6)])]).result(T).results
        client.release([hit.lease_id]).result(T)
    deadline = time.monotonic() + 10
    exported = _exported(server)
    while not any(name == "kvdepot_salt_hits_total" for name, _ in exported):
        assert time.monotonic() < deadline, "the server never published its per-salt lookups"
        time.sleep(0.05)
        exported = _exported(server)
    missing = []
    for expr in _targets(json.loads(shipped_dashboard())):
        for name, body in SELECTOR.findall(expr):
            matchers = [m for m in MATCHER.findall(body) if m[0] != "instance"]
            if not any(n == name and _matches(labels, matchers) for n, labels in exported):
                missing.append(f"{name}{{{body}}}")
    assert not missing, f"selectors that match no series the server exports: {sorted(set(missing))}"
