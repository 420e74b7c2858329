"""Unit tests of MemoryEnforcer's decision: who is killed, when, and what is counted."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from testkit import GiB, MiB

from gemtrace.agent.collectors.enforcement import EnforcementCollector
from gemtrace.agent.enforcement import Holding, MemoryEnforcer
from gemtrace.groups_of import ProcReader, parse_uid

pytestmark = pytest.mark.unit

GPU = "GPU-0"


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
    e.note_tampering(7, "a", GPU, slot_bytes=0, verified_bytes=MiB)
    e.note_tampering(8, "a", GPU, slot_bytes=GiB, verified_bytes=0, kind="over_reporting")
    text = generate_latest(registry).decode()
    assert 'gemtrace_oom_kills_total{group="a"} 3.0' in text
    assert 'gemtrace_quota_breaches_total{group="a",resource="memory"} 1.0' in text
    assert 'gemtrace_tampering_events_total{group="a",kind="under_reporting"} 1.0' in text
    assert 'gemtrace_tampering_events_total{group="a",kind="over_reporting"} 1.0' in text


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
        for kind in ("under_reporting", "over_reporting"):
            assert f'gemtrace_tampering_events_total{{group="{group}",kind="{kind}"}} 0.0' in text

    e.check([Holding(1, "a", GPU, 600 * MiB, 1)], {"a": 500 * MiB})
    defined = ["b"]  # a reload removed group a: its counts stay, a counter does not go back
    text = generate_latest(registry).decode()
    assert 'gemtrace_oom_kills_total{group="a"} 1.0' in text
    assert 'gemtrace_quota_breaches_total{group="a",resource="memory"} 1.0' in text
    assert 'gemtrace_tampering_events_total{group="a"' not in text  # never had one, no longer defined
    assert 'gemtrace_oom_kills_total{group="b"} 0.0' in text


def test_among_processes_of_unknown_allocation_time_an_ungated_one_goes_before_a_gated_one() -> None:
    killed: list[int] = []
    e = MemoryEnforcer(kill=killed.append)
    # Rebuilt after an agent restart: eBPF saw neither allocate, so both are as old as can be.
    holdings = [Holding(1, "a", GPU, 400 * MiB, 0, gated=True), Holding(2, "a", GPU, 400 * MiB, 0, gated=False)]
    e.check(holdings, {"a": 500 * MiB})
    assert killed == [2]


# -- who made the group go over: the victim's user (docs/accounting.md, "Who is killed") -------------

ROOT, ALICE, BOB = 0, 1000, 1001


def test_another_users_ungated_memory_in_the_group_gets_that_users_process_killed_not_roots() -> None:
    """The reported case: alice allocated 900 MiB without the gate in root's group; root's next gated
    allocation crossed the 1 GiB limit. The gate held root to the limit, nothing held alice."""
    killed: list[int] = []
    e = MemoryEnforcer(kill=killed.append)
    alice = Holding(10, "root-jobs", GPU, 900 * MiB, last_alloc_ns=100, gated=False, uid=ALICE)
    assert e.check([alice], {"root-jobs": GiB}) == []
    root = Holding(20, "root-jobs", GPU, 200 * MiB, last_alloc_ns=200, gated=True, uid=ROOT)
    kills = e.check([alice, root], {"root-jobs": GiB})
    assert killed == [10], "the newest allocator (root's) used to die here"
    assert kills[0].uid == ALICE and kills[0].process_bytes == 900 * MiB
    # Until alice's process has exited nobody else dies for its memory, even as root allocates more.
    root_more = Holding(20, "root-jobs", GPU, 300 * MiB, last_alloc_ns=300, gated=True, uid=ROOT)
    assert e.check([alice, root_more], {"root-jobs": GiB}) == []
    assert e.check([root_more], {"root-jobs": GiB}) == [] and killed == [10]


def test_the_same_processes_of_one_user_lose_the_newest_as_before() -> None:
    """A group of one user is unchanged: the newest allocator dies, gated or not."""
    killed: list[int] = []
    e = MemoryEnforcer(kill=killed.append)
    e.check([
        Holding(10, "g", GPU, 900 * MiB, last_alloc_ns=100, gated=False, uid=ALICE),
        Holding(20, "g", GPU, 200 * MiB, last_alloc_ns=200, gated=True, uid=ALICE),
    ], {"g": GiB})
    assert killed == [20]


def test_a_single_user_group_dies_in_the_order_it_always_did() -> None:
    holdings = [
        Holding(1, "g", GPU, 200 * MiB, last_alloc_ns=50, gated=True, uid=ALICE),
        Holding(2, "g", GPU, 200 * MiB, last_alloc_ns=40, gated=False, uid=ALICE),
        Holding(3, "g", GPU, 200 * MiB, last_alloc_ns=0, gated=True, uid=ALICE),  # rebuilt: oldest
        Holding(4, "g", GPU, 200 * MiB, last_alloc_ns=0, gated=False, uid=ALICE),
        Holding(5, "g", GPU, 200 * MiB, last_alloc_ns=60, gated=True, uid=ALICE),
    ]
    killed: list[int] = []
    MemoryEnforcer(kill=killed.append).check(holdings, {"g": 100 * MiB})
    # Newest allocation first; among the unknown (0), the ungated first. One short of the limit: all die.
    assert killed == [5, 1, 2, 4, 3]


def test_when_the_gates_own_sum_is_over_the_users_who_allocated_since_it_fit_go_first() -> None:
    """A reload lowered the limit as root allocated again (the gated sum is over: the gate cannot have
    held anyone to the new limit). Root allocated since the group last fit, alice did not: root's
    older process goes before alice's newer one."""
    killed: list[int] = []
    e = MemoryEnforcer(kill=killed.append)
    root_old = Holding(1, "g", GPU, 600 * MiB, last_alloc_ns=5, gated=True, uid=ROOT)
    alice = Holding(2, "g", GPU, 250 * MiB, last_alloc_ns=10, gated=True, uid=ALICE)
    assert e.check([root_old, alice], {"g": 900 * MiB}) == []
    root_new = Holding(3, "g", GPU, 100 * MiB, last_alloc_ns=20, gated=True, uid=ROOT)
    kills = e.check([root_old, alice, root_new], {"g": 700 * MiB})
    assert killed == [3, 1], "newest first alone would have killed alice's pid 2 second"
    assert {k.uid for k in kills} == {ROOT}


