"""The scheduler end to end on the simulated GPU: GpuScheduler threads in this process over a real
region, gated launch loops as the groups' processes (tests/scheduler_harness.py). Each claim is in
figures that how busy the host is cannot move (`check`, issue 27): the scheduler's own account, the
simulated GPU's timeline, and the same loop run ungated on a GPU of its own over the same window
(the rig's last GPU, which the cases leave free), never a reference measured at another time.
Shares are asserted within 5 points, looser than the benchmark's 2 (bench/bench_scheduler_accuracy.py)."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import scheduler_harness as harness
from simgpu_env import SimGpu

from gemtrace import contract, defaults
from gemtrace.agent.policy import MS, PolicyParams

pytestmark = pytest.mark.e2e

WARMUP, SECONDS = 1.0, 3.0
POINTS = 5.0
# Two launch-bound groups taking turns do together at least this much of one alone. Each switch costs
# a drain and a wake-up of the loop released (0.99 at 24 holds a second on a quiet machine:
# bench/results/scheduler_accuracy.md, where the figure itself is judged), and a machine loaded
# beyond its CPUs makes every wake-up late, which the reference loop, never held, does not pay
# (0.70 beside stress-ng on both CPUs and other work). What this bound catches is a scheduler that
# loses whole slices between one group's hold and the next one's release: about half.
LAUNCH_BOUND_TOGETHER_MIN = 0.6
# Holds a second for those two groups: one per slice (23-25 in the bench and in loaded runs); a
# scheduler that took the GPU's idle spells between the holder's kernels for the holder going idle
# revoked it there (43-61 holds a second, with the split and the pair's throughput unchanged).
LAUNCH_BOUND_HOLDS_MAX = 40


@pytest.fixture
def rig(simgpu_factory: Callable[..., SimGpu], tmp_path: Path) -> Iterator[harness.Rig]:
    """GPU 0 for the case, GPU 1 for the reference beside it."""
    with harness.rig(simgpu_factory(devices=2), tmp_path / "state") as the_rig:
        yield the_rig


def check(rows: list[dict[str, Any]]) -> None:
    """Each group against what the load on the host cannot move: the scheduler's own account, and
    the GPU's timeline measured against it. A group alone: the scheduler charged it its target of the
    time it wanted the GPU (at least its target for ">="). Groups that share a GPU: each one's part of
    the GPU seconds charged to them all. Either way, for a target of "=", the GPU ran no more of its
    kernels than that target of its time (a gate that let it launch while held would run past it; a
    busy host only slows the loops). A group alone that is never held (">=") is also judged by its
    share of the reference, which runs as it does. What a held group does with the time it is given
    is partly the host's: each release wakes its processes, late on a busy host, and a group of three
    processes fills its slices where one process beside it, or the reference, waits for its wake-ups;
    so is the gap between one group's hold and the next one's release, which waits for the held
    processes to report their drain, and which a busy host leaves charged to nobody. test_policy
    holds both on a fake clock (the caps within the GPU get their whole MaxUtil), test_gate times the
    wake-up."""
    table = "\n".join(f"{r['group']}@{r['device']}: charged {r['charged']:.3f} of the time it wanted the GPU, "
                      f"{r['charged_split']:.3f} of its groups' GPU seconds; did {r['device_share']:.3f} of the GPU, "
                      f"{r['measured']:.3f} of the reference, {r['split']:.3f} of what its groups did; "
                      f"for {r['kind']} {r['target']}" for r in rows)
    for row in rows:
        assert harness.within({**row, "measured": row["charged" if row["alone"] else "charged_split"]}, POINTS), table
        assert row["kind"] != "=" or row["device_share"] <= row["target"] + POINTS / 100, table
        if row["alone"] and row["kind"] == ">=":
            assert harness.within(row, POINTS), table


@pytest.mark.parametrize("case", harness.CASES, ids=lambda c: c.name)
def test_share(rig: harness.Rig, case: harness.Case) -> None:
    rows = harness.run_case(rig, case, WARMUP, SECONDS)
    # The reference is a plain launch loop: it keeps its GPU busy but for each sync's wake-up, which a
    # busy host makes later; only a wake-up as long as the loop's 8 ms of kernels would halve it.
    assert 0.5 < rows[0]["reference"] <= 1.0
    check(rows)
    if len(case.loads) == 1 and case.loads[0].quota.max_util == 1.0:
        # Alone and uncapped: one look per slice, no polling (about 17 a second).
        assert rows[0]["looks_per_s"] < 80


def test_share_of_launch_bound_loops_counts_their_gaps(rig: harness.Rig) -> None:
    """Caps of 0.3 and 0.7 split launch-bound loops' throughput 0.3 / 0.7, together they do what one
    does alone, and the holder is held once a slice: the GPU is the holder's while it has a burst
    open, the gaps between its kernels included (docs/scheduler.md, "What a share means"). Charging
    the holder only its kernels would give the group of 0.3 more of the split; revoking it at its
    gaps would hold it more often and, where a resume costs, lose throughput. The split is asserted,
    not each group's share of the reference: these loops' speed is the CPU's, which a loaded machine
    gives unevenly from one slice to the next, so a group's slices and the reference's whole window
    need not see the same CPU; the two groups share the same slices, and their split does not depend
    on it."""
    rows = harness.run_case(rig, harness.LAUNCH_BOUND_CAPS, WARMUP, SECONDS)
    # Launch-bound: 20 us kernels after 30 us of CPU each leave the GPU idle much of each burst.
    assert rows[0]["reference"] < 0.8
    measured = {row["group"]: row["measured"] for row in rows}
    together, split = rows[0]["together"], rows[0]["split"]
    holds = rows[0]["switches_per_s"]
    summary = (f"capped30 {measured['capped30']:.3f}, capped70 {measured['capped70']:.3f} of the reference: split "
               f"{split:.3f}, {holds:.0f} holds/s")
    assert abs(split - 0.3) <= POINTS / 100, summary
    assert together >= LAUNCH_BOUND_TOGETHER_MIN, summary
    assert holds < LAUNCH_BOUND_HOLDS_MAX, summary


@pytest.mark.parametrize("case", harness.NEVER_SYNC, ids=lambda c: c.name)
def test_share_of_loops_that_never_sync(rig: harness.Rig, case: harness.Case) -> None:
    """Each process keeps the driver's queue full (2 s of kernels) unless the gate keeps it short.
    Alone and ungated such a loop keeps the GPU busy all the time (its queue never empties): solo is
    1. A cap holds on the GPU's timeline only if the gate keeps the queue short: one it let grow
    would run past the cap."""
    check(harness.run_case(rig, case, WARMUP + 1.0, SECONDS, 1.0))


def test_a_process_on_gpu_1_with_device_0_current_is_held_by_gpu_1(simgpu_factory: Callable[..., SimGpu],
                                                                      tmp_path: Path) -> None:
    """PyTorch on cuda:1 of a two-GPU host: its launches go to a stream of device 1 while device 0's
    context is current, and its syncs are device 0's (it never waits for GPU 1). GPU 1's scheduler
    holds it all the same: the gate keeps its queue short with an event in device 1's context."""
    with harness.rig(simgpu_factory(devices=2), tmp_path / "state") as the_rig:
        rows = harness.run_case(the_rig, harness.ON_CUDA1_NEVER_SYNC, WARMUP + 1.0, SECONDS, 1.0)
        usage = the_rig.schedulers[1].usage()
        assert sum(u.gpu_seconds for u in usage.values()) > 0
        assert not the_rig.schedulers[0].usage() or all(
            u.gpu_seconds == 0 for u in the_rig.schedulers[0].usage().values())
    check(rows)


