"""The scheduler's adapter on a real region file, with slots written by hand as gates would and a
fake clock: what it reads, which words it holds and releases, and that it never leaves one held."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import testkit

from gemtrace import region as rg
from gemtrace.agent.gang import GangTurns, JobKeys
from gemtrace.agent.policy import MS, Decision, PolicyParams
from gemtrace.agent.scheduler import RESCAN_NET_NS, GpuScheduler, Quota, SlotTable

pytestmark = pytest.mark.unit

GPU = 1  # not 0: a mix-up of GPU indices shows
# Turns between groups that nothing binds, as where they could not share the GPU (several processes
# each): the adapter's turns are what most tests here walk through; sharing has its own tests below.
TURNS = PolicyParams(share_unbound=False)


class FakeClock:
    def __init__(self) -> None:
        self.t = 1_000 * MS

    def __call__(self) -> int:
        return self.t

    def advance(self, ns: int) -> None:
        self.t += ns


@pytest.fixture
def region(tmp_path: Path) -> Iterator[rg.Region]:
    region = rg.Region.create(tmp_path)
    region.set_gpus([(f"GPU-{i}", 1 << 30) for i in range(2)])
    yield region
    region.close()


def claim(region: rg.Region, index: int, pid: int, group: int) -> rg.Slot:
    """A gate's claim, the agent's decision, and the slot's first use of GPU."""
    slot = testkit.claim(region, index, pid, group)
    use_gpu(region, slot)
    return slot


def use_gpu(region: rg.Region, slot: rg.Slot, gpu: int = GPU) -> None:
    """What a gate does on its first use of a GPU: set the slot's bit, then count a new user in the
    doorbells (hook/attach.c, gt_note_gpu)."""
    slot.gpu_mask |= 1 << gpu
    assert region.doorbells is not None
    region.doorbells.layout.joined[gpu] += 1


def launch(slot: rg.Slot, count: int, now: int) -> None:
    """What the gate stores for `count` launches at `now`: a burst opens unless one is open."""
    if slot.drained_ns[GPU] >= slot.burst_start_ns[GPU]:
        slot.burst_start_ns[GPU] = max(now, slot.drained_ns[GPU] + 1)
    slot.launches[GPU] += count


def held(region: rg.Region, group: int) -> bool:
    return region.is_held(GPU, group)


def test_slot_table_reads_the_fields_of_one_gpu(region: rg.Region) -> None:
    slot = claim(region, 700, 4242, 3)
    slot.launches[GPU] = 12345678901
    slot.launches[0] = 7
    slot.waiting[GPU] = 2
    slot.drained_ns[GPU] = 99
    slot.burst_start_ns[GPU] = 98
    table = SlotTable(region, GPU)
    assert table.live() == [700]
    t = table
    fields = (t.pid[700], t.group[700], t.launches[700], t.waiting[700], t.drained_ns[700], t.burst_start_ns[700])
    assert fields == (4242, 3, 12345678901, 2, 99, 98)
    assert SlotTable(region, 0).launches[700] == 7


def test_a_waiting_group_is_released_and_the_others_stay_held(region: rg.Region) -> None:
    clock = FakeClock()
    scheduler = GpuScheduler(region, GPU, clock, rescan_ns=0, params=TURNS)
    a, b = region.set_group("a", None, 0, 1), region.set_group("b", None, 0, 1)
    scheduler.set_quotas({a: Quota(), b: Quota()})
    scheduler.step()
    assert held(region, a) and held(region, b)  # nobody wants the GPU: all held
    slot = claim(region, 0, 1001, a)
    slot.waiting[GPU] = 1
    scheduler.step()
    assert not held(region, a) and held(region, b)
    assert not region.is_held(0, a)  # the other GPU is not this scheduler's
    # Alone and uncapped, with no hold in sight: its queue is bounded, loosely (a group that comes
    # later waits for that backlog); a group this scheduler does not drive is released plainly.
    assert region.layout.control[GPU][a].held == rg.RELEASED_LONG_QUEUE
    c = region.set_group("c", None, 0, 1)
    assert region.layout.control[GPU][c].held == rg.RELEASED
    # Another group wants the GPU: a hold is coming, the holder's queue is kept short.
    claim(region, 1, 1002, b).waiting[GPU] = 1
    clock.advance(1 * MS)
    scheduler.step()
    assert region.layout.control[GPU][a].held == rg.RELEASED_SHORT_QUEUE


