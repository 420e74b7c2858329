"""Scheduler accuracy on a real GPU with PyTorch workloads (issue 3, "Accuracy", H100 part).

Self-contained: it starts its own GpuScheduler threads in this process over a Region in a temporary
state dir (the GPUs' NVML UUIDs, a heartbeat), and runs each group's work as separate Python processes
with the gate preloaded (LD_PRELOAD=build/libgemgate.so, GEMTRACE_GROUP, GEMTRACE_STATE_DIR). Work:
  matmul     a loop of 4 fp16 8192x8192 matmuls then torch.cuda.synchronize() (~7 ms of GPU per step)
  inference  a small-batch MLP forward pass (batch 8, 6 layers of 2048) then synchronize: kernels of a
             few microseconds, launch-bound, as in small-batch inference serving
A group's share = its iterations per second shared / the same work's alone and ungated on the same GPU.
Cases: the four of issue 3 with matmul loops, caps 0.3/0.7 with the inference loop (the short-kernel
case), and, when torch sees two GPUs or more, a two-GPU case (one GpuScheduler per GPU, as the agent
runs them): caps 0.3/0.7 on cuda:0 beside a group capped 0.4 and an uncapped one on cuda:1, each GPU
scheduled on its own (with one GPU it is skipped with a printed line). The workers call
torch.cuda.synchronize() as users write it, for the current device: on cuda:1 that is device 0, so
the loops on GPU 1 never wait for their own GPU (the driver's queue fills, seconds of kernels): the
gate must keep such a process's queue short for GPU 1's scheduler to hold it (GT_RELEASED_SHORT_QUEUE).
For comparison, HAMi-core's caps of 30 and 70 delivered about 46% and 54% (issue 3).

Prints a table; with $OUT set, writes scheduler_torch.md and scheduler_torch.json there.

    python3 -m bench.gpu.scheduler_torch [--seconds 8] [--warmup 3] [--cases all|name,...]

Needs, from the repo root: torch with CUDA, build/libgemgate.so (`make gate`), and what the agent needs
(psutil, nvidia-ml-py, prometheus-client, structlog) on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.recording import REPO, publish, stamp
from gemtrace import defaults
from gemtrace.agent.membership import Membership
from gemtrace.agent.policy import PolicyParams
from gemtrace.agent.scheduler import GpuScheduler, Quota
from gemtrace.region import Region

GATE = REPO / "build" / "libgemgate.so"

WORKER = r"""
import json, os, sys, time
import torch
kind, device = sys.argv[1], int(sys.argv[2])
paced_s = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0  # >0: rest this long after running this long
dev = torch.device("cuda", device)
torch.backends.cuda.matmul.allow_tf32 = True
if kind == "matmul":
    a = torch.randn(8192, 8192, device=dev, dtype=torch.float16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.float16)
    def step():
        for _ in range(4):
            c = a @ b
        return c
elif kind == "idle":
    keep = torch.ones(1024, device=dev)  # a context and some memory on the GPU, and nothing to run
    def step():
        time.sleep(0.01)
else:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(2048, 2048) for _ in range(6)]
    model = torch.nn.Sequential(*[m for l in layers for m in (l, torch.nn.ReLU())]).to(dev).half().eval()
    x = torch.randn(8, 2048, device=dev, dtype=torch.float16)
    def step():
        with torch.inference_mode():
            return model(x)
for _ in range(20):
    step()
torch.cuda.synchronize()
# A step longer than this waited on a hold (matmul steps take ~7 ms, inference ones ~0.2 ms alone):
# the others tell the rate while the group holds the GPU.
held_step = {"matmul": 0.02, "inference": 0.001, "idle": 1.0}[kind]
print(json.dumps({"ready": True, "t": time.monotonic()}), flush=True)
iters, last, run_iters, run_s = 0, 0.0, 0, 0.0
begin = paced_from = time.monotonic()
while True:
    if paced_s and begin - paced_from >= paced_s:
        time.sleep(paced_s)  # as if held, with no gemtrace: this step is not counted as running
        paced_from = time.monotonic()
    step()
    torch.cuda.synchronize()
    iters += 1
    now = time.monotonic()
    if now - begin < held_step:
        run_iters, run_s = run_iters + 1, run_s + (now - begin)
    begin = now
    if now - last >= 0.05:
        print(json.dumps({"t": now, "iters": iters, "run_iters": run_iters, "run_s": run_s}), flush=True)
        last = now
