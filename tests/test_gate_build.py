"""What the built gate and simulated GPU ask of the C library that loads them.

The gate goes into every process of the host and of its containers, whose images bring their own
glibc: built on Debian 12 it needed GLIBC_2.34, and a process of glibc 2.31 under it did not start at
all (`version GLIBC_2.34 not found (required by libgemgate.so)`, exit 1: seen in a Debian 11 root).
hook/libc_compat.h holds it to GT_GLIBC_FLOOR. The simulated GPU's libraries and clients run in the
e2e tier's pods, whose image is Debian 12 (glibc 2.36), whatever host built them.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from simgpu_env import REPO, SIMGPU_DIR

GATE = REPO / "build" / "libgemgate.so"
IMAGE_GLIBC = (2, 36)  # Debian 12's, the e2e image's rootfs (packaging/image/build.sh)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def gate_floor() -> tuple[int, ...]:
    found = re.search(r'#define GT_GLIBC_FLOOR "([0-9.]+)"', (REPO / "hook" / "libc_compat.h").read_text())
    assert found, "hook/libc_compat.h no longer defines GT_GLIBC_FLOOR"
    return _version(found[1])


def symbol_table(path: Path) -> str:
    """`path`'s dynamic symbols as objdump -T lists them."""
    return subprocess.run(["objdump", "-T", str(path)], capture_output=True, text=True, check=True).stdout


def glibc_needs(path: Path) -> dict[str, tuple[int, ...]]:
    """Each undefined dynamic symbol of `path` bound to a GLIBC_x.y version, and that version."""
    table = symbol_table(path)
    return {m[2]: _version(m[1]) for m in re.finditer(r"\*UND\*\s+\S+\s+\(GLIBC_([0-9.]+)\)\s+(\S+)", table)}


def needed(path: Path) -> list[str]:
    dynamic = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^]]+)\]", dynamic)


def test_the_gate_needs_no_glibc_newer_than_its_floor() -> None:
    needs = glibc_needs(GATE)
    assert "dlopen" in needs  # (the table was read: the gate opens libcuda)
    floor = gate_floor()
    assert {name: version for name, version in needs.items() if version > floor} == {}


def test_the_gate_needs_no_library_but_libc_and_binds_what_moved_in_2_34_weakly() -> None:
    # Under an older glibc dlopen and pthread_mutex_trylock live in libdl.so.2 and libpthread.so.0,
    # which a minimal image may lack (the e2e tier's test image has neither: naming them stopped every
    # pod's program with exit 127). Weak, they are found where the process has them.
    assert needed(GATE) == ["libc.so.6"]
    weak = set(re.findall(r"\s+w\s+DF\s+\*UND\*\s+\S+\s+\(GLIBC_[0-9.]+\)\s+(\S+)", symbol_table(GATE)))
    assert {"dlopen", "dlclose", "dlvsym", "pthread_mutex_trylock"} <= weak


def test_the_simulated_gpu_runs_in_the_e2e_image() -> None:
    too_new = {}
    for name in ("libcuda.so.1", "libnvidia-ml.so.1", "simgpu-rt", "simgpu-linked"):
        needs = glibc_needs(SIMGPU_DIR / name)
        assert needs, name
        too_new[name] = {symbol: version for symbol, version in needs.items() if version > IMAGE_GLIBC}
    assert too_new == dict.fromkeys(too_new, {})
