"""The layout of both shared files (region and slots) is defined once, in hook/gemtrace_region.h: the
ctypes mirror must match it field by field (compiled and printed by a C program) and constant by
constant."""

from __future__ import annotations

import ctypes
import os
import re
import stat
import subprocess
from pathlib import Path

import pytest

from gemtrace import region

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
HEADER = ROOT / "hook" / "gemtrace_region.h"

STRUCTS = {
    "gt_header": region.Header,
    "gt_gpu": region.Gpu,
    "gt_group": region.Group,
    "gt_control": region.Control,
    "gt_assignment": region.Assignment,
    "gt_region": region.RegionLayout,
    "gt_slot": region.Slot,
    "gt_slots_header": region.SlotsHeader,
    "gt_slot_table": region.SlotTableLayout,
}


def _c_layout(tmp_path: Path) -> dict[str, int]:
    lines = ['#include <stdio.h>', '#include <stddef.h>', f'#include "{HEADER}"', "int main(void) {"]
    for c_name, py_struct in STRUCTS.items():
        lines.append(f'printf("{c_name} %zu\\n", sizeof(struct {c_name}));')
        for field, *_ in py_struct._fields_:
            lines.append(f'printf("{c_name}.{field} %zu\\n", offsetof(struct {c_name}, {field}));')
    lines.append("return 0; }")
    source = tmp_path / "layout.c"
    source.write_text("\n".join(lines))
    binary = tmp_path / "layout"
    subprocess.run(["cc", "-std=c11", "-Wall", "-Werror", "-o", str(binary), str(source)], check=True)
    out = subprocess.run([str(binary)], check=True, capture_output=True, text=True).stdout
    return {key: int(value) for key, value in (line.split() for line in out.splitlines())}


def _py_layout() -> dict[str, int]:
    layout = {}
    for c_name, py_struct in STRUCTS.items():
        layout[c_name] = ctypes.sizeof(py_struct)
        for field, *_ in py_struct._fields_:
            layout[f"{c_name}.{field}"] = getattr(py_struct, field).offset
    return layout


def test_every_struct_and_field_matches_the_header(tmp_path: Path) -> None:
    assert _py_layout() == _c_layout(tmp_path)


def test_the_mirror_names_every_field_of_the_header() -> None:
    """A field added in C but not mirrored would shift nothing (if it replaced reserved words) but be
    invisible to the agent: compare the field names per struct too."""
    text = HEADER.read_text()
    for c_name, py_struct in STRUCTS.items():
        body = re.search(rf"struct {c_name} \{{(.*?)\n\}};", text, re.S)
        assert body, c_name
        c_fields = re.findall(r"^\s+(?:_Alignas\(\d+\) )?(?:struct )?\w+ (\w+)(?:\[[^\]]*\])*;", body.group(1), re.M)
        assert c_fields == [f for f, *_ in py_struct._fields_], c_name


def test_constants_match_the_header() -> None:
    defines = {
        name: int(value, 0)
        for name, value in re.findall(r"^#define (GT_\w+) (0x[0-9a-fA-F]+|\d+)[uUlL]*", HEADER.read_text(), re.M)
    }
    assert defines["GT_REGION_MAGIC"] == region.MAGIC
    assert defines["GT_SLOTS_MAGIC"] == region.SLOTS_MAGIC
    assert defines["GT_REGION_VERSION"] == region.VERSION == 4
    assert defines["GT_ASSIGN_WAIT_NS"] == region.ASSIGN_WAIT_NS
    assert defines["GT_MAX_GPUS"] == region.MAX_GPUS
    assert defines["GT_MAX_GROUPS"] == region.MAX_GROUPS
    assert defines["GT_MAX_SLOTS"] == region.MAX_SLOTS
    assert defines["GT_NAME_LEN"] == region.NAME_LEN
    assert defines["GT_UUID_LEN"] == region.UUID_LEN
    assert defines["GT_COMM_LEN"] == region.COMM_LEN
    assert defines["GT_UTIL_ONE"] == region.UTIL_ONE
    assert defines["GT_HEARTBEAT_STALE_NS"] == region.HEARTBEAT_STALE_NS
    assert defines["GT_HOLD_RECHECK_NS"] == region.HOLD_RECHECK_NS
    assert defines["GT_QUEUE_BOUND_NS"] == region.QUEUE_BOUND_NS
    enum = re.search(r"enum gt_held \{(.*?)\};", HEADER.read_text(), re.S)
    assert enum
    held = dict(re.findall(r"^\s+(GT_\w+) = (\d+),", enum.group(1), re.M))
    assert {k: int(v) for k, v in held.items()} == {
        "GT_RELEASED": region.RELEASED, "GT_HELD": region.HELD, "GT_RELEASED_SHORT_QUEUE": region.RELEASED_SHORT_QUEUE}
    assert b"GEMTRACE" == region.MAGIC.to_bytes(8, "little")
    assert b"GEMSLOTS" == region.SLOTS_MAGIC.to_bytes(8, "little")
    files = dict(re.findall(r'^#define (GT_\w+_FILE) "(\w+)"', HEADER.read_text(), re.M))
    assert files == {"GT_REGION_FILE": region.REGION_FILE, "GT_SLOTS_FILE": region.SLOTS_FILE}
    assert re.search(r"^#define GT_GROUP_UNASSIGNED UINT32_MAX\b", HEADER.read_text(), re.M)
    assert region.GROUP_UNASSIGNED == 2**32 - 1


