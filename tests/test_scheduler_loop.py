"""The loop that runs every GPU's looks in one thread (gemtrace/agent/scheduler_loop.py), on real
doorbells: which GPUs a ring brings to look, in one pass; a failed look; the stop; and the agent's
fallback to a thread per GPU where futex_waitv cannot be used. What a look decides is
tests/test_scheduler.py's."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from simgpu_env import REPO
from structlog.testing import capture_logs
from testkit import wait_until

from gemtrace import region as rg
from gemtrace.agent import scheduler_loop
from gemtrace.agent.agent import Agent
from gemtrace.agent.policy import MS, PolicyParams
from gemtrace.agent.scheduler import GpuScheduler, Quota
from gemtrace.agent.scheduler_loop import (
    RETRY_NS,
    RING_CPU_BURST_NS,
    RING_CPU_SHARE,
    SchedulerLoop,
    scheduler_threads,
)
from gemtrace.gpus import Gpu
from gemtrace.region import futex
from gemtrace.region.doorbells import Doorbells

pytestmark = pytest.mark.unit

SECOND = 1000 * MS


class RecordedBells:
    """Real doorbells whose every sleep of the loop is written in `events`."""

    def __init__(self, bells: Doorbells, events: list[str]) -> None:
        self.bells, self.events = bells, events

    def rung(self, gpu: int) -> int:
        return self.bells.rung(gpu)

    def own_rings(self, gpu: int) -> int:
        return self.bells.own_rings(gpu)

    def wait(self, seen: dict[int, int], timeout_ns: int) -> None:
        self.events.append("sleep")
        self.bells.wait(seen, timeout_ns)


class OneGpu:
    """A GPU's scheduler as the loop sees it (scheduler_loop.Scheduling): each look is written in
    `events`; a look may ring other GPUs' bells, as a gang report that changes their turns does."""

    def __init__(self, gpu: int, bells: Doorbells, events: list[str], news: bool = True) -> None:
        self.gpu, self.bells, self.events, self.news = gpu, bells, events, news
        self.rings: list[int] = []  # the bells its looks ring
        self.failures = 0  # its next looks that fail
        self.asked = 0  # how often the loop asked whether a ring was news
        self.looked_at: list[int] = []

    def step(self) -> int:
        self.events.append(f"look{self.gpu}")
        self.looked_at.append(time.monotonic_ns())
        if self.failures:
            self.failures -= 1
            raise RuntimeError("a look that fails")
        for other in self.rings:
            self.bells.ring(other)
        return time.monotonic_ns() + 30 * SECOND

    def listens_for_rings(self) -> bool:
        return True

    def ring_is_news(self) -> bool:
        self.asked += 1
        return self.news

    def release_all(self) -> None:
        self.events.append(f"release{self.gpu}")

    def stopped(self) -> None:
        self.events.append(f"stopped{self.gpu}")


@pytest.fixture
def bells() -> Iterator[Doorbells]:
    made = Doorbells(0x100B)
    yield made
    made.close()


class Running:
    def __init__(self, gpus: list[OneGpu], bells: Doorbells, events: list[str]) -> None:
        self.bells = bells
        self.stop = threading.Event()
        loop = SchedulerLoop(gpus, RecordedBells(bells, events))  # type: ignore[arg-type]
        self.thread = threading.Thread(target=loop.run, args=(self.stop,))
        self.events = events

    def asleep(self, since: int = 0) -> int:
        """Once the loop sleeps again after event `since`: where the events go on from."""
        wait_until("the loop to sleep", lambda: len(self.events) > since and self.events[-1] == "sleep", timeout=10)
        return len(self.events)

    def looked(self, since: int) -> list[str]:
        """Once the loop looked after event `since` and sleeps again: the events from its first look on.
        (A ring that comes within RING_GAP_NS of a GPU's last look brings a sleep until the gap has
        passed first: on a busy host the test's ring can.)"""
        def after() -> list[str]:
            events = self.events[since:]
            return events[next((i for i, e in enumerate(events) if e != "sleep"), len(events)):]
        wait_until("the loop to look and sleep", lambda: len(after()) > 1 and after()[-1] == "sleep", timeout=10)
        return after()

    def close(self) -> None:
        """As the agent stops: the stop set, then every bell rung (Region.stop)."""
        self.stop.set()
        self.bells.ring_all()
        self.thread.join(10)
        assert not self.thread.is_alive()


def run_loop(gpus: list[OneGpu], bells: Doorbells, events: list[str]) -> Running:
    running = Running(gpus, bells, events)
    running.thread.start()
    return running


