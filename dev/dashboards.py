"""gemtrace's Grafana dashboards, generated from code so that every query names catalogue metrics.

Owns the four dashboards (fleet overview, group view, process view, Kubernetes pod view) as Grafana JSON models and
writes them to grafana/provisioning/dashboards/gemtrace/ (`python -m dev.dashboards --write`);
tests check that the committed files equal what this module generates. It never talks to Grafana
or Prometheus: tests/test_prometheus_live.py evaluates every query against a real Prometheus.

Hosts are Prometheus's `instance` label; `gpu` is the GPU's UUID; metric names come from
gemtrace.metrics, and a selector naming a label the metric does not have fails at generation.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from gemtrace.metrics import spec

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
TARGET_LABELS = ("job", "instance")
# Matchers that every panel applies, by label: a selector gets those its metric has.
VARIABLE_MATCHERS = {"instance": '=~"$host"', "gpu": '=~"$gpu"', "group": '=~"$group"',
                     "namespace": '=~"$namespace"', "pod": '=~"$pod"'}
POD_ONLY = ("instance", "gpu", "namespace", "pod")

Json = dict[str, Any]


def sel(name: str, *, only: tuple[str, ...] = ("instance", "gpu", "group"), **extra: str) -> str:
    """`name{...}` with the dashboard's variable matchers for the labels the metric has."""
    metric = spec(name)
    labels = set(metric.labels) | set(TARGET_LABELS)
    parts = [f"{label}{VARIABLE_MATCHERS[label]}" for label in only if label in labels]
    for label, value in extra.items():
        if label not in labels:
            raise ValueError(f"{name} has no label {label}")
        parts.append(f'{label}="{value}"')
    return f"{metric.name}{{{', '.join(parts)}}}"


def target(expr: str, legend: str = "", *, ref: str = "A", instant: bool = False) -> Json:
    t: Json = {"refId": ref, "datasource": DATASOURCE, "expr": expr, "legendFormat": legend or "__auto"}
    if instant:
        t.update(instant=True, range=False, format="table")
    else:
        t.update(instant=False, range=True)
    return t


def panel(kind: str, title: str, description: str, targets: list[Json], *, w: int = 12, h: int = 8,
          unit: str = "short", minimum: float | None = None, maximum: float | None = None,
          options: Json | None = None, overrides: list[Json] | None = None,
          transformations: list[Json] | None = None) -> Json:
    defaults: Json = {"unit": unit}
    if minimum is not None:
        defaults["min"] = minimum
    if maximum is not None:
        defaults["max"] = maximum
    p: Json = {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "gridPos": {"w": w, "h": h},
        "targets": targets,
        "fieldConfig": {"defaults": defaults, "overrides": overrides or []},
        "options": options or {},
    }
    if transformations:
        p["transformations"] = transformations
    return p


def _unit(column: str, unit: str) -> Json:
    """A table column's unit, by the name the organize transformation gave it."""
    return {"matcher": {"id": "byName", "options": column}, "properties": [{"id": "unit", "value": unit}]}


def row(title: str, repeat: str = "") -> Json:
    r: Json = {"type": "row", "title": title, "collapsed": False, "panels": [], "gridPos": {"w": 24, "h": 1}}
    if repeat:
        r["repeat"] = repeat
    return r


def _variable(name: str, label: str, query: str) -> Json:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DATASOURCE,
        "query": query,
        "definition": query,
        "refresh": 2,  # on time range change: hosts and groups come and go
        "includeAll": True,
        "multi": True,
        "allValue": ".+",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "options": [],
        "regex": "",
        "sort": 1,
        "hide": 0,
    }


def variables() -> list[Json]:
    return [
        {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
         "current": {}, "options": [], "refresh": 1, "regex": "", "hide": 0},
        _variable("host", "Host", f"label_values({spec('gemtrace_agent_info').name}, instance)"),
        _variable("gpu", "GPU", f"label_values({sel('gemtrace_gpu_info', only=('instance',))}, gpu)"),
        _variable("group", "Group",
                  f"label_values({sel('gemtrace_group_util_max_ratio', only=('instance',))}, group)"),
    ]


def _layout(panels: list[Json]) -> list[Json]:
    """Ids and positions: panels flow left to right in rows of 24 columns."""
    x = y = line_h = 0
    for i, p in enumerate(panels, start=1):
        p["id"] = i
        w, h = p["gridPos"]["w"], p["gridPos"]["h"]
        if p["type"] == "row" or x + w > 24:
            x, y, line_h = 0, y + line_h, 0
        p["gridPos"] = {"x": x, "y": y, "w": w, "h": h}
        x += w
        line_h = max(line_h, h)
        if p["type"] == "row":
            x, y, line_h = 0, y + h, 0
    return panels


