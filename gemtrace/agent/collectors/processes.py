"""Per-process series (memory, GPU time, launches) from the accounting's latest Snapshot.

Only reads the snapshot it is given; the accounting decides what is in it. A process's series go
away when the process leaves the snapshot, at the first poll after its exit: nothing lingers. A
process whose launches are unknown (ungated, launches not probed) has no launch series rather than a
false zero. Also exports the probe gauges.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from gemtrace.agent.snapshot import Snapshot
from gemtrace.metrics import family, spec


class ProcessCollector(Collector):
    def __init__(
        self,
        snapshot: Callable[[], Snapshot | None],
        probes: Callable[[], tuple[int, int]] | None = None,
        pod: Callable[[int, str], tuple[str, str, str]] | None = None,
    ) -> None:
        """`snapshot`: the latest Snapshot; `probes`: (uprobes attached, libcuda files) or None; `pod`:
        a process's (namespace, pod, container) by its pid and group, or None for empty ones."""
        self._snapshot = snapshot
        self._probes = probes
        self._pod = pod or (lambda _pid, _group: ("", "", ""))

    def collect(self) -> Iterator[Metric]:
        memory = family(spec("gemtrace_process_memory_bytes"))
        seconds = family(spec("gemtrace_process_gpu_seconds_total"))
        launches = family(spec("gemtrace_process_kernel_launches_total"))
        snap = self._snapshot()
        for p in snap.processes if snap is not None else ():
            labels = [p.gpu, p.group, str(p.pid), p.comm, *self._pod(p.pid, p.group)]
            memory.add_metric(labels, float(p.memory_bytes))
            seconds.add_metric(labels, p.gpu_seconds)
            if p.launches is not None:
                launches.add_metric(labels, float(p.launches))
        yield memory
        yield seconds
        yield launches
        if self._probes is not None:
            attached, files = self._probes()
            g = family(spec("gemtrace_probes_attached"))
            g.add_metric([], float(attached))
            yield g
            g = family(spec("gemtrace_probe_libcuda_files"))
            g.add_metric([], float(files))
            yield g
