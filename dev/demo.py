"""`make demo`: the agent at work on the simulated GPU, three groups sharing it.

Starts `gemtrace agent` on the simulated GPU (simgpu/, built into build/simgpu: a libcuda whose kernels take
the time they are told, and an NVML) with examples/resource.conf, starts each group's workload with
`gemtrace run`, and prints a frame of the groups every second (what `gemtrace top` shows), so the
shares can be watched being held: train is capped at 30%, infer may take up to 70%, notebook takes
what is left and holds memory under its 2 GiB limit. Plain text frames, one after the other: it
needs no terminal (`make demo | less`, CI). Everything runs in a temporary directory and is stopped
at the end; the agent's log is kept and its path printed.

The demo's agent probes only the simulated libcuda (GEMTRACE_PROBE_LIBCUDA): it must neither show
nor, with its MemoryLimit, kill the host's other programs. With bcc able to run (root, python3-bpfcc,
the running kernel's headers) the memory figures come from eBPF; otherwise one line says what is
missing and the gates and NVML still count. On a host with a real NVIDIA GPU it prints how to run
the real thing instead.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gemtrace import top
from gemtrace.agent.agent import ENV_PROBE_LIBCUDA

REPO = Path(__file__).resolve().parent.parent
SIMGPU = REPO / "build" / "simgpu"
CONFIG = REPO / "examples" / "resource.conf"
TITLE = "gemtrace demo"
# The first start compiles the eBPF probes (seconds of clang), slower on a busy machine; a healthy agent
# answers well within this and the demo goes on as soon as it does.
AGENT_START_SECONDS = 90.0

REAL_GPU_HELP = """This host has an NVIDIA GPU: run the real thing.
  sudo gemtrace agent --config examples/resource.conf          # or: systemctl start gemtrace
  gemtrace run --group train -- python train.py                 # in another shell
  gemtrace top                                                  # watch the groups
Force the simulated GPU with: python -m dev.demo --simulated
"""

# group -> the client's arguments: 2 ms kernels, four per step then a sync, as a training step does.
WORKLOADS = {
    "train": ["launch-loop", "--kernel-ns", "2000000", "--launches-per-iter", "4", "--seconds", "3600"],
    "infer": ["launch-loop", "--kernel-ns", "2000000", "--launches-per-iter", "4", "--seconds", "3600"],
    "notebook": ["launch-loop", "--kernel-ns", "2000000", "--launches-per-iter", "4", "--seconds", "3600"],
}


def has_real_gpu() -> bool:
    gpus = Path("/proc/driver/nvidia/gpus")
    return gpus.is_dir() and any(gpus.iterdir())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def frame_lines(frame: top.Frame, width: int = 100) -> list[str]:
    """A frame as `gemtrace top` draws it, headed as the demo's (pure)."""
    lines = top.render(frame, "on the simulated GPU", width)
    _, _, rest = lines[0].partition("  ")  # top heads its frames with its own name
    lines[0] = f"{TITLE}  {rest}"
    return lines


def ebpf_line(frame: top.Frame, agent_log: str, as_root: bool) -> str:
    """One line on the eBPF accounting (pure): on, or why not and what to do, from the agent's
    `ebpf_unavailable` event. `as_root`: whether the demo runs as root (else it says how)."""
    if frame.probes_attached:
        return f"eBPF accounting on: {frame.probes_attached:.0f} uprobes on the simulated libcuda"
    for line in agent_log.splitlines():
        try:
            event = json.loads(line[line.index("{"):])
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("event") == "ebpf_unavailable":
            # The agent's advice is an operator's ("then restart the agent"); the demo starts its own.
            reason = str(event.get("reason")).replace(", then restart the agent", ", then run the demo again")
            hint = "" if as_root else " (here: make demo as root)"
            return f"eBPF accounting off, the gates and NVML still count: {reason}{hint}"
    return "eBPF accounting off: no uprobe attached to the simulated libcuda (see the agent's log)"