def pod_variables() -> list[Json]:
    """Namespace and pod: only series of pods (a pod label not empty)."""
    pods = sel("gemtrace_group_util_max_ratio", only=("instance",))[:-1] + ', pod!=""}'
    in_namespace = pods[:-1] + ', namespace=~"$namespace"}'
    return [_variable("namespace", "Namespace", f"label_values({pods}, namespace)"),
            _variable("pod", "Pod", f"label_values({in_namespace}, pod)")]


def dashboard(uid: str, title: str, description: str, panels: list[Json],
              extra_variables: list[Json] | None = None) -> Json:
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["gemtrace"],
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "timezone": "",
        "links": [{"title": "gemtrace", "type": "dashboards", "tags": ["gemtrace"], "asDropdown": True,
                   "includeVars": True, "keepTime": True}],
        "annotations": {"list": []},
        "templating": {"list": variables() + (extra_variables or [])},
        "panels": _layout(panels),
    }


_RATE = "[$__rate_interval]"
_PERCENT_BAR: Json = {"displayMode": "gradient", "orientation": "horizontal", "showUnfilled": True,
                      "valueMode": "color", "reduceOptions": {"calcs": ["lastNotNull"], "values": False}}
_STAT: Json = {"reduceOptions": {"calcs": ["lastNotNull"], "values": False}, "colorMode": "value",
               "graphMode": "none", "textMode": "auto"}


def fleet() -> Json:
    share = f"rate({sel('gemtrace_group_gpu_seconds_total')}{_RATE})"
    mem = sel("gemtrace_group_memory_bytes")
    return dashboard("gemtrace-fleet", "gemtrace / Fleet overview",
                     "Hosts, GPUs and groups that gemtrace schedules, and how full each quota is.", [
        panel("stat", "Hosts", "Agents reporting.",
              [target(f"count(count by (instance) ({sel('gemtrace_agent_info', only=('instance',))}))",
                      instant=True)], w=4, h=4, options=_STAT),
        panel("stat", "GPUs", "GPUs the agents schedule.",
              [target(f"count({sel('gemtrace_gpu_info', only=('instance', 'gpu'))})", instant=True)],
              w=4, h=4, options=_STAT),
        panel("stat", "Groups", "Groups defined in the resource files.",
              [target(f"count(count by (group) ({sel('gemtrace_group_util_max_ratio')}))", instant=True)],
              w=4, h=4, options=_STAT),
        panel("stat", "Processes", "Processes using a GPU, gated or not.",
              [target(f"sum({sel('gemtrace_group_processes')})", instant=True)], w=4, h=4, options=_STAT),
        panel("stat", "OOM kills", "Processes killed for their group's MemoryLimit in the time range.",
              [target(f"sum(increase({sel('gemtrace_oom_kills_total')}[$__range]))", instant=True)],
              w=4, h=4, options=_STAT),
        panel("stat", "Memory breaches", "Times a group went over its MemoryLimit in the time range.",
              [target(f"sum(increase({sel('gemtrace_quota_breaches_total', resource='memory')}[$__range]))",
                      instant=True)], w=4, h=4, options=_STAT),
        panel("table", "Agents", "One row per host: version, resource file and eBPF state.", [
            target(sel("gemtrace_agent_info", only=("instance",)), ref="A", instant=True),
            target(sel("gemtrace_config_last_reload_success", only=("instance",)), ref="B", instant=True),
            target(sel("gemtrace_probes_attached", only=("instance",)), ref="C", instant=True),
            target(sel("gemtrace_probe_libcuda_files", only=("instance",)), ref="D", instant=True),
        ], w=24, h=6, transformations=[
            {"id": "merge", "options": {}},
            {"id": "organize", "options": {
                "excludeByName": {"Time": True, "__name__": True, "Value #A": True},
                "renameByName": {"Value #B": "resource file loaded", "Value #C": "eBPF probes",
                                 "Value #D": "libcuda files"}}},
        ]),
        panel("table", "GPUs", "Each GPU, how much of its memory the groups hold, and how much of the last 5 "
              "minutes its groups shared it under the driver's time slicing (a job across GPUs ran there and "
              "nothing bound them) rather than taking turns.", [
            target(sel("gemtrace_gpu_info", only=("instance", "gpu")), ref="A", instant=True),
            target(f"sum by (job, instance, gpu) ({mem}) / on (job, instance, gpu) "
                   f"{sel('gemtrace_gpu_memory_total_bytes', only=('instance', 'gpu'))}",
                   ref="B", instant=True),
            target(sel("gemtrace_gpu_memory_total_bytes", only=("instance", "gpu")), ref="C", instant=True),
            target(f"rate({sel('gemtrace_gpu_shared_seconds_total', only=('instance', 'gpu'))}[5m])",
                   ref="D", instant=True),
        ], w=24, h=6, overrides=[
            _unit("memory used", "percentunit"),
            _unit("memory", "bytes"),
            _unit("shared", "percentunit"),
        ], transformations=[
            {"id": "merge", "options": {}},
            {"id": "organize", "options": {
                "excludeByName": {"Time": True, "__name__": True, "Value #A": True, "job": True},
                "renameByName": {"Value #B": "memory used", "Value #C": "memory", "Value #D": "shared"}}},
        ]),
        panel("bargauge", "GPU time used of MaxUtil", "Each group's share of each GPU against its MaxUtil.", [
            target(f"{share} / on (job, instance, group) group_left () "
                   f"{sel('gemtrace_group_util_max_ratio')}", "{{group}} {{instance}} {{gpu}}"),
        ], unit="percentunit", minimum=0, maximum=1, options=_PERCENT_BAR),
        panel("bargauge", "Memory used of MemoryLimit", "Device memory against MemoryLimit, by group.", [
            target(f"{mem} / on (job, instance, group) group_left () "
                   f"{sel('gemtrace_group_memory_limit_bytes')}", "{{group}} {{instance}} {{gpu}}"),
        ], unit="percentunit", minimum=0, maximum=1, options=_PERCENT_BAR),
        panel("timeseries", "GPU share by group", "GPU time used per second of wall time, by group and GPU.",
              [target(share, "{{group}} {{instance}} {{gpu}}")], unit="percentunit", minimum=0),
        panel("timeseries", "Memory by group", "Device memory held by each group's processes.",
              [target(mem, "{{group}} {{instance}} {{gpu}}")], unit="bytes", minimum=0),
    ])


