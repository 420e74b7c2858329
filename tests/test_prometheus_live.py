"""Dashboards and alerts against a real Prometheus scraping the real agent on the simulated GPU.

A Prometheus (Debian's package) on loopback scrapes `gemtrace agent` every second and evaluates
grafana/rules/gemtrace.rules.yml every second, while groups work through `gemtrace run` and one
group goes over its MemoryLimit. Then every dashboard panel's query (template variables filled in
as Grafana would) must return series whose labels its legend names; every alert expression must
evaluate, each of its selectors must return series, and the memory-breach alert must be pending
or firing while the alerts that must not fire do not.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import promql_catalogue
import pytest
import testkit
import yaml
from simgpu_env import RT_CLIENT, require_build, simgpu_env
from testkit import free_port

from dev import dashboards
from gemtrace.kube.pods import Names

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "grafana" / "rules" / "gemtrace.rules.yml"

RESOURCE_FILE = """\
# Two groups at work, one that goes over its memory limit.
[train]
MinUtil = 0.2
MaxUtil = 0.7
MemoryLimit = 4GiB

[infer]
MinUtil = 0.3
MemoryLimit = 4GiB

[greedy]
MaxUtil = 0.5
MemoryLimit = 1GiB
"""
BREACHING_GROUP = "greedy"

# What Grafana puts in place of its own interval variables, for a 1 s scrape interval.
GRAFANA_INTERVALS = {"$__rate_interval": "4s", "$__range": "1m", "$__interval": "1s"}
# Alerts that must not fire here: the agent is up and scraped, its resource file is good.
QUIET_ALERTS = {"GemtraceAgentDown", "GemtraceAgentAbsent", "GemtraceConfigReloadFailing"}


def http_get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        body: bytes = response.read()
        return body


# Prometheus and the agent answer errors until they are up, and a query's answer may lack a key
# until the first scrape: those mean "not yet" here. A quarter second between tries spares the API.
wait_until = functools.partial(testkit.wait_until, step=0.25, retry_on=(OSError, ValueError, KeyError))


@dataclass
class Prometheus:
    """A throwaway Prometheus server on loopback."""

    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    @classmethod
    def start(cls, workdir: Path, target: str) -> Prometheus:
        binary = shutil.which("prometheus")
        assert binary, "prometheus not found: install Debian's prometheus package (sudo make prereqs does)"
        port = free_port()
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [{"job_name": "gemtrace", "static_configs": [{"targets": [target]}]}],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        log = workdir / "prometheus.log"
        proc = subprocess.Popen(
            [binary, f"--config.file={workdir / 'prometheus.yml'}",
             f"--storage.tsdb.path={workdir / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}",
             "--log.level=warn"],
            stdout=subprocess.DEVNULL, stderr=log.open("wb"), start_new_session=True,
        )
        prom = cls(f"http://127.0.0.1:{port}", proc, log)
        wait_until("prometheus ready", lambda: http_get(prom.url + "/-/ready"), 60, proc=proc)
        return prom

    def api(self, path: str, **params: str) -> Any:
        url = f"{self.url}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        try:
            body = http_get(url, timeout=15)
        except urllib.error.HTTPError as exc:  # 400/422 carry Prometheus's own error text
            body = exc.read()
        doc = json.loads(body)
        if doc.get("status") != "success":
            raise AssertionError(f"{path} {params}: {doc.get('errorType')}: {doc.get('error')}")
        return doc["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", (expr, data["resultType"])
        result: list[dict[str, Any]] = data["result"]
        return result

    def query_range(self, expr: str, seconds: float = 30) -> list[dict[str, Any]]:
        end = time.time()
        data = self.api("query_range", query=expr, start=str(end - seconds), end=str(end), step="1")
        result: list[dict[str, Any]] = data["result"]
        return result

    def alerts(self) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = self.api("alerts")["alerts"]
        return found

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class Stack:
    prom: Prometheus
    agent_log: Path
    agent_url: str
    workloads: list[subprocess.Popen[bytes]] = field(default_factory=list)
    variables: dict[str, list[str]] = field(default_factory=dict)


def _stop(proc: subprocess.Popen[Any], sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _gemtrace(*args: str) -> list[str]:
    return [sys.executable, "-m", "gemtrace.cli", *args]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    require_build()
    work = tmp_path_factory.mktemp("live")
    # As `gemtrace kube-plugin` writes it: the group train is a pod's (the pod dashboard's data).
    pod_names = work / "pods.json"
    pod_names.write_text(Names({}, {"train": ("ml", "trainer", "main")}).to_json())
    state_dir = work / "state"
    state_dir.mkdir()
    config = work / "resource.conf"
    config.write_text(RESOURCE_FILE)
    env = simgpu_env(work / "simgpu", devices=1, memory="16GiB")
    env["GEMTRACE_STATE_DIR"] = str(state_dir)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    listen = f"127.0.0.1:{free_port()}"
    agent_log = work / "agent.log"
    procs: list[subprocess.Popen[bytes]] = []
    prom: Prometheus | None = None
    try:
        agent = subprocess.Popen(
            _gemtrace("agent", "--config", str(config), "--state-dir", str(state_dir), "--listen", listen,
                      "--pod-names", str(pod_names)),
            env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=agent_log.open("wb"))
        procs.append(agent)
        wait_until("agent serving /metrics", lambda: b"gemtrace_agent_info" in http_get(f"http://{listen}/metrics"),
                   60, proc=agent)
        prom = server = Prometheus.start(work, listen)
        # Prometheus must have scraped the agent before the breach, so that the breach is news.
        wait_until("first scrape", lambda: server.query('up{job="gemtrace"} == 1'), 30)
        s = Stack(server, agent_log, f"http://{listen}/metrics")

        def run(group: str, *args: str, gated: bool = True) -> None:
            cmd = _gemtrace("run", "--group", group, "--", str(RT_CLIENT), *args) if gated else [
                str(RT_CLIENT), *args]
            extra = {} if gated else {"GEMTRACE_GROUP": group}
            p = subprocess.Popen(cmd, env={**env, **extra}, cwd=ROOT, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL, start_new_session=True)
            procs.append(p)
            s.workloads.append(p)

        run("train", "launch-loop", "--kernel-ns", "2000000", "--launches-per-iter", "4", "--seconds", "300")
        run("train", "alloc", "--hold", "300", "1GiB")
        run("infer", "launch-loop", "--kernel-ns", "1000000", "--launches-per-iter", "2", "--seconds", "300")
        run("infer", "alloc", "--hold", "300", "512MiB")
        # Over the limit: through the gate (refused there), and without it (eBPF sees it and kills).
        run(BREACHING_GROUP, "alloc", "--hold", "300", "768MiB", "768MiB")
        run(BREACHING_GROUP, "alloc", "--hold", "300", "2GiB", gated=False)
        breaches = f'gemtrace_quota_breaches_total{{group="{BREACHING_GROUP}",resource="memory"}} > 0'
        wait_until("the breach in Prometheus", lambda: server.query(breaches), 90)
        wait_until("processes of every group",
                   lambda: len(server.query("count by (group) (gemtrace_process_memory_bytes)")) >= 2, 60)
        # The panels' rates need two scrapes within $__rate_interval of every series they read; all
        # families are scraped together, so GPU time per group and per process stands for the rest.
        window = GRAFANA_INTERVALS["$__rate_interval"]

        def groups_with(expr: str) -> set[str]:
            return {series["metric"].get("group", "") for series in server.query(expr)}

        wait_until(f"a rate over {window} of every group's GPU time and of two groups' processes'",
                   lambda: {"train", "infer", BREACHING_GROUP}
                   <= groups_with(f"rate(gemtrace_group_gpu_seconds_total[{window}])")
                   and len(groups_with(f"rate(gemtrace_process_gpu_seconds_total[{window}])")) >= 2, 60)
        yield s
    finally:
        if prom is not None:
            prom.stop()
        for p in reversed(procs):
            _stop(p)


def _failure_context(stack: Stack) -> str:
    return (f"\n--- agent log (tail) ---\n{stack.agent_log.read_text()[-3000:]}"
            f"\n--- prometheus log (tail) ---\n{stack.prom.log.read_text()[-2000:]}")


def _variable_values(stack: Stack, board: dict[str, Any]) -> dict[str, list[str]]:
    """Each query variable's values, computed as Grafana does (earlier variables filled in)."""
    values: dict[str, list[str]] = {}
    for v in board["templating"]["list"]:
        if v["type"] != "query":
            continue
        expr, label = promql_catalogue.label_values_parts(v["query"])
        series = stack.prom.query(_fill(expr, values))
        values[v["name"]] = sorted({s["metric"][label] for s in series if label in s["metric"]})
        assert values[v["name"]], f"variable {v['name']} has no values: {expr}" + _failure_context(stack)
    return values


