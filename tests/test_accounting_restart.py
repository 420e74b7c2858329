"""What survives the agent: limits after a restart (memory rebuilt from the gates' slots and NVML),
the gate's memory check while no agent frees dead processes' slots, and a group's processes never
given more GPU time together than the group got. A real `gemtrace agent` on a private simulated GPU
(tests/agent_host.py); gated clients through `gemtrace run`, ungated ones with GEMTRACE_GROUP only."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time

import pytest
from agent_host import Host, Running, stop
from prometheus_client.parser import text_string_to_metric_families
from simgpu_env import DRIVER_CLIENT, REPO, RT_CLIENT
from test_bpf_accounting import require_bcc
from testkit import MiB, wait_until

from gemtrace.contract import HEARTBEAT_STALE_NS
from gemtrace.metrics import POD_LABELS

GATE = REPO / "build" / "libgemgate.so"
CUDA_ERROR_OUT_OF_MEMORY = 2


def series(running: Running, name: str) -> dict[frozenset[tuple[str, str]], float]:
    """The samples of `name` by their labels, less the pod labels of a process outside any pod (empty)."""
    return {frozenset((k, v) for k, v in s.labels.items() if v or k not in POD_LABELS): s.value
            for f in text_string_to_metric_families(running.metrics()) for s in f.samples if s.name == name}


def ungated(host: Host, group: str, *args: str) -> subprocess.Popen[str]:
    """A client of `group` without the gate: only eBPF and NVML see it."""
    return subprocess.Popen([str(RT_CLIENT), *args], env=host.env(GEMTRACE_GROUP=group), stdout=subprocess.PIPE,
                            text=True)


def first_line(proc: subprocess.Popen) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    return line.decode() if isinstance(line, bytes) else line


def sigkill(agent: Running) -> None:
    agent.proc.send_signal(signal.SIGKILL)
    agent.proc.wait(timeout=60)


def wait_stale_heartbeat() -> None:
    time.sleep(HEARTBEAT_STALE_NS / 1e9 + 0.2)  # the gates now see no agent


@pytest.mark.bpf
def test_a_group_over_its_limit_while_the_agent_was_down_is_acted_on_after_the_restart(host: Host) -> None:
    require_bcc()
    agent = host.start_agent(ebpf=True)
    clients: list[subprocess.Popen] = []
    try:
        # train's MemoryLimit is 1 GiB: 600 MiB gated + 300 MiB ungated fit.
        gated = host.run("train", "alloc", "--api", "v2", str(600 * MiB), "--hold", "60")
        clients.append(gated)
        assert "CUDA_SUCCESS" in first_line(gated)
        early = ungated(host, "train", "alloc", "--api", "v2", str(300 * MiB), "--hold", "60")
        clients.append(early)
        assert "CUDA_SUCCESS" in first_line(early)
        time.sleep(0.5)
        assert gated.poll() is None and early.poll() is None
        sigkill(agent)
        # Nobody enforces now: an ungated client takes train to 1.4 GiB.
        late = ungated(host, "train", "alloc", "--api", "v2", str(500 * MiB), "--hold", "60")
        clients.append(late)
        assert "CUDA_SUCCESS" in first_line(late)
        time.sleep(0.3)
        assert late.poll() is None

        started = time.monotonic()
        agent = host.start_agent(ebpf=True)  # eBPF saw none of those allocations
        up = time.monotonic()
        late.wait(timeout=up - started + 2)  # acted on within 2 s of /metrics being up, at the latest
        killed = time.monotonic()
        assert late.returncode == -signal.SIGKILL
        # The newest process goes; the rest fit again, so nobody else dies.
        time.sleep(0.5)
        assert gated.poll() is None and early.poll() is None
        train = frozenset({("gpu", host.region().gpu_uuids()[0]), ("group", "train")})
        wait_until("train's rebuilt memory without the killed process",
                   lambda: series(agent, "gemtrace_group_memory_bytes").get(train) == 900 * MiB, timeout=5)
        kills = series(agent, "gemtrace_oom_kills_total")  # every defined group is exported, at 0 until its first
        assert {labels: n for labels, n in kills.items() if n} == {frozenset({("group", "train")}): 1.0}
        per_process = series(agent, "gemtrace_process_memory_bytes")
        by_pid = {dict(labels)["pid"]: v for labels, v in per_process.items()}
        assert by_pid[str(early.pid)] == 300 * MiB  # rebuilt from NVML (no context cost on the simulated GPU)
        assert by_pid[str(gated.pid)] == 600 * MiB  # rebuilt from its slot
        print(f"restart: agent start {up - started:.2f} s, kill {killed - started:.2f} s after it was started")
    finally:
        for c in clients:
            c.kill()
            c.wait()
        if agent.proc.poll() is None:
            stop(agent)


class Waiting:
    """A gated driver client (tests/cuda_driver_client.py) that allocates when told: attached, and so
    placed in its group by the agent, while the agent runs; allocating later, when it is gone (a gate
    that attaches with no agent counts as "default": only the agent decides groups)."""

    def __init__(self, host: Host, group: str) -> None:
        env = host.env(GEMTRACE_STATE_DIR=str(host.state_dir), GEMTRACE_GROUP=group, LD_PRELOAD=str(GATE))
        self.proc = subprocess.Popen([sys.executable, str(DRIVER_CLIENT)], env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.pid = json.loads(self._line())["pid"]

    def _line(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline()

    def call(self, command: str) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return int(json.loads(self._line())["result"])

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.mark.e2e
def test_while_the_agent_is_down_a_dead_process_slot_does_not_refuse_an_allocation_that_fits(host: Host) -> None:
    agent = host.start_agent()
    holders: list[subprocess.Popen] = []
    waiting: list[Waiting] = []
    try:
        dead = host.run("train", "alloc", "--api", "v2", str(700 * MiB), "--hold", "60")
        holders.append(dead)
        assert "CUDA_SUCCESS" in first_line(dead)
        fits, over = Waiting(host, "train"), Waiting(host, "train")
        waiting += [fits, over]
        for client in waiting:
            assert client.call("init") == 0 and client.call(f"alloc {MiB}") == 0  # attached, placed in train
        sigkill(agent)
        wait_stale_heartbeat()
        os.kill(dead.pid, signal.SIGKILL)
        dead.wait()  # reaped: its pid is gone, its slot stays (only the agent frees slots)
        region = host.region()
        assert dead.pid in region.slot_pids()

        assert fits.call(f"alloc {600 * MiB}") == 0  # 602 MiB of a 1 GiB limit: the dead slot is not charged
        assert dead.pid in region.slot_pids()  # skipped, not freed
        # A live slot still counts: no overshoot.
        assert over.call(f"alloc {500 * MiB}") == CUDA_ERROR_OUT_OF_MEMORY
        region.close()
    finally:
        for h in holders:
            h.kill()
            h.wait()
        for w in waiting:
            w.kill()


@pytest.mark.e2e
def test_a_groups_processes_together_never_get_more_gpu_time_than_the_group(host: Host) -> None:
    agent = host.start_agent()
    loops: list[subprocess.Popen[bytes]] = []
    try:
        # Each holds after its report: an exited process's series leave at the next poll.
        loops += [host.run("infer", "launch-loop", "--kernel-ns", "2000000", "--launches-per-iter", "5",
                           "--seconds", "4", "--hold", "30") for _ in range(3)]
        region = host.region()
        raw = 0.0  # the gates' own busy seconds, summed over the group's slots: what used to be exported
        truth: list[dict[str, float]] = []
        while len(truth) < len(loops):
            busy = sum(s.busy_ns[0] for _, s in region.live_slots() if s.pid in {p.pid for p in loops}) / 1e9
            raw = max(raw, busy)
            reported = select.select([loop.stdout for loop in loops], [], [], 0.1)[0]
            truth += [json.loads(out.readline()) for out in reported]  # type: ignore[union-attr]
        uuid = region.gpu_uuids()[0]
        infer = frozenset({("gpu", uuid), ("group", "infer")})
        # The group's figure when the work ended: it goes on growing while the idle processes hold it.
        worked = series(agent, "gemtrace_group_gpu_seconds_total")[infer]
        time.sleep(1.5)  # a poll after the last burst ended
        group = series(agent, "gemtrace_group_gpu_seconds_total")[infer]
        processes = {dict(labels)["pid"]: v for labels, v in series(agent, "gemtrace_process_gpu_seconds_total").items()
                     if dict(labels)["group"] == "infer"}
        kernels = sum(t["kernel_s"] for t in truth)
        print(f"time share: group {worked:.2f} s ({group:.2f} s later), processes {sorted(processes.values())} (sum "
              f"{sum(processes.values()):.2f} s), gates' raw sum {raw:.2f} s, kernels {kernels:.2f} s")
        assert set(processes) == {str(loop.pid) for loop in loops}
        assert all(v > 0 for v in processes.values()), processes
        assert sum(processes.values()) <= group * 1.02 + 0.01, (processes, group)
        assert raw > worked * 1.5  # the bursts did overlap: without the share the sum would be far above
        assert sum(processes.values()) >= 0.8 * kernels  # and the time is given out, not dropped
        region.close()
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()
        stop(agent)
