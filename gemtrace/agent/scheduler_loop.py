"""When the GPUs' schedulers look: one thread for all the agent's GPUs, sleeping on their doorbells.

This module owns the sleeping between looks (gemtrace/agent/scheduler.py owns a look, and the rules of
which ring is news to a GPU). The loop sleeps until the earliest GPU's deadline or a ring on the bell
of any GPU that listens for rings (`GpuScheduler.listens_for_rings`; Linux's futex_waitv waits on
several words at once), then looks at every GPU whose deadline came or whose bell rang with news
(`GpuScheduler.ring_is_news`; a ring that is no news is taken as heard, with no look), one after
another, reading the bells again after each look: a gang turn that one GPU's look changed rings the
other GPUs of the gang (gemtrace/agent/gang.py), and they look in the same pass. Why: with a thread
per GPU, every turn's change at the region's limit woke 8 threads at once, each paying a wake-up after
a sleep (cold caches) and then queueing on the GIL behind the others' looks (bench/results/agent_cpu.md).
A ring brings a look no sooner than RING_GAP_NS after the GPU's last one (any user can ring). A GPU
whose look fails has its words released and is looked at again RETRY_NS later, the other GPUs
scheduled meanwhile; on the way out every GPU's words are released.
Where futex_waitv cannot be used (a kernel before 5.16, a seccomp filter), each GPU gets a loop and a
thread of its own (one bell: a plain futex wait), as the agent ran before.
It never decides anything nor touches the region itself.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import structlog

from gemtrace.region import futex
from gemtrace.region.doorbells import Doorbells

__all__ = ["PER_GPU_THREAD_PREFIX", "RETRY_NS", "RING_GAP_NS", "THREAD_NAME", "SchedulerLoop", "scheduler_threads"]

log = structlog.get_logger("gemtrace.scheduler")

# The least time between the start of a look and a look that a doorbell ring brings (any gated user
# can ring it: a forged ring loop costs at most this many looks a second, 4000, not a core).
RING_GAP_NS = 250_000
# After a look that failed (its words released meanwhile: no gate waits on a scheduler that cannot
# decide), the next try.
RETRY_NS = 100_000_000
# The scheduling threads' names (the benches count their CPU by name).
THREAD_NAME = "gemtrace-schedulers"
PER_GPU_THREAD_PREFIX = "gemtrace-gpu"  # + the GPU's index, where each GPU has its own


class Scheduling(Protocol):
    """What the loop needs of one GPU's scheduler (gemtrace/agent/scheduler.py, GpuScheduler)."""

    gpu: int

    def step(self) -> int: ...
    def listens_for_rings(self) -> bool: ...
    def ring_is_news(self) -> bool: ...
    def release_all(self) -> None: ...
    def stopped(self) -> None: ...


@dataclass(slots=True)
class _Gpu:
    scheduler: Scheduling
    index: int
    rung: int = 0  # its bell as read before its last look (or the last ring taken as heard)
    looked: int = 0  # when its last look started
    look_at: int = 0  # its next look, rings aside
    listens: bool = False  # a ring may bring a look before look_at
    news_at: int | None = None  # a ring with news came: its look, once RING_GAP_NS passed


class SchedulerLoop:
    """Runs the looks of some GPUs' schedulers in one thread (`run`)."""

    def __init__(self, schedulers: Sequence[Scheduling], bells: Doorbells,
                 clock: Callable[[], int] = time.monotonic_ns) -> None:
        self._gpus = [_Gpu(s, s.gpu) for s in schedulers]
        self._bells = bells
        self._clock = clock

    def run(self, stop: threading.Event) -> None:
        """Schedule until `stop` is set; every GPU's words are released on the way out."""
        for gpu in self._gpus:
            log.info("scheduler_started", gpu=gpu.index)
        try:
            while not stop.is_set():
                for gpu in self._gpus:
                    if self._due(gpu) <= self._clock():
                        self._look(gpu)
                self._sleep()
        finally:
            for gpu in self._gpus:
                try:
                    gpu.scheduler.stopped()
                except Exception:  # (the other GPUs' words are released all the same)
                    log.exception("scheduler_stop_failed", gpu=gpu.index)
                log.info("scheduler_stopped", gpu=gpu.index)

    def _look(self, gpu: _Gpu) -> None:
        # Read before the look: a gate that rings during it is heard after it.
        gpu.rung = self._bells.rung(gpu.index)
        gpu.looked = self._clock()
        gpu.news_at = None
        try:
            wake_at = gpu.scheduler.step()
        except Exception:
            log.exception("scheduler_step_failed", gpu=gpu.index)
            gpu.scheduler.release_all()
            gpu.listens, gpu.look_at = False, self._clock() + RETRY_NS
            return
        gpu.listens = gpu.scheduler.listens_for_rings()
        # A GPU that listens looks no sooner than the ring gap, whatever brings the look.
        gpu.look_at = max(wake_at, gpu.looked + RING_GAP_NS) if gpu.listens else wake_at

    def _due(self, gpu: _Gpu) -> int:
        """When `gpu` is to look next: at its deadline, or once the gap passed where its bell rang with
        news. A ring that is no news is taken as heard: the GPU sleeps on."""
        if gpu.news_at is not None:
            return gpu.news_at
        if gpu.listens:
            rung = self._bells.rung(gpu.index)
            if rung != gpu.rung:
                if gpu.scheduler.ring_is_news():
                    gpu.news_at = gpu.looked + RING_GAP_NS
                    return gpu.news_at
                gpu.rung = rung
        return gpu.look_at

    def _sleep(self) -> None:
        """Until the earliest GPU's look, or a ring on the bell of a GPU that listens."""
        until = min(self._due(gpu) for gpu in self._gpus)
        left = until - self._clock()
        if left <= 0:
            return
        seen = {gpu.index: gpu.rung for gpu in self._gpus if gpu.listens and gpu.news_at is None}
        if seen:
            self._bells.wait(seen, left)
        else:
            # A plain sleep costs about half the CPU of an Event.wait wake-up; `stop` is still seen
            # within one look (at most the policy's longest sleep, 60 ms).
            time.sleep(left / 1e9)


def scheduler_threads(schedulers: Sequence[Scheduling], bells: Doorbells) -> list[tuple[str, SchedulerLoop]]:
    """The scheduling threads to start, by name: one for every GPU, or where the kernel will not wait
    on several words at once, one per GPU (said once in the log). None where there is no GPU."""
    if not schedulers:
        return []
    if len(schedulers) > 1 and (reason := futex.waitv_unsupported()) is not None:
        log.warning("scheduler_threads_per_gpu", reason=reason, gpus=len(schedulers))
        return [(f"{PER_GPU_THREAD_PREFIX}{s.gpu}", SchedulerLoop([s], bells)) for s in schedulers]
    return [(THREAD_NAME, SchedulerLoop(schedulers, bells))]
