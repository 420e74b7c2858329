"""Scheduler accuracy on the simulated GPU (issue 3, "Accuracy"): the four cases and the two-GPU one,
loops that sync rarely or never, and launch-bound loops (issue 13).

Each case runs GpuScheduler threads in this process over a private region, with gated launch loops of
2 ms kernels as the groups' processes (launch-bound: 20 us kernels after 30 us of CPU each;
tests/scheduler_harness.py is the rig; the e2e tests use the same one with shorter runs and looser
tolerances). A group's share is its kernel throughput divided by
that of the same loop alone and ungated; the target is within 2 points. Prints a table and appends it,
dated, with the machine, to bench/results/scheduler_accuracy.md.

    .venv/bin/python -m bench.bench_scheduler_accuracy [--seconds 10] [--warmup 2] [--no-record]
        [--only TEXT] [--slice-ms 20]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import scheduler_harness as harness
from simgpu_env import SimGpu, require_build

from bench.recording import REPO, add_record_flag, record
from gemtrace.agent.policy import MS, PolicyParams

RESULTS = REPO / "bench" / "results" / "scheduler_accuracy.md"
POINTS = 2.0
RARE = harness.RARE_SYNC_PER_ITER


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| case | group | GPU | target | measured | error (points) | device share | "
            "scheduler CPU | looks/s | holds/s | ok |\n|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        error = (r["measured"] - r["target"]) * 100
        lines.append(
            f"| {r['case']} | {r['group']} | {r['device']} | {'≥ ' if r['kind'] == '>=' else ''}"
            f"{r['target']:.2f} | {r['measured']:.3f} | {error:+.1f} | {r['device_share']:.3f} | "
            f"{r['cpu']:.1%} | {r['looks_per_s']:.0f} | {r['switches_per_s']:.0f} | "
            f"{'yes' if harness.within(r, POINTS) else 'NO'} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="measurement window per case")
    parser.add_argument("--warmup", type=float, default=2.0)
    add_record_flag(parser, RESULTS)
    parser.add_argument("--no-rare-sync", dest="rare_sync", action="store_false",
                        help="leave out the cases of loops that sync every 100 kernels or never")
    parser.add_argument("--no-launch-bound", dest="launch_bound", action="store_false",
                        help="leave out the cases of launch-bound loops (20 us kernels, 30 us of CPU each)")
    parser.add_argument("--only", metavar="TEXT", help="run only the cases whose name contains TEXT")
    parser.add_argument("--slice-ms", type=float, default=PolicyParams.slice_ns / MS,
                        help="the schedulers' slice (PolicyParams.slice_ns), to see what switching costs")
    args = parser.parse_args()
    params = PolicyParams(slice_ns=int(args.slice_ms * MS))
    try:
        require_build()
    except BaseException as exc:  # pytest.fail outside pytest: say what to build
        print(exc, file=sys.stderr)
        return 2
    load_at_start = os.getloadavg()[0]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="gemtrace-bench-") as tmp:
        cases = (*harness.CASES, harness.FOUR_CAPPED, harness.TWO_GPUS,
                 *((*harness.RARE_SYNC, *harness.NEVER_SYNC, harness.ON_CUDA1_NEVER_SYNC) if args.rare_sync else ()),
                 *(harness.LAUNCH_BOUND if args.launch_bound else ()))
        cases = tuple(case for case in cases if not args.only or args.only in case.name)
        # Each case's 100%: its kind of loop alone and ungated (measured only for the kinds that run).
        def kind(case: harness.Case) -> str:
            never = case in harness.NEVER_SYNC or case is harness.ON_CUDA1_NEVER_SYNC
            return ("rare" if case in harness.RARE_SYNC else "never" if never
                    else "launch-bound" if case in harness.LAUNCH_BOUND else "plain")

        solo_loads = {"plain": harness.Load("solo"), "rare": harness.Load("solo", launches_per_iter=RARE),
                      "never": harness.Load("solo", syncs=False), "launch-bound": harness.LAUNCH_BOUND_CAPS.loads[0]}
        solos = {k: float("nan") for k in solo_loads}
        with harness.rig(SimGpu(Path(tmp) / "solo"), Path(tmp) / "solo-state") as rig:
            for k in sorted({kind(case) for case in cases}):
                solos[k] = harness.solo_share(rig, args.warmup, args.seconds, like=solo_loads[k])
        solo, bound_solo = solos["plain"], solos["launch-bound"]
        print(f"solo: one ungated launch loop keeps the simulated GPU {solo:.1%} busy "
              f"({solos['rare']:.1%} syncing every {RARE} kernels, {solos['never']:.1%} never, "
              f"{bound_solo:.1%} launch-bound)", flush=True)
        for n, case in enumerate(cases):
            devices = 1 + max(d for load in case.loads for d in load.devices)
            with harness.rig(SimGpu(Path(tmp) / f"sim{n}", devices=devices), Path(tmp) / f"state{n}",
                             params=params) as rig:
                cpu0, t0 = rig.scheduler_cpu_seconds(), time.monotonic()
                base = solos[kind(case)]
                case_rows = harness.run_case(rig, case, args.warmup, args.seconds, base)
                cpu = (rig.scheduler_cpu_seconds() - cpu0) / (time.monotonic() - t0) / devices
            for row in case_rows:
                row["cpu"] = cpu
            rows += case_rows
            print(table(case_rows).split("\n", 2)[2], flush=True)
    text = table(rows)
    print()
    print(text)
    ok = all(harness.within(r, POINTS) for r in rows)
    if not args.no_record:
        # The solo device shares of the kinds that ran (nan: not measured).
        measured = [f"2 ms kernels {solo:.3f}" * (not math.isnan(solo)),
                    (f"launch-bound ({harness.LAUNCH_BOUND_KERNEL_NS / 1e3:g} us kernels after "
                     f"{harness.LAUNCH_BOUND_CPU_NS / 1e3:g} us of CPU, {harness.LAUNCH_BOUND_PER_ITER} per sync) "
                     f"{bound_solo:.3f}") * (not math.isnan(bound_solo))]
        slices = "" if params.slice_ns == PolicyParams.slice_ns else f"; {args.slice_ms:g} ms slices"
        record(RESULTS, "Scheduler accuracy on the simulated GPU\n\n"
               "Written by bench/bench_scheduler_accuracy.py. Share = the group's kernel throughput over that of "
               f"the same launch loop alone and ungated; target within {POINTS:g} points (\">=\": at least). Device "
               "share = kernel time / wall time. Scheduler CPU = one scheduler thread's CPU time / wall time; "
               "looks/s = its wake-ups; holds/s = groups held to switch or cap.",
               f"{args.seconds:g} s windows after {args.warmup:g} s, solo device share: "
               f"{', '.join(filter(None, measured))}{slices}.\n\n{text}",
               about=f"load {load_at_start:.1f} at the start")
        print(f"appended to {RESULTS.relative_to(REPO)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
