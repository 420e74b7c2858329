"""Agent CPU (issue 13): the whole `gemtrace agent` process, as users run it, on the simulated GPU.

Each case starts `gemtrace agent` as a subprocess (through bench/agent_sampler.py, which only tells
the bench its threads' names) on a private simulated GPU with G groups (the capped ones MaxUtil
`--cap`), then P gated launch loops: process i in group i % G on GPU i % N (every group spans GPUs
where N > 1, its processes one job: gang turns, docs/scheduler.md), or with --group-per-gpu on GPU (i % G) % N (no group
spans GPUs: each GPU schedules its own groups alone). The first ones start
through `gemtrace run`; past `--run-limit` the bench gives a process the environment `gemtrace run`
would (launcher.child_environment: the gate preloaded, the group asked for), since a thousand Python
launchers would take minutes of this host's CPU. After a warm-up, the agent's CPU time over a window
(utime + stime of all its threads, /proc/PID/stat) over the window's wall time is its CPU in % of one
core; the threads' shares come from /proc/PID/task/*/stat, and their wake-ups a second (voluntary
context switches, /proc/PID/task/*/status) from the same window: on a VM a wake-up costs more than
the Python it runs (bench/bench_wake_cost.py). The targets: <= 2% with 8 processes in 4
capped groups on one GPU, <= 5% at the region's limit (1024 processes, 63 groups, 8 GPUs), issue 30's.

What makes the figure differ between hosts is printed with it: the agent's wake-ups a second (each
costs a cold cache, and on a VM an idle vCPU's wake-up), its threads' timer slack (the kernel may
defer a sleeper's wake-up by that much, merging wake-ups), the clock source (a clock read is a
vDSO read on tsc, a trap on some VMs' clocks) and NVML's call time, the simulated driver's during
each case and the host's own driver's (a GPU host: the agent calls it every accounting poll).
With --rounds N, each case runs N times, every code once a round: the table gives medians and
(min-max).

With --profile, each case runs a second time with the agent's stacks sampled (agent_sampler --hz)
and prints the top frames per thread (the sampling costs CPU itself: never in the measured run).

Appends the dated table, with the machine and its load, to bench/results/agent_cpu.md.

    .venv/bin/python -m bench.bench_agent_cpu [--case 8x4x1 --case 256x16x1 ...] [--seconds 20]
        [--rounds 3] [--tree NAME=DIR] [--ebpf memory|launches] [--profile] [--no-record]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
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
from gemtrace.agent.scheduler_loop import PER_GPU_THREAD_PREFIX
from gemtrace.agent.scheduler_loop import THREAD_NAME as SCHEDULER_THREAD
from gemtrace.defaults import ENV_JOB
from gemtrace.run.launcher import child_environment, find_gate

RESULTS = REPO / "bench" / "results" / "agent_cpu.md"
SAMPLER = REPO / "bench" / "agent_sampler.py"
TICKS = os.sysconf("SC_CLK_TCK")
DEFAULT_CASES = ("0x4x1", "8x4x1", "256x16x1", "1024x63x8")
# The scheduling threads, counted as one: the agent's one for all GPUs, or one per GPU (where the kernel
# has no futex_waitv, and in agents before it, a --tree beside this one).
SCHEDULERS = f"{SCHEDULER_THREAD}|{PER_GPU_THREAD_PREFIX}*"


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


# The agent's NVML reads, timed in a process of their own: each call's CPU and wall time, median of 20
# (the agent's accounting poll calls processes() and utilization() once a second).
NVML_TIMING = """
import json, statistics, sys, time
from gemtrace.sources.nvml import NvmlReader
reader = NvmlReader()
if not reader.available:
    print(json.dumps({"reason": reader.reason}))
    sys.exit()
def per_call(fn):
    cpu, wall = [], []
    for _ in range(20):
        c, w = time.thread_time_ns(), time.perf_counter_ns()
        fn()
        cpu.append(time.thread_time_ns() - c)
        wall.append(time.perf_counter_ns() - w)
    return statistics.median(cpu) / 1e3, statistics.median(wall) / 1e3
print(json.dumps({"devices": len(reader.gpu_uuids()), "processes": len(reader.processes()),
                  "processes_us": per_call(reader.processes), "utilization_us": per_call(reader.utilization)}))