def group() -> Json:
    # Quota settings drawn as dashed lines over the usage they bound.
    limit_overrides = [
        {"matcher": {"id": "byRegexp", "options": f"^{name}.*"},
         "properties": [{"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}},
                        {"id": "custom.fillOpacity", "value": 0}]}
        for name in ("MinUtil", "MaxUtil", "MemoryLimit")
    ]
    return dashboard("gemtrace-group", "gemtrace / Group",
                     "One row per group: its GPU share against MinUtil and MaxUtil, memory against its "
                     "limit, throttled time, OOM kills and breaches.", [
        row("Group $group", repeat="group"),
        panel("timeseries", "GPU share", "GPU time used per second, by GPU, against MinUtil and MaxUtil.", [
            target(f"rate({sel('gemtrace_group_gpu_seconds_total')}{_RATE})", "{{instance}} {{gpu}}"),
            target(sel("gemtrace_group_util_ratio"), "scheduler window {{instance}} {{gpu}}", ref="B"),
            target(sel("gemtrace_group_util_min_ratio"), "MinUtil", ref="C"),
            target(sel("gemtrace_group_util_max_ratio"), "MaxUtil", ref="D"),
        ], unit="percentunit", minimum=0, maximum=1, overrides=limit_overrides),
        panel("timeseries", "Memory", "Device memory the group's processes hold, against MemoryLimit.", [
            target(sel("gemtrace_group_memory_bytes"), "{{instance}} {{gpu}}"),
            target(sel("gemtrace_group_memory_limit_bytes"), "MemoryLimit", ref="B"),
        ], unit="bytes", minimum=0, overrides=limit_overrides),
        panel("timeseries", "Throttled", "Share of the time the group had work waiting while held back.", [
            target(f"rate({sel('gemtrace_group_throttled_seconds_total')}{_RATE})", "{{instance}} {{gpu}}"),
        ], w=8, unit="percentunit", minimum=0),
        panel("timeseries", "OOM kills and breaches", "Processes killed, and times over the MemoryLimit.", [
            target(f"increase({sel('gemtrace_oom_kills_total')}{_RATE})", "OOM kills {{instance}}"),
            target(f"increase({sel('gemtrace_quota_breaches_total')}{_RATE})",
                   "breaches ({{resource}}) {{instance}}", ref="B"),
        ], w=8, minimum=0, options={"tooltip": {"mode": "multi"}}),
        panel("timeseries", "Processes", "Processes of the group using each GPU.", [
            target(sel("gemtrace_group_processes"), "{{instance}} {{gpu}}"),
        ], w=8, minimum=0),
    ])


def process() -> Json:
    def top(name: str, rate: bool) -> str:
        inner = f"rate({sel(name)}{_RATE})" if rate else sel(name)
        return f"topk(10, {inner})"

    legend = "{{comm}} ({{pid}}) {{group}} {{instance}}"
    return dashboard("gemtrace-process", "gemtrace / Process",
                     "Top processes on the GPUs by kernel time, memory and kernel launches.", [
        panel("table", "Processes", "Every process using a GPU, by kernel time.", [
            target(f"sort_desc(rate({sel('gemtrace_process_gpu_seconds_total')}[$__range]))", ref="A",
                   instant=True),
            target(sel("gemtrace_process_memory_bytes"), ref="B", instant=True),
            target(f"rate({sel('gemtrace_process_kernel_launches_total')}[$__range])", ref="C", instant=True),
        ], w=24, h=9, overrides=[
            _unit("kernel time", "percentunit"),
            _unit("memory", "bytes"),
            _unit("launches", "ops"),
        ], transformations=[
            {"id": "merge", "options": {}},
            {"id": "organize", "options": {
                "excludeByName": {"Time": True, "__name__": True, "job": True},
                "renameByName": {"Value #A": "kernel time", "Value #B": "memory", "Value #C": "launches"}}},
        ]),
        panel("timeseries", "Kernel time, top 10", "GPU time of each process's kernels per second.",
              [target(top("gemtrace_process_gpu_seconds_total", True), legend)], w=8, unit="percentunit",
              minimum=0),
        panel("timeseries", "Memory, top 10", "Device memory each process holds.",
              [target(top("gemtrace_process_memory_bytes", False), legend)], w=8, unit="bytes", minimum=0),
        panel("timeseries", "Kernel launches, top 10", "Kernel launches per second.",
              [target(top("gemtrace_process_kernel_launches_total", True), legend)], w=8, unit="ops",
              minimum=0),
    ])


def pod() -> Json:
    """Kubernetes: one row per pod, its group's share and memory against what it requested."""
    def q(name: str) -> str:
        return sel(name, only=POD_ONLY)

    legend = "{{container}} {{gpu}}"
    return dashboard("gemtrace-pod", "gemtrace / Pod",
                     "Kubernetes pods holding GPU shares (gemtrace.io/gpu-memory, gemtrace.io/gpu-util): one row "
                     "per pod, its GPU share against MinUtil and MaxUtil, its memory against its MemoryLimit.", [
        row("Pod $pod", repeat="pod"),
        panel("timeseries", "GPU share", "GPU time used per second by the pod's containers, against the "
              "gpu-util it requested (MinUtil) and its MaxUtil.", [
            target(f"rate({q('gemtrace_group_gpu_seconds_total')}{_RATE})", legend),
            target(q("gemtrace_group_util_min_ratio"), "MinUtil {{container}}", ref="B"),
            target(q("gemtrace_group_util_max_ratio"), "MaxUtil {{container}}", ref="C"),
        ], w=8, unit="percentunit", minimum=0, maximum=1),
        panel("timeseries", "Memory", "Device memory the pod's containers hold, against the gpu-memory they "
              "requested (MemoryLimit).", [
            target(q("gemtrace_group_memory_bytes"), legend),
            target(q("gemtrace_group_memory_limit_bytes"), "MemoryLimit {{container}}", ref="B"),
        ], w=8, unit="bytes", minimum=0),
        panel("timeseries", "Processes", "The pod's processes on the GPU, by memory.", [
            target(q("gemtrace_process_memory_bytes"), "{{container}} {{comm}} ({{pid}})"),
        ], w=8, unit="bytes", minimum=0),
    ], extra_variables=pod_variables())


DASHBOARDS = {"gemtrace-fleet.json": fleet, "gemtrace-group.json": group, "gemtrace-process.json": process,
              "gemtrace-pod.json": pod}
OUT_DIR = Path("grafana/provisioning/dashboards/gemtrace")


def render(name: str) -> str:
    return json.dumps(DASHBOARDS[name](), indent=2, sort_keys=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dev.dashboards",
                                 description="Grafana dashboards of gemtrace")
    ap.add_argument("--write", metavar="DIR", nargs="?", const=str(OUT_DIR),
                    help=f"write the dashboards into DIR (default {OUT_DIR})")
    args = ap.parse_args(argv)
    if args.write is None:
        json.dump({name: make() for name, make in DASHBOARDS.items()}, sys.stdout, indent=2)
        return 0
    out = Path(args.write)
    out.mkdir(parents=True, exist_ok=True)
    for name in DASHBOARDS:
        (out / name).write_text(render(name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
