"""The one catalogue of gemtrace's Prometheus metrics: names, types, units, labels and help texts.

The collectors build every family from here (`family`), docs/metrics.md's list of metrics is
generated from here (`python -m gemtrace.metrics --update docs/metrics.md`), and the dashboard and
alert tests check their queries against it. Conventions: `gemtrace_` prefix, base units (seconds,
bytes), `_total` on counters, ratios 0-1, and the same label names across families (`gpu` is always
the GPU's UUID).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Literal

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

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
    MetricSpec("gemtrace_admission_refusals_total", "counter", "", ("group",),
               "Gated processes that asked for a group their user is not admitted to (Users=, UnixGroups=); "
               "each ran in the group the agent assigned instead."),
    MetricSpec("gemtrace_probes_attached", "gauge", "", (),
               "eBPF uprobes currently attached to libcuda files (0 when eBPF is unavailable)."),
    MetricSpec("gemtrace_probe_libcuda_files", "gauge", "", (),
               "Distinct libcuda files the eBPF probes are attached to."),
    # the scrape itself (gemtrace.agent.collectors): a collector that fails loses only its own series
    MetricSpec("gemtrace_scrape_collector_success", "gauge", "", ("collector",),
               "1 if the collector's part of this scrape succeeded, 0 if it failed (its series are missing)."),
    MetricSpec("gemtrace_scrape_collector_duration_seconds", "gauge", "seconds", ("collector",),
               "How long the collector's part of this scrape took."),
    # GPUs
    MetricSpec("gemtrace_gpu_info", "info", "", ("gpu", "name", "index"), "A GPU the agent schedules."),
    MetricSpec("gemtrace_gpu_memory_total_bytes", "gauge", "bytes", ("gpu",), "Device memory of the GPU."),
    MetricSpec("gemtrace_gpu_shared_seconds_total", "counter", "seconds", ("gpu",),
               "Time the GPU's groups ran together under the driver's own time slicing, not in turns: a job "
               "spanning GPUs ran there, and every group there had no MinUtil, no MaxUtil, the same Priority and "
               "one process (docs/scheduler.md, \"Where nothing binds\")."),
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
    MetricSpec("gemtrace_group_managed_memory_bytes", "gauge", "bytes", GPU_GROUP_LABELS,
               "Managed memory held by the group's processes (Oversubscribe: allocations past the device share; "
               "the driver pages it between host and GPU), apart from gemtrace_group_memory_bytes."),
    MetricSpec("gemtrace_group_processes", "gauge", "", GPU_GROUP_LABELS, "Processes of the group using the GPU."),
    MetricSpec("gemtrace_oom_kills_total", "counter", "", ("group",),
               "Processes killed because their group exceeded its MemoryLimit."),
    MetricSpec("gemtrace_quota_breaches_total", "counter", "", ("group", "resource"),
               "Times a group was found over a quota (resource: memory)."),
    # attaching: the gates' socket (docs/security.md, "Attaching")
    MetricSpec("gemtrace_attach_refusals_total", "counter", "", ("uid", "reason"),
               "Gates' attaches the agent refused or could not serve, by the asking user's uid and reason (full: "
               "no free process slot for that user; timeout: no request within 1 s; dropped: that user had too "
               "many connections waiting; malformed; failed: the reply could not be sent)."),
    MetricSpec("gemtrace_attach_chunks", "gauge", "", ("uid",),
               "Slot chunks (32 process slots each) held by the user."),
    MetricSpec("gemtrace_attach_chunks_free", "gauge", "", (),
               "Slot chunks no user holds."),
    MetricSpec("gemtrace_tampering_events_total", "counter", "", ("group", "kind"),
               "Slots whose memory figures disagreed with what the agent verified (eBPF, else NVML): "
               "kind under_reporting (less than the process holds) or over_reporting (more: from then on "
               "other users' gates count that user's processes at their verified figures)."),
    # processes
    MetricSpec("gemtrace_process_memory_bytes", "gauge", "bytes", PROCESS_LABELS,
               "Device memory the process holds through libcuda allocations."),
    MetricSpec("gemtrace_process_gpu_seconds_total", "counter", "seconds", PROCESS_LABELS,
               "GPU time of the process's kernels. Gated: measured by its gate, within its group's time. "
               "Ungated: an estimate, NVML's device utilisation x time less the gated processes' time on "
               "that GPU, split equally among the ungated processes there; it undercounts beside a gated "
               "process, whose time includes its kernels' waits behind the ungated ones "
               "(docs/accounting.md)."),
    MetricSpec("gemtrace_process_kernel_launches_total", "counter", "", PROCESS_LABELS,
               "Kernel launches of the process."),
]

CATALOGUE: dict[str, MetricSpec] = {spec.name: spec for spec in _SPECS}


def spec(name: str) -> MetricSpec:
    """The spec of a metric by its exposition name; KeyError names the unknown metric."""
    return CATALOGUE[name]


def family(s: MetricSpec) -> CounterMetricFamily | GaugeMetricFamily:
    """An empty counter or gauge family of the spec, for a collector to fill."""
    if s.type == "info":
        raise ValueError(f"{s.name} is an info metric: use info_family")
    cls = CounterMetricFamily if s.type == "counter" else GaugeMetricFamily
    return cls(s.family, s.help, labels=list(s.labels), unit=s.unit)


def info_family(s: MetricSpec) -> InfoMetricFamily:
    """An empty info family of the spec: its labels go in each sample's value
    (add_metric([], {"version": ...})), as prometheus-client wants them."""
    if s.type != "info":
        raise ValueError(f"{s.name} is a {s.type}: use family")
    return InfoMetricFamily(s.family, s.help, labels=[])


DOC_BEGIN = "<!-- generated by `python -m gemtrace.metrics --update docs/metrics.md`: do not edit by hand -->"
DOC_END = "<!-- end of the generated part -->"


def markdown() -> str:
    """The generated part of docs/metrics.md (between DOC_BEGIN and DOC_END), so that the list of
    metrics cannot drift from the code; the prose around it is written by hand."""
    lines = [
        DOC_BEGIN,
        "",
        "| metric | type | unit | labels | meaning |",
        "| --- | --- | --- | --- | --- |",
    ]
    for s in _SPECS:
        labels = ", ".join(f"`{label}`" for label in s.labels) or "-"
        lines.append(f"| `{s.name}` | {s.type} | {s.unit or '-'} | {labels} | {s.help} |")
    per_process = ", ".join(f"`{s.name}`" for s in _SPECS if "pid" in s.labels)
    lines += [
        "",
        f"Families that name a process ({', '.join(f'`{label}`' for label in PROCESS_LABELS)}): {per_process}.",
        "",
        DOC_END,
    ]
    return "\n".join(lines) + "\n"


def updated_doc(text: str) -> str:
    """`text` (docs/metrics.md) with its generated part replaced by markdown(); ValueError when the
    markers are missing."""
    begin, end = text.find(DOC_BEGIN), text.find(DOC_END)
    if begin < 0 or end < begin:
        raise ValueError(f"the generated part's markers are missing: {DOC_BEGIN!r} ... {DOC_END!r}")
    return text[:begin] + markdown() + text[end + len(DOC_END):].removeprefix("\n")


if __name__ == "__main__":
    if sys.argv[1:] == ["--markdown"]:
        sys.stdout.write(markdown())
    elif sys.argv[1:2] == ["--update"] and len(sys.argv) == 3:
        from pathlib import Path

        doc = Path(sys.argv[2])
        doc.write_text(updated_doc(doc.read_text()))
    else:
        sys.exit("usage: python -m gemtrace.metrics --markdown (print the generated part of docs/metrics.md)\n"
                 "       python -m gemtrace.metrics --update docs/metrics.md (rewrite it there)")
