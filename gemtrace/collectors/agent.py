"""The agent itself: version, resource-file reloads, the GPUs it schedules."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from gemtrace import __version__
from gemtrace.collectors.processes import family
from gemtrace.metrics import spec

if TYPE_CHECKING:
    from gemtrace.agent import Agent


class AgentCollector(Collector):
    def __init__(self, agent: Agent) -> None:
        self._agent = agent

    def collect(self) -> Iterator[Metric]:
        info = spec("gemtrace_agent_info")
        agent_info = InfoMetricFamily(info.family, info.help, labels=[])
        agent_info.add_metric([], {"version": __version__})
        yield agent_info

        reloads = family(spec("gemtrace_config_reloads_total"))
        for result in ("success", "failure"):
            reloads.add_metric([result], float(self._agent.reloads[result]))
        yield reloads
        ok = family(spec("gemtrace_config_last_reload_success"))
        ok.add_metric([], 1.0 if self._agent.last_reload_ok else 0.0)
        yield ok

        gpu_spec = spec("gemtrace_gpu_info")
        gpu_info = InfoMetricFamily(gpu_spec.family, gpu_spec.help, labels=[])
        total = family(spec("gemtrace_gpu_memory_total_bytes"))
        for gpu in self._agent.gpus:
            gpu_info.add_metric([], {"gpu": gpu.uuid, "name": gpu.name, "index": str(gpu.index)})
            total.add_metric([gpu.uuid], float(gpu.memory_total))
        yield gpu_info
        yield total
