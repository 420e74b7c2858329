"""What a scrape loop costs the groups (issue 13), and what 200 other clients cost a legitimate scrape
(issue 25): `gemtrace agent` on the simulated GPU.

First, two groups capped at 0.3 and 0.7 with one gated launch loop each (2 ms kernels, 4 a sync), while
nobody scrapes /metrics and while `--scrapers` threads scrape it back to back, as a curl loop or a
misconfigured scraper would (any local user can on the default 127.0.0.1 listener). Per run: each
group's kernels a second, their sum against the quiet run of the same tree, the scrapes served and the
agent's CPU.

Then a legitimate scrape's latency (p50, p99, max of `--samples`, one every 0.1 s), alone and while
`--clients` clients (tests/slow_clients.py) scrape back to back (half of them) and hold connections
idle (the other half), beside the same idle gated processes.

Each agent tree runs every case, side by side (`--agent-tree NAME=DIR` adds the agent from DIR/gemtrace,
e.g. a `git archive` of an older commit).

    .venv/bin/python -m bench.bench_scrape_load [--seconds 10] [--scrapers 4] [--idle 200] [--clients 200]
        [--samples 50] [--agent-tree NAME=DIR] [--no-record]
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
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, BinaryIO

from simgpu_env import RT_CLIENT, SimGpu, require_build
from testkit import free_port

from bench.bench_agent_cpu import cpu_ticks, serving
from bench.recording import REPO, add_record_flag, add_tree_flag, record, trees
from gemtrace.run.launcher import child_environment, find_gate

RESULTS = REPO / "bench" / "results" / "scrape_load.md"
SLOW_CLIENTS = REPO / "tests" / "slow_clients.py"
TICKS = os.sysconf("SC_CLK_TCK")
CONFIG = "[capped30]\nMaxUtil = 0.3\n\n[capped70]\nMaxUtil = 0.7\n"
KERNEL_NS = 2_000_000


def scrape_loop(url: str, stop: threading.Event, served: list[int]) -> None:
    while not stop.is_set():
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                r.read()
            served[0] += 1
        except OSError:
            time.sleep(0.01)


def start_agent(tmp: Path, config: Path, state: Path, env: dict[str, str]
                ) -> tuple[subprocess.Popen[bytes], str, BinaryIO]:
    """The agent on a free port, once it answers /metrics; its URL and its log file."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    log = (tmp / "agent.log").open("wb")
    agent = subprocess.Popen([sys.executable, "-m", "gemtrace.cli", "agent", "--config", str(config), "--state-dir",
                              str(state), "--listen", f"127.0.0.1:{port}", "--no-ebpf"],
                             env=env, stdout=subprocess.DEVNULL, stderr=log,
                             cwd=tmp)  # not the repo: `python -m` puts the cwd before PYTHONPATH
    serving(agent, port, tmp / "agent.log")
    return agent, url, log


def environments(sim: SimGpu, tree: Path | None) -> tuple[dict[str, str], dict[str, str]]:
    """The gated programs' environment, and the agent's (from `tree` where given)."""
    env = sim.env()
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    agent_env = dict(env)
    if tree is not None:
        agent_env["PYTHONPATH"] = str(tree) + os.pathsep + env["PYTHONPATH"]
    return env, agent_env


def agent_on_simgpu(tmp: Path, tree: Path | None) -> tuple[Path, Path, dict[str, str],
                                                           tuple[subprocess.Popen[bytes], str, BinaryIO]]:
    """A private simulated GPU and the agent on it (from `tree` where given), on CONFIG: the resource
    file, the state dir, the gated programs' environment, and start_agent's answer."""
    config = tmp / "resource.conf"
    config.write_text(CONFIG)
    state = tmp / "state"
    env, agent_env = environments(SimGpu(tmp / "sim"), tree)
    return config, state, env, start_agent(tmp, config, state, agent_env)


def idle_holders(state: Path, env: dict[str, str], count: int, seconds: float) -> list[subprocess.Popen[bytes]]:
    """Gated processes that hold a little memory and launch nothing: series for /metrics to carry."""
    gate = find_gate({"GEMTRACE_GATE": str(REPO / "build" / "libgemgate.so")})
    return [subprocess.Popen([str(RT_CLIENT), "alloc", "--api", "v2", "1MiB", "--hold", f"{seconds:.0f}"],
                             env=child_environment("default", state, gate, env), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL) for _ in range(count)]


