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
Any gated user can ring any bell, as fast as it likes: a ring brings a look no sooner than RING_GAP_NS
after the GPU's last look, and what the gates' rings cost this thread (weighing them: is it news?;
the looks they bring; the wake-ups around them) is held to RING_CPU_SHARE of a core over time
(`_RingBudget`, measured as this thread's CPU time); once that is spent, rings wait until it
refills, and the looks at deadlines go on. The agent's own rings (a gang turn's change, a quota set,
the reaper) are not charged: Doorbells counts them where no user can write. A GPU whose look fails
has its words released and is looked at again RETRY_NS later, the other GPUs scheduled meanwhile; on
the way out every GPU's words are released.
Where futex_waitv cannot be used (a kernel before 5.16, a seccomp filter), each GPU gets a loop and a
thread of its own (one bell: a plain futex wait), as the agent ran before, each with a ring budget of
its own.
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

__all__ = ["PER_GPU_THREAD_PREFIX", "RETRY_NS", "RING_CPU_BURST_NS", "RING_CPU_SHARE", "RING_GAP_NS", "THREAD_NAME",
           "SchedulerLoop", "scheduler_threads"]

log = structlog.get_logger("gemtrace.scheduler")

# The least time between the start of a look and a look that a doorbell ring brings (any gated user can
# ring it: a ring loop brings at most 4000 a second, and the ring budget below fewer).
RING_GAP_NS = 250_000
# What the gates' rings may cost the scheduling thread over time, as a share of one core, and how much
# of it may be spent at once. In the normal course (a held thread starting to wait, a drain's end, a
# busy holder gone quiet) the whole scheduling thread takes 5-8% of a core at the region's limit, the
# rings' part of it less (bench/results/agent_cpu.md); 1024 processes starting together spend it for a
# second or two (their first waits ring together), and wait milliseconds. A user ringing in a loop cost
# 95% of a core beside two busy groups and 19% with the GPU idle (bench/results/tenant_loops.md).
RING_CPU_SHARE = 0.10
RING_CPU_BURST_NS = 50_000_000
# The budget spent is said in the log once rings have waited for it, with no second of rest, this long
# (processes starting together: nothing to say), and then at most once a minute (who rang cannot be
# known: a bell has no owner).
RING_BUDGET_SAY_AFTER_NS = 10_000_000_000
RING_BUDGET_REST_NS = 1_000_000_000  # a rest this long between two waits ends a spell of them
RING_BUDGET_SAID_NS = 60_000_000_000
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
    own_rings: int = 0  # the agent's own rings of its bell as counted then (Doorbells.own_rings)
    looked: int = 0  # when its last look started
    look_at: int = 0  # its next look, rings aside
    listens: bool = False  # a ring may bring a look before look_at
    news_at: int | None = None  # a ring with news came: its look, once RING_GAP_NS passed
    news_charged: bool = False  # that ring was not (only) the agent's: its look is charged to the budget
    deaf_until: int = 0  # a ring came while the budget was spent: its bell is not slept on until then


class _RingBudget:
    """What the gates' rings may still cost the loop's thread, in ns of its CPU time: RING_CPU_SHARE of
    the time passed, at most RING_CPU_BURST_NS saved up. Charged with all of the thread's CPU time but
    the looks that no gate's ring brought (`free`: a deadline, the agent's own ring): weighing rings,
    the looks they bring, and the wake-ups and bookkeeping of the loop around them."""

    def __init__(self, clock: Callable[[], int], cpu_clock: Callable[[], int]) -> None:
        self._clock, self._cpu_clock = clock, cpu_clock
        self._left = RING_CPU_BURST_NS
        self._at, self._cpu_at, self._free = clock(), cpu_clock(), 0

    def free(self, cpu_ns: int) -> None:
        """CPU time the thread spent on work that no gate asked for."""
        self._free += cpu_ns

    def open_at(self, now: int) -> int:
        """When rings may be weighed again: `now` while some budget is left, else once it refilled."""
        cpu = self._cpu_clock()
        spent = max(0, cpu - self._cpu_at - self._free)
        self._left = min(RING_CPU_BURST_NS, self._left + int((now - self._at) * RING_CPU_SHARE)) - spent
        self._at, self._cpu_at, self._free = now, cpu, 0
        return now if self._left > 0 else now + int(-self._left / RING_CPU_SHARE) + 1