def test_another_users_process_dies_only_once_the_culprits_are_all_gone() -> None:
    """Root's processes are all killed and the group is still over: then alice's, newest first."""
    killed: list[int] = []
    e = MemoryEnforcer(kill=killed.append)
    a1 = Holding(1, "g", GPU, 400 * MiB, last_alloc_ns=5, gated=True, uid=ALICE)
    a2 = Holding(2, "g", GPU, 400 * MiB, last_alloc_ns=8, gated=True, uid=ALICE)
    assert e.check([a1, a2], {"g": GiB}) == []
    r = Holding(3, "g", GPU, 100 * MiB, last_alloc_ns=20, gated=True, uid=ROOT)
    e.check([a1, a2, r], {"g": 300 * MiB})  # the limit lowered below alice's own 800 MiB
    assert killed == [3, 2, 1]


def test_a_lowered_limit_with_no_allocation_since_blames_every_user_newest_first() -> None:
    killed: list[int] = []
    e = MemoryEnforcer(kill=killed.append)
    holdings = [Holding(1, "g", GPU, 500 * MiB, last_alloc_ns=5, gated=True, uid=ROOT),
                Holding(2, "g", GPU, 500 * MiB, last_alloc_ns=9, gated=True, uid=ALICE)]
    assert e.check(holdings, {"g": GiB}) == []
    e.check(holdings, {"g": 600 * MiB})
    assert killed == [2]


def test_ties_among_the_culprits_go_ungated_then_bigger_then_higher_pid() -> None:
    # Rebuilt after an agent restart: nobody's allocation time is known. Two users without the gate.
    holdings = [
        Holding(1, "g", GPU, 300 * MiB, 0, gated=False, uid=ALICE),
        Holding(2, "g", GPU, 500 * MiB, 0, gated=False, uid=BOB),
        Holding(3, "g", GPU, 300 * MiB, 0, gated=False, uid=BOB),
        Holding(4, "g", GPU, 100 * MiB, 0, gated=True, uid=ROOT),
    ]
    killed: list[int] = []
    MemoryEnforcer(kill=killed.append).check(holdings, {"g": 50 * MiB})
    # Root's gated 100 MiB alone is over the 50 MiB limit, and the group was never seen within it:
    # every user is to blame. Ungated first, then the bigger, then the higher pid; the gated one last.
    assert killed == [2, 3, 1, 4]
    # With a limit the gated process fits, it is not killed at all: the ungated users took it over.
    killed.clear()
    MemoryEnforcer(kill=killed.append).check(holdings, {"g": 150 * MiB})
    assert killed == [2, 3, 1]


def test_an_unknown_uid_is_one_more_user() -> None:
    """A process whose uid could not be read (it was exiting) is not lumped in with root's."""
    killed: list[int] = []
    e = MemoryEnforcer(kill=killed.append)
    gone = Holding(1, "g", GPU, 900 * MiB, last_alloc_ns=100, gated=False, uid=None)
    root = Holding(2, "g", GPU, 200 * MiB, last_alloc_ns=200, gated=True, uid=ROOT)
    e.check([gone, root], {"g": GiB})
    assert killed == [1]


class _Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, object]]] = []

    def warning(self, event: str, **fields: object) -> None:
        self.events.append((event, fields))


def test_the_kill_log_names_the_victims_uid_and_the_users_blamed() -> None:
    log = _Recorder()
    killed: list[int] = []
    e = MemoryEnforcer(kill=killed.append, log=log)
    e.check([Holding(10, "g", GPU, 900 * MiB, 100, gated=False, uid=ALICE),
             Holding(20, "g", GPU, 200 * MiB, 200, gated=True, uid=ROOT)], {"g": GiB})
    (kill,) = [fields for event, fields in log.events if event == "oom_kill"]
    assert kill["pid"] == 10 and kill["uid"] == ALICE and kill["culprit_uids"] == [ALICE]


def test_the_uid_is_the_real_uid_of_proc_status(tmp_path: Path) -> None:
    # A set-uid program run by alice: real 1000, effective 0. Alice started it.
    status = b"Name:\tsu\nUmask:\t0022\nState:\tS (sleeping)\nUid:\t1000\t0\t0\t0\nGid:\t1000\t1000\t1000\t1000\n"
    assert parse_uid(status) == ALICE
    assert parse_uid(b"Name:\tx\n") is None
    (tmp_path / "4242").mkdir()
    (tmp_path / "4242" / "status").write_bytes(status)
    assert ProcReader(tmp_path).uid(4242) == ALICE
    assert ProcReader(tmp_path).uid(4243) is None
    assert ProcReader().uid(os.getpid()) == os.getuid()
