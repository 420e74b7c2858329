"""Groups: their quotas (from the resource file in force), and per GPU what the scheduler gave them
and the memory they hold (the accounting snapshot: eBPF where attached, else the gates' slots).

Reads a GroupsView (built by the agent at scrape time: Agent.groups_view) and nothing else: not the
region, not the schedulers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from gemtrace.agent.policy import GroupUsage
from gemtrace.agent.snapshot import Snapshot
from gemtrace.metrics import family, spec


@dataclass(frozen=True)
class GroupQuota:
    name: str
    min_util: float
    max_util: float
    memory_limit: int | None


@dataclass(frozen=True)
class GroupsView:
    quotas: tuple[GroupQuota, ...]  # the groups of the resource file in force
    usage: tuple[tuple[str, str, GroupUsage], ...]  # (GPU UUID, group, what the scheduler gave it)
    snapshot: Snapshot | None  # the accounting's latest
    # group -> its pod's (namespace, pod, container) on Kubernetes (gemtrace.kube.pods); others: empty
    pods: dict[str, tuple[str, str, str]] = field(default_factory=dict)


class GroupCollector(Collector):
    def __init__(self, view: Callable[[], GroupsView]) -> None:
        self._view = view

    def collect(self) -> Iterator[Metric]:
        view = self._view()

        def pod(group: str) -> tuple[str, str, str]:
            return view.pods.get(group, ("", "", ""))

        min_util = family(spec("gemtrace_group_util_min_ratio"))
        max_util = family(spec("gemtrace_group_util_max_ratio"))
        limit = family(spec("gemtrace_group_memory_limit_bytes"))
        for q in sorted(view.quotas, key=lambda q: q.name):
            min_util.add_metric([q.name, *pod(q.name)], q.min_util)
            max_util.add_metric([q.name, *pod(q.name)], q.max_util)
            if q.memory_limit is not None:
                limit.add_metric([q.name, *pod(q.name)], float(q.memory_limit))
        yield from (min_util, max_util, limit)

        seconds = family(spec("gemtrace_group_gpu_seconds_total"))
        throttled = family(spec("gemtrace_group_throttled_seconds_total"))
        util = family(spec("gemtrace_group_util_ratio"))
        for gpu, group, usage in view.usage:
            seconds.add_metric([gpu, group, *pod(group)], usage.gpu_seconds)
            throttled.add_metric([gpu, group, *pod(group)], usage.throttled_seconds)
            util.add_metric([gpu, group, *pod(group)], usage.util_ratio)
        yield from (seconds, throttled, util)

        memory = family(spec("gemtrace_group_memory_bytes"))
        managed = family(spec("gemtrace_group_managed_memory_bytes"))
        processes = family(spec("gemtrace_group_processes"))
        snapshot = view.snapshot
        if snapshot is not None:
            for (gpu_uuid, group), used in sorted(snapshot.group_memory().items()):
                memory.add_metric([gpu_uuid, group, *pod(group)], float(used))
            for (gpu_uuid, group), used in sorted(snapshot.group_managed().items()):
                managed.add_metric([gpu_uuid, group, *pod(group)], float(used))
            counts: dict[tuple[str, str], int] = {}
            for p in snapshot.processes:
                counts[(p.gpu, p.group)] = counts.get((p.gpu, p.group), 0) + 1
            for (gpu_uuid, group), n in sorted(counts.items()):
                processes.add_metric([gpu_uuid, group, *pod(group)], float(n))
        yield from (memory, managed, processes)
