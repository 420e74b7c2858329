"""Gate overhead per launch within quota, on the simulated GPU: gate against no gate, side by side.

Runs `simgpu-rt empty-launch-loop` (0 ns kernels: the cost is the launch path itself) alternately
with and without LD_PRELOAD=build/libgemgate.so, attached to a region whose group is released and an
agent heartbeat that is fresh, and reports the median ns per launch of each and the difference.
Two cases: one GPU visible (the common case: the gate knows the GPU without asking the driver) and
two (the gate asks the driver for the current context on each default-stream launch).
Target (issue 2): at most 50 ns added per launch. Results are appended to
bench/results/gate_overhead.md with the date and the machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from gemtrace.membership import Membership  # noqa: E402
from gemtrace.region import Region  # noqa: E402

SIM = REPO / "build" / "simgpu"
GATE = REPO / "build" / "libgemgate.so"
LAUNCHES = 2_000_000
ROUNDS = 7
TARGET_NS = 50.0


def machine() -> str:
    cpu = "unknown CPU"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    return f"{platform.node()} ({cpu}, {os.cpu_count()} cores)"


def one_run(env: dict[str, str]) -> float:
    out = subprocess.run(
        [str(SIM / "simgpu-rt"), "empty-launch-loop", "--launches", str(LAUNCHES)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return float(json.loads(out.splitlines()[-1])["ns_per_launch"])


def measure(tmp: str, devices: int) -> tuple[float, float]:
    """Medians of ns per launch without and with the gate, `devices` simulated GPUs visible."""
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
    region.set_group("bench", None, 0.0, 1.0)
    region.heartbeat(time.monotonic_ns() + 3600 * 10**9)  # fresh for the whole run
    stop = threading.Event()
    keeper = decide_groups(region, stop)
    gated = dict(base, LD_PRELOAD=str(GATE), GEMTRACE_STATE_DIR=state, GEMTRACE_GROUP="bench")
    plain, with_gate = [], []
    for _ in range(ROUNDS):  # interleaved, so drifts of the machine hit both alike
        plain.append(one_run(base))
        with_gate.append(one_run(gated))
    stop.set()
    keeper.join()
    region.stop()
    region.close()
    return statistics.median(plain), statistics.median(with_gate)


def decide_groups(region: Region, stop: threading.Event) -> threading.Thread:
    """The agent's decision of each new process's group (gemtrace/membership.py), as its keeper
    thread makes it, every group open to all: gates count as "default" until it is made."""
    membership = Membership(region, lambda: {})

    def keep() -> None:
        while not stop.wait(0.005):
            membership.tick()

    thread = threading.Thread(target=keep, daemon=True)
    thread.start()
    return thread


HEADER = (
    "# Gate overhead per launch, simulated GPU (bench/bench_gate_overhead.py)\n\n"
    "| date | machine | GPUs visible | no gate ns | gate ns | added ns | target |\n"
    "| --- | --- | --- | --- | --- | --- | --- |\n"
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--no-record", action="store_true", help="do not append to bench/results/gate_overhead.md")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        figures = {devices: measure(tmp, devices) for devices in (1, 2)}
    print(f"{'GPUs visible':<14} {'no gate ns':>11} {'gate ns':>9} {'added ns':>9}  target <= {TARGET_NS:.0f}")
    for devices, (p, g) in figures.items():
        print(f"{devices:<14} {p:>11.1f} {g:>9.1f} {g - p:>9.1f}")
    met = all(g - p <= TARGET_NS for p, g in figures.values())
    if args.no_record:
        return 0 if met else 1
    results = REPO / "bench" / "results" / "gate_overhead.md"
    results.parent.mkdir(parents=True, exist_ok=True)
    if not results.exists():
        results.write_text(HEADER)
    with results.open("a") as f:
        for devices, (p, g) in figures.items():
            verdict = "met" if g - p <= TARGET_NS else "MISSED"
            f.write(
                f"| {datetime.date.today()} | {machine()} | {devices} | {p:.1f} | {g:.1f} | {g - p:.1f} | "
                f"{verdict} (<= {TARGET_NS:.0f}) |\n"
            )
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