def _fill(expr: str, values: dict[str, list[str]]) -> str:
    """Grafana's interpolation of a multi-value variable in a regex matcher: (a|b), regex-escaped."""
    for name in sorted(GRAFANA_INTERVALS, key=len, reverse=True):
        expr = expr.replace(name, GRAFANA_INTERVALS[name])

    def one(m: re.Match[str]) -> str:
        chosen = values[m.group(1)]
        escaped = [re.escape(x).replace("\\", "\\\\") for x in chosen]
        return "(" + "|".join(escaped) + ")" if len(escaped) > 1 else escaped[0]

    return re.sub(r"\$\{?(\w+)\}?", one, expr)


@pytest.mark.parametrize("name", sorted(dashboards.DASHBOARDS))
def test_every_panel_query_returns_series(stack: Stack, name: str) -> None:
    board = json.loads((ROOT / "grafana/provisioning/dashboards/gemtrace" / name).read_text())
    values = _variable_values(stack, board)
    assert BREACHING_GROUP in values["group"] and {"train", "infer"} <= set(values["group"])
    selections = [values]
    if any(p.get("repeat") == "group" for p in board["panels"]):
        # A row repeated per group: each row's panels see one group.
        selections = [{**values, "group": [g]} for g in values["group"]]
    # A panel must show data for some selection: in a row repeated per group, a group that has no
    # memory or no OOM kill rightly shows none, but a typo or a missing metric shows none for any.
    empty: dict[tuple[str, str], str] = {}
    shown: set[tuple[str, str]] = set()
    # A rate needs two scrapes of a series in its window: on a loaded host a scrape comes late, so a
    # panel still empty is asked again for a while (a typo or a missing metric stays empty for good).
    deadline = time.monotonic() + 30
    while True:
        for chosen in selections:
            for panel in board["panels"]:
                for target in panel.get("targets", []):
                    key = (panel["title"], target["refId"])
                    if key in shown:
                        continue
                    expr = _fill(target["expr"], chosen)
                    result = stack.prom.query(expr) if target.get("instant") else stack.prom.query_range(expr)
                    if not result:
                        empty.setdefault(key, expr)
                        continue
                    shown.add(key)
                    for label in re.findall(r"\{\{\s*(\w+)\s*\}\}", target["legendFormat"]):
                        assert all(label in s["metric"] for s in result), (panel["title"], label, result[:2])
        if empty.keys() <= shown or time.monotonic() > deadline:
            break
        time.sleep(1)
    never = [f"{title} [{ref}] {expr}" for (title, ref), expr in empty.items() if (title, ref) not in shown]
    assert not never, "panels without data:\n" + "\n".join(never) + _failure_context(stack)


