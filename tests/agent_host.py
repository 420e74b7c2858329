"""A host for end-to-end tests: a real `gemtrace agent` process on a private simulated GPU, and
`gemtrace run` for its clients. The `host` fixture comes to every test module through conftest.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import psutil
import pytest
from simgpu_env import REPO, RT_CLIENT, SimGpu
from testkit import free_port, wait_until

from gemtrace import region as rg

T = TypeVar("T")

CONFIG = "[train]\nMinUtil = 0.2\nMaxUtil = 0.8\nMemoryLimit = 1GiB\n\n[infer]\nMaxUtil = 0.5\n"


def gemtrace(*args: str) -> list[str]:
    return [sys.executable, "-m", "gemtrace.cli", *args]


@dataclass
class Running:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url, timeout=5) as r:
            return str(r.read().decode())

    def cpu_share(self, action: Callable[[], T]) -> tuple[float, T]:
        """The agent's CPU (user and system, as a share of one core) while `action` runs, and what it
        returned."""
        agent = psutil.Process(self.proc.pid)
        before, began = sum(agent.cpu_times()[:2]), time.monotonic()
        result = action()
        return (sum(agent.cpu_times()[:2]) - before) / (time.monotonic() - began), result


@dataclass
class Host:
    sim: SimGpu
    config: Path
    state_dir: Path
    tmp: Path

    def env(self, **extra: str) -> dict[str, str]:
        env = self.sim.env(**extra)
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        return env

    def start_agent(self, *options: str, ebpf: bool = False, tree: Path | None = None) -> Running:
        """Start `gemtrace agent` on this host; `options` are more of its command-line options, `ebpf`:
        with the eBPF accounting and enforcement (needs root and bcc); `tree`: the agent's code from
        TREE/gemtrace (another commit's, for a bench side by side) rather than this checkout's."""
        env = self.env()
        if tree is not None:
            env["PYTHONPATH"] = str(tree) + os.pathsep + env["PYTHONPATH"]
        port = free_port()
        log = self.tmp / f"agent-{port}.log"
        proc = subprocess.Popen(
            gemtrace(
                "agent",
                "--config",
                str(self.config),
                "--state-dir",
                str(self.state_dir),
                "--listen",
                f"127.0.0.1:{port}",
                *(() if ebpf else ("--no-ebpf",)),
                *options,
            ),
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=log.open("wb"),
            cwd=self.tmp if tree is not None else None,  # (`python -m` puts the working directory first)
        )
        running = Running(proc, f"http://127.0.0.1:{port}/metrics", log)

        def up() -> bool:
            assert proc.poll() is None, log.read_text()
            try:
                return "gemtrace_agent_info" in running.metrics()
            except OSError:
                return False

        # A wait, not a figure: the agent answers within a second or two alone (bcc's compile adds a few
        # with eBPF), and took over 20 s beside CPU hogs on both cores.
        wait_until("the agent's /metrics", up, timeout=60)
        return running

    def run(self, group: str, *args: str, env: dict[str, str] | None = None, **popen: Any) -> subprocess.Popen[bytes]:
        """`gemtrace run` of the simulated GPU's client in `group`; `env`: more variables for it."""
        return subprocess.Popen(
            gemtrace(
                "run",
                "--group",
                group,
                "--config",
                str(self.config),
                "--state-dir",
                str(self.state_dir),
                "--",
                str(RT_CLIENT),
                *args,
            ),
            env=self.env(**(env or {})),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            **popen,
        )

    def run_ungated(self, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """The simulated GPU's client with no gemtrace at all (no agent's word, no gate): the driver's own
        sharing, for a figure to set gemtrace's beside."""
        return subprocess.Popen([str(RT_CLIENT), *args], env=self.env(**(env or {})),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def region(self) -> rg.Region:
        return rg.Region.open(self.state_dir)

    def busy_groups(self, *groups: str, seconds: float = 600) -> list[subprocess.Popen[bytes]]:
        """A gated launch loop of 2 ms kernels in each of `groups` for `seconds`, once each is
        launching (its slot counts launches on GPU 0); the caller kills them."""
        gate = REPO / "build" / "libgemgate.so"
        loops = [subprocess.Popen([str(RT_CLIENT), "launch-loop", "--kernel-ns", "2000000", "--seconds", str(seconds)],
                                  env=self.env(GEMTRACE_STATE_DIR=str(self.state_dir), GEMTRACE_GROUP=group,
                                               LD_PRELOAD=str(gate)), stdout=subprocess.DEVNULL)
                 for group in groups]
        r = self.region()
        try:
            wait_until("each group launching", lambda: {s.pid for _, s in r.live_slots() if s.launches[0]}
                       >= {loop.pid for loop in loops}, timeout=30)
        except BaseException:
            for loop in loops:
                loop.kill()
            raise
        finally:
            r.close()
        return loops


@pytest.fixture
def host(simgpu: SimGpu, tmp_path: Path) -> Iterator[Host]:
    config = tmp_path / "resource.conf"
    config.write_text(CONFIG)
    yield Host(simgpu, config, tmp_path / "state", tmp_path)


def stop(running: Running) -> int:
    running.proc.send_signal(signal.SIGTERM)
    try:
        return running.proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        running.proc.send_signal(signal.SIGUSR1)  # the agent's threads' stacks, into its log
        time.sleep(1)
        running.proc.kill()
        log = running.log.read_text()
        raise AssertionError(f"the agent did not stop within 20 s of SIGTERM; its log:\n{log}") from None


