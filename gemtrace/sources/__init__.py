"""The accounting's sources, behind one small interface: what each knows of each process's GPU use.

A source reads one thing (eBPF's maps: ebpf/, with the uprobes and the libcuda discovery it owns; the
gates' slots: gate.py; NVML: nvml.py) into a SourceReading of plain figures per (pid, GPU UUID). It
never merges (gemtrace/agent/merge.py picks the best figure for each process, as docs/accounting.md's table
says), keeps no figure across reads that the accounting keeps, and never kills. Each source has a
fake (tests/fake_sources.py) that a test passes to Accounting's constructor in place of the real
one: no patching, no root.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

Key = tuple[int, str]  # (pid, GPU UUID)


class Figures(NamedTuple):
    """What one source knows of one process on one GPU; None where it does not know. (A NamedTuple:
    the gate makes one per live slot and GPU each poll, and these are the cheapest to make.)"""

    memory: int | None = None  # bytes
    launches: int | None = None
    busy_ns: int | None = None  # GPU time of finished bursts (the gate)
    last_alloc_ns: int = 0  # CLOCK_MONOTONIC of its last allocation there (eBPF); 0: not known
    placed: bool = True  # the source itself places the process on this GPU (a slot's gpu_mask bit)
    managed: int | None = None  # bytes of managed memory (Oversubscribe), apart from `memory`


@dataclass(frozen=True)
class SourceReading:
    figures: Mapping[Key, Figures] = field(default_factory=dict)
    # pids the source knows are alive without asking /proc (eBPF drops a context at the process's exit)
    alive: frozenset[int] = frozenset()
    # pid -> the start time (/proc ticks) the source recorded for it (a gate's slot; 0: none)
    start_times: Mapping[int, int] = field(default_factory=dict)
    # Blindness (eBPF): a process started by `since_ticks` (/proc ticks), or one in `missed` (it mapped
    # a libcuda file before it was probed), may hold memory the source never saw. None: sees all.
    since_ticks: int | None = None
    missed: frozenset[int] = frozenset()
    utilization: Mapping[str, float] = field(default_factory=dict)  # GPU UUID -> busy fraction 0-1 (NVML)


class Devices(Protocol):
    """The host's GPUs, and a process's device ordinals as GPU UUIDs (its CUDA_VISIBLE_DEVICES)."""

    def physical(self) -> Sequence[str]: ...

    def of(self, pid: int, ordinal: int) -> str | None: ...

    def forget(self, pids: Collection[int]) -> None:
        """These processes exited (a source saw it): what is cached about them is stale."""


class Source(Protocol):
    """Reads what it knows now; cheap enough for every poll (about one a second)."""

    def read(self, now_ns: int, devices: Devices) -> SourceReading: ...


class AllocationListener(Protocol):
    def on_allocation(self, event_ns: int | None) -> None:
        """Memory may have grown (or gone): `event_ns` is the last allocation's return, if known."""


class AllocationSource(Source, Protocol):
    """A source that sees every allocation as it happens (eBPF): it wakes its listeners at once, and
    reads its memory figures alone, for the enforcer, without the rest of a poll."""

    @property
    def status(self) -> str: ...

    @property
    def probes_attached(self) -> int: ...

    @property
    def libcuda_files(self) -> int: ...

    def subscribe(self, listener: AllocationListener) -> None: ...

    def start(self) -> None:
        """Begin delivering events (after every listener has subscribed)."""

    def nudge(self) -> None:
        """Wake the listeners as an allocation would (memory was rebuilt: check it now)."""

    def memory(self, devices: Devices) -> SourceReading:
        """Memory and last allocation times only, processes seen exiting left out."""

    def stop_watching(self) -> None:
        """Stop delivering events (the agent's stop: the gates are free first, the probes go after)."""

    def close(self) -> None: ...