def _alert_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"] if "alert" in rule]


@pytest.mark.parametrize("rule", _alert_rules(), ids=lambda r: r["alert"])
def test_alert_expression_evaluates_and_its_selectors_return_series(stack: Stack,
                                                                    rule: dict[str, Any]) -> None:
    stack.prom.query(rule["expr"])  # evaluates without error (an error raises)
    for sel in promql_catalogue.analyse(rule["expr"]).selectors:
        matchers = ", ".join(f"{k}{op}{v}" for k, (op, v) in sel.matchers.items())
        expr = f"{sel.metric}{{{matchers}}}"
        # Counters whose event this stack does not cause (tampering) are exported at 0 from the
        # start, so every selector returns series.
        assert stack.prom.query(expr), f"{rule['alert']}: {expr} returns nothing" + _failure_context(stack)


def test_rules_are_loaded_and_healthy(stack: Stack) -> None:
    groups = stack.prom.api("rules")["groups"]
    rules = {r["name"]: r for g in groups for r in g["rules"]}
    assert set(rules) == {r["alert"] for r in _alert_rules()}
    bad = {name: r.get("lastError") for name, r in rules.items() if r["health"] != "ok"}
    assert not bad


def test_memory_breach_alert_is_pending_or_firing(stack: Stack) -> None:
    def breach_alert() -> list[dict[str, Any]]:
        return [a for a in stack.prom.alerts() if a["labels"]["alertname"] == "GemtraceGroupMemoryOverLimit"
                and a["labels"].get("group") == BREACHING_GROUP and a["state"] in ("pending", "firing")]

    (alert,) = wait_until("GemtraceGroupMemoryOverLimit pending", breach_alert, 30)
    assert alert["labels"]["severity"] == "warning"
    assert alert["annotations"]["runbook_url"].endswith("#gemtracegroupmemoryoverlimit")
    assert BREACHING_GROUP in alert["annotations"]["description"]
    others = [a for a in stack.prom.alerts() if a["labels"]["alertname"] == "GemtraceGroupMemoryOverLimit"
              and a["labels"].get("group") != BREACHING_GROUP]
    assert not others, others  # the groups within their limits are not taken for breaching


def test_alerts_that_must_not_fire_do_not(stack: Stack) -> None:
    noisy = [a for a in stack.prom.alerts() if a["labels"]["alertname"] in QUIET_ALERTS]
    assert not noisy, noisy
