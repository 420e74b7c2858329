"""Agent CPU (issue 13): the whole `gemtrace agent` process, as users run it, on the simulated GPU.

Each case starts `gemtrace agent` as a subprocess (through bench/agent_sampler.py, which only tells
the bench its threads' names) on a private simulated GPU with G groups (the capped ones MaxUtil
`--cap`), then P gated launch loops: process i in group i % G on GPU i % N. The first ones start
through `gemtrace run`; past `--run-limit` the bench gives a process the environment `gemtrace run`
would (launcher.child_environment: the gate preloaded, the group asked for), since a thousand Python
launchers would take minutes of this host's CPU. After a warm-up, the agent's CPU time over a window
(utime + stime of all its threads, /proc/PID/stat) over the window's wall time is its CPU in % of one
core; the threads' shares come from /proc/PID/task/*/stat, and their wake-ups a second (voluntary
context switches, /proc/PID/task/*/status) from the same window: on a VM a wake-up costs more than
the Python it runs (bench/bench_wake_cost.py). The targets: <= 2% with 8 processes in 4
capped groups on one GPU, <= 10% at the region's limit (1024 processes, 63 groups, 8 GPUs).

With --profile, each case runs a second time with the agent's stacks sampled (agent_sampler --hz)
and prints the top frames per thread (the sampling costs CPU itself: never in the measured run).

Appends the dated table, with the machine and its load, to bench/results/agent_cpu.md.

    .venv/bin/python -m bench.bench_agent_cpu [--case 8x4x1 --case 256x16x1 ...] [--seconds 20]
        [--ebpf memory|launches] [--profile] [--no-record]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from simgpu_env import RT_CLIENT, SimGpu, require_build
from testkit import free_port, wait_until

from bench.recording import REPO, add_record_flag, add_tree_flag, record, trees
from gemtrace.launcher import child_environment, find_gate

RESULTS = REPO / "bench" / "results" / "agent_cpu.md"
SAMPLER = REPO / "bench" / "agent_sampler.py"
TICKS = os.sysconf("SC_CLK_TCK")
DEFAULT_CASES = ("0x4x1", "8x4x1", "256x16x1", "1024x63x8")


@dataclass(frozen=True)
class Case:
    processes: int
    groups: int
    gpus: int
    capped: str  # "all" or "half"

    @classmethod
    def parse(cls, text: str) -> Case:
        """PxGxN, e.g. 8x4x1; the groups are all capped up to 4 groups, half capped beyond."""
        p, g, n = (int(x) for x in text.split("x"))
        return cls(p, g, n, "all" if g <= 4 else "half")

    @property
    def name(self) -> str:
        return f"{self.processes} processes, {self.groups} groups ({self.capped} capped), {self.gpus} GPU(s)"


def serving(agent: subprocess.Popen[bytes], port: int, log: Path) -> None:
    """Wait for the agent's /metrics on `port`; fail with its log's end if it exits first."""
    def answers() -> bool:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2):
            return True
    try:
        wait_until("the agent's /metrics", answers, timeout=30, step=0.1, proc=agent, retry_on=(OSError,))
    except AssertionError:  # the log says why
        print(log.read_text()[-2000:], file=sys.stderr)
        raise


def cpu_ticks(stat: Path) -> int:
    """utime + stime of a process (or a thread: /proc/PID/task/TID/stat), in clock ticks."""
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def thread_ticks(pid: int) -> dict[int, int]:
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out[int(task.name)] = cpu_ticks(task / "stat")
        except (OSError, ValueError):
            pass
    return out


def thread_wakeups(pid: int) -> dict[int, int]:
    """Voluntary context switches of each thread (/proc/PID/task/TID/status): how often it slept and
    was woken, which on a VM costs more than the Python between (bench/bench_wake_cost.py)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            for line in (task / "status").read_text().splitlines():
                if line.startswith("voluntary_ctxt_switches:"):
                    out[int(task.name)] = int(line.split()[1])
        except (OSError, ValueError):
            pass
    return out


