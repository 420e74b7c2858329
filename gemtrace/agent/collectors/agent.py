"""The agent itself: version, resource-file reloads, refused group requests, the GPUs it schedules and how
their groups shared them.

Reads an AgentView (built by the agent at scrape time: Agent.agent_view) and nothing else.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from gemtrace import __version__
from gemtrace.gpus import Gpu
from gemtrace.metrics import family, info_family, spec


@dataclass(frozen=True)
class AgentView:
    reload_successes: int
    reload_failures: int
    last_reload_ok: bool
    gpus: tuple[Gpu, ...]
    admission_refusals: tuple[tuple[str, int], ...] = ()  # (requested group, refusals)
    # Per GPU of `gpus`, in that order: seconds its groups shared it under the driver's time slicing.
    shared_seconds: tuple[float, ...] = ()


class AgentCollector(Collector):
    def __init__(self, view: Callable[[], AgentView]) -> None:
        self._view = view

    def collect(self) -> Iterator[Metric]:
        view = self._view()
        agent_info = info_family(spec("gemtrace_agent_info"))
        agent_info.add_metric([], {"version": __version__})
        yield agent_info

        reloads = family(spec("gemtrace_config_reloads_total"))
        reloads.add_metric(["success"], float(view.reload_successes))
        reloads.add_metric(["failure"], float(view.reload_failures))
        yield reloads
        ok = family(spec("gemtrace_config_last_reload_success"))
        ok.add_metric([], 1.0 if view.last_reload_ok else 0.0)
        yield ok

        refusals = family(spec("gemtrace_admission_refusals_total"))
        for group, count in view.admission_refusals:
            refusals.add_metric([group], float(count))
        yield refusals

        gpu_info = info_family(spec("gemtrace_gpu_info"))
        total = family(spec("gemtrace_gpu_memory_total_bytes"))
        for gpu in view.gpus:
            gpu_info.add_metric([], {"gpu": gpu.uuid, "name": gpu.name, "index": str(gpu.index)})
            total.add_metric([gpu.uuid], float(gpu.memory_total))
        yield gpu_info
        yield total
        shared = family(spec("gemtrace_gpu_shared_seconds_total"))
        for gpu, seconds in zip(view.gpus, view.shared_seconds, strict=False):
            shared.add_metric([gpu.uuid], seconds)
        yield shared