def test_a_ring_brings_the_look_of_its_gpu_alone(bells: Doorbells) -> None:
    events: list[str] = []
    gpus = [OneGpu(gpu, bells, events) for gpu in range(3)]
    running = run_loop(gpus, bells, events)
    try:
        start = running.asleep()
        assert events[:start] == ["look0", "look1", "look2", "sleep"]  # the first pass: every GPU
        bells.ring(1)
        assert running.looked(start) == ["look1", "sleep"]
    finally:
        running.close()
    assert events[-3:] == ["stopped0", "stopped1", "stopped2"]


def test_a_look_that_rings_another_gpu_brings_its_look_in_the_same_pass(bells: Doorbells) -> None:
    """A gang turn's change rings the other GPUs of the gang (gang.py): they look after the look that
    changed it, with no sleep in between."""
    events: list[str] = []
    gpus = [OneGpu(gpu, bells, events) for gpu in range(4)]
    running = run_loop(gpus, bells, events)
    try:
        start = running.asleep()
        gpus[1].rings = [2, 3]
        bells.ring(1)
        assert running.looked(start) == ["look1", "look2", "look3", "sleep"]
    finally:
        running.close()


def test_a_ring_that_is_no_news_brings_no_look_and_is_heard_once(bells: Doorbells) -> None:
    events: list[str] = []
    gpus = [OneGpu(0, bells, events, news=False), OneGpu(1, bells, events)]
    running = run_loop(gpus, bells, events)
    try:
        start = running.asleep()
        bells.ring(0)
        wait_until("the ring to be weighed", lambda: gpus[0].asked == 1, timeout=10)
        time.sleep(0.05)
        assert events[start:] == ["sleep"]  # asleep again, and not woken by the same ring again
        assert gpus[0].asked == 1
    finally:
        running.close()


def test_a_failed_look_releases_its_gpu_and_is_tried_again_while_the_others_are_scheduled(
        bells: Doorbells) -> None:
    events: list[str] = []
    gpus = [OneGpu(0, bells, events), OneGpu(1, bells, events)]
    gpus[0].failures = 1
    running = run_loop(gpus, bells, events)
    try:
        start = running.asleep()
        assert events[:start] == ["look0", "release0", "look1", "sleep"]
        bells.ring(1)  # GPU 0's words stay released meanwhile: its bell is not listened to
        bells.ring(0)
        wait_until("GPU 0's second try", lambda: len(gpus[0].looked_at) == 2, timeout=10)
        assert running.looked(start)[:2] == ["look1", "sleep"]
        retried = (gpus[0].looked_at[1] - gpus[0].looked_at[0]) / 1e9
        assert RETRY_NS / 1e9 * 0.9 < retried < 2, retried
    finally:
        running.close()


# -- rings as a gate rings them: any user, as fast as it likes ---------------------------------------

# A gate's ring from another process (the bells' memfd opened through /proc, as a gate maps the one its
# socket sent): GPU argv[3]'s word bumped and woken for argv[4] seconds.
GATE_RINGER = r"""
import ctypes, mmap, sys, time
from gemtrace import contract
from gemtrace.region import futex
with open(sys.argv[1], "r+b") as f:
    page = mmap.mmap(f.fileno(), contract.BELLS_BYTES)
word = ctypes.c_uint32.from_buffer(page, 4 * int(sys.argv[2]))
end = time.monotonic() + float(sys.argv[3])
while time.monotonic() < end:
    word.value += 1
    futex.wake(ctypes.addressof(word), 1)
"""


class CostlyGpu(OneGpu):
    """A GPU whose looks and weighings cost made-up CPU time (`cpu`, the loop's CPU clock): what the
    ring budget is charged, whatever the host's speed."""

    def __init__(self, gpu: int, bells: Doorbells, cpu: list[int], look_ns: int, weigh_ns: int = 0,
                 news: bool = True) -> None:
        super().__init__(gpu, bells, [], news)
        self.cpu, self.look_ns, self.weigh_ns = cpu, look_ns, weigh_ns

    def step(self) -> int:
        self.cpu[0] += self.look_ns
        self.looked_at.append(time.monotonic_ns())
        return time.monotonic_ns() + 30 * SECOND

    def ring_is_news(self) -> bool:
        self.cpu[0] += self.weigh_ns
        return super().ring_is_news()