def test_a_new_process_is_seen_at_its_ring_or_at_the_net(region: rg.Region) -> None:
    clock = FakeClock()
    scheduler = GpuScheduler(region, GPU, clock)
    a = region.set_group("a", None, 0, 1)
    scheduler.set_quotas({a: Quota()})
    scheduler.step()
    # Its thread waits on the held word and rings: the look the ring brings scans for it.
    claim(region, 3, 1001, a).waiting[GPU] = 1
    ring(region, GPU)
    clock.advance(1 * MS)
    scheduler.step()
    assert not held(region, a)
    # Without a ring (one lost): its slot was assigned and its gate counted it, so the look at the net
    # scans for it.
    b = region.set_group("b", None, 0, 1)
    scheduler.set_quotas({a: Quota(), b: Quota()})
    region.slots[3].waiting[GPU] = 0
    clock.advance(1 * MS)
    wake = scheduler.step()
    start = clock()
    claim(region, 4, 1002, b).waiting[GPU] = 1
    for _ in range(100):  # the looks as run() makes them with no ring: each at the last one's wake_at
        if not held(region, b):
            break
        clock.advance(wake - clock())
        wake = scheduler.step()
    # The net's look (or the slice's end, where sooner), then a's drain (quiet: it ends at once, looked at
    # a fraction of a ms later).
    assert not held(region, b) and clock() - start <= PolicyParams().ring_net_ns + 1 * MS, clock() - start


@pytest.mark.parametrize("counted", [True, False], ids=["counted", "an-older-gate"])
def test_the_table_is_scanned_for_users_when_a_gate_counts_a_new_one_not_at_every_ring(region: rg.Region,
                                                                                         counted: bool) -> None:
    """A scan of the whole table costs most of a look; rings come twice a switch. A process seen in the
    table before (on the other GPU) that begins to use this one counts itself in the doorbells: the
    look its ring brings finds it. A gate that did not count it (an older build): the net finds it."""
    clock = FakeClock()
    scheduler = GpuScheduler(region, GPU, clock)
    a = region.set_group("a", None, 0, 1)
    scheduler.set_quotas({a: Quota()})
    scheduler.step()
    scans = scheduler.scans
    for _ in range(20):  # rings with nothing new: held processes' drains ending, a forger
        ring(region, GPU)
        clock.advance(1 * MS)
        scheduler.step()
    assert scheduler.scans == scans
    slot = testkit.claim(region, 5, 1005, a)
    use_gpu(region, slot, 0)  # the other GPU first: the scan its assignment brings passes it over
    clock.advance(1 * MS)
    scheduler.step()
    assert scheduler.scans == scans + 1 and held(region, a)
    # It begins to use this GPU: its first launch waits on the held word and rings.
    if counted:
        use_gpu(region, slot)
    else:
        slot.gpu_mask |= 1 << GPU
    slot.waiting[GPU] = 1
    ring(region, GPU)
    clock.advance(1 * MS)
    scheduler.step()
    assert held(region, a) is not counted
    start = clock()
    while held(region, a):
        assert clock() - start <= RESCAN_NET_NS + PolicyParams().ring_net_ns, clock() - start
        clock.advance(scheduler.step() - clock())

