"""The shared region between the agent and the gates: a ctypes mirror of hook/gemtrace_region.h.

This module owns the mapping of the region file and the few operations on it that need care
(creating it so a gate never maps a half-written file, releasing a futex word, freeing a dead
process's slot). It never decides anything: the scheduler decides what to hold, the agent when to
reap. The layout is defined once, in the C header; tests/test_region_layout.py compiles a program
that prints sizeof/offsetof of every field and compares them with the classes below.
"""

from __future__ import annotations

import ctypes
import itertools
import mmap
import os
from collections.abc import Iterator
from functools import cached_property
from pathlib import Path

# The header is the source of truth; these literals are the installed package's copy of it, and
# tests/test_region_layout.py fails if they ever differ from the header.
MAGIC = 0x45434152544D4547
VERSION = 2
MAX_GPUS = 8
MAX_GROUPS = 64
MAX_SLOTS = 1024
NAME_LEN = 64
UUID_LEN = 48
COMM_LEN = 16
NO_LIMIT = 2**64 - 1
UTIL_ONE = 1_000_000
HEARTBEAT_STALE_NS = 2_000_000_000
HOLD_RECHECK_NS = 100_000_000
QUEUE_BOUND_NS = 10_000_000
# enum gt_held: the values of a control word
RELEASED = 0
HELD = 1
RELEASED_SHORT_QUEUE = 2
REGION_FILE = "region"
SLOT_GATED = 1

u32, i32, u64 = ctypes.c_uint32, ctypes.c_int32, ctypes.c_uint64


class Header(ctypes.Structure):
    _fields_ = [
        ("magic", u64),
        ("version", u32),
        ("size", u32),
        ("agent_pid", i32),
        ("n_gpus", u32),
        ("heartbeat_ns", u64),
        ("config_generation", u64),
        ("reserved", u64 * 11),
    ]


class Gpu(ctypes.Structure):
    _fields_ = [("uuid", ctypes.c_char * UUID_LEN), ("memory_total", u64), ("reserved", u64 * 1)]


class Group(ctypes.Structure):
    _fields_ = [
        ("name", ctypes.c_char * NAME_LEN),
        ("memory_limit", u64),
        ("min_util_ppm", u32),
        ("max_util_ppm", u32),
        ("defined", u32),
        ("reserved0", u32),
        ("reserved", u64 * 4),
    ]


class Control(ctypes.Structure):
    _fields_ = [("held", u32), ("reserved0", u32), ("grant_seq", u64), ("reserved", u64 * 6)]


class Slot(ctypes.Structure):
    _fields_ = [
        ("pid", i32),
        ("group", u32),
        ("flags", u32),
        ("gpu_mask", u32),
        ("start_time", u64),
        ("comm", ctypes.c_char * COMM_LEN),
        ("memory", u64 * MAX_GPUS),
        ("launches", u64 * MAX_GPUS),
        ("busy_ns", u64 * MAX_GPUS),
        ("last_launch_ns", u64 * MAX_GPUS),
        ("drained_ns", u64 * MAX_GPUS),
        ("waiting", u32 * MAX_GPUS),
        ("reserved", u64 * 4),
    ]


class RegionLayout(ctypes.Structure):
    _fields_ = [
        ("header", Header),
        ("gpus", Gpu * MAX_GPUS),
        ("groups", Group * MAX_GROUPS),
        ("control", (Control * MAX_GROUPS) * MAX_GPUS),
        ("slots", Slot * MAX_SLOTS),
    ]


REGION_SIZE = ctypes.sizeof(RegionLayout)


class RegionError(Exception):
    """A region file that cannot be used; the message says why and what to do."""


class RegionVersionError(RegionError):
    pass


_libc = ctypes.CDLL(None, use_errno=True)
_SYS_futex = 202  # x86-64; the gate and the agent run on x86-64 hosts only (see packaging)
_FUTEX_WAKE = 1
_INT_MAX = 2**31 - 1


