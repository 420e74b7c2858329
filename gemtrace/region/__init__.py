"""The region: everything the agent shares with the gates (hook/gemtrace_region.h), built bottom-up.

Each module imports only those listed before it (tests/test_import_graph.py holds it to that):
    layout.py     ctypes mirror of hook/gemtrace_region.h (the region, the slots) and the checks of a read-back
    chunks.py     the slot table's memory: per-user chunks, sealed memfds in one reserved range
    slots.py      SlotColumns: the slots' counters read as columns, the one way the agent reads them
    futex.py      futex waits and wakes on words shared with the gates
    doorbells.py  the page of per-GPU futex words that gates ring when a wait is news
    server.py     the attach socket where gates get their slots, fair per user (SO_PEERCRED); ask()
    region.py     Region: the region file and the slot table mapped, created or adopted, and their care
Callers write `from gemtrace import region as rg` and use the names below (`rg.Region`, `rg.HELD`):
the layout's classes, Region and its errors, and the header's constants they compare with.
"""

from gemtrace.contract import (
    ATTACH_SOCKET,
    ATTACH_VIEW,
    CHUNK_SLOTS,
    COMM_LEN,
    GROUP_UNASSIGNED,
    HELD,
    MAX_CHUNKS,
    MAX_GPUS,
    MAX_GROUPS,
    MAX_SLOTS,
    NAME_LEN,
    NO_LIMIT,
    NO_OWNER,
    REGION_FILE,
    RELEASED,
    RELEASED_BESIDE,
    RELEASED_LONG_QUEUE,
    RELEASED_OUTRANKED,
    RELEASED_SHORT_QUEUE,
    UTIL_ONE,
    UUID_LEN,
    WAKE_FANOUT,
)
from gemtrace.contract import REGION_MAGIC as MAGIC
from gemtrace.contract import REGION_VERSION as VERSION
from gemtrace.region.layout import (
    REGION_SIZE,
    RELEASED_WORDS,
    Assignment,
    Control,
    GpuRecord,
    GroupRecord,
    Header,
    RegionLayout,
    Slot,
    SlotTableLayout,
    Verified,
    assignment_word,
    decode_name,
    unsound,
)
from gemtrace.region.region import REGION_MODE, WAKE_ALL, Region, RegionError, RegionVersionError, os_error
from gemtrace.region.slots import SlotColumns

__all__ = [
    "ATTACH_SOCKET",
    "ATTACH_VIEW",
    "CHUNK_SLOTS",
    "COMM_LEN",
    "GROUP_UNASSIGNED",
    "HELD",
    "MAGIC",
    "MAX_CHUNKS",
    "MAX_GPUS",
    "MAX_GROUPS",
    "MAX_SLOTS",
    "NAME_LEN",
    "NO_LIMIT",
    "NO_OWNER",
    "REGION_FILE",
    "REGION_MODE",
    "REGION_SIZE",
    "RELEASED",
    "RELEASED_BESIDE",
    "RELEASED_LONG_QUEUE",
    "RELEASED_OUTRANKED",
    "RELEASED_SHORT_QUEUE",
    "RELEASED_WORDS",
    "UTIL_ONE",
    "UUID_LEN",
    "VERSION",
    "WAKE_ALL",
    "WAKE_FANOUT",
    "Assignment",
    "Control",
    "GpuRecord",
    "GroupRecord",
    "Header",
    "Region",
    "RegionError",
    "RegionLayout",
    "RegionVersionError",
    "Slot",
    "SlotColumns",
    "SlotTableLayout",
    "Verified",
    "assignment_word",
    "decode_name",
    "os_error",
    "unsound",
]
