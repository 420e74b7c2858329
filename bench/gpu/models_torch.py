"""Throughput of real models under gemtrace's quotas, through the product only (issue 13, first part).

Each run starts `gemtrace agent` (a temporary state dir and resource file of its own, --no-ebpf unless
--ebpf) and each group's processes with `gemtrace run --group NAME -- python3 bench/gpu/models_worker.py
WORKLOAD`; no scheduler runs in this process. The workers warm up, then count the steps they finish in
one window that they all share (models_worker.py's protocol), and per group the bench prints:
  time charged   the agent's gemtrace_group_gpu_seconds_total over the window / the window
  throughput     the group's steps per second (all its processes) / the same workload's solo rate
Solo is the workload alone, gated, in a group with no quota, measured before AND after the cases (a
GPU machine drifts: clocks, heat); the table shows both and divides by their mean. A group of two
processes (4x2) is compared with two processes alone: they share the GPU by the driver's time slicing
even without gemtrace.

Workloads (models_worker.py; random weights, nothing downloaded):
  cnn-train          ResNet-50, batch 64, 224x224, bf16 autocast, SGD
  transformer-train  a GPT-style nn.TransformerEncoder (6 layers, d_model 1024, seq 512, batch 8), AdamW, bf16
  cnn-infer          ResNet-18, batch 1, inference_mode
  transformer-infer  the same encoder, batch 1, seq 128, inference_mode, bf16
Cases (CASES) and their targets (issue 13):
  caps     two groups, MaxUtil 0.3 and 0.7            each within 2 points of its cap (3 for inference)
  minutil  MinUtil 0.6 beside two uncapped hogs        the guaranteed group >= 0.58 (hogs: cnn-train)
  maxutil  MaxUtil 0.5 alone                           0.5 +- 0.02
  4x2      4 groups capped 0.1/0.2/0.3/0.4, 2 processes each   each within 2 points; agent CPU <= 2% of a core
  fair     no quotas: a loop sleeping 4 ms between steps (a data loader's CPU work) beside one that never
           pauses                                      the pausing loop >= 0.42 (an even split is 0.5, less
           the slice of usage the policy lets one group lead by, and its switches)
The training workloads run every case, the inference ones the caps case. The agent's CPU (psutil, over
the window, % of one core) is printed for every run.

Default plan: every case above, in PLAN's order (ResNet-50 training first, then the inference caps,
then the transformer training), within --budget-s (480 s): before each case the bench estimates the time
left from the runs so far (--seconds plus each run's measured start and stop) and skips, with a printed
line, a case that would not leave room for the solo runs after. With 10 s windows the whole plan is 19
runs, about 7.5 minutes on an H100 at ~12 s of start-up per run.

    python3 -m bench.gpu.models_torch [--cases caps,minutil,maxutil,4x2] [--workloads cnn-train,...]
        [--seconds 10] [--settle 2] [--budget-s 480] [--ebpf] [--gpu 0] [--stand-in]

Prints a markdown table; with $OUT set, writes models_torch.md and models_torch.json there. Exit status
0 when every target was met, 1 when one was missed, 2 on bad usage or a run that failed. Needs, from the
repo root: build/libgemgate.so (`make -C hook BUILD=$PWD/build`), torch with CUDA and torchvision, and
what the agent needs (psutil, nvidia-ml-py, prometheus-client, structlog) on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.gpu.models_worker import WORKLOADS
from bench.gpu.scheduler_torch import end, json_lines, pin_self, pin_worker, worker_cpu
from bench.recording import REPO, gpus, publish, stamp
from gemtrace.metrics import spec
from tests.testkit import free_port

WORKER = Path(__file__).resolve().parent / "models_worker.py"
GATE = REPO / "build" / "libgemgate.so"
GROUP_SECONDS = spec("gemtrace_group_gpu_seconds_total").name
GPU_INFO = spec("gemtrace_gpu_info").name
GROUP_MEMORY = spec("gemtrace_group_memory_bytes").name
GROUP_MANAGED = spec("gemtrace_group_managed_memory_bytes").name
TRAINING = ("cnn-train", "transformer-train")
INFERENCE = ("cnn-infer", "transformer-infer")
HOG_WORKLOAD = "cnn-train"  # the hogs beside a MinUtil group run the CNN training, whatever it runs
START_UP_GUESS_S = 12.0  # a run's start and stop before any was measured: agent, torch, warm-up, teardown
READY_TIMEOUT_S = 300.0  # 8 processes importing torch and warming up under caps of 0.05 each


@dataclass(frozen=True)
class Target:
    low: float
    high: float
    text: str

    def met(self, value: float) -> bool:
        return self.low <= value <= self.high


def share(value: float, points: float) -> Target:
    return Target(value - points / 100, value + points / 100, f"{value:.2f} ± {points / 100:.2f}")


@dataclass(frozen=True)
class GroupSpec:
    name: str
    min_util: float = 0.0
    max_util: float = 1.0
    processes: int = 1
    workload: str | None = None  # None: the case's workload
    target: Target | None = None  # on its throughput against solo; None: shown, not judged
    priority: int = 0
    worker_args: tuple[str, ...] = ()  # more arguments of models_worker.py (--pause-ms)
    isolation: str = "time"  # the resource file's Isolation (bench/gpu/mps.py runs "mps")
    opportunistic: bool = False  # the resource file's Opportunistic (bench/gpu/colocation.py)
    env: tuple[tuple[str, str], ...] = ()  # more environment for its processes (GEMTRACE_BESIDE_KERNELS)
    memory_limit: str | None = None  # the resource file's MemoryLimit (bench/gpu/gate_torch.py)

    def quota(self) -> str:
        parts = ([f"MinUtil {self.min_util:g}"] if self.min_util else []) + \
                ([f"MaxUtil {self.max_util:g}"] if self.max_util < 1 else [])
        return ", ".join(parts) or "none"

    def conf(self) -> str:
        return f"[{self.name}]\n" + (f"MinUtil = {self.min_util:g}\n" if self.min_util else "") + \
               (f"MaxUtil = {self.max_util:g}\n" if self.max_util < 1 else "") + \
               (f"Priority = {self.priority}\n" if self.priority else "") + \
               (f"Isolation = {self.isolation}\n" if self.isolation != "time" else "") + \
               ("Opportunistic = yes\n" if self.opportunistic else "") + \
               (f"MemoryLimit = {self.memory_limit}\n" if self.memory_limit else "")


@dataclass(frozen=True)
class Case:
    name: str  # what --cases names
    title: str
    workloads: tuple[str, ...]
    # The groups for a workload: short kernels get 3 points (issue 13, "Short kernels"), training 2.
    points: dict[str, float]

    def groups(self, workload: str) -> tuple[GroupSpec, ...]:
        pts = self.points["inference" if workload in INFERENCE else "training"]
        if self.name == "caps":
            return (GroupSpec("capped30", max_util=0.3, target=share(0.3, pts)),
                    GroupSpec("capped70", max_util=0.7, target=share(0.7, pts)))
        if self.name == "minutil":
            return (GroupSpec("reserved60", min_util=0.6, target=Target(0.58, math.inf, "≥ 0.58")),
                    GroupSpec("hog1", workload=HOG_WORKLOAD), GroupSpec("hog2", workload=HOG_WORKLOAD))
        if self.name == "maxutil":
            return (GroupSpec("capped50", max_util=0.5, target=share(0.5, pts)),)
        if self.name == "fair":
            return (GroupSpec("pausing", worker_args=("--pause-ms", "4"), target=Target(0.42, math.inf, "≥ 0.42")),
                    GroupSpec("steady"))
        if self.name == "4x2":
            return tuple(GroupSpec(f"capped{cap}", max_util=cap / 100, processes=2, target=share(cap / 100, pts))
                         for cap in (10, 20, 30, 40))
        raise ValueError(self.name)


BOTH = {"training": 2.0, "inference": 3.0}
CASES = (
    Case("caps", "caps 0.3 / 0.7", TRAINING + INFERENCE, BOTH),
    Case("minutil", "MinUtil 0.6 beside two uncapped hogs", TRAINING, BOTH),
    Case("maxutil", "MaxUtil 0.5 alone", TRAINING, BOTH),
    Case("4x2", "4 groups capped 0.1/0.2/0.3/0.4, 2 processes each", TRAINING, BOTH),
    Case("fair", "no quotas, a loop pausing 4 ms between steps beside one that never pauses", TRAINING, BOTH),
)
CASE = {c.name: c for c in CASES}
# The order the default plan runs in, most telling first: what a budget cut drops comes last.
PLAN = (("caps", "cnn-train"), ("minutil", "cnn-train"), ("maxutil", "cnn-train"), ("4x2", "cnn-train"),
        ("fair", "cnn-train"), ("caps", "cnn-infer"), ("caps", "transformer-infer"), ("caps", "transformer-train"),
        ("minutil", "transformer-train"), ("maxutil", "transformer-train"), ("4x2", "transformer-train"))
SOLO = GroupSpec("solo")
AGENT_CPU_TARGET = 2.0  # % of one core, with 8 processes in 4 capped groups (issue 13)


def product_env() -> dict[str, str]:
    """This process's environment for the agent and `gemtrace run`: this checkout's package first on
    PYTHONPATH, and its gate."""
    return {**os.environ, "GEMTRACE_GATE": str(GATE),
            "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}


def gemtrace(*args: str) -> list[str]:
    return [sys.executable, "-m", "gemtrace.cli", *args]


class RunFailed(RuntimeError):
    """A run that gave no figures: the message says which process and shows its output's end."""


