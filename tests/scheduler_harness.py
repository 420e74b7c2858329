"""Scheduler accuracy on the simulated GPU: the rig shared by tests/test_scheduler_e2e.py and
bench/bench_scheduler_accuracy.py.

It runs what the agent would, minus the agent: a Region in a private state dir with the simulated
GPUs' NVML UUIDs, one GpuScheduler thread per GPU, a heartbeat thread (gates ignore a silent agent)
that also decides new processes' groups as the agent does (gemtrace/agent/membership.py, every group open
to all), and gated launch loops (build/libgemgate.so preloaded, GEMTRACE_GROUP set) as each group's processes.
A group's device share is the kernel time its processes completed over a window in the middle of
the run (read from the clients' once-a-second progress lines) divided by the window's length; its
share, as on the H100 (throughput shared / solo), is that divided by the device share the same work
gets alone on a GPU without a gate (a launch loop cannot keep a GPU 100% busy: it waits for each
sync to return). That reference runs side by side with the case, over the same window, on the rig's
last GPU, which the case leaves free: a loop's speed is partly its CPU's (each sync's wake-up, each
launch), so a reference measured at another time, under another load on the host, moves the ratio;
one measured beside the case loses to the host what the case's loops lose.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from simgpu_env import REPO, RT_CLIENT, Client, SimGpu

from gemtrace import defaults
from gemtrace.agent.membership import Membership
from gemtrace.agent.policy import MS, GroupUsage, PolicyParams
from gemtrace.agent.scheduler import GpuScheduler, Quota
from gemtrace.region import Region

GATE = REPO / "build" / "libgemgate.so"
KERNEL_NS = 2 * MS  # the benchmark: 2 ms kernels
# A few kernels then a sync, as a training step does: one 2 ms kernel per sync leaves the GPU idle
# while the process wakes from each sync (5% here), four leave 1-2%.
PER_ITER = 4


@dataclass(frozen=True)
class Load:
    """A group and its work: `processes` launch loops on each of `devices`."""

    group: str
    quota: Quota = Quota()
    processes: int = 1
    devices: tuple[int, ...] = (0,)
    gated: bool = True
    launches_per_iter: int = PER_ITER  # kernels between two syncs
    syncs: bool = True  # False: never synchronises (the driver's queue fills and paces the launches)
    # Launch on a stream of its own while this device's context is current (PyTorch on cuda:1 keeps
    # device 0's current): None for the default stream of the load's device.
    current_device: int | None = None
    kernel_ns: int = KERNEL_NS
    cpu_ns: int = 0  # CPU spun before each launch (launch-loop --cpu-ns): launch-bound if above kernel_ns


@dataclass(frozen=True)
class Case:
    """A benchmark case: loads sharing the GPUs, and the share each (group, device) must get."""

    name: str
    loads: tuple[Load, ...]
    # (group, device) -> (target share, "=" for within tolerance, ">=" for at least)
    targets: dict[tuple[str, int], tuple[float, str]] = field(default_factory=dict)


# The four cases of issue 3 ("Accuracy"), and the two-GPU one.
CASES = (
    Case("caps 0.3 / 0.7", (Load("capped30", Quota(0, 0.3)), Load("capped70", Quota(0, 0.7))),
         {("capped30", 0): (0.3, "="), ("capped70", 0): (0.7, "=")}),
    Case("MinUtil 0.2 alone", (Load("reserved20", Quota(0.2, 1.0)),),
         {("reserved20", 0): (0.97, ">=")}),
    Case("MaxUtil 0.5 alone", (Load("capped50", Quota(0, 0.5)),), {("capped50", 0): (0.5, "=")}),
    Case("MinUtil 0.6 vs two hogs", (Load("reserved60", Quota(0.6, 1.0)), Load("hog1"), Load("hog2")),
         {("reserved60", 0): (0.6, ">=")}),
)
# A process that syncs rarely, as a PyTorch training loop may (the CPU runs ahead): 100 kernels, 200 ms
# of GPU work, queued between two syncs, so a held group's drain outlasts the 50 ms drain timeout.
RARE_SYNC_PER_ITER = 100
RARE_SYNC = (
    Case("rare syncs: MaxUtil 0.5 alone", (Load("capped50", Quota(0, 0.5), launches_per_iter=RARE_SYNC_PER_ITER),),
         {("capped50", 0): (0.5, "=")}),
    Case("rare syncs: caps 0.3 / 0.7",
         (Load("capped30", Quota(0, 0.3), launches_per_iter=RARE_SYNC_PER_ITER),
          Load("capped70", Quota(0, 0.7), launches_per_iter=RARE_SYNC_PER_ITER)),
         {("capped30", 0): (0.3, "="), ("capped70", 0): (0.7, "=")}),
)
# A process that never synchronises (a loop whose CPU runs ahead until the driver's queue of 1024
# launches is full, as a PyTorch worker on cuda:1 calling torch.cuda.synchronize() for the current
# device 0 does): 2 s of work queued, unless the gate keeps it short.
NEVER_SYNC = (
    Case("never syncs: MaxUtil 0.5 alone", (Load("capped50", Quota(0, 0.5), syncs=False),),
         {("capped50", 0): (0.5, "=")}),
    Case("never syncs: caps 0.3 / 0.7",
         (Load("capped30", Quota(0, 0.3), syncs=False), Load("capped70", Quota(0, 0.7), syncs=False)),
         {("capped30", 0): (0.3, "="), ("capped70", 0): (0.7, "=")}),
)
# PyTorch on cuda:1 of a two-GPU host: launches on a stream of device 1 while device 0's context is
# current, and torch.cuda.synchronize() syncs device 0, so the loop never waits for its GPU.
ON_CUDA1_NEVER_SYNC = Case(
    "GPU 1 with device 0 current, never syncing: cap 0.4 + uncapped",
    (Load("capped40", Quota(0, 0.4), devices=(1,), syncs=False, current_device=0),
     Load("uncapped", devices=(1,), syncs=False, current_device=0)),
    {("capped40", 1): (0.4, "="), ("uncapped", 1): (0.6, "=")},
)
# Batch-1 inference (docs/scheduler.md, "What a share means"): kernels of 20 us, each after 30 us of
# the host's CPU (Python and the runtime), 12 then a sync. Alone the GPU is idle between the kernels
# inside each burst (about half the time here). A share is time with the GPU, gaps included, so a cap
# of c gives c of the solo throughput: a scheduler that took the gaps for idle time (revoking the
# holder, or charging only its kernels) would give the capped group more.
LAUNCH_BOUND_KERNEL_NS, LAUNCH_BOUND_CPU_NS, LAUNCH_BOUND_PER_ITER = 20_000, 30_000, 12


def launch_bound(group: str, quota: Quota) -> Load:
    return Load(group, quota, launches_per_iter=LAUNCH_BOUND_PER_ITER, kernel_ns=LAUNCH_BOUND_KERNEL_NS,
                cpu_ns=LAUNCH_BOUND_CPU_NS)


LAUNCH_BOUND_CAPS = Case(
    "launch-bound: caps 0.3 / 0.7", (launch_bound("capped30", Quota(0, 0.3)), launch_bound("capped70", Quota(0, 0.7))),
    {("capped30", 0): (0.3, "="), ("capped70", 0): (0.7, "=")})
LAUNCH_BOUND = (
    Case("launch-bound: MaxUtil 0.5 alone", (launch_bound("capped50", Quota(0, 0.5)),), {("capped50", 0): (0.5, "=")}),
    LAUNCH_BOUND_CAPS,
)
# The H100 benchmark's 4 x 2 (bench/gpu/models_torch.py): caps that add up to the whole GPU, so every
# hold and release costs some group its cap, and how that loss is shared shows.
FOUR_CAPPED = Case(
    "4 groups capped 0.1/0.2/0.3/0.4, 2 processes each",
    tuple(Load(f"capped{c}", Quota(0, c / 100), processes=2) for c in (10, 20, 30, 40)),
    {(f"capped{c}", 0): (c / 100, "=") for c in (10, 20, 30, 40)},
)
TWO_GPUS = Case(
    "2 GPUs, each its own",
    (Load("both40", Quota(0, 0.4), devices=(0, 1)), Load("gpu0only")),
    {("both40", 0): (0.4, "="), ("gpu0only", 0): (0.6, "="), ("both40", 1): (0.4, "=")},
)


@dataclass
class Rig:
    sim: SimGpu
    state_dir: Path
    region: Region
    schedulers: list[GpuScheduler]
    stop: threading.Event
    threads: list[threading.Thread]
    gate: Path = GATE
    client: Path = RT_CLIENT

    def scheduler_cpu_seconds(self) -> float:
        """CPU time the scheduler threads used so far (user + system)."""
        ids = {t.native_id for t in self.threads if t.name.startswith("scheduler")}
        return sum(t.user_time + t.system_time for t in psutil.Process().threads() if t.id in ids)

    def define(self, loads: Sequence[Load]) -> None:
        """Define the loads' groups in the region and give every GPU's scheduler their quotas."""
        quotas: dict[int, Quota] = {}
        for load in loads:
            index = self.region.set_group(load.group, None, load.quota.min_util, load.quota.max_util)
            quotas[index] = load.quota
        self.region.bump_generation()
        for scheduler in self.schedulers:
            scheduler.set_quotas(quotas)

    def start(self, load: Load, device: int, seconds: float) -> Client:
        extra = {defaults.ENV_STATE_DIR: str(self.state_dir), defaults.ENV_GROUP: load.group}
        if load.gated:
            extra["LD_PRELOAD"] = str(self.gate)
        args = ["launch-loop", "--kernel-ns", str(load.kernel_ns), "--launches-per-iter", str(load.launches_per_iter),
                *(("--cpu-ns", str(load.cpu_ns)) if load.cpu_ns else ()),
                "--seconds", f"{seconds:g}", "--progress",
                "--device", str(device), *(() if load.syncs else ("--no-sync",)),
                *(() if load.current_device is None else ("--stream", "--current-device", str(load.current_device)))]
        return self.sim.start(args, client=self.client, **extra)


@contextmanager
def rig(sim: SimGpu, state_dir: Path, gate: Path | None = None, client: Path | None = None,
        params: PolicyParams | None = None) -> Iterator[Rig]:
    """The rig over `sim`; `params`: the schedulers' (the defaults' where None)."""
    gate, client = gate or GATE, client or RT_CLIENT
    if not gate.exists():
        raise FileNotFoundError(f"{gate} is missing: run `make gate` first")
    found = sim.nvml(  # in a child: NVML binds one simulation per process
        "from gemtrace.gpus import discover\n"
        "emit({'gpus': [[gpu.uuid, gpu.memory_total] for gpu in discover()]})\n"
    )[0]["gpus"]
    region = Region.create(state_dir)
    region.set_gpus([(str(uuid), int(total)) for uuid, total in found])
    region.set_group(defaults.DEFAULT_GROUP, None, 0, 1)  # the agent always defines it
    membership = Membership(region, lambda: {})
    stop = threading.Event()
    schedulers = [GpuScheduler(region, gpu, params=params) for gpu in range(len(found))]
    threads = [threading.Thread(target=s.run, args=(stop,), name=f"scheduler-gpu{s.gpu}") for s in schedulers]

    def beat() -> None:
        while not stop.is_set():
            region.heartbeat(time.monotonic_ns())
            membership.tick()
            stop.wait(defaults.TICK_SECONDS)

    region.heartbeat(time.monotonic_ns())
    threads.append(threading.Thread(target=beat, name="heartbeat"))
    for thread in threads:
        thread.start()
    try:
        yield Rig(sim, state_dir, region, schedulers, stop, threads, gate, client)
    finally:
        stop.set()
        for thread in threads:
            thread.join(5)
        sim.close()
        region.stop()
        region.close()


def window_share(lines: Sequence[dict[str, Any]], start: float, end: float, kernel_ns: int = KERNEL_NS) -> float:
    """Kernel time per second of one client between its progress lines nearest `start` and `end`."""
    progress = [line for line in lines if line.get("progress")]
    first = min(progress, key=lambda p: abs(p["t"] - start))
    last = min(progress, key=lambda p: abs(p["t"] - end))
    if last["t"] <= first["t"]:
        raise ValueError(f"no progress between {start} s and {end} s: {progress}")
    return float((last["launches"] - first["launches"]) * kernel_ns / 1e9 / (last["t"] - first["t"]))


Shares = dict[tuple[str, int], float]


def measure(the_rig: Rig, loads: Sequence[Load], warmup: float, seconds: float,
            scheduled: Sequence[Load] = ()) -> Shares:
    """Run the loads together; the device share of each (group, device) over [warmup, warmup+seconds].
    The scheduled groups are those of the gated loads and of `scheduled` (groups with no work here)."""
    the_rig.define([*scheduled, *(load for load in loads if load.gated)])
    clients: list[tuple[Load, int, Client]] = []
    total = warmup + seconds + 1.0  # a second of tail: nobody's window sees another group stop
    for load in loads:
        for device in load.devices:
            for _ in range(load.processes):
                clients.append((load, device, the_rig.start(load, device, total)))
    shares: Shares = {}
    for load, device, client in clients:
        lines = client.finish(timeout=total + 60)
        key = (load.group, device)
        shares[key] = shares.get(key, 0.0) + window_share(lines, warmup, warmup + seconds, load.kernel_ns)
    return shares


REFERENCE = "reference"


def reference(the_rig: Rig, like: Load) -> Load:
    """`like`'s loop, one process ungated on the rig's last GPU: what 100% of a GPU means for that
    work, measured beside it (run it in the same `measure`; its share is at (REFERENCE, device))."""
    device = the_rig.sim.devices - 1
    return dataclasses.replace(like, group=REFERENCE, quota=Quota(), processes=1, devices=(device,), gated=False,
                               current_device=None)


def solo_share(the_rig: Rig, warmup: float, seconds: float, launches_per_iter: int = PER_ITER,
               syncs: bool = True, like: Load | None = None) -> float:
    """The device share of one launch loop alone on GPU 0 with no gate at all: `like`'s loop where
    given, else one of 2 ms kernels, `launches_per_iter` between syncs (`syncs`: or none)."""
    load = (dataclasses.replace(like, group="solo", quota=Quota(), processes=1, devices=(0,), gated=False)
            if like is not None else Load("solo", gated=False, launches_per_iter=launches_per_iter, syncs=syncs))
    return measure(the_rig, [load], warmup, seconds)[("solo", 0)]


def run_case(the_rig: Rig, case: Case, warmup: float, seconds: float, solo: float | None = None,
             ) -> list[dict[str, Any]]:
    """Rows (case, group, device, target, kind, device_share, reference, measured, split, together,
    alone, looks_per_s, switches_per_s) for the table and the asserts; `measured` is the share relative
    to `reference`: `solo` where given (1.0 for loops that never sync, which keep any GPU busy on their
    own), else the device share of the case's first loop run beside it on the rig's last GPU, which the
    case must leave free. `split` is the group's part of what all the case's groups on that GPU did
    together, `together` that sum relative to `reference`, `alone` whether the group had the GPU to
    itself, `charged` the part of the time it wanted that GPU which its scheduler charged it (its
    GPU seconds over those and its throttled seconds: the scheduler's clock, since the rig began,
    which must be fresh for the case), `charged_split` its GPU seconds' part of those of all the
    case's groups on that GPU. looks_per_s is how often that GPU's scheduler looked at the
    region (its wake-ups), switches_per_s how often it held a group."""
    loads = list(case.loads)
    if solo is None:
        beside = reference(the_rig, case.loads[0])
        if any(beside.devices[0] in load.devices for load in case.loads):
            raise ValueError(f"{case.name} runs on GPU {beside.devices[0]}, the reference's: "
                             "make the SimGpu with one more device")
        loads.append(beside)
    looks = [s.looks for s in the_rig.schedulers]
    switches = [s.switches for s in the_rig.schedulers]
    start = time.monotonic()
    shares = measure(the_rig, loads, warmup, seconds)
    elapsed = time.monotonic() - start
    base = solo if solo is not None else shares[(REFERENCE, loads[-1].devices[0])]
    on_device: dict[int, list[float]] = {}
    usages: dict[tuple[str, int], GroupUsage] = {}
    for (group, device), share in shares.items():
        if group != REFERENCE:
            on_device.setdefault(device, []).append(share)
            index = the_rig.region.group_index(group)
            usage = the_rig.schedulers[device].usage().get(index) if index is not None else None
            usages[(group, device)] = usage or GroupUsage(0.0, 0.0, 0.0)
    charged_on = {device: sum(u.gpu_seconds for (_, d), u in usages.items() if d == device) for device in on_device}
    rows = []
    for (group, device), (target, kind) in case.targets.items():
        share, together = shares[(group, device)], sum(on_device[device])
        usage = usages[(group, device)]
        wanted = usage.gpu_seconds + usage.throttled_seconds
        rows.append({"case": case.name, "group": group, "device": device, "target": target, "kind": kind,
                     "device_share": share, "reference": base, "measured": share / base,
                     "split": share / together, "together": together / base, "alone": len(on_device[device]) == 1,
                     "charged": usage.gpu_seconds / wanted if wanted else float("nan"),
                     "charged_split": usage.gpu_seconds / charged_on[device] if charged_on[device] else float("nan"),
                     "looks_per_s": (the_rig.schedulers[device].looks - looks[device]) / elapsed,
                     "switches_per_s": (the_rig.schedulers[device].switches - switches[device]) / elapsed})
    return rows


def within(row: dict[str, Any], points: float) -> bool:
    error = row["measured"] - row["target"]
    if row["kind"] == ">=":
        return bool(error >= -points / 100)
    return bool(abs(error) <= points / 100)