def _wait_for_agent(url: str, agent: subprocess.Popen[bytes], seconds: float) -> top.Frame | None:
    """The agent's first frame once its /metrics answers with a GPU; None if it exited or never did.
    Quiet meanwhile: a refused connection is what a starting agent answers."""
    deadline = time.monotonic() + seconds
    while agent.poll() is None and time.monotonic() < deadline:
        frame = top.snapshot(url, None)
        if not frame.error and frame.gpus:
            return frame
        time.sleep(0.2)
    return None


def _run(group: str, state: Path, env: dict[str, str], client: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "gemtrace.cli", "run", "--group", group, "--config", str(CONFIG),
         "--state-dir", str(state), "--", str(SIMGPU / "simgpu-rt"), *client],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dev.demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=20.0, help="how long to show the shares (default 20)")
    ap.add_argument("--simulated", action="store_true", help="use the simulated GPU even on a GPU host")
    args = ap.parse_args(argv)
    if has_real_gpu() and not args.simulated:
        print(REAL_GPU_HELP)
        return 0
    missing = [p for p in (SIMGPU / "libcuda.so.1", SIMGPU / "simgpu-rt", REPO / "build" / "libgemgate.so")
               if not p.exists()]
    if missing:
        print(f"demo: {missing[0]} is missing; run `make` first", file=sys.stderr)
        return 1

    work = Path(tempfile.mkdtemp(prefix="gemtrace-demo-"))
    # The log outlives the demo (its path is printed): it is where the agent says what it did.
    fd, log_name = tempfile.mkstemp(prefix="gemtrace-demo-agent-", suffix=".log")
    agent_log, log_path = os.fdopen(fd, "wb"), Path(log_name)
    state = work / "state"
    url = top.metrics_url(f"127.0.0.1:{_free_port()}")
    env = dict(os.environ, LD_LIBRARY_PATH=str(SIMGPU), SIMGPU_STATE_DIR=str(work / "simgpu"),
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env[ENV_PROBE_LIBCUDA] = str(SIMGPU / "libcuda.so.1")
    agent = subprocess.Popen(
        [sys.executable, "-m", "gemtrace.cli", "agent", "--config", str(CONFIG), "--state-dir", str(state),
         "--listen", url.split("/")[2]],
        env=env, stdout=subprocess.DEVNULL, stderr=agent_log,
    )
    workloads: list[subprocess.Popen[bytes]] = []
    try:
        first = _wait_for_agent(url, agent, AGENT_START_SECONDS)
        if first is None:
            why = (f"the agent exited with status {agent.returncode}" if agent.poll() is not None else
                   f"the agent did not answer within {AGENT_START_SECONDS:g} s (the machine may be too busy)")
            print(f"demo: {why}; its log ({log_path}):\n" + log_path.read_text(), file=sys.stderr)
            return 1
        print(f"{TITLE}: the agent is up on the simulated GPU with the groups of {CONFIG}; "
              f"{', '.join(WORKLOADS)} at work for {args.seconds:g} s (default: every other program; "
              "--seconds N or Ctrl-C)", flush=True)
        print(f"{TITLE}: {ebpf_line(first, log_path.read_text(), os.geteuid() == 0)}", flush=True)
        print(f"{TITLE}: the agent's log: {log_path} (kept)\n", flush=True)
        for group, client_args in WORKLOADS.items():
            workloads.append(_run(group, state, env, client_args))
        # notebook also holds 1.5 GiB under its 2 GiB limit.
        workloads.append(_run("notebook", state, env, ["alloc", "--api", "v2", "1536MiB", "--hold", "3600"]))
        previous: top.Frame | None = None
        end = time.monotonic() + args.seconds
        while time.monotonic() < end:
            time.sleep(top.REFRESH_SECONDS)
            frame = top.snapshot(url, previous)
            previous = frame if not frame.error else None
            print("\n".join(frame_lines(frame)) + "\n", flush=True)
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        for proc in workloads:
            proc.kill()
            proc.wait()
        agent.send_signal(signal.SIGTERM)
        try:
            agent.wait(timeout=20)
        except subprocess.TimeoutExpired:
            agent.kill()
        agent_log.close()
        shutil.rmtree(work, ignore_errors=True)
        if workloads:  # it ran: the frames have scrolled the log's path away
            print(f"{TITLE}: stopped; the agent's log is kept in {log_path}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