def config_text(case: Case, cap: float) -> str:
    lines = []
    for g in range(case.groups):
        lines.append(f"[g{g}]")
        if case.capped == "all" or g % 2 == 0:
            lines.append(f"MaxUtil = {cap}")
        lines.append("")
    return "\n".join(lines)


def run_case(case: Case, tmp: Path, seconds: float, warmup: float, args: argparse.Namespace,
             profile_hz: float = 0.0, tree: Path | None = None) -> dict:
    sim = SimGpu(tmp / "sim", devices=case.gpus)
    config = tmp / "resource.conf"
    config.write_text(config_text(case, args.cap))
    state = tmp / "state"
    env = sim.env()
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    agent_env = dict(env)
    if tree is not None:  # another checkout's (or `git archive`'s) gemtrace/ for the agent only
        agent_env["PYTHONPATH"] = str(tree) + os.pathsep + env["PYTHONPATH"]
    port = free_port()
    out = tmp / "agent"
    log = (tmp / "agent.log").open("wb")
    agent_args = ["agent", "--config", str(config), "--state-dir", str(state), "--listen", f"127.0.0.1:{port}",
                  *(("--probe-mode", args.ebpf) if args.ebpf else ("--no-ebpf",))]
    agent = subprocess.Popen([sys.executable, str(SAMPLER), str(out), "--hz", str(profile_hz), "--", *agent_args],
                             env=agent_env, stdout=subprocess.DEVNULL, stderr=log)
    serving(agent, port, tmp / "agent.log")
    gate = find_gate({"GEMTRACE_GATE": str(REPO / "build" / "libgemgate.so")})
    lasting = warmup + seconds + 30 + case.processes * 0.02
    clients = []
    for i in range(case.processes):
        group, gpu = f"g{i % case.groups}", i % case.gpus
        loop = [str(RT_CLIENT), "launch-loop", "--kernel-ns", str(args.kernel_ns), "--launches-per-iter", "4",
                "--seconds", f"{lasting:.0f}", "--device", str(gpu)]
        if i < args.run_limit:
            cmd = [sys.executable, "-m", "gemtrace.cli", "run", "--group", group, "--config", str(config),
                   "--state-dir", str(state), "--", *loop]
            child_env = env
        else:
            cmd, child_env = loop, child_environment(group, state, gate, env)
        clients.append(subprocess.Popen(cmd, env=child_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    time.sleep(warmup)
    load0 = os.getloadavg()[0]
    wakes0 = thread_wakeups(agent.pid)
    threads0, cpu0, wall0 = thread_ticks(agent.pid), cpu_ticks(Path(f"/proc/{agent.pid}/stat")), time.monotonic()
    time.sleep(seconds)
    threads1, cpu1, wall1 = thread_ticks(agent.pid), cpu_ticks(Path(f"/proc/{agent.pid}/stat")), time.monotonic()
    wakes1 = thread_wakeups(agent.pid)
    alive = sum(c.poll() is None for c in clients)
    names = json.loads((tmp / "agent.threads.json").read_text())
    def kind(tid: int) -> str:  # the thread's name, every GPU's scheduler under one
        name: str = names.get(str(tid), "other")
        return "gemtrace-gpu*" if name.startswith("gemtrace-gpu") else name

    by_name: dict[str, float] = {}
    wakes: dict[str, float] = {}
    for tid, count in wakes1.items():
        wakes[kind(tid)] = wakes.get(kind(tid), 0.0) + (count - wakes0.get(tid, 0)) / (wall1 - wall0)
    for tid, ticks in threads1.items():
        name = kind(tid)
        by_name[name] = by_name.get(name, 0.0) + (ticks - threads0.get(tid, 0)) / TICKS / (wall1 - wall0) * 100
    for c in clients:
        c.kill()
    for c in clients:
        c.wait()
    agent.send_signal(signal.SIGTERM)
    agent.wait(timeout=60)
    log.close()
    stacks = {}
    if profile_hz:
        stacks = json.loads((tmp / "agent.stacks.json").read_text())
    return {"cpu_pct": (cpu1 - cpu0) / TICKS / (wall1 - wall0) * 100, "threads": by_name, "alive": alive,
            "wakes": wakes, "load": load0, "stacks": stacks}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", action="append", metavar="PxGxN",
                    help=f"processes x groups x GPUs (repeatable; default {' '.join(DEFAULT_CASES)})")
    ap.add_argument("--seconds", type=float, default=20.0, help="measurement window per case")
    ap.add_argument("--warmup", type=float, default=5.0, help="after the last process started")
    ap.add_argument("--kernel-ns", type=int, default=2_000_000)
    ap.add_argument("--cap", type=float, default=0.25, help="the capped groups' MaxUtil")
    ap.add_argument("--run-limit", type=int, default=16, help="processes started through `gemtrace run`")
    ap.add_argument("--ebpf", choices=("memory", "launches"), help="with the eBPF accounting (root, bcc)")
    ap.add_argument("--profile", type=float, nargs="?", const=500.0, default=0.0, metavar="HZ",
                    help="then run each case again with its stacks sampled at HZ (default 500)")
    add_tree_flag(ap, "the agent")
    ap.add_argument("--note", default="", help="a line recorded above the table (what code this is)")
    add_record_flag(ap, RESULTS)
    args = ap.parse_args()
    require_build()
    cases = [Case.parse(c) for c in (args.case or DEFAULT_CASES)]
    side_by_side = trees(args.tree)
    rows = []
    for case in cases:
        for code, tree in side_by_side:  # side by side, case by case: the host's load moves in between
            with tempfile.TemporaryDirectory(prefix="gemtrace-cpu-") as tmp:
                r = run_case(case, Path(tmp), args.seconds, args.warmup + case.processes * 0.01, args, tree=tree)
            rows.append((case, code, r))
            print(f"{case.name}, {code}: {r['cpu_pct']:.2f}% ({r['alive']} alive) "
                  + ", ".join(f"{k} {v:.2f}" for k, v in sorted(r["threads"].items(), key=lambda kv: -kv[1]) if v),
                  flush=True)
        if args.profile:
            with tempfile.TemporaryDirectory(prefix="gemtrace-cpu-") as tmp:
                p = run_case(case, Path(tmp), args.seconds, args.warmup + case.processes * 0.01, args, args.profile)
            for thread, frames in sorted(p["stacks"].items()):
                total = sum(frames.values())
                print(f"  {thread}: {total} samples")
                for where, n in list(frames.items())[:8]:
                    print(f"    {100 * n / total:5.1f}%  {where}")
    target = {(8, 4, 1): 2.0, (1024, 63, 8): 10.0}
    table = [
        f"{args.seconds:g} s windows, launch loops of {args.kernel_ns / 1e6:g} ms kernels (4 a sync), capped groups "
        f"MaxUtil {args.cap:g}, accounting {'eBPF ' + args.ebpf if args.ebpf else 'without eBPF (--no-ebpf)'}",
        "",
        "| case | code | agent CPU (% of one core) | scheduler threads | main | keeper | other | target | load "
        "| scheduler wake-ups/s | agent wake-ups/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for case, code, r in rows:
        t = r["threads"]
        main_, keeper, sched = t.get("MainThread", 0.0), t.get("gemtrace-keeper", 0.0), t.get("gemtrace-gpu*", 0.0)
        other = r["cpu_pct"] - main_ - keeper - sched
        goal = target.get((case.processes, case.groups, case.gpus))
        verdict = "" if goal is None else f"<= {goal:g}%: {'met' if r['cpu_pct'] <= goal else 'NOT met'}"
        table.append(f"| {case.name} | {code} | {r['cpu_pct']:.2f} | {sched:.2f} | {main_:.2f} | {keeper:.2f} | "
                     f"{max(0.0, other):.2f} | {verdict} | {r['load']:.1f} | "
                     f"{r['wakes'].get('gemtrace-gpu*', 0.0):.0f} | {sum(r['wakes'].values()):.0f} |")
    text = "\n".join(table)
    print(text)
    if not args.no_record:
        record(RESULTS, "Agent CPU and probe cost on the simulated GPU", f"{args.note}\n\n{text}",
               about="the whole agent (bench/bench_agent_cpu.py)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
