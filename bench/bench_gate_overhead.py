"""Gate overhead per launch on the simulated GPU: no gate, released, released with a short queue.

Runs `simgpu-rt empty-launch-loop` (0 ns kernels: the cost is the launch path itself) without the
gate and with LD_PRELOAD=build/libgemgate.so, the process's group released plainly (GT_RELEASED: a
group the agent does not schedule) or with a short queue (GT_RELEASED_SHORT_QUEUE: a hold is coming;
a scheduled group alone, GT_RELEASED_LONG_QUEUE, takes the same path with a longer bound, so it costs
at most this and checks its queue less often), interleaved round by round so that
drifts of the machine hit every case alike (bench/recording.py's `interleave`, 20 rounds by
default), and reports the median ns per launch of each and the paired statistic of each step: the
median of the differences within a round, its interquartile range and a 95% bootstrap interval. The
agent's heartbeat is kept fresh by a thread, as the agent does: the gate reads a beat older than
GT_HEARTBEAT_STALE_NS, or one in its future (now - beat is unsigned), as no agent, and then the
short-queue path stands aside. Two cases: one GPU visible (the common case: the gate knows the GPU
without asking the driver) and two (the gate asks the driver for the current context on each
default-stream launch).

The held path is not benched: a held launch waits for the agent's release, its cost is that wait
(bench_scheduler_accuracy.py and the scheduler's e2e tests measure it), not a figure per launch.

Targets, on the paired medians: at most 50 ns added by the released gate (issue 2); the short-queue
path within 10 ns of the released one (issue 13). On a machine without a GPU only the differences and ratios mean
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.recording import MIN_ROUNDS, REPO, Paired, add_record_flag, interleave, machine, paired, stamp
from bench.recording import RESULTS as RESULTS_DIR
from gemtrace import region as rg
from gemtrace.agent.membership import Membership
from gemtrace.region import Region

SIM = REPO / "build" / "simgpu"
GATE = REPO / "build" / "libgemgate.so"
LAUNCHES = 2_000_000
ROUNDS = MIN_ROUNDS
TARGET_NS = 50.0  # released gate, added to no gate (issue 2)
SHORT_QUEUE_TARGET_NS = 10.0  # short queue, added to released (issue 13)
HEARTBEAT_S = 0.1  # as the agent's tick does it, well inside GT_HEARTBEAT_STALE_NS
CASES = ("no gate", "released", "short queue")
# The paired steps: (case, against), each difference taken within one round.
STEPS = (("released", "no gate"), ("short queue", "released"))


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
    decided (gemtrace/agent/membership.py, every group open to all) within a few ms, as the gates wait for it."""
    membership = Membership(region, lambda: {})
    while not stop.is_set():
        region.heartbeat(time.monotonic_ns())
        membership.tick()
        stop.wait(min(HEARTBEAT_S, 0.005))


@dataclass(frozen=True)
class Figures:
    """One count of visible GPUs: each case's median ns per launch, and each step's paired statistic."""

    medians: dict[str, float]
    steps: dict[tuple[str, str], Paired]


def measure(tmp: str, devices: int, gate: Path, rounds: int, launches: int) -> Figures:
    """The cases with `devices` simulated GPUs visible, `rounds` interleaved rounds."""
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

    def released(how: int) -> Callable[[], float]:
        def run() -> float:
            for gpu in range(devices):
                region.release(gpu, group, how)
            return one_run(gated, launches)
        return run

    try:
        runs = interleave([("no gate", lambda: one_run(base, launches)),
                           ("released", released(rg.RELEASED)),
                           ("short queue", released(rg.RELEASED_SHORT_QUEUE))], rounds)
    finally:
        stop.set()
        beat.join()
        region.stop()
        region.close()
    return Figures({case: statistics.median(values) for case, values in runs.items()},
                   {(case, against): paired(runs[against], runs[case], " ns") for case, against in STEPS})


RESULTS = RESULTS_DIR / "gate_overhead.md"
HEADER = "# Gate overhead per launch, simulated GPU (bench/bench_gate_overhead.py)\n"
SECTION = (
    "\n## Released and short-queue paths side by side: paired differences of interleaved rounds\n\n"
    "Each step is the median of the differences within a round (the case's run less the run it is\n"
    "compared with, in the same round), its interquartile range and a 95% bootstrap interval of that\n"
    "median; the targets are on the median. On a machine without a GPU the simulated driver's launch\n"
    "is the denominator: read the differences, not the absolute times.\n\n"
    "| date | machine | gate | GPUs visible | rounds | no gate ns | released ns | short queue ns "
    "| released - no gate (IQR; 95% interval) | short queue - released (IQR; 95% interval) | targets |\n"
    "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n"
)
STEP_TARGETS = {("released", "no gate"): TARGET_NS, ("short queue", "released"): SHORT_QUEUE_TARGET_NS}


def verdict(figures: Figures) -> dict[tuple[str, str], bool]:
    """Each step's paired median against its target."""
    return {step: figures.steps[step].median <= target for step, target in STEP_TARGETS.items()}


def cell(p: Paired) -> str:
    return f"{p.median:+.1f} ({p.q1:+.1f} to {p.q3:+.1f}; {p.low:+.1f} to {p.high:+.1f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_record_flag(parser, RESULTS)
    parser.add_argument("--gate", type=Path, default=GATE, help="the gate library to measure (default: %(default)s)")
    parser.add_argument("--label", default="", help="what the gate is (a commit), written to the results")
    parser.add_argument("--rounds", type=int, default=ROUNDS,
                        help="interleaved rounds, each one run of every case (default: %(default)s)")
    parser.add_argument("--launches", type=int, default=LAUNCHES)
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error(f"--rounds {args.rounds}: the paired statistic needs at least 2 rounds; "
                     f"{MIN_ROUNDS} or more place its median")
    with tempfile.TemporaryDirectory() as tmp:
        figures = {devices: measure(tmp, devices, args.gate, args.rounds, args.launches) for devices in (1, 2)}
    print(f"medians of {args.rounds} interleaved rounds of {args.launches} launches; targets on the paired "
          f"medians: released - no gate <= {TARGET_NS:.0f} ns, short queue - released <= "
          f"{SHORT_QUEUE_TARGET_NS:.0f} ns")
    for devices, f in figures.items():
        m = f.medians
        print(f"{devices} GPU(s) visible: no gate {m['no gate']:.1f}, released {m['released']:.1f}, "
              f"short queue {m['short queue']:.1f} ns per launch")
        for (case, against), p in f.steps.items():
            print(f"  {case} - {against}: {p}")
    met = all(all(verdict(f).values()) for f in figures.values())
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
            m, met_steps = f.medians, verdict(f)
            targets = ", ".join(f"{case} {'met' if met_steps[(case, against)] else 'MISSED'} (<= {target:.0f})"
                                for (case, against), target in STEP_TARGETS.items())
            out.write(
                f"| {stamp()} | {machine()} | {args.label or args.gate.name} | {devices} | {args.rounds} | "
                f"{m['no gate']:.1f} | {m['released']:.1f} | {m['short queue']:.1f} | "
                f"{cell(f.steps[('released', 'no gate')])} | {cell(f.steps[('short queue', 'released')])} | "
                f"{targets} |\n"
            )
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