def test_an_assignment_is_one_aligned_word() -> None:
    """The gate loads assigned[i] with one 8-byte atomic load and the agent stores it with one: the
    entries must sit on 8-byte boundaries, pid in the low half."""
    assert region.RegionLayout.assigned.offset % 8 == 0 and ctypes.sizeof(region.Assignment) == 8
    layout = region.RegionLayout()
    layout.assigned[3].pid, layout.assigned[3].group = 4242, 7
    word = memoryview(layout.assigned).cast("B").cast("Q")[3]
    assert word == region.assignment_word(4242, 7) == 4242 | 7 << 32


def test_a_region_of_another_version_is_refused(tmp_path: Path) -> None:
    r = region.Region.create(tmp_path)
    r.layout.header.version = region.VERSION + 1
    r.close()
    with pytest.raises(region.RegionVersionError, match=f"reads version {region.VERSION}"):
        region.Region.open(tmp_path)
    # The agent replaces a foreign region instead of adopting it.
    fresh = region.Region.create(tmp_path)
    assert fresh.layout.header.version == region.VERSION
    fresh.close()


def test_an_agent_restart_adopts_groups_and_slots(tmp_path: Path) -> None:
    first = region.Region.create(tmp_path)
    index = first.set_group("train", 4 << 30, 0.2, 0.6)
    first.slots[7].pid = 4242
    first.assign(7, 4242, index)
    first.close()
    second = region.Region.create(tmp_path)
    assert second.group_index("train") == index
    assert second.layout.groups[index].max_util_ppm == 600_000
    assert [i for i, _ in second.live_slots()] == [7]
    assert second.slot_groups() == {7: index}
    assert second.free_slot(7, 4242)
    assert list(second.live_slots()) == []
    assert second.assigned_group(7, 4242) is None  # freed first, so no later occupant inherits it
    second.close()


def test_the_region_is_roots_read_only_file_and_the_slots_everyones(tmp_path: Path) -> None:
    r = region.Region.create(tmp_path)
    r.close()
    modes = {name: os.stat(tmp_path / name) for name in (region.REGION_FILE, region.SLOTS_FILE)}
    assert stat.S_IMODE(modes["region"].st_mode) == 0o644 and modes["region"].st_uid == os.geteuid()
    assert stat.S_IMODE(modes["slots"].st_mode) == 0o666
    assert modes["region"].st_size == region.REGION_SIZE and modes["slots"].st_size == region.SLOTS_SIZE
    # An adopted region is put back to 0644, whatever was done to its mode.
    os.chmod(tmp_path / region.REGION_FILE, 0o666)
    region.Region.create(tmp_path).close()
    assert stat.S_IMODE(os.stat(tmp_path / region.REGION_FILE).st_mode) == 0o644


def test_an_assignment_counts_only_for_the_process_it_names(tmp_path: Path) -> None:
    r = region.Region.create(tmp_path)
    try:
        train = r.set_group("train", None, 0, 1)
        r.slots[2].pid = 500
        assert r.slot_groups() == {}  # not decided yet
        r.assign(2, 500, train)
        assert r.slot_groups() == {2: train} and r.assigned_group(2, 500) == train
        r.slots[2].pid = 501  # the slot changed owner (the gate freed it at exit, another claimed it)
        assert r.slot_groups() == {} and r.assigned_group(2, 501) is None
        assert r.slot_columns.groups()[2] == region.GROUP_UNASSIGNED
    finally:
        r.close()