class Worker:
    """One `gemtrace run -- models_worker.py` process, its JSON lines read as they come."""

    def __init__(self, group: GroupSpec, workload: str, state: Path, env: dict[str, str], log: Path,
                 cpu: int | None, stand_in: bool) -> None:
        self.group, self.workload, self.log = group, workload, log
        argv = gemtrace("run", "--group", group.name, "--state-dir", str(state), "--require-agent", "--",
                        sys.executable, str(WORKER), workload, *(["--stand-in"] if stand_in else []),
                        *group.worker_args)
        self.proc = subprocess.Popen(argv, env=env, cwd=REPO, text=True, preexec_fn=pin_worker(cpu),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log.open("w"))
        self.ready: dict[str, Any] | None = None
        self.result: dict[str, Any] | None = None
        self.done = False
        self.seen = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for obj in json_lines(self.proc.stdout):
            with self.seen:
                if obj.get("ready"):
                    self.ready = obj
                elif obj.get("result"):
                    self.result = obj
                self.seen.notify_all()
        with self.seen:
            self.done = True  # its output ended: nothing more will come
            self.seen.notify_all()

    def wait(self, key: str, deadline: float) -> dict[str, Any]:
        with self.seen:
            while getattr(self, key) is None and not self.done and time.monotonic() < deadline:
                self.seen.wait(min(max(deadline - time.monotonic(), 0.0), 1.0))
            value: dict[str, Any] | None = getattr(self, key)
        if value is None:
            tail = "".join(self.log.read_text(errors="replace").splitlines(keepends=True)[-15:])
            state = f"exited {self.proc.returncode}" if self.proc.poll() is not None else "still running"
            raise RunFailed(f"{self.group.name} ({self.workload}) gave no {key} line ({state}); "
                            f"its stderr ends:\n{tail}")
        return value

    def start(self, start: float, end: float) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"start": start, "end": end}) + "\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        end(self.proc)


