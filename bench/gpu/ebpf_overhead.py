"""eBPF accounting on a real GPU (issue 4, "On the H100"): what each probe mode costs, and whether the
figures agree with NVML and with kernels of known duration. Run by the integrator on the GPU machine:

    # first make bcc importable by python3 (python3-bpfcc and the kernel's headers; the lent GPU
    # machine has neither, so the integrator sources a carried bundle of Debian 12's bcc)
    python3 -m bench.gpu.ebpf_overhead [--rounds 5] [--launches 200000] [--steps 300]

Self-contained: PyTorch workers run as child processes without the gate; the accounting
(gemtrace.agent.accounting, probes from bpf/) runs in this process, attached to libcuda before the workers
start. Side by side, interleaved rounds of:
  1. an empty-kernel launch loop (torch.cuda._sleep(0): one cuLaunchKernel each), per mode
     off / memory (the default) / launches; target: the default adds <= 2%;
  2. a small PyTorch training loop (MLP, Adam), same modes; target: <= 1%;
  3. memory: eBPF's per-process figure against NVML's (which adds the context, ~800 MB) for
     PyTorch's three allocator back-ends (default, expandable_segments, cudaMallocAsync);
  4. GPU time of an ungated process (NVML-based, coarse) against clock64 spin kernels of known
     duration (CUDA events in the worker); target within 5%.
Prints tables; writes ebpf_overhead.md and ebpf_overhead.json into $OUT when set.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from bench.recording import gpus, publish, stamp
from gemtrace.agent.accounting import Accounting
from gemtrace.agent.agent import open_accounting
from gemtrace.sources.nvml import NvmlReader

MODES = (None, "memory", "launches")

LAUNCH_WORKER = textwrap.dedent("""
    import json, sys, time, torch
    n = int(sys.argv[1])
    torch.cuda.init(); torch.cuda._sleep(0); torch.cuda.synchronize()
    for _ in range(2000): torch.cuda._sleep(0)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n): torch.cuda._sleep(0)
    torch.cuda.synchronize()
    print(json.dumps({"us_per_launch": (time.perf_counter() - t) / n * 1e6}))
""")

TRAIN_WORKER = textwrap.dedent("""
    import json, sys, time, torch
    steps = int(sys.argv[1])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 10)).cuda()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    x = torch.randn(256, 1024, device="cuda"); y = torch.randint(0, 10, (256,), device="cuda")
    def step():
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y); loss.backward(); opt.step()
    for _ in range(30): step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps): step()
    torch.cuda.synchronize()
    print(json.dumps({"ms_per_step": (time.perf_counter() - t) / steps * 1e3}))
""")

MEMORY_WORKER = textwrap.dedent("""
    import json, os, sys, time, torch
    tensors = [torch.empty(64 << 20, dtype=torch.uint8, device="cuda") for _ in range(4)]
    torch.cuda.synchronize()
    print(json.dumps({"pid": os.getpid(), "reserved": torch.cuda.memory_reserved()}), flush=True)
    sys.stdin.readline()
""")

SPIN_WORKER = textwrap.dedent("""
    import json, sys, torch
    seconds = float(sys.argv[1])
    torch.cuda.init()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000); torch.cuda.synchronize()
    start.record(); torch.cuda._sleep(1_000_000); end.record(); torch.cuda.synchronize()
    cycles_per_ms = 1_000_000 / start.elapsed_time(end)
    per_kernel_ms = 10.0
    n = int(seconds * 1000 / per_kernel_ms)
    start.record()
    for _ in range(n): torch.cuda._sleep(int(cycles_per_ms * per_kernel_ms))
    end.record(); torch.cuda.synchronize()
    print(json.dumps({"kernel_s": start.elapsed_time(end) / 1e3}))