"""


@dataclass(frozen=True)
class Load:
    group: str
    quota: Quota = Quota()
    kind: str = "matmul"
    gated: bool = True
    device: int = 0  # the worker's torch device, cuda:<device>
    paced_ms: float = 0.0  # >0: the worker itself runs this long, then sleeps this long (no gemtrace)


@dataclass(frozen=True)
class Case:
    name: str
    loads: tuple[Load, ...]
    # group -> (target share, "=" or ">=", or "~" for a diagnostic figure) on its load's device
    targets: dict[str, tuple[float, str]]
    gpus: int = 1  # GPUs the case needs; skipped with a printed line when torch sees fewer


CASES = (
    Case("caps 0.3 / 0.7", (Load("capped30", Quota(0, 0.3)), Load("capped70", Quota(0, 0.7))),
         {"capped30": (0.3, "="), "capped70": (0.7, "=")}),
    Case("MinUtil 0.2 alone", (Load("reserved20", Quota(0.2, 1.0)),), {"reserved20": (0.97, ">=")}),
    Case("MaxUtil 0.5 alone", (Load("capped50", Quota(0, 0.5)),), {"capped50": (0.5, "=")}),
    Case("MinUtil 0.6 vs two hogs", (Load("reserved60", Quota(0.6, 1.0)), Load("hog1"), Load("hog2")),
         {"reserved60": (0.6, ">=")}),
    Case("short kernels: caps 0.3 / 0.7",
         (Load("infer30", Quota(0, 0.3), "inference"), Load("infer70", Quota(0, 0.7), "inference")),
         {"infer30": (0.3, "="), "infer70": (0.7, "=")}),
    # Why short kernels run slower inside their slices (targets marked "~" are diagnostics, not
    # goals): held and resumed with no other process on the GPU; ungated beside a process that only
    # holds a context; ungated, resting as often as a cap of 0.5 holds it (the host's own cost of
    # a loop that sleeps half the time); two ungated loops side by side (the GPU's own time-slicing).
    Case("short kernels, capped at 0.5 alone", (Load("infer50", Quota(0, 0.5), "inference"),),
         {"infer50": (0.5, "~")}),
    Case("short kernels: ungated beside an idle context",
         (Load("infer-beside-idle", kind="inference", gated=False), Load("idle", kind="idle", gated=False)),
         {"infer-beside-idle": (1.0, "~")}),
    Case("short kernels: ungated, resting 20 ms every 20 ms by itself",
         (Load("infer-paced", kind="inference", gated=False, paced_ms=20.0),), {"infer-paced": (0.5, "~")}),
    Case("short kernels: two ungated side by side",
         (Load("infer-a", kind="inference", gated=False), Load("infer-b", kind="inference", gated=False)),
         {"infer-a": (0.5, "~"), "infer-b": (0.5, "~")}),
    # Each GPU is scheduled on its own: GPU 0's groups never wait for GPU 1's, and the 0.4 cap on GPU 1
    # leaves the rest of GPU 1 to the uncapped group there (work-conserving), whatever GPU 0 does.
    Case("2 GPUs: caps 0.3 / 0.7 on GPU 0, cap 0.4 + uncapped on GPU 1",
         (Load("gpu0-capped30", Quota(0, 0.3), device=0), Load("gpu0-capped70", Quota(0, 0.7), device=0),
          Load("gpu1-capped40", Quota(0, 0.4), device=1), Load("gpu1-uncapped", device=1)),
         {"gpu0-capped30": (0.3, "="), "gpu0-capped70": (0.7, "="),
          "gpu1-capped40": (0.4, "="), "gpu1-uncapped": (0.6, "=")}, gpus=2),
)


def visible_gpus() -> int:
    """GPUs the workers will see: torch's count (imported here only to count)."""
    import torch

    return int(torch.cuda.device_count())


CPUS = sorted(os.sched_getaffinity(0))  # taken at import, before this process pins itself


