"""JAX, CuPy and PyTorch under a 4 GiB group, and this host's GPU topology, through the product only
(issue 14: "the memory share handed to frameworks", "topology-aware GPU choice").

Starts `gemtrace agent` (no eBPF: the gate alone enforces a MemoryLimit) on a resource file with one
group `small` (MemoryLimit=4GiB), then for each framework runs, with `gemtrace run --group small`,
a program that reports the memory the framework believes it has, does some work, and allocates 256 MiB
blocks until the framework raises its own out-of-memory error. It must start, run, and stop at the
limit with that error (exit 0 after catching it), not crash. Then it prints what NVML says of the
links between the GPUs and which GPUs `gemtrace run --gpus N` picks.

    python3 -m bench.gpu.frameworks_limit      # from the repo root, build/libgemgate.so built

Needs: the frameworks that are installed (a missing one is reported, not failed), nvidia-ml-py,
psutil, prometheus-client, structlog. Prints a table; with $OUT set, writes frameworks_limit.md there.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.recording import REPO, gpus, publish, stamp
from tests.testkit import GiB

LIMIT = 4 * GiB

# Each program prints one JSON line: the total its framework reports, the bytes it held when the
# framework refused, the error's type and the first line of its message.
PROGRAMS = {
    "cupy": r"""
import json, cupy
free, total = cupy.cuda.runtime.memGetInfo()
a = cupy.ones((2048, 2048), dtype=cupy.float32); (a @ a).sum().item()
held, blocks = 0, []
try:
    while held < 64 << 30:
        blocks.append(cupy.empty(256 << 20, dtype=cupy.uint8)); held += 256 << 20
    error = None
except cupy.cuda.memory.OutOfMemoryError as e:
    error = e
print(json.dumps({"reported_total": total, "held_at_refusal": held,
                  "error": type(error).__name__, "message": str(error).splitlines()[0][:160]}))
""",
    "jax": r"""
import json, jax, jax.numpy as jnp
dev = jax.devices()[0]
stats = dev.memory_stats() or {}
a = jnp.ones((2048, 2048), dtype=jnp.float32); float((a @ a).sum())
held, blocks = 0, []
try:
    while held < 64 << 30:
        blocks.append(jax.device_put(jnp.zeros(256 << 20, dtype=jnp.uint8), dev).block_until_ready())
        held += 256 << 20
    error = None
except Exception as e:  # jaxlib's XlaRuntimeError: RESOURCE_EXHAUSTED
    error = e
print(json.dumps({"reported_total": stats.get("bytes_limit"), "held_at_refusal": held,
                  "error": type(error).__name__, "message": str(error).splitlines()[0][:160]}))
""",
    "torch": r"""
import json, torch
free, total = torch.cuda.mem_get_info()
a = torch.ones(2048, 2048, device="cuda"); (a @ a).sum().item()
held, blocks = 0, []
try:
    while held < 64 << 30:
        blocks.append(torch.empty(256 << 20, dtype=torch.uint8, device="cuda")); held += 256 << 20
    error = None
except torch.cuda.OutOfMemoryError as e:
    error = e
print(json.dumps({"reported_total": total, "held_at_refusal": held,
                  "error": type(error).__name__, "message": str(error).splitlines()[0][:160]}))
""",
}

TOPOLOGY = r"""
import json
from gemtrace.run import topology
nodes = topology.read()
print(json.dumps([{"index": n.index, "uuid": n.uuid, "links": {str(k): {"pcie": getattr(v.pcie, "name", v.pcie),
                   "nvlinks": v.nvlinks, "nvlink_version": v.nvlink_version} for k, v in n.links.items()}}
                  for n in nodes]))
"""


def gemtrace(*args: str) -> list[str]:
    return [sys.executable, "-m", "gemtrace.cli", *args]


def main() -> int:
    # No options: --help says what the run does, and anything else is refused before a GPU is touched.
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    work = Path(tempfile.mkdtemp(prefix="gemtrace-frameworks-"))
    config = work / "resource.conf"
    config.write_text("[small]\nMemoryLimit=4GiB\n")
    state = work / "state"
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}", "GEMTRACE_GATE":
           str(REPO / "build" / "libgemgate.so")}
    agent_log = (work / "agent.log").open("w")
    agent = subprocess.Popen(gemtrace("agent", "--config", str(config), "--state-dir", str(state), "--no-ebpf",
                                      "--listen", "127.0.0.1:19843"), cwd=REPO, env=env, stderr=agent_log)
    rows: list[dict[str, object]] = []
    try:
        deadline = time.monotonic() + 60
        while not (state / "region").exists():
            if agent.poll() is not None or time.monotonic() > deadline:
                print((work / "agent.log").read_text(), file=sys.stderr)
                return 1
            time.sleep(0.2)
        time.sleep(0.5)
        for name, program in PROGRAMS.items():
            started = time.monotonic()
            out = subprocess.run(gemtrace("run", "--group", "small", "--state-dir", str(state), "--require-agent",
                                          "--", sys.executable, "-c", program),
                                 cwd=REPO, env={**env, "CUDA_VISIBLE_DEVICES": "0"}, capture_output=True, text=True,
                                 timeout=300)
            row: dict[str, object] = {"framework": name, "exit": out.returncode,
                                      "seconds": round(time.monotonic() - started, 1)}
            lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
            if lines:
                row.update(json.loads(lines[-1]))
            else:
                row["stderr_tail"] = out.stderr.strip().splitlines()[-3:]
            rows.append(row)
            print(json.dumps(row), flush=True)
        topo = subprocess.run([sys.executable, "-c", TOPOLOGY], cwd=REPO, env=env, capture_output=True, text=True)
        links = json.loads(topo.stdout) if topo.returncode == 0 else topo.stderr.strip().splitlines()[-3:]
        picks = {}
        for n in (1, 2):
            out = subprocess.run(gemtrace("run", "--group", "small", "--state-dir", str(state), "--gpus", str(n),
                                          "--", "sh", "-c", "echo $CUDA_VISIBLE_DEVICES"),
                                 cwd=REPO, env={k: v for k, v in env.items() if k != "CUDA_VISIBLE_DEVICES"},
                                 capture_output=True, text=True)
            picks[n] = out.stdout.strip() or out.stderr.strip()
    finally:
        agent.terminate()
        agent.wait(timeout=30)
    publish(render(rows, links, picks), "frameworks_limit")
    ok = all(r.get("exit") == 0 and r.get("error") not in (None, "NoneType") for r in rows if "stderr_tail" not in r)
    return 0 if ok else 1


def render(rows: list[dict[str, object]], links: object, picks: dict[int, str]) -> str:
    lines = [f"## {stamp()}, {gpus()}, {platform.node()}", "",
             "Group `small`, MemoryLimit=4GiB, through `gemtrace agent --no-ebpf` and `gemtrace run`:", "",
             "| framework | exit | total it reports | held when refused | its error | message |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        total = r.get("reported_total")
        lines.append(f"| {r['framework']} | {r['exit']} | "
                     f"{'-' if total is None else f'{int(total) / GiB:.2f} GiB'} | "
                     f"{int(r.get('held_at_refusal', 0)) / GiB:.2f} GiB | {r.get('error', '-')} | "
                     f"{str(r.get('message', r.get('stderr_tail', '')))[:120]} |")
    lines += ["", "NVML's links between the GPUs (gemtrace/run/topology.py):", "", "```", json.dumps(links, indent=1),
              "```", "", "`gemtrace run --gpus N` picked: " + "; ".join(f"N={n}: {p}" for n, p in picks.items()), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
