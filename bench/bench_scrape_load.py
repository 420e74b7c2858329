"""What a scrape loop costs the groups (issue 13): `gemtrace agent` on the simulated GPU, two groups
capped at 0.3 and 0.7 with one gated launch loop each (2 ms kernels, 4 a sync), while nobody scrapes
/metrics and while `--scrapers` threads scrape it back to back, as a curl loop or a misconfigured
scraper would (any local user can on the default 127.0.0.1 listener).

Each agent tree runs both ways, side by side (`--agent-tree NAME=DIR` adds the agent from DIR/gemtrace,
e.g. a `git archive` of a commit before the scrape pacing). Per run: each group's kernels a second,
their sum against the quiet run of the same tree, the scrapes served and the agent's CPU.

    .venv/bin/python bench/bench_scrape_load.py [--seconds 10] [--scrapers 4] [--idle 200]
        [--agent-tree NAME=DIR] [--no-record]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from bench_agent_cpu import cpu_ticks, free_port  # noqa: E402
from simgpu_env import RT_CLIENT, SimGpu, require_build  # noqa: E402

from gemtrace.launcher import child_environment, find_gate  # noqa: E402

RESULTS = REPO / "bench" / "results" / "scrape_load.md"
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


def run(tmp: Path, tree: Path | None, scrapers: int, seconds: float, warmup: float, idle: int) -> dict:
    sim = SimGpu(tmp / "sim")
    config = tmp / "resource.conf"
    config.write_text(CONFIG)
    state = tmp / "state"
    env = sim.env()
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    agent_env = dict(env)
    if tree is not None:
        agent_env["PYTHONPATH"] = str(tree) + os.pathsep + env["PYTHONPATH"]
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    log = (tmp / "agent.log").open("wb")
    agent = subprocess.Popen([sys.executable, "-m", "gemtrace.cli", "agent", "--config", str(config), "--state-dir",
                              str(state), "--listen", f"127.0.0.1:{port}", "--no-ebpf"],
                             env=agent_env, stdout=subprocess.DEVNULL, stderr=log,
                             cwd=tmp)  # not the repo: `python -m` puts the cwd before PYTHONPATH
    deadline = time.monotonic() + 30
    while True:
        if agent.poll() is not None:
            raise RuntimeError(f"the agent exited: {(tmp / 'agent.log').read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    loops = {group: subprocess.Popen(
        [sys.executable, "-m", "gemtrace.cli", "run", "--group", group, "--config", str(config), "--state-dir",
         str(state), "--", str(RT_CLIENT), "launch-loop", "--kernel-ns", str(KERNEL_NS), "--launches-per-iter",
         "4", "--seconds", f"{warmup + seconds:.1f}", "--progress"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for group in ("capped30", "capped70")}
    # Gated processes that hold a little memory and launch nothing: series for /metrics to carry.
    gate = find_gate({"GEMTRACE_GATE": str(REPO / "build" / "libgemgate.so")})
    hold = ["--hold", f"{warmup + seconds + 30:.0f}"]
    holders = [subprocess.Popen([str(RT_CLIENT), "alloc", "--api", "v2", "1MiB", *hold],
                                env=child_environment("default", state, gate, env), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL) for _ in range(idle)]
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
        for proc in [*loops.values(), *holders]:
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--scrapers", type=int, default=4, help="threads scraping back to back")
    ap.add_argument("--agent-tree", action="append", metavar="NAME=DIR", help="also the agent from DIR/gemtrace")
    ap.add_argument("--idle", type=int, default=0, help="gated processes holding 1 MiB, launching nothing")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    require_build()
    trees: list[tuple[str, Path | None]] = [(name, Path(path)) for name, _, path in
                                            (t.partition("=") for t in args.agent_tree or ())]
    trees.append(("this checkout", None))
    rows = []
    for code, tree in trees:
        quiet = None
        for scrapers in (0, args.scrapers):
            with tempfile.TemporaryDirectory(prefix="gemtrace-scrape-") as tmp:
                r = run(Path(tmp), tree, scrapers, args.seconds, args.warmup + args.idle * 0.01, args.idle)
            total = sum(r["rates"].values())
            quiet = quiet or total
            rows.append(f"| {code} | {scrapers} | {r['scrapes']:.0f} | {r['rates']['capped30']:.0f} | "
                        f"{r['rates']['capped70']:.0f} | {total / quiet:.3f} | {r['cpu_pct']:.1f} |")
            print(rows[-1], flush=True)
    text = "\n".join([
        f"{args.seconds:g} s windows; kernels of {KERNEL_NS / 1e6:g} ms, 4 a sync (the simulated GPU does 500 a "
        f"second); {args.idle} idle gated processes beside the two loops",
        "",
        "| agent | scraping threads | scrapes/s | capped30 kernels/s | capped70 kernels/s | sum / quiet sum "
        "| agent CPU % |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        *rows])
    print(text)
    if not args.no_record:
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip() or "?"
        stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
        header = "" if RESULTS.exists() else ("# Scrape loops against the scheduler, simulated GPU "
                                              "(bench/bench_scrape_load.py)\n\n")
        with RESULTS.open("a") as f:
            f.write(f"{header}## {stamp} on {platform.node()}, {os.cpu_count()} CPUs, gemtrace {commit}\n\n{text}\n\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
