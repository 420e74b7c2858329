"""Groups: their quotas (from the resource file in force), and per GPU what the scheduler gave them
and the memory they hold (the accounting snapshot: eBPF where attached, else the gates' slots)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from gemtrace.collectors.processes import family
from gemtrace.metrics import spec

if TYPE_CHECKING:
    from gemtrace.agent import Agent


class GroupCollector(Collector):
    def __init__(self, agent: Agent) -> None:
        self._agent = agent

    def collect(self) -> Iterator[Metric]:
        agent = self._agent
        config = agent.config
        pod = agent.pod_labels.group  # a pod's group: its namespace, pod, container
        min_util = family(spec("gemtrace_group_util_min_ratio"))
        max_util = family(spec("gemtrace_group_util_max_ratio"))
        limit = family(spec("gemtrace_group_memory_limit_bytes"))
        for name, settings in sorted(config.groups.items()):
            min_util.add_metric([name, *pod(name)], settings.min_util)
            max_util.add_metric([name, *pod(name)], settings.max_util)
            if settings.memory_limit is not None:
                limit.add_metric([name, *pod(name)], float(settings.memory_limit))
        yield from (min_util, max_util, limit)

        seconds = family(spec("gemtrace_group_gpu_seconds_total"))
        throttled = family(spec("gemtrace_group_throttled_seconds_total"))
        util = family(spec("gemtrace_group_util_ratio"))
        names = agent.region.group_names()
        for gpu, scheduler in zip(agent.gpus, agent.schedulers, strict=True):
            for index, usage in sorted(scheduler.usage().items()):
                group = names.get(index)
                if group is None:
                    continue
                seconds.add_metric([gpu.uuid, group, *pod(group)], usage.gpu_seconds)
                throttled.add_metric([gpu.uuid, group, *pod(group)], usage.throttled_seconds)
                util.add_metric([gpu.uuid, group, *pod(group)], usage.util_ratio)
        yield from (seconds, throttled, util)

        memory = family(spec("gemtrace_group_memory_bytes"))
        processes = family(spec("gemtrace_group_processes"))
        snapshot = agent.snapshot
        if snapshot is not None:
            for (gpu_uuid, group), used in sorted(snapshot.group_memory().items()):
                memory.add_metric([gpu_uuid, group, *pod(group)], float(used))
            counts: dict[tuple[str, str], int] = {}
            for p in snapshot.processes:
                if p.exited_ns is None:
                    counts[(p.gpu, p.group)] = counts.get((p.gpu, p.group), 0) + 1
            for (gpu_uuid, group), n in sorted(counts.items()):
                processes.add_metric([gpu_uuid, group, *pod(group)], float(n))
        yield from (memory, processes)
