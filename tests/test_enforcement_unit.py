"""Unit tests of MemoryEnforcer's decision: who is killed, when, and what is counted."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from gemtrace.collectors.enforcement import EnforcementCollector
from gemtrace.enforcement import Holding, MemoryEnforcer

pytestmark = pytest.mark.unit

GPU = "GPU-0"
MiB = 1 << 20


def test_kills_the_group_s_last_allocator_only_and_counts_once() -> None:
    killed: list[int] = []
    e = MemoryEnforcer(kill=killed.append)
    holdings = [
        Holding(1, "a", GPU, 300 * MiB, last_alloc_ns=10),
        Holding(2, "a", GPU, 300 * MiB, last_alloc_ns=30),  # allocated last in group a
        Holding(3, "b", GPU, 900 * MiB, last_alloc_ns=50),  # allocated last overall, other group
    ]
    kills = e.check(holdings, {"a": 500 * MiB, "b": None})
    assert [k.pid for k in kills] == [2] and killed == [2]
    assert kills[0].group_bytes == 600 * MiB and kills[0].limit == 500 * MiB
    # Until pid 2 has exited its memory is still counted, but it is not killed twice nor is pid 1.
    assert e.check(holdings, {"a": 500 * MiB}) == []
    # Gone: the group is back under its limit.
    assert e.check([holdings[0], holdings[2]], {"a": 500 * MiB}) == []
    assert e.oom_kills == {"a": 1} and e.breaches == {("a", "memory"): 1}


def test_kills_as_many_as_needed_latest_first_and_groups_are_per_gpu() -> None:
    killed: list[int] = []
    e = MemoryEnforcer(kill=killed.append)
    holdings = [Holding(pid, "a", GPU, 200 * MiB, last_alloc_ns=pid) for pid in range(1, 6)]
    holdings.append(Holding(9, "a", "GPU-1", 400 * MiB, last_alloc_ns=99))  # another GPU, its own limit
    e.check(holdings, {"a": 500 * MiB})
    assert killed == [5, 4, 3]
    assert e.breaches == {("a", "memory"): 1}

    registry = CollectorRegistry()
    registry.register(EnforcementCollector(e))
    e.note_tampering(7, "a", GPU, slot_bytes=0, ebpf_bytes=MiB)
    text = generate_latest(registry).decode()
    assert 'gemtrace_oom_kills_total{group="a"} 3.0' in text
    assert 'gemtrace_quota_breaches_total{group="a",resource="memory"} 1.0' in text
    assert 'gemtrace_tampering_events_total{group="a"} 1.0' in text


def test_at_the_limit_is_not_over() -> None:
    killed: list[int] = []
    e = MemoryEnforcer(kill=killed.append)
    assert e.check([Holding(1, "a", GPU, 500 * MiB, 1)], {"a": 500 * MiB}) == []
    assert killed == [] and not e.breaches


def test_every_defined_group_is_exported_at_zero_before_its_first_event() -> None:
    killed: list[int] = []
    e = MemoryEnforcer(kill=killed.append)
    defined = ["a", "b"]
    registry = CollectorRegistry()
    registry.register(EnforcementCollector(e, lambda: defined))
    text = generate_latest(registry).decode()
    for group in ("a", "b"):
        assert f'gemtrace_oom_kills_total{{group="{group}"}} 0.0' in text
        assert f'gemtrace_quota_breaches_total{{group="{group}",resource="memory"}} 0.0' in text
        assert f'gemtrace_tampering_events_total{{group="{group}"}} 0.0' in text

    e.check([Holding(1, "a", GPU, 600 * MiB, 1)], {"a": 500 * MiB})
    defined = ["b"]  # a reload removed group a: its counts stay, a counter does not go back
    text = generate_latest(registry).decode()
    assert 'gemtrace_oom_kills_total{group="a"} 1.0' in text
    assert 'gemtrace_quota_breaches_total{group="a",resource="memory"} 1.0' in text
    assert 'gemtrace_tampering_events_total{group="a"}' not in text  # never had one, no longer defined
    assert 'gemtrace_oom_kills_total{group="b"} 0.0' in text


def test_among_processes_of_unknown_allocation_time_an_ungated_one_goes_before_a_gated_one() -> None:
    killed: list[int] = []
    e = MemoryEnforcer(kill=killed.append)
    # Rebuilt after an agent restart: eBPF saw neither allocate, so both are as old as can be.
    holdings = [Holding(1, "a", GPU, 400 * MiB, 0, gated=True), Holding(2, "a", GPU, 400 * MiB, 0, gated=False)]
    e.check(holdings, {"a": 500 * MiB})
    assert killed == [2]
