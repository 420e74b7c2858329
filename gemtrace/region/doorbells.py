"""The doorbells (hook/gemtrace_region.h, struct gt_bells): one futex word per GPU that a gate rings
when one of its threads starts waiting on a held word, so that a scheduler can sleep until such a
wait where it is news, instead of polling for it.

The page is a memfd the agent makes, seals against shrinking and growing, and sends read-write with
every answer of its socket (server.py). Every user can ring it, or write anything there:
a bell only wakes a scheduler up, which spaces and budgets what the gates' rings cost it
(gemtrace/agent/scheduler_loop.py); the agent's own rings it counts here, where no user writes.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Mapping

from gemtrace.contract import BELLS_BYTES, BELLS_MEMFD, MAX_GPUS
from gemtrace.region import futex
from gemtrace.region.chunks import sealed_memfd


class BellsLayout(ctypes.Structure):
    _fields_ = [("ring", ctypes.c_uint32 * MAX_GPUS), ("joined", ctypes.c_uint32 * MAX_GPUS),
                ("reserved", ctypes.c_uint32 * (BELLS_BYTES // 4 - 2 * MAX_GPUS))]


def bells_name(region_id: int) -> str:
    return f"{BELLS_MEMFD}-{region_id:x}"


class Doorbells:
    """The agent's doorbells: the memfd (`fd`, for the socket) and its mapping."""

    def __init__(self, region_id: int) -> None:
        self.fd = sealed_memfd(bells_name(region_id), BELLS_BYTES)
        try:
            self._map = mmap.mmap(self.fd, BELLS_BYTES)
        except BaseException:
            os.close(self.fd)
            raise
        self.layout = BellsLayout.from_buffer(self._map)
        # How often the agent itself rang each bell, in its own memory (no user can write it): a ring
        # of the agent's brings its look free of the gates' ring budget (gemtrace/agent/scheduler_loop.py).
        self._own = [0] * MAX_GPUS

    def rung(self, gpu: int) -> int:
        """How often GPU `gpu`'s bell rang (modulo 2**32): read it before a look, wait on it after."""
        return int(self.layout.ring[gpu])

    def own_rings(self, gpu: int) -> int:
        """How often the agent rang GPU `gpu`'s bell itself (`ring`): not a user's doing."""
        return self._own[gpu]

    def joined(self, gpu: int) -> int:
        """How often a gate began to use GPU `gpu` (set its slot's gpu_mask bit), modulo 2**32: a
        scheduler looks for new users among the slots only when this moved (or at its net)."""
        return int(self.layout.joined[gpu])

    def wait(self, seen: Mapping[int, int], timeout_ns: int) -> None:
        """Sleep until the bell of any GPU of `seen` (GPU -> its bell as read) rings after it was read,
        or `timeout_ns` passed; may return early. Several bells need futex_waitv (Linux 5.16 or later:
        futex.waitv_unsupported says where not); one is a plain futex wait."""
        if timeout_ns <= 0:
            return
        if len(seen) == 1:
            [(gpu, rung)] = seen.items()
            futex.wait(self._address(gpu), rung, timeout_ns)
        else:
            futex.waitv([(self._address(gpu), rung) for gpu, rung in seen.items()], timeout_ns)

    def ring(self, gpu: int) -> None:
        """Ring GPU `gpu`'s bell as a gate does: its scheduler looks now, not at its next deadline."""
        self._own[gpu] += 1  # (before the ring: the scheduler it wakes sees the ring as the agent's)
        self.layout.ring[gpu] += 1  # (wraps at 2**32, as the gate's atomic add does)
        futex.wake(self._address(gpu))

    def ring_all(self) -> None:
        for gpu in range(len(self.layout.ring)):
            self.ring(gpu)

    def _address(self, gpu: int) -> int:
        return ctypes.addressof(self.layout) + BellsLayout.ring.offset + 4 * gpu

    def close(self) -> None:
        del self.layout
        self._map.close()
        os.close(self.fd)