def flooded(gpus: list[CostlyGpu], bells: Doorbells, cpu: list[int], gpu: int, seconds: float
            ) -> tuple[threading.Event, threading.Thread, subprocess.Popen[bytes]]:
    """The loop over `gpus` (on the made-up CPU clock), GPU `gpu`'s bell rung by another process."""
    stop = threading.Event()
    thread = threading.Thread(target=SchedulerLoop(gpus, bells, cpu_clock=lambda: cpu[0]).run, args=(stop,))
    thread.start()
    wait_until("the first looks", lambda: all(g.looked_at for g in gpus), timeout=10)
    ringer = subprocess.Popen([sys.executable, "-c", GATE_RINGER, f"/proc/{os.getpid()}/fd/{bells.fd}", str(gpu),
                               str(seconds)], env={**os.environ, "PYTHONPATH": str(REPO)})
    return stop, thread, ringer


def stopped(bells: Doorbells, stop: threading.Event, thread: threading.Thread,
            ringer: subprocess.Popen[bytes]) -> None:
    ringer.kill()
    ringer.wait()
    stop.set()
    bells.ring_all()
    thread.join(10)
    assert not thread.is_alive()


@pytest.mark.parametrize("news", [True, False])
def test_a_gate_ringing_in_a_loop_costs_the_loop_its_ring_budget_and_no_more(
        bells: Doorbells, news: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A user ringing a bell as fast as it can: the rings are still heard, but what weighing them and
    the looks they bring cost the loop stays within RING_CPU_SHARE of the time and RING_CPU_BURST_NS
    (95% of a core on a GPU with two busy groups before the budget, bench/results/tenant_loops.md), and the log
    says so once. Counted on a made-up CPU clock: a look costs 1 ms, a weighing 0.5 ms."""
    monkeypatch.setattr(scheduler_loop, "RING_BUDGET_SAY_AFTER_NS", 300 * MS)  # (1 s in the agent)
    cpu = [0]
    gpu = CostlyGpu(0, bells, cpu, look_ns=MS, weigh_ns=MS // 2, news=news)
    with capture_logs() as logs:
        stop, thread, ringer = flooded([gpu], bells, cpu, 0, 30)
        try:
            time.sleep(0.3)  # (the ringer's start)
            looks, asked, spent, began = len(gpu.looked_at), gpu.asked, cpu[0], time.monotonic_ns()
            time.sleep(1.0)
            looks, asked, spent = len(gpu.looked_at) - looks, gpu.asked - asked, cpu[0] - spent
            allowed = RING_CPU_BURST_NS + RING_CPU_SHARE * (time.monotonic_ns() - began)
            assert spent <= allowed + MS, (spent, allowed)
            assert asked >= 20  # heard all the same
            assert (looks >= 20) if news else (looks == 0)
        finally:
            stopped(bells, stop, thread, ringer)
    said = [e for e in logs if e["event"] == "ring_budget_spent"]
    assert len(said) == 1 and said[0]["log_level"] == "warning", said  # once a minute at most


def test_the_agents_own_rings_bring_their_looks_while_a_gates_flood_spent_the_budget(bells: Doorbells) -> None:
    """The agent's own rings (a gang turn's change, a quota set, the reaper) are counted where no user
    writes (Doorbells.own_rings) and never wait for the ring budget: GPU 1's looks that they bring
    follow each other at once while a flood of GPU 0's bell keeps the budget spent. Had they been
    charged, each 10 ms look would wait 50 ms for the budget to refill."""
    cpu = [0]
    gpus = [CostlyGpu(0, bells, cpu, look_ns=10 * MS), CostlyGpu(1, bells, cpu, look_ns=10 * MS)]
    stop, thread, ringer = flooded(gpus, bells, cpu, 0, 30)
    try:
        wait_until("the flood to spend the budget", lambda: len(gpus[0].looked_at) > RING_CPU_BURST_NS // (10 * MS),
                   timeout=10)
        began = time.monotonic()
        for _ in range(40):
            looks = len(gpus[1].looked_at)
            bells.ring(1)
            wait_until("GPU 1's look", lambda: len(gpus[1].looked_at) > looks, timeout=10)  # noqa: B023
        took = time.monotonic() - began
        assert took < 40 * 10 * MS / RING_CPU_SHARE / SECOND / 2, took  # 1 s, where charged looks take 2 s
    finally:
        stopped(bells, stop, thread, ringer)


@pytest.fixture
def region(tmp_path: Path) -> Iterator[rg.Region]:
    region = rg.Region.create(tmp_path)
    region.set_gpus([(f"GPU-{i}", 1 << 30) for i in range(2)])
    yield region
    region.close()


def test_two_real_schedulers_the_rung_gpu_looks_the_other_sleeps_on(region: rg.Region) -> None:
    """Both GPUs idle (nobody released: a first wait is news), their deadlines seconds away: a ring on
    GPU 1's bell brings GPU 1's look within a fraction of that, and none on GPU 0."""
    params = PolicyParams(slice_ns=SECOND, max_slice_ns=SECOND, poll_ns=SECOND, steady_poll_ns=SECOND)
    schedulers = [GpuScheduler(region, gpu, params=params) for gpu in range(2)]
    a, b = region.set_group("a", None, 0, 1), region.set_group("b", None, 0, 1)
    for scheduler in schedulers:
        scheduler.set_quotas({a: Quota(), b: Quota()})
    assert region.doorbells is not None
    stop = threading.Event()
    thread = threading.Thread(target=SchedulerLoop(schedulers, region.doorbells).run, args=(stop,))
    thread.start()
    try:
        wait_until("both GPUs' first looks", lambda: all(s.looks for s in schedulers), timeout=10)
        time.sleep(0.05)
        assert all(s.listens_for_rings() for s in schedulers)
        looks = [s.looks for s in schedulers]
        rung = time.monotonic()
        region.doorbells.ring(1)
        wait_until("GPU 1's look", lambda: schedulers[1].looks > looks[1], timeout=10)
        assert time.monotonic() - rung < 0.5
        time.sleep(0.05)
        assert schedulers[0].looks == looks[0]
        assert all(region.is_held(gpu, group) for gpu in range(2) for group in (a, b))
    finally:
        stop.set()
        thread.join(5)
    assert not thread.is_alive()
    assert not any(region.is_held(gpu, group) for gpu in range(2) for group in (a, b))


# -- where futex_waitv cannot be used -------------------------------------------------------------------


def no_waitv(words: object, timeout_ns: int) -> int | None:
    """futex_waitv as a kernel before 5.16 answers it."""
    raise OSError(errno.ENOSYS, "Function not implemented")


def test_without_futex_waitv_each_gpu_gets_a_thread_and_the_log_says_why_once(
        bells: Doorbells, monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []
    gpus = [OneGpu(gpu, bells, events) for gpu in range(3)]
    assert [name for name, _ in scheduler_threads(gpus, bells)] == ["gemtrace-schedulers"]
    assert scheduler_threads([], bells) == []  # (a host with no GPU)
    monkeypatch.setattr(futex, "waitv", no_waitv)
    with capture_logs() as logs:
        threads = scheduler_threads(gpus, bells)
    assert [name for name, _ in threads] == ["gemtrace-gpu0", "gemtrace-gpu1", "gemtrace-gpu2"]
    said = [e for e in logs if e["event"] == "scheduler_threads_per_gpu"]
    assert len(said) == 1 and "5.16" in said[0]["reason"]


def test_the_agent_without_futex_waitv_schedules_each_gpu_from_a_thread_of_its_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole agent, in-process on two made-up GPUs: a thread per GPU, each GPU's ring still brings
    its look alone, and every word is released at the stop."""
    config = tmp_path / "resource.conf"
    config.write_text("[train]\nMaxUtil = 0.5\n\n[infer]\nMaxUtil = 0.5\n")
    monkeypatch.setattr(futex, "waitv", no_waitv)
    agent = Agent(config, tmp_path / "state", use_ebpf=False,
                  gpus=[Gpu(i, f"GPU-test{i}", "simulated", 16 << 30) for i in range(2)])
    names = {t.name for t in threading.enumerate()}
    agent.start()
    try:
        started = {t.name for t in threading.enumerate()} - names
        assert {"gemtrace-gpu0", "gemtrace-gpu1"} <= started and "gemtrace-schedulers" not in started
        schedulers, region = agent.schedulers, agent.region
        train = region.group_index("train")
        wait_until("both GPUs' first looks", lambda: all(s.looks for s in schedulers), timeout=10)
        wait_until("train held on both GPUs", lambda: all(region.is_held(g, train) for g in range(2)), timeout=10)
        time.sleep(0.3)  # (idle: their next looks are the 250 ms net's)
        looks = [s.looks for s in schedulers]
        assert region.doorbells is not None
        region.doorbells.ring(0)
        wait_until("GPU 0's look", lambda: schedulers[0].looks > looks[0], timeout=10)
        assert schedulers[1].looks == looks[1]
        after = rg.Region.open(tmp_path / "state")
    finally:
        agent.close()
    try:
        assert not any(after.is_held(g, train) for g in range(2))
    finally:
        after.close()
