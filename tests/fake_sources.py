"""Fakes of the accounting's sources, chosen by configuration: a test puts them in the Sources it
gives Accounting's constructor where the agent puts the real ones (FakeNvml is NVML's reader, under
the real NvmlSource), and the resource file it reads (`Config`, `group`). No root, no GPU, no bcc.

Each fake keeps the figures a test sets and turns them into readings through the same pure functions
as the real source (eBPF's maps -> figures: gemtrace/sources/ebpf/source.py), so what is tested is what
runs. FakeEbpf replays eBPF's allocation and exit events: its listeners are woken synchronously,
in the caller's thread, as the real watcher thread would wake them. Lives in tests/: it never ships.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from gemtrace import defaults
from gemtrace.config import GroupConfig
from gemtrace.sources import AllocationListener, Devices, Figures, Key, SourceReading
from gemtrace.sources.ebpf import memory_figures, usage_figures
from gemtrace.sources.ebpf.probes import Usage
from gemtrace.sources.nvml import NvmlProcess


def group(memory_limit: int | None = None, cgroups: tuple[str, ...] = ()) -> GroupConfig:
    """A resource file's group as the accounting reads it (open to every user)."""
    return GroupConfig("", memory_limit=memory_limit, cgroups=cgroups)


@dataclass
class Config:
    """The resource file as the accounting reads it: its groups by name."""

    groups: dict[str, GroupConfig]


class FakeEbpf:
    """eBPF as a test scripts it: `allocate`, `free` and `exit` change the maps and deliver the event."""

    def __init__(self, since_ticks: int | None = 0, mode: str = defaults.PROBE_MODE) -> None:
        """`since_ticks`: the probes' attach time in /proc ticks (processes started by then are
        inherited: eBPF may have missed their memory); 0 means none is."""
        self.since_ticks = since_ticks
        self.mode = mode
        self.missed: set[int] = set()  # pids that mapped a libcuda before it was probed
        self._bytes: dict[tuple[int, int], int] = {}  # (pid, ordinal) -> bytes
        self._last_alloc: dict[tuple[int, int], int] = {}
        self.contexts: dict[int, int] = {}  # pid -> ordinal of its context
        self.launches: dict[int, int] = {}
        self._exited: set[int] = set()
        self._listeners: list[AllocationListener] = []
        self._started = False
        self._woken = False
        self.last_alloc_ns: int | None = None

    status = "fake eBPF"
    probes_attached = 0
    libcuda_files = 0

    def subscribe(self, listener: AllocationListener) -> None:
        self._listeners.append(listener)

    def start(self) -> None:
        self._started = True
        self._deliver()  # as the real watcher's first look

    def nudge(self) -> None:
        self._woken = True

    def _deliver(self) -> None:
        if not self._started:
            return
        self._woken = False
        for listener in self._listeners:
            listener.on_allocation(self.last_alloc_ns)

    def deliver_pending(self) -> None:
        """What the watcher thread does after a nudge: wake the listeners if anything asked."""
        if self._woken:
            self._deliver()

    # -- events --------------------------------------------------------------------------------------

    def allocate(self, pid: int, ordinal: int, size: int, ts_ns: int, context: bool = True) -> None:
        key = (pid, ordinal)
        self._bytes[key] = self._bytes.get(key, 0) + size
        self._last_alloc[key] = ts_ns
        if context:
            self.contexts[pid] = ordinal
        self.last_alloc_ns = ts_ns
        self._deliver()

    def free(self, pid: int, ordinal: int, size: int) -> None:
        key = (pid, ordinal)
        self._bytes[key] = max(0, self._bytes.get(key, 0) - size)

    def exit(self, pid: int) -> None:
        """sched_process_exit: the bytes go at once, the records when the exit is reaped."""
        for key in [k for k in self._bytes if k[0] == pid]:
            self._bytes[key] = 0
        self.contexts.pop(pid, None)
        self._exited.add(pid)
        self._deliver()

    # -- readings ------------------------------------------------------------------------------------

    def _usage(self) -> list[Usage]:
        return [Usage(pid, dev, used, 1, self._last_alloc.get((pid, dev), 0))
                for (pid, dev), used in self._bytes.items()]

    def _reap(self, devices: Devices) -> None:
        gone, self._exited = self._exited, set()
        if gone:
            for key in [k for k in self._bytes if k[0] in gone]:
                del self._bytes[key]
            for pid in gone:
                self.launches.pop(pid, None)
            self.missed -= gone
            devices.forget(gone)

    def _reading(self, figures: dict[Key, Figures], alive: Collection[int] = ()) -> SourceReading:
        return SourceReading(figures, alive=frozenset(alive), since_ticks=self.since_ticks,
                             missed=frozenset(self.missed))

    def memory(self, devices: Devices) -> SourceReading:
        self._reap(devices)
        return self._reading(memory_figures(self._usage(), devices))

    def read(self, now_ns: int, devices: Devices) -> SourceReading:
        self._reap(devices)
        launches = self.launches if self.mode == "launches" else {}
        return self._reading(usage_figures(self._usage(), self.contexts, launches, devices), self.contexts)

    def stop_watching(self) -> None:
        self._started = False

    def close(self) -> None:
        self.stop_watching()
        self._listeners.clear()


class FakeGate:
    """Slots as a test sets them: `figures`, (pid, GPU UUID) -> the slot's figures on that GPU (every
    pid with one is gated); `start_times`, pid -> the start time its slot recorded (0: none)."""

    def __init__(self, figures: Mapping[Key, Figures] | None = None,
                 start_times: Mapping[int, int] | None = None) -> None:
        self.figures: dict[Key, Figures] = dict(figures or {})
        self.start_times: dict[int, int] = dict(start_times or {})

    def read(self, now_ns: int, devices: Devices) -> SourceReading:
        return SourceReading(dict(self.figures),
                             start_times={pid: self.start_times.get(pid, 0) for pid, _ in self.figures})


@dataclass
class FakeNvml:
    """NVML's reader as a test sets it (NvmlLike: NvmlSource takes it as it takes NvmlReader)."""

    gpus: list[str] = field(default_factory=list)
    procs: list[NvmlProcess] = field(default_factory=list)
    busy: dict[str, float] = field(default_factory=dict)
    available: bool = True

    def gpu_uuids(self) -> list[str]:
        return list(self.gpus)

    def processes(self) -> list[NvmlProcess]:
        return list(self.procs)

    def utilization(self) -> dict[str, float]:
        return dict(self.busy)

