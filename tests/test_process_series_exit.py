"""End to end on the simulated GPU: a killed process's series leave the real agent's /metrics within
2 s, for 50 gated processes killed at once (the 100-pod bench found them exported long after)."""

from __future__ import annotations

import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from agent_host import Host, stop
from simgpu_env import RT_CLIENT
from testkit import MiB, wait_until

pytestmark = pytest.mark.e2e

GATE = Path(__file__).resolve().parents[1] / "build" / "libgemgate.so"
CLIENTS = 50


def exported_pids(metrics: str) -> set[int]:
    """The pids of every gemtrace_process_memory_bytes series."""
    return {int(pid) for pid in re.findall(r'^gemtrace_process_memory_bytes\{[^}]*pid="(\d+)"', metrics, re.M)}


def test_killed_processes_series_leave_metrics_within_2_s(host: Host) -> None:
    agent = host.start_agent()
    clients: list[subprocess.Popen[bytes]] = []
    try:
        env = host.env(LD_PRELOAD=str(GATE), GEMTRACE_STATE_DIR=str(host.state_dir))
        for i in range(CLIENTS):
            env["GEMTRACE_GROUP"] = ("train", "infer", "default")[i % 3]
            clients.append(subprocess.Popen([str(RT_CLIENT), "alloc", "--api", "v2", str(16 * MiB), "--hold", "120"],
                                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        pids = {c.pid for c in clients}
        wait_until(f"the {CLIENTS} processes' series", lambda: pids <= exported_pids(agent.metrics()), timeout=120)
        for c in clients:
            c.send_signal(signal.SIGKILL)
        for c in clients:
            c.wait()
        killed = time.monotonic()
        wait_until("their series to leave /metrics", lambda: not pids & exported_pids(agent.metrics()), timeout=30)
        took = time.monotonic() - killed
        assert took < 2, f"the killed processes' series stayed {took:.1f} s"
    finally:
        for c in clients:
            c.kill()
            c.wait()
        stop(agent)
