"""What garbage on the attach socket does to the agent's log (issue 25): `gemtrace agent` on the
simulated GPU while `--senders` processes send malformed requests back to back for `--seconds`,
each on a connection of its own, reading every answer. Per agent tree: the requests answered, the
log lines and bytes the flood produced, and the dropped count the agent's summaries give (every
sender runs as the bench's own user, so one uid's budget: gemtrace/eventlog.py).

`--agent-tree NAME=DIR` adds the agent from DIR/gemtrace (a `git archive` of a commit before the
limiter, with the checkout's generated gemtrace/contract.py copied in), run the same way.

    sudo .venv/bin/python -m bench.bench_log_flood [--senders 6] [--seconds 10] [--agent-tree NAME=DIR]
        [--no-record]
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
from pathlib import Path

from simgpu_env import SimGpu, require_build
from testkit import free_port

from bench.bench_agent_cpu import serving
from bench.recording import REPO, add_record_flag, add_tree_flag, record, trees
from gemtrace.contract import ATTACH_SOCKET

RESULTS = REPO / "bench" / "results" / "log_flood.md"

# One sender: malformed requests until the deadline; prints how many were answered.
SENDER = r"""
import socket, sys, time
deadline, answered = time.monotonic() + float(sys.argv[2]), 0
while time.monotonic() < deadline:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            s.settimeout(2)
            s.connect(sys.argv[1])
            s.send(b"not a request")
            answered += bool(s.recv(4096))
    except OSError:
        pass
print(answered)
"""


def run(tmp: Path, tree: Path | None, senders: int, seconds: float) -> dict[str, float]:
    sim = SimGpu(tmp / "sim")
    config = tmp / "resource.conf"
    config.write_text("[train]\nMaxUtil = 0.5\n")
    state = tmp / "state"
    env = sim.env()
    env["PYTHONPATH"] = str(tree or REPO) + os.pathsep + str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    port = free_port()
    log_path = tmp / "agent.log"
    with log_path.open("wb") as log:
        agent = subprocess.Popen([sys.executable, "-m", "gemtrace.cli", "agent", "--config", str(config),
                                  "--state-dir", str(state), "--listen", f"127.0.0.1:{port}", "--no-ebpf"],
                                 env=env, stdout=subprocess.DEVNULL, stderr=log, cwd=tmp)
        try:
            serving(agent, port, log_path)
            before = log_path.stat().st_size, len(log_path.read_bytes().splitlines())
            procs = [subprocess.Popen([sys.executable, "-c", SENDER, str(state / ATTACH_SOCKET), str(seconds)],
                                      stdout=subprocess.PIPE, text=True) for _ in range(senders)]
            answered = sum(int(p.communicate()[0] or 0) for p in procs)
            time.sleep(11)  # the last summary (SUMMARY_SECONDS after the flood's last drop)
        finally:
            agent.send_signal(signal.SIGTERM)
            agent.wait(timeout=60)
    lines = log_path.read_bytes().splitlines()
    events = [json.loads(line) for line in lines[before[1]:] if line.startswith(b"{")]
    return {"answered": answered, "lines": len(lines) - before[1], "bytes": log_path.stat().st_size - before[0],
            "refused_lines": sum(e["event"] == "slot_request_refused" for e in events),
            "dropped": sum(e.get("dropped", 0) for e in events if e["event"] == "log_lines_dropped")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--senders", type=int, default=6)
    ap.add_argument("--seconds", type=float, default=10.0)
    add_tree_flag(ap, "the agent")
    add_record_flag(ap, RESULTS)
    args = ap.parse_args()
    require_build()
    side_by_side = trees(args.tree)
    rows = []
    for code, tree in side_by_side:
        with tempfile.TemporaryDirectory(prefix="gemtrace-flood-") as tmp:
            r = run(Path(tmp), tree, args.senders, args.seconds)
        rows.append(f"| {code} | {r['answered']:.0f} | {r['lines']:.0f} | {r['bytes'] / 1e3:.1f} | "
                    f"{r['refused_lines']:.0f} | {r['dropped']:.0f} |")
        print(rows[-1], flush=True)
    text = "\n".join([
        f"{args.senders} senders of malformed requests for {args.seconds:g} s, one uid; the log counted from the "
        "flood's start to 11 s after its end",
        "",
        "| agent | requests answered | log lines | log kB | slot_request_refused lines | dropped (summaries) |",
        "| --- | --- | --- | --- | --- | --- |",
        *rows])
    print(text)
    if not args.no_record:
        record(RESULTS, "Garbage on the attach socket against the agent's log, simulated GPU "
               "(bench/bench_log_flood.py)", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
