"""The slots read as columns: `SlotColumns`, the one way the agent reads the gates' counters.

Reads the layout (gemtrace/region/layout.py) through strided memoryviews and never writes; nothing it
returns is trusted (any user writes its own user's slots: docs/security.md).
"""

from __future__ import annotations

import ctypes
import itertools

from gemtrace.contract import GROUP_UNASSIGNED, MAX_SLOTS
from gemtrace.region.layout import RegionLayout, Slot, SlotTableLayout


class SlotColumns:
    """Strided views of the slots' fields, the one way the slots' counters are read: element i of
    `pid` is slots[i].pid, element i of `memory(g)` is slots[i].memory[g], and so on; element i of
    `group` and `assigned_pid` is the agent's assignment of slot i (the region's assigned[i]).

    Reading a column with tolist() runs at C speed; indexing one element is one memory load, so a
    reader pays a few microseconds plus a little per live slot, and copies nothing it does not read.
    The views point into the layout they were made from: the live mapping for the agent (which must
    not read them after Region.close), a copy for a read-only reader. Never writes.
    """

    def __init__(self, layout: RegionLayout, table: SlotTableLayout) -> None:
        slots = table.slots
        raw = memoryview((ctypes.c_char * ctypes.sizeof(slots)).from_address(ctypes.addressof(slots))).cast("B")
        self._stride = ctypes.sizeof(Slot)
        self._words32, self._words64 = raw.cast("I"), raw.cast("Q")
        assigned = layout.assigned
        raw_assigned = memoryview((ctypes.c_char * ctypes.sizeof(assigned)).from_address(ctypes.addressof(assigned)))
        words = raw_assigned.cast("B").cast("i")
        self._raw = (raw, raw_assigned)  # keeps the views' bases alive
        self._assigned_bytes = raw_assigned.cast("B")
        self.pid = raw.cast("i")[Slot.pid.offset // 4 :: self._stride // 4]
        self.gpu_mask = self._col32(Slot.gpu_mask.offset)
        self.start_time = self._col64(Slot.start_time.offset)
        self.flags = self._col32(Slot.flags.offset)
        # The agent's decisions: element i is assigned[i].pid / assigned[i].group (region file).
        self.assigned_pid = words[0::2]
        self.group = words.cast("B").cast("I")[1::2]

    def groups(self) -> list[int]:
        """Each slot's group: its assignment where that names the slot's process, else GROUP_UNASSIGNED
        (a free slot, a process the agent has not decided yet, a former occupant's entry)."""
        return [g if p and p == a else GROUP_UNASSIGNED
                for p, a, g in zip(self.pid.tolist(), self.assigned_pid.tolist(), self.group.tolist(), strict=True)]

    def assignments(self) -> bytes:
        """Every slot's assignment as it stands, one copy of the region's assigned[] (8 KiB, a
        microsecond): a reader that keeps it can tell, by one comparison, that no decision changed."""
        return self._assigned_bytes.tobytes()

    def _col32(self, offset: int) -> memoryview:
        return self._words32[offset // 4 :: self._stride // 4]

    def _col64(self, offset: int) -> memoryview:
        return self._words64[offset // 8 :: self._stride // 8]

    def pids(self) -> list[int]:
        """The pid of every slot (0 = free)."""
        return self.pid.tolist()

    def live(self) -> list[int]:
        """The indices of the claimed slots."""
        return list(itertools.compress(range(MAX_SLOTS), self.pid.tolist()))

    # Per GPU: element i is slots[i].<field>[gpu].
    def memory(self, gpu: int) -> memoryview:
        return self._col64(Slot.memory.offset + 8 * gpu)

    def managed(self, gpu: int) -> memoryview:
        return self._col64(Slot.managed.offset + 8 * gpu)

    def launches(self, gpu: int) -> memoryview:
        return self._col64(Slot.launches.offset + 8 * gpu)

    def busy_ns(self, gpu: int) -> memoryview:
        return self._col64(Slot.busy_ns.offset + 8 * gpu)

    def drained_ns(self, gpu: int) -> memoryview:
        return self._col64(Slot.drained_ns.offset + 8 * gpu)

    def burst_start_ns(self, gpu: int) -> memoryview:
        return self._col64(Slot.burst_start_ns.offset + 8 * gpu)

    def audit_requests(self) -> memoryview:
        """Element i: slots[i].audit_requests (a gate asks the agent to look now, issue 25)."""
        return self._col32(Slot.audit_requests.offset)

    def waiting(self, gpu: int) -> memoryview:
        return self._col32(Slot.waiting.offset + 4 * gpu)