class SchedulerLoop:
    """Runs the looks of some GPUs' schedulers in one thread (`run`)."""

    def __init__(self, schedulers: Sequence[Scheduling], bells: Doorbells,
                 clock: Callable[[], int] = time.monotonic_ns,
                 cpu_clock: Callable[[], int] = time.thread_time_ns) -> None:
        """`cpu_clock`: this thread's CPU time, what the gates' rings are charged in."""
        self._gpus = [_Gpu(s, s.gpu) for s in schedulers]
        self._bells = bells
        self._clock = clock
        self._cpu_clock = cpu_clock
        self._budget = _RingBudget(clock, cpu_clock)
        self._spent_from: int | None = None  # since when rings wait for the budget, no second of rest between
        self._spent_last = 0
        self._budget_said_at: int | None = None

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
        gpu.own_rings = self._bells.own_rings(gpu.index)
        gpu.looked = self._clock()
        charged, gpu.news_at, gpu.news_charged = gpu.news_at is not None and gpu.news_charged, None, False
        cpu = 0 if charged else self._cpu_clock()
        try:
            wake_at = gpu.scheduler.step()
        except Exception:
            log.exception("scheduler_step_failed", gpu=gpu.index)
            gpu.scheduler.release_all()
            gpu.listens, gpu.look_at = False, self._clock() + RETRY_NS
            return
        finally:
            if not charged:
                self._budget.free(self._cpu_clock() - cpu)
        gpu.listens = gpu.scheduler.listens_for_rings()
        # A GPU that listens looks no sooner than the ring gap, whatever brings the look.
        gpu.look_at = max(wake_at, gpu.looked + RING_GAP_NS) if gpu.listens else wake_at

    def _due(self, gpu: _Gpu) -> int:
        """When `gpu` is to look next: at its deadline, or once the gap passed where its bell rang with
        news. A ring that is no news is taken as heard: the GPU sleeps on. A ring of a gate's (not only
        the agent's own) is weighed only while the ring budget lasts; until it refills, the GPU's bell is
        not slept on (it would wake the loop at once)."""
        if gpu.news_at is not None:
            return gpu.news_at
        if gpu.listens:
            rung = self._bells.rung(gpu.index)
            if rung != gpu.rung:
                own_rings = self._bells.own_rings(gpu.index)
                charged = own_rings == gpu.own_rings  # no ring of the agent's since: a gate's
                if charged:
                    now = self._clock()
                    open_at = self._budget.open_at(now)
                    if open_at > now:
                        self._say_budget_spent(now, gpu.index)
                        gpu.deaf_until = open_at
                        return min(gpu.look_at, open_at)
                news = gpu.scheduler.ring_is_news()
                gpu.own_rings = own_rings
                if news:
                    gpu.news_at, gpu.news_charged = gpu.looked + RING_GAP_NS, charged
                    return gpu.news_at
                gpu.rung = rung
        return gpu.look_at

    def _say_budget_spent(self, now: int, gpu: int) -> None:
        """A ring of `gpu` waits for the budget: said once that has lasted RING_BUDGET_SAY_AFTER_NS."""
        if self._spent_from is None or now - self._spent_last > RING_BUDGET_REST_NS:
            self._spent_from = now
        self._spent_last = now
        if now - self._spent_from >= RING_BUDGET_SAY_AFTER_NS and (
                self._budget_said_at is None or now - self._budget_said_at >= RING_BUDGET_SAID_NS):
            self._budget_said_at = now
            log.warning("ring_budget_spent", gpu=gpu, share=RING_CPU_SHARE,
                        seconds=round((now - self._spent_from) / 1e9, 1),
                        consequence="the gates' rings wait for the budget to refill (milliseconds at a time); "
                                    "the looks at deadlines go on. A user may be ringing the doorbells in a loop")

    def _sleep(self) -> None:
        """Until the earliest GPU's look, or a ring on the bell of a GPU that listens."""
        until = min(self._due(gpu) for gpu in self._gpus)
        now = self._clock()
        left = until - now
        if left <= 0:
            return
        seen = {gpu.index: gpu.rung for gpu in self._gpus
                if gpu.listens and gpu.news_at is None and gpu.deaf_until <= now}
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
