"""The agent's Prometheus collectors, one module each; this file is the one place they are registered.

Each collector is a prometheus-client custom Collector that only reads a narrow, read-only view of
what the agent keeps (a frozen view the agent builds at scrape time, the accounting snapshot, the
enforcer's counters) and builds its families from gemtrace/metrics.py; none is handed the Agent.
Collect apart from expose: nothing here computes what the agent or the accounting already keep.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from gemtrace.agent import Agent


def _agent(agent: Agent) -> Collector:
    from gemtrace.collectors.agent import AgentCollector

    return AgentCollector(agent.agent_view)


def _groups(agent: Agent) -> Collector:
    from gemtrace.collectors.groups import GroupCollector

    return GroupCollector(agent.groups_view)


def _processes(agent: Agent) -> Collector:
    from gemtrace.collectors.processes import ProcessCollector

    acc = agent.accounting
    return ProcessCollector(lambda: agent.snapshot, lambda: (acc.probes_attached, acc.libcuda_files),
                            agent.pod_labels.process)


def _enforcement(agent: Agent) -> Collector:
    from gemtrace.collectors.enforcement import EnforcementCollector

    return EnforcementCollector(agent.accounting.enforcer, lambda: agent.config.groups)


def _attach(agent: Agent) -> Collector:
    from gemtrace.collectors.attach import AttachCollector

    return AttachCollector(agent.region.attach_counts, agent.region.chunk_holdings)


# name -> factory; one line registers a collector.
COLLECTORS: dict[str, Callable[[Agent], Collector]] = {
    "agent": _agent,
    "groups": _groups,
    "processes": _processes,
    "enforcement": _enforcement,
    "attach": _attach,
}


def registry_for(agent: Agent) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    for factory in COLLECTORS.values():
        registry.register(factory(agent))
    return registry
