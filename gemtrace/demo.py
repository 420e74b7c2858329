"""`make demo`: the agent at work on the simulated GPU, three groups sharing it.

Starts `gemtrace agent` on the simulated GPU of tests/ (build/simgpu: a libcuda whose kernels take
the time they are told, and an NVML) with examples/resource.conf, starts each group's workload with
`gemtrace run`, and prints `gemtrace status` every second, so the shares can be watched being held:
train is capped at 30%, infer may take up to 70%, notebook takes what is left and holds memory
under its 2 GiB limit. Everything runs in a temporary directory and is stopped at the end.
On a host with a real NVIDIA GPU it prints how to run the real thing instead.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gemtrace import status

REPO = Path(__file__).resolve().parent.parent
SIMGPU = REPO / "build" / "simgpu"
CONFIG = REPO / "examples" / "resource.conf"

REAL_GPU_HELP = """This host has an NVIDIA GPU: run the real thing.
  sudo gemtrace agent --config examples/resource.conf          # or: systemctl start gemtrace
  gemtrace run --group train -- python train.py                 # in another shell
  gemtrace top                                                  # watch the groups
Force the simulated GPU with: python -m gemtrace.demo --simulated
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gemtrace.demo", description=__doc__.split("\n\n")[0])
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
    listen = f"127.0.0.1:{_free_port()}"
    env = dict(os.environ, LD_LIBRARY_PATH=str(SIMGPU), SIMGPU_STATE_DIR=str(work / "simgpu"),
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    gemtrace = [sys.executable, "-m", "gemtrace.cli"]
    agent_log = (work / "agent.log").open("wb")
    agent = subprocess.Popen(
        [*gemtrace, "agent", "--config", str(CONFIG), "--state-dir", str(work / "state"), "--listen", listen],
        env=env, stdout=subprocess.DEVNULL, stderr=agent_log,
    )
    workloads: list[subprocess.Popen[bytes]] = []
    try:
        deadline = time.monotonic() + 30
        while not (work / "state" / "region").exists() or status.main(listen, False, out=open(os.devnull, "w")):
            if agent.poll() is not None or time.monotonic() > deadline:
                print("demo: the agent did not start; its log:\n" + (work / "agent.log").read_text(), file=sys.stderr)
                return 1
            time.sleep(0.2)
        print(f"agent up on the simulated GPU (log {work / 'agent.log'}); groups from {CONFIG}\n", flush=True)
        for group, client_args in WORKLOADS.items():
            workloads.append(subprocess.Popen(
                [*gemtrace, "run", "--group", group, "--config", str(CONFIG), "--state-dir", str(work / "state"),
                 "--", str(SIMGPU / "simgpu-rt"), *client_args],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            ))
        # notebook also holds 1.5 GiB under its 2 GiB limit.
        workloads.append(subprocess.Popen(
            [*gemtrace, "run", "--group", "notebook", "--config", str(CONFIG), "--state-dir", str(work / "state"),
             "--", str(SIMGPU / "simgpu-rt"), "alloc", "--api", "v2", "1536MiB", "--hold", "3600"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        ))
        end = time.monotonic() + args.seconds
        while time.monotonic() < end:
            time.sleep(1.0)
            print(f"--- {time.strftime('%H:%M:%S')}", flush=True)
            status.main(listen, False)
            sys.stdout.flush()
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


if __name__ == "__main__":
    sys.exit(main())
