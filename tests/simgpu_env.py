"""The simulated GPU for tests: where it is built, the environment that selects it, and its clients.

Owns the test-side view of build/simgpu (built by `make simgpu`; sources in simgpu/ and
simgpu/clients/). Never builds anything itself: a missing build fails the test with the command to run.

API (`from simgpu_env import ...`; the fixtures come to every test module through tests/conftest.py):
  SIMGPU_DIR, LIBCUDA, LIBNVML, RT_CLIENT, LINKED_CLIENT   paths under build/simgpu
  DRIVER_CLIENT   tests/cuda_driver_client.py: a Python client calling libcuda's entry points through
      ctypes, one command a line on stdin (its opening comment lists them)
  simgpu_env(state_dir, devices=1, memory="16GiB", **extra) -> dict   a full environment for a child
      process: LD_LIBRARY_PATH first names build/simgpu, SIMGPU_STATE_DIR is `state_dir`;
      extra keys are added as they are (CUDA_VISIBLE_DEVICES="1", SIMGPU_QUEUE_DEPTH="4", ...).
  run_client(args, env, client=RT_CLIENT, timeout=60) -> list[dict]   runs a client to its end and
      returns its JSON lines; raises ClientError on a non-zero exit.
  last_line(proc, timeout) -> dict   the last JSON line of a client started elsewhere (`gemtrace run`,
      host.run) with its stdout piped, once it exited 0; fails the test with its output otherwise.
  Client(args, env, client=RT_CLIENT)   a running client: .next_json(timeout) waits for its next
      JSON line, .wait_for(key) for the first line holding `key`, .kill(), .finish() -> lines.
  run_nvml(code, env) -> list[dict]   runs Python `code` in a child with pynvml loaded and
      initialised against the simulation (pynvml binds the library once per process, so NVML views
      of different simulations need a process each); `emit(obj)` in `code` prints a JSON line.
  simgpu (fixture) -> SimGpu   a private simulation in a temporary state dir: .env(**extra),
      .run(args, client=..., **extra), .start(args, client=..., **extra), .nvml(code, **extra);
      `devices` and `memory` come from its attributes (set them before the first call, or use
      the `simgpu_factory` fixture: simgpu_factory(devices=2, memory="4GiB")).
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
SIMGPU_DIR = REPO / "build" / "simgpu"
LIBCUDA = SIMGPU_DIR / "libcuda.so.1"
LIBNVML = SIMGPU_DIR / "libnvidia-ml.so.1"
RT_CLIENT = SIMGPU_DIR / "simgpu-rt"
LINKED_CLIENT = SIMGPU_DIR / "simgpu-linked"
DRIVER_CLIENT = REPO / "tests" / "cuda_driver_client.py"



class ClientError(RuntimeError):
    """A client exited with a non-zero status; the message holds its output."""


def require_build() -> None:
    missing = [p for p in (LIBCUDA, LIBNVML, RT_CLIENT, LINKED_CLIENT) if not p.exists()]
    if missing:
        pytest.fail(f"{missing[0]} is missing: run `make simgpu` first", pytrace=False)


def simgpu_env(
    state_dir: Path | str,
    devices: int = 1,
    memory: str | int = "16GiB",
    base: Mapping[str, str] | None = None,
    **extra: str,
) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    for key in ("CUDA_VISIBLE_DEVICES", "SIMGPU_QUEUE_DEPTH", "SIMGPU_TOPOLOGY", "LD_PRELOAD"):
        env.pop(key, None)  # the caller's own settings must not leak into a simulation
    previous = env.get("LD_LIBRARY_PATH")
    env["LD_LIBRARY_PATH"] = str(SIMGPU_DIR) + (f":{previous}" if previous else "")
    env["SIMGPU_STATE_DIR"] = str(state_dir)
    env["SIMGPU_DEVICES"] = str(devices)
    env["SIMGPU_MEMORY"] = str(memory)
    env.update(extra)
    return env


def _parse(lines: Sequence[str]) -> list[dict[str, Any]]:
    return [json.loads(line) for line in lines if line.startswith("{")]


def run_client(
    args: Sequence[str], env: Mapping[str, str], client: Path = RT_CLIENT, timeout: float = 60
) -> list[dict[str, Any]]:
    proc = subprocess.run(
        [str(client), *args], env=dict(env), capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0:
        raise ClientError(
            f"{client.name} {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}{proc.stderr}"
        )
    return _parse(proc.stdout.splitlines())


def last_line(proc: subprocess.Popen[bytes], timeout: float) -> dict[str, Any]:
    out, err = proc.communicate(timeout=timeout)
    lines = _parse(out.decode().splitlines())
    assert proc.returncode == 0 and lines, (out.decode(), (err or b"").decode()[-2000:])
    return lines[-1]


class Client:
    """A client running in the background whose JSON lines can be awaited one by one."""

    def __init__(self, args: Sequence[str], env: Mapping[str, str], client: Path = RT_CLIENT) -> None:
        self.args = [str(client), *args]
        self.proc = subprocess.Popen(
            self.args, env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.pid = self.proc.pid
        self.lines: list[dict[str, Any]] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._stderr_lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        # Drained all along: a client blocked on a full stderr pipe would look like a hang.
        self._stderr_reader = threading.Thread(target=self._read_stderr, daemon=True)
        self._stderr_reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._queue.put(line)
        self._queue.put(None)

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._stderr_lines.append(line)

    def next_json(self, timeout: float = 30) -> dict[str, Any]:
        while True:
            try:
                line = self._queue.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"{self.args} printed nothing in {timeout} s") from None
            if line is None:
                raise ClientError(f"{self.args} ended (status {self.proc.wait()}): {self._stderr()}")
            if line.startswith("{"):
                obj: dict[str, Any] = json.loads(line)
                self.lines.append(obj)
                return obj

    def wait_for(self, key: str, timeout: float = 30) -> dict[str, Any]:
        while True:
            obj = self.next_json(timeout)
            if key in obj:
                return obj

    def _stderr(self) -> str:
        self._stderr_reader.join(timeout=5)  # the process has ended: its stderr is closing
        return "".join(self._stderr_lines)

    def kill(self) -> int:
        self.proc.kill()
        return self.proc.wait()

    def finish(self, timeout: float = 60) -> list[dict[str, Any]]:
        status = self.proc.wait(timeout=timeout)
        while True:
            try:
                line = self._queue.get(timeout=timeout)
            except queue.Empty:
                break
            if line is None:
                break
            if line.startswith("{"):
                self.lines.append(json.loads(line))
        if status != 0:
            raise ClientError(f"{self.args} exited {status}: {self._stderr()}")
        return self.lines


_NVML_PRELUDE = """
import json, sys
import pynvml
def emit(obj):
    print(json.dumps(obj), flush=True)
