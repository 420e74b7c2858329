"""The Grafana dashboards and provisioning files, checked without Grafana: the committed JSON is what
dev.dashboards generates, every query and variable uses catalogue metrics and labels only and
is valid PromQL for promtool, and the provisioning files point where the files are.
tests/test_prometheus_live.py evaluates the same queries against a real Prometheus."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import promql_catalogue
import pytest
import yaml

from dev import dashboards

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
PROVISIONING = ROOT / "grafana" / "provisioning"
DASHBOARD_DIR = PROVISIONING / "dashboards" / "gemtrace"
RULES = ROOT / "grafana" / "rules" / "gemtrace.rules.yml"

# What Grafana puts in place of its own variables, for promtool's syntax check.
GRAFANA_BUILTINS = {"$__rate_interval": "1m", "$__range": "1h", "$__interval": "15s"}


def _load(name: str) -> dict[str, Any]:
    return json.loads((DASHBOARD_DIR / name).read_text())


def queries(board: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(panel title, target) for every query of every panel."""
    return [(p["title"], t) for p in board["panels"] for t in p.get("targets", [])]


def substitute(expr: str, values: dict[str, str]) -> str:
    for name in sorted(GRAFANA_BUILTINS, key=len, reverse=True):
        expr = expr.replace(name, GRAFANA_BUILTINS[name])
    return re.sub(r"\$\{?(\w+)\}?", lambda m: values[m.group(1)], expr)


@pytest.mark.parametrize("name", sorted(dashboards.DASHBOARDS))
def test_committed_dashboard_is_the_generated_one(name: str) -> None:
    assert (DASHBOARD_DIR / name).read_text() == dashboards.render(name), (
        "stale dashboard: python -m dev.dashboards --write")


def test_the_four_views_are_there() -> None:
    titles = {_load(n)["title"] for n in dashboards.DASHBOARDS}
    assert titles == {"gemtrace / Fleet overview", "gemtrace / Group", "gemtrace / Process", "gemtrace / Pod"}
    assert sorted(p.name for p in DASHBOARD_DIR.glob("*.json")) == sorted(dashboards.DASHBOARDS)


@pytest.mark.parametrize("name", sorted(dashboards.DASHBOARDS))
def test_dashboard_model_is_consistent(name: str) -> None:
    board = _load(name)
    variables = {v["name"]: v for v in board["templating"]["list"]}
    pods = ["namespace", "pod"] if name == "gemtrace-pod.json" else []
    assert list(variables) == ["datasource", "host", "gpu", "group", *pods]
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for p in board["panels"]:
        pos = p["gridPos"]
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24 and pos["h"] > 0
        if p["type"] == "row":
            assert p.get("repeat") in (None, *variables)
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        refs = [t["refId"] for t in p["targets"]]
        assert p["targets"] and len(refs) == len(set(refs)), p["title"]
    for title, t in queries(board):
        used = set(re.findall(r"\$\{?(\w+)\}?", t["expr"])) - {"__rate_interval", "__range", "__interval"}
        assert used <= set(variables), (title, used)
    # No two panels overlap.
    cells: set[tuple[int, int]] = set()
    for p in board["panels"]:
        pos = p["gridPos"]
        xs, ys = range(pos["x"], pos["x"] + pos["w"]), range(pos["y"], pos["y"] + pos["h"])
        mine = {(x, y) for x in xs for y in ys}
        assert not cells & mine, p["title"]
        cells |= mine


@pytest.mark.parametrize("name", sorted(dashboards.DASHBOARDS))
def test_every_query_uses_catalogue_metrics_and_labels(name: str) -> None:
    board = _load(name)
    for title, t in queries(board):
        assert promql_catalogue.problems(t["expr"]) == [], (title, t["expr"])
        analysis = promql_catalogue.analyse(t["expr"])
        metric_labels: set[str] = set()
        for sel in analysis.selectors:
            metric_labels |= promql_catalogue.labels_of(sel.metric) or set()
        for label in re.findall(r"\{\{\s*(\w+)\s*\}\}", t["legendFormat"]):
            assert label in metric_labels, (title, label)
    for v in board["templating"]["list"]:
        if v["type"] != "query":
            continue
        expr, label = promql_catalogue.label_values_parts(v["query"])
        assert promql_catalogue.problems(expr) == [], v["name"]
        for sel in promql_catalogue.analyse(expr).selectors:
            assert label in (promql_catalogue.labels_of(sel.metric) or set()), (v["name"], label)


def test_every_query_is_valid_promql_for_promtool(tmp_path: Path) -> None:
    """promtool checks the syntax: each query (variables filled in) as a recording rule."""
    promtool = shutil.which("promtool")
    assert promtool, "promtool not found: install Debian's prometheus package (sudo make prereqs does)"
    values = {"host": ".+", "gpu": ".+", "group": ".+", "namespace": ".+", "pod": ".+", "datasource": "x"}
    exprs: list[str] = []
    for name in sorted(dashboards.DASHBOARDS):
        board = _load(name)
        exprs += [t["expr"] for _, t in queries(board)]
        exprs += [promql_catalogue.label_values_parts(v["query"])[0]
                  for v in board["templating"]["list"] if v["type"] == "query"]
    rules = [{"record": f"gemtrace:check:{i}", "expr": substitute(e, values)} for i, e in enumerate(exprs)]
    path = tmp_path / "queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    out = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(rules)} rules found" in out.stdout


def test_promtool_check_catches_a_syntax_error(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    assert promtool
    path = tmp_path / "queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "x", "rules": [
        {"record": "x:y", "expr": "sum by (group (gemtrace_group_processes)"}]}]}))
    assert subprocess.run([promtool, "check", "rules", str(path)], capture_output=True).returncode != 0


def test_dashboard_provisioning_points_at_the_dashboards() -> None:
    doc = yaml.safe_load((PROVISIONING / "dashboards" / "gemtrace.yml").read_text())
    assert doc["apiVersion"] == 1
    (provider,) = doc["providers"]
    assert provider["type"] == "file"
    # Copied as they are into /etc/grafana/provisioning, the path is where the JSON files land.
    relative = DASHBOARD_DIR.relative_to(PROVISIONING)
    assert provider["options"]["path"] == f"/etc/grafana/provisioning/{relative}"


def test_datasource_provisioning_is_a_prometheus() -> None:
    doc = yaml.safe_load((PROVISIONING / "datasources" / "gemtrace.yml").read_text())
    assert doc["apiVersion"] == 1
    (ds,) = doc["datasources"]
    assert ds["type"] == "prometheus" and ds["url"].startswith("http")
    assert ds["isDefault"] is False  # two defaults make Grafana refuse the whole provisioning


def test_example_prometheus_config_is_valid(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    assert promtool
    config = yaml.safe_load((ROOT / "grafana" / "prometheus.example.yml").read_text())
    assert [job["job_name"] for job in config["scrape_configs"]] == ["gemtrace"]
    config["rule_files"] = [str(RULES)]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    out = subprocess.run([promtool, "check", "config", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