class Agent:
    """`gemtrace agent` on a resource file of the run's groups, in a state dir of its own."""

    def __init__(self, work: Path, groups: tuple[GroupSpec, ...], env: dict[str, str], ebpf: bool,
                 log_level: str = "info") -> None:
        self.work = work
        config = work / "resource.conf"
        config.write_text("\n".join(g.conf() for g in groups))
        self.state = work / "state"
        self.url = f"http://127.0.0.1:{free_port()}/metrics"
        self.log = work / "agent.log"
        self.proc = subprocess.Popen(
            gemtrace("agent", "--config", str(config), "--state-dir", str(self.state), "--listen",
                     self.url.split("/")[2], "--log-level", log_level, *([] if ebpf else ["--no-ebpf"])),
            env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=self.log.open("w"))
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RunFailed(f"the agent did not serve {self.url}; its log ends:\n" +
                                "\n".join(self.log.read_text(errors="replace").splitlines()[-15:]))
            try:
                if GPU_INFO in self.metrics():
                    break
            except OSError:
                pass
            time.sleep(0.1)

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url, timeout=10) as r:
            return str(r.read().decode())

    def gpu_uuid(self, index: int) -> str:
        from prometheus_client.parser import text_string_to_metric_families

        for family in text_string_to_metric_families(self.metrics()):
            for s in family.samples:
                if s.name == GPU_INFO and s.labels.get("index") == str(index):
                    return str(s.labels["gpu"])
        raise RunFailed(f"the agent schedules no GPU of index {index}: choose one `nvidia-smi -L` lists with --gpu")

    def charged(self, uuid: str) -> tuple[float, dict[str, float]]:
        """GPU seconds the agent charged each group on the GPU so far, and when (the middle of the scrape)."""
        when, by_gpu = self.charged_on((uuid,))
        return when, by_gpu[uuid]

    def charged_on(self, uuids: tuple[str, ...]) -> tuple[float, dict[str, dict[str, float]]]:
        """`charged` for several GPUs from one scrape: read one scrape a GPU, a later GPU's figures were
        read later, and at a window's end, where the jobs beside a job stop, that shifted its share."""
        from prometheus_client.parser import text_string_to_metric_families

        before = time.monotonic()
        text = self.metrics()
        when = (before + time.monotonic()) / 2
        out: dict[str, dict[str, float]] = {uuid: {} for uuid in uuids}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == GROUP_SECONDS and s.labels.get("gpu") in out:
                    groups = out[s.labels["gpu"]]
                    groups[s.labels["group"]] = groups.get(s.labels["group"], 0.0) + float(s.value)
        return when, out

    def held(self, uuid: str) -> dict[str, dict[str, float]]:
        """Each group's device and managed memory on the GPU now: {group: {"memory": B, "managed": B}}."""
        from prometheus_client.parser import text_string_to_metric_families

        names = {GROUP_MEMORY: "memory", GROUP_MANAGED: "managed"}
        out: dict[str, dict[str, float]] = {}
        for family in text_string_to_metric_families(self.metrics()):
            for s in family.samples:
                if s.name in names and s.labels.get("gpu") == uuid:
                    group = out.setdefault(s.labels["group"], {"memory": 0.0, "managed": 0.0})
                    group[names[s.name]] += float(s.value)
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class Options:
    seconds: float
    settle: float
    ebpf: bool
    gpu: int
    stand_in: bool


