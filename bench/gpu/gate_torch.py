"""The gate on a real GPU (issue 2, "Benchmarks", H100 part), through the product. Run from the repo root:

    python3 -m bench.gpu.gate_torch

It starts `gemtrace agent --no-ebpf` on a resource file of two groups, `bench` with MemoryLimit 4 GiB and
`free` without limit, and runs every gated program as a user would, `gemtrace run --group G -- CMD`; then
checks:
  1. PyTorch with a 4 GiB limit, for the default caching allocator, expandable_segments:True and
     backend:cudaMallocAsync: torch.cuda.mem_get_info() reports 4 GiB total, 3 GiB fit, and an
     allocation past 4 GiB raises torch.cuda.OutOfMemoryError;
  2. a program built by nvcc with the static cudart (bench/gpu/gate_probe.cu) is gated the same way;
  3. the empty-kernel launch loop of that program, gated in `free` (within quota) against no gate,
     20 interleaved rounds (bench/recording.py's `interleave`), with one GPU visible and (on a host
     of several) all of them: the overhead in percent as the median of the paired differences, its
     interquartile range and a 95% bootstrap interval (`paired`; target: median <= 2%). The loop times
     itself, so `gemtrace run`'s own start is not in the figure;
  4. the same launches inside one process (gate_probe's `paired`): the cuLaunchKernel the runtime hands
     out (the gate's) against libcuda's own, alternated in blocks, 40 rounds; and the same program with
     no gate, where both paths are libcuda's: the method's own floor. Between processes one
     configuration's runs spread by +-12% on an H100, which hides a 2% cost; in one process they share
     the layout, the context and the CPU's state.
Prints a table; with $OUT set, writes gate_gpu.md there.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path

from bench.gpu.models_torch import Agent, GroupSpec, RunFailed, gemtrace, product_env
from bench.recording import MIN_ROUNDS, REPO, gpus, interleave, paired, publish, stamp
from tests.testkit import GiB

GROUPS = (GroupSpec("bench", memory_limit="4GiB"), GroupSpec("free"))
LOOP_ROUNDS = MIN_ROUNDS
LOOP_LAUNCHES = 500_000
PAIRED_ROUNDS = 40
PAIRED_BLOCK = 100_000  # launches a block: about 0.4 s on an H100

TORCH_CHECK = r"""
import json, sys, torch
free, total = torch.cuda.mem_get_info()
a = torch.empty(3 * (1 << 30), dtype=torch.uint8, device="cuda")
try:
    b = torch.empty(2 * (1 << 30), dtype=torch.uint8, device="cuda")
    outcome = "allocated"
except torch.cuda.OutOfMemoryError:
    outcome = "OutOfMemoryError"
