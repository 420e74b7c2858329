"""Scheduler accuracy on the simulated GPU (issue 3, "Accuracy"): the four cases and the two-GPU one.

Each case runs GpuScheduler threads in this process over a private region, with gated launch loops of
2 ms kernels as the groups' processes (tests/scheduler_harness.py is the rig; the e2e tests use the
same one with shorter runs and looser tolerances). A group's share is its kernel throughput divided by
that of the same loop alone and ungated; the target is within 2 points. Prints a table and appends it,
dated, with the machine, to bench/results/scheduler_accuracy.md.

    .venv/bin/python bench/bench_scheduler_accuracy.py [--seconds 10] [--warmup 2] [--no-record]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

import scheduler_harness as harness  # noqa: E402
from simgpu_env import SimGpu, require_build  # noqa: E402

RESULTS = REPO / "bench" / "results" / "scheduler_accuracy.md"
POINTS = 2.0


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = os.getloadavg()[0]
    return f"{platform.node()}, {os.cpu_count()} CPUs ({cpu}), load {load:.1f} at start"


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
    parser.add_argument("--no-record", action="store_true", help=f"do not append to {RESULTS}")
    parser.add_argument("--no-rare-sync", dest="rare_sync", action="store_false",
                        help="leave out the cases of loops that sync every 100 kernels or never")
    parser.add_argument("--only", metavar="TEXT", help="run only the cases whose name contains TEXT")
    args = parser.parse_args()
    try:
        require_build()
    except BaseException as exc:  # pytest.fail outside pytest: say what to build
        print(exc, file=sys.stderr)
        return 2
    where = machine()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="gemtrace-bench-") as tmp:
        with harness.rig(SimGpu(Path(tmp) / "solo"), Path(tmp) / "solo-state") as rig:
            solo = harness.solo_share(rig, args.warmup, args.seconds)
            rare_solo = harness.solo_share(rig, args.warmup, args.seconds, harness.RARE_SYNC_PER_ITER)
            never_solo = harness.solo_share(rig, args.warmup, args.seconds, syncs=False)
        print(f"solo: one ungated launch loop keeps the simulated GPU {solo:.1%} busy "
              f"({rare_solo:.1%} syncing every {harness.RARE_SYNC_PER_ITER} kernels, {never_solo:.1%} never)",
              flush=True)
        cases = (*harness.CASES, harness.TWO_GPUS,
                 *((*harness.RARE_SYNC, *harness.NEVER_SYNC, harness.ON_CUDA1_NEVER_SYNC) if args.rare_sync else ()))
        for n, case in enumerate(cases):
            if args.only and args.only not in case.name:
                continue
            devices = 1 + max(d for load in case.loads for d in load.devices)
            with harness.rig(SimGpu(Path(tmp) / f"sim{n}", devices=devices), Path(tmp) / f"state{n}") as rig:
                cpu0, t0 = rig.scheduler_cpu_seconds(), time.monotonic()
                never = case in harness.NEVER_SYNC or case is harness.ON_CUDA1_NEVER_SYNC
                base = rare_solo if case in harness.RARE_SYNC else never_solo if never else solo
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
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        new = not RESULTS.exists()
        with RESULTS.open("a") as out:
            if new:
                out.write("# Scheduler accuracy on the simulated GPU\n\n"
                          "Written by bench/bench_scheduler_accuracy.py. Share = the group's kernel "
                          "throughput over that of the same launch loop alone and ungated; target within "
                          f"{POINTS:g} points (\">=\": at least). Device share = kernel time / wall time. "
                          "Scheduler CPU = one scheduler thread's CPU time / wall time; looks/s = its wake-ups; "
                          "holds/s = groups held to switch or cap.\n")
            stamp = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
            out.write(f"\n## {stamp}\n\n{where}; {args.seconds:g} s windows after {args.warmup:g} s, "
                      f"2 ms kernels, solo device share {solo:.3f}.\n\n{text}\n")
        print(f"appended to {RESULTS.relative_to(REPO)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