def run(groups: tuple[GroupSpec, ...], workload: str, opts: Options) -> dict[str, Any]:
    """One agent, the groups' workers, one shared window. Per group: `rate` (steps/s of all its
    processes), `iters`, `charged` (GPU time charged / window), `results` (its workers' result lines),
    `memory` and `managed` (bytes held on the GPU at the window's end); `agent_cpu` (% of one core), and
    `window` (its start and end, time.monotonic())."""
    import psutil

    env = product_env()
    with tempfile.TemporaryDirectory(prefix="gemtrace-models-") as tmp:
        work = Path(tmp)
        if opts.stand_in and "SIMGPU_STATE_DIR" not in env:
            # Run by hand (tests set up their own): a simulated GPU of this run's, from build/simgpu.
            env["LD_LIBRARY_PATH"] = os.pathsep.join([str(REPO / "build" / "simgpu"),
                                                      *filter(None, [env.get("LD_LIBRARY_PATH")])])
            env["SIMGPU_STATE_DIR"] = str(work / "sim")
        agent = Agent(work, groups, env, opts.ebpf)
        workers: list[Worker] = []
        try:
            uuid = agent.gpu_uuid(opts.gpu)
            worker_env = {**env, "CUDA_VISIBLE_DEVICES": uuid}
            for g in groups:
                for n in range(g.processes):
                    workers.append(Worker(g, g.workload or workload, agent.state, {**worker_env, **dict(g.env)},
                                          work / f"{g.name}-{n}.log", worker_cpu(len(workers)), opts.stand_in))
            deadline = time.monotonic() + READY_TIMEOUT_S
            about = [w.wait("ready", deadline) for w in workers][0]
            time.sleep(opts.settle)  # every process stepping under the scheduler: its steady state
            start = time.monotonic() + 0.5
            end = start + opts.seconds
            for w in workers:
                w.start(start, end)
            cpu = psutil.Process(agent.proc.pid)
            time.sleep(max(0.0, start - time.monotonic()))
            cpu.cpu_percent(None)
            t0, charged0 = agent.charged(uuid)
            time.sleep(max(0.0, end - time.monotonic()))
            t1, charged1 = agent.charged(uuid)
            held = agent.held(uuid)
            agent_cpu = cpu.cpu_percent(None)
            # A held process ends its step past the window's end within the step's time / its share.
            results = [w.wait("result", time.monotonic() + 120) for w in workers]
        finally:
            for w in workers:
                w.stop()
            agent.stop()
    out: dict[str, Any] = {"groups": {}, "agent_cpu": agent_cpu, "about": about, "window": (start, end)}
    for g in groups:
        mine = [r for w, r in zip(workers, results, strict=True) if w.group is g]
        out["groups"][g.name] = {
            "workload": g.workload or workload, "rate": sum(r["rate"] for r in mine),
            "iters": sum(r["iters"] for r in mine), "results": mine,
            "charged": (charged1.get(g.name, 0.0) - charged0.get(g.name, 0.0)) / (t1 - t0),
            **held.get(g.name, {"memory": 0.0, "managed": 0.0})}
    return out