def test_a_group_that_comes_later_waits_for_a_bounded_backlog_of_the_one_alone(rig: harness.Rig) -> None:
    """An uncapped group alone whose process never synchronises: unbounded, it would queue the driver's
    whole queue (1024 kernels of 2 ms, 2 s of work), and a group that comes later would wait for all
    of it, the drain's timeout first. Released alone with a long queue (GT_RELEASED_LONG_QUEUE), it
    keeps about LONG_QUEUE_BOUND_NS queued: the newcomer's first kernels run after that much of the
    hog's, not after 2 s of them. (Its gate lets it launch once the hog's drain times out either way:
    what it waits for is the queue its kernels join.)"""
    hog, late = harness.Load("hog", syncs=False), harness.Load("late")
    rig.define([hog, late])
    hog_client = rig.start(hog, 0, 4.0)
    try:
        time.sleep(1.0)  # the hog alone, long enough to have filled the driver's queue
        late_client = rig.start(late, 0, 1.0)
        started = time.monotonic()
        # Its first sync's end: the gate stores drained_ns when a sync covered every launch.
        while not any(slot.pid == late_client.pid and slot.drained_ns[0] > 0 for _, slot in rig.region.live_slots()):
            assert time.monotonic() - started < 5, "the newcomer's first kernels never ran"
            time.sleep(0.002)
        waited = time.monotonic() - started
        # The bound, the newcomer's start (a process of the simulated runtime) and a loaded CI's
        # late wake-ups; the whole queue would be 2 s.
        assert waited < contract.LONG_QUEUE_BOUND_NS / 1e9 + 0.4, f"its first kernels ran after {waited:.2f} s"
        late_client.finish(timeout=30)
    finally:
        hog_client.kill()


def test_two_gpus_are_scheduled_independently(simgpu_factory: Callable[..., SimGpu], tmp_path: Path) -> None:
    # GPUs 0 and 1 for the case, 2 for the reference.
    with harness.rig(simgpu_factory(devices=3), tmp_path / "state") as the_rig:
        rows = harness.run_case(the_rig, harness.TWO_GPUS, WARMUP, SECONDS)
        # Each GPU's scheduler charged only that GPU's work: the group on both is capped on each.
        both = the_rig.region.group_index("both40")
        assert both is not None
        for scheduler in the_rig.schedulers[:2]:
            assert scheduler.usage()[both].gpu_seconds == pytest.approx(0.4 * (WARMUP + SECONDS + 1), abs=0.4)
    check(rows)


