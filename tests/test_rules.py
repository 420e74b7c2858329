"""The alert rules (grafana/rules/gemtrace.rules.yml): valid for promtool, unit-tested by promtool with
cases that fire and cases that must not, written in the node_exporter-mixin style, with a runbook
section for each alert, and built only from metrics and labels of the catalogue."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import promql_catalogue
import pytest
import yaml

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "grafana" / "rules" / "gemtrace.rules.yml"
RULE_TESTS = sorted((ROOT / "grafana" / "rules" / "tests").glob("*.yml"))
RUNBOOK = ROOT / "docs" / "alerts.md"
# Where the Debian package installs docs/alerts.md (packaging/deb/build.sh), uncompressed.
RUNBOOK_BASE = "file:///usr/share/doc/gemtrace/alerts.md#"


def _alerts() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"] if "alert" in rule]


def _promtool() -> str:
    path = shutil.which("promtool")
    assert path, "promtool not found: install Debian's prometheus package (sudo make prereqs does)"
    return path


def test_promtool_check_rules() -> None:
    out = subprocess.run([_promtool(), "check", "rules", str(RULES)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(_alerts())} rules found" in out.stdout


def test_promtool_unit_tests_pass() -> None:
    assert RULE_TESTS
    out = subprocess.run([_promtool(), "test", "rules", *map(str, RULE_TESTS)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "FAILED" not in out.stdout + out.stderr


def test_promtool_unit_tests_catch_a_broken_rule(tmp_path: Path) -> None:
    """The unit tests can fail: the same tests against rules with every `for:` dropped do."""
    broken = re.sub(r"for: \d+m", "for: 0m", RULES.read_text())
    (tmp_path / "rules").mkdir()
    (tmp_path / "rules" / RULES.name).write_text(broken)
    (tmp_path / "rules" / "tests").mkdir()
    for test in RULE_TESTS:
        shutil.copy(test, tmp_path / "rules" / "tests" / test.name)
    copies = sorted((tmp_path / "rules" / "tests").glob("*.yml"))
    out = subprocess.run([_promtool(), "test", "rules", *map(str, copies)], capture_output=True, text=True)
    assert out.returncode != 0
    assert "GemtraceAgentDown" in out.stdout + out.stderr


def test_every_alert_has_firing_and_quiet_cases() -> None:
    fires: set[str] = set()
    quiet: set[str] = set()
    for path in RULE_TESTS:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                (fires if check.get("exp_alerts") else quiet).add(check["alertname"])
    names = {rule["alert"] for rule in _alerts()}
    assert names - fires == set(), "alerts without a case where they fire"
    assert names - quiet == set(), "alerts without a case where they must not fire"


def test_the_issue_s_alerts_are_all_there() -> None:
    assert {rule["alert"] for rule in _alerts()} == {
        "GemtraceGroupMemoryOverLimit", "GemtraceGroupOOMKill", "GemtraceGroupBelowMinUtil",
        "GemtraceGroupAtMaxUtil", "GemtraceAgentDown", "GemtraceAgentAbsent",
        "GemtraceConfigReloadFailing", "GemtraceProbesNotAttached", "GemtraceSlotTampering",
        "GemtraceAttachRefused",
    }


@pytest.mark.parametrize("rule", _alerts(), ids=lambda r: r["alert"])
def test_alert_follows_the_mixin_conventions(rule: dict[str, Any]) -> None:
    assert re.fullmatch(r"Gemtrace(?:[A-Z][a-zA-Z0-9]*)+", rule["alert"])
    assert re.fullmatch(r"\d+[smh]", rule["for"])
    assert rule["labels"]["severity"] in {"critical", "warning", "info"}
    annotations = rule["annotations"]
    assert annotations["summary"].strip() and "{{" not in annotations["summary"]
    assert "{{ $labels." in annotations["description"]
    assert annotations["runbook_url"] == RUNBOOK_BASE + rule["alert"].lower()


def _runbook_anchors() -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to dashes."""
    headings = re.findall(r"^#{2,3} (.+)$", RUNBOOK.read_text(), re.MULTILINE)
    return {re.sub(r"[^a-z0-9 _-]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("rule", _alerts(), ids=lambda r: r["alert"])
def test_runbook_has_a_section_for_the_alert(rule: dict[str, Any]) -> None:
    anchor = rule["annotations"]["runbook_url"].split("#", 1)[1]
    assert anchor in _runbook_anchors()


@pytest.mark.parametrize("rule", _alerts(), ids=lambda r: r["alert"])
def test_alert_uses_only_catalogue_metrics_and_labels(rule: dict[str, Any]) -> None:
    assert promql_catalogue.problems(rule["expr"]) == []
    # Template labels in the annotations exist on the result: grouped on, or labels of its metrics.
    analysis = promql_catalogue.analyse(rule["expr"])
    for label in re.findall(r"\$labels\.(\w+)", rule["annotations"]["description"]):
        metrics = [promql_catalogue.labels_of(s.metric) or frozenset() for s in analysis.selectors]
        assert label in analysis.grouping_labels or all(label in m for m in metrics), label


@pytest.mark.parametrize(
    ("expr", "complaint"),
    [
        ("rate(gemtrace_group_gpu_second_total[5m])", "not in gemtrace/metrics.py"),
        ('gemtrace_group_memory_limit_bytes{gpu="GPU-x"}', "has no label gpu"),
        ("sum by (pid) (gemtrace_group_memory_bytes)", "grouping on pid"),
        ("rate(gemtrace_group_memory_bytes[5m])", "not a counter"),
        ("rat(gemtrace_oom_kills_total[5m])", "unknown function rat()"),
    ],
)
def test_the_catalogue_check_catches_mistakes(expr: str, complaint: str) -> None:
    assert any(complaint in p for p in promql_catalogue.problems(expr)), promql_catalogue.problems(expr)
