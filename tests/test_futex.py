"""futex_waitv (gemtrace/region/futex.py, `waitv`) on real doorbells: the agent's one scheduling thread
sleeps on every GPU's bell at once with it. Rung from another process, as gates ring: a wait made
private by mistake would never see such a ring."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
from simgpu_env import REPO

from gemtrace.region import futex
from gemtrace.region.doorbells import Doorbells

pytestmark = pytest.mark.unit

SECOND = 1_000_000_000

# Rings GPU argv[2]'s bell of the doorbells memfd argv[1] (inherited) as a gate does (hook/attach.c,
# gt_ring), once the thread argv[3] (of its parent) sleeps in futex_waitv (its /proc syscall file names 449).
RINGER = """
import ctypes, mmap, sys, time
from gemtrace.contract import BELLS_BYTES
from gemtrace.region import futex
from gemtrace.region.doorbells import BellsLayout
fd, gpu, tid = (int(a) for a in sys.argv[1:])
page = mmap.mmap(fd, BELLS_BYTES)
bells = BellsLayout.from_buffer(page)
deadline = time.monotonic() + 20
while not open(f"/proc/{tid}/syscall").read().startswith("449 "):
    assert time.monotonic() < deadline, "the waiter never slept in futex_waitv"
    time.sleep(0.001)
bells.ring[gpu] += 1
futex.wake(ctypes.addressof(bells) + BellsLayout.ring.offset + 4 * gpu)
"""


@pytest.fixture
def bells() -> Iterator[Doorbells]:
    made = Doorbells(0xF07E)
    yield made
    made.close()


def words(bells: Doorbells, gpus: range) -> list[tuple[int, int]]:
    return [(bells._address(gpu), bells.rung(gpu)) for gpu in gpus]


def test_futex_waitv_is_usable_here() -> None:
    """Linux 5.16 or later, no seccomp filter refusing it: what `make test` runs on (the agent falls back
    to a thread per GPU elsewhere: tests/test_scheduler_loop.py)."""
    assert futex.waitv_unsupported() is None


def test_a_ring_from_another_process_wakes_the_wait_on_any_of_several_bells(bells: Doorbells) -> None:
    seen = words(bells, range(4))
    ringer = subprocess.Popen([sys.executable, "-c", RINGER, str(bells.fd), "2", str(threading.get_native_id())],
                              pass_fds=(bells.fd,), env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        woken = futex.waitv(seen, 30 * SECOND)
    finally:
        assert ringer.wait(30) == 0
    assert woken == 2
    assert [bells.rung(gpu) for gpu in range(4)] == [rung + (gpu == 2) for gpu, (_, rung) in enumerate(seen)]


def test_a_wait_with_no_ring_ends_at_its_timeout(bells: Doorbells) -> None:
    started = time.monotonic_ns()
    assert futex.waitv(words(bells, range(8)), 50_000_000) is None
    assert time.monotonic_ns() - started >= 50_000_000


def test_a_wait_on_a_bell_that_rang_since_it_was_read_returns_at_once(bells: Doorbells) -> None:
    seen = words(bells, range(8))
    bells.ring(5)
    started = time.monotonic_ns()
    assert futex.waitv(seen, 10 * SECOND) is None
    assert time.monotonic_ns() - started < SECOND