print(json.dumps({"total": total, "free": free, "past_limit": outcome}))
"""


def main() -> int:
    # No options: --help says what the run does, and anything else is refused before a GPU is touched.
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    rows: list[tuple[str, str, str]] = []
    failures = 0
    env = product_env()
    with tempfile.TemporaryDirectory(prefix="gemtrace-gate-") as tmp:
        agent = Agent(Path(tmp), GROUPS, env, ebpf=False)
        try:
            uuids = []
            while True:
                try:
                    uuids.append(agent.gpu_uuid(len(uuids)))
                except RunFailed:  # (no GPU of that index)
                    break

            def gated(group: str, *argv: str) -> list[str]:
                return gemtrace("run", "--group", group, "--state-dir", str(agent.state), "--require-agent", "--",
                                *argv)

            for conf in ("", "expandable_segments:True", "backend:cudaMallocAsync"):
                conf_env = dict(env, PYTORCH_CUDA_ALLOC_CONF=conf) if conf else env
                proc = subprocess.run(gated("bench", sys.executable, "-c", TORCH_CHECK), env=conf_env,
                                      capture_output=True, text=True)
                got = (json.loads(proc.stdout.splitlines()[-1]) if proc.returncode == 0
                       else {"error": proc.stderr[-500:]})
                ok = got.get("total") == 4 * GiB and got.get("past_limit") == "OutOfMemoryError"
                failures += not ok
                rows.append((f"torch {conf or 'default allocator'}", "4 GiB total, OOM past it",
                             f"total {got.get('total', 0) / GiB:.2f} GiB, {got.get('past_limit', got.get('error'))}"))

            probe = Path(tmp) / "gate_probe"
            subprocess.run(["nvcc", "-O2", "-o", str(probe), str(REPO / "bench" / "gpu" / "gate_probe.cu")], check=True)
            proc = subprocess.run(gated("bench", str(probe), "alloc", str(3 * GiB), str(2 * GiB)), env=env,
                                  capture_output=True, text=True)
            lines = [json.loads(line) for line in proc.stdout.splitlines()]
            ok = [line.get("result") for line in lines[:2]] == ["cudaSuccess", "cudaErrorMemoryAllocation"] and \
                lines[2]["total"] == 4 * GiB
            failures += not ok
            rows.append(("nvcc static cudart", "3 GiB ok, 2 GiB more refused, 4 GiB total",
                         f"{lines[0].get('result')}, {lines[1].get('result')}, "
                         f"total {lines[2]['total'] / GiB:.2f} GiB"))

            # The launch loop, gate (group within quota) against no gate, interleaved rounds; one GPU
            # visible (the common case: the gate knows the GPU without asking the driver), and all of
            # them where there are several (the gate asks the driver for the current context per launch).
            cases = [("one GPU visible", {"CUDA_VISIBLE_DEVICES": "0"})]
            if len(uuids) > 1:
                cases.append((f"{len(uuids)} GPUs visible", {}))
            # Runs of one configuration spread by 20% on the H100 (bench/results/gpu_gate.md), far more
            # than the 2% to resolve: every run is pinned to the same CPU, and the figure is the median of
            # the differences within each round (a gated run against the plain run just before it).
            cpus = sorted(os.sched_getaffinity(0))
            cpu = cpus[len(cpus) // 2]

            def pinned() -> None:
                os.sched_setaffinity(0, {cpu})

            def launch_loop(argv: list[str], env: dict[str, str]) -> float:
                run = subprocess.run(argv, env=env, capture_output=True, text=True, check=True, preexec_fn=pinned)
                return float(json.loads(run.stdout.splitlines()[-1])["ns_per_launch"])

            loop = [str(probe), "launch", str(LOOP_LAUNCHES)]
            for case, visible in cases:
                case_env = dict(env, **visible)
                runs = interleave([("no gate", partial(launch_loop, loop, case_env)),
                                   ("gate", partial(launch_loop, gated("free", *loop), case_env))], LOOP_ROUNDS)
                plain, with_gate = runs["no gate"], runs["gate"]
                print(f"{case}, CPU {cpu}: no gate {plain}\n{case}, CPU {cpu}: gate    {with_gate}")
                p, g = statistics.median(plain), statistics.median(with_gate)
                overhead = paired(plain, with_gate, relative=True)
                print(f"{case}: gate - no gate {overhead}")
                failures += overhead.median > 2.0
                rows.append((f"empty-kernel launch loop, {case}", "<= 2% added (paired median)",
                             f"{p:.0f} ns -> {g:.0f} ns per launch (medians); {overhead.median:+.2f}% median of the "
                             f"paired differences (IQR {overhead.q1:+.2f}% to {overhead.q3:+.2f}%, 95% interval "
                             f"{overhead.low:+.2f}% to {overhead.high:+.2f}%), {LOOP_ROUNDS} interleaved rounds of "
                             f"{LOOP_LAUNCHES} launches, pinned to one CPU"))
            # Inside one process: the gate's entry point against libcuda's, and the floor without a gate.
            def in_process(argv: list[str], env: dict[str, str]) -> tuple[bool, list[float], list[float]]:
                run = subprocess.run(argv, env=env, capture_output=True, text=True, check=True, preexec_fn=pinned)
                lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
                return (bool(lines[0]["gated"]), [line["real_ns"] for line in lines[1:]],
                        [line["handed_ns"] for line in lines[1:]])

            paired_argv = [str(probe), "paired", str(PAIRED_BLOCK), str(PAIRED_ROUNDS)]
            one_gpu = dict(env, CUDA_VISIBLE_DEVICES="0")
            for case, argv, gate_expected in (("the gate's entry point", gated("free", *paired_argv), True),
                                              ("no gate (both libcuda's: the floor)", paired_argv, False)):
                was_gated, real, handed = in_process(argv, one_gpu)
                cost = paired(real, handed, relative=True)
                print(f"in one process, {case}: libcuda's {real}\n  handed out {handed}\n  {cost}")
                ok = was_gated == gate_expected and (not gate_expected or cost.median <= 2.0)
                failures += not ok
                rows.append((f"empty-kernel launches in one process, {case}",
                             "<= 2% added (paired median)" if gate_expected else "about 0 (the method's floor)",
                             f"{statistics.median(real):.0f} ns -> {statistics.median(handed):.0f} ns per launch "
                             f"(medians; handed out by the runtime {'is' if was_gated else 'is not'} the gate's); "
                             f"{cost.median:+.2f}% median of the paired differences (IQR {cost.q1:+.2f}% to "
                             f"{cost.q3:+.2f}%, 95% interval {cost.low:+.2f}% to {cost.high:+.2f}%), "
                             f"{PAIRED_ROUNDS} alternated blocks of {PAIRED_BLOCK} launches, pinned to one CPU"))
        finally:
            agent.stop()

    text = [f"# Gate on a real GPU, {stamp()} ({platform.node()}, {gpus()})", "",
            "| check | expected | measured |", "| --- | --- | --- |"]
    text += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    publish("\n".join(text) + "\n", "gate_gpu")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
