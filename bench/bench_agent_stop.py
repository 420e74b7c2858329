"""How long the agent takes to stop, and how old its heartbeat gets, with many gated processes
(issue 11): a real `gemtrace agent` on the simulated GPU, --processes gated clients that hold memory
(so every one maps the probed libcuda and owns a slot), then SIGTERM.

Stop time is from SIGTERM to the agent's exit (the unit's TimeoutStopSec is 15 s; the target is
under 2 s), gates free from SIGTERM to heartbeat 0 (no gate waits on the agent from then on); the
agent's own `agent_stopped` event gives where the time went (main_loop: the signal to the stop's
start, while the main loop finishes its tick). Heartbeat age is
sampled from the region every millisecond while the processes start, run and exit (target: under
100 ms; gates ignore a silent agent after GT_HEARTBEAT_STALE_NS). Appends a dated table to
bench/results/agent_stop.md.

    sudo .venv/bin/python -m bench.bench_agent_stop [--processes 1000] [--runs 5] [--no-ebpf] [--no-record]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from simgpu_env import RT_CLIENT, require_build, simgpu_env
from testkit import free_port

from bench.recording import REPO, add_record_flag, record
from gemtrace import region as rg

RESULTS = REPO / "bench" / "results" / "agent_stop.md"
GATE = REPO / "build" / "libgemgate.so"
CONFIG = "[train]\nMaxUtil = 0.8\nMemoryLimit = 64GiB\n\n[infer]\nMaxUtil = 0.5\n"


class HeartbeatSampler:
    """The heartbeat's age, read from the region every millisecond by a thread of its own."""

    def __init__(self, region: rg.Region) -> None:
        self.region = region
        self.worst_ns = 0
        self.worst_phase = ""
        self.phase = "start"  # what the bench is doing, set by its main thread
        self.own_gap_ns = 0  # the sampler's own longest pause: a stalled bench is not a stalled agent
        self.ages: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last = time.monotonic_ns()
        while not self._stop.is_set():
            now = time.monotonic_ns()
            self.own_gap_ns, last = max(self.own_gap_ns, now - last), now
            beat = self.region.layout.header.heartbeat_ns
            if beat:
                age = now - beat
                self.ages.append(age)
                if age > self.worst_ns:
                    self.worst_ns, self.worst_phase = age, self.phase
            time.sleep(0.001)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def one_run(tmp: Path, processes: int, ebpf: bool) -> dict[str, float]:
    config = tmp / "resource.conf"
    config.write_text(CONFIG)
    state = tmp / "state"
    env = simgpu_env(tmp / "sim", memory="1TiB")
    env["PYTHONPATH"] = str(REPO)
    log = tmp / "agent.log"
    cmd = [sys.executable, "-m", "gemtrace.cli", "agent", "--config", str(config), "--state-dir", str(state),
           "--listen", f"127.0.0.1:{free_port()}"] + ([] if ebpf else ["--no-ebpf"])
    agent = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log.open("wb"))
    deadline = time.monotonic() + 60
    while '"agent_started"' not in log.read_text():
        if agent.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the agent did not start:\n{log.read_text()}")
        time.sleep(0.05)
    region = rg.Region.open(state)
    sampler = HeartbeatSampler(region)
    gated = dict(env, LD_PRELOAD=str(GATE), GEMTRACE_STATE_DIR=str(state))
    clients = []
    sampler.phase = "spawning"
    for i in range(processes):
        gated["GEMTRACE_GROUP"] = ("train", "infer")[i % 2]
        clients.append(subprocess.Popen([str(RT_CLIENT), "alloc", "--api", "v2", str(1 << 20), "--hold", "600"],
                                        env=gated, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    deadline = time.monotonic() + 120
    while sum(1 for p in region.slot_pids() if p) < processes and time.monotonic() < deadline:
        time.sleep(0.1)
    attached = sum(1 for p in region.slot_pids() if p)
    sampler.phase = "running"
    time.sleep(2.5)  # a libcuda rescan or two with every process running
    # Half of them exit while the agent runs: the reaper's work, measured against the heartbeat.
    sampler.phase = "exiting"
    for c in clients[: processes // 2]:
        c.kill()
    for c in clients[: processes // 2]:
        c.wait()
    time.sleep(1.0)
    sampler.stop()
    t0 = time.monotonic()
    agent.send_signal(signal.SIGTERM)
    while agent.poll() is None and region.layout.header.heartbeat_ns != 0:
        time.sleep(0.001)
    gates_free_s = time.monotonic() - t0  # heartbeat 0: no gate waits on the agent any more
    status = agent.wait(timeout=120)
    stop_s = time.monotonic() - t0
    for c in clients[processes // 2 :]:
        c.kill()
        c.wait()
    region.close()
    stopped = [json.loads(x) for x in log.read_text().splitlines() if '"agent_stopped"' in x]
    steps = stopped[-1].get("steps_ms", {}) if stopped else {}
    return {"stop_s": stop_s, "gates_free_s": gates_free_s, "status": status,
            "heartbeat_worst_ms": sampler.worst_ns / 1e6,
            "worst_while": sampler.worst_phase, "bench_own_pause_ms": sampler.own_gap_ns / 1e6,
            "heartbeat_p99_ms": sorted(sampler.ages)[int(0.99 * len(sampler.ages))] / 1e6 if sampler.ages else 0.0,
            "attached": attached, "steps": steps}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--processes", type=int, default=1000)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--no-ebpf", action="store_true")
    add_record_flag(ap, RESULTS)
    args = ap.parse_args()
    require_build()
    if os.geteuid() != 0 and not args.no_ebpf:
        sys.exit("run as root (eBPF), or pass --no-ebpf")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the bench's own pipes and pidfds
    rows = []
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory() as tmp:
            r = one_run(Path(tmp), args.processes, not args.no_ebpf)
        print(json.dumps(r), flush=True)
        rows.append(r)
    stops = [r["stop_s"] for r in rows]
    table = [
        f"{args.processes} gated processes (half killed while the agent runs), eBPF {'off' if args.no_ebpf else 'on'},"
        f" {args.runs} runs",
        "",
        "| stop median (s) | stop max (s) | gates free max (s) | heartbeat age worst (ms) | heartbeat age p99 (ms) "
        "| stop steps, last run (ms) |",
        "|---|---|---|---|---|---|",
        f"| {statistics.median(stops):.2f} | {max(stops):.2f} | {max(r['gates_free_s'] for r in rows):.3f} | "
        f"{max(r['heartbeat_worst_ms'] for r in rows):.1f} | "
        f"{max(r['heartbeat_p99_ms'] for r in rows):.1f} | {rows[-1]['steps']} |",
    ]
    print("\n".join(table))
    if not args.no_record:
        record(RESULTS, "Agent stop time and heartbeat age", "\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