""")


def libcuda_path() -> Path:
    ctypes.CDLL("libcuda.so.1")
    for line in Path("/proc/self/maps").read_text().splitlines():
        if "libcuda.so" in line:
            return Path(line.split(None, 5)[5])
    raise SystemExit("libcuda.so.1 is not loadable here")


def run_worker(code: str, *args: str, env: dict[str, str] | None = None) -> dict:
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=True,
                         env=env or dict(os.environ))
    return json.loads(out.stdout.strip().splitlines()[-1])


def with_mode(mode: str | None, lib: Path, nvml: NvmlReader) -> Accounting | None:
    if mode is None:
        return None
    acc = open_accounting(None, lambda: None, probe_mode=mode, nvml=nvml, libcuda_paths=[lib])
    assert acc.probes is not None, acc.ebpf_status
    return acc


def side_by_side(code: str, arg: str, key: str, rounds: int, lib: Path, nvml: NvmlReader) -> dict[str, list[float]]:
    results: dict[str, list[float]] = {str(m): [] for m in MODES}
    for _ in range(rounds):
        for mode in MODES:
            acc = with_mode(mode, lib, nvml)
            try:
                results[str(mode)].append(run_worker(code, arg)[key])
            finally:
                if acc is not None:
                    acc.close()
    return results


def memory_agreement(lib: Path, nvml: NvmlReader) -> list[tuple[str, int, int, int]]:
    rows = []
    acc = with_mode("memory", lib, nvml)
    assert acc is not None
    try:
        for name, conf in (("default", ""), ("expandable_segments", "expandable_segments:True"),
                           ("cudaMallocAsync", "backend:cudaMallocAsync")):
            env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=conf)
            p = subprocess.Popen([sys.executable, "-c", MEMORY_WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True, env=env)
            assert p.stdout is not None and p.stdin is not None
            hello = json.loads(p.stdout.readline())
            time.sleep(0.5)
            ebpf = sum(a.memory_bytes for a in acc.poll().processes if a.pid == hello["pid"])
            nv = sum(x.used_bytes for x in nvml.processes() if x.pid == hello["pid"])
            rows.append((name, hello["reserved"], ebpf, nv))
            p.stdin.write("\n")
            p.stdin.flush()
            p.wait()
    finally:
        acc.close()
    return rows


def gpu_time(lib: Path, nvml: NvmlReader, seconds: float) -> tuple[float, float]:
    acc = open_accounting(None, lambda: None, nvml=nvml, libcuda_paths=[lib])
    try:
        end = time.monotonic() + 1.5  # an agent polls all along: NVML's window is full before the work
        while time.monotonic() < end:
            acc.poll()
            time.sleep(0.05)
        p = subprocess.Popen([sys.executable, "-c", SPIN_WORKER, str(seconds)], stdout=subprocess.PIPE, text=True)
        pid = p.pid
        while p.poll() is None:
            acc.poll()
            time.sleep(0.05)
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            acc.poll()
            time.sleep(0.05)
        assert p.stdout is not None
        truth = json.loads(p.stdout.read().strip().splitlines()[-1])["kernel_s"]
        measured = sum(a.gpu_seconds for a in acc.poll().processes if a.pid == pid)
    finally:
        acc.close()
    return truth, measured


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--launches", type=int, default=200000)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--spin-seconds", type=float, default=5.0)
    args = ap.parse_args()
    lib = libcuda_path()
    nvml = NvmlReader()
    lines = [f"# eBPF accounting on {platform.node()} ({stamp()}, {gpus()}), libcuda {lib}", ""]

    launch = side_by_side(LAUNCH_WORKER, str(args.launches), "us_per_launch", args.rounds, lib, nvml)
    train = side_by_side(TRAIN_WORKER, str(args.steps), "ms_per_step", args.rounds, lib, nvml)
    for title, unit, res, target in (("Empty-kernel launch loop", "us/launch", launch, 2.0),
                                     ("PyTorch training loop (MLP, Adam)", "ms/step", train, 1.0)):
        base = statistics.median(res["None"])
        lines += [f"## {title} ({args.rounds} interleaved rounds, medians)", "",
                  f"| probe mode | {unit} | added | target |", "| --- | --- | --- | --- |"]
        for mode in MODES:
            med = statistics.median(res[str(mode)])
            added = 100 * (med / base - 1)
            verdict = "" if mode != "memory" else (f"<= {target:g}%: " + ("met" if added <= target else "NOT met"))
            lines.append(f"| {mode or 'off'} | {med:.3f} | {added:+.2f}% | {verdict} |")
        lines.append("")

    lines += ["## Memory: eBPF against NVML (4 x 64 MiB tensors per process)", "",
              "| allocator | torch reserved | eBPF | NVML | NVML - eBPF (context) |", "| --- | --- | --- | --- | --- |"]
    for name, reserved, ebpf, nv in memory_agreement(lib, nvml):
        lines.append(f"| {name} | {reserved >> 20} MiB | {ebpf >> 20} MiB | {nv >> 20} MiB | {(nv - ebpf) >> 20} MiB |")
    truth, measured = gpu_time(lib, nvml, args.spin_seconds)
    err = 100 * (measured / truth - 1) if truth else float("nan")
    verdict = "met" if abs(err) <= 5 else "NOT met"
    lines += ["", "## GPU time of an ungated process (NVML-based) against clock64 spin kernels", "",
              "| kernels (CUDA events) | accounted | error | target |", "| --- | --- | --- | --- |",
              f"| {truth:.3f} s | {measured:.3f} s | {err:+.1f}% | within 5%: {verdict} |"]
    publish("\n".join(lines) + "\n", "ebpf_overhead", {"launch": launch, "train": train, "gpu_time": [truth, measured]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