pynvml.nvmlInit()
"""


def run_nvml(code: str, env: Mapping[str, str], timeout: float = 60) -> list[dict[str, Any]]:
    proc = subprocess.run(
        [sys.executable, "-c", _NVML_PRELUDE + code],
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise ClientError(f"pynvml script failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
    return _parse(proc.stdout.splitlines())


class SimGpu:
    """One private simulation: a state dir and the settings every process of it must share."""

    def __init__(self, state_dir: Path, devices: int = 1, memory: str | int = "16GiB") -> None:
        self.state_dir = state_dir
        self.devices = devices
        self.memory = memory
        self._clients: list[Client] = []

    def env(self, **extra: str) -> dict[str, str]:
        env = simgpu_env(self.state_dir, self.devices, self.memory)
        env.update(extra)
        return env

    def run(self, args: Sequence[str], client: Path = RT_CLIENT, **extra: str) -> list[dict[str, Any]]:
        return run_client(args, self.env(**extra), client)

    def start(self, args: Sequence[str], client: Path = RT_CLIENT, **extra: str) -> Client:
        c = Client(args, self.env(**extra), client)
        self._clients.append(c)
        return c

    def nvml(self, code: str, **extra: str) -> list[dict[str, Any]]:
        return run_nvml(code, self.env(**extra))

    def close(self) -> None:
        for c in self._clients:
            if c.proc.poll() is None:
                c.kill()


@pytest.fixture
def simgpu_factory(tmp_path: Path) -> Iterator[Callable[..., SimGpu]]:
    require_build()
    made: list[SimGpu] = []

    def make(devices: int = 1, memory: str | int = "16GiB") -> SimGpu:
        sim = SimGpu(tmp_path / f"simgpu-{len(made)}", devices, memory)
        made.append(sim)
        return sim

    yield make
    for sim in made:
        sim.close()


@pytest.fixture
def simgpu(simgpu_factory: Callable[..., SimGpu]) -> SimGpu:
    return simgpu_factory()
