"""Issue 11 in-process: what a scribbled region (root's file: a bug or root itself) and the agent's
process limits do, and that the agent, the region and the schedulers come through it. A real region
file, a real Agent object (no eBPF, a made-up GPU), real child processes for the reaper; forgeries
are written through Region or a raw mmap of the file, as root. What another user can do to the two
files is tests/test_trust.py's part (as a real unprivileged user)."""

from __future__ import annotations

import mmap
import os
import resource
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from testkit import claim, wait_until

from gemtrace import contract, defaults
from gemtrace import region as rg
from gemtrace.agent.agent import Agent, AgentLock, AgentRunning, Reaper, raise_fd_limit
from gemtrace.agent.policy import MS
from gemtrace.agent.scheduler import GpuScheduler, Quota
from gemtrace.gpus import Gpu
from gemtrace.groups_of import ProcReader

pytestmark = pytest.mark.unit

CONFIG = "[train]\nMinUtil = 0.2\nMaxUtil = 0.8\nMemoryLimit = 1GiB\n\n[infer]\nMaxUtil = 0.5\n"


def make_agent(tmp_path: Path, text: str = CONFIG) -> Agent:
    config = tmp_path / "resource.conf"
    config.write_text(text)
    return Agent(config, tmp_path / "state", use_ebpf=False, gpus=[Gpu(0, "GPU-test", "simulated", 16 << 30)])


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    a = make_agent(tmp_path)
    yield a
    a.close()


def reload(agent: Agent, text: str) -> None:
    path = agent.config_path
    path.write_text(text)
    assert agent.reload(path)


def sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


# -- 1. one agent per state dir ---------------------------------------------------------------------


def test_a_second_lock_on_the_state_dir_names_the_first_owner(tmp_path: Path) -> None:
    first = AgentLock(tmp_path)
    try:
        with pytest.raises(AgentRunning) as e:
            AgentLock(tmp_path)
        assert str(e.value) == f"another gemtrace agent (pid {os.getpid()}) owns {tmp_path}; stop it first"
    finally:
        first.release()
    AgentLock(tmp_path).release()  # free again once the first let go


# -- 2. a region that cannot be trusted --------------------------------------------------------------


def test_a_new_region_is_allocated_not_sparse(tmp_path: Path) -> None:
    r = rg.Region.create(tmp_path)
    st = os.stat(tmp_path / rg.REGION_FILE)
    assert st.st_blocks * 512 >= rg.REGION_SIZE  # every page has its block: no SIGBUS on a full filesystem
    r.close()


def raw_map(path: Path) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, rg.REGION_SIZE, mmap.MAP_SHARED)
    finally:
        os.close(fd)


def test_garbage_names_are_read_without_error_and_an_unsound_region_is_replaced(tmp_path: Path) -> None:
    first = rg.Region.create(tmp_path)
    first.set_group("train", None, 0, 1)
    raw = raw_map(tmp_path / rg.REGION_FILE)
    start = rg.RegionLayout.groups.offset
    raw[start : start + rg.NAME_LEN * 4] = bytes([0xFF]) * (rg.NAME_LEN * 4)  # past the header, no NUL
    assert isinstance(first.group_names()[0], str)  # decoded defensively, no UnicodeDecodeError
    raw[start + 10] = 0  # NUL-terminated now, but not UTF-8
    assert "\ufffd" in first.group_names()[0]
    assert rg.unsound(first.layout) == "group 0: its name is not UTF-8"
    first.close()
    reasons: list[str] = []
    second = rg.Region.create(tmp_path, on_replace=reasons.append)
    assert reasons == [f"{tmp_path / rg.REGION_FILE}: group 0: its name is not UTF-8"]
    assert second.group_names() == {}
    for i in range(rg.MAX_GROUPS):  # the room the garbage took is free again
        second.set_group(f"g{i}", None, 0, 1)
    second.close()
    raw.close()


def test_a_forged_control_word_makes_the_region_unsound(tmp_path: Path) -> None:
    r = rg.Region.create(tmp_path)
    r.layout.control[3][5].held = 77
    assert rg.unsound(r.layout) == "control word of GPU 3, group 5 is 77"
    r.close()


# -- 3. forgeries last at most one look (words) or one second (the group table) ----------------------


