"""The gates' source: each gated process's slot, read through the region's one slot reader.

Owns turning the slot columns (gemtrace/region/slots.py's SlotColumns) into per-process figures: memory
the gate reserved (device and managed), launches and the GPU time of finished bursts, on each GPU
the slot's gpu_mask names. A gate sets a GPU's bit before it counts anything there (hook/attach.c,
gt_note_gpu), so a slot's counters on the other GPUs are 0: no figure is made for them (the merge
reads a gated process's missing figure as zeros), which keeps a poll at one figure per process and
GPU it uses, not eight per slot. Never writes a slot (the agent's reaper frees them), never merges:
a slot is the process's own word and may lie (docs/accounting.md, tampering).
"""

from __future__ import annotations

from gemtrace.contract import SLOT_GATED
from gemtrace.region import Region
from gemtrace.sources import Devices, Figures, Key, SourceReading


class GateSource:
    def __init__(self, region: Region | None) -> None:
        """`region`: None reads no slot (an accounting without gates)."""
        self.region = region

    def read(self, now_ns: int, devices: Devices) -> SourceReading:
        if self.region is None:
            return SourceReading()
        columns = self.region.slot_columns
        pids, masks, flags, starts = columns.pid, columns.gpu_mask, columns.flags, columns.start_time
        per_gpu = [(uuid, columns.memory(g), columns.launches(g), columns.busy_ns(g), columns.managed(g))
                   for g, uuid in enumerate(devices.physical())]
        # The GPUs of each gpu_mask, worked out once a read (a few masks, each shared by many slots): a
        # slot costs a figure per GPU it uses, not a test per GPU of the host.
        used_by: dict[int, list[tuple[str, memoryview, memoryview, memoryview, memoryview]]] = {}
        figures: dict[Key, Figures] = {}
        start_times: dict[int, int] = {}
        for index in columns.live():
            pid = pids[index]
            if not pid:
                continue  # freed since the pids were read
            mask = masks[index]
            used = used_by.get(mask)
            if used is None:
                used = used_by[mask] = [gpu for g, gpu in enumerate(per_gpu) if mask >> g & 1]
            # Positional (memory, launches, busy_ns, last_alloc_ns unknown, placed, managed), and no list
            # for the one figure of a slot on one GPU (most are): each cut the read by a quarter.
            one: tuple[Key, Figures] | None = None
            read: list[tuple[Key, Figures]] = []
            if len(used) == 1:
                uuid, memory, launches, busy_ns, managed = used[0]
                one = (pid, uuid), Figures(memory[index], launches[index], busy_ns[index], 0, True, managed[index])
            else:
                read = [((pid, uuid), Figures(memory[index], launches[index], busy_ns[index], 0, True, managed[index]))
                        for uuid, memory, launches, busy_ns, managed in used]
            # A slot being freed loses its flag before its counters are zeroed (hook/attach.c): read
            # after the counters, the flag says they were read whole.
            if not flags[index] & SLOT_GATED or pids[index] != pid:
                continue
            start_times[pid] = starts[index]
            if one is not None:
                figures[one[0]] = one[1]
            else:
                figures.update(read)
        return SourceReading(figures, start_times=start_times)
