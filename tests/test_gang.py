"""Gang turns (gemtrace/agent/gang.py) with the policies of several fake GPUs on one fake clock: a job whose
ranks meet at a collective every step makes progress only while all of them run, so its turns must
line up across its GPUs, while each GPU's own quotas and fairness still hold. No region, no sleeping:
the simulated GPU's collectives through the real agent are in tests/test_gang_e2e.py."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace

import pytest

from gemtrace.agent.gang import NO_JOB, GangTurns, GpuReport, Turns
from gemtrace.agent.policy import MS, Decision, Observation, PolicyParams, Quota, TimeSharePolicy

pytestmark = pytest.mark.unit

SECOND = 1000 * MS
TICK = MS // 10


@dataclass
class Job:
    """A data-parallel job: each step, on each of its GPUs, a rank runs `segments` times
    `compute_ns / segments` of kernels, each followed by a collective (the gradients' buckets) that
    needs `collective_ns / segments` with every rank running at once; a rank that reached it first
    spins (busy, charged, no progress) until the others run too. On one GPU with no collective, it is
    a single-GPU training loop (`loop`)."""

    gpus: tuple[int, ...]
    compute_ns: int = 20 * MS
    collective_ns: int = 2 * MS
    segments: int = 4
    pause_ns: int = 0  # CPU work between steps: every rank quiet (nothing queued) that long
    # A rank released after a hold runs this long before it moves again (its CPU refills the queue the
    # hold emptied, the ranks line up at their next collective): what each turn costs the job.
    restart_ns: int = 0
    steps: int = 0
    pause_left: int = 0
    resumed_at: int = 0  # when its last pause ended: its open burst opened there
    done: int = 0  # segments done this step
    left: dict[int, int] = field(default_factory=dict)  # each rank's compute left this segment
    collective_left: int = 0
    ran: set[int] = field(default_factory=set)  # the GPUs its ranks ran on in the last tick
    restart_left: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._next_segment()

    def _next_segment(self) -> None:
        self.left = {gpu: self.compute_ns // self.segments for gpu in self.gpus}
        self.collective_left = self.collective_ns // self.segments

    @property
    def quiet(self) -> bool:
        return self.pause_left > 0

    def run(self, running: set[int], dt: int) -> None:
        """`running`: the GPUs on which the job's rank runs during this tick."""
        if self.pause_left > 0:
            self.pause_left -= dt
            return
        for gpu in running - self.ran:
            self.restart_left[gpu] = self.restart_ns
        self.ran = set(running)
        for gpu in running:
            if self.restart_left.get(gpu, 0) > 0:
                self.restart_left[gpu] -= dt
                running = running - {gpu}
        for gpu in running:
            self.left[gpu] = max(0, self.left[gpu] - dt)
        if all(self.left[gpu] == 0 for gpu in self.gpus) and running >= set(self.gpus):
            self.collective_left -= dt
            if self.collective_left <= 0:
                self.done += 1
                if self.done == self.segments:
                    self.steps, self.done = self.steps + 1, 0
                    self.pause_left = self.pause_ns
                self._next_segment()

    def solo_steps_per_second(self) -> float:
        return SECOND / (self.compute_ns + self.collective_ns)


@dataclass
class Gpu:
    """One fake GPU's groups (each a hog, or a rank of a Job) and its policy; the held group drains
    in `drain_ns`. Keeps every group's true GPU time."""

    index: int
    policy: TimeSharePolicy
    groups: set[int]
    drain_ns: int = 1 * MS
    released: int | None = None
    draining: int | None = None
    drain_end: int = 0
    next_look: int = 0
    busy_ns: dict[int, int] = field(default_factory=dict)
    switches: int = 0
    quiet_since: dict[int, int] = field(default_factory=dict)  # the pausing jobs' groups: since when
    wake_on_wait: bool = False  # the last decision's: a group that starts waiting rings (the gates do)
    quiet_rings: bool = False  # the last decision's: the released group going quiet rings (the gates do)
    demand: frozenset[int] = frozenset()  # at the last look

    def observe(self, t: int, jobs: dict[int, Job]) -> Observation:
        drained = self.drain_end if self.draining is not None and t >= self.drain_end else None
        # Hogs and ranks have work (a spinning rank is busy) but while a job pauses between steps.
        quiet = {group for group in self.groups if group in jobs and jobs[group].quiet}
        for group in quiet:
            self.quiet_since.setdefault(group, t)
        for group in self.groups - quiet:
            self.quiet_since.pop(group, None)
        released = self.released
        idle_since = self.quiet_since.get(released) if released is not None else None
        # A busy job's gates tell when its open burst opened: charged from there, not from this look.
        burst_from = jobs[released].resumed_at if released in jobs and idle_since is None else None
        return Observation(frozenset(self.groups - quiet), idle_since, drained, present=frozenset(self.groups),
                           holder_burst_from=burst_from)

    def apply(self, t: int, decision: Decision) -> None:
        if decision.draining is not None and self.draining is None:
            self.draining, self.drain_end = decision.draining, t + self.drain_ns
            self.switches += 1
        if decision.draining is None:
            self.draining = None
        self.released = decision.released
        self.next_look = max(t + TICK, decision.wake_at)
        self.wake_on_wait = decision.wake_on_wait
        self.quiet_rings = decision.quiet_rings

    def rings(self, jobs: dict[int, Job]) -> bool:
        """Does a group start waiting on its held word, or the released group go quiet, where the last
        decision asked to hear of it?"""
        released = self.released
        if self.quiet_rings and released in self.demand and released in jobs and jobs[released].quiet:
            return True  # (seen busy at the last look: it just went quiet)
        if not self.wake_on_wait:
            return False
        waiting = {g for g in self.groups if g != self.released and not (g in jobs and jobs[g].quiet)}
        return bool(waiting - self.demand)

    def running(self, t: int) -> set[int]:
        """The groups whose kernels run during this tick: the released one, and a drain's."""
        out = set()
        if self.released is not None:
            out.add(self.released)
        if self.draining is not None and t < self.drain_end:
            out.add(self.draining)
        return out


def simulate(layout: dict[int, dict[int, Quota]], jobs: dict[int, Job], seconds: float = 10,
             gang: bool = True, params: PolicyParams | None = None) -> tuple[list[Gpu], GangTurns]:
    """`layout`: GPU -> {group: quota}; `jobs`: group -> Job for the groups that are jobs (the rest are
    hogs). Looks come at each policy's wake_at, and at once where a turn changes, or a group starts
    waiting or the released one goes quiet while the last decision asked to hear of it (the doorbell). Each
    GPU's first look is half a slice after the last one's, and their drains differ (1, 1.7, 2.4 ms...):
    their clocks are apart, as real ones are. The fake GPUs run one group at a time: groups that nothing
    binds take turns here as where they could not share (PolicyParams.share_unbound off); sharing is
    checked through the agent on simulated GPUs (tests/test_gang_e2e.py) and below, in the turns' views."""
    params = params or PolicyParams(share_unbound=False)
    woken: set[int] = set()
    turns = GangTurns(woken.add)
    gpus = []
    for index, quotas in layout.items():
        policy = TimeSharePolicy(params, now=index * 30 * MS)
        policy.set_quotas(index * 30 * MS, quotas)
        gpus.append(Gpu(index, policy, set(quotas), drain_ns=1 * MS + index * 7 * TICK, next_look=index * 30 * MS))
    end = int(seconds * SECOND)
    for t in range(0, end, TICK):
        for gpu in gpus:
            drain_ended = gpu.draining is not None and gpu.drain_end == t
            if t < gpu.next_look and gpu.index not in woken and not drain_ended and not gpu.rings(jobs):
                continue
            woken.discard(gpu.index)
            obs = gpu.observe(t, jobs)
            gpu.demand = obs.demand
            if gang:
                turned = with_turns(obs, turns.view(gpu.index))
                decision = gpu.policy.step(t, turned)
                for _ in range(3):  # as GpuScheduler.step does
                    if not turns.report(gpu.index, GpuReport(obs.present, obs.demand, decision.ready,
                                                             decision.released, decision.clear, decision.draining,
                                                             turned.clearing)):
                        break
                    turned = with_turns(obs, turns.view(gpu.index))
                    decision = gpu.policy.step(t, turned)
            else:
                decision = gpu.policy.step(t, obs)
            gpu.apply(t, decision)
        running_jobs: dict[int, set[int]] = {}
        for gpu in gpus:
            for group in gpu.running(t):
                if group in jobs and jobs[group].quiet:
                    continue  # released, and idle: the GPU's time goes unused
                gpu.busy_ns[group] = gpu.busy_ns.get(group, 0) + TICK
                if group in jobs:
                    running_jobs.setdefault(group, set()).add(gpu.index)
        for group, job in jobs.items():
            quiet = job.quiet
            job.run(running_jobs.get(group, set()), TICK)
            if quiet and not job.quiet:
                job.resumed_at = t + TICK
    return gpus, turns


def with_turns(obs: Observation, turns: Turns) -> Observation:
    return replace(obs, barred=turns.barred, clearing=turns.clearing, due=turns.due, pending=turns.pending,
                   stranded=turns.stranded)


def share(gpu: Gpu, group: int, seconds: float = 10) -> float:
    return gpu.busy_ns.get(group, 0) / (seconds * SECOND)


def loop(gpu: int, pause_ns: int) -> Job:
    """A single-GPU training loop: 25 ms of kernels a step, then `pause_ns` quiet (its sync, then the CPU
    work that launches the next step)."""
    return Job((gpu,), compute_ns=25 * MS, collective_ns=0, segments=1, pause_ns=pause_ns)


def ddp_beside_hogs(job_quota: Quota, seconds: float = 10, gang: bool = True) -> tuple[Job, list[Gpu]]:
    """The job (group 0) on GPUs 0 and 1, an uncapped single-GPU hog on each (groups 1 and 2)."""
    job = Job((0, 1))
    gpus, _ = simulate({0: {0: job_quota, 1: Quota()}, 1: {0: job_quota, 2: Quota()}}, {0: job},
                       seconds=seconds, gang=gang)
    return job, gpus


def test_a_capped_job_does_its_cap_of_its_solo_work_only_with_gang_turns() -> None:
    job, gpus = ddp_beside_hogs(Quota(0, 0.3))
    done = job.steps / 10 / job.solo_steps_per_second()
    assert done >= 0.28
    for gpu in gpus:
        assert share(gpu, 0) == pytest.approx(0.3, abs=0.02)
    assert share(gpus[0], 1) == pytest.approx(0.7, abs=0.02)
    assert share(gpus[1], 2) == pytest.approx(0.7, abs=0.02)
    # Each GPU on its own clock: the job's ranks take turns that rarely meet.
    alone, _ = ddp_beside_hogs(Quota(0, 0.3), gang=False)
    assert alone.steps < job.steps / 2


def test_a_capped_job_that_pauses_between_steps_keeps_its_turns_whole() -> None:
    # Each step ends in 2 ms of CPU work on every rank: a rank quiet there and revoked as any quiet
    # holder is would close the turn on both GPUs every step, and the job would wait to line up again.
    job = Job((0, 1), pause_ns=2 * MS)
    gpus, _ = simulate({0: {0: Quota(0, 0.3), 1: Quota()}, 1: {0: Quota(0, 0.3), 2: Quota()}}, {0: job})
    solo = SECOND / (job.compute_ns + job.collective_ns + job.pause_ns)
    assert job.steps / 10 / solo >= 0.27
    for gpu in gpus:
        assert share(gpu, 0) == pytest.approx(0.3, abs=0.02)  # its quiet pauses are not charged, its steps are
        assert gpu.switches < 40  # about one turn per 180 ms turn's credit (gang_slice_ns) and its end


def test_a_guaranteed_job_gets_its_min_util_of_its_solo_work() -> None:
    job, gpus = ddp_beside_hogs(Quota(0.6, 1.0))
    assert job.steps / 10 / job.solo_steps_per_second() >= 0.57
    for gpu, hog in zip(gpus, (1, 2), strict=True):
        assert share(gpu, 0) >= 0.59
        # and no more than its guarantee: a debt's slice paid in whole turns gave it 0.75
        assert share(gpu, hog) == pytest.approx(0.4, abs=0.03)


def test_an_unlimited_job_shares_each_gpu_evenly_with_the_single_gpu_jobs() -> None:
    job, gpus = ddp_beside_hogs(Quota())
    assert job.steps / 10 / job.solo_steps_per_second() >= 0.45
    for gpu, hog in zip(gpus, (1, 2), strict=True):
        assert share(gpu, hog) == pytest.approx(0.5, abs=0.03)


@pytest.mark.parametrize("pause_ms", [1, 3, 5])
def test_an_unlimited_job_shares_each_gpu_evenly_with_single_gpu_loops_that_pause_between_steps(
        pause_ms: int) -> None:
    """Each loop goes quiet at every step's end, and its gates ring then. Counted out of the choice at
    that look, a loop let the job's turn open at its first pause: the job took 0.87 of each GPU and the
    loops 0.12, whatever the pause from 1 to 8 ms. Weighed as if busy through a pause of up to
    gang_pause_ns (5 ms), the job gets 0.49 / 0.48 / 0.47 of each GPU and the loops 0.49 / 0.47 / 0.45
    for pauses of 1 / 3 / 5 ms (the rest is the loops' own pauses, GPU time nobody uses); 0.49 / 0.50
    with no pause. A loop that pauses longer (8 ms) is idle to the choice: 0.73 / 0.20."""
    job = Job((0, 1))
    loops = {1: loop(0, pause_ms * MS), 2: loop(1, pause_ms * MS)}
    gpus, _ = simulate({0: {0: Quota(), 1: Quota()}, 1: {0: Quota(), 2: Quota()}}, {0: job, **loops})
    for gpu, single in zip(gpus, (1, 2), strict=True):
        assert share(gpu, 0) == pytest.approx(0.5, abs=0.05)
        assert share(gpu, single) == pytest.approx(0.5, abs=0.06)
        assert abs(share(gpu, 0) - share(gpu, single)) < 0.03  # the same charge, whoever pauses
    assert job.steps / 10 / job.solo_steps_per_second() >= 0.45
    for single in loops.values():
        solo = SECOND / (single.compute_ns + single.pause_ns)
        assert single.steps / 10 / solo >= 0.45


def test_a_job_whose_turns_cost_it_a_restart_runs_in_turns_long_enough_to_pay_for_them() -> None:
    # Each turn costs the job 8 ms before its ranks move again: in turns of a 60 ms slice, it would do
    # 0.43 of its solo work with half of each GPU. Its turns are longer, and still half of each GPU.
    job = Job((0, 1), restart_ns=8 * MS)
    gpus, turns = simulate({0: {0: Quota(), 1: Quota()}, 1: {0: Quota(), 2: Quota()}}, {0: job})
    assert job.steps / 10 / job.solo_steps_per_second() >= 0.45
    for gpu, hog in zip(gpus, (1, 2), strict=True):
        assert share(gpu, hog) == pytest.approx(0.5, abs=0.03)
    assert turns.turns < 40


def test_a_job_beside_work_on_one_of_its_gpus_gets_that_gpus_fair_share() -> None:
    # GPU 0 is shared with a hog; GPU 1 is the job's alone. The job runs half the time on both (its
    # rank on GPU 1 could do nothing more: it would spin), and the hog keeps its half of GPU 0.
    job = Job((0, 1))
    gpus, _ = simulate({0: {0: Quota(), 1: Quota()}, 1: {0: Quota()}}, {0: job})
    assert job.steps / 10 / job.solo_steps_per_second() >= 0.45
    assert share(gpus[0], 1) == pytest.approx(0.5, abs=0.03)


def test_two_jobs_on_the_same_two_gpus_take_whole_turns_evenly() -> None:
    first, second = Job((0, 1)), Job((0, 1))
    gpus, turns = simulate({0: {0: Quota(), 1: Quota()}, 1: {0: Quota(), 1: Quota()}}, {0: first, 1: second})
    for job in (first, second):
        assert job.steps / 10 / job.solo_steps_per_second() >= 0.45
    assert turns.turns > 50  # they alternate, each in whole turns on both GPUs


def test_caps_of_two_jobs_hold_on_each_gpu() -> None:
    first, second = Job((0, 1)), Job((0, 1))
    quotas = {0: Quota(0, 0.3), 1: Quota(0, 0.7)}
    gpus, _ = simulate({0: dict(quotas), 1: dict(quotas)}, {0: first, 1: second})
    for gpu in gpus:
        assert share(gpu, 0) == pytest.approx(0.3, abs=0.02)
        assert share(gpu, 1) == pytest.approx(0.7, abs=0.03)
    assert first.steps / 10 / first.solo_steps_per_second() >= 0.28
    assert second.steps / 10 / second.solo_steps_per_second() >= 0.65


def test_a_group_on_one_gpu_is_neither_barred_nor_due() -> None:
    turns = GangTurns()
    turns.report(0, GpuReport(present=frozenset({1, 2}), demand=frozenset({1, 2})))
    turns.report(1, GpuReport(present=frozenset({2, 3}), demand=frozenset({2})))
    assert turns.view(0) == Turns(barred=frozenset({2}))
    assert turns.view(1) == Turns(barred=frozenset({2}))
    turns.report(1, GpuReport(present=frozenset({3}), demand=frozenset()))
    assert not turns.view(0)


def test_a_group_is_a_gang_only_on_the_gpus_that_one_of_its_jobs_spans() -> None:
    def report(*jobs: tuple[int, int]) -> GpuReport:
        groups = frozenset(group for group, _ in jobs)
        return GpuReport(present=groups, demand=groups, jobs=frozenset(jobs))

    turns = GangTurns()
    # Group 5's job 1 on GPU 0 and its job 2 on GPU 1 (two single-GPU runs): each GPU schedules it alone.
    turns.report(0, report((5, 1), (6, NO_JOB)))
    turns.report(1, report((5, 2)))
    turns.report(2, report((5, 3)))
    assert not turns.view(0) and not turns.view(1) and not turns.view(2)
    # Its job 2 starts a rank on GPU 0: a gang on GPUs 0 and 1, not on GPU 2, where job 3 runs alone.
    turns.report(0, report((5, 1), (5, 2), (6, NO_JOB)))
    assert turns.view(0) == turns.view(1) == Turns(barred=frozenset({5}))
    assert not turns.view(2)
    # Processes that name no job are one job, as a group without jobs is (a report without them).
    turns.report(0, report((6, NO_JOB)))
    turns.report(1, report((6, NO_JOB)))
    assert turns.view(0) == turns.view(1) == Turns(barred=frozenset({6}))


def test_a_gang_whose_every_gpu_would_share_takes_no_turns_and_one_that_would_not_ends_that() -> None:
    """Group 2 spans GPUs 0 and 1, beside group 1 on GPU 0 and group 3 on GPU 1, and nothing binds any
    (Decision.sharable on both): it is no gang, neither barred nor due, and its open turn ends. GPU 1
    would no longer share (a quota set there, a second process): group 2 takes turns on both again,
    GPU 0 included, whose policy then ends its sharing (`TimeSharePolicy._sharing`)."""
    woken: list[int] = []
    turns = GangTurns(woken.append)
    zero, one = frozenset({1, 2}), frozenset({2, 3})
    turns.report(0, GpuReport(zero, zero, ready=frozenset({2})))
    turns.report(1, GpuReport(one, one, ready=frozenset({2})))
    assert turns.open_turns() == {2: frozenset({0, 1})}
    turns.report(0, GpuReport(zero, zero, sharable=True))
    assert turns.view(0) == turns.view(1) == Turns(clearing=frozenset({2}))  # (GPU 1 would not yet)
    woken.clear()
    turns.report(1, GpuReport(one, one, sharable=True))
    assert not turns.view(0) and not turns.view(1) and not turns.open_turns()
    assert woken == [0]  # GPU 0 looks again at once: group 2 is its own there now
    turns.report(0, GpuReport(zero, zero, sharable=True))
    assert not turns.view(0) and not turns.open_turns()
    turns.report(1, GpuReport(one, one, sharable=False))
    assert turns.view(0) == turns.view(1) == Turns(barred=frozenset({2}))


def test_a_group_is_a_gang_from_the_report_in_which_it_wants_a_second_gpu() -> None:
    # The gangs are kept between reports while no GPU's (group, job) pairs change: a group that only
    # starts to want GPU 1 (its first launch waits there) changes them.
    turns = GangTurns()
    turns.report(0, GpuReport(present=frozenset({2}), demand=frozenset({2})))
    turns.report(1, GpuReport())
    assert not turns.view(0)
    turns.report(1, GpuReport(demand=frozenset({2})))
    assert turns.view(0) == turns.view(1) == Turns(barred=frozenset({2}))
    turns.report(1, GpuReport())
    assert not turns.view(0) and not turns.view(1)


def test_a_turn_goes_to_the_gang_whose_last_turn_opened_longest_ago_one_that_never_had_one_first() -> None:
    gangs = frozenset({3, 4, 5})
    turns = GangTurns()

    def report(gpu: int, ready: frozenset[int], clearing: frozenset[int] = frozenset()) -> None:
        turns.report(gpu, GpuReport(gangs, gangs, ready=ready, clearing=clearing))

    def opened(ready: frozenset[int]) -> int:
        """Both GPUs consent to `ready`: the gang whose turn opens, closed again unstarted (GPU 0 no
        longer consents while it clears)."""
        report(0, ready)
        report(1, ready)
        (group,) = turns.open_turns()
        report(0, frozenset(), clearing=frozenset({group}))
        report(1, frozenset())
        assert turns.open_turns() == {}
        return group

    assert opened(frozenset({4})) == 4
    first, second = opened(gangs), opened(gangs)
    assert {first, second} == {3, 5}  # never had a turn: before 4
    assert opened(gangs) == 4
    assert opened(gangs) == first


def test_a_turn_opens_when_every_gpu_that_wants_it_consents_starts_when_all_are_clear_and_closes_when_one_holds_it(
        ) -> None:
    woken: list[int] = []
    turns = GangTurns(woken.append)
    both = frozenset({7})
    turns.report(1, GpuReport(both, both, ready=frozenset()))
    turns.report(0, GpuReport(both, both, ready=both, clear=True))
    assert turns.view(0) == Turns(barred=both)  # GPU 1 has not consented yet
    assert turns.open_turns() == {}
    assert turns.report(1, GpuReport(both, both, ready=both))
    # Open: GPU 0 is clear already, GPU 1 still holds another group (it drains).
    assert turns.view(0) == Turns(clearing=both) and turns.view(1) == Turns(clearing=both)
    assert 0 in woken  # the other GPU's scheduler is told at once
    turns.report(0, GpuReport(both, both, ready=both, clear=True, clearing=both))
    assert turns.view(0) == Turns(clearing=both)
    turns.report(1, GpuReport(both, both, ready=both, clear=True, clearing=both))
    # Go: released on both at once, whether or not each asks (pending: not yet released there).
    assert turns.view(0) == Turns(due=both, pending=both) and turns.view(1) == Turns(due=both, pending=both)
    turns.report(0, GpuReport(both, both, released=7))
    assert turns.view(0) == Turns(due=both)
    turns.report(1, GpuReport(both, both, released=7))
    turns.report(1, GpuReport(both, frozenset(), released=None))  # quiet on GPU 1: the turn goes on
    assert turns.view(0) == Turns(due=both)
    woken.clear()
    turns.report(0, GpuReport(both, both, released=None))  # GPU 0's slice ended
    assert turns.view(1) == Turns(barred=both) and woken == [1]


def test_a_turn_that_a_gpu_no_longer_consents_to_while_it_clears_does_not_start() -> None:
    # Its MaxUtil credit went on GPU 1 while GPU 0 drained: started, the turn would leave the process
    # on GPU 0 spinning in its collective.
    both = frozenset({7})
    turns = GangTurns()
    turns.report(1, GpuReport(both, both, ready=both))
    turns.report(0, GpuReport(both, both, ready=both))
    assert turns.view(1) == Turns(clearing=both)
    turns.report(1, GpuReport(both, both, ready=frozenset(), clear=True, clearing=both))
    assert turns.open_turns() == {} and turns.view(0) == Turns(barred=both)


def test_a_look_decided_before_the_turn_opened_does_not_close_it() -> None:
    # GPU 2 read its view (7 barred) before GPU 0's report opened 7's turn, and chose another barred
    # group: its readiness speaks of 7 barred, not clearing. Counted, it closed 8 turns of 10 at the
    # region's limit (1024 processes, 63 groups spanning 8 GPUs), each waking every GPU.
    both, three = frozenset({7}), frozenset({0, 1, 2})
    turns = GangTurns()
    turns.report(1, GpuReport(both, both, ready=both))
    turns.report(2, GpuReport(both, both, ready=both))
    turns.report(0, GpuReport(both, both, ready=both))
    assert turns.open_turns() == {7: three}
    turns.report(2, GpuReport(both, both, ready=frozenset(), clear=True))  # its look began before the opening
    assert turns.open_turns() == {7: three}
    for gpu in (0, 1, 2):
        turns.report(gpu, GpuReport(both, both, ready=both, clear=True, clearing=both))
    assert turns.view(2) == Turns(due=both, pending=both)


def test_an_idle_gpu_whose_capped_groups_wait_for_their_turns_looks_only_when_credit_comes_back() -> None:
    # Their turns' changes ring the bell; looked at at once instead, every GPU of the region's limit
    # looked as fast as the ring gap allows while turns cleared elsewhere.
    params = PolicyParams()
    policy = TimeSharePolicy(params, now=0)
    policy.set_quotas(0, {1: Quota(0, 0.3), 2: Quota(0, 0.3), 3: Quota(0, 0.3)})
    wanting = frozenset({1, 2, 3})
    t = 10 * SECOND
    # (Seen barred a second before: their buckets have room for a turn across GPUs, and filled it.)
    policy.step(t - SECOND, Observation(wanting, present=wanting, barred=wanting))
    barred = policy.step(t, Observation(wanting, present=wanting, barred=wanting))
    assert barred.released is None and barred.ready == wanting
    assert barred.wake_at == t + params.ring_net_ns
    clearing = policy.step(t + MS, Observation(wanting, present=wanting, barred=frozenset({1, 2}),
                                               clearing=frozenset({3})))
    assert clearing.released is None and clearing.wake_at == t + MS + params.ring_net_ns


def test_a_gpu_consents_to_the_barred_groups_it_would_choose_over_its_holder() -> None:
    # Barred 2 of the holder's priority, never run, is chosen over holder 1 once 1 has used more than
    # 2 would have used halfway through its turn (a gang's turn, 120 ms longer than a slice: 60 ms);
    # barred 3 of a lower priority is not, however little it ran.
    params = PolicyParams()
    policy = TimeSharePolicy(params, now=0)
    policy.set_quotas(0, {1: Quota(0, 1.0, 1), 2: Quota(0, 1.0, 1), 3: Quota(0, 1.0, 0)})
    wanting, barred = frozenset({1, 2, 3}), frozenset({2, 3})
    assert policy.step(0, Observation(wanting, present=wanting, barred=barred)).released == 1
    half_turn_more = (params.gang_slice_ns - params.slice_ns) // 2
    early = policy.step(half_turn_more - 5 * MS, Observation(wanting, present=wanting, barred=barred))
    assert early.released == 1 and early.ready == frozenset()
    later = policy.step(half_turn_more + 10 * MS, Observation(wanting, present=wanting, barred=barred))
    assert later.released == 1 and later.ready == {2}


def test_a_holder_quiet_between_two_steps_is_weighed_against_a_gang_as_if_busy() -> None:
    # Holder 1 ran 30 ms, less than barred 2 would have halfway through its turn: busy, it goes on.
    # Quiet for less than gang_pause_ns it still does (a loop's CPU work between steps); quiet longer,
    # it has nothing to go on with, and the GPU consents to 2's turn.
    params = PolicyParams()
    policy = TimeSharePolicy(params, now=0)
    policy.set_quotas(0, {1: Quota(), 2: Quota()})
    both, barred = frozenset({1, 2}), frozenset({2})
    assert policy.step(0, Observation(both, present=both, barred=barred)).released == 1
    busy = policy.step(20 * MS, Observation(both, present=both, barred=barred))
    assert busy.released == 1 and busy.ready == frozenset()
    quiet_at = 30 * MS
    paused = policy.step(quiet_at + params.gang_pause_ns - MS,
                         Observation(barred, quiet_at, present=both, barred=barred))
    assert paused.released == 1 and paused.ready == frozenset()
    idle = policy.step(quiet_at + params.gang_pause_ns + MS, Observation(barred, quiet_at, present=both, barred=barred))
    assert idle.ready == barred


def test_a_rank_held_while_its_turn_was_closed_does_not_hold_that_turn_up() -> None:
    # Group 7 is released alone on this GPU; its turn closes on its other GPU, so this GPU holds it, and
    # its queued work (a collective waiting for its peer there) keeps running. That drain is its own
    # work: the GPU is clear for its next turn, and when the turn goes, 7 goes on at once. Waited out,
    # the drain would end only after the turn began, and the turn began only once it ended.
    policy = TimeSharePolicy(PolicyParams(), now=0)
    policy.set_quotas(0, {7: Quota()})
    group = frozenset({7})
    assert policy.step(0, Observation(group, present=group)).released == 7
    held = policy.step(1 * MS, Observation(group, present=group, barred=group))
    assert held.released is None and held.draining == 7
    clearing = policy.step(2 * MS, Observation(group, present=group, clearing=group))
    assert clearing.clear and clearing.ready == group
    going = policy.step(3 * MS, Observation(group, present=group, due=group))
    assert going.released == 7


def test_a_gpu_draining_a_gang_whose_next_turn_is_not_open_sleeps_till_the_drain_ends() -> None:
    # Its turn ended (another GPU held it), every group here barred: nobody to hand the GPU to until the
    # next turn opens, and this GPU must be clear for that. The drain's end rings and the look it brings
    # sees the turn clearing: no look in between but the drain's net. A group on this GPU alone keeps
    # the poll (nobody barred here).
    params = PolicyParams()
    policy = TimeSharePolicy(params, now=0)
    policy.set_quotas(0, {7: Quota(), 8: Quota()})
    both = frozenset({7, 8})
    assert policy.step(0, Observation(both, present=both, due=frozenset({7}), barred=frozenset({8}))).released == 7
    now = params.gang_slice_ns // 2
    ended = policy.step(now, Observation(both, present=both, barred=both))
    assert ended.released is None and ended.draining == 7
    assert ended.wake_at == now + params.drain_net_ns
    drained = policy.step(now + 5 * MS, Observation(both, present=both, barred=frozenset({7}),
                                                    clearing=frozenset({8}), drained_at=now + 3 * MS))
    assert drained.draining is None and drained.clear and drained.ready == frozenset({8})

    alone = TimeSharePolicy(params, now=0)
    alone.set_quotas(0, {7: Quota(0, 0.5)})
    decision = alone.step(0, Observation(frozenset({7})))
    while decision.draining is None:
        now = decision.wake_at
        decision = alone.step(now, Observation(frozenset({7})))
    assert decision.wake_at == now + params.poll_ns


def test_a_gpu_that_ends_a_groups_turn_drains_it_before_releasing_anyone() -> None:
    # Held in its turn (its slice ended, another group waits): its drain is waited out as any holder's,
    # though the turn is still due in this GPU's view until the next report closes it.
    params = PolicyParams()
    policy = TimeSharePolicy(params, now=0)
    policy.set_quotas(0, {7: Quota(), 8: Quota()})
    both, gang = frozenset({7, 8}), frozenset({7})
    assert policy.step(0, Observation(both, present=both, due=gang)).released == 7
    ended = policy.step(params.gang_slice_ns + MS, Observation(both, present=both, due=gang))
    assert ended.released is None and ended.draining == 7


def test_a_group_in_its_turn_ends_it_where_another_spanning_group_waits_and_it_went_quiet_or_is_outranked() -> None:
    # 7 holds its turn here; 8, which spans GPUs too, waits (barred: no quiet revocation nor preemption
    # counted it, and 7's turn ran its whole 180 ms). Quiet past its pause, 7 goes at once, its first
    # 15 ms or not; busy, it goes once 8 of a higher priority waits and its first 15 ms have passed.
    params = PolicyParams()
    for quiet, priority in ((True, 0), (False, 10)):
        policy = TimeSharePolicy(params, now=0)
        policy.set_quotas(0, {7: Quota(), 8: Quota(0, 1.0, priority)})
        both, mine, other = frozenset({7, 8}), frozenset({7}), frozenset({8})
        assert policy.step(0, Observation(both, present=both, due=mine, barred=other)).released == 7
        quiet_at = 2 * MS
        t = quiet_at + params.gang_pause_ns + MS if quiet else params.min_slice_ns + MS
        seen = Observation(other if quiet else both, quiet_at if quiet else None, present=both, due=mine,
                           barred=other)
        ended = policy.step(t, seen)
        assert ended.released is None and ended.ready == other, (quiet, priority)


@pytest.mark.parametrize("job_here", [True, False])
def test_a_quiet_group_in_its_turn_ends_it_for_a_spanning_group_present_here_that_asks_for_nothing(
        job_here: bool) -> None:
    # 7 (a service at Priority 10) holds its turn here; 8 (a data-parallel job) is present, its rank
    # waiting in a sync for its collective, which waits for its peer held on the other GPU: it asks for
    # nothing here. Busy, 7 rings when it goes quiet; quiet past its pause, 7 goes. Kept (it was, as
    # nobody asked), its turn stayed open through its pause between requests, its next request came
    # first, and the job did 1.1 steps/s on two H200s where the driver's time slicing gave it 14.9.
    params = PolicyParams()
    policy = TimeSharePolicy(params, now=0)
    policy.set_quotas(0, {7: Quota(0, 1.0, 10), 8: Quota()})
    mine, other = frozenset({7}), frozenset({8})
    present = mine | other if job_here else mine
    barred = other if job_here else frozenset()
    busy = policy.step(0, Observation(mine, present=present, due=mine, pending=mine, barred=barred))
    assert busy.released == 7 and busy.quiet_rings == job_here
    quiet_at = 20 * MS
    seen = Observation(frozenset(), quiet_at, present=present, due=mine, barred=barred)
    assert policy.step(quiet_at + MS, seen).released == 7  # (within its pause)
    after = policy.step(quiet_at + params.gang_pause_ns + MS, seen)
    if job_here:
        assert after.released is None and after.draining == 7 and after.ready == other
    else:
        assert after.released == 7  # nobody waits for this GPU: no needless hold


def test_a_busy_group_in_its_turn_ends_it_for_a_spanning_group_a_whole_turn_behind_it() -> None:
    # 7 ran a second alone in its turn; 8, which spans GPUs too and of the same priority, starts to want
    # this GPU (barred, its turn waiting for 7's): 7 is held at once, a whole turn ahead of 8 in usage,
    # not at its slice's end (a service beside a data-parallel job waited 172 ms at p50).
    params = PolicyParams()
    policy = TimeSharePolicy(params, now=0)
    policy.set_quotas(0, {7: Quota(), 8: Quota()})
    mine, other, both = frozenset({7}), frozenset({8}), frozenset({7, 8})
    t = 0
    while t < SECOND + params.gang_slice_ns // 2:
        assert policy.step(t, Observation(mine, present=both, due=mine)).released == 7
        t += 10 * MS
    ended = policy.step(t, Observation(both, present=both, due=mine, barred=other))
    assert ended.released is None and ended.ready == other


def test_a_stranded_drain_ends_when_it_is_seen_stranded_uncharged_and_unlearnt() -> None:
    # 7 held while its turn closed, its work left here a collective waiting for peers held elsewhere:
    # charged until max_overrun_ns, a capped group's credit sank a second deep on a GPU nobody else wanted;
    # charged until the drain timeout, each GPU's credit sank as its ranks were stranded, and a gang's turn
    # waits for its lowest.
    policy = TimeSharePolicy(PolicyParams(), now=0)
    policy.set_quotas(0, {7: Quota(0, 0.3)})
    group = frozenset({7})
    timeout_before = policy.drain_timeout_ns()
    assert policy.step(0, Observation(group, present=group)).released == 7
    held = policy.step(10 * MS, Observation(group, present=group, barred=group))
    assert held.draining == 7  # its peers not yet done elsewhere: a drain as any
    charged = policy.usage(10 * MS)[7].gpu_seconds
    seen = policy.step(12 * MS, Observation(group, present=group, barred=group, stranded=group))
    assert seen.draining is None  # its peers held and done: no drain to wait for
    assert policy.usage(12 * MS)[7].gpu_seconds - charged <= 0.002  # charged to the moment it was seen
    later = policy.step(300 * MS, Observation(group, present=group, barred=group, stranded=group))
    assert later.draining is None and policy.usage(300 * MS)[7].gpu_seconds - charged <= 0.002
    assert policy.drain_timeout_ns() == timeout_before  # not learnt as a drain


def test_a_policy_decides_the_same_whichever_groups_are_stranded_but_its_drain_and_overruns() -> None:
    # The scheduler does not decide again where its report changed only which groups are stranded here,
    # none of them its drain or an overrun (scheduler._decides_the_same): the policy reads
    # `stranded` for nothing else. Checked at each phase: a decision at the same instant, with a barred
    # group stranded or not, is the same, and so is the next look's.
    params = PolicyParams()
    policy = TimeSharePolicy(params, now=0)
    policy.set_quotas(0, {7: Quota(), 8: Quota(0, 0.5), 9: Quota(0.2)})
    every = frozenset({7, 8, 9})
    looks = [(0, Observation(every, present=every, due=frozenset({7}), barred=frozenset({8, 9}))),
             (params.gang_slice_ns // 2, Observation(every, present=every, barred=every)),
             (params.gang_slice_ns // 2 + 5 * MS, Observation(every, present=every, barred=frozenset({7, 9}),
                                                              clearing=frozenset({8}), drained_at=1)),
             (params.gang_slice_ns, Observation(every, present=every, barred=frozenset({7, 9}), due=frozenset({8})))]
    phases = set()
    for now, obs in looks:
        decision = policy.step(now, obs)
        phases.add((decision.released, decision.draining))
        assert 9 not in policy.overrunning() and decision.draining != 9
        stranded = copy.deepcopy(policy)
        assert stranded.step(now, replace(obs, stranded=frozenset({9}))) == policy.step(now, obs)
        later = replace(obs, drained_at=None)
        assert stranded.step(now + MS, later) == policy.step(now + MS, later)
    assert {(7, None), (None, 7), (None, None), (8, None)} <= phases
    # Its own drain stranded is another decision: the drain ends, uncharged (the test reads `stranded`).
    held = TimeSharePolicy(params, now=0)
    held.set_quotas(0, {7: Quota(), 8: Quota()})
    both = frozenset({7, 8})
    held.step(0, Observation(both, present=both, due=frozenset({7}), barred=frozenset({8})))
    draining = held.step(MS, Observation(both, present=both, barred=both))
    assert draining.draining == 7
    assert copy.deepcopy(held).step(MS, Observation(both, present=both, barred=both, stranded=frozenset({7}))
                                    ).draining is None


def test_an_overrunning_drain_seen_stranded_is_charged_no_further() -> None:
    policy = TimeSharePolicy(PolicyParams(), now=0)
    policy.set_quotas(0, {7: Quota(0, 0.3), 5: Quota(0, 1.0)})
    seven, both = frozenset({7}), frozenset({5, 7})
    assert policy.step(0, Observation(seven, present=both)).released == 7
    assert policy.step(10 * MS, Observation(both, present=both, barred=seven)).draining == 7
    timeout = 10 * MS + policy.drain_timeout_ns() + MS
    # Past the timeout, its peers elsewhere not yet done: an overrun, charged while it runs.
    assert policy.step(timeout, Observation(both, present=both, barred=seven)).released == 5
    assert 7 in policy.overrunning()
    charged = policy.usage(timeout)[7].gpu_seconds
    policy.step(timeout + 20 * MS, Observation(both, present=both, barred=seven, stranded=seven))
    assert 7 not in policy.overrunning()
    policy.step(timeout + 500 * MS, Observation(both, present=both, barred=seven, stranded=seven))
    assert policy.usage(timeout + 500 * MS)[7].gpu_seconds - charged <= 0.021


def test_a_barred_group_draining_where_another_gpu_holds_it_done_is_stranded_there() -> None:
    seven, five = frozenset({7}), frozenset({5, 7})
    turns = GangTurns()
    turns.report(0, GpuReport(five, five, draining=7))
    turns.report(1, GpuReport(five, five, released=5))
    turns.report(2, GpuReport(five, five))
    assert [turns.view(gpu).stranded for gpu in (0, 1, 2)] == [seven, frozenset(), frozenset()]
    # Draining on two GPUs while held and done on the third: with more than two ranks, several wait for
    # that one at once (four ranks capped at 0.3: each such drain was charged, and past the drain timeout
    # charged up to a second, unseen as stranded; they did 0.06-0.33 of their solo on 4 simulated GPUs).
    turns.report(2, GpuReport(five, five, draining=7))
    assert [turns.view(gpu).stranded for gpu in (0, 1, 2)] == [seven, frozenset(), seven]
    turns.report(2, GpuReport(five, five, overrunning=seven))  # past its drain timeout there: the same
    assert [turns.view(gpu).stranded for gpu in (0, 1, 2)] == [seven, frozenset(), seven]
    turns.report(1, GpuReport(five, five, draining=7))  # draining on all its GPUs: its own work, no wait
    assert not any(turns.view(gpu).stranded for gpu in (0, 1, 2))
    turns.report(1, GpuReport(five, five, released=5))
    turns.report(2, GpuReport(five, five, released=7))  # released elsewhere: its peer runs
    assert not any(turns.view(gpu).stranded for gpu in (0, 1, 2))
    turns.report(2, GpuReport(five, five))
    assert turns.view(0).stranded == seven
    turns.report(0, GpuReport(five, five))  # its drain ended
    assert not turns.view(0).stranded


def test_the_stranded_views_follow_a_report_that_changes_only_what_overruns() -> None:
    """The views are worked out again only where a report changes what they read: a GPU whose group stops
    overrunning, and nothing else in its report changes, is no longer where it is stranded."""
    seven, five = frozenset({7}), frozenset({5, 7})
    turns = GangTurns()
    turns.report(0, GpuReport(five, five, draining=7))
    turns.report(1, GpuReport(five, five, released=5))
    turns.report(2, GpuReport(five, five, overrunning=seven))
    assert [turns.view(gpu).stranded for gpu in (0, 1, 2)] == [seven, frozenset(), seven]
    turns.report(2, GpuReport(five, five))  # its queued work finished there
    assert [turns.view(gpu).stranded for gpu in (0, 1, 2)] == [seven, frozenset(), frozenset()]
    turns.report(2, GpuReport(five, five, overrunning=seven, ready=five))
    assert turns.view(2).stranded == seven


def test_a_gpu_where_the_group_wants_nothing_does_not_hold_its_turn_back() -> None:
    # A rank blocked on the CPU (a barrier waiting for the held rank) wants nothing on its GPU.
    both = frozenset({7})
    turns = GangTurns()
    turns.report(1, GpuReport(both, frozenset(), ready=both))  # (it could release the group: credit)
    turns.report(0, GpuReport(both, both, ready=both))
    assert turns.open_turns() == {7: frozenset({0, 1})}


def capped_holder() -> tuple[TimeSharePolicy, frozenset[int], int]:
    """A policy in which group 0, capped at 0.3, holds the GPU and uncapped group 1 waits: the policy,
    the two groups, and the time of the look that released group 0."""
    policy = TimeSharePolicy(PolicyParams(), now=0)
    policy.set_quotas(0, {0: Quota(0, 0.3), 1: Quota()})
    busy = frozenset({0, 1})
    t = 0
    while policy.holder != 0:
        t = policy.step(t, Observation(busy, present=busy)).wake_at
    return policy, busy, t


def released_again(policy: TimeSharePolicy, busy: frozenset[int], resumed: int, decision: Decision) -> int | None:
    """After `decision` (the look at `resumed`), both groups busy and every drain over at once: when
    group 0, once held, is released again (None within 5 s)."""
    t, held = resumed, decision.released != 0
    while t < resumed + 5 * SECOND:
        t = max(t + TICK, decision.wake_at)
        decision = policy.step(t, Observation(busy, present=busy, drained_at=t))
        held = held or decision.released != 0
        if held and decision.released == 0:
            return t
    return None


def test_a_stall_of_the_agent_leaves_no_group_held_for_long() -> None:
    # The agent stopped (SIGSTOP) for 10 s while a capped group held the GPU: charged all of it, its
    # bucket would take 23 s to refill.
    policy, busy, t = capped_holder()
    resumed = t + 10 * SECOND
    decision = policy.step(resumed, Observation(busy, present=busy, drained_at=resumed))
    again = released_again(policy, busy, resumed, decision)
    assert again is not None and again - resumed < 1 * SECOND


def test_a_stall_that_began_while_the_holder_was_quiet_leaves_it_held_no_longer() -> None:
    # The same stall, the capped holder quiet at the last look before it (not being charged) and busy
    # through it: the look after the stall charges its burst after the fact, which sank its bucket the
    # stall deep (CI: a group capped at 0.3 made no progress in the 4 s after a 10 s stop).
    policy, busy, t = capped_holder()
    quiet_at = t + MS
    # (Nobody else wanting the GPU then: a quiet holder keeps it.)
    assert policy.step(quiet_at + MS, Observation(frozenset(), quiet_at, present=busy)).released == 0
    resumed = quiet_at + 10 * SECOND
    decision = policy.step(resumed, Observation(busy, present=busy, holder_burst_from=quiet_at + 2 * MS))
    again = released_again(policy, busy, resumed, decision)
    assert again is not None and again - resumed < 1 * SECOND
