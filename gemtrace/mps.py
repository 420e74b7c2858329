"""NVIDIA MPS for the groups with Isolation=mps (docs/mps.md): one MPS control daemon per GPU that such
a group may use, and the variables its clients are given.

Owns the daemons' lifecycle (the agent starts one when a GPU first needs it and stops them all at its
stop), where each lives under the state dir (mps/<uuid>/pipe and mps/<uuid>/log: never the host's
default /tmp/nvidia-mps, which another MPS user may own), the file through which `gemtrace run` learns
an mps group's client variables (mps/<uuid>/clients.json, written by the agent from the resource file
in force, as the region carries the other settings), and those variables (pure functions).

It never decides who is scheduled: the agent leaves an mps group out of a GPU's scheduler only where a
daemon of this module serves that GPU. A missing or failing nvidia-cuda-mps-control is one error event
per GPU; that GPU's groups keep time slicing, and the agent keeps running.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import structlog

from gemtrace import defaults
from gemtrace.config import ISOLATION_MPS, GroupConfig
from gemtrace.groups_of import ENV_VISIBLE_DEVICES, visible_devices

log = structlog.get_logger("gemtrace.mps")

CONTROL = defaults.MPS_CONTROL  # found through PATH unless the agent is given another (--mps-control)
ENV_PIPE = "CUDA_MPS_PIPE_DIRECTORY"
ENV_LOG = "CUDA_MPS_LOG_DIRECTORY"
ENV_THREADS = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
ENV_MEMORY = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
# An opportunistic mps group's clients start at MPS's low client priority: the GPU runs the other
# clients' kernels first (NVIDIA's MPS guide, environment variables, CUDA_MPS_CLIENT_PRIORITY: 0 normal,
# the default, and 1 below normal).
ENV_PRIORITY = "CUDA_MPS_CLIENT_PRIORITY"
PRIORITY_BELOW_NORMAL = "1"
CONTROL_PIPE = "control"  # the daemon's named pipe in its pipe directory: there while it runs
CLIENTS_FILE = "clients.json"
# `-d` returns once the daemon has forked, `quit` once the command is written: seconds are a hang.
COMMAND_SECONDS = 10.0
MiB = 1 << 20


def gpu_dir(state_dir: Path, uuid: str) -> Path:
    return state_dir / "mps" / uuid


def pipe_dir(state_dir: Path, uuid: str) -> Path:
    return gpu_dir(state_dir, uuid) / "pipe"


def mps_groups(groups: Iterable[GroupConfig], uuid: str) -> list[GroupConfig]:
    """The groups with Isolation=mps that may run on GPU `uuid` (a group without Gpus: on every GPU)."""
    return [g for g in groups if g.isolation == ISOLATION_MPS and (not g.gpus or uuid in g.gpus)]


def thread_percentage(group: GroupConfig, others: Iterable[GroupConfig]) -> int | None:
    """CUDA_MPS_ACTIVE_THREAD_PERCENTAGE for `group`'s clients beside the other mps groups `others`
    of the GPU: its MaxUtil, and no more than the MinUtils of the others leave (MPS only caps, so a
    guarantee is kept by capping everyone else). Rounded down, at least 1; None: no cap (100%)."""
    share = min(group.max_util, 1.0 - math.fsum(g.min_util for g in others if g.name != group.name))
    if share >= 1.0 - 1e-9:
        return None
    return max(1, math.floor(share * 100 + 1e-9))


def pinned_memory_limit(limit: int | None) -> str | None:
    """CUDA_MPS_PINNED_DEVICE_MEM_LIMIT for a MemoryLimit: device 0 (the daemon sees its one GPU only)
    in whole MiB, rounded down, so that it is within the limit whether MPS reads M as 2**20 or 10**6."""
    if limit is None:
        return None
    return f"0={max(1, limit // MiB)}M"


def client_variables(groups: Iterable[GroupConfig], uuid: str) -> dict[str, dict[str, str]]:
    """Each mps group's client variables on GPU `uuid` (what clients.json holds)."""
    on_gpu = mps_groups(groups, uuid)
    out: dict[str, dict[str, str]] = {}
    for g in on_gpu:
        variables: dict[str, str] = {}
        threads = thread_percentage(g, on_gpu)
        if threads is not None:
            variables[ENV_THREADS] = str(threads)
        memory = pinned_memory_limit(g.memory_limit)
        if memory is not None:
            variables[ENV_MEMORY] = memory
        if g.opportunistic:
            variables[ENV_PRIORITY] = PRIORITY_BELOW_NORMAL
        out[g.name] = variables
    return out


