"""Counters of memory enforcement: OOM kills, quota breaches and slot tampering (by kind), per group.

Reads MemoryEnforcer's counters only (copies, through `Counters`) and the groups' names. Every
group of the resource file in force is exported from the start, at 0 until its first event (and
every resource a breach can name, every kind of tampering), so that a dashboard shows 0 rather than
"No data" and increase() sees the first event as a step from 0. A group that
had events and was then removed from the file keeps its series: a counter does not go back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from gemtrace.agent.enforcement import RESOURCES, TAMPERING_KINDS
from gemtrace.metrics import family, spec


class Counters(Protocol):
    """MemoryEnforcer's read side: copies of its counters."""

    def counters(self) -> tuple[dict[str, int], dict[tuple[str, str], int], dict[tuple[str, str], int]]: ...


class EnforcementCollector(Collector):
    def __init__(self, enforcer: Counters, groups: Callable[[], Iterable[str]] = lambda: ()) -> None:
        """`groups`: the names of the groups defined now (the resource file in force)."""
        self._enforcer = enforcer
        self._groups = groups

    def collect(self) -> Iterator[Metric]:
        oom_kills, breach_counts, tampering_counts = self._enforcer.counters()
        defined = set(self._groups())
        kills = family(spec("gemtrace_oom_kills_total"))
        for group in sorted(defined | set(oom_kills)):
            kills.add_metric([group], float(oom_kills.get(group, 0)))
        breaches = family(spec("gemtrace_quota_breaches_total"))
        for group, resource in sorted({(g, r) for g in defined for r in RESOURCES} | set(breach_counts)):
            breaches.add_metric([group, resource], float(breach_counts.get((group, resource), 0)))
        tampering = family(spec("gemtrace_tampering_events_total"))
        for group, kind in sorted({(g, k) for g in defined for k in TAMPERING_KINDS} | set(tampering_counts)):
            tampering.add_metric([group, kind], float(tampering_counts.get((group, kind), 0)))
        yield kills
        yield breaches
        yield tampering