"""


def nvml_call_times(env: dict[str, str]) -> dict:
    """NVML's call times as the agent's reader sees them under `env` (the simulated driver's or the
    host's): {"devices", "processes", "processes_us": (cpu, wall), "utilization_us": (cpu, wall)}, or
    {"reason"} where there is no NVML."""
    env = dict(env, PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""))
    try:
        done = subprocess.run([sys.executable, "-c", NVML_TIMING], env=env, capture_output=True, text=True,
                              timeout=120, check=True)
        return dict(json.loads(done.stdout))
    except (subprocess.SubprocessError, ValueError) as e:
        return {"reason": f"timing failed: {e}"}


def describe_nvml(t: dict) -> str:
    if "reason" in t:
        return str(t["reason"])
    return (f"{t['devices']} device(s), {t['processes']} process(es): processes() {t['processes_us'][0]:.0f} us "
            f"CPU ({t['processes_us'][1]:.0f} wall), utilization() {t['utilization_us'][0]:.0f} us CPU "
            f"({t['utilization_us'][1]:.0f} wall)")


def timer_slack(pid: int) -> int:
    """A process's timer slack in ns (/proc/PID/timerslack_ns: its main thread's, which threads inherit
    when they start; -1 if unreadable). A sleep's wake-up may come that much late, merged with others."""
    try:
        return int(Path(f"/proc/{pid}/timerslack_ns").read_text())
    except (OSError, ValueError):
        return -1