def test_the_scheduler_puts_back_a_forged_word_at_its_next_look(tmp_path: Path) -> None:
    region = rg.Region.create(tmp_path)
    clock_ns = [1_000 * MS]
    sched = GpuScheduler(region, 0, clock=lambda: clock_ns[0])
    a, b = region.set_group("a", None, 0, 1), region.set_group("b", None, 0, 1)
    sched.set_quotas({a: Quota(0, 1), b: Quota(0, 1)})
    sched.step()
    assert region.is_held(0, a) and region.is_held(0, b)  # nobody wants the GPU: both held
    region.layout.control[0][a].held = rg.RELEASED  # scribbled (by root: no other user can)
    region.layout.control[0][40].held = rg.HELD  # and a hold on a group nobody schedules
    clock_ns[0] += MS
    sched.step()
    assert region.layout.control[0][a].held == rg.HELD
    assert region.layout.control[0][40].held == rg.RELEASED
    region.close()


def test_the_agent_puts_back_a_forged_group_table_within_a_second(agent: Agent) -> None:
    agent.start()
    try:
        r = agent.region
        train = r.group_index("train")
        infer = r.group_index("infer")
        assert train is not None and infer is not None
        r.layout.groups[train].memory_limit = rg.NO_LIMIT  # scribbled by root (a user cannot: test_trust.py)
        r.layout.groups[infer].max_util_ppm = rg.UTIL_ONE
        r.layout.groups[50].name = b"forged"
        r.layout.groups[50].defined = 1
        forged = time.monotonic()
        while time.monotonic() - forged < 2:
            g = r.layout.groups
            if g[train].memory_limit == 1 << 30 and g[infer].max_util_ppm == 500_000 and not g[50].name:
                break
            time.sleep(0.01)
        assert r.layout.groups[train].memory_limit == 1 << 30
        assert r.layout.groups[infer].max_util_ppm == 500_000
        assert r.layout.groups[50].name == b"" and r.layout.groups[50].defined == 0
        assert time.monotonic() - forged < 1.2  # TABLE_SECONDS and a tick
        r.layout.header.heartbeat_ns = 0  # and the heartbeat within a keeper's tick (idle: no gate joins)
        wait_for = defaults.KEEPER_IDLE_SECONDS + 0.05
        time.sleep(wait_for)
        assert time.monotonic_ns() - r.layout.header.heartbeat_ns < wait_for * 1e9
    finally:
        agent.stop()


# -- 4. dropped and renamed groups -------------------------------------------------------------------


def test_processes_of_a_dropped_group_move_to_default_and_its_entry_is_freed(agent: Agent) -> None:
    r = agent.region
    infer, default = r.group_index("infer"), r.group_index("default")
    assert infer is not None and default is not None
    child = sleeper()
    try:
        claim(r, 9, child.pid, infer)
        reload(agent, CONFIG.replace("[infer]", "[serve]"))  # renamed
        assert r.assigned_group(9, child.pid) == default
        assert r.group_index("infer") is None  # freed: no slot refers to it any more
        serve = r.group_index("serve")
        assert serve is not None and r.layout.groups[serve].defined == 1
        assert agent.schedulers[0]._pending_quotas is not None and default in agent.schedulers[0]._pending_quotas
    finally:
        child.kill()
        child.wait()


def test_a_hundred_renames_never_exhaust_the_table(agent: Agent) -> None:
    for i in range(100):
        reload(agent, CONFIG.replace("[infer]", f"[infer{i}]"))
    names = set(agent.region.group_names().values())
    assert names == {"train", "infer99", "default"}


def test_an_entry_an_assignment_still_points_at_is_never_freed(agent: Agent) -> None:
    r = agent.region
    infer, default = r.group_index("infer"), r.group_index("default")
    assert infer is not None
    child = sleeper()
    try:
        claim(r, 3, child.pid, infer)
        with agent._table_lock:
            # A table without default: the process cannot be moved, so its entry must stay.
            agent._sync_table({i: g for i, g in agent._groups.items() if g.name == "train"})
            assert r.group_index("infer") == infer and r.layout.groups[infer].defined == 0
            assert r.group_index("default") is None  # no slot there: freed
            agent._sync_table(agent._groups)
        assert r.assigned_group(3, child.pid) == infer  # infer is defined again: the process stays
        assert r.group_index("infer") == infer and r.group_index("default") == default
    finally:
        child.kill()
        child.wait()


