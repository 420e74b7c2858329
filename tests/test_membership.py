"""The agent's one decision of a gated process's group (gemtrace/agent/membership.py): the pure rule, then
the pass over a real region file with processes described by a /proc tree."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from structlog.testing import capture_logs
from testkit import GiB

from gemtrace import contract, eventlog
from gemtrace import region as rg
from gemtrace.agent.gang import NO_JOB, JobKeys
from gemtrace.agent.membership import Membership, decide, group_of, job_of
from gemtrace.config import parse_text
from gemtrace.groups_of import ProcReader, parse_gids

pytestmark = pytest.mark.unit

ALICE, BOB, ML = 1001, 1002, 3000
CONFIG = parse_text(f"[ml]\nUsers = {ALICE}\nUnixGroups = {ML}\n[pods]\nCgroup = /kubepods\n[open]\n")
DEFINED = set(CONFIG.groups)


@pytest.mark.parametrize(("requested", "uid", "gids", "cgroups", "expected"), [
    ("ml", ALICE, [ALICE], ["/user.slice"], ("ml", False)),  # named in Users
    ("ml", BOB, [BOB, ML], ["/user.slice"], ("ml", False)),  # in a Unix group of UnixGroups
    ("ml", 0, [0], ["/"], ("ml", False)),  # root, always
    ("ml", BOB, [BOB], ["/user.slice"], ("default", True)),  # refused: default
    ("ml", BOB, [BOB], ["/kubepods/pod1"], ("pods", True)),  # refused: its cgroup's group
    ("open", BOB, [BOB], ["/"], ("open", False)),  # a group without Users/UnixGroups admits everyone
    ("", BOB, [BOB], ["/kubepods/pod1"], ("pods", False)),  # no wish: the Cgroup rule
    ("nosuch", BOB, [BOB], ["/"], ("default", False)),  # undefined: not a refusal, the gate says so
    ("default", BOB, [BOB], ["/kubepods/x"], ("default", False)),  # asked for default: stays there
])
def test_decide(requested: str, uid: int, gids: list[int], cgroups: list[str], expected: tuple[str, bool]) -> None:
    decision = decide(requested, uid, gids, cgroups, CONFIG.groups, DEFINED)
    assert (decision.group, decision.refused) == expected


def test_parse_gids_reads_the_real_gid_and_the_supplementary_groups() -> None:
    status = b"Name:\tx\nUid:\t1002\t1002\t1002\t1002\nGid:\t1002\t0\t0\t0\nGroups:\t27 3000 \n"
    assert parse_gids(status) == [1002, 27, 3000]
    assert parse_gids(b"Name:\tx\n") is None


def _process(proc: Path, pid: int, uid: int, gids: list[int], cgroup: str = "0::/user.slice\n",
             start_time: int = 4242, environ: dict[str, str] | None = None) -> None:
    d = proc / str(pid)
    d.mkdir(parents=True)
    d.joinpath("environ").write_bytes(b"".join(f"{k}={v}".encode() + b"\0" for k, v in (environ or {}).items()))
    d.joinpath("stat").write_text(f"{pid} (python3) S " + " ".join(["0"] * 18 + [str(start_time)] + ["0"] * 10))
    d.joinpath("status").write_text(f"Uid:\t{uid}\t{uid}\t{uid}\t{uid}\nGid:\t{gids[0]}\t{gids[0]}\t0\t0\n"
                                    f"Groups:\t{' '.join(map(str, gids[1:]))}\n")
    d.joinpath("cgroup").write_text(cgroup)


def _claim(region: rg.Region, index: int, pid: int, requested: str, start_time: int = 4242) -> None:
    slot = region.slots[index]
    slot.requested = requested.encode()
    slot.start_time = start_time
    slot.pid = pid
    slot.flags = contract.SLOT_GATED


@pytest.fixture
def region(tmp_path: Path):  # type: ignore[no-untyped-def]
    r = rg.Region.create(tmp_path / "state")
    for name in ("default", *CONFIG.groups):
        r.set_group(name, None, 0, 1)
    yield r
    r.close()


def test_the_pass_assigns_new_slots_counts_refusals_and_clears_freed_ones(region: rg.Region, tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    _process(proc, 501, ALICE, [ALICE])
    _process(proc, 502, BOB, [BOB])
    _process(proc, 503, BOB, [BOB], cgroup="0::/kubepods/pod9\n")
    membership = Membership(region, lambda: CONFIG.groups, ProcReader(proc))
    _claim(region, 1, 501, "ml")
    _claim(region, 2, 502, "ml")
    _claim(region, 3, 503, "ml")
    region.slots[4].pid = 504  # claimed, not filled yet: no decision until its gate sets the flag
    assert membership.tick() == 3
    index = region.defined_groups()
    assert region.slot_groups() == {1: index["ml"], 2: index["default"], 3: index["pods"]}
    assert membership.refusals == {"ml": 2}
    assert membership.tick() == 0  # decided once: nothing new
    assert membership.refusals == {"ml": 2}
    # A gate frees its own slot at exit and cannot clear the region's entry: the pass does.
    region.slots[1].pid = 0
    membership.tick()
    assert region.layout.assigned[1].pid == 0 and region.layout.assigned[1].group == rg.GROUP_UNASSIGNED
    # A slot whose process has gone before the agent looked stays unassigned (the reaper frees it).
    _claim(region, 5, 999, "ml")
    assert membership.tick() == 0 and region.assigned_group(5, 999) is None


def test_a_users_refusals_are_all_counted_and_logged_within_its_budget(region: rg.Region, tmp_path: Path) -> None:
    """A user starting many processes that ask for a group it is not admitted to: every refusal counts
    in the metric, its lines stop at the per-uid budget (gemtrace/eventlog.py), and another user's
    refusal right after is still logged."""
    flooder, other = 7101, 7102  # uids of this test's own: the limiter is the process's one
    proc = tmp_path / "proc"
    n = eventlog.USER_BURST + 10
    for k in range(n + 1):
        _process(proc, 600 + k, flooder if k < n else other, [flooder if k < n else other])
        _claim(region, k, 600 + k, "ml")
    membership = Membership(region, lambda: CONFIG.groups, ProcReader(proc))
    started = time.monotonic()
    with capture_logs() as lines:
        assert membership.tick() == n + 1
    seconds = time.monotonic() - started
    assert membership.refusals == {"ml": n + 1}
    refused = [e["uid"] for e in lines if e["event"] == "group_refused"]
    assert eventlog.USER_BURST <= refused.count(flooder) <= eventlog.USER_BURST + seconds / eventlog.LINE_SECONDS
    assert refused.count(other) == 1


def test_a_pid_from_a_containers_namespace_is_not_decided_for_the_hosts_process(region: rg.Region,
                                                                                  tmp_path: Path) -> None:
    """A gate in a pod stores its pid there (7); here 7 is root's process, started at another time.
    No decision on root's credentials: the reaper gives the slot its host pid (8123), then Bob's
    credentials decide."""
    proc = tmp_path / "proc"
    _process(proc, 7, 0, [0], start_time=100)
    _process(proc, 8123, BOB, [BOB], start_time=5555)
    membership = Membership(region, lambda: CONFIG.groups, ProcReader(proc))
    _claim(region, 3, 7, "ml", start_time=5555)
    assert membership.tick() == 0 and region.assigned_group(3, 7) is None
    assert region.translate_slot(3, 7, 8123)
    assert membership.tick() == 1
    assert region.assigned_group(3, 8123) == region.defined_groups()["default"]
    assert membership.refusals == {"ml": 1}


def test_a_forged_pid_in_a_slot_gains_its_writer_nothing(region: rg.Region, tmp_path: Path) -> None:
    """Bob's gate writes root's pid into its slot, hoping for root's admission: the agent decides
    for that pid (root's process), and Bob's gate only ever reads an entry naming its own pid."""
    proc = tmp_path / "proc"
    _process(proc, 1, 0, [0])
    membership = Membership(region, lambda: CONFIG.groups, ProcReader(proc))
    _claim(region, 7, 1, "ml")
    membership.tick()
    assert region.assigned_group(7, 1) == region.defined_groups()["ml"]
    assert region.assigned_group(7, 4242) is None  # Bob's process (pid 4242) is not in ml


def test_the_accounting_counts_a_gated_process_where_it_was_assigned(region: rg.Region, tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    _process(proc, 502, BOB, [BOB])
    _process(proc, 600, BOB, [BOB])  # ungated, asks through its environment
    reader = ProcReader(proc)
    _claim(region, 2, 502, "ml")
    assert group_of(502, {"GEMTRACE_GROUP": "ml"}, reader, region, CONFIG.groups) == ("default", False)  # undecided
    Membership(region, lambda: CONFIG.groups, reader).tick()
    assert group_of(502, {"GEMTRACE_GROUP": "ml"}, reader, region, CONFIG.groups) == ("default", True)
    assert group_of(600, {"GEMTRACE_GROUP": "ml"}, reader, region, CONFIG.groups) == ("default", True)
    assert group_of(600, {"GEMTRACE_GROUP": "open"}, reader, region, CONFIG.groups) == ("open", True)


# Two containers of one pod, each with its grant, and a pod of one: the device plugin's drop-ins.
POD = "/kubepods/podaa"
BOUND = parse_text(f"[ml]\nUsers = {ALICE}\n[open]\n[pods]\nCgroup = /kubepods\n"
                   f"[k8s-a]\nCgroup = {POD}\nCgroupBinding = true\n[k8s-b]\nCgroup = {POD}\nCgroupBinding = true\n"
                   "[k8s-c]\nCgroup = /kubepods/podcc\nCgroupBinding = true\n")


@pytest.mark.parametrize(("requested", "uid", "cgroups", "expected"), [
    ("", BOB, ["/kubepods/podcc/0123"], ("k8s-c", False, True)),  # env -i in a container: its pod's group
    ("default", BOB, ["/kubepods/podcc/0123"], ("k8s-c", False, True)),  # an old gate's wish for default
    ("open", BOB, ["/kubepods/podcc/0123"], ("k8s-c", False, True)),  # a group open to all: still its pod's
    ("ml", ALICE, ["/kubepods/podcc"], ("k8s-c", False, True)),  # even one its user is admitted to
    ("k8s-b", BOB, [f"{POD}/0456"], ("k8s-b", False, True)),  # its own container's group, of its pod's
    ("k8s-c", BOB, [f"{POD}/0456"], ("k8s-a", False, True)),  # another pod's: the first of its own pod's
    ("", BOB, [f"{POD}/0456"], ("k8s-a", False, True)),
    ("open", BOB, ["/kubepods/poddd"], ("open", False, False)),  # a plain rule still yields to a request
    ("", BOB, ["/kubepods/poddd"], ("pods", False, False)),
])
def test_a_binding_cgroup_rule_decides_whatever_the_process_asks(requested: str, uid: int, cgroups: list[str],
                                                                  expected: tuple[str, bool, bool]) -> None:
    decision = decide(requested, uid, [uid], cgroups, BOUND.groups, set(BOUND.groups))
    assert (decision.group, decision.refused, decision.bound) == expected


def test_a_binding_rule_that_comes_later_moves_the_processes_already_placed(region: rg.Region,
                                                                           tmp_path: Path) -> None:
    """The plugin learns a pod's cgroup once the kubelet has made it: a process of the pod that
    started before (env -i, so placed by no rule in default) moves at the reload that brings it."""
    proc = tmp_path / "proc"
    _process(proc, 700, BOB, [BOB], cgroup="0::/kubepods/podcc/0123\n")
    _process(proc, 701, BOB, [BOB], cgroup="0::/user.slice\n")
    groups = {"now": CONFIG.groups}
    membership = Membership(region, lambda: groups["now"], ProcReader(proc))
    _claim(region, 1, 700, "")
    _claim(region, 2, 701, "open")
    assert membership.tick() == 2
    index = region.defined_groups()
    assert region.slot_groups() == {1: index["pods"], 2: index["open"]}
    assert membership.rebind() == 0  # no binding rule yet
    region.set_group("k8s-c", GiB, 0, 1)
    groups["now"] = BOUND.groups
    with capture_logs() as lines:
        assert membership.rebind() == 1
    assert region.slot_groups() == {1: region.defined_groups()["k8s-c"], 2: index["open"]}
    assert [e["pid"] for e in lines if e["event"] == "process_bound_to_group"] == [700]
    assert membership.rebind() == 0  # the same rules: nothing to look at again


POD = "/kubepods/besteffort/pod0f1e2d3c-aaaa-bbbb-cccc-0123456789ab/" + "c" * 64


@pytest.mark.parametrize(("environ", "cgroups", "expected"), [
    # torch.distributed's rendezvous, however each rank was started: one run's ranks share it
    ({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "GEMTRACE_JOB": "a"}, ["/"], "7 rendezvous 127.0.0.1 29500"),
    ({"MASTER_ADDR": "127.0.0.1", "GEMTRACE_JOB": "a"}, ["/"], "7 run a"),  # half a rendezvous names none
    ({"PMIX_NAMESPACE": "prterun-host-1234@1"}, [POD], "7 rendezvous prterun-host-1234@1"),  # MPI over the pod
    ({"SLURM_JOB_ID": "12", "SLURM_STEP_ID": "0"}, ["/"], "7 rendezvous 12 0"),
    ({"GEMTRACE_JOB": "a"}, [POD], "7 pod 0f1e2d3c-aaaa-bbbb-cccc-0123456789ab"),  # a pod's containers: one job
    # a training operator's workers reach their master by name; a loopback one is the pod's own
    ({"MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456"}, [POD], "7 rendezvous job-master-0 23456"),
    ({"MASTER_ADDR": "localhost", "MASTER_PORT": "12355"}, [POD],
     "7 pod 0f1e2d3c-aaaa-bbbb-cccc-0123456789ab rendezvous localhost 12355"),
    ({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "12355"}, ["/user.slice"], "7 rendezvous 127.0.0.1 12355"),
    ({"GEMTRACE_JOB": " a "}, ["/user.slice"], "7 run a"),  # the `gemtrace run` that started it
    ({}, ["/user.slice"], ""),  # none: the group's processes that name none are one job
    ({"GEMTRACE_JOB": "x" * 10000}, ["/"], ("7 run " + "x" * 10000)[:256]),  # cut: the agent's memory is not theirs
])
def test_job_of_names_the_run_then_the_pod_then_the_gemtrace_run(environ: dict[str, str], cgroups: list[str],
                                                                  expected: str) -> None:
    assert job_of(7, environ, cgroups) == expected


def test_the_pass_records_each_processs_job_before_its_assignment(region: rg.Region, tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    rank = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    _process(proc, 501, ALICE, [ALICE], environ={**rank, "GEMTRACE_JOB": "first"})
    _process(proc, 502, ALICE, [ALICE], environ={**rank, "GEMTRACE_JOB": "second"})
    _process(proc, 503, ALICE, [ALICE], environ={"GEMTRACE_JOB": "first"})
    _process(proc, 504, BOB, [BOB], environ=rank)  # another user naming the same run: not in it
    _process(proc, 505, BOB, [BOB])
    jobs = JobKeys()
    membership = Membership(region, lambda: CONFIG.groups, ProcReader(proc), jobs=jobs)
    for index, pid in enumerate((501, 502, 503, 504, 505), start=1):
        _claim(region, index, pid, "open")
    assert membership.tick() == 5
    job = {pid: jobs.of(index, pid) for index, pid in enumerate((501, 502, 503, 504, 505), start=1)}
    assert job[501] == job[502] != NO_JOB  # two ranks of one run, started apart
    assert len({job[501], job[503], job[504]}) == 3 and job[505] == NO_JOB
    assert jobs.of(1, 999) == NO_JOB  # the slot's job is its process's only
    assert len(jobs) == 3
    region.slots[1].pid = 0  # the gate freed its slot at exit
    membership.tick()
    assert jobs.of(1, 501) == NO_JOB and len(jobs) == 3  # its run's other rank holds the key
    region.slots[2].pid = 0
    region.slots[3].pid = 0
    membership.tick()
    assert len(jobs) == 1  # keys no process holds are forgotten: every `gemtrace run` names a new one


def test_a_new_agent_records_the_jobs_of_the_processes_placed_before_it(region: rg.Region, tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    _process(proc, 501, ALICE, [ALICE], environ={"GEMTRACE_JOB": "sweep-1"})
    _process(proc, 502, ALICE, [ALICE], environ={"GEMTRACE_JOB": "sweep-1"})
    _process(proc, 503, ALICE, [ALICE], environ={"GEMTRACE_JOB": "sweep-2"})
    before = Membership(region, lambda: CONFIG.groups, ProcReader(proc))  # an agent that kept no jobs
    for index, pid in enumerate((501, 502, 503), start=1):
        _claim(region, index, pid, "open")
    assert before.tick() == 3
    jobs = JobKeys()
    after = Membership(region, lambda: CONFIG.groups, ProcReader(proc), jobs=jobs)
    assert after.tick() == 0  # placed already: nothing to decide
    assert after.adopt_jobs() == 3
    assert jobs.of(1, 501) == jobs.of(2, 502) != jobs.of(3, 503) != NO_JOB