def test_all_processes_of_a_group_share_its_quota(rig: harness.Rig) -> None:
    case = harness.Case(
        "three processes in a capped group",
        (harness.Load("many", harness.Quota(0, 0.3), processes=3), harness.Load("one")),
        {("many", 0): (0.3, "="), ("one", 0): (0.7, "=")},
    )
    check(harness.run_case(rig, case, WARMUP, SECONDS))


def test_reserved_time_a_group_leaves_unused_goes_to_the_others(rig: harness.Rig) -> None:
    # "idle" reserves half the GPU and has a live gated process that launches nothing (it allocated
    # and sleeps): that is no demand, so the hog gets the whole GPU, with no switch at all.
    loads = [harness.Load("idle", harness.Quota(0.5, 1.0)), harness.Load("hog")]
    rig.define(loads)
    sleeper = rig.sim.start(["alloc", "--api", "v2", "--hold", "30", "1MiB"], client=rig.client,
                            GEMTRACE_STATE_DIR=str(rig.state_dir), GEMTRACE_GROUP="idle",
                            LD_PRELOAD=str(rig.gate))
    sleeper.wait_for("holding")
    idle = rig.region.group_index("idle")
    assert any(slot.pid == sleeper.pid and rig.region.assigned_group(i, slot.pid) == idle
               for i, slot in rig.region.live_slots())
    switches = rig.schedulers[0].switches
    beside = harness.reference(rig, loads[1])
    shares = harness.measure(rig, [loads[1], beside], WARMUP, SECONDS, scheduled=loads[:1])
    reference = shares[(harness.REFERENCE, 1)]
    assert shares[("hog", 0)] / reference >= 0.97, f"hog {shares[('hog', 0)]:.3f}, reference {reference:.3f}"
    assert rig.schedulers[0].switches == switches
    assert idle is not None and rig.schedulers[0].usage()[idle].gpu_seconds == 0


def test_a_holder_that_goes_quiet_rings_and_the_scheduler_looks_only_then(simgpu: SimGpu, tmp_path: Path) -> None:
    """The real gate: a holder whose one kernel runs 1.5 s while another group waits is not polled
    (every 4 ms, that is hundreds of looks); its sync that ends the kernel rings the doorbell
    (control.ring_quiet), and the look that ring brings revokes it: the waiting group's first kernel
    follows within a few looks. Slices are 10 s here: without the ring, the switch would
    come then. Looks are counted, not time: the machine may be busy."""
    second = 1000 * MS
    params = PolicyParams(slice_ns=10 * second, max_slice_ns=10 * second, drain_timeout_ns=10 * second,
                          share_unbound=False)  # (in turns, as groups of several processes take them)
    with harness.rig(simgpu, tmp_path / "state", params=params) as the_rig:
        service, hog = harness.Load("service"), harness.Load("hog")
        the_rig.define([service, hog])
        scheduler, region = the_rig.schedulers[0], the_rig.region
        env = the_rig.sim.env(**{defaults.ENV_STATE_DIR: str(the_rig.state_dir), defaults.ENV_GROUP: "service",
                                 "LD_PRELOAD": str(the_rig.gate)})
        holder = subprocess.Popen([str(the_rig.client), "launch-per-line", "--kernel-ns", str(int(1.5 * second))],
                                  env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        waiter = None
        try:
            assert holder.stdin is not None and holder.stdout is not None
            assert json.loads(holder.stdout.readline())["ready"]
            holder.stdin.write("\n")
            holder.stdin.flush()
            assert "returned_ns" in json.loads(holder.stdout.readline())  # released; its sync runs 1.5 s
            waiter = the_rig.start(hog, 0, 1.0)
            hog_group = region.group_index("hog")
            assert hog_group is not None
            deadline = time.monotonic() + 1.0
            while not any(slot.pid == waiter.pid and slot.waiting[0] for _, slot in region.live_slots()):
                assert time.monotonic() < deadline, "the waiting group's first launch never waited"
                time.sleep(0.001)
            looks = scheduler.looks
            while region.is_held(0, hog_group):
                assert time.monotonic() < deadline + 5, "never switched: the holder's quiet ring was not heard"
                time.sleep(0.001)
            # The waiter's ring (maybe after this count), the holder's quiet ring, the quiet drain's
            # look, and a look more at most on a loaded machine.
            assert scheduler.looks - looks <= 5, f"{scheduler.looks - looks} looks while the holder ran"
            holder_slot = next(slot for _, slot in region.live_slots() if slot.pid == holder.pid)
            assert holder_slot.drained_ns[0] > 0  # its own sync emptied its queue: that is what rang
            waiter.finish(timeout=30)
        finally:
            holder.communicate("", timeout=30)
            if waiter is not None and waiter.proc.poll() is None:
                waiter.kill()
