"""The gates' source: each gated process's slot, read through the region's one slot reader.

Owns turning the slot columns (gemtrace/region.py's SlotColumns) into per-process figures: memory
the gate reserved (device and managed), launches and the GPU time of finished bursts, on every GPU of the host, placed
where the slot's gpu_mask says the process works. Never writes a slot (the agent's reaper frees
them), never merges: a slot is the process's own word and may lie (docs/accounting.md, tampering).
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
        physical = devices.physical()
        per_gpu = [(g, uuid, columns.memory(g), columns.launches(g), columns.busy_ns(g), columns.managed(g))
                   for g, uuid in enumerate(physical)]
        figures: dict[Key, Figures] = {}
        start_times: dict[int, int] = {}
        for index in columns.live():
            pid = columns.pid[index]
            if not pid:
                continue  # freed since the pids were read
            mask = columns.gpu_mask[index]
            read = {uuid: Figures(memory=memory[index], launches=launches[index], busy_ns=busy_ns[index],
                                  placed=bool(mask >> g & 1), managed=managed[index])
                    for g, uuid, memory, launches, busy_ns, managed in per_gpu}
            # A slot being freed loses its flag before its counters are zeroed (hook/attach.c): read
            # after the counters, the flag says they were read whole.
            if not columns.flags[index] & SLOT_GATED or columns.pid[index] != pid:
                continue
            start_times[pid] = columns.start_time[index]
            for uuid, figure in read.items():
                figures[(pid, uuid)] = figure
        return SourceReading(figures, start_times=start_times)
