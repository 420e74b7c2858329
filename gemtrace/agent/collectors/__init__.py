"""The agent's Prometheus collectors, one module each (Agent.metrics_registry registers them), and the
isolation every scrape runs them in.

Each collector is a prometheus-client custom Collector that only reads a narrow, read-only view of
what the agent keeps (a frozen view the agent builds at scrape time, the accounting snapshot, the
enforcer's counters) and builds its families from gemtrace/metrics.py; none is handed the Agent.
Collect apart from expose: nothing here computes what the agent or the accounting already keep.
Each collector runs on its own (`Isolated`, as node_exporter does): one that raises loses only its
own series, and every scrape says how each fared (gemtrace_scrape_collector_success, _duration_seconds).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import structlog
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from gemtrace.metrics import family, spec

# A collector that keeps failing is logged when it starts to, then at most once this often (with how
# many scrapes failed meanwhile), and once when it recovers: never a line per scrape.
FAILURE_LOG_INTERVAL_S = 600.0


@dataclass
class _Failing:
    since_log: float  # when its last line was logged
    failures: int = 0  # scrapes failed since that line


class Isolated(Collector):
    """The named collectors, each collected on its own: one that raises costs its own series only
    (all of them: a part of its output is not trusted), shows as 0 in gemtrace_scrape_collector_success,
    and is logged as FAILURE_LOG_INTERVAL_S says."""

    def __init__(self, collectors: dict[str, Collector], clock: Callable[[], float] = time.monotonic) -> None:
        self._collectors = collectors
        self._clock = clock
        self._failing: dict[str, _Failing] = {}
        self._log = structlog.get_logger("gemtrace.collectors")

    def collect(self) -> Iterator[Metric]:
        success = family(spec("gemtrace_scrape_collector_success"))
        duration = family(spec("gemtrace_scrape_collector_duration_seconds"))
        for name, collector in self._collectors.items():
            began = time.perf_counter()
            try:
                families = list(collector.collect())
            except Exception as e:
                families = []
                self._failed(name, e)
            else:
                self._succeeded(name)
            success.add_metric([name], 0.0 if name in self._failing else 1.0)
            duration.add_metric([name], time.perf_counter() - began)
            yield from families
        yield success
        yield duration

    def _failed(self, name: str, error: Exception) -> None:
        now = self._clock()
        failing = self._failing.get(name)
        if failing is None:
            self._failing[name] = _Failing(now)
            self._log.error("collector_failed", collector=name, error=repr(error),
                            consequence="its series are missing from /metrics until it recovers")
        elif now - failing.since_log >= FAILURE_LOG_INTERVAL_S:
            self._log.error("collector_still_failing", collector=name, error=repr(error),
                            failed_scrapes=failing.failures + 1,
                            consequence="its series are missing from /metrics until it recovers")
            self._failing[name] = _Failing(now)
        else:
            failing.failures += 1

    def _succeeded(self, name: str) -> None:
        failing = self._failing.pop(name, None)
        if failing is not None:
            self._log.info("collector_recovered", collector=name, failed_scrapes_since_last_line=failing.failures)
