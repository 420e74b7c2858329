"""The merge: for each process on each GPU, the best figure its sources know.

The rule is docs/accounting.md's table "Sources, best first", stated there once; each function below
is one row of it, in the table's order, and tests/test_merge.py checks every row. Pure: figures in,
figures out; no clock, no /proc, no state. What is stateful about a figure (GPU time apportioned
within a group, NVML's time integrated, a figure kept after an exit, the context overhead learnt
over polls) is gemtrace/agent/accounting.py's. Never reads a source itself.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import NamedTuple

from gemtrace.sources import Figures, Key, SourceReading


class Merged(NamedTuple):
    """One process on one GPU, its figures merged; the sources' own memory figures kept for the audit
    of the slots (tampering: a slot showing less than eBPF saw, or more than the agent can verify)."""

    memory: int
    gate_seconds: float  # the gate's busy time, before it is apportioned within the group
    launches: int | None  # None: not known
    gated: bool
    slot_memory: int | None
    ebpf_memory: int | None
    managed: int = 0  # managed memory (Oversubscribe), apart from `memory`
    # A gated process's memory as checked by eBPF or NVML (row "verified"); None: ungated, or nothing
    # checks it (the slot's own figure is then what other users' gates count).
    verified: int | None = None
    verified_managed: int = 0  # its managed memory as checked (row "verified")
    slot_managed: int = 0  # the managed memory its slot shows


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


def verified(ebpf_on: bool, ebpf: Figures | None, slot: Figures | None, nvml: Figures | None,
             nvml_on: bool, inherited: bool) -> tuple[int | None, int]:
    """Row "verified": a gated process's (device, managed) memory as the agent can check it, which
    other users' gates count for it in place of its slot (hook/memory.c, issue 25). Device None:
    nothing checks it.
      eBPF on:  eBPF's (0 where it saw nothing: it sees every allocation of a process probed from its
                start). eBPF counts every cuMemAllocManaged as managed; a gate counts a program's own
                one as device memory outside an Oversubscribe group: what the slot counts as managed
                (at most eBPF's) stays managed, the rest of eBPF's managed memory counts as device
                memory. Inherited: device max(that, the slot clamped by NVML), managed the slot's.
      eBPF off: device: the slot clamped by NVML's figure (context included: an honest slot is never
                above it; 0 where NVML lists the process nowhere on that GPU), None without NVML;
                managed: the slot's (NVML does not tell it apart: nothing checks it)"""
    slot_bytes = slot.memory if slot is not None and slot.memory is not None else 0
    slot_managed = slot.managed if slot is not None and slot.managed is not None else 0
    clamped: int | None = None
    if nvml_on:
        clamped = min(slot_bytes, nvml.memory if nvml is not None and nvml.memory is not None else 0)
    if not ebpf_on:
        return clamped, slot_managed
    seen = ebpf.memory if ebpf is not None and ebpf.memory is not None else 0
    seen_managed = ebpf.managed if ebpf is not None and ebpf.managed is not None else 0
    as_managed = min(slot_managed, seen_managed)
    device = seen + seen_managed - as_managed
    if inherited:
        return max(device, slot_bytes if clamped is None else clamped), max(as_managed, slot_managed)
    return device, as_managed


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


class Inputs(NamedTuple):
    """What the merge reads of the sources for one process on one GPU: equal inputs merge to equal
    figures (the accounting keeps a process's merge while its inputs stay the same)."""

    gated: bool  # it has a slot
    ebpf: Figures | None
    slot: Figures | None  # UNUSED where a gated process's gate counted nothing on this GPU
    nvml: Figures | None
    rebuilt: int | None  # rebuilt_memory() of an inherited process, else None
    ebpf_on: bool  # eBPF runs
    nvml_on: bool  # NVML lists the processes of every GPU (one it does not list holds nothing there)
    inherited: bool  # eBPF may have missed some of the process's memory (docs/accounting.md)


def inputs(key: Key, ebpf: SourceReading | None, gate: SourceReading, nvml: SourceReading,
           rebuilt: int | None, nvml_on: bool = False, inherited: bool = False) -> Inputs:
    """The readings' figures for one process on one GPU. `ebpf` None: eBPF is off. A process is gated
    when it has a slot."""
    gated = key[0] in gate.start_times
    s = gate.figures.get(key)
    if s is None and gated:
        s = UNUSED  # the gate's source makes no figure where its gate counted nothing
    return Inputs(gated, ebpf.figures.get(key) if ebpf is not None else None, s, nvml.figures.get(key), rebuilt,
                  ebpf is not None, nvml_on, inherited)


def merged(i: Inputs) -> Merged:
    """Every row for one process on one GPU."""
    gated, e, s, n = i.gated, i.ebpf, i.slot, i.nvml
    checked = verified(i.ebpf_on, e, s, n, i.nvml_on, i.inherited) if gated else (None, 0)
    return Merged(
        memory=memory(gated, e, s, n, i.rebuilt),
        gate_seconds=gate_seconds(gated, s),
        launches=launches(gated, e, s),
        gated=gated,
        slot_memory=s.memory if s is not None else None,
        ebpf_memory=e.memory if e is not None else None,
        managed=managed(e, s),
        verified=checked[0],
        verified_managed=checked[1],
        slot_managed=(s.managed or 0) if s is not None else 0,
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
    start. NVML's per-process figure also holds the context (hundreds of MiB a process:
    bench/results/gpu_ebpf.md)."""
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
