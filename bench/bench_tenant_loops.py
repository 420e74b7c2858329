"""What a user's loop costs the agent (issue 30, tenants; docs/security.md, "Can"): a real `gemtrace agent`
on the simulated GPU, and an unprivileged uid (one with no account, through setpriv) running one of
tests/test_trust.py's loops for --seconds: ringing GPU 0's doorbell as fast as it can beside two busy
groups (`bell-busy`) or with the GPU idle (`bell-idle`), or allocating and freeing 1 MiB as fast as it
can with no gate while the agent runs with eBPF (`alloc-loop`); `busy` and `ebpf-idle` are the same
agents with no loop. The agent's CPU (user and system, % of one core) over the loop's run, side by
side with older code (--tree NAME=DIR: DIR/gemtrace, `git archive` of an older commit), each case a
round at a time. Appends a dated table to bench/results/tenant_loops.md.

    sudo .venv/bin/python -m bench.bench_tenant_loops [--seconds 4] [--rounds 2] [--tree last-stop=DIR] [--no-record]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from agent_host import Host, stop
from simgpu_env import RT_CLIENT, SimGpu, require_build
from test_trust import ALLOC_LOOP, BELL_RINGER

from bench.bench_attach_flood import as_uid
from bench.recording import REPO, add_record_flag, add_tree_flag, record, trees

RESULTS = REPO / "bench" / "results" / "tenant_loops.md"
CONFIG = "[train]\nMaxUtil = 0.8\nMemoryLimit = 1GiB\n\n[infer]\nMaxUtil = 0.5\n"
UID = 61033  # no account needed: the socket, the simulated libcuda and the checkout are all it uses
CASES = {
    "busy": "two busy groups, no loop",
    "bell-busy": "GPU 0's doorbell rung in a loop, beside two busy groups",
    "bell-idle": "GPU 0's doorbell rung in a loop, the GPU idle",
    "ebpf-idle": "eBPF on, no loop",
    "alloc-loop": "eBPF on, cuMemAlloc_v2 + cuMemFree_v2 of 1 MiB in a loop, no gate",
}


def measure(case: str, host: Host, seconds: float, tree: Path | None) -> tuple[float, float]:
    """The agent's CPU share over the case's loop, and the loop's rate (rings or pairs a second)."""
    running = host.start_agent(ebpf=case in ("ebpf-idle", "alloc-loop"), tree=tree)
    busy: list[subprocess.Popen[bytes]] = []
    try:
        if case in ("busy", "bell-busy"):
            busy = host.busy_groups("train", "infer")
        if case.startswith("bell"):
            loop = [sys.executable, "-c", BELL_RINGER, str(host.state_dir), str(seconds), "0"]
        elif case == "alloc-loop":
            loop = [sys.executable, "-c", ALLOC_LOOP, str(seconds)]
        else:
            loop = [sys.executable, "-c", f"import time; time.sleep({seconds}); print(0)"]
        share, out = running.cpu_share(lambda: subprocess.run(as_uid(UID, *loop), env=host.env(), capture_output=True,
                                                              text=True, timeout=seconds + 60))
        assert out.returncode == 0, out.stderr
        return share * 100, int(out.stdout.split()[0]) / seconds
    finally:
        for p in busy:
            p.kill()
            p.wait()
        stop(running)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    add_tree_flag(parser)
    parser.add_argument("--note", default="", help="a line above the table (what the codes are)")
    add_record_flag(parser, RESULTS)
    args = parser.parse_args()
    require_build()
    base = Path(tempfile.mkdtemp(prefix="gemtrace-loops-bench-"))
    base.chmod(0o755)
    runs: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for case in args.cases:
        for _ in range(args.rounds):
            for code, tree in trees(args.tree):
                tmp = Path(tempfile.mkdtemp(dir=base))
                tmp.chmod(0o755)
                (tmp / "sim").mkdir()
                # The simulation's files are made 0600 by their creator: the uid starts it (as tests/test_trust.py).
                os.chown(tmp / "sim", UID, UID)
                sim = SimGpu(tmp / "sim")
                first = subprocess.run(as_uid(UID, str(RT_CLIENT), "meminfo"), env=sim.env(), capture_output=True,
                                       text=True, timeout=60)
                assert first.returncode == 0, first.stderr
                config = tmp / "resource.conf"
                config.write_text(CONFIG)
                config.chmod(0o644)
                figures = measure(case, Host(sim, config, tmp / "state", tmp), args.seconds, tree)
                sim.close()
                runs.setdefault((case, code), []).append(figures)
                print(f"{case}, {code}: agent {figures[0]:.1f}% of a core, loop {figures[1]:.0f}/s", flush=True)
    lines = [f"{args.seconds:g} s loops, {args.rounds} rounds (medians, min-max), the loop as uid {UID}", "",
             "| case | code | agent CPU (% of one core) | the loop's rate (/s) |", "| --- | --- | --- | --- |"]
    for (case, code), rs in runs.items():
        cpu = [r[0] for r in rs]
        rate = statistics.median(r[1] for r in rs)
        lines.append(f"| {case}: {CASES[case]} | {code} | {statistics.median(cpu):.1f} ({min(cpu):.1f}-{max(cpu):.1f}) "
                     f"| {rate:.0f} |")
    text = "\n".join(lines)
    print(text)
    if not args.no_record:
        record(RESULTS, "What a user's loop costs the agent", f"{args.note}\n\n{text}" if args.note else text,
               about="tenants' loops (bench/bench_tenant_loops.py)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
