"""The time-share policy against a fake GPU and a fake clock: shares, caps, guarantees, work
conservation, and what an idle group costs. No region, no processes, no sleeping."""

from __future__ import annotations

from dataclasses import astuple, dataclass, field

import pytest

from gemtrace.agent.policy import MS, Decision, Observation, Phase, PolicyParams, Quota, TimeSharePolicy

pytestmark = pytest.mark.unit

SECOND = 1000 * MS

class Workload:
    """Work arriving for a group's GPU: `on_ns` of kernels every `period_ns` (a hog: always some).
    Work that cannot run while the group is held stays pending, as a blocked launch would.
    With `gap_ns`, a training loop: steps of `on_ns` of kernels, each `gap_ns` of CPU work after the
    last one ended (the step's sync), whenever that was."""

    def __init__(self, on_ns: int | None, period_ns: int = 1, gap_ns: int | None = None) -> None:
        self.on_ns, self.period_ns, self.gap_ns = on_ns, period_ns, gap_ns
        self.pending = 0
        self.arrived_until = 0
        self.ran_out_at = 0  # when the pending work was last used up
        self.burst_at = 0  # when the work pending now arrived (into an empty queue)
        self.latencies: list[int] = []  # per burst: from its arrival to its last kernel's end
        self.open_ns = 0  # GPU time of the burst running now
        self.closed_ns = 0  # of the bursts that ran out (the gate's busy_ns)

    def wants(self, t: int) -> bool:
        if self.on_ns is None:
            return True
        if self.gap_ns is not None:
            if self.pending == 0 and self.arrived_until <= t:
                self.burst_at, self.pending, self.arrived_until = self.arrived_until, self.on_ns, 10**18
            return self.pending > 0
        while self.arrived_until <= t:
            if self.pending == 0 and self.on_ns:
                self.burst_at = self.arrived_until
            self.pending += self.on_ns
            self.arrived_until += self.period_ns
        return self.pending > 0

    def run(self, t: int, dt: int) -> int:
        if self.on_ns is None:
            return dt
        used = min(dt, self.pending)
        self.pending -= used
        self.open_ns += used
        if self.pending == 0 and used:
            self.closed_ns, self.open_ns = self.closed_ns + self.open_ns, 0
            self.ran_out_at = t + used
            self.latencies.append(self.ran_out_at - self.burst_at)
            if self.gap_ns is not None:
                self.arrived_until = self.ran_out_at + self.gap_ns
        return used


def hog() -> Workload:
    return Workload(None)


def idle() -> Workload:
    return Workload(0, 10**18)


def bursty(on_ns: int, period_ns: int) -> Workload:
    return Workload(on_ns, period_ns)


def steps(step_ns: int, gap_ns: int) -> Workload:
    return Workload(step_ns, gap_ns=gap_ns)


