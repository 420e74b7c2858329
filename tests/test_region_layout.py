"""The region layout is defined once, in hook/gemtrace_region.h: the ctypes mirror must match it
field by field (compiled and printed by a C program) and constant by constant."""

from __future__ import annotations

import ctypes
import re
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
    "gt_slot": region.Slot,
    "gt_region": region.RegionLayout,
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
        c_fields = re.findall(r"^\s+(?:struct )?\w+ (\w+)(?:\[[^\]]*\])*;", body.group(1), re.M)
        assert c_fields == [f for f, *_ in py_struct._fields_], c_name


def test_constants_match_the_header() -> None:
    defines = {
        name: int(value, 0)
        for name, value in re.findall(r"^#define (GT_\w+) (0x[0-9a-fA-F]+|\d+)[uUlL]*", HEADER.read_text(), re.M)
    }
    assert defines["GT_REGION_MAGIC"] == region.MAGIC
    assert defines["GT_REGION_VERSION"] == region.VERSION
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


def test_a_region_of_another_version_is_refused(tmp_path: Path) -> None:
    r = region.Region.create(tmp_path)
    r.layout.header.version = region.VERSION + 1
    r.close()
    with pytest.raises(region.RegionVersionError, match="version 2"):
        region.Region.open(tmp_path)
    # The agent replaces a foreign region instead of adopting it.
    fresh = region.Region.create(tmp_path)
    assert fresh.layout.header.version == region.VERSION
    fresh.close()


def test_an_agent_restart_adopts_groups_and_slots(tmp_path: Path) -> None:
    first = region.Region.create(tmp_path)
    index = first.set_group("train", 4 << 30, 0.2, 0.6)
    first.layout.slots[7].pid = 4242
    first.close()
    second = region.Region.create(tmp_path)
    assert second.group_index("train") == index
    assert second.layout.groups[index].max_util_ppm == 600_000
    assert [i for i, _ in second.live_slots()] == [7]
    assert second.free_slot(7, 4242)
    assert list(second.live_slots()) == []
    second.close()