def text(value: object) -> str:
    """An NVML string: bytes from older nvidia-ml-py, str from newer."""
    return value.decode() if isinstance(value, bytes) else str(value)


def report_header(about: dict[str, str], args: argparse.Namespace, what_ran: str, began: float) -> str:
    """The dated heading of a bench/gpu report: the machine and its software, how the agent ran,
    `what_ran` (the bench's own words), and how long it all took."""
    software = ", ".join(f"{k} {about[k]}" for k in ("torch", "torchvision", "cuda") if k in about)
    return (f"## {stamp()}, {gpus()}, {platform.node()}"
            f"{', ' + software if software else ''}\n\n"
            f"`gemtrace agent{'' if args.ebpf else ' --no-ebpf'}` and `gemtrace run`, one agent per run; "
            f"{what_ran}; {(time.monotonic() - began) / 60:.1f} min in all"
            f"{' (stand-in workers on the simulated GPU)' if args.stand_in else ''}.")


def render(header: str, solo: dict[str, dict[str, float]], rows: list[dict[str, Any]],
           cpu: list[dict[str, Any]], skipped: list[str]) -> str:
    lines = [header, "", "Solo: the workload alone, gated, in a group with no quota, in as many processes as the "
             "groups compared with it (steps/s):", "",
             "| workload | before | after | after / before | mean (the reference) |", "| --- | --- | --- | --- | --- |"]
    for workload, s in solo.items():
        after = f"{s['after']:.2f}" if "after" in s else "-"
        drift = f"{s['after'] / s['before']:.3f}" if "after" in s else "-"
        lines.append(f"| {workload} | {s['before']:.2f} | {after} | {drift} | {s['mean']:.2f} |")
    lines += ["", "| case | workload | group | processes | quota | time charged | throughput (of solo) | steps/s "
              "| target | result |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        thr = "-" if r["throughput"] is None else f"{r['throughput']:.3f}"
        lines.append(f"| {r['case']} | {r['workload']} | {r['group']} | {r['processes']} | {r['quota']} | "
                     f"{r['charged']:.3f} | {thr} | {r['rate']:.2f} | {r['target'] or '-'} | {r['result']} |")
    lines += ["", "Agent CPU over each window (% of one core):", "",
              "| case | workload | processes | groups | agent CPU | target | result |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for c in cpu:
        lines.append(f"| {c['case']} | {c['workload']} | {c['processes']} | {c['groups']} | {c['agent_cpu']:.1f}% | "
                     f"{c['target'] or '-'} | {c['result']} |")
    if skipped:
        lines += ["", "Not run: " + "; ".join(skipped) + "."]
    return "\n".join(lines) + "\n"


def solo_key(workload: str, processes: int) -> str:
    """The solo table's row: the workload, and how many processes ran it where more than one."""
    return workload if processes == 1 else f"{workload}, {processes} processes"


def parse_list(text: str, known: tuple[str, ...], what: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{what} {', '.join(unknown) or '(none)'}: choose among {', '.join(known)}")
    return names


def parser(doc: str | None, seconds: float, settle: float = 2.0, *, agent: bool = True,
           paced: bool = False) -> argparse.ArgumentParser:
    """The options of every bench built on `run`: the window, the settling before it, the GPU, with
    `agent` the agent's eBPF probes and the stand-in workers, and with `paced` the pause of a service
    between requests. The bench adds its own after them."""
    ap = argparse.ArgumentParser(description=(doc or "").split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=seconds,
                    help=f"the measured window of each run (default {seconds:g})")
    ap.add_argument("--settle", type=float, default=settle,
                    help=f"seconds between the last process's warm-up and the window (default {settle:g})")
    ap.add_argument("--gpu", type=int, default=0, help="the GPU (NVML index) the workers run on (default 0)")
    if agent:
        ap.add_argument("--ebpf", action="store_true", help="run the agent with its eBPF probes (root, bcc)")
        ap.add_argument("--stand-in", action="store_true",
                        help="workers run the simulated GPU's kernels instead of torch (no GPU needed)")
    if paced:
        ap.add_argument("--pause-ms", type=float, default=20.0,
                        help="the service's pause between an answer and its next request (default 20)")
    return ap


def options(ap: argparse.ArgumentParser, args: argparse.Namespace) -> Options | None:
    """The runs' Options, once the window makes sense (else a usage error) and the gate is built (else
    None, having said how to build it); this process is then pinned off the workers' cores."""
    if args.seconds <= 0 or args.settle < 0 or getattr(args, "pause_ms", 0) < 0:
        ap.error("--seconds must be positive, --settle and --pause-ms not negative")
    if not GATE.exists():
        print(f"{GATE} is missing: run `make -C hook BUILD=$PWD/build` from the repo root first", file=sys.stderr)
        return None
    pin_self()
    return Options(args.seconds, args.settle, getattr(args, "ebpf", False), args.gpu, getattr(args, "stand_in", False))


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, seconds=10.0)
    ap.add_argument("--cases", type=lambda t: parse_list(t, tuple(CASE), "case"), default=tuple(CASE),
                    help=f"comma-separated, among {','.join(CASE)} (default all)")
    ap.add_argument("--workloads", type=lambda t: parse_list(t, WORKLOADS, "workload"), default=WORKLOADS,
                    help=f"comma-separated, among {','.join(WORKLOADS)} (default all); each case runs those it "
                    "covers")
    ap.add_argument("--budget-s", type=float, default=480.0,
                    help="skip the cases that would end past this many seconds from the start, solo runs after "
                    "included (default 480; 0: no limit)")
    args = ap.parse_args(argv)
    opts = options(ap, args)
    if opts is None:
        return 2
    plan = [(c, w) for c, w in PLAN if c in args.cases and w in args.workloads]
    if not plan:
        ap.error("no case covers those workloads: caps runs every workload, minutil, maxutil and 4x2 the training ones")
    # Each judged group's reference: its workload alone, in as many processes as the group has (two
    # processes of one group share the GPU by the driver's time slicing even alone, and that is no
    # cost of gemtrace's).
    solo_runs = sorted({(g.workload or w, g.processes) for c, w in plan for g in CASE[c].groups(w) if g.target},
                       key=lambda run: (WORKLOADS.index(run[0]), run[1]))
    began = time.monotonic()
    spent: list[float] = []  # each run's time beyond its window: start-up, warm-up, settle, stop

    def timed(groups: tuple[GroupSpec, ...], workload: str) -> dict[str, Any]:
        t = time.monotonic()
        result = run(groups, workload, opts)
        spent.append(time.monotonic() - t - opts.seconds)
        return result

    def per_run() -> float:
        return opts.seconds + (sum(spent) / len(spent) if spent else START_UP_GUESS_S)

    estimate = per_run() * (len(plan) + 2 * len(solo_runs))
    print(f"plan: solo {', '.join(solo_key(*run) for run in solo_runs)}; " + "; ".join(f"{c} {w}" for c, w in plan) +
          f"; then solo again: {len(plan) + 2 * len(solo_runs)} runs, about {estimate / 60:.1f} min", flush=True)
    about: dict[str, Any] = {}
    solo: dict[str, dict[str, float]] = {}
    rows: list[dict[str, Any]] = []
    targets: list[Target | None] = []  # rows' targets, judged once solo after is known
    cpu_rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    try:
        for w, n in solo_runs:
            r = timed((replace(SOLO, processes=n),), w)
            about = about or r["about"]
            solo[solo_key(w, n)] = {"before": r["groups"]["solo"]["rate"]}
            print(f"solo before {solo_key(w, n)}: {r['groups']['solo']['rate']:.2f} steps/s, "
                  f"charged {r['groups']['solo']['charged']:.3f}", flush=True)
    except RunFailed as e:
        print(f"a solo run failed, so nothing can be compared: {e}", file=sys.stderr)
        return 2
    failed = False
    for case_name, w in plan:
        case = CASE[case_name]
        left = args.budget_s - (time.monotonic() - began)
        if args.budget_s and per_run() * (1 + len(solo_runs)) > left:
            skipped.append(f"{case.name} {w} (budget: {left:.0f} s left, a run takes about {per_run():.0f} s)")
            print(f"skipped: {skipped[-1]}", flush=True)
            continue
        groups = case.groups(w)
        try:
            r = timed(groups, w)
        except RunFailed as e:  # the other cases' figures still count: say which failed and go on
            failed = True
            skipped.append(f"{case.name} {w} (failed: {str(e).splitlines()[0]})")
            print(f"a run failed ({case.name} {w}): {e}", file=sys.stderr)
            continue
        for g in groups:
            got = r["groups"][g.name]
            rows.append({"case": case.title, "case_name": case.name, "workload": got["workload"], "group": g.name,
                         "processes": g.processes, "quota": g.quota(), "charged": got["charged"],
                         "rate": got["rate"], "iters": got["iters"], "target": g.target.text if g.target else None})
            targets.append(g.target)
        judged = case.name == "4x2"  # the figure: 8 processes in 4 capped groups
        cpu_rows.append({"case": case.title, "workload": w, "processes": sum(g.processes for g in groups),
                         "groups": len(groups), "agent_cpu": r["agent_cpu"],
                         "target": f"≤ {AGENT_CPU_TARGET:g}%" if judged else None,
                         "result": ("met" if r["agent_cpu"] <= AGENT_CPU_TARGET else "missed") if judged else "-"})
        print("  ".join(f"{row['group']}: charged {row['charged']:.3f}, {row['rate']:.2f} steps/s"
                        for row in rows[-len(groups):]) + f"; agent CPU {r['agent_cpu']:.1f}% ({case.name} {w})",
              flush=True)
    for w, n in solo_runs:
        key = solo_key(w, n)
        try:
            solo[key]["after"] = timed((replace(SOLO, processes=n),), w)["groups"]["solo"]["rate"]
            print(f"solo after {key}: {solo[key]['after']:.2f} steps/s", flush=True)
        except RunFailed as e:  # the reference is then solo before alone, as the table shows
            failed = True
            print(f"solo after {key} failed: {e}", file=sys.stderr)
    for s in solo.values():
        s["mean"] = (s["before"] + s["after"]) / 2 if "after" in s else s["before"]
    for row, target in zip(rows, targets, strict=True):
        ref = solo.get(solo_key(row["workload"], row["processes"]))
        row["throughput"] = row["rate"] / ref["mean"] if ref else None
        row["result"] = "-" if target is None or row["throughput"] is None else \
            "met" if target.met(row["throughput"]) else "missed"
    ok = all(row["result"] != "missed" for row in rows + cpu_rows)
    elapsed = time.monotonic() - began
    header = report_header(about, args, f"{args.seconds:g} s windows after {args.settle:g} s of settling; throughput = "
                           "steps/s of the group's processes / the mean of solo before and after", began)
    report = render(header, solo, rows, cpu_rows, skipped)
    publish(report, "models_torch", {"header": header, "about": about, "seconds": args.seconds, "elapsed_s": elapsed,
                                     "solo": solo, "rows": rows, "agent_cpu": cpu_rows, "skipped": skipped})
    return 2 if failed else 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