def clock_source() -> str:
    try:
        return Path("/sys/devices/system/clocksource/clocksource0/current_clocksource").read_text().strip()
    except OSError:
        return "unknown"


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
        group, gpu = f"g{i % case.groups}", (i % case.groups if args.group_per_gpu else i) % case.gpus
        loop = [str(RT_CLIENT), "launch-loop", "--kernel-ns", str(args.kernel_ns), "--launches-per-iter", "4",
                "--seconds", f"{lasting:.0f}", "--device", str(gpu)]
        # A group's processes are one job (GEMTRACE_JOB), as a distributed run's ranks are: the groups
        # spanning GPUs take gang turns, the case the bench means to measure.
        job_env = {**env, ENV_JOB: f"bench-{group}"}
        if i < args.run_limit:
            cmd = [sys.executable, "-m", "gemtrace.cli", "run", "--group", group, "--config", str(config),
                   "--state-dir", str(state), "--", *loop]
            child_env = job_env
        else:
            cmd, child_env = loop, child_environment(group, state, gate, job_env)
        clients.append(subprocess.Popen(cmd, env=child_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    time.sleep(warmup)
    load0 = os.getloadavg()[0]
    wakes0 = thread_wakeups(agent.pid)
    threads0, cpu0, wall0 = thread_ticks(agent.pid), cpu_ticks(Path(f"/proc/{agent.pid}/stat")), time.monotonic()
    time.sleep(seconds)
    threads1, cpu1, wall1 = thread_ticks(agent.pid), cpu_ticks(Path(f"/proc/{agent.pid}/stat")), time.monotonic()
    wakes1 = thread_wakeups(agent.pid)
    slack = timer_slack(agent.pid)
    alive = sum(c.poll() is None for c in clients)
    nvml = nvml_call_times(env)  # (the simulated driver's, with the case's processes running)
    names = json.loads((tmp / "agent.threads.json").read_text())
    def kind(tid: int) -> str:  # the thread's name, the scheduling threads under one
        name: str = names.get(str(tid), "other")
        return SCHEDULERS if name == SCHEDULER_THREAD or name.startswith(PER_GPU_THREAD_PREFIX) else name

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
    # The gates' rings over their budget (gemtrace/agent/scheduler_loop.py): said at most once a minute,
    # and never in the normal course, where rings are what the gates' waits and drains bring.
    budget_spent = (tmp / "agent.log").read_text(errors="replace").count('"ring_budget_spent"')
    stacks = {}
    if profile_hz:
        stacks = json.loads((tmp / "agent.stacks.json").read_text())
    return {"cpu_pct": (cpu1 - cpu0) / TICKS / (wall1 - wall0) * 100, "threads": by_name, "alive": alive,
            "wakes": wakes, "load": load0, "stacks": stacks, "slack": slack, "nvml": nvml,
            "budget_spent": budget_spent}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", action="append", metavar="PxGxN",
                    help=f"processes x groups x GPUs (repeatable; default {' '.join(DEFAULT_CASES)})")
    ap.add_argument("--seconds", type=float, default=20.0, help="measurement window per case")
    ap.add_argument("--warmup", type=float, default=5.0, help="after the last process started")
    ap.add_argument("--rounds", type=int, default=1, help="runs of each case, every code once a round")
    ap.add_argument("--group-per-gpu", action="store_true",
                    help="a group's processes on one GPU (no gang turns), not spread over all of them")
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
    host_nvml = describe_nvml(nvml_call_times(dict(os.environ)))
    print(f"host: clock source {clock_source()}; the host's NVML: {host_nvml}", flush=True)
    runs: dict[tuple[Case, str], list[dict]] = {}
    for case in cases:
        for _ in range(args.rounds):
            for code, tree in side_by_side:  # side by side, case by case: the host's load moves in between
                with tempfile.TemporaryDirectory(prefix="gemtrace-cpu-") as tmp:
                    r = run_case(case, Path(tmp), args.seconds, args.warmup + case.processes * 0.01, args, tree=tree)
                runs.setdefault((case, code), []).append(r)
                print(f"{case.name}, {code}: {r['cpu_pct']:.2f}% ({r['alive']} alive) "
                      + ", ".join(f"{k} {v:.2f}" for k, v in sorted(r["threads"].items(), key=lambda kv: -kv[1]) if v)
                      + "; wake-ups/s " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(r["wakes"].items()) if v >= 0.5)
                      + f"; timer slack {r['slack']} ns; ring budget spent {r['budget_spent']} times"
                      + f"; simulated NVML: {describe_nvml(r['nvml'])}",
                      flush=True)
        if args.profile:
            with tempfile.TemporaryDirectory(prefix="gemtrace-cpu-") as tmp:
                p = run_case(case, Path(tmp), args.seconds, args.warmup + case.processes * 0.01, args, args.profile)
            for thread, frames in sorted(p["stacks"].items()):
                total = sum(frames.values())
                print(f"  {thread}: {total} samples")
                for where, n in list(frames.items())[:8]:
                    print(f"    {100 * n / total:5.1f}%  {where}")
    target = {(8, 4, 1): 2.0, (1024, 63, 8): 5.0}
    rounds = f", {args.rounds} rounds (medians, min-max)" if args.rounds > 1 else ""
    layout = "each group on one GPU" if args.group_per_gpu else "each group over every GPU"
    table = [
        f"{args.seconds:g} s windows{rounds}, {layout}, launch loops of {args.kernel_ns / 1e6:g} ms kernels "
        f"(4 a sync), capped groups MaxUtil {args.cap:g}, "
        f"accounting {'eBPF ' + args.ebpf if args.ebpf else 'without eBPF (--no-ebpf)'}; "
        f"clock source {clock_source()}; the host's NVML: {host_nvml}",
        "",
        "| case | code | agent CPU (% of one core) | scheduler threads | main | keeper | other | target | load "
        "| scheduler wake-ups/s | agent wake-ups/s | timer slack (ns) | simulated NVML processes(), us CPU "
        "| ring budget spent (log) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]

    def median(figures: list[float]) -> str:
        text = f"{statistics.median(figures):.2f}"
        return text + (f" ({min(figures):.2f}-{max(figures):.2f})" if len(figures) > 1 else "")

    def of(rs: list[dict], name: str) -> list[float]:
        return [r["threads"].get(name, 0.0) for r in rs]

    for (case, code), rs in runs.items():
        cpu = [r["cpu_pct"] for r in rs]
        main_, keeper, sched = of(rs, "MainThread"), of(rs, "gemtrace-keeper"), of(rs, SCHEDULERS)
        other = [max(0.0, r["cpu_pct"] - m - k - g) for r, m, k, g in zip(rs, main_, keeper, sched, strict=True)]
        goal = target.get((case.processes, case.groups, case.gpus))
        verdict = "" if goal is None else f"<= {goal:g}%: {'met' if statistics.median(cpu) <= goal else 'NOT met'}"
        nvml = [r["nvml"]["processes_us"][0] for r in rs if "processes_us" in r["nvml"]]
        nvml_cell = f"{statistics.median(nvml):.0f}" if nvml else "-"
        table.append(f"| {case.name} | {code} | {median(cpu)} | {median(sched)} | {median(main_)} | "
                     f"{median(keeper)} | {median(other)} | {verdict} | {median([r['load'] for r in rs])} | "
                     f"{statistics.median(r['wakes'].get(SCHEDULERS, 0.0) for r in rs):.0f} | "
                     f"{statistics.median(sum(r['wakes'].values()) for r in rs):.0f} | "
                     f"{'/'.join(sorted({str(r['slack']) for r in rs}))} | "
                     f"{nvml_cell} | {sum(r['budget_spent'] for r in rs)} |")
    text = "\n".join(table)
    print(text)
    if not args.no_record:
        record(RESULTS, "Agent CPU and probe cost on the simulated GPU", f"{args.note}\n\n{text}",
               about="the whole agent (bench/bench_agent_cpu.py)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
