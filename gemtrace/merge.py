"""The merge: for each process on each GPU, the best figure its sources know.

The rule is docs/accounting.md's table "Sources, best first", stated there once; each function below
is one row of it, in the table's order, and tests/test_merge.py checks every row. Pure: figures in,
figures out; no clock, no /proc, no state. What is stateful about a figure (GPU time apportioned
within a group, NVML's time integrated, a figure kept after an exit, the context overhead learnt
over polls) is gemtrace/accounting.py's. Never reads a source itself.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import NamedTuple

from gemtrace.sources import Figures, Key, SourceReading


class Merged(NamedTuple):
    """One process on one GPU, its figures merged; the sources' own memory figures kept for the audit
    of the slots (tampering: a slot showing less than eBPF saw)."""

    memory: int
    gate_seconds: float  # the gate's busy time, before it is apportioned within the group
    launches: int | None  # None: not known
    gated: bool
    slot_memory: int | None
    ebpf_memory: int | None
    managed: int = 0  # managed memory (Oversubscribe), apart from `memory`


# A gated process's slot on a GPU its gate never used (no gpu_mask bit): every counter 0.
UNUSED = Figures(memory=0, launches=0, busy_ns=0, placed=False, managed=0)


# -- memory ------------------------------------------------------------------------------------------


def rebuilt_memory(gated: bool, slot: Figures | None, nvml: Figures | None, context_bytes: int) -> int | None:
    """Memory of an inherited process (eBPF may have missed some of it) from what outlives eBPF's
    blindness. Gated: its slot, where the gate places it (the gate counted from the process's
    start). Ungated: NVML less the GPU's context overhead. None: nothing to rebuild from."""
    if gated:
        return slot.memory if slot is not None and slot.placed and slot.memory else None
    if nvml is None or nvml.memory is None:
        return None
    return max(0, nvml.memory - context_bytes)


def memory(gated: bool, ebpf: Figures | None, slot: Figures | None, nvml: Figures | None,
           rebuilt: int | None) -> int:
    """Row "memory". `rebuilt`: rebuilt_memory() of an inherited process, else None.
      gated:   eBPF (the slot where eBPF has no figure); inherited: max(eBPF, slot)
      ungated: eBPF (NVML, context included, where eBPF has no figure); inherited: max(eBPF, NVML less
               the context overhead)"""
    seen = ebpf.memory if ebpf is not None and ebpf.memory is not None else None
    if rebuilt is not None:
        return max(rebuilt, seen or 0)
    if seen is not None:
        return seen
    if gated and slot is not None and slot.memory is not None:
        return slot.memory
    return nvml.memory if nvml is not None and nvml.memory is not None else 0


# -- GPU time ----------------------------------------------------------------------------------------


def gate_seconds(gated: bool, slot: Figures | None) -> float:
    """Row "GPU time", gated: the gate's busy_ns (Accounting apportions it within the group). An
    ungated process starts at 0 here: Accounting adds NVML's device utilisation x time, less the
    gated processes' share, split among the ungated processes on that GPU."""
    if gated and slot is not None and slot.busy_ns is not None:
        return slot.busy_ns / 1e9
    return 0.0


# -- launches ----------------------------------------------------------------------------------------


def launches(gated: bool, ebpf: Figures | None, slot: Figures | None) -> int | None:
    """Row "launches": gated, the gate's launches; ungated, the `launches` probe mode; else unknown."""
    if gated and slot is not None:
        return slot.launches
    if ebpf is not None:
        return ebpf.launches
    return None


# -- one process, and where it is ----------------------------------------------------------------------


def managed(ebpf: Figures | None, slot: Figures | None) -> int:
    """Managed memory: eBPF's where it sees the process (it saw every cuMemAllocManaged), else the
    gate's slot; NVML does not tell it apart."""
    if ebpf is not None and ebpf.managed is not None:
        return ebpf.managed
    return slot.managed if slot is not None and slot.managed is not None else 0


def merge(key: Key, ebpf: SourceReading | None, gate: SourceReading, nvml: SourceReading,
          rebuilt: int | None) -> Merged:
    """Every row for one process on one GPU. `ebpf` None: eBPF is off. A process is gated when it
    has a slot."""
    pid = key[0]
    gated = pid in gate.start_times
    e = ebpf.figures.get(key) if ebpf is not None else None
    s = gate.figures.get(key)
    if s is None and gated:
        s = UNUSED  # the gate's source makes no figure where its gate counted nothing
    n = nvml.figures.get(key)
    return Merged(
        memory=memory(gated, e, s, n, rebuilt),
        gate_seconds=gate_seconds(gated, s),
        launches=launches(gated, e, s),
        gated=gated,
        slot_memory=s.memory if s is not None else None,
        ebpf_memory=e.memory if e is not None else None,
        managed=managed(e, s),
    )


def places(ebpf: SourceReading | None, gate: SourceReading, nvml: SourceReading) -> set[Key]:
    """Every (pid, GPU) some source places a process on (a slot: where its gpu_mask says)."""
    keys = set(nvml.figures)
    if ebpf is not None:
        keys |= ebpf.figures.keys()
    keys.update(key for key, f in gate.figures.items() if f.placed)
    return keys


def context_overhead(gate: SourceReading, nvml: SourceReading, ebpf: SourceReading,
                     inherited: Collection[int], reused: Collection[int]) -> dict[str, int]:
    """Per GPU, the smallest NVML - true figure among the processes whose true figure is known: gated
    ones (their slot; a slot whose pid was reused left out) and ungated ones that eBPF saw from their
    start. NVML's per-process figure also holds the context (about 800 MB a process on an H100)."""
    overhead: dict[str, int] = {}

    def note(uuid: str, diff: int) -> None:
        overhead[uuid] = min(overhead.get(uuid, diff), diff)

    for key, s in gate.figures.items():
        n = nvml.figures.get(key)
        if s.placed and key[0] not in reused and n is not None and n.memory is not None:
            note(key[1], max(0, n.memory - (s.memory or 0)))
    for key, n in nvml.figures.items():
        e = ebpf.figures.get(key)
        if key[0] in gate.start_times or key[0] in inherited or e is None or n.memory is None:
            continue
        note(key[1], max(0, n.memory - (e.memory or 0)))
    return overhead


def rebuilt(keys: Collection[Key], gate: SourceReading, nvml: SourceReading, inherited: Collection[int],
            reused: Collection[int], context_bytes: Mapping[str, int]) -> dict[Key, int]:
    """rebuilt_memory() of every inherited process among `keys` that has something to rebuild from."""
    out: dict[Key, int] = {}
    for key in keys:
        pid, uuid = key
        if pid not in inherited or pid in reused:
            continue
        figure = rebuilt_memory(pid in gate.start_times, gate.figures.get(key), nvml.figures.get(key),
                                context_bytes.get(uuid, 0))
        if figure is not None:
            out[key] = figure
    return out