def physical_cores(cpus: list[int]) -> list[list[int]]:
    """The CPUs grouped by physical core (hyperthreads of one core together), in order; each CPU
    its own core where sysfs does not say."""
    cores: dict[tuple[str, str], list[int]] = {}
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            key = ((topology / "physical_package_id").read_text().strip(), (topology / "core_id").read_text().strip())
        except OSError:
            key = ("cpu", str(cpu))
        cores.setdefault(key, []).append(cpu)
    return list(cores.values())


CORES = physical_cores(CPUS)


def worker_cpu(position: int) -> int | None:
    """A physical core of its own for the case's n-th worker, the same one in every run (the solo's is
    the first worker's): the inference loop is CPU-bound, and a worker the kernel moved between CPUs
    ran up to 30% slower or faster from one solo run to the next. The first core is this process's (its
    scheduler threads: `pin_self`), and no worker shares a core with another one's hyperthread. None
    where there are too few cores to give each its own."""
    return CORES[1 + position][0] if len(CORES) > position + 1 else None


def pin_self() -> None:
    """Keep this process's threads (the schedulers, their polls during drains) off the workers' cores:
    unpinned, or pinned to the hyperthread beside the first worker's, they slowed that worker's
    launch-bound loop (H100, 2026-11-22 16:51-17:00)."""
    if len(CORES) > 1:
        os.sched_setaffinity(0, set(CORES[0]))


def pin_worker(cpu: int | None) -> Callable[[], None] | None:
    """A worker's preexec_fn: onto `cpu` (worker_cpu), or onto any of the CPUs this process started
    with, not its own pin (pin_self); None where there is a single CPU to give."""
    cpus = set(CPUS) if cpu is None else {cpu}
    return (lambda: os.sched_setaffinity(0, cpus)) if len(CPUS) > 1 else None


def json_lines(stream: Iterable[str]) -> Iterator[dict[str, Any]]:
    """A worker's JSON lines as they come, passing over what else it prints (torch's warnings)."""
    for line in stream:
        if line.startswith("{"):
            yield json.loads(line)