def client_environment(state_dir: Path, group: str, gpus: Sequence[str], environ: Mapping[str, str]) -> dict[str, str]:
    """The variables to add for a `gemtrace run` in `group`, whose GPUs in physical order are `gpus`
    (UUIDs, as the agent's region lists them): empty unless the group is an mps group on the first GPU
    the command sees and that GPU's daemon runs. A variable the user set is never replaced (a
    CUDA_MPS_PIPE_DIRECTORY of their own names another daemon, which is theirs to choose)."""
    seen = visible_devices(environ.get(ENV_VISIBLE_DEVICES), list(gpus))
    if not seen:
        return {}
    uuid = seen[0]
    pipe = pipe_dir(state_dir, uuid)
    try:
        clients = json.loads((gpu_dir(state_dir, uuid) / CLIENTS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    if group not in clients or not (pipe / CONTROL_PIPE).exists():
        return {}
    wanted = {ENV_PIPE: str(pipe), **clients[group]}
    return {name: value for name, value in wanted.items() if name not in environ}


class MpsDaemons:
    """The MPS control daemons of the agent in `state_dir`, one per GPU that asks for one. `control`
    is the nvidia-cuda-mps-control program (a name looked up in PATH, or a path)."""

    def __init__(self, state_dir: Path, control: str = CONTROL, environ: Mapping[str, str] = os.environ) -> None:
        self.state_dir = state_dir
        self.control = control
        self._environ = dict(environ)
        self._running: dict[str, dict[str, str]] = {}  # uuid -> the daemon's environment
        self._failed: set[str] = set()  # GPUs whose start failed: said once, not retried at every reload

    @property
    def running(self) -> frozenset[str]:
        return frozenset(self._running)

    def _environment(self, uuid: str) -> dict[str, str]:
        env = {k: v for k, v in self._environ.items() if k not in ("LD_PRELOAD", ENV_PIPE, ENV_LOG)}
        env[ENV_VISIBLE_DEVICES] = uuid
        env[ENV_PIPE] = str(pipe_dir(self.state_dir, uuid))
        env[ENV_LOG] = str(gpu_dir(self.state_dir, uuid) / "log")
        return env

    def ensure(self, uuids: Iterable[str]) -> frozenset[str]:
        """Start a daemon on each GPU of `uuids` that has none (nor failed to start one); returns the
        GPUs a daemon serves. A daemon no longer needed keeps running until stop(): its clients may
        still be there."""
        for uuid in uuids:
            if uuid in self._running or uuid in self._failed:
                continue
            program = shutil.which(self.control)
            if program is None:
                self._failed.add(uuid)
                log.error("mps_control_missing", gpu=uuid, program=self.control,
                          consequence="groups with Isolation=mps are time-sliced on this GPU; install the NVIDIA "
                          "driver's nvidia-cuda-mps-control (or give its path with --mps-control) and restart the "
                          "agent")
                continue
            env = self._environment(uuid)
            for key in (ENV_PIPE, ENV_LOG):
                Path(env[key]).mkdir(parents=True, exist_ok=True)
                # The clients of every user reach the pipe directory; the daemon sets its pipes' own modes.
                os.chmod(env[key], 0o755)
            try:
                done = subprocess.run([program, "-d"], env=env, stdin=subprocess.DEVNULL, capture_output=True,
                                      timeout=COMMAND_SECONDS, check=False)
                error = None if done.returncode == 0 else (
                    f"exit status {done.returncode}: {(done.stdout + done.stderr).decode(errors='replace').strip()}")
            except (OSError, subprocess.TimeoutExpired) as e:
                error = str(e)
            if error is not None:
                self._failed.add(uuid)
                log.error("mps_daemon_start_failed", gpu=uuid, program=program, error=error,
                          log_dir=env[ENV_LOG], consequence="groups with Isolation=mps are time-sliced on this GPU")
                continue
            self._running[uuid] = env
            log.info("mps_daemon_started", gpu=uuid, pipe_dir=env[ENV_PIPE], log_dir=env[ENV_LOG])
        return self.running

    def publish(self, groups: Iterable[GroupConfig]) -> None:
        """Write each served GPU's clients.json (replaced whole: a reader never sees half of one)."""
        groups = list(groups)
        for uuid in self._running:
            path = gpu_dir(self.state_dir, uuid) / CLIENTS_FILE
            part = path.with_suffix(".tmp")
            part.write_text(json.dumps(client_variables(groups, uuid), sort_keys=True) + "\n")
            os.chmod(part, 0o644)
            os.replace(part, path)

    def stop(self) -> None:
        """Ask every daemon to quit: it stops taking new clients and ends when its clients have (a
        running program is never cut off by the agent's stop). New `gemtrace run`s stop finding it."""
        for uuid, env in list(self._running.items()):
            (gpu_dir(self.state_dir, uuid) / CLIENTS_FILE).unlink(missing_ok=True)
            program = shutil.which(self.control) or self.control
            try:
                done = subprocess.run([program], env=env, input=b"quit\n", capture_output=True,
                                      timeout=COMMAND_SECONDS, check=False)
                error = None if done.returncode == 0 else f"exit status {done.returncode}"
            except (OSError, subprocess.TimeoutExpired) as e:
                error = str(e)
            if error is None:
                log.info("mps_daemon_stopped", gpu=uuid)
            else:
                log.error("mps_daemon_stop_failed", gpu=uuid, error=error)
            del self._running[uuid]
