"""bench/gpu/scheduler_torch.py's orchestration on the simulated GPU, with stand-in workers.

The GPU bench runs PyTorch workers; this machine has neither torch nor a GPU. The test runs the bench's
own `main` (its Rig, its schedulers, its case list, its table) against the simulated GPU with WORKER
replaced by a stand-in that drives a simgpu launch loop on the requested device and reports progress as
the PyTorch worker does, and torch's GPU count replaced by NVML's. It checks what the GPU run depends on:
the two-GPU case runs with two GPUs, one row per (group, GPU) with sensible shares, and is skipped with
a printed line on one GPU. The figures of record come from the GPU (bench/results/scheduler_torch.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from simgpu_env import REPO, RT_CLIENT, require_build, simgpu_env

pytestmark = pytest.mark.e2e

STANDIN = r"""
import json, signal, subprocess, sys, time
kind, device = sys.argv[1], sys.argv[2]
if kind == "idle":  # holds a context and runs nothing
    print(json.dumps({"ready": True, "t": time.monotonic()}), flush=True)
    while True:
        time.sleep(0.05)
        print(json.dumps({"t": time.monotonic(), "iters": 0, "run_iters": 0, "run_s": 0.0}), flush=True)
kernel_ns, per_iter = {"matmul": (2_000_000, 4), "inference": (50_000, 12)}[kind]
loop = subprocess.Popen([RT_CLIENT, "launch-loop", "--kernel-ns", str(kernel_ns), "--launches-per-iter",
                         str(per_iter), "--seconds", "600", "--progress", "--device", device],
                        stdout=subprocess.PIPE, text=True)
def stop(*_):
    loop.kill()
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
print(json.dumps({"ready": True, "t": time.monotonic()}), flush=True)
for line in loop.stdout:
    obj = json.loads(line)
    if obj.get("progress"):
        # No per-step times here: the running rate is the loop's nominal one (kernel time per step).
        now = time.monotonic()
        print(json.dumps({"t": now, "iters": obj["iters"], "run_iters": obj["iters"],
                          "run_s": obj["iters"] * kernel_ns * per_iter / 1e9}), flush=True)
"""

DRIVER = r"""
import sys
import bench.gpu.scheduler_torch as bench
bench.WORKER = "RT_CLIENT = %r\n" % RT_CLIENT + STANDIN
import pynvml
pynvml.nvmlInit()
bench.visible_gpus = pynvml.nvmlDeviceGetCount
sys.argv = ["scheduler_torch.py", "--seconds", "3", "--warmup", "1", "--cases", CASES]
sys.exit(bench.main())
"""


def run_bench(tmp_path: Path, devices: int, cases: str) -> tuple[int, str, dict]:
    require_build()
    out = tmp_path / "out"
    env = simgpu_env(tmp_path / "sim", devices=devices, OUT=str(out))
    code = f"RT_CLIENT = {str(RT_CLIENT)!r}\nCASES = {cases!r}\nSTANDIN = {STANDIN!r}\n" + DRIVER
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, text=True, capture_output=True, timeout=180)
    result = json.loads((out / "scheduler_torch.json").read_text()) if (out / "scheduler_torch.json").exists() \
        else {"rows": []}
    return done.returncode, done.stdout + done.stderr, result


def test_two_gpu_case_schedules_each_gpu(tmp_path: Path) -> None:
    rc, output, result = run_bench(tmp_path, 2, "2 GPUs")
    rows = {(r["group"], r["gpu"]): r for r in result["rows"]}
    assert set(rows) == {("gpu0-capped30", 0), ("gpu0-capped70", 0), ("gpu1-capped40", 1),
                         ("gpu1-uncapped", 1)}, output
    assert "solo matmul on GPU 1" in output and "gated uncapped alone" in output, output
    # Loose bounds: orchestration, not accuracy (tests/test_scheduler_e2e.py holds that). The bench's
    # share is of a solo run earlier, under whatever load the host had then: on each GPU, whose
    # targets add up to 1, each group's part of what the two did together is asserted instead (they
    # took turns on the same slices of the same host: a busier host moves neither part).
    together = {gpu: sum(r["share"] for r in rows.values() if r["gpu"] == gpu) for gpu in (0, 1)}
    for row in rows.values():
        assert abs(row["share"] / together[row["gpu"]] - row["target"]) <= 0.1, output
        # The scheduler's own account of GPU time agrees with the throughput on the simulated GPU.
        assert abs(row["charged"] - row["target"]) <= 0.1, output
    assert rc in (0, 1), output


def test_diagnostic_rows_are_shown_and_not_judged(tmp_path: Path) -> None:
    rc, output, result = run_bench(tmp_path, 1, "beside an idle context")
    rows = {r["group"]: r for r in result["rows"]}
    assert set(rows) == {"infer-beside-idle"} and rows["infer-beside-idle"]["kind"] == "~", output
    assert "~ 1.00" in output, output
    assert rc == 0, output  # "~" rows never fail the run


def test_two_gpu_case_skipped_on_one_gpu(tmp_path: Path) -> None:
    rc, output, result = run_bench(tmp_path, 1, "2 GPUs,MaxUtil 0.5 alone")
    assert "skipped: 2 GPUs" in output and "torch sees 1" in output, output
    assert [(r["group"], r["gpu"]) for r in result["rows"]] == [("capped50", 0)], output
    assert rc in (0, 1), output
