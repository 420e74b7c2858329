"""The region's layout: a ctypes mirror of hook/gemtrace_region.h, and the checks a layout read back must pass.

The layout is defined once, in the C header; tests/test_region_layout.py compiles a program that
prints sizeof/offsetof of every field and compares them with the classes below. The header's
constants come from gemtrace.contract, which `make` generates from it. Owns no mapping and no file:
gemtrace/region/region.py maps these structures. Anything read back from the region or the slots may
have been written by any user, so the readers here never raise on what they find (`decode_name`,
`unsound`).
"""

from __future__ import annotations

import ctypes

from gemtrace.contract import (
    BESIDE_SLOTS,
    COMM_LEN,
    GROUP_UNASSIGNED,
    HELD,
    MAX_CHUNKS,
    MAX_GPUS,
    MAX_GROUPS,
    MAX_SLOTS,
    NAME_LEN,
    RELEASED,
    RELEASED_BESIDE,
    RELEASED_LONG_QUEUE,
    RELEASED_OUTRANKED,
    RELEASED_SHORT_QUEUE,
    UTIL_ONE,
    UUID_LEN,
)

# A control word's states that let launches proceed: unbounded (a group not scheduled there), and
# with the queue bounded for a hold coming, for an outranking group's wait, with no hold in sight, and
# for an opportunistic group beside production.
RELEASED_WORDS = (RELEASED, RELEASED_SHORT_QUEUE, RELEASED_OUTRANKED, RELEASED_LONG_QUEUE, RELEASED_BESIDE)

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
        ("managed_host_limit", u64),
        ("chunk_generation", u64),
        ("region_id", u64),
        ("unattached", u32),
        ("reserved0", u32),
        ("reserved", u64 * 7),
    ]


class GpuRecord(ctypes.Structure):
    _fields_ = [("uuid", ctypes.c_char * UUID_LEN), ("memory_total", u64), ("reserved", u64 * 1)]


class GroupRecord(ctypes.Structure):
    _fields_ = [
        ("name", ctypes.c_char * NAME_LEN),
        ("memory_limit", u64),
        ("min_util_ppm", u32),
        ("max_util_ppm", u32),
        ("defined", u32),
        ("reserved0", u32),
        ("oversubscribe_limit", u64),
        ("reserved", u64 * 3),
    ]


class Control(ctypes.Structure):
    _fields_ = [("held", u32), ("beside_n", ctypes.c_uint16), ("ring_quiet", ctypes.c_uint16), ("grant_seq", u64),
                ("beside_slots", ctypes.c_uint16 * BESIDE_SLOTS)]


class Assignment(ctypes.Structure):
    _fields_ = [("pid", i32), ("group", u32)]


class Slot(ctypes.Structure):
    _fields_ = [
        ("pid", i32),
        ("flags", u32),
        ("gpu_mask", u32),
        ("reserved0", u32),
        ("start_time", u64),
        ("comm", ctypes.c_char * COMM_LEN),
        ("requested", ctypes.c_char * NAME_LEN),
        ("memory", u64 * MAX_GPUS),
        ("managed", u64 * MAX_GPUS),
        ("launches", u64 * MAX_GPUS),
        ("busy_ns", u64 * MAX_GPUS),
        ("burst_start_ns", u64 * MAX_GPUS),
        ("drained_ns", u64 * MAX_GPUS),
        ("waiting", u32 * MAX_GPUS),
        ("audit_requests", u32),
        ("reserved1", u32),
        ("reserved", u64 * 62),
    ]


class Verified(ctypes.Structure):
    """struct gt_verified: what the agent checked that a slot's process holds (issue 25)."""
    _fields_ = [("pid", i32), ("reserved0", u32), ("memory", u64 * MAX_GPUS), ("managed", u64 * MAX_GPUS)]


class RegionLayout(ctypes.Structure):
    _fields_ = [
        ("header", Header),
        ("gpus", GpuRecord * MAX_GPUS),
        ("groups", GroupRecord * MAX_GROUPS),
        ("control", (Control * MAX_GROUPS) * MAX_GPUS),
        ("assigned", Assignment * MAX_SLOTS),
        ("chunk_owner", u32 * MAX_CHUNKS),
        ("verified", Verified * MAX_SLOTS),
        ("chunk_trusted", u32 * MAX_CHUNKS),
    ]


class SlotTableLayout(ctypes.Structure):
    """The slot table as both sides map it (struct gt_slot slots[GT_MAX_SLOTS]; no header: the chunks
    come from the agent's socket, never from a file someone could have replaced)."""
    _fields_ = [("slots", Slot * MAX_SLOTS)]


REGION_SIZE = ctypes.sizeof(RegionLayout)


def assignment_word(pid: int, group: int) -> int:
    """struct gt_assignment as the one little-endian 8-byte word the agent stores (pid low, group high)."""
    return (pid & 0xFFFF_FFFF) | (group << 32)


def decode_name(raw: bytes) -> str:
    """A name read back from the region (any user may have written it): never raises."""
    return raw.decode("utf-8", "replace")


def unsound(layout: RegionLayout) -> str | None:
    """Why an adopted region cannot be trusted, or None. Checks what the agent would otherwise act
    on: the GPU count, every group entry (a NUL-terminated UTF-8 name, `defined` 0 or 1, utilisations
    within 0..1) and every control word."""
    header = layout.header
    if header.n_gpus > MAX_GPUS:
        return f"n_gpus {header.n_gpus} is above {MAX_GPUS}"
    raw_groups = bytes(memoryview(layout.groups).cast("B"))
    size = ctypes.sizeof(GroupRecord)
    for index in range(MAX_GROUPS):
        name = raw_groups[index * size : index * size + NAME_LEN]
        if b"\0" not in name:
            return f"group {index}: its name is not NUL-terminated"
        name = name.split(b"\0", 1)[0]
        try:
            name.decode("utf-8")
        except UnicodeDecodeError:
            return f"group {index}: its name is not UTF-8"
        group = layout.groups[index]
        if name and (group.defined not in (0, 1) or group.min_util_ppm > UTIL_ONE or group.max_util_ppm > UTIL_ONE):
            return f"group {index} ({decode_name(name)!r}): defined/utilisation out of range"
    for gpu in range(MAX_GPUS):
        for group_index in range(MAX_GROUPS):
            if layout.control[gpu][group_index].held not in (HELD, *RELEASED_WORDS):
                return f"control word of GPU {gpu}, group {group_index} is {layout.control[gpu][group_index].held}"
    groups = memoryview(layout.assigned).cast("B").cast("I")[1::2].tolist()
    for slot, group in enumerate(groups):
        if group >= MAX_GROUPS and group != GROUP_UNASSIGNED:
            return f"slot {slot} is assigned group {group}, outside the table"
    return None

