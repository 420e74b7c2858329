"""Gated processes blocked on one held word, then one release: the rig shared by tests/test_gate.py's
wake-tree tests and bench/bench_release_wake.py (issue 13).

It stands in for the agent as tests/test_gate.py does (a Region in a private state dir, the simulated
GPUs' UUIDs, a heartbeat thread that also decides new processes' groups with gemtrace/agent/membership.py),
and starts N `simgpu-rt launch-per-line` clients with the real gate (build/libgemgate.so) preloaded:
each reaches the simulated driver as the CUDA runtime does, makes one launch per line it reads, and
prints CLOCK_MONOTONIC when that launch returned. A round holds the group's word on GPU 0, asks every
client for a launch, waits until every one sleeps in the gate's hold(), releases the word and reads
when each launch returned.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from simgpu_env import REPO, RT_CLIENT, simgpu_env

from gemtrace.agent.membership import Membership
from gemtrace.region import WAKE_FANOUT, Region

GATE = REPO / "build" / "libgemgate.so"
GROUP = "waiters"
GPU = 0
# Between the last waiter counted in `waiting` and the release: the gate counts itself before its
# futex wait, so a thread may still be on its way into the kernel.
SETTLE_S = 0.005


@dataclass(frozen=True)
class Round:
    """One release: when it started (CLOCK_MONOTONIC ns), how long the agent's release call took
    (wall clock, and the CPU time of its thread: the woken may take the thread's CPU meanwhile), and
    when each waiter's launch returned."""

    released_ns: int
    wake_call_ns: int
    wake_cpu_ns: int
    returned_ns: tuple[int, ...]

    @property
    def last_resume_ns(self) -> int:
        return max(self.returned_ns) - self.released_ns


class Waiters:
    """`n` gated clients of one group, each making one launch per round."""

    def __init__(self, region: Region, env: dict[str, str], n: int) -> None:
        self.region = region
        self.group = region.set_group(GROUP, None, 0, 1)
        region.release(GPU, self.group)
        self.procs = [
            subprocess.Popen([str(RT_CLIENT), "launch-per-line", "--kernel-ns", "1000"], env=env, text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            for _ in range(n)
        ]
        self.pids = {p.pid for p in self.procs}
        for proc in self.procs:
            self._line(proc, "ready")

    @staticmethod
    def _line(proc: subprocess.Popen[str], key: str) -> int:
        assert proc.stdout is not None
        while True:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"simgpu-rt launch-per-line (pid {proc.pid}) ended with status {proc.wait()}")
            if line.startswith("{"):
                obj = json.loads(line)
                if key in obj:
                    return int(obj.get("returned_ns", 0))

    def waiting(self) -> int:
        """How many of the clients sleep on the word (their slots' `waiting`)."""
        return sum(slot.waiting[GPU] for _, slot in self.region.live_slots() if slot.pid in self.pids)

    def pin(self, cpu: int) -> None:
        """Run every client on `cpu` alone: woken, they take turns there, and the wake tree runs slower
        than a thread on another CPU."""
        for proc in self.procs:
            os.sched_setaffinity(proc.pid, {cpu})

    def launched(self) -> int:
        """How many launches of the clients the gate has let through, in all."""
        return sum(slot.launches[GPU] for _, slot in self.region.live_slots() if slot.pid in self.pids)

    def block(self, timeout: float = 30) -> None:
        """Hold the word, ask every client for a launch, and return once every one waits in hold()."""
        self.region.hold(GPU, self.group)
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.write("\n")
            proc.stdin.flush()
        deadline = time.monotonic() + timeout
        while (count := self.waiting()) < len(self.procs):
            if time.monotonic() > deadline:
                raise AssertionError(f"{count} of {len(self.procs)} launches were held after {timeout} s")
            time.sleep(0.0005)
        time.sleep(SETTLE_S)

    def release(self, wake: int = WAKE_FANOUT) -> None:
        self.region.release(GPU, self.group, wake=wake)

    def resumed(self) -> tuple[int, ...]:
        """When each client's launch returned (CLOCK_MONOTONIC ns), waiting for every one."""
        return tuple(self._line(proc, "returned_ns") for proc in self.procs)

    def round(self, wake: int = WAKE_FANOUT) -> Round:
        """Block every client, release with `wake` woken by the agent itself, and time it."""
        self.block()
        cpu = time.thread_time_ns()
        released = time.monotonic_ns()
        self.release(wake)
        wake_call = time.monotonic_ns() - released
        wake_cpu = time.thread_time_ns() - cpu
        return Round(released, wake_call, wake_cpu, self.resumed())

    def close(self) -> None:
        self.region.release(GPU, self.group)
        for proc in self.procs:
            if proc.stdin is not None:
                proc.stdin.close()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()


@contextmanager
def agent_stand_in(state_dir: Path, sim_dir: Path) -> Iterator[tuple[Region, dict[str, str]]]:
    """A region with the simulated GPU published, a heartbeat and membership thread, and the gated
    environment of the group's clients."""
    base = simgpu_env(sim_dir)
    devices = json.loads(subprocess.run([str(RT_CLIENT), "devices"], env=base, capture_output=True, text=True,
                                        check=True).stdout.splitlines()[-1])["devices"]
    region = Region.create(state_dir)
    region.set_gpus([(d["uuid"], d["total"]) for d in devices])
    region.set_group("default", None, 0, 1)  # the agent always defines it
    membership = Membership(region, lambda: {})
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(0.002):
            region.heartbeat(time.monotonic_ns())
            membership.tick()

    region.heartbeat(time.monotonic_ns())
    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield region, dict(base, LD_PRELOAD=str(GATE), GEMTRACE_STATE_DIR=str(state_dir), GEMTRACE_GROUP=GROUP)
    finally:
        stop.set()
        thread.join()
        region.stop()
        region.close()
