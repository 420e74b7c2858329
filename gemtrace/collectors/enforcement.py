"""Counters of memory enforcement: OOM kills, quota breaches and slot tampering, per group.

Reads MemoryEnforcer's counters only; a group appears once it has an event (counters born at their
first event, as the alert rules expect).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from gemtrace.collectors.processes import family
from gemtrace.enforcement import MemoryEnforcer
from gemtrace.metrics import spec


class EnforcementCollector(Collector):
    def __init__(self, enforcer: MemoryEnforcer) -> None:
        self._enforcer = enforcer

    def collect(self) -> Iterator[Metric]:
        oom_kills, breach_counts, tampering_counts = self._enforcer.counters()
        kills = family(spec("gemtrace_oom_kills_total"))
        for group, n in sorted(oom_kills.items()):
            kills.add_metric([group], float(n))
        breaches = family(spec("gemtrace_quota_breaches_total"))
        for (group, resource), n in sorted(breach_counts.items()):
            breaches.add_metric([group, resource], float(n))
        tampering = family(spec("gemtrace_tampering_events_total"))
        for group, n in sorted(tampering_counts.items()):
            tampering.add_metric([group], float(n))
        yield kills
        yield breaches
        yield tampering