@dataclass
class FakeGpu:
    """One GPU shared by groups with the given workloads. A released group that has work keeps the
    GPU busy; a held group takes `drain_ns` to finish what it had queued (`outranked_drain_ns` where
    it was released outranked: the gate's tighter queue bound). Groups released together
    (Decision.shared) split the GPU evenly among those with work, as the driver's time slicing does.
    The `crowded` groups run several processes each (Observation.crowded); the `spanning` ones are jobs
    over this GPU and another (Observation.spanning). It keeps the true GPU time of every group, which the
    policy never sees."""

    workloads: dict[int, Workload]
    drain_ns: int = 1 * MS
    outranked_drain_ns: int | None = None
    outranked: bool = False  # the released group's word says GT_RELEASED_OUTRANKED
    quiet_rings: bool = False  # the released group's gates ring when it runs out of work (ring_quiet)
    rings_lost: bool = False  # no gate rings when it runs out (one that predates it, or a process gone)
    released: int | None = None
    draining: int | None = None
    hold_at: int = 0
    drain_end: int = 0
    busy_ns: dict[int, int] = field(default_factory=dict)
    switches: int = 0
    steps: int = 0
    looked_at: int = 0
    busy_seen: dict[int, int] = field(default_factory=dict)  # each group's closed_ns at the last look
    crowded: frozenset[int] = frozenset()
    spanning: frozenset[int] = frozenset()
    shared: frozenset[int] = frozenset()
    queued_ns: dict[int, int] = field(default_factory=dict)  # shared groups' time with work, since the last look

    def observe(self, t: int) -> Observation:
        demand = frozenset(g for g, work in self.workloads.items() if work.wants(t))
        idle_since = burst_from = None
        burst_ns = 0
        if self.released is not None:
            work = self.workloads[self.released]
            # The gate's slot: the bursts' lengths, added as each one closes (busy_ns), and the
            # opening of the open one, or of the last one.
            burst_ns = work.closed_ns - self.busy_seen.get(self.released, 0)
            if self.released not in demand:
                idle_since = work.ran_out_at
                if work.ran_out_at > self.looked_at:
                    burst_from = work.burst_at  # quiet now, busy since the last look
            elif work.on_ns:
                burst_from = work.burst_at
        self.looked_at = t
        self.busy_seen = {g: work.closed_ns for g, work in self.workloads.items()}
        drained_at = None
        if self.draining is not None and t >= self.drain_end:
            drained_at = self.drain_end
        shared_busy, self.queued_ns = {g: self.queued_ns.get(g, 0) for g in self.shared}, {}
        # Every group's process is alive all along: present, wanting the GPU or not.
        return Observation(demand, idle_since, drained_at, present=frozenset(self.workloads),
                           holder_burst_from=burst_from, holder_burst_ns=burst_ns, crowded=self.crowded,
                           shared_busy=shared_busy, spanning=self.spanning)

    def rung(self, t0: int, t: int, wake_on_wait: bool) -> bool:
        """Did the released group run out of work in (t0, t] where the decision asked it to ring then
        (its sync empties its queue: Decision.quiet_rings)? With `wake_on_wait`, or did a thread start
        waiting on a held word (the gate rings the doorbell then): work arrived for a held group that
        had none, or the draining group finished its queue (a hog's next launch then waits)?"""
        if (self.quiet_rings and not self.rings_lost and self.released is not None
                and t0 < self.workloads[self.released].ran_out_at <= t):
            return True
        if not wake_on_wait:
            return False
        if self.draining is not None and t0 < self.drain_end <= t:
            return True
        return any(g not in (self.released, self.draining) and work.on_ns and work.pending == 0
                   and t0 < work.arrived_until <= t for g, work in self.workloads.items())

    def run(self, t0: int, t1: int, wake_on_wait: bool = False) -> int:
        """GPU time between two looks, 0.1 ms at a time, until a ring the look waits for (`rung`) if that
        comes first. Returns when the next look is."""
        step = MS // 10
        for t in range(t0, t1, step):
            if t > t0 and self.rung(t0, t, wake_on_wait):
                return t
            dt = min(step, t1 - t)
            sharing = [g for g in self.shared if self.workloads[g].wants(t)]
            for group in sharing:
                used = self.workloads[group].run(t, dt // len(sharing))
                self.busy_ns[group] = self.busy_ns.get(group, 0) + used
                self.queued_ns[group] = self.queued_ns.get(group, 0) + dt
            if self.released is not None and self.workloads[self.released].wants(t):
                used = self.workloads[self.released].run(t, dt)
                self.busy_ns[self.released] = self.busy_ns.get(self.released, 0) + used
            if self.draining is not None and t < self.drain_end:
                work = self.workloads[self.draining]
                if work.gap_ns is None:
                    self.busy_ns[self.draining] = self.busy_ns.get(self.draining, 0) + dt
                else:
                    # A step's queued kernels: where the step ends within the drain, its sync ends the
                    # drain, and the loop's CPU work follows (it wants the GPU again only after).
                    used = work.run(t, dt)
                    self.busy_ns[self.draining] = self.busy_ns.get(self.draining, 0) + used
                    if work.pending == 0:
                        self.drain_end = t + used
        return t1

    def apply(self, t: int, decision: Decision) -> None:
        if decision.draining is not None and self.draining is None:
            self.draining, self.hold_at = decision.draining, t
            # A group held while it had work finishes what it had queued; an idle one has nothing.
            had_work = self.workloads[self.draining].wants(t)
            drain = self.drain_ns if self.outranked_drain_ns is None or not self.outranked else self.outranked_drain_ns
            self.drain_end = t + drain if had_work else t
            self.switches += 1
        if decision.draining is None:
            self.draining = None
        self.released = decision.released
        self.shared = decision.shared
        self.outranked = decision.outranked
        self.quiet_rings = decision.quiet_rings

    def share(self, group: int, duration: int) -> float:
        return self.busy_ns.get(group, 0) / duration


def simulate(quotas: dict[int, Quota], workloads: dict[int, Workload], duration: int = 10 * SECOND,
             drain_ns: int = 1 * MS, params: PolicyParams | None = None,
             policy: TimeSharePolicy | None = None, start: int = 0,
             outranked_drain_ns: int | None = None, crowded: frozenset[int] = frozenset(),
             spanning: frozenset[int] = frozenset()) -> tuple[FakeGpu, TimeSharePolicy]:
    """As the scheduler runs it: a look comes at the decision's wake_at, or when a thread starts
    waiting on a held word where the decision asks for it (Decision.wake_on_wait: the scheduler
    sleeps on the GPU's doorbell, which the gates ring then)."""
    if policy is None:
        policy = TimeSharePolicy(params or PolicyParams(), now=start)
        policy.set_quotas(start, quotas)
    gpu = FakeGpu(workloads, drain_ns, outranked_drain_ns, crowded=crowded, spanning=spanning)
    t = start
    while t < start + duration:
        decision = policy.step(t, gpu.observe(t))
        gpu.apply(t, decision)
        gpu.steps += 1
        nxt = min(max(decision.wake_at, t + 1), start + duration)
        t = gpu.run(t, nxt, decision.wake_on_wait)
    return gpu, policy


def test_caps_split_two_saturating_groups() -> None:
    gpu, policy = simulate({0: Quota(0, 0.3), 1: Quota(0, 0.7)}, {0: hog(), 1: hog()})
    assert gpu.share(0, 10 * SECOND) == pytest.approx(0.3, abs=0.01)
    assert gpu.share(1, 10 * SECOND) == pytest.approx(0.7, abs=0.015)
    usage = policy.usage(10 * SECOND)
    # What the policy charged is the true GPU time (drains included), within a slice.
    for group in (0, 1):
        assert usage[group].gpu_seconds == pytest.approx(gpu.busy_ns[group] / 1e9, abs=0.03)
    assert usage[0].util_ratio == pytest.approx(0.3, abs=0.03)
    # Long slices, not a switch per look: a few tens of switches a second at most.
    assert gpu.switches < 10 * 40


def test_gpu_seconds_are_usages_own_and_leave_the_policy_as_usage_does() -> None:
    """The accounting reads each group's GPU seconds alone at every poll (gpu_seconds): usage()'s
    figures, and the policy goes on after the read as it would after usage()."""
    quotas = {0: Quota(0, 0.3), 1: Quota(0.2, 1.0), 2: Quota(0, 1.0)}

    def workloads() -> dict[int, Workload]:
        return {0: hog(), 1: steps(5 * MS, 3 * MS), 2: bursty(2 * MS, 10 * MS)}

    read_usage, read_seconds = workloads(), workloads()
    a: TimeSharePolicy | None = None
    b: TimeSharePolicy | None = None
    for k in range(5):
        _, a = simulate(quotas, read_usage, duration=SECOND, policy=a, start=k * SECOND)
        _, b = simulate(quotas, read_seconds, duration=SECOND, policy=b, start=k * SECOND)
        at = (k + 1) * SECOND + 3 * MS  # (between looks)
        assert b.gpu_seconds(at) == {group: u.gpu_seconds for group, u in a.usage(at).items()}
    assert a is not None and b is not None and a.usage(6 * SECOND) == b.usage(6 * SECOND)
    assert all(u.gpu_seconds > 0 for u in a.usage(6 * SECOND).values())


@pytest.mark.parametrize("caps", [(0.1, 0.2, 0.3, 0.4), (0.2, 0.3, 0.4)])
def test_caps_within_the_gpu_each_get_their_whole_max_util(caps: tuple[float, ...]) -> None:
    # Least usage first left the largest cap behind: its bucket full while the others ran, and the GPU
    # idle while nobody had a whole slice's credit (the 0.4 group got 0.35 and 0.38 here).
    quotas = {g: Quota(0, cap) for g, cap in enumerate(caps)}
    gpu, _ = simulate(quotas, {g: hog() for g in quotas})
    for g, cap in enumerate(caps):
        assert gpu.share(g, 10 * SECOND) == pytest.approx(cap, abs=0.012), (g, cap)
    assert gpu.switches < 10 * 20


def test_caps_beyond_the_gpu_still_share_max_min() -> None:
    # Caps that add up to more than the GPU are ceilings, not weights: 0.5 and 0.6 get half each, as
    # two uncapped groups would; and a capped 0.7 beside an uncapped hog gets half, not its cap.
    gpu, _ = simulate({0: Quota(0, 0.5), 1: Quota(0, 0.6)}, {0: hog(), 1: hog()})
    assert gpu.share(0, 10 * SECOND) == pytest.approx(0.5, abs=0.01)
    assert gpu.share(1, 10 * SECOND) == pytest.approx(0.5, abs=0.01)
    gpu, _ = simulate({0: Quota(0, 0.7), 1: Quota(0, 1)}, {0: hog(), 1: hog()})
    assert gpu.share(0, 10 * SECOND) == pytest.approx(0.5, abs=0.02)


def test_min_util_holds_against_two_uncapped_hogs() -> None:
    gpu, _ = simulate({0: Quota(0.6, 1.0), 1: Quota(0, 1), 2: Quota(0, 1)}, {0: hog(), 1: hog(), 2: hog()})
    assert gpu.share(0, 10 * SECOND) >= 0.6 - 0.005
    # The unreserved 40% is shared by the least used first: the hogs, equally.
    assert gpu.share(1, 10 * SECOND) == pytest.approx(gpu.share(2, 10 * SECOND), abs=0.02)
    assert sum(gpu.busy_ns.values()) / (10 * SECOND) > 0.97
    # Its debt paid in long slices, not one after each hog's slice: 3 switches a 330 ms round, not 4
    # (each costs a real model's work some ms beyond its charge).
    assert gpu.switches <= 10 * 10


def test_max_util_holds_for_a_group_alone() -> None:
    gpu, policy = simulate({0: Quota(0, 0.5)}, {0: hog()})
    assert gpu.share(0, 10 * SECOND) == pytest.approx(0.5, abs=0.01)
    # Alone it waits for a full bucket (60 ms of credit), then runs 120 ms: about 4 holds a second,
    # not 8 (each costs a real model some ms of work).
    assert gpu.switches <= 10 * 4.5
    assert policy.usage(10 * SECOND)[0].throttled_seconds == pytest.approx(5.0, abs=0.3)


@pytest.mark.parametrize("gap_ns", [300_000, 1 * MS, 5 * MS, 20 * MS])
def test_min_util_holds_for_a_training_loop_that_pauses_between_steps(gap_ns: int) -> None:
    """A training loop's step ends in a sync and CPU work before the next step's first launch.
    - Held at its slice's end, it drains, often to its step's sync, and blocks on its word only after
      the CPU work: the look that saw the drain end saw it want nothing. Its wait rings, and its debt
      runs from the look the ring brings, not from a look a hog's slice later (on the H100, ResNet-50
      at MinUtil 0.6 beside two hogs was charged 0.57: the debt missed the hogs' slices).
    - Paid its debt, it keeps the GPU over a short pause; revoked at a long one, it goes before the
      next holder's slice ends once it is owed a slice (else one step of debt was paid a slice).
    MinUtil counts the time it wants the GPU, not its CPU work: of its solo throughput it gets 0.6."""
    step_ns = 33 * MS
    gpu, _ = simulate({0: Quota(0.6, 1.0), 1: Quota(0, 1), 2: Quota(0, 1)},
                      {0: steps(step_ns, gap_ns), 1: hog(), 2: hog()}, drain_ns=5 * MS)
    of_solo = gpu.share(0, 10 * SECOND) * (step_ns + gap_ns) / step_ns
    assert of_solo >= 0.6 - 0.01
    assert gpu.share(1, 10 * SECOND) == pytest.approx(gpu.share(2, 10 * SECOND), abs=0.02)
    if gap_ns <= PolicyParams().owed_pause_ns:
        assert gpu.switches < 10 * 15  # no switch at each pause: a few tens a second, as with hogs only


def test_a_guaranteed_service_owed_a_slice_goes_before_the_holder_s_slice_ends() -> None:
    """A service with MinUtil 0.5 answers 2 ms requests every 20 ms beside a hog. Waiting out the
    hog's slices, each request took 50 ms and the debt grew to its bound, never paid (a request
    cannot use it). Owed a slice, a request now goes first: half the GPU while it has work."""
    gpu, _ = simulate({0: Quota(0.5, 1.0), 1: Quota(0, 1.0)}, {0: bursty(2 * MS, 20 * MS), 1: hog()},
                      )
    latencies = sorted(gpu.workloads[0].latencies)
    assert gpu.share(0, 10 * SECOND) == pytest.approx(0.1, abs=0.005)
    assert latencies[len(latencies) // 2] <= 5 * MS
    assert sum(gpu.busy_ns.values()) / (10 * SECOND) > 0.85


def test_a_new_holder_is_not_looked_at_for_the_last_holder_s_pause() -> None:
    """The owed holder's pause (owed_pause_ns) is its own: a group released after a holder that went
    quiet is looked at when it goes quiet itself (its gates ring) or at its slice's end, not at the end
    of the other's pause."""
    policy = TimeSharePolicy(PolicyParams(), now=0)
    policy.set_quotas(0, {0: Quota(0.6, 1.0), 1: Quota()})
    assert policy.step(0, Observation(demand=frozenset({1}))).released == 1
    policy.step(50 * MS, Observation(demand=frozenset({0, 1})))  # 0 waits: owed from here
    quiet = Observation(demand=frozenset({0}), holder_idle_since=99_500_000)
    assert policy.step(100 * MS, quiet).draining == 1  # 1 went quiet: revoked early
    now = 100_200_000
    decision = policy.step(now, Observation(demand=frozenset({0, 1}), drained_at=100_100_000))
    assert decision.released == 0 and decision.quiet_rings
    assert decision.wake_at >= now + PolicyParams().slice_ns  # (its slice pays its debt: longer)


def test_min_util_alone_runs_at_full_speed_without_switches() -> None:
    gpu, _ = simulate({0: Quota(0.2, 1.0)}, {0: hog()})
    assert gpu.share(0, 10 * SECOND) > 0.999
    assert gpu.switches == 0


@pytest.mark.parametrize(("spanning", "crowded"), [(frozenset({0}), frozenset()), (frozenset(), frozenset()),
                                                   (frozenset({0}), frozenset({0, 1}))])
def test_two_equal_hogs_share_equally(spanning: frozenset[int], crowded: frozenset[int]) -> None:
    """Released together (a job over this GPU and another among them, one process each: the driver's
    slicing), or in turns (groups of this GPU alone; several processes each)."""
    gpu, policy = simulate({0: Quota(), 1: Quota()}, {0: hog(), 1: hog()}, crowded=crowded, spanning=spanning)
    assert gpu.share(0, 10 * SECOND) == pytest.approx(0.5, abs=0.01)
    assert gpu.share(1, 10 * SECOND) == pytest.approx(0.5, abs=0.01)
    # What each is charged is what it got.
    for group, usage in policy.usage(10 * SECOND).items():
        assert usage.gpu_seconds == pytest.approx(gpu.busy_ns[group] / 1e9, abs=0.1)
    assert (gpu.switches == 0) == bool(spanning and not crowded)


def test_groups_that_nothing_binds_share_the_gpu_and_take_turns_as_soon_as_something_does() -> None:
    """Two uncapped groups of one process each, one of them a job over this GPU and another, are released
    together (Decision.shared: the driver slices among them); a MinUtil set, a second process of one, or a
    priority apart ends that at the next look, and one of them is released in turns; the others are held
    and charged their queue until it drains. Groups of this GPU alone take turns."""
    policy = TimeSharePolicy(now=0)
    policy.set_quotas(0, {0: Quota(), 1: Quota(), 2: Quota()})
    both, job = frozenset({0, 1}), frozenset({0})
    decision = policy.step(0, Observation(both, present=both, spanning=job))
    assert decision.shared == both and decision.released is None and decision.sharable
    assert decision.wake_on_wait  # a newcomer's first launch waits on its held word and rings
    assert policy.phase is Phase.SHARED
    # Charged by the time each had work, scaled to the time that passed: both busy, half each.
    decision = policy.step(60 * MS, Observation(both, present=both, shared_busy={0: 60 * MS, 1: 60 * MS}, spanning=job))
    seconds = policy.gpu_seconds(60 * MS)
    assert seconds[0] == pytest.approx(0.03) and seconds[1] == pytest.approx(0.03)
    assert policy.usage(60 * MS)[0].throttled_seconds == 0.0
    # One of them quiet: the other is charged what it ran.
    decision = policy.step(120 * MS, Observation(both, present=both, shared_busy={0: 60 * MS, 1: 0}, spanning=job))
    assert policy.gpu_seconds(120 * MS)[0] == pytest.approx(0.09)
    # A third group's process: all three share.
    three = frozenset({0, 1, 2})
    decision = policy.step(130 * MS, Observation(three, present=three, shared_busy={0: 10 * MS, 1: 10 * MS},
                                                 spanning=job))
    assert decision.shared == three
    # Group 1 starts a second process here: turns. One is released, the others held and charged as they drain.
    decision = policy.step(140 * MS, Observation(three, present=three, crowded=frozenset({1}),
                                                 shared_busy=dict.fromkeys(three, 10 * MS), spanning=job))
    assert not decision.shared and not decision.sharable and policy.phase is Phase.RUNNING
    assert decision.released in three
    assert set(policy.overrunning()) == three - {decision.released}
    # The GPU was shared from 0 to 140 ms (gemtrace_gpu_shared_seconds_total), and not since.
    assert policy.shared_seconds(140 * MS) == pytest.approx(0.14)
    assert policy.shared_seconds(200 * MS) == pytest.approx(0.14)
    # Opportunistic groups among themselves (no production present) keep turns and their beside word.
    for mixed in ({0: Quota(0.1, 1.0), 1: Quota()}, {0: Quota(0, 0.5), 1: Quota()}, {0: Quota(priority=1), 1: Quota()},
                  {0: Quota(opportunistic=True), 1: Quota(opportunistic=True)}):
        policy = TimeSharePolicy(now=0)
        policy.set_quotas(0, mixed)
        decision = policy.step(0, Observation(both, present=both, spanning=job))
        assert not decision.shared and not decision.sharable and decision.released is not None, mixed
    # Production groups share beside an opportunistic one, which runs beside them.
    policy = TimeSharePolicy(now=0)
    policy.set_quotas(0, {0: Quota(), 1: Quota(), 2: Quota(opportunistic=True)})
    three = frozenset({0, 1, 2})
    decision = policy.step(0, Observation(three, present=three, spanning=job))
    assert decision.shared == both and decision.beside == {2}
    # Off (PolicyParams.share_unbound), or no job over GPUs here: turns. (With none here, the GPU still says
    # it would share were one here: so the first look of a job that spans it opens no turn across GPUs.)
    for params, spanning in ((PolicyParams(share_unbound=False), job), (PolicyParams(), frozenset())):
        policy = TimeSharePolicy(params, now=0)
        policy.set_quotas(0, {0: Quota(), 1: Quota()})
        decision = policy.step(0, Observation(both, present=both, spanning=spanning))
        assert decision.released is not None and not decision.shared
        assert decision.sharable == params.share_unbound


def test_a_group_alone_is_released_as_the_holder_though_sharable() -> None:
    policy = TimeSharePolicy(now=0)
    policy.set_quotas(0, {0: Quota(), 1: Quota()})
    decision = policy.step(0, Observation(frozenset({0}), present=frozenset({0}), spanning=frozenset({0})))
    assert decision.released == 0 and not decision.shared and decision.sharable and not decision.short_queue


@pytest.mark.parametrize("gap_ns", [2 * MS, 5 * MS, 12 * MS])
def test_a_loop_that_pauses_between_steps_gets_its_fair_share_beside_a_hog(gap_ns: int) -> None:
    """A training loop of 25 ms steps with CPU work between them, beside a hog, no quotas. Revoked at
    each pause (the hog wants the GPU), it waited out the hog's whole slice each time: 0.29 of the GPU
    whatever its pause. A slice behind the hog in usage, it now cuts the hog's slice to the shortest one
    (TimeSharePolicy._overtaken): within a slice's usage of the hog, and the GPU still busy but for the switches.
    In turns: each group runs several processes (released together, the loop gets what the driver gives it,
    below)."""
    gpu, _ = simulate({0: Quota(), 1: Quota()}, {0: steps(25 * MS, gap_ns), 1: hog()}, crowded=frozenset({0, 1}))
    loop, other = gpu.share(0, 10 * SECOND), gpu.share(1, 10 * SECOND)
    window = PolicyParams().window_ns
    assert other - loop <= PolicyParams().slice_ns / window + 0.01
    assert loop > 0.45
    assert loop + other > 0.97
    assert gpu.switches < 10 * 50
    # Released together (were one of them a job over GPUs), the loop gets half the GPU while it has work and
    # the hog all of it in the loop's pauses (the driver's slicing: work-conserving, not fair in usage), with
    # no switch at all.
    shared, _ = simulate({0: Quota(), 1: Quota()}, {0: steps(25 * MS, gap_ns), 1: hog()}, spanning=frozenset({1}))
    loop = shared.share(0, 10 * SECOND)
    assert loop == pytest.approx(25 / (50 + gap_ns / MS), abs=0.01)
    assert loop + shared.share(1, 10 * SECOND) > 0.999 and shared.switches == 0


def test_time_a_group_does_not_use_goes_to_the_others() -> None:
    # Both reserve half; one has nothing to do: the other gets the whole GPU.
    gpu, policy = simulate({0: Quota(0.5, 1.0), 1: Quota(0.5, 1.0)}, {0: hog(), 1: idle()})
    assert gpu.share(0, 10 * SECOND) > 0.99
    assert gpu.switches == 0
    assert policy.usage(10 * SECOND)[1].gpu_seconds == 0


def test_unused_slices_are_revoked_early() -> None:
    # Group 0 has work 2 ms in every 20 ms; group 1 is a hog. Group 0's idle time goes to group 1
    # within a poll or two, not at the end of its slice.
    gpu, _ = simulate({0: Quota(0.5, 1.0), 1: Quota(0, 1.0)}, {0: bursty(2 * MS, 20 * MS), 1: hog()})
    assert gpu.share(0, 10 * SECOND) == pytest.approx(0.1, abs=0.005)  # all its bursts ran
    # The GPU idles only while the policy has not yet seen group 0 go quiet (a poll, 4 ms).
    assert sum(gpu.busy_ns.values()) / (10 * SECOND) > 0.85


def test_a_group_without_demand_gets_nothing_and_costs_nothing() -> None:
    alone, policy_alone = simulate({0: Quota(0, 0.5)}, {0: hog()})
    with_idle, policy = simulate({0: Quota(0, 0.5), 1: Quota(0.5, 1.0)}, {0: hog(), 1: idle()})
    assert with_idle.busy_ns.get(1, 0) == 0
    usage = policy.usage(10 * SECOND)[1]
    assert usage.gpu_seconds == 0 and usage.throttled_seconds == 0 and usage.util_ratio == 0
    # Same decisions, same number of looks and switches as without the idle group.
    assert with_idle.steps == alone.steps
    assert with_idle.switches == alone.switches
    assert with_idle.busy_ns[0] == alone.busy_ns[0]


def test_a_service_alone_is_charged_about_what_it_runs() -> None:
    # A batch-1 service: 3 ms of kernels, then 20 ms to its next request. The looks that see it busy
    # come at random points of its requests; the charge from such a look must end with the request,
    # not at the slice's end (60 ms: it was charged 0.5 of the GPU on the H100 for the 0.08 it used).
    gpu, policy = simulate({0: Quota()}, {0: bursty(3 * MS, 23 * MS)})
    true = gpu.busy_ns[0] / 1e9
    assert policy.usage(10 * SECOND)[0].gpu_seconds == pytest.approx(true, rel=0.1)
    assert gpu.steps < 10 * 150  # a look now and then, not a poll throughout


def test_few_wakeups_for_a_group_alone() -> None:
    gpu, _ = simulate({0: Quota()}, {0: hog()}, duration=1 * SECOND)
    # One look per slice, no polling while nobody else wants the GPU.
    assert gpu.steps <= 1 * SECOND // PolicyParams().slice_ns + 2


def test_overrun_of_a_long_drain_is_charged_to_the_group() -> None:
    # 8 ms drains after 20+ ms slices: the capped group still gets its 30%, not more.
    gpu, policy = simulate({0: Quota(0, 0.3), 1: Quota(0, 1.0)}, {0: hog(), 1: hog()}, drain_ns=8 * MS)
    assert gpu.share(0, 10 * SECOND) == pytest.approx(0.3, abs=0.01)
    assert gpu.share(1, 10 * SECOND) == pytest.approx(0.7, abs=0.015)
    # The slice grew with the measured drain, so the drain stays a small part of it.
    assert policy.slice_ns() >= 4 * 8 * MS * 0.9


def test_quota_change_takes_effect() -> None:
    gpu, policy = simulate({0: Quota(0, 0.2), 1: Quota(0, 1.0)}, {0: hog(), 1: hog()}, duration=5 * SECOND)
    assert gpu.share(0, 5 * SECOND) == pytest.approx(0.2, abs=0.01)
    policy.set_quotas(5 * SECOND, {0: Quota(0, 0.6), 1: Quota(0, 1.0)})
    simulate({}, {0: hog(), 1: hog()}, duration=5 * SECOND, policy=policy, start=5 * SECOND)
    # Max-min fair now that 0.6 does not bind: half each over the recent window.
    assert policy.usage(10 * SECOND)[0].util_ratio == pytest.approx(0.5, abs=0.03)
    policy.set_quotas(10 * SECOND, {1: Quota(0, 1.0)})  # group 0 dropped: no longer scheduled
    decision = policy.step(10 * SECOND + 1, Observation(frozenset({0, 1})))
    assert decision.released in (1, None)


def test_zero_max_util_never_runs() -> None:
    gpu, policy = simulate({0: Quota(0, 0.0), 1: Quota()}, {0: hog(), 1: hog()}, duration=1 * SECOND)
    assert gpu.busy_ns.get(0, 0) == 0
    assert policy.phase in (Phase.RUNNING, Phase.DRAINING)


def test_quota_rejects_min_above_max() -> None:
    with pytest.raises(ValueError):
        Quota(0.6, 0.5)


def test_an_idle_gpu_is_looked_at_rarely() -> None:
    gpu, _ = simulate({0: Quota(), 1: Quota(0, 0.5)}, {0: idle(), 1: idle()}, duration=2 * SECOND)
    # Nobody wants it: a group's first launch would ring, so it is looked at only at the net.
    assert gpu.steps <= 2 * SECOND // PolicyParams().ring_net_ns + 1, gpu.steps
    assert not gpu.busy_ns


def test_first_launch_after_a_quiet_spell_is_released_at_its_ring() -> None:
    late = Workload(5 * MS, 10**18)
    late.arrived_until = 3 * SECOND + 7 * MS  # its first work arrives after 3 s of nothing, off the net
    gpu, policy = simulate({0: Quota()}, {0: late}, duration=4 * SECOND)
    assert gpu.busy_ns[0] == 5 * MS
    # Its 5 ms and the look its ring brings, within one 0.1 ms step of the fake GPU (not the 250 ms net).
    assert late.latencies == [pytest.approx(5 * MS, abs=MS // 10)]
    assert policy.usage(4 * SECOND)[0].throttled_seconds <= 0.001


def test_a_drain_is_waited_out_when_nobody_else_wants_the_gpu() -> None:
    # A process that queues 200 ms of kernels between syncs, capped at 0.5, alone: the drain outlasts
    # the 50 ms timeout, but with nobody to hand the GPU to it is waited out and charged in full.
    policy = TimeSharePolicy(now=0)
    policy.set_quotas(0, {0: Quota(0, 0.5)})
    t = 0
    decision = policy.step(t, Observation(frozenset({0})))
    assert decision.released == 0
    while decision.draining is None:
        t = decision.wake_at
        decision = policy.step(t, Observation(frozenset({0})))
    hold_at = t
    while t < hold_at + 200 * MS:
        t = max(t + 1, decision.wake_at)
        decision = policy.step(t, Observation(frozenset()))
        if t < hold_at + 200 * MS:
            assert decision.draining == 0, "cut short by the timeout with nobody waiting"
    decision = policy.step(t, Observation(frozenset(), drained_at=hold_at + 200 * MS))
    assert decision.draining is None
    assert policy.usage(t)[0].gpu_seconds * 1e9 == pytest.approx(hold_at + 200 * MS, abs=1)


def test_a_busy_drain_that_another_group_waits_for_is_looked_at_with_its_ring_or_at_its_timeout() -> None:
    # Group 0, busy at its slice's end, drains while group 1 waits: its last process's finish rings
    # (hook/launch.c), so the policy sets no poll before the drain's timeout, which it acts on anyway.
    policy = TimeSharePolicy(now=0)
    policy.set_quotas(0, {0: Quota(), 1: Quota()})
    t = 0
    decision = policy.step(t, Observation(frozenset({0})))
    assert decision.released == 0
    t = 5 * MS
    decision = policy.step(t, Observation(frozenset({0, 1}), holder_burst_from=t - MS))
    while decision.draining is None:
        t = decision.wake_at
        decision = policy.step(t, Observation(frozenset({0, 1}), holder_burst_from=t - MS))
    hold_at = t
    assert decision.wake_at == hold_at + policy.drain_timeout_ns()
    t += 7 * MS  # a ring that was no drain's end (another group's thread began waiting)
    decision = policy.step(t, Observation(frozenset({0, 1})))
    assert decision.draining == 0 and decision.wake_at == hold_at + policy.drain_timeout_ns()
    decision = policy.step(t + MS, Observation(frozenset({0, 1}), drained_at=t + MS))
    assert decision.draining is None and decision.released == 1


def test_work_queued_past_the_drain_timeout_is_charged_until_it_finishes() -> None:
    # Group 0 drains for 300 ms while group 1 waits: after the timeout group 1 runs, and group 0 is
    # charged on (its queued work still runs beside it) until the gate reports it finished.
    policy = TimeSharePolicy(now=0)
    policy.set_quotas(0, {0: Quota(), 1: Quota()})
    policy.step(0, Observation(frozenset({0})))
    decision = policy.step(1 * MS, Observation(frozenset({0, 1})))
    t = 1 * MS
    while decision.draining is None:
        t = decision.wake_at
        decision = policy.step(t, Observation(frozenset({0, 1})))
    hold_at = t
    while decision.released != 1:
        t = decision.wake_at
        decision = policy.step(t, Observation(frozenset({0, 1})))
    assert t == pytest.approx(hold_at + policy.params.drain_timeout_ns, abs=MS)
    assert policy.overrunning() == {0: hold_at}
    policy.step(hold_at + 400 * MS, Observation(frozenset({1}), overrun_drained={0: hold_at + 300 * MS}))
    assert policy.overrunning() == {}
    assert policy.usage(hold_at + 400 * MS)[0].gpu_seconds * 1e9 == pytest.approx(hold_at + 300 * MS, abs=1)
    # The next drain of this GPU is given about as long as the ones measured.
    assert policy.drain_timeout_ns() > policy.params.drain_timeout_ns


def test_a_drain_that_never_reports_is_charged_at_most_max_overrun() -> None:
    # The held process queued work and went off to CPU work: no sync, no launch, no end reported.
    policy = TimeSharePolicy(now=0)
    policy.set_quotas(0, {0: Quota(0, 0.5)})
    decision = policy.step(0, Observation(frozenset({0})))
    t = 0
    while decision.draining is None:
        t = decision.wake_at
        decision = policy.step(t, Observation(frozenset({0})))
    hold_at = t
    while decision.draining is not None:
        assert t <= hold_at + policy.params.max_overrun_ns
        t = max(t + 1, decision.wake_at)
        decision = policy.step(t, Observation(frozenset()))
    assert policy.usage(t)[0].gpu_seconds * 1e9 <= hold_at + policy.params.max_overrun_ns + 1


def test_a_released_group_keeps_its_queue_short_only_where_a_hold_is_coming() -> None:
    """short_queue asks the gate to drain a backlog older than QUEUE_BOUND_NS: worth it only where
    the group will be held (a MaxUtil, or another group wanting the GPU), a cost for nothing otherwise."""
    policy = TimeSharePolicy(now=0)
    policy.set_quotas(0, {0: Quota(0, 1.0), 1: Quota(0, 1.0), 2: Quota(0, 0.5)})
    alone = policy.step(0, Observation(frozenset({0})))
    assert alone.released == 0 and not alone.short_queue
    contended = policy.step(1 * MS, Observation(frozenset({0, 1})))
    assert contended.released == 0 and contended.short_queue

    capped = TimeSharePolicy(now=0)
    capped.set_quotas(0, {2: Quota(0, 0.5)})
    decision = capped.step(0, Observation(frozenset({2})))
    assert decision.released == 2 and decision.short_queue


# -- priority ----------------------------------------------------------------------------------------


def test_a_higher_priority_group_revokes_a_lower_holder_at_the_next_look() -> None:
    policy = TimeSharePolicy(now=0)
    policy.set_quotas(0, {0: Quota(priority=0), 1: Quota(priority=5)})
    both = frozenset({0, 1})
    decision = policy.step(0, Observation(frozenset({0}), present=both))
    assert decision.released == 0
    # A higher-priority group present: the holder's queue is short, and the look comes at that group's
    # request (its thread waits on its held word and rings).
    assert decision.wake_on_wait and decision.short_queue
    # Group 1 launches 1 ms into group 0's slice: group 0 is held at this look, not at the slice's end.
    decision = policy.step(1 * MS, Observation(both, present=both))
    assert decision.draining == 0 and decision.released is None
    decision = policy.step(2 * MS, Observation(both, drained_at=2 * MS, present=both))
    assert decision.released == 1
    # The lower-priority group waits while the higher one has work: no switch back at its slice's end.
    for t in range(3 * MS, 100 * MS, MS):
        decision = policy.step(t, Observation(both, present=both))
        assert decision.released == 1


def test_a_holder_outranked_by_an_idle_group_is_looked_at_its_ring_not_every_poll() -> None:
    """A request of the higher priority rings (its thread blocks on its held word) and the scheduler
    looks then (wake_on_wait): while the service idles, its hog is looked at once a slice, not every
    poll."""
    params = PolicyParams()
    policy = TimeSharePolicy(params, now=0)
    policy.set_quotas(0, {0: Quota(priority=0), 1: Quota(priority=5)})
    decision = policy.step(0, Observation(frozenset({0}), present=frozenset({0, 1})))
    assert decision.released == 0 and decision.outranked and decision.wake_on_wait
    assert decision.wake_at == min(params.slice_ns, params.steady_poll_ns)


def test_equal_priorities_keep_the_slices() -> None:
    policy = TimeSharePolicy(now=0)
    policy.set_quotas(0, {0: Quota(priority=3), 1: Quota(priority=3)})
    both = frozenset({0, 1})
    # (Several processes each: turns.) Group 1 outranks nobody: the holder alone is looked at only at the
    # net (group 1's wait rings).
    assert policy.step(0, Observation(frozenset({0}), present=both, crowded=both)).wake_at == policy.params.ring_net_ns
    assert policy.step(1 * MS, Observation(both, present=both, crowded=both)).released == 0  # kept to its slice's end


def test_equal_priorities_decide_as_no_priority_at_all() -> None:
    plain, plain_policy = simulate({0: Quota(0.2, 1.0), 1: Quota(0, 0.7)}, {0: bursty(3 * MS, 17 * MS), 1: hog()},
                                   duration=2 * SECOND)
    same, same_policy = simulate({0: Quota(0.2, 1.0, priority=7), 1: Quota(0, 0.7, priority=7)},
                                 {0: bursty(3 * MS, 17 * MS), 1: hog()}, duration=2 * SECOND)
    assert (same.busy_ns, same.steps, same.switches) == (plain.busy_ns, plain.steps, plain.switches)


def short_bursts_beside_a_hog(priority: int, spanning: frozenset[int] = frozenset()) -> tuple[FakeGpu, Workload]:
    """2 ms of work every 30 ms (a latency-sensitive service) in group 0, a hog in group 1 (in turns, unless
    one of them is a job over this GPU and another: `spanning`)."""
    bursts = bursty(2 * MS, 30 * MS)
    gpu, _ = simulate({0: Quota(priority=priority), 1: Quota()}, {0: bursts, 1: hog()}, duration=3 * SECOND,
                      spanning=spanning)
    return gpu, bursts


def test_a_high_priority_burst_waits_a_poll_and_a_drain_not_a_slice() -> None:
    gpu, bursts = short_bursts_beside_a_hog(priority=1)
    base, base_bursts = short_bursts_beside_a_hog(priority=0)
    p = PolicyParams()
    # Each burst: its own 2 ms, at most a poll until the policy sees it, the hog's 1 ms drain.
    assert len(bursts.latencies) >= 95
    assert max(bursts.latencies) <= 2 * MS + p.poll_ns + 1 * MS + MS // 10
    # Without the priority the first bursts wait for the hog's slice to end; once the service is a
    # slice behind the hog in usage (it uses a fifteenth of the GPU), for the hog's shortest slice
    # at most (PolicyParams.min_slice_ns; the hog runs 28 ms between bursts): fair, not first.
    def median(latencies: list[int]) -> int:
        return sorted(latencies)[len(latencies) // 2]

    assert max(base_bursts.latencies) > p.slice_ns / 2
    assert median(base_bursts.latencies) <= 2 * MS + p.poll_ns + 1 * MS + MS // 10
    assert max(base_bursts.latencies[len(base_bursts.latencies) // 4:]) <= p.min_slice_ns + 3 * MS
    # Every burst ran, and the hog got the rest: the GPU idles only for the looks and drains.
    assert gpu.share(0, 3 * SECOND) == pytest.approx(2 / 30, abs=0.005)
    assert sum(gpu.busy_ns.values()) / (3 * SECOND) > 0.85
    assert sum(base.busy_ns.values()) / (3 * SECOND) > 0.85
    # The hog a job over GPUs, no priority: released together, each burst runs beside the hog at half speed.
    shared, shared_bursts = short_bursts_beside_a_hog(priority=0, spanning=frozenset({1}))
    assert len(shared_bursts.latencies) >= 95 and max(shared_bursts.latencies) <= 2 * 2 * MS + MS // 10
    assert sum(shared.busy_ns.values()) / (3 * SECOND) > 0.999


def test_a_lower_priority_group_still_gets_its_min_util() -> None:
    # Its debt is paid in slices of 180 ms (it goes first once owed that long a slice): up to 126 ms of
    # it is outstanding at any time, 0.4 points of 30 s.
    gpu, policy = simulate({0: Quota(0.3, 1.0), 1: Quota(priority=10)}, {0: hog(), 1: hog()},
                           duration=30 * SECOND)
    assert gpu.share(0, 30 * SECOND) >= 0.3 - 0.005
    assert gpu.share(1, 30 * SECOND) == pytest.approx(0.7, abs=0.015)
    # Over the scheduler's 1 s window too, which swings with the 180 ms slices every 600 ms.
    assert policy.usage(30 * SECOND)[0].util_ratio >= 0.3 - 0.06
    # Without a MinUtil, all of it goes to the higher priority.
    starved, _ = simulate({0: Quota(), 1: Quota(priority=10)}, {0: hog(), 1: hog()}, duration=2 * SECOND)
    assert starved.share(1, 2 * SECOND) > 0.99


def test_a_holder_paid_its_min_util_is_not_revoked_for_a_priority() -> None:
    policy = TimeSharePolicy(now=0)
    policy.set_quotas(0, {0: Quota(0.5, 1.0), 1: Quota(priority=1)})
    both = frozenset({0, 1})
    policy.step(0, Observation(frozenset({1}), present=both))
    t = 0
    # Group 0 waits beside the higher-priority hog until it is owed time, and is then released.
    decision = policy.step(t, Observation(both, present=both))
    while decision.released != 0:
        t = max(t + 1, decision.wake_at)
        decision = policy.step(t, Observation(both, drained_at=t, present=both))
    released_at = t
    while decision.released == 0:
        t = max(t + 1, decision.wake_at)
        decision = policy.step(t, Observation(both, present=both))
    # It kept the GPU for its debt (a slice of at least min_slice), not a single look.
    assert t - released_at >= policy.params.min_slice_ns


def test_a_high_priority_group_is_still_capped() -> None:
    gpu, _ = simulate({0: Quota(0, 0.4, priority=10), 1: Quota()}, {0: hog(), 1: hog()})
    assert gpu.share(0, 10 * SECOND) == pytest.approx(0.4, abs=0.01)
    assert gpu.share(1, 10 * SECOND) == pytest.approx(0.6, abs=0.015)


def test_no_extra_looks_without_a_higher_priority_process() -> None:
    # The higher-priority group is configured but has no process on this GPU: the holder alone is
    # looked at only at the net, its queue long.
    policy = TimeSharePolicy(now=0)
    policy.set_quotas(0, {0: Quota(), 1: Quota(priority=5)})
    decision = policy.step(0, Observation(frozenset({0}), present=frozenset({0})))
    assert decision.wake_at == policy.params.ring_net_ns and not decision.short_queue


def test_an_outranked_holder_keeps_a_tight_queue_and_its_waits_are_news() -> None:
    """The holder of a lower priority than a present group's is released outranked (the gate keeps
    its queue to GT_OUTRANKED_QUEUE_BOUND_NS), and the scheduler looks as soon as a thread waits;
    not so at equal priorities, nor for a holder being paid its MinUtil debt. (At equal priorities
    the holder alone sleeps on the bell too: another group's wait is news there.)"""
    both = frozenset({0, 1})
    policy = TimeSharePolicy(now=0)
    policy.set_quotas(0, {0: Quota(), 1: Quota(priority=5)})
    decision = policy.step(0, Observation(frozenset({0}), present=both))
    assert decision.released == 0 and decision.outranked and decision.wake_on_wait
    decision = policy.step(1 * MS, Observation(both, present=both))  # group 1's request: revoked
    assert decision.draining == 0 and decision.wake_on_wait  # the hog's wait after its drain is news
    decision = policy.step(2 * MS, Observation(both, drained_at=2 * MS, present=both))
    assert decision.released == 1 and not decision.outranked and not decision.wake_on_wait

    equal = TimeSharePolicy(now=0)
    equal.set_quotas(0, {0: Quota(priority=5), 1: Quota(priority=5)})
    decision = equal.step(0, Observation(frozenset({0}), present=both, crowded=both))
    assert decision.released == 0 and not decision.outranked and not decision.short_queue

    owed = TimeSharePolicy(now=0)
    owed.set_quotas(0, {0: Quota(0.5, 1.0), 1: Quota(priority=5)})
    t, decision = 0, owed.step(0, Observation(both, present=both))
    while decision.released != 0:
        t = max(t + 1, decision.wake_at)
        decision = owed.step(t, Observation(both, drained_at=t, present=both))
    assert not decision.outranked  # paid its debt first: no request revokes it meanwhile


def requests_beside_a_hog(outranked_drain_ns: int | None) -> tuple[FakeGpu, Workload]:
    """2 ms requests every 20 ms in group 0 (Priority 1) beside a hog in group 1 whose queue takes
    10 ms to drain (GT_QUEUE_BOUND_NS), or `outranked_drain_ns` where it was released outranked."""
    requests = bursty(2 * MS, 20 * MS)
    gpu, _ = simulate({0: Quota(priority=1), 1: Quota()}, {0: requests, 1: hog()}, duration=3 * SECOND,
                      drain_ns=10 * MS, outranked_drain_ns=outranked_drain_ns)
    return gpu, requests


def test_a_request_waits_the_outranked_drain_only() -> None:
    gpu, requests = requests_beside_a_hog(outranked_drain_ns=2 * MS)
    assert len(requests.latencies) >= 149
    # Each request: its own 2 ms and the hog's outranked drain (2 ms); the looks come at the rings
    # (the request's wait, then the drained hog's), within one 0.1 ms step of the fake GPU each.
    assert max(requests.latencies) <= 2 * MS + 2 * MS + 2 * MS // 10
    # The hog keeps the rest of the GPU but the switches: after each request the GPU idles until the
    # look that sees the service quiet (a poll at most after its release).
    assert gpu.share(1, 3 * SECOND) >= 0.7
    assert gpu.share(0, 3 * SECOND) == pytest.approx(2 / 20, abs=0.005)
    # Where the outranked hog's queue were bounded as any released group's (a 10 ms drain), the
    # worst request waited for all of it.
    before, before_requests = requests_beside_a_hog(outranked_drain_ns=None)
    assert max(before_requests.latencies) > 2 * MS + 10 * MS
    assert before.share(1, 3 * SECOND) <= gpu.share(1, 3 * SECOND) + 0.02


def test_groups_out_of_play_are_brought_up_to_date_as_if_look_by_look() -> None:
    """A look moves only the accounts in play; the others (40 groups here, capped and guaranteed,
    most of them quiet between 2 ms bursts) are brought up to date when next read. The same decisions and
    figures as a policy whose every account is brought up to date at every look (`usage` does that),
    while the buckets' capacity follows the drains (a long drain, or none for a quiet holder)."""
    quotas = {g: Quota(0.05 if g % 5 == 0 else 0.0, (0.05, 0.1, 1.0)[g % 3]) for g in range(40)}
    workloads = {g: hog() if g in (2, 5, 8) else bursty(2 * MS, (60 + 13 * g) * MS) for g in range(40)}
    # 20 ms slices: the hogs' drains of 20 ms move the slice (the buckets' capacity) off it, and the
    # quiet holders' empty ones back.
    params = PolicyParams(slice_ns=20 * MS, min_slice_ns=5 * MS)
    lazy, eager = (TimeSharePolicy(params) for _ in range(2))
    for policy in (lazy, eager):
        policy.set_quotas(0, quotas)
    gpu = FakeGpu(workloads, drain_ns=20 * MS)
    t, capacities = 0, set()
    # Time held back, counted from the decisions: a group that wanted the GPU and was not released
    # (at least); or that, besides, was held and still draining or overrunning (at most).
    waited, waited_or_drained = dict.fromkeys(quotas, 0), dict.fromkeys(quotas, 0)
    while t < 5 * SECOND:
        observation = gpu.observe(t)
        decision = lazy.step(t, observation)
        eager.usage(t)
        assert eager.step(t, observation) == decision
        capacities.add(eager.slice_ns())
        gpu.apply(t, decision)
        wanting, finishing = observation.demand, {decision.draining, *lazy.overrunning()}
        after = gpu.run(t, min(max(decision.wake_at, t + 1), 5 * SECOND), decision.wake_on_wait)
        for group in quotas:
            if group != decision.released:
                waited[group] += (after - t) * (group in wanting)
                waited_or_drained[group] += (after - t) * (group in wanting or group in finishing)
        t = after
    assert len(capacities) > 10 and gpu.switches > 100  # the slice (the buckets' capacity) moved all along
    expected = eager.usage(t)
    for group, usage in lazy.usage(t).items():
        assert astuple(usage) == pytest.approx(astuple(expected[group]), rel=1e-9)
        assert waited[group] / 1e9 - 1e-6 <= usage.throttled_seconds <= waited_or_drained[group] / 1e9 + 1e-6
    assert sum(waited.values()) > 20 * SECOND  # most of the 40 groups waited most of the 5 s


def test_a_holder_whose_processes_exit_keeps_the_time_it_was_seen_busy() -> None:
    # Its slots freed, the holder has no drain time to tell (0): refunded from its release, a group that
    # held the GPU alone for seconds lost them all, its GPU-seconds counter going backwards.
    policy = TimeSharePolicy(PolicyParams(), now=0)
    policy.set_quotas(0, {0: Quota()})
    busy = frozenset({0})
    t = 0
    while t < 5 * SECOND:
        t = max(t + 1, policy.step(t, Observation(busy, present=busy, holder_burst_from=0)).wake_at)
    before = policy.usage(t)[0].gpu_seconds
    policy.step(t + 10 * MS, Observation(frozenset(), holder_idle_since=0))
    after = policy.usage(t + 10 * MS)[0].gpu_seconds
    assert before >= 4.9 and after >= before - 0.3, (before, after)


def test_an_opportunistic_group_goes_beside_a_production_group_present_and_is_scheduled_without_one() -> None:
    """Opportunistic groups take no turn while a production group (one not opportunistic) has a
    process on the GPU: they are released beside it (Decision.beside), idle or not, and the production
    group is released alone in the token, at once. Without a production group present they take turns
    as any group. An opportunistic holder goes beside the moment production appears, with no drain
    (its gate bounds its queue at its next launch)."""
    policy = TimeSharePolicy(now=0)
    policy.set_quotas(0, {0: Quota(opportunistic=True), 1: Quota()})
    train = frozenset({0})
    decision = policy.step(0, Observation(train, present=train))
    assert decision.released == 0 and decision.beside == frozenset()
    # The production group's first launch (it waits on its held word): the opportunistic holder goes
    # beside, and production holds the token at this very look.
    both = frozenset({0, 1})
    decision = policy.step(1 * MS, Observation(both, present=both))
    assert decision.beside == train and decision.released == 1 and decision.draining is None
    # Production idle but present: still beside, nobody else needs the token.
    for t in range(2 * MS, 200 * MS, 4 * MS):
        decision = policy.step(t, Observation(train, present=both))
        assert decision.beside == train and decision.released != 0
    # Production gone (its last process exited: nothing queued): the opportunistic group is scheduled
    # again, and takes the GPU from the quiet holder.
    decision = policy.step(200 * MS, Observation(train, holder_idle_since=199 * MS, present=train))
    assert decision.beside == frozenset()
    decision = policy.step(201 * MS, Observation(train, drained_at=199 * MS, present=train))
    assert decision.released == 0


def test_opportunistic_groups_alone_share_the_gpu_as_any_groups() -> None:
    """Two opportunistic hogs with nobody else: the usual time shares, priorities included."""
    gpu, policy = simulate({0: Quota(opportunistic=True), 1: Quota(opportunistic=True, priority=1)},
                           {0: hog(), 1: hog()}, duration=2 * SECOND)
    assert gpu.share(1, 2 * SECOND) > 0.95 and gpu.share(0, 2 * SECOND) < 0.02


def test_a_waiting_group_s_debt_coming_due_is_a_deadline_while_the_busy_holder_rings() -> None:
    """A busy holder others wait for is looked at its quiet ring, not polled: what the poll also found
    comes as a deadline. Here a group with MinUtil 0.9 waits beside a group in its turn across GPUs
    (180 ms long): its debt reaches what revokes the holder (`_deep_debt`: a long
    slice's debt and a slice's accrual, 72 ms at 0.9) 80 ms after it began to wait, and the look comes
    then, not at the turn's end."""
    policy = TimeSharePolicy(now=0)
    policy.set_quotas(0, {0: Quota(), 1: Quota(0.9, 1.0)})
    both, turn = frozenset({0, 1}), frozenset({0})
    assert policy.step(0, Observation(frozenset({0}), present=both, due=turn)).released == 0
    decision = policy.step(1 * MS, Observation(both, present=both, due=turn))  # 1 waits from here
    assert decision.released == 0 and decision.quiet_rings
    assert decision.wake_at == 81 * MS
    decision = policy.step(decision.wake_at, Observation(both, present=both, due=turn))
    assert decision.draining == 0  # revoked for the debt, 100 ms before its turn's end


def test_a_guaranteed_group_spanning_gpus_starts_a_whole_turn_however_little_it_is_owed() -> None:
    """Each turn of a job across GPUs costs it a restart of every rank: released with a small MinUtil debt,
    it keeps its whole turn (180 ms) rather than the debt's 15-70 ms (four ranks at MinUtil 0.6 were charged
    0.55 of each H200 in turns of 43-110 ms); and it goes on past its turn only for the debt left."""
    policy = TimeSharePolicy(now=0)
    policy.set_quotas(0, {0: Quota(0.6, 1.0), 1: Quota()})
    both, gang = frozenset({0, 1}), frozenset({0})
    assert policy.step(0, Observation(frozenset({1}), present=both, barred=gang)).released == 1
    # Group 0 wants the GPU, its turn closed: it is owed 0.6 of the 20 ms it waits.
    assert policy.step(1 * MS, Observation(both, present=both, barred=gang)).released == 1
    assert policy.step(21 * MS, Observation(both, present=both, due=gang)).draining == 1  # its turn goes
    decision = policy.step(22 * MS, Observation(both, drained_at=21 * MS, present=both, due=gang))
    assert decision.released == 0
    for now in range(32 * MS, 200 * MS, 10 * MS):  # busy all along, the other waiting
        decision = policy.step(now, Observation(both, present=both, due=gang))
        assert decision.released == 0, now


def test_barred_eligibility_in_one_loop_is_eligible_with_gang_ok() -> None:
    """`_barred_eligible` (the look's one loop over the barred groups) lets go exactly the groups that
    `_eligible(g, now, gang_ok=True)` would, in their order, whatever their caps and credit."""
    caps = [1.0, 0.0, 0.05, 0.25, 0.3, 0.5, 0.9, 0.99]
    quotas = {g: Quota(max_util=caps[g % len(caps)]) for g in range(24)}
    policy = TimeSharePolicy(PolicyParams(), now=0)
    policy.set_quotas(0, quotas)
    now, refused = 0, 0
    for look in range(400):
        now += (look % 7 + 1) * 3 * MS
        # Groups take turns being barred, so that those barred now have run (and spent credit) before.
        barred = frozenset(g for g in range(24) if (g + look // 40) % 3 == 0)
        demand = frozenset(g for g in range(24) if (g + look) % 5)
        policy.step(now, Observation(demand=demand, present=frozenset(range(24)), barred=barred))
        for groups in (policy._barred & policy._demand, policy._barred - policy._demand):
            eligible = [g for g in groups if policy._eligible(g, now, gang_ok=True)]
            assert policy._barred_eligible(groups) == eligible
            refused += sum(1 for g in groups if 0.0 < quotas[g].max_util < 1.0 and g not in eligible)
    assert refused  # (some capped group was barred without the credit for a turn)


def test_the_demands_caps_follow_new_quotas_with_the_same_demand() -> None:
    """`_caps_fill_gpu` keeps the demand's MaxUtils added up between looks: a change of quotas with the
    same groups wanting the GPU is seen at once (a sum kept past it would say the caps do not fill it)."""
    policy = TimeSharePolicy(PolicyParams(), now=0)
    policy.set_quotas(0, {1: Quota(max_util=0.5), 2: Quota(max_util=0.4)})
    policy.step(MS, Observation(demand=frozenset({1, 2}), present=frozenset({1, 2})))
    assert not policy._caps_fill_gpu()
    policy.set_quotas(2 * MS, {1: Quota(max_util=0.6), 2: Quota(max_util=0.4)})
    assert policy._caps_fill_gpu()
    policy.step(3 * MS, Observation(demand=frozenset({1}), present=frozenset({1, 2})))
    assert not policy._caps_fill_gpu()