def test_a_pods_slot_seen_before_its_gate_filled_it_gets_the_host_pid(tmp_path: Path) -> None:
    """A gate in a PID namespace claims its slot with its pid there (1 for a pod's first process:
    the host's init here), then writes its start time, then its flag (hook/attach.c). A reaper tick
    between the claim and the flag must not watch the slot as it stands: it waits, then translates."""
    region = rg.Region.create(tmp_path)
    pod = subprocess.Popen(["unshare", "--pid", "--fork", "sleep", "60"])
    reaper = Reaper(region)
    try:
        children = Path(f"/proc/{pod.pid}/task/{pod.pid}/children")
        host_pid = int(wait_until("the pod's process", lambda: children.read_text().split())[0])
        status = Path(f"/proc/{host_pid}/status").read_text()
        assert next(line for line in status.splitlines() if line.startswith("NSpid:")).split()[1:] == [
            str(host_pid), "1"]
        slot = region.slots[5]
        slot.pid = 1  # claimed: start time and flag not written yet
        assert reaper.tick() == []
        slot.start_time = ProcReader().start_time(host_pid) or 0  # the same in every namespace
        slot.flags = contract.SLOT_GATED
        assert reaper.tick() == []
        assert region.slot_pids()[5] == host_pid
    finally:
        reaper.close()
        pod.kill()
        pod.wait()
        region.close()


def test_a_process_s_exit_rings_every_gpu_s_doorbell(tmp_path: Path) -> None:
    """A process that exits with work queued rings nobody itself: the reaper rings the doorbells when
    it sees a watched process exit, whether it frees the slot or the gate already did, so that a
    scheduler waiting for that group's end (a drain, a holder going quiet) looks now, not at its net."""
    region = rg.Region.create(tmp_path)
    assert region.doorbells is not None
    children = [sleeper(), sleeper()]
    reaper = Reaper(region)
    try:
        for i, child in enumerate(children):
            claim(region, i, child.pid, 0)
        assert reaper.tick() == []
        rung = [region.doorbells.rung(gpu) for gpu in range(rg.MAX_GPUS)]
        assert reaper.tick() == [] and [region.doorbells.rung(gpu) for gpu in range(rg.MAX_GPUS)] == rung
        children[0].kill()
        children[0].wait()
        wait_until("the reaper frees the slot", lambda: children[0].pid in reaper.tick())
        assert all(region.doorbells.rung(gpu) > rung[gpu] for gpu in range(rg.MAX_GPUS))
        rung = [region.doorbells.rung(gpu) for gpu in range(rg.MAX_GPUS)]
        region.slots[1].pid = 0  # its gate freed its own slot at exit
        children[1].kill()
        children[1].wait()
        wait_until("the exit seen", lambda: reaper.tick() == [] and region.doorbells is not None
                   and region.doorbells.rung(0) > rung[0])
    finally:
        reaper.close()
        for child in children:
            child.kill()
            child.wait()
        region.close()


# -- 5. the reaper out of file descriptors ----------------------------------------------------------


def test_out_of_file_descriptors_no_live_process_is_taken_for_gone(tmp_path: Path) -> None:
    region = rg.Region.create(tmp_path)
    children = [sleeper() for _ in range(40)]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    reaper = Reaper(region)
    try:
        for i, child in enumerate(children):
            claim(region, i, child.pid, 0)
        in_use = len(os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (in_use + 10, hard))  # room for about 10 pidfds
        assert reaper.tick() == []
        assert reaper.fd_limit_hits > 0
        assert sum(1 for p in region.slot_pids() if p) == 40  # every live slot kept
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert reaper.tick() == []
        assert len(reaper._watched) == 40  # watched once descriptors were there
        children[0].kill()
        children[0].wait()
        deadline = time.monotonic() + 2
        freed: list[int] = []
        while not freed and time.monotonic() < deadline:
            freed = reaper.tick()
            time.sleep(0.01)
        assert freed == [children[0].pid]
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        reaper.close()
        for child in children:
            child.kill()
            child.wait()
        region.close()


def test_the_fd_limit_is_raised_to_the_hard_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))
        assert raise_fd_limit() == (hard, hard)
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
