"""The one catalogue of gemtrace's Prometheus metrics: names, types, units, labels and help texts.

The exporter builds every family from here, docs/metrics.md is generated from here
(`python -m gemtrace.metrics --markdown`), and the dashboard and alert tests check their queries
against it. Conventions: `gemtrace_` prefix, base units (seconds, bytes), `_total` on counters,
ratios 0-1, and the same label names across families (`gpu` is always the GPU's UUID).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Literal

MetricType = Literal["counter", "gauge", "info"]

# A process's or a group's pod on Kubernetes (gemtrace.kube.pods); empty strings elsewhere.
POD_LABELS = ("namespace", "pod", "container")
PROCESS_LABELS = ("gpu", "group", "pid", "comm", *POD_LABELS)
GROUP_LABELS = ("group", *POD_LABELS)
GPU_GROUP_LABELS = ("gpu", "group", *POD_LABELS)


@dataclass(frozen=True)
class MetricSpec:
    name: str  # full exposition name (counters end in _total)
    type: MetricType
    unit: str  # "seconds", "bytes", "ratio", "" for counts and info
    labels: tuple[str, ...]
    help: str

    @property
    def family(self) -> str:
        """Name as prometheus-client wants it for a family (counters without `_total`, info without `_info`)."""
        if self.type == "counter" and self.name.endswith("_total"):
            return self.name[: -len("_total")]
        if self.type == "info" and self.name.endswith("_info"):
            return self.name[: -len("_info")]
        return self.name


_SPECS = [
    # agent
    MetricSpec("gemtrace_agent_info", "info", "", ("version",), "The running gemtrace agent."),
    MetricSpec("gemtrace_config_reloads_total", "counter", "", ("result",),
               "Resource file loads by result (success, failure)."),
    MetricSpec("gemtrace_config_last_reload_success", "gauge", "", (),
               "1 if the last load of the resource file succeeded, else 0."),
    MetricSpec("gemtrace_probes_attached", "gauge", "", (),
               "eBPF uprobes currently attached to libcuda files (0 when eBPF is unavailable)."),
    MetricSpec("gemtrace_probe_libcuda_files", "gauge", "", (),
               "Distinct libcuda files the eBPF probes are attached to."),
    # GPUs
    MetricSpec("gemtrace_gpu_info", "info", "", ("gpu", "name", "index"), "A GPU the agent schedules."),
    MetricSpec("gemtrace_gpu_memory_total_bytes", "gauge", "bytes", ("gpu",), "Device memory of the GPU."),
    # groups: quota settings
    MetricSpec("gemtrace_group_util_min_ratio", "gauge", "ratio", GROUP_LABELS,
               "MinUtil: the share of each GPU's time the group is guaranteed."),
    MetricSpec("gemtrace_group_util_max_ratio", "gauge", "ratio", GROUP_LABELS,
               "MaxUtil: the share of each GPU's time the group may not exceed."),
    MetricSpec("gemtrace_group_memory_limit_bytes", "gauge", "bytes", GROUP_LABELS,
               "MemoryLimit: device memory the group may hold on each GPU."),
    # groups: usage
    MetricSpec("gemtrace_group_gpu_seconds_total", "counter", "seconds", GPU_GROUP_LABELS,
               "GPU time granted to and used by the group."),
    MetricSpec("gemtrace_group_throttled_seconds_total", "counter", "seconds", GPU_GROUP_LABELS,
               "Time the group had work waiting while the scheduler held it back."),
    MetricSpec("gemtrace_group_util_ratio", "gauge", "ratio", GPU_GROUP_LABELS,
               "The group's share of the GPU's time over the scheduler's recent window."),
    MetricSpec("gemtrace_group_memory_bytes", "gauge", "bytes", GPU_GROUP_LABELS,
               "Device memory held by the group's processes (eBPF where attached, else gates)."),
    MetricSpec("gemtrace_group_processes", "gauge", "", GPU_GROUP_LABELS, "Processes of the group using the GPU."),
    MetricSpec("gemtrace_oom_kills_total", "counter", "", ("group",),
               "Processes killed because their group exceeded its MemoryLimit."),
    MetricSpec("gemtrace_quota_breaches_total", "counter", "", ("group", "resource"),
               "Times a group was found over a quota (resource: memory)."),
    MetricSpec("gemtrace_tampering_events_total", "counter", "", ("group",),
               "Slots whose figures disagreed with eBPF accounting."),
    # processes
    MetricSpec("gemtrace_process_memory_bytes", "gauge", "bytes", PROCESS_LABELS,
               "Device memory the process holds through libcuda allocations."),
    MetricSpec("gemtrace_process_gpu_seconds_total", "counter", "seconds", PROCESS_LABELS,
               "GPU time of the process's kernels."),
    MetricSpec("gemtrace_process_kernel_launches_total", "counter", "", PROCESS_LABELS,
               "Kernel launches of the process."),
]

CATALOGUE: dict[str, MetricSpec] = {spec.name: spec for spec in _SPECS}


def spec(name: str) -> MetricSpec:
    """The spec of a metric by its exposition name; KeyError names the unknown metric."""
    return CATALOGUE[name]


def markdown() -> str:
    """docs/metrics.md, generated so that it cannot drift from the code."""
    lines = [
        "# gemtrace metrics",
        "",
        "Generated by `python -m gemtrace.metrics --markdown`; do not edit by hand.",
        "",
        "| metric | type | unit | labels | meaning |",
        "| --- | --- | --- | --- | --- |",
    ]
    for s in _SPECS:
        labels = ", ".join(f"`{label}`" for label in s.labels) or "-"
        lines.append(f"| `{s.name}` | {s.type} | {s.unit or '-'} | {labels} | {s.help} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] == ["--markdown"]:
        sys.stdout.write(markdown())
    else:
        sys.exit("usage: python -m gemtrace.metrics --markdown")
