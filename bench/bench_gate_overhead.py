"""Gate overhead per launch on the simulated GPU: no gate, released, released with a short queue.

Runs `simgpu-rt empty-launch-loop` (0 ns kernels: the cost is the launch path itself) without the
gate and with LD_PRELOAD=build/libgemgate.so, the process's group released plainly (GT_RELEASED: a
group the agent does not schedule) or with a short queue (GT_RELEASED_SHORT_QUEUE: a hold is coming;
a scheduled group alone, GT_RELEASED_LONG_QUEUE, takes the same path with a longer bound, so it costs
at most this and checks its queue less often), interleaved round by round so that
drifts of the machine hit every case alike, and reports the median ns per launch of each. The
agent's heartbeat is kept fresh by a thread, as the agent does: the gate reads a beat older than
GT_HEARTBEAT_STALE_NS, or one in its future (now - beat is unsigned), as no agent, and then the
short-queue path stands aside. Two cases: one GPU visible (the common case: the gate knows the GPU
without asking the driver) and two (the gate asks the driver for the current context on each
default-stream launch).

The held path is not benched: a held launch waits for the agent's release, its cost is that wait
(bench_scheduler_accuracy.py and the scheduler's e2e tests measure it), not a figure per launch.

Targets: at most 50 ns added by the released gate (issue 2); the short-queue path within 10 ns of
the released one (issue 13). On a machine without a GPU only the differences and ratios mean
something; the GPU machine's figures are in bench/results/gpu_gate.md. Results are appended to
bench/results/gate_overhead.md with the date and the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.recording import REPO, add_record_flag, machine, stamp
from bench.recording import RESULTS as RESULTS_DIR
from gemtrace import region as rg
from gemtrace.membership import Membership
from gemtrace.region import Region

SIM = REPO / "build" / "simgpu"
GATE = REPO / "build" / "libgemgate.so"
LAUNCHES = 2_000_000
ROUNDS = 7
TARGET_NS = 50.0  # released gate, added to no gate (issue 2)
SHORT_QUEUE_TARGET_NS = 10.0  # short queue, added to released (issue 13)
HEARTBEAT_S = 0.1  # as the agent's tick does it, well inside GT_HEARTBEAT_STALE_NS
CASES = ("no gate", "released", "short queue")


def one_run(env: dict[str, str], launches: int) -> float:
    out = subprocess.run(
        [str(SIM / "simgpu-rt"), "empty-launch-loop", "--launches", str(launches)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return float(json.loads(out.splitlines()[-1])["ns_per_launch"])


def keep_beating(region: Region, stop: threading.Event) -> None:
    """The agent's keeper, as far as the gates can tell: the heartbeat, and each new process's group
    decided (gemtrace/membership.py, every group open to all) within a few ms, as the gates wait for it."""
    membership = Membership(region, lambda: {})
    while not stop.is_set():
        region.heartbeat(time.monotonic_ns())
        membership.tick()
        stop.wait(min(HEARTBEAT_S, 0.005))


def measure(tmp: str, devices: int, gate: Path, rounds: int, launches: int) -> dict[str, float]:
    """Median ns per launch of each case, `devices` simulated GPUs visible."""
    base = dict(
        os.environ,
        LD_LIBRARY_PATH=str(SIM),
        SIMGPU_STATE_DIR=f"{tmp}/sim{devices}",
        SIMGPU_DEVICES=str(devices),
    )
    listed = json.loads(
        subprocess.run(
            [str(SIM / "simgpu-rt"), "devices"], env=base, capture_output=True, text=True, check=True
        ).stdout.splitlines()[-1]
    )["devices"]
    state = f"{tmp}/state{devices}"
    region = Region.create(Path(state))
    region.set_gpus([(d["uuid"], d["total"]) for d in listed])
    region.set_group("default", None, 0.0, 1.0)  # the agent always defines it
    group = region.set_group("bench", None, 0.0, 1.0)
    stop = threading.Event()
    beat = threading.Thread(target=keep_beating, args=(region, stop), daemon=True)
    region.heartbeat(time.monotonic_ns())
    beat.start()
    gated = dict(base, LD_PRELOAD=str(gate), GEMTRACE_STATE_DIR=state, GEMTRACE_GROUP="bench")
    runs: dict[str, list[float]] = {case: [] for case in CASES}
    try:
        for _ in range(rounds):  # interleaved, so drifts of the machine hit every case alike
            runs["no gate"].append(one_run(base, launches))
            for gpu in range(devices):
                region.release(gpu, group)
            runs["released"].append(one_run(gated, launches))
            for gpu in range(devices):
                region.release(gpu, group, rg.RELEASED_SHORT_QUEUE)
            runs["short queue"].append(one_run(gated, launches))
    finally:
        stop.set()
        beat.join()
        region.stop()
        region.close()
    return {case: statistics.median(values) for case, values in runs.items()}



RESULTS = RESULTS_DIR / "gate_overhead.md"
HEADER = (
    "# Gate overhead per launch, simulated GPU (bench/bench_gate_overhead.py)\n\n"
    "| date | machine | GPUs visible | no gate ns | gate ns | added ns | target |\n"
    "| --- | --- | --- | --- | --- | --- | --- |\n"
)
SECTION = (
    "\n## Released and short-queue paths side by side (medians of interleaved rounds)\n\n"
    "Added ns are against no gate; the short queue's target is against released. On a machine without a\n"
    "GPU the simulated driver's launch is the denominator: read the differences, not the absolute times.\n\n"
    "| date | machine | gate | GPUs visible | no gate ns | released ns (added) | short queue ns (added) "
    "| short queue - released | targets |\n"
    "| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n"
)


def verdict(figures: dict[str, float]) -> tuple[bool, bool]:
    released = figures["released"] - figures["no gate"] <= TARGET_NS
    short = figures["short queue"] - figures["released"] <= SHORT_QUEUE_TARGET_NS
    return released, short


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_record_flag(parser, RESULTS)
    parser.add_argument("--gate", type=Path, default=GATE, help="the gate library to measure (default: %(default)s)")
    parser.add_argument("--label", default="", help="what the gate is (a commit), written to the results")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--launches", type=int, default=LAUNCHES)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        figures = {devices: measure(tmp, devices, args.gate, args.rounds, args.launches) for devices in (1, 2)}
    print(f"{'GPUs visible':<13} {'no gate':>8} {'released':>9} {'added':>6} {'short queue':>12} {'added':>6} "
          f"{'sq - rel':>9}   targets: released <= {TARGET_NS:.0f}, sq - rel <= {SHORT_QUEUE_TARGET_NS:.0f}")
    for devices, f in figures.items():
        p, r, s = f["no gate"], f["released"], f["short queue"]
        print(f"{devices:<13} {p:>8.1f} {r:>9.1f} {r - p:>6.1f} {s:>12.1f} {s - p:>6.1f} {s - r:>9.1f}")
    met = all(all(verdict(f)) for f in figures.values())
    if args.no_record:
        return 0 if met else 1
    results = RESULTS
    if not results.exists():
        results.write_text(HEADER)
    if SECTION not in results.read_text():
        with results.open("a") as out:
            out.write(SECTION)
    with results.open("a") as out:
        for devices, f in figures.items():
            p, r, s = f["no gate"], f["released"], f["short queue"]
            released_met, short_met = verdict(f)
            out.write(
                f"| {stamp()} | {machine()} | {args.label or args.gate.name} | {devices} | {p:.1f} | "
                f"{r:.1f} ({r - p:+.1f}) | {s:.1f} ({s - p:+.1f}) | {s - r:+.1f} | "
                f"released {'met' if released_met else 'MISSED'} (<= {TARGET_NS:.0f}), "
                f"short queue {'met' if short_met else 'MISSED'} (<= {SHORT_QUEUE_TARGET_NS:.0f}) |\n"
            )
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