def test_slice_end_holds_drains_then_switches(region: rg.Region) -> None:
    clock = FakeClock()
    params = PolicyParams(slice_ns=20 * MS, min_slice_ns=5 * MS, share_unbound=False)  # (the slice walked through)
    scheduler = GpuScheduler(region, GPU, clock, rescan_ns=0, params=params)
    a, b = region.set_group("a", None, 0, 1), region.set_group("b", None, 0, 1)
    scheduler.set_quotas({a: Quota(), b: Quota()})
    slot_a, slot_b = claim(region, 0, 1001, a), claim(region, 5, 1002, b)
    slot_a.waiting[GPU] = 1
    slot_b.waiting[GPU] = 1
    scheduler.step()
    first = a if not held(region, a) else b
    other = b if first == a else a
    slots = {a: slot_a, b: slot_b}
    slots[first].waiting[GPU] = 0
    released_at = clock()
    # The released group launches through its 20 ms slice; while the other waits its gates are to ring
    # when it goes quiet (early revocation), and no look comes before the slice's end but for that ring.
    for _ in range(9):
        clock.advance(2 * MS)
        launch(slots[first], 100, clock())
        assert scheduler.step() == released_at + 20 * MS
        assert not held(region, first) and held(region, other)
        assert region.layout.control[GPU][first].ring_quiet == 1
    clock.advance(2 * MS)
    launch(slots[first], 100, clock())
    scheduler.step()
    assert held(region, first) and held(region, other)  # held, draining: nobody may launch
    assert region.layout.control[GPU][first].ring_quiet == 0  # (its drain rings, as any held group's)
    clock.advance(1 * MS)
    scheduler.step()
    assert held(region, other)  # not drained yet (still launching)
    slots[first].drained_ns[GPU] = clock()  # the gate drained its queue
    slots[first].waiting[GPU] = 1
    clock.advance(MS // 4)
    scheduler.step()
    assert held(region, first) and not held(region, other)
    usage = scheduler.usage()
    assert usage[first].gpu_seconds == pytest.approx((20 + 1) / 1000, abs=0.003)
    assert usage[other].throttled_seconds == pytest.approx(usage[first].gpu_seconds, abs=0.002)
    # The accounting's read at every poll: usage()'s GPU seconds alone, a group set since the last look at 0.
    assert scheduler.gpu_seconds() == {group: u.gpu_seconds for group, u in usage.items()}
    late = region.set_group("late", None, 0, 1)
    scheduler.set_quotas({first: Quota(), other: Quota(), late: Quota()})
    assert scheduler.gpu_seconds() == {group: u.gpu_seconds for group, u in scheduler.usage().items()}
    assert scheduler.gpu_seconds()[late] == 0.0


def test_a_drain_that_ends_in_a_wait_with_no_drain_time_is_charged_until_seen(region: rg.Region) -> None:
    # A process with work on several streams (NCCL's beside the compute stream) whose stream sync closed
    # its burst stores no drain time; quiet only because its thread now waits on its word, its old
    # drain time made the drain end before the hold: its whole slice was refunded.
    clock = FakeClock()
    params = PolicyParams(slice_ns=20 * MS, share_unbound=False)
    scheduler = GpuScheduler(region, GPU, clock, rescan_ns=0, params=params)
    a, b = region.set_group("a", None, 0, 1), region.set_group("b", None, 0, 1)
    scheduler.set_quotas({a: Quota(), b: Quota()})
    slot_a, slot_b = claim(region, 0, 1001, a), claim(region, 5, 1002, b)
    slot_a.drained_ns[GPU] = clock()  # its one full drain, long ago
    clock.advance(MS)
    slot_a.waiting[GPU] = slot_b.waiting[GPU] = 1
    scheduler.step()
    first, other = (a, b) if not held(region, a) else (b, a)
    slots = {a: slot_a, b: slot_b}
    slots[first].waiting[GPU] = 0
    while not held(region, first):
        clock.advance(2 * MS)
        launch(slots[first], 100, clock())
        scheduler.step()
    clock.advance(3 * MS)
    slots[first].waiting[GPU] = 1  # its next launch waits; no drain time was stored
    scheduler.step()
    assert not held(region, other)
    assert scheduler.usage()[first].gpu_seconds >= 0.020


def test_an_idle_holder_is_revoked_when_another_group_waits(region: rg.Region) -> None:
    clock = FakeClock()
    scheduler = GpuScheduler(region, GPU, clock, rescan_ns=0, params=TURNS)
    a, b = region.set_group("a", None, 0, 1), region.set_group("b", None, 0, 1)
    scheduler.set_quotas({a: Quota(), b: Quota()})
    slot_a = claim(region, 0, 1001, a)
    slot_a.waiting[GPU] = 1
    scheduler.step()
    assert not held(region, a)
    slot_a.waiting[GPU] = 0
    clock.advance(1 * MS)
    launch(slot_a, 10, clock())
    scheduler.step()
    clock.advance(1 * MS)
    slot_a.drained_ns[GPU] = clock()  # it synced and went quiet
    claim(region, 1, 1002, b).waiting[GPU] = 1
    for _ in range(3):
        clock.advance(4 * MS)
        scheduler.step()
    assert held(region, a) and not held(region, b)  # well before a's 20 ms slice ended


def test_a_burst_between_two_looks_is_idle_at_the_next(region: rg.Region) -> None:
    # A service: a request's kernels, a sync, a pause, all between two polls. The gate stored when the
    # burst opened, so the drain after it says "nothing queued" at once: the holder is revoked at the
    # next look, not at its slice's end, and charged until its drain, not through its pause.
    clock = FakeClock()
    scheduler = GpuScheduler(region, GPU, clock, rescan_ns=0, params=TURNS)
    a, b = region.set_group("a", None, 0, 1), region.set_group("b", None, 0, 1)
    scheduler.set_quotas({a: Quota(), b: Quota()})
    slot_a, slot_b = claim(region, 0, 1001, a), claim(region, 1, 1002, b)
    slot_a.waiting[GPU] = 1
    scheduler.step()
    assert not held(region, a)
    slot_a.waiting[GPU] = 0
    slot_b.waiting[GPU] = 1
    clock.advance(1 * MS)
    launch(slot_a, 12, clock())
    clock.advance(MS // 2)
    slot_a.drained_ns[GPU] = clock()  # its own sync, covering every launch
    clock.advance(MS // 2)
    scheduler.step()  # the first look after the burst: the counter moved, and yet nothing is queued
    assert held(region, a)  # revoked at once (its drain is already done: b follows at the next look)
    clock.advance(MS // 4)
    scheduler.step()
    assert held(region, a) and not held(region, b)
    assert scheduler.usage()[a].gpu_seconds == pytest.approx(1.5 / 1000, abs=0.0002)


def test_a_burst_no_look_saw_is_charged(region: rg.Region) -> None:
    # A service alone: each request opens and drains between two looks. It is charged what its
    # bursts ran (from their opening to their drain), not nothing and not the pauses.
    clock = FakeClock()
    scheduler = GpuScheduler(region, GPU, clock, rescan_ns=0)
    a = region.set_group("a", None, 0, 1)
    scheduler.set_quotas({a: Quota()})
    slot_a = claim(region, 0, 1001, a)
    slot_a.waiting[GPU] = 1
    scheduler.step()
    slot_a.waiting[GPU] = 0
    clock.advance(1 * MS)
    scheduler.step()  # quiet: nothing charged from here
    for _ in range(10):
        clock.advance(10 * MS)
        launch(slot_a, 12, clock())
        clock.advance(MS // 2)
        slot_a.drained_ns[GPU] = clock()
        clock.advance(10 * MS)
        scheduler.step()
    assert not held(region, a)
    assert scheduler.usage()[a].gpu_seconds == pytest.approx(10 * 0.5 / 1000, abs=1e-6)


def test_a_process_in_a_long_sync_is_busy(region: rg.Region) -> None:
    # A burst opened after its last drain: work is queued however long ago the counter moved (taking
    # such a process for idle let one in an 8 ms sync run beside the next group).
    clock = FakeClock()
    scheduler = GpuScheduler(region, GPU, clock, rescan_ns=0, params=TURNS)
    a, b = region.set_group("a", None, 0, 1), region.set_group("b", None, 0, 1)
    scheduler.set_quotas({a: Quota(), b: Quota()})
    slot_a, slot_b = claim(region, 0, 1001, a), claim(region, 1, 1002, b)
    slot_a.waiting[GPU] = 1
    scheduler.step()
    slot_a.waiting[GPU] = 0
    slot_a.drained_ns[GPU] = clock()
    clock.advance(1 * MS)
    launch(slot_a, 4, clock())
    slot_b.waiting[GPU] = 1
    for _ in range(3):  # 12 ms in its sync: the counter stands still, the burst is open
        clock.advance(4 * MS)
        scheduler.step()
        assert not held(region, a) and held(region, b)
    slot_a.drained_ns[GPU] = clock()
    clock.advance(1 * MS)
    scheduler.step()  # drained: revoked at this look, b released at the next
    clock.advance(MS // 4)
    scheduler.step()
    assert held(region, a) and not held(region, b)


def test_a_group_without_processes_costs_nothing(region: rg.Region) -> None:
    clock = FakeClock()
    scheduler = GpuScheduler(region, GPU, clock, rescan_ns=0)
    a, b = region.set_group("a", None, 0, 1), region.set_group("b", None, 0.5, 1)
    scheduler.set_quotas({a: Quota(), b: Quota(0.5, 1)})
    slot_a = claim(region, 0, 1001, a)
    slot_a.waiting[GPU] = 1
    scheduler.step()
    slot_a.waiting[GPU] = 0
    grants = region.layout.control[GPU][a].grant_seq
    looks = scheduler.looks
    for _ in range(100):
        launch(slot_a, 5, clock())
        clock.advance(scheduler.step() - clock())
    # One look per slice (the default 60 ms), no switch, b never charged.
    assert scheduler.looks - looks == 100
    assert clock() - 1_000 * MS >= 100 * 19 * MS
    assert region.layout.control[GPU][a].grant_seq == grants and not held(region, a)
    assert scheduler.usage()[b].gpu_seconds == 0 and scheduler.usage()[b].throttled_seconds == 0


def test_dropping_a_group_releases_its_word(region: rg.Region) -> None:
    clock = FakeClock()
    scheduler = GpuScheduler(region, GPU, clock, rescan_ns=0)
    a, b = region.set_group("a", None, 0, 1), region.set_group("b", None, 0, 1)
    scheduler.set_quotas({a: Quota(), b: Quota()})
    scheduler.step()
    assert held(region, b)
    scheduler.set_quotas({a: Quota()})
    scheduler.step()
    assert not held(region, b) and held(region, a)


def test_a_dead_process_does_not_hold_up_a_drain(region: rg.Region) -> None:
    clock = FakeClock()
    # Default rescan: between scans a freed slot must still be seen at once.
    scheduler = GpuScheduler(region, GPU, clock, PolicyParams(slice_ns=10 * MS, share_unbound=False))
    a, b = region.set_group("a", None, 0, 1), region.set_group("b", None, 0, 1)
    scheduler.set_quotas({a: Quota(), b: Quota()})
    slot_a, slot_b = claim(region, 0, 1001, a), claim(region, 1, 1002, b)
    slot_a.waiting[GPU] = 1
    scheduler.step()
    slot_a.waiting[GPU] = 0
    slot_b.waiting[GPU] = 1
    for _ in range(6):  # a keeps launching past its slice end, then is held
        launch(slot_a, 1, clock())
        clock.advance(2 * MS)
        scheduler.step()
    assert held(region, a) and held(region, b)
    region.free_slot(0, 1001)  # the agent reaped it: a died while draining
    clock.advance(MS // 4)
    scheduler.step()
    assert not held(region, b)


def test_a_scheduler_refuses_a_region_without_doorbells(region: rg.Region, tmp_path: Path) -> None:
    """Only the agent's region has the doorbells the scheduler sleeps on: an opened one is refused at
    once, not scheduled with looks that no ring ever brings."""
    opened = rg.Region.open(tmp_path)
    try:
        with pytest.raises(ValueError, match="no doorbells"):
            GpuScheduler(opened, GPU)
    finally:
        opened.close()


def test_run_releases_every_word_when_stopped(region: rg.Region) -> None:
    scheduler = GpuScheduler(region, GPU)
    a, b = region.set_group("a", None, 0, 1), region.set_group("b", None, 0, 0.5)
    scheduler.set_quotas({a: Quota(), b: Quota(0, 0.5)})
    stop = threading.Event()
    thread = threading.Thread(target=scheduler.run, args=(stop,))
    thread.start()
    deadline = time.monotonic() + 5
    while not (held(region, a) and held(region, b)) and time.monotonic() < deadline:
        time.sleep(0.001)
    assert held(region, a) and held(region, b)
    stop.set()
    thread.join(5)
    assert not thread.is_alive()
    assert not held(region, a) and not held(region, b)


def ring(region: rg.Region, gpu: int) -> None:
    """What a gate does when one of its threads starts waiting on a held word: add 1 to the GPU's
    doorbell and wake whoever sleeps on it (hook/attach.c, gt_ring)."""
    assert region.doorbells is not None
    region.doorbells.ring(gpu)


def test_a_higher_priority_wait_is_seen_at_the_ring_not_the_next_poll(region: rg.Region) -> None:
    """Polls a second apart: the outranked holder is revoked within a fraction of that once the
    higher-priority group's thread waits and rings, and it kept a tight queue until then."""
    second = 1000 * MS
    params = PolicyParams(slice_ns=second, max_slice_ns=second, poll_ns=second, steady_poll_ns=second)
    scheduler = GpuScheduler(region, GPU, params=params, rescan_ns=0)
    low, high = region.set_group("low", None, 0, 1), region.set_group("high", None, 0, 1)
    scheduler.set_quotas({low: Quota(), high: Quota(priority=5)})
    slot_low = claim(region, 0, 1001, low)
    slot_low.waiting[GPU] = 1
    slot_high = claim(region, 1, 1002, high)
    launch(slot_high, 5, time.monotonic_ns())
    slot_high.drained_ns[GPU] = time.monotonic_ns()  # launched before, quiet now
    for _ in range(3):  # high (its launches are news), seen quiet and revoked, then low
        scheduler.step()
    assert not held(region, low) and held(region, high)
    slot_low.waiting[GPU] = 0
    launch(slot_low, 10, time.monotonic_ns())
    scheduler.step()
    assert region.layout.control[GPU][low].held == rg.RELEASED_OUTRANKED
    stop = threading.Event()
    thread = threading.Thread(target=scheduler.run, args=(stop,))
    thread.start()
    try:
        time.sleep(0.05)  # the run's first look is done: the next is a second away but for a ring
        assert not held(region, low)
        slot_high.waiting[GPU] = 1
        rung = time.monotonic()
        ring(region, GPU)
        while not held(region, low) and time.monotonic() - rung < 2:
            time.sleep(0.001)
        assert held(region, low) and time.monotonic() - rung < 0.5
    finally:
        stop.set()
        thread.join(5)


def test_a_drain_is_looked_at_when_its_last_process_finishes_not_at_each_ring(region: rg.Region) -> None:
    """Each of a drained group's processes rings as its thread starts waiting: the ring of one that
    finished while another still drains brings no look (the look costs a wake-up's worth of CPU and
    could only see the drain unfinished); the last one's brings the look that releases the next group."""
    second = 1000 * MS
    params = PolicyParams(slice_ns=20 * MS, min_slice_ns=5 * MS, poll_ns=second, steady_poll_ns=second,
                          drain_net_ns=second, drain_timeout_ns=2 * second)
    scheduler = GpuScheduler(region, GPU, params=params, rescan_ns=0)
    a, b = region.set_group("a", None, 0, 1), region.set_group("b", None, 0, 1)
    scheduler.set_quotas({a: Quota(), b: Quota()})
    first, second_a = claim(region, 0, 1001, a), claim(region, 1, 1003, a)
    waiter = claim(region, 2, 1002, b)
    first.waiting[GPU] = 1
    scheduler.step()  # a alone wants the GPU: released
    assert not held(region, a)
    first.waiting[GPU] = 0
    waiter.waiting[GPU] = 1
    deadline = time.monotonic() + 2
    while not held(region, a):  # a's two processes launch through its slice, then a is held
        assert time.monotonic() < deadline, "a was never held"
        for slot in (first, second_a):
            launch(slot, 10, time.monotonic_ns())
        scheduler.step()
        time.sleep(0.002)
    assert held(region, b)  # draining: a's processes still run what they queued
    stop = threading.Event()
    thread = threading.Thread(target=scheduler.run, args=(stop,))
    thread.start()
    try:
        time.sleep(0.05)  # the run's first look is done: the next is a second away but for a ring
        looks = scheduler.looks
        first.drained_ns[GPU] = time.monotonic_ns()
        first.waiting[GPU] = 1
        ring(region, GPU)
        time.sleep(0.05)
        assert scheduler.looks == looks and held(region, b)
        second_a.drained_ns[GPU] = time.monotonic_ns()
        second_a.waiting[GPU] = 1
        rung = time.monotonic()
        ring(region, GPU)
        while held(region, b) and time.monotonic() - rung < 2:
            time.sleep(0.001)
        assert not held(region, b) and time.monotonic() - rung < 0.5
    finally:
        stop.set()
        thread.join(5)


def busy_holder_with_a_waiter(region: rg.Region, params: PolicyParams) -> tuple[GpuScheduler, rg.Slot, int]:
    """Group a released and busy (a burst open) while group b waits, in turns: the scheduler, a's slot, b."""
    scheduler = GpuScheduler(region, GPU, params=dataclasses.replace(params, share_unbound=False), rescan_ns=0)
    a, b = region.set_group("a", None, 0, 1), region.set_group("b", None, 0, 1)
    scheduler.set_quotas({a: Quota(), b: Quota()})
    holder, waiter = claim(region, 0, 1001, a), claim(region, 1, 1002, b)
    holder.waiting[GPU] = 1
    scheduler.step()  # a alone wants the GPU: released
    holder.waiting[GPU] = 0
    launch(holder, 10, time.monotonic_ns())
    waiter.waiting[GPU] = 1
    scheduler.step()
    assert not held(region, a) and held(region, b)
    assert region.layout.control[GPU][a].ring_quiet == 1  # its gates ring when it goes quiet
    return scheduler, holder, b


def test_a_holder_that_went_quiet_just_before_its_hold_is_looked_at_again_at_once(region: rg.Region) -> None:
    """The holder's last sync lands after the look read its slots and before its hold is stored: the
    gate saw its group released and rang nobody, and the drain's timeout (seconds here) is its only
    net. The look that held it sees it finished and asks to look again at once; that look releases b."""
    second = 1000 * MS
    params = PolicyParams(slice_ns=5 * MS, min_slice_ns=MS, max_slice_ns=5 * MS, poll_ns=second,
                          steady_poll_ns=second, drain_net_ns=second, drain_timeout_ns=5 * second)
    scheduler, holder, b = busy_holder_with_a_waiter(region, params)
    a = region.slot_groups()[0]
    time.sleep(0.01)  # a's slice is over
    carry_out = scheduler._carry_out

    def sync_lands_before_the_hold(now: int, decision: Decision) -> None:
        holder.drained_ns[GPU] = time.monotonic_ns()  # its sync emptied its queue
        carry_out(now, decision)

    scheduler._carry_out = sync_lands_before_the_hold  # type: ignore[method-assign]
    wake_at = scheduler.step()
    scheduler._carry_out = carry_out  # type: ignore[method-assign]
    assert held(region, a) and held(region, b)
    assert wake_at <= time.monotonic_ns()
    scheduler.step()
    assert not held(region, b)


def test_a_busy_holder_others_wait_for_is_switched_at_its_quiet_ring_not_polled(region: rg.Region) -> None:
    """A busy holder with another group waiting is not polled for going quiet (every 4 ms, most of the
    looks at the region's limit): its gates ring when their sync leaves it with nothing queued, and
    the look that revokes it comes with that ring. Slices and the net are seconds away here: any look
    but the ring's would be a poll. A held group's thread that starts waiting meanwhile rings too, and
    brings no look while the holder still has work."""
    second = 1000 * MS
    params = PolicyParams(slice_ns=5 * second, max_slice_ns=5 * second, drain_net_ns=second,
                          drain_timeout_ns=5 * second)
    scheduler, holder, b = busy_holder_with_a_waiter(region, params)
    stop = threading.Event()
    thread = threading.Thread(target=scheduler.run, args=(stop,))
    thread.start()
    try:
        time.sleep(0.05)  # the run's first look is done
        looks = scheduler.looks
        time.sleep(0.2)
        assert scheduler.looks == looks  # polled every 4 ms, that is 50 looks
        ring(region, GPU)  # another thread of the waiting group starts waiting
        time.sleep(0.05)
        assert scheduler.looks == looks and held(region, b)
        holder.drained_ns[GPU] = time.monotonic_ns()  # its sync emptied its queue: the gate rings
        rung = time.monotonic()
        ring(region, GPU)
        while held(region, b) and time.monotonic() - rung < 2:
            time.sleep(0.001)
        assert not held(region, b) and time.monotonic() - rung < 0.5
        # The ring's look holds the quiet holder, the drain of a quiet holder ends at once (its look a
        # drain poll later), and the next group goes: a few looks, not a poll's worth.
        assert scheduler.looks - looks <= 4
    finally:
        stop.set()
        thread.join(5)


def test_a_quiet_holder_whose_ring_is_lost_is_switched_at_its_slice_s_end(region: rg.Region) -> None:
    """A ring that never comes (the last busy process exited, a gate that predates the ring): the
    look at the holder's slice's end hands the GPU on: the holder keeps the slice it could have used
    anyway, and no look comes before it (a poll would)."""
    params = PolicyParams(slice_ns=300 * MS, max_slice_ns=300 * MS)
    scheduler, holder, b = busy_holder_with_a_waiter(region, params)
    stop = threading.Event()
    thread = threading.Thread(target=scheduler.run, args=(stop,))
    thread.start()
    try:
        time.sleep(0.05)
        looks = scheduler.looks
        holder.drained_ns[GPU] = time.monotonic_ns()  # quiet, and no ring
        quiet = time.monotonic()
        while held(region, b) and time.monotonic() - quiet < 5:
            time.sleep(0.001)
        waited = time.monotonic() - quiet
        assert not held(region, b), "never switched"
        assert 0.1 < waited < 2.5, waited  # at the 300 ms slice's end, not before (no poll)
        assert scheduler.looks - looks <= 4
    finally:
        stop.set()
        thread.join(5)


def test_an_opportunistic_group_is_released_beside_production_naming_its_slots(region: rg.Region) -> None:
    """The words and lists the opportunistic gates read (hook/launch.c, production_busy): alone, the
    opportunistic holder's word is the beside word with no production named; once a production
    process launched here, every opportunistic group is released beside it with the production slots
    listed, and a forged word is put back; when production has gone, it takes turns again."""
    clock = FakeClock()
    scheduler = GpuScheduler(region, GPU, clock, rescan_ns=0)
    spare, serve = region.set_group("spare", None, 0, 1), region.set_group("serve", None, 0, 1)
    scheduler.set_quotas({spare: Quota(opportunistic=True), serve: Quota()})
    control = region.layout.control[GPU]
    trainer = claim(region, 0, 1001, spare)
    launch(trainer, 10, clock())
    trainer.waiting[GPU] = 1
    scheduler.step()
    assert control[spare].held == rg.RELEASED_BESIDE and control[spare].beside_n == 0
    trainer.waiting[GPU] = 0
    service = claim(region, 5, 1002, serve)
    launch(service, 1, clock())
    service.waiting[GPU] = 1
    clock.advance(1 * MS)
    scheduler.step()
    assert control[serve].held in rg.RELEASED_WORDS and control[serve].held != rg.RELEASED_BESIDE
    assert control[spare].held == rg.RELEASED_BESIDE
    assert list(control[spare].beside_slots[: control[spare].beside_n]) == [5]
    control[spare].held = rg.HELD  # forged: put back at the next look
    clock.advance(1 * MS)
    scheduler.step()
    assert control[spare].held == rg.RELEASED_BESIDE
    # The service's process exits: the trainer takes turns again (held until the policy releases it).
    region.free_slot(5, 1002)
    launch(trainer, 10, clock())
    trainer.waiting[GPU] = 1
    clock.advance(1 * MS)
    scheduler.step()
    assert control[spare].held == rg.HELD  # a group in turns again, waiting for one
    clock.advance(1 * MS)
    scheduler.step()
    assert control[spare].held == rg.RELEASED_BESIDE and control[spare].beside_n == 0


def test_groups_that_nothing_binds_share_the_gpu_until_one_runs_two_processes_there(region: rg.Region) -> None:
    """Two uncapped groups of one process each, one of them a job whose other rank runs on GPU 0: both
    released, each with the long queue, and charged half the time while both are busy; a forged hold lasts
    a look; a second process of one of them on this GPU (the driver would give that group two slices to the
    other's one) brings turns at the next look. Before the job's rank on GPU 0 launches, they take turns."""
    clock = FakeClock()
    jobs, turns = JobKeys(), GangTurns()
    scheduler = GpuScheduler(region, GPU, clock, rescan_ns=0, gang=turns, jobs=jobs)
    peer = GpuScheduler(region, 0, clock, rescan_ns=0, gang=turns, jobs=jobs)
    a, b = region.set_group("a", None, 0, 1), region.set_group("b", None, 0, 1)
    scheduler.set_quotas({a: Quota(), b: Quota()})
    peer.set_quotas({a: Quota(), b: Quota()})
    slot_a, slot_b = claim(region, 0, 1001, a), claim(region, 5, 1002, b)
    rank = testkit.claim(region, 7, 1003, a)
    use_gpu(region, rank, 0)
    jobs.record(0, 1001, "ddp")
    jobs.record(7, 1003, "ddp")
    slot_a.waiting[GPU] = slot_b.waiting[GPU] = 1

    def word(group: int) -> int:
        return region.layout.control[GPU][group].held

    scheduler.step()
    assert held(region, a) != held(region, b)  # turns: no job over GPUs here yet
    rank.launches[0] = 4
    peer.step()
    clock.advance(MS)
    scheduler.step()
    assert turns.spanning_on(GPU) == {a} and not turns.view(GPU)  # a job over both GPUs, that shares
    assert turns.turns == 0  # from its first look on: every GPU of it said it would share
    assert word(a) == word(b) == rg.RELEASED_LONG_QUEUE
    slot_a.waiting[GPU] = slot_b.waiting[GPU] = 0
    before = scheduler.gpu_seconds()
    for _ in range(2):
        launch(slot_a, 10, clock())
        launch(slot_b, 10, clock())
        clock.advance(60 * MS)
        scheduler.step()
    seconds = scheduler.gpu_seconds()
    assert seconds[a] - before[a] == pytest.approx(0.06, abs=1e-6)
    assert seconds[b] - before[b] == pytest.approx(0.06, abs=1e-6)
    assert scheduler.usage()[a].throttled_seconds == 0.0
    region.hold(GPU, a)
    scheduler.step()
    assert word(a) == rg.RELEASED_LONG_QUEUE
    second = claim(region, 9, 1003, a)
    launch(second, 1, clock())
    clock.advance(MS)
    scheduler.step()
    assert not held(region, a) and held(region, b)  # a wants the GPU (it launched); b is charged as it drains
    assert scheduler.switches == 0
    # Shared from the first look to the last (gemtrace_gpu_shared_seconds_total), and no longer.
    assert scheduler.shared_seconds() == pytest.approx(0.121, abs=1e-6)
    clock.advance(60 * MS)
    assert scheduler.shared_seconds() == pytest.approx(0.121, abs=1e-6)


def test_a_process_counts_in_its_job_on_a_gpu_from_its_first_launch_there(region: rg.Region) -> None:
    """A group is a gang where one of its jobs has processes that launched (or wait) on two GPUs: the
    jobs a scheduler reports are read again when a user starts launching, not only when a slot's process
    or assignment changes."""
    clock = FakeClock()
    jobs, turns = JobKeys(), GangTurns()
    schedulers = [GpuScheduler(region, gpu, clock, TURNS, rescan_ns=0, gang=turns, jobs=jobs) for gpu in (0, 1)]
    a = region.set_group("a", None, 0, 1)
    slots = []
    for gpu in (0, 1):
        schedulers[gpu].set_quotas({a: Quota()})
        slot = testkit.claim(region, gpu, 1000 + gpu, a)
        jobs.record(gpu, 1000 + gpu, "ddp")
        use_gpu(region, slot, gpu)
        slots.append(slot)
    slots[0].launches[0] = 4
    for scheduler in schedulers:
        scheduler.step()
    assert not turns.view(0) and not turns.view(1)  # its process on GPU 1 has not launched yet
    clock.advance(1 * MS)
    slots[1].launches[1] = 4
    for scheduler in schedulers:
        scheduler.step()
    assert a in turns.view(0).barred | turns.view(0).clearing | turns.view(0).due
    assert a in turns.view(1).barred | turns.view(1).clearing | turns.view(1).due