class Region:
    """A mapped region file. `layout` is the live ctypes view of the shared memory."""

    def __init__(self, path: Path, fd: int, mapping: mmap.mmap) -> None:
        self.path = path
        self._fd = fd
        self._map = mapping
        self.layout = RegionLayout.from_buffer(mapping)

    # -- opening ---------------------------------------------------------------------------------

    @classmethod
    def create(cls, state_dir: Path) -> Region:
        """The agent's view: adopt a region of this version (groups and live slots survive an agent
        restart, so running programs keep going), or replace a missing, foreign or torn one.

        A new file is written under a temporary name and renamed into place with the magic already
        set, so a gate never maps a half-initialised region.
        """
        state_dir.mkdir(parents=True, exist_ok=True)
        path = state_dir / REGION_FILE
        try:
            region = cls.open(state_dir)
        except (FileNotFoundError, RegionError):
            region = None
        if region is not None:
            region.layout.header.agent_pid = os.getpid()
            return region
        tmp = state_dir / f".{REGION_FILE}.{os.getpid()}"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o666)
        try:
            os.fchmod(fd, 0o666)  # gated programs of any user map it read-write (their own slot)
            os.ftruncate(fd, REGION_SIZE)
            mapping = mmap.mmap(fd, REGION_SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            layout = RegionLayout.from_buffer(mapping)
            layout.header.version = VERSION
            layout.header.size = REGION_SIZE
            layout.header.agent_pid = os.getpid()
            for gpu in range(MAX_GPUS):
                for group in range(MAX_GROUPS):
                    layout.control[gpu][group].held = RELEASED
            layout.header.magic = MAGIC
            del layout
            mapping.flush()
            os.rename(tmp, path)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        return cls(path, fd, mapping)

    @classmethod
    def open(cls, state_dir: Path, writable: bool = True) -> Region:
        """Map an existing region; refuse a file of another layout version with a clear message."""
        path = state_dir / REGION_FILE
        fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            header = Header.from_buffer_copy(os.pread(fd, ctypes.sizeof(Header), 0).ljust(ctypes.sizeof(Header), b"\0"))
            if header.magic != MAGIC:
                raise RegionError(f"{path}: not a gemtrace region (bad magic); remove it or restart the agent")
            if header.version != VERSION:
                raise RegionVersionError(
                    f"{path}: region layout version {header.version}, this gemtrace reads version {VERSION}; "
                    "restart the agent of this version to replace it"
                )
            if header.size != REGION_SIZE or size < REGION_SIZE:
                raise RegionError(f"{path}: region of {size} bytes, expected {REGION_SIZE}")
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            mapping = mmap.mmap(fd, REGION_SIZE, mmap.MAP_SHARED, prot)
        except BaseException:
            os.close(fd)
            raise
        if not writable:
            # ctypes.from_buffer needs a writable buffer; a read-only reader takes snapshots instead.
            region = cls.__new__(cls)
            region.path, region._fd, region._map = path, fd, mapping
            region.layout = RegionLayout.from_buffer_copy(mapping)
            return region
        return cls(path, fd, mapping)

    def close(self) -> None:
        self.__dict__.pop("slot_columns", None)  # its views point into the mapping about to go
        del self.layout
        try:
            self._map.close()
        except BufferError:
            pass  # a caller still holds a view into the mapping; the OS unmaps at exit
        os.close(self._fd)

    # -- agent-owned parts -----------------------------------------------------------------------

    def heartbeat(self, now_ns: int) -> None:
        self.layout.header.heartbeat_ns = now_ns

    def set_gpus(self, gpus: list[tuple[str, int]]) -> None:
        """Publish the GPUs as (uuid, memory_total); the index in this list is the gpu index."""
        if len(gpus) > MAX_GPUS:
            raise RegionError(f"{len(gpus)} GPUs found; the region has room for {MAX_GPUS}")
        for index, (uuid, total) in enumerate(gpus):
            self.layout.gpus[index].uuid = uuid.encode()[: UUID_LEN - 1]
            self.layout.gpus[index].memory_total = total
        self.layout.header.n_gpus = len(gpus)

    def gpu_uuids(self) -> list[str]:
        return [self.layout.gpus[i].uuid.decode() for i in range(self.layout.header.n_gpus)]

    def group_index(self, name: str) -> int | None:
        encoded = name.encode()
        for index in range(MAX_GROUPS):
            if self.layout.groups[index].name == encoded:
                return index
        return None

    def group_names(self) -> dict[int, str]:
        return {i: g.name.decode() for i, g in enumerate(self.layout.groups) if g.name}

    def set_group(self, name: str, memory_limit: int | None, min_util: float, max_util: float) -> int:
        """Define or update a group; a name keeps its index for the region's life (gates cache it)."""
        encoded = name.encode()
        if not encoded or len(encoded) >= NAME_LEN:
            raise RegionError(f"group name {name!r} must be 1 to {NAME_LEN - 1} bytes")
        index = self.group_index(name)
        if index is None:
            free = [i for i in range(MAX_GROUPS) if not self.layout.groups[i].name]
            if not free:
                raise RegionError(f"the region has room for {MAX_GROUPS} groups")
            index = free[0]
        group = self.layout.groups[index]
        group.memory_limit = NO_LIMIT if memory_limit is None else memory_limit
        group.min_util_ppm = round(min_util * UTIL_ONE)
        group.max_util_ppm = round(max_util * UTIL_ONE)
        group.defined = 1
        group.name = encoded  # last: a gate looking the name up sees complete limits
        return index

    def undefine_group(self, index: int) -> None:
        """The resource file dropped the group: keep its index (running gates hold it), lift its hold."""
        self.layout.groups[index].defined = 0

    def bump_generation(self) -> None:
        self.layout.header.config_generation += 1

    def is_held(self, gpu: int, group: int) -> bool:
        return bool(self.layout.control[gpu][group].held == HELD)

    def hold(self, gpu: int, group: int) -> None:
        self.layout.control[gpu][group].held = HELD

    def release(self, gpu: int, group: int, short_queue: bool = False) -> None:
        """Let the group launch; with `short_queue` its processes keep no more than GT_QUEUE_BOUND_NS
        of work queued (a hold is coming: its drain stays short)."""
        control = self.layout.control[gpu][group]
        word = RELEASED_SHORT_QUEUE if short_queue else RELEASED
        if control.held == word:
            return
        was_held = control.held == HELD
        control.held = word
        if was_held:
            control.grant_seq += 1
            self._wake(ctypes.addressof(control) + Control.held.offset)

    def release_all(self) -> None:
        for gpu in range(MAX_GPUS):
            for group in range(MAX_GROUPS):
                self.release(gpu, group)

    def stop(self) -> None:
        """A clean stop of the agent: nobody waits on a word, and gates see no agent."""
        self.release_all()
        self.layout.header.heartbeat_ns = 0
        self.layout.header.agent_pid = 0

    @staticmethod
    def _wake(address: int) -> None:
        # Not FUTEX_PRIVATE: the waiters are in other processes mapping the same file.
        _libc.syscall(_SYS_futex, ctypes.c_void_p(address), _FUTEX_WAKE, _INT_MAX, None, None, 0)

    # -- slots -----------------------------------------------------------------------------------

    @cached_property
    def slot_columns(self) -> SlotColumns:
        """The one reader of the slots' counters (the scheduler, the reaper and the accounting use it)."""
        return SlotColumns(self.layout)

    def live_slots(self) -> Iterator[tuple[int, Slot]]:
        """(index, slot) for every claimed slot; the slot is the live view, copy what must not move."""
        slots = self.layout.slots
        for index in self.slot_columns.live():
            yield index, slots[index]

    def slot_pids(self) -> list[int]:
        """The pid of every slot (0 = free), read in one strided pass: cheap enough for every tick."""
        return self.slot_columns.pids()

    def free_slot(self, index: int, pid: int) -> bool:
        """Free the slot of a process that has died; False if the slot changed owner meanwhile."""
        slot = self.layout.slots[index]
        if slot.pid != pid:
            return False
        ctypes.memset(ctypes.addressof(slot) + Slot.group.offset, 0, ctypes.sizeof(Slot) - Slot.group.offset)
        slot.pid = 0  # last: a gate claiming it with CAS finds a zeroed slot
        return True


class SlotColumns:
    """Strided views of the slots' fields, the one way the slots' counters are read: element i of
    `pid` is slots[i].pid, element i of `memory(g)` is slots[i].memory[g], and so on.

    Reading a column with tolist() runs at C speed; indexing one element is one memory load, so a
    reader pays a few microseconds plus a little per live slot, and copies nothing it does not read.
    The views point into the layout they were made from: the live mapping for the agent (which must
    not read them after Region.close), a copy for a read-only reader. Never writes.
    """

    def __init__(self, layout: RegionLayout) -> None:
        slots = layout.slots
        table = (ctypes.c_char * ctypes.sizeof(slots)).from_address(ctypes.addressof(slots))
        raw = memoryview(table).cast("B")
        self._stride = ctypes.sizeof(Slot)
        self._words32, self._words64 = raw.cast("I"), raw.cast("Q")
        self._raw = raw  # keeps the views' base alive
        self.pid = raw.cast("i")[Slot.pid.offset // 4 :: self._stride // 4]
        self.group = self._col32(Slot.group.offset)
        self.gpu_mask = self._col32(Slot.gpu_mask.offset)
        self.start_time = self._col64(Slot.start_time.offset)

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

    def launches(self, gpu: int) -> memoryview:
        return self._col64(Slot.launches.offset + 8 * gpu)

    def busy_ns(self, gpu: int) -> memoryview:
        return self._col64(Slot.busy_ns.offset + 8 * gpu)

    def drained_ns(self, gpu: int) -> memoryview:
        return self._col64(Slot.drained_ns.offset + 8 * gpu)

    def waiting(self, gpu: int) -> memoryview:
        return self._col32(Slot.waiting.offset + 4 * gpu)
