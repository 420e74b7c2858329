"""Root's attaches while another user floods or hoards the attach socket (issue 25; docs/security.md,
"Attaching"): a real `gemtrace agent` on the simulated GPU, and an unprivileged uid (one with no
account, through setpriv) running tests/test_trust.py's flooders: silent, slow, garbage and useless
(valid joins never used) connections, six processes of 500 connections each; or two uids' chunk
hoards. Meanwhile root runs --programs gated programs one after another, each asking its 1 GiB group
for 768 MiB twice: gated means it got CUDA_SUCCESS then CUDA_ERROR_OUT_OF_MEMORY. Attach latency is
root's request to the socket answered (a view, the same queue a gate's join waits in), --asks times;
the program's wall time is measured too. Appends a dated table, with the commit, to
bench/results/attach_flood.md; run it on an older checkout for the "before" rows.

    sudo .venv/bin/python -m bench.bench_attach_flood [--programs 20] [--asks 200] [--no-record]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from agent_host import Host, stop
from simgpu_env import RT_CLIENT, SimGpu, require_build
from test_trust import FLOODER, HOARDER, SETPRIV
from testkit import MiB

from bench.recording import REPO, add_record_flag, append_rows, commit, machine, stamp
from gemtrace import contract
from gemtrace.region import server

RESULTS = REPO / "bench" / "results" / "attach_flood.md"
GATE = REPO / "build" / "libgemgate.so"
CONFIG = "[train]\nMaxUtil = 0.8\nMemoryLimit = 1GiB\n"
CASES = ("none", "silent", "slow", "garbage", "useless", "hoard")
UIDS = (61031, 61032)  # no account needed: the socket and the checkout are all they use
HEADER = """# Root's attaches under another user's flood of the attach socket

`bench/bench_attach_flood.py` (issue 25; docs/security.md, "Attaching"): a real agent on the simulated GPU,
another uid flooding the socket (six processes, 500 connections each) or two uids hoarding chunks; root
runs gated programs one after another in a 1 GiB group, each asking for 768 MiB twice. "Programs gated":
root's programs that got CUDA_SUCCESS then CUDA_ERROR_OUT_OF_MEMORY (an ungated one gets two successes). Attach
latency: root's request to the socket answered ("inf": that share of them got no answer within 2 s; the
unanswered are counted apart). The machine is shared, so compare rows of one date.

| date | machine | commit | flood | programs gated | asks unanswered | attach ms p50 | p99 | program ms p50 | p99 |
|---|---|---|---|---|---|---|---|---|---|
"""


def as_uid(uid: int, *argv: str) -> list[str]:
    return [SETPRIV, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *argv]


def start_attack(case: str, host: Host) -> list[subprocess.Popen[str]]:
    if case == "none":
        return []
    if case == "hoard":
        procs = []
        for uid in UIDS:
            proc = subprocess.Popen(as_uid(uid, sys.executable, "-c", HOARDER, str(host.state_dir), "20", "one"),
                                    env=host.env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            assert proc.stdout is not None
            proc.stdout.readline()  # its chunks taken
            procs.append(proc)
        return procs
    proc = subprocess.Popen(as_uid(UIDS[0], sys.executable, "-c", FLOODER, case,
                                   str(host.state_dir / contract.ATTACH_SOCKET), "6", "500", "600"),
                            env=host.env(), stdout=subprocess.DEVNULL, text=True,
                            start_new_session=True)  # its processes are one group, killed together
    time.sleep(2)  # at full strength
    return [proc]


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def measure(case: str, host: Host, programs: int, asks: int) -> dict[str, float]:
    running = host.start_agent()
    attack = start_attack(case, host)
    try:
        latencies = []
        for _ in range(asks):
            start = time.perf_counter()
            try:
                _, fds = server.ask(host.state_dir)
                for fd in fds:
                    os.close(fd)
                latencies.append((time.perf_counter() - start) * 1000)
            except OSError:
                latencies.append(float("inf"))  # no answer: the socket's timeout and more
        gated, walls = 0, []
        for _ in range(programs):
            start = time.perf_counter()
            run = subprocess.run([str(RT_CLIENT), "alloc", "--api", "v2", str(768 * MiB), str(768 * MiB)],
                                 env=host.env(GEMTRACE_STATE_DIR=str(host.state_dir), GEMTRACE_GROUP="train",
                                              LD_PRELOAD=str(GATE)), capture_output=True, text=True, timeout=120)
            walls.append((time.perf_counter() - start) * 1000)
            names = [json.loads(line)["name"] for line in run.stdout.splitlines() if line.startswith('{"size"')]
            gated += names == ["CUDA_SUCCESS", "CUDA_ERROR_OUT_OF_MEMORY"] and run.returncode == 0
    finally:
        for proc in attack:
            if proc.stdin is not None:
                proc.stdin.close()
            os.killpg(proc.pid, signal.SIGKILL) if case != "hoard" else proc.kill()
            proc.wait()
        stop(running)
    return {"gated": gated, "programs": programs, "unanswered": sum(t == float("inf") for t in latencies),
            "asks": asks, "ask_p50": percentile(latencies, 50),
            "ask_p99": percentile(latencies, 99), "wall_p50": percentile(walls, 50), "wall_p99": percentile(walls, 99)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--programs", type=int, default=20)
    parser.add_argument("--asks", type=int, default=200)
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    add_record_flag(parser, RESULTS)
    args = parser.parse_args()
    require_build()
    where, at, gemtrace_commit = machine(), stamp(), commit()
    base = Path(tempfile.mkdtemp(prefix="gemtrace-attach-bench-"))
    base.chmod(0o755)
    rows = []
    try:
        for case in args.cases:
            tmp = base / case
            tmp.mkdir()
            (tmp / "sim").mkdir()
            config = tmp / "resource.conf"
            config.write_text(CONFIG)
            sim = SimGpu(tmp / "sim")
            try:
                f = measure(case, Host(sim, config, tmp / "state", tmp), args.programs, args.asks)
            finally:
                sim.close()
            rows.append((case, f))
            print(f"{case:>8}: root's programs gated {f['gated']}/{f['programs']}, asks unanswered "
                  f"{f['unanswered']}/{f['asks']}, attach p50 {f['ask_p50']:.2f} "
                  f"p99 {f['ask_p99']:.2f} ms, program p50 {f['wall_p50']:.0f} p99 {f['wall_p99']:.0f} ms", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    if not args.no_record:
        append_rows(RESULTS, HEADER, [
            f"| {at} | {where} | {gemtrace_commit} | {case} | {f['gated']} of {f['programs']} | {f['unanswered']} "
            f"of {f['asks']} | {f['ask_p50']:.2f} | {f['ask_p99']:.2f} | {f['wall_p50']:.0f} | {f['wall_p99']:.0f} |"
            for case, f in rows])
        print(f"appended to {RESULTS.relative_to(REPO)}")
    return 0 if all(f["gated"] == f["programs"] for _, f in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