def end(proc: subprocess.Popen[Any]) -> None:
    """Stop a worker: SIGTERM, then SIGKILL if it is not gone within 10 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Worker:
    def __init__(self, load: Load, state_dir: Path, cpu: int | None = None) -> None:
        env = dict(os.environ)
        env.pop("LD_PRELOAD", None)
        if load.gated:
            env["LD_PRELOAD"] = str(GATE)
            env[defaults.ENV_GROUP] = load.group
            env[defaults.ENV_STATE_DIR] = str(state_dir)
        self.load = load
        argv = [sys.executable, "-c", WORKER, load.kind, str(load.device), str(load.paced_ms / 1e3)]
        self.proc = subprocess.Popen(argv, env=env, text=True, preexec_fn=pin_worker(cpu),
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.lines: list[dict[str, Any]] = []
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for obj in json_lines(self.proc.stdout):
            if obj.get("ready"):
                self.ready.set()
            else:
                self.lines.append(obj)

    def rate(self, t0: float, t1: float) -> float:
        """Iterations per second between the progress lines nearest t0 and t1."""
        lines = list(self.lines)
        if not lines:
            raise RuntimeError(f"{self.load.group}: no progress; stderr: {self.stderr()}")
        first = min(lines, key=lambda p: abs(p["t"] - t0))
        last = min(lines, key=lambda p: abs(p["t"] - t1))
        if last["t"] <= first["t"]:
            raise RuntimeError(f"{self.load.group}: no progress between {t0} and {t1}")
        return float((last["iters"] - first["iters"]) / (last["t"] - first["t"]))

    def running_rate(self, t0: float, t1: float) -> float:
        """Iterations per second of the steps not slowed by a hold (the rate while it held the GPU)."""
        lines = [p for p in self.lines if "run_iters" in p]
        first = min(lines, key=lambda p: abs(p["t"] - t0))
        last = min(lines, key=lambda p: abs(p["t"] - t1))
        spent = last["run_s"] - first["run_s"]
        return float((last["run_iters"] - first["run_iters"]) / spent) if spent > 0 else 0.0

    def stderr(self) -> str:
        if self.proc.poll() is None:
            return ""
        return self.proc.stderr.read() if self.proc.stderr else ""

    def stop(self) -> None:
        end(self.proc)


class Rig:
    """A region with every GPU's UUID, one scheduler thread per GPU and a heartbeat."""

    def __init__(self, state_dir: Path, params: PolicyParams | None = None) -> None:
        from gemtrace.gpus import discover, nvml

        found = discover()  # as the agent finds them
        self.handles = [nvml().nvmlDeviceGetHandleByIndex(gpu.index) for gpu in found]
        gpus = [(gpu.uuid, gpu.memory_total) for gpu in found]
        self.device = found[0].name
        self.state_dir = state_dir
        self.region = Region.create(state_dir)
        self.region.set_gpus(gpus)
        self.region.set_group("default", None, 0.0, 1.0)  # the agent always defines it
        self.membership = Membership(self.region, lambda: {})  # the agent's decision of each group
        self.stop = threading.Event()
        self.schedulers = [GpuScheduler(self.region, i, params=params) for i in range(len(gpus))]
        self.threads = [threading.Thread(target=s.run, args=(self.stop,)) for s in self.schedulers]
        self.threads.append(threading.Thread(target=self._beat))
        self.region.heartbeat(time.monotonic_ns())
        for t in self.threads:
            t.start()

    def _beat(self) -> None:
        while not self.stop.is_set():
            self.region.heartbeat(time.monotonic_ns())
            self.membership.tick()
            self.stop.wait(0.01)

    def define(self, loads: tuple[Load, ...]) -> dict[str, int]:
        quotas, index = {}, {}
        for load in loads:
            if load.gated:
                index[load.group] = self.region.set_group(load.group, None, load.quota.min_util,
                                                          load.quota.max_util)
                quotas[index[load.group]] = load.quota
        self.region.bump_generation()
        for s in self.schedulers:
            s.set_quotas(quotas)
        return index

    def _gpu_seconds(self, index: dict[str, int]) -> dict[tuple[str, int], float]:
        """GPU time each scheduler charged each group so far."""
        return {(group, s.gpu): s.usage()[i].gpu_seconds for s in self.schedulers
                for group, i in index.items() if i in s.usage()}

    def run(self, loads: tuple[Load, ...], warmup: float, seconds: float) -> dict[str, dict[str, float]]:
        """Per group, over a common window once every worker is warm: `rate` (it/s), `running` (it/s of
        the steps not slowed by a hold), `charged` (GPU time its scheduler charged it / the window),
        `switches` (holds per second on its GPU) and `sm_mhz` (its GPU's mean SM clock)."""
        import pynvml

        index = self.define(loads)
        workers = [Worker(load, self.state_dir, worker_cpu(n)) for n, load in enumerate(loads)]
        try:
            for w in workers:
                if not w.ready.wait(180):
                    raise RuntimeError(f"{w.load.group} did not start: {w.stderr()}")
            time.sleep(warmup)
            charged0, switches0 = self._gpu_seconds(index), [s.switches for s in self.schedulers]
            t0 = time.monotonic()
            clocks: list[list[int]] = [[] for _ in self.handles]
            while time.monotonic() - t0 < seconds:
                # Clocks tell a change of speed apart from a change of share (a GPU that rests half the
                # time may run its kernels at a higher clock than one busy all the time).
                for h, seen in zip(self.handles, clocks, strict=True):
                    try:
                        seen.append(int(pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)))
                    except pynvml.NVMLError:
                        pass  # not every NVML answers (the simulated GPU's does not): no figure then
                time.sleep(0.1)
            t1 = time.monotonic()
            charged1, switches1 = self._gpu_seconds(index), [s.switches for s in self.schedulers]
            time.sleep(0.3)  # a progress line past t1 from every worker
            out = {}
            for w in workers:
                gpu, group = w.load.device, w.load.group
                key = (group, gpu)
                out[group] = {
                    "rate": w.rate(t0, t1), "running": w.running_rate(t0, t1),
                    "charged": (charged1[key] - charged0[key]) / (t1 - t0) if key in charged0 else float("nan"),
                    "switches": (switches1[gpu] - switches0[gpu]) / (t1 - t0),
                    "sm_mhz": sum(clocks[gpu]) / len(clocks[gpu]) if clocks[gpu] else float("nan"),
                }
            return out
        finally:
            for w in workers:
                w.stop()

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(5)
        self.region.stop()
        self.region.close()


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| case | group | GPU | work | target | share | error (points) | time charged | running / solo "
           "| switches/s | SM MHz | it/s | solo it/s |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        sign = {">=": "≥ ", "~": "~ "}.get(r["kind"], "")
        out.append(f"| {r['case']} | {r['group']} | {r['gpu']} | {r['work']} | {sign}{r['target']:.2f} | "
                   f"{r['share']:.3f} | {(r['share'] - r['target']) * 100:+.1f} | {r['charged']:.3f} | "
                   f"{r['running'] / r['solo']:.3f} | {r['switches']:.0f} | {r['sm_mhz']:.0f} | "
                   f"{r['rate']:.1f} | {r['solo']:.1f} |")
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--cases", default="all", help="comma-separated substrings of case names")
    parser.add_argument("--slice-ms", type=float, metavar="MS",
                        help=f"the scheduler's slice (default {PolicyParams().slice_ns / 1e6:g} ms; at most "
                             "max_slice grows with it)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    pin_self()
    if not GATE.exists():
        print(f"{GATE} is missing: run `make gate` first", file=sys.stderr)
        return 2
    cases = [c for c in CASES if args.cases == "all" or any(s in c.name for s in args.cases.split(","))]
    gpus = visible_gpus()
    for case in [c for c in cases if c.gpus > gpus]:
        print(f"skipped: {case.name} (needs {case.gpus} GPUs, torch sees {gpus})", flush=True)
    cases = [c for c in cases if c.gpus <= gpus]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="gemtrace-sched-") as tmp:
        params = None
        if args.slice_ms is not None:
            if args.slice_ms <= 0:
                parser.error("--slice-ms must be positive")
            slice_ns = int(args.slice_ms * 1e6)
            params = PolicyParams(slice_ns=slice_ns, max_slice_ns=max(PolicyParams().max_slice_ns, slice_ns))
        rig = Rig(Path(tmp), params)
        try:
            solo: dict[tuple[str, int], float] = {}  # (work, GPU) -> it/s alone and ungated
            for kind, device in sorted({(load.kind, load.device) for c in cases for load in c.loads
                                        if load.kind != "idle"}):
                alone = rig.run((Load(f"solo-{kind}", kind=kind, gated=False, device=device),),
                                args.warmup, args.seconds)[f"solo-{kind}"]
                solo[kind, device] = alone["rate"]
                # The same work alone through the gate, uncapped: what the gate and the scheduler cost
                # a group that is never held (it should be 1.00).
                gated = rig.run((Load(f"gated-{kind}", kind=kind, device=device),), args.warmup,
                                args.seconds)[f"gated-{kind}"]
                print(f"solo {kind} on GPU {device}: {alone['rate']:.1f} it/s ungated at {alone['sm_mhz']:.0f} "
                      f"MHz; gated uncapped alone {gated['rate'] / alone['rate']:.3f} of it", flush=True)
            for case in cases:
                rates = rig.run(case.loads, args.warmup, args.seconds)
                for load in case.loads:
                    if load.group not in case.targets:
                        continue
                    target, kind = case.targets[load.group]
                    base = solo[load.kind, load.device]
                    got = rates[load.group]
                    rows.append({"case": case.name, "group": load.group, "gpu": load.device, "work": load.kind,
                                 "target": target, "kind": kind, **got, "solo": base,
                                 "share": got["rate"] / base})
                print(table(rows[-len(case.targets):]).split("\n", 2)[2], flush=True)
        finally:
            rig.close()
    text = table(rows)
    slice_note = "" if args.slice_ms is None else f"; slice {args.slice_ms:g} ms"
    header = (f"{stamp()}, {rig.device}, {platform.node()}{slice_note}; {args.seconds:g} s windows after "
              f"{args.warmup:g} s warm-up; share = it/s shared / it/s alone ungated")
    ok = all(abs(r["share"] - r["target"]) <= 0.02 if r["kind"] == "=" else r["share"] >= r["target"] - 0.02
             for r in rows if r["kind"] != "~")
    publish(f"{header}\n\n{text}\n", "scheduler_torch", {"header": header, "rows": rows})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
