"""What a scheduler look costs after a sleep, against the same look back to back (issue 13, agent CPU).

A `GpuScheduler` over a private region with 8 slots in 4 capped groups, the holder's slots launching
before each look, as in a 4x2 run (and at the region's limit: 1024 slots, 63 groups, 8 GPUs, a look
and a look that scans the table for a new user): its CPU time per look (the thread's own clock) back to back, and
after sleeps of 1, 5, 20 and 60 ms (the scheduler's polls, drains' nets, slices), and the same for a
trivial function (a sum of 200 integers) to tell the look's own cost from the wake-up's. A sleeping
thread's caches and branch history go cold and a VM's idle vCPU is descheduled, so the agent's CPU
follows its wake-ups more than its work per look. Appends the dated table to
bench/results/agent_cpu.md.

    .venv/bin/python -m bench.bench_wake_cost [--looks 300] [--no-record]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from testkit import claim

from bench.recording import RESULTS as RESULTS_DIR
from bench.recording import add_record_flag, record
from gemtrace import region as rg
from gemtrace.agent.scheduler import GpuScheduler, Quota

RESULTS = RESULTS_DIR / "agent_cpu.md"
SLEEPS_MS = (0, 1, 5, 20, 60)
GPU = 0


def scheduler_look(state: Path, processes: int = 8, groups: int = 4, gpus: int = 1,
                   new_user: bool = False) -> tuple[Callable[[], None], Callable[[], None]]:
    """A look of GPU 0's scheduler, process i in group i % groups on GPU i % gpus (every group capped
    up to 4 groups, half of them beyond, as in bench_agent_cpu.py), the holder's processes there
    launching before each look; with `new_user`, a gate counts a new user of GPU 0 in the doorbells
    before each look (the look scans the slot table). And the region's close."""
    region = rg.Region.create(state)
    region.set_gpus([(f"GPU-bench-{g}", 1 << 30) for g in range(gpus)])
    caps = [0.25 if groups <= 4 or g % 2 else 1.0 for g in range(groups)]
    indices = [region.set_group(f"g{g}", None, 0, cap) for g, cap in enumerate(caps)]
    scheduler = GpuScheduler(region, GPU)
    scheduler.set_quotas({index: Quota(0, cap) for index, cap in zip(indices, caps, strict=True)})
    bells = region.doorbells
    now = time.monotonic_ns()
    here: dict[int, list[int]] = {}  # group -> its slots on GPU 0
    for i in range(processes):
        gpu, group = i % gpus, indices[i % groups]
        slot = claim(region, i, os.getpid() + 1 + i, group)  # a pid never read as a process: the bench only looks
        slot.gpu_mask = 1 << gpu
        slot.burst_start_ns[gpu] = now
        slot.launches[gpu] = 1
        slot.waiting[gpu] = 1
        if gpu == GPU:
            here.setdefault(group, []).append(i)

    def look() -> None:
        for i in here.get(scheduler._released, ()):  # the holder's processes launched since the last look
            region.slots[i].launches[GPU] += 3
        if new_user and bells is not None:
            bells.layout.joined[GPU] += 1
        scheduler.step()

    def close() -> None:
        scheduler._release_all()
        region.close()

    return look, close


def trivial() -> None:
    sum(range(200))


def cpu_per_call(fn: Callable[[], None], sleep_ms: float, calls: int) -> float:
    """Median thread CPU time of one call (us), each after a sleep of `sleep_ms`."""
    times = []
    for _ in range(calls):
        if sleep_ms:
            time.sleep(sleep_ms / 1e3)
        t = time.thread_time_ns()
        fn()
        times.append(time.thread_time_ns() - t)
    times.sort()
    return times[len(times) // 2] / 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--looks", type=int, default=300, help="looks per sleep length (default 300)")
    add_record_flag(ap, RESULTS)
    args = ap.parse_args()
    # The 4x2 look; at the region's limit (1024 processes, 63 groups, 8 GPUs: 128 users of GPU 0 in
    # every group), a look, and one that scans the table for a new user.
    layouts = {"4x2": {}, "limit": {"processes": 1024, "groups": 63, "gpus": 8},
               "limit, scan": {"processes": 1024, "groups": 63, "gpus": 8, "new_user": True}}
    costs: dict[str, list[float]] = {}
    for name, layout in layouts.items():
        with tempfile.TemporaryDirectory(prefix="gemtrace-wake-") as tmp:
            look, close = scheduler_look(Path(tmp), **layout)  # type: ignore[arg-type]
            try:
                for _ in range(200):
                    look()  # warm: the interpreter specialises the code
                costs[name] = [cpu_per_call(look, ms, args.looks) for ms in SLEEPS_MS]
            finally:
                close()
    rows = [(ms, costs["4x2"][k], cpu_per_call(trivial, ms, args.looks), costs["limit"][k], costs["limit, scan"][k])
            for k, ms in enumerate(SLEEPS_MS)]
    warm_look, warm_trivial = rows[0][1], rows[0][2]
    table = [f"Median thread CPU of one call over {args.looks} calls per row.", "",
             "| sleep before each call | scheduler look, us | x back to back | sum of 200 ints, us | x back to back "
             "| look at the region's limit, us | the same, scanning for a new user, us |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for ms, look_us, trivial_us, limit_us, scan_us in rows:
        table.append(f"| {'none (back to back)' if not ms else f'{ms} ms'} | {look_us:.1f} | "
                     f"{look_us / warm_look:.1f} | {trivial_us:.1f} | {trivial_us / warm_trivial:.1f} | "
                     f"{limit_us:.1f} | {scan_us:.1f} |")
    text = "\n".join(table) + "\n"
    print(text)
    if not args.no_record:
        record(RESULTS, "Agent CPU and probe cost on the simulated GPU", text,
               about="a look's CPU after a sleep (bench/bench_wake_cost.py)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