def flood(port: int, mode: str, count: int, tls: bool = False) -> subprocess.Popen[str]:
    """`count` clients of tests/slow_clients.py's `mode`, under way once this returns."""
    proc = subprocess.Popen([sys.executable, str(SLOW_CLIENTS), "--port", str(port), "--mode", mode, "--count",
                             str(count), *(["--tls"] if tls else [])],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != "ready":
        raise RuntimeError(f"tests/slow_clients.py --mode {mode} did not start")
    return proc


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def latency(tmp: Path, tree: Path | None, clients: int, samples: int, idle: int) -> list[tuple[str, list[float]]]:
    """A legitimate scrape's seconds, `samples` of them, alone and under `clients` other clients."""
    config, state, env, (agent, url, log) = agent_on_simgpu(tmp, tree)
    holders = idle_holders(state, env, idle, 600)
    port = int(url.split(":")[2].split("/")[0])
    cases: list[tuple[str, list[float]]] = []
    floods: list[subprocess.Popen[str]] = []
    try:
        time.sleep(3 + idle * 0.01)
        for case in ("alone", f"{clients // 2} scraping + {clients - clients // 2} idle"):
            if case != "alone":
                floods = [flood(port, "scrape", clients // 2), flood(port, "idle", clients - clients // 2)]
                time.sleep(2)
            times = []
            for _ in range(samples):
                began = time.monotonic()
                try:
                    with urllib.request.urlopen(url, timeout=30) as r:
                        r.read()
                    times.append(time.monotonic() - began)
                except OSError:
                    times.append(float("inf"))
                time.sleep(0.1)
            cases.append((case, times))
    finally:
        for proc in floods:
            proc.kill()
            proc.wait()
        for holder in holders:
            holder.kill()
            holder.wait()
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=60)
        log.close()
    return cases


def run(tmp: Path, tree: Path | None, scrapers: int, seconds: float, warmup: float, idle: int) -> dict:
    config, state, env, (agent, url, log) = agent_on_simgpu(tmp, tree)
    loops = {group: subprocess.Popen(
        [sys.executable, "-m", "gemtrace.cli", "run", "--group", group, "--config", str(config), "--state-dir",
         str(state), "--", str(RT_CLIENT), "launch-loop", "--kernel-ns", str(KERNEL_NS), "--launches-per-iter",
         "4", "--seconds", f"{warmup + seconds:.1f}", "--progress"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for group in ("capped30", "capped70")}
    holders = idle_holders(state, env, idle, warmup + seconds + 30)
    stop, served = threading.Event(), [0]
    threads = [threading.Thread(target=scrape_loop, args=(url, stop, served), daemon=True) for _ in range(scrapers)]
    try:
        time.sleep(warmup)
        for t in threads:
            t.start()
        cpu0, wall0 = cpu_ticks(Path(f"/proc/{agent.pid}/stat")), time.monotonic()
        progress: dict[str, list[dict]] = {}
        for group, loop in loops.items():
            assert loop.stdout is not None
            progress[group] = [json.loads(line) for line in loop.stdout if line.startswith('{"progress"')]
        cpu1, wall1 = cpu_ticks(Path(f"/proc/{agent.pid}/stat")), time.monotonic()
    finally:
        stop.set()
        procs: list[subprocess.Popen[Any]] = [*loops.values(), *holders]
        for proc in procs:
            proc.kill()
            proc.wait()
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=60)
        log.close()
    rates = {}
    for group, lines in progress.items():
        # The window: the progress lines after the warm-up (one a second, cumulative launches).
        window = [p for p in lines if p["t"] >= warmup]
        first, last = window[0], window[-1]
        rates[group] = (last["launches"] - first["launches"]) / (last["t"] - first["t"])
    return {"rates": rates, "scrapes": served[0] / max(wall1 - wall0, 1e-9),
            "cpu_pct": (cpu1 - cpu0) / TICKS / (wall1 - wall0) * 100}


def latency_row(code: str, case: str, times: list[float]) -> str:
    answered = [t for t in times if t != float("inf")]
    return (f"| {code} | {case} | {statistics.median(times) * 1e3:.0f} | {percentile(times, 0.99) * 1e3:.0f} | "
            f"{max(times) * 1e3:.0f} | {len(answered)}/{len(times)} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--scrapers", type=int, default=4, help="threads scraping back to back")
    add_tree_flag(ap, "the agent")
    ap.add_argument("--idle", type=int, default=0, help="gated processes holding 1 MiB, launching nothing")
    ap.add_argument("--clients", type=int, default=200, help="other clients while a legitimate scrape is timed")
    ap.add_argument("--samples", type=int, default=50, help="legitimate scrapes timed per case")
    add_record_flag(ap, RESULTS)
    args = ap.parse_args()
    require_build()
    side_by_side = trees(args.tree)
    rows, latencies = [], []
    for code, tree in side_by_side:
        quiet = None
        for scrapers in (0, args.scrapers):
            with tempfile.TemporaryDirectory(prefix="gemtrace-scrape-") as tmp:
                r = run(Path(tmp), tree, scrapers, args.seconds, args.warmup + args.idle * 0.01, args.idle)
            total = sum(r["rates"].values())
            quiet = quiet or total
            rows.append(f"| {code} | {scrapers} | {r['scrapes']:.0f} | {r['rates']['capped30']:.0f} | "
                        f"{r['rates']['capped70']:.0f} | {total / quiet:.3f} | {r['cpu_pct']:.1f} |")
            print(rows[-1], flush=True)
        if args.clients:
            with tempfile.TemporaryDirectory(prefix="gemtrace-scrape-") as tmp:
                for case, times in latency(Path(tmp), tree, args.clients, args.samples, args.idle):
                    latencies.append(latency_row(code, case, times))
                    print(latencies[-1], flush=True)
    text = "\n".join([
        f"{args.seconds:g} s windows; kernels of {KERNEL_NS / 1e6:g} ms, 4 a sync (the simulated GPU does 500 a "
        f"second); {args.idle} idle gated processes beside the two loops",
        "",
        "| agent | scraping threads | scrapes/s | capped30 kernels/s | capped70 kernels/s | sum / quiet sum "
        "| agent CPU % |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        *rows])
    if latencies:
        text += "\n".join([
            "", "",
            f"A legitimate scrape, {args.samples} of them 0.1 s apart (30 s timeout), beside the same idle gated "
            "processes, alone and while other clients scrape back to back or hold idle connections "
            "(tests/slow_clients.py)",
            "",
            "| agent | other clients | p50 ms | p99 ms | max ms | answered |",
            "| --- | --- | --- | --- | --- | --- |",
            *latencies])
    print(text)
    if not args.no_record:
        record(RESULTS, "Scrape loops against the scheduler, simulated GPU (bench/bench_scrape_load.py)", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
