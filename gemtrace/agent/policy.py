"""The time-share policy of one GPU: which group may launch now, and until when.

Pure logic: plain data in (the clock's `now`, which groups want the GPU, whether the group that holds
it went idle, when a held group finished draining), decisions out (the group released, when to look
again). It never touches the region, a clock or a thread; gemtrace/agent/scheduler.py is the adapter that
reads the gates' slots, turns them into an `Observation`, and writes the decision into the futex words.
Tests drive it with a fake clock (tests/test_policy.py).

The design (docs/scheduler.md says why, and what it measured) is a token in the spirit of Gemini's:
one group at a time is released on a GPU for a slice; at the slice's end it is held, and the next
group is released only after the held group's processes drained (or a drain timeout), so that each
interval of GPU time belongs to exactly one group and is charged to it, overrun included.

  - MaxUtil is a credit bucket per group (refilled at MaxUtil per second of wall time, spent by the
    GPU time charged): exact over the long run whatever the slice lengths, also for a group alone.
    A capped group alone waits for a full bucket (fewer holds); where every wanting group is capped
    and the caps fit in the GPU, the one whose bucket fills first goes first (its credit would be
    lost), and where they fill it, a group with credit for min_slice_ns runs rather than the GPU idle.
  - MinUtil is time owed (accrued at MinUtil while the group wants the GPU, spent by its GPU time):
    a waiting group owed enough for a long slice goes first, for a slice that pays the debt, and one
    owed a slice's accrual more goes before the holder's slice ends.
  - Priority orders the rest: a wanting group of a higher priority goes before every group of a
    lower one, and revokes a lower-priority holder at once (not at its slice's end), unless that
    holder is being paid its MinUtil debt. Caps still apply (a capped group is not eligible), and a
    lower-priority group still gets its MinUtil, as debt paid first. A request of the higher group
    waits for the holder's drain and for two looks: while outranked, the holder keeps at most a few
    ms queued (Decision.outranked), and the looks come when the gates ring (Decision.wake_on_wait:
    the request's thread blocks, then the drained holder's), not a poll later.
  - Opportunistic groups take no turn while a group that is not opportunistic is present on the GPU:
    they are released beside the holder (Decision.beside), and their gates keep a queue of a few
    kernels while production has work; with no production present they are scheduled as any group.
  - Among the wanting groups of the highest priority, the rest (unreserved, or reserved and unused)
    goes to the one with the least GPU time over a decayed window (max-min fairness):
    work-conserving, and the holder keeps the GPU without a needless switch while nobody else wants it.
  - Where a job spanning GPUs runs and nothing binds (no MinUtil, no MaxUtil, one priority, one process a
    group on the GPU), no turns: the groups are released together (Decision.shared) and the driver's time
    slicing shares the GPU, each charged the time it had work, shared out (`_sharing`; docs/scheduler.md,
    "Where nothing binds").

Cost: a step moves the accounts of the groups in play only (wanting the GPU, charged: the holder and
overrunning groups); a group out of play only decays and refills, brought up to date in one go when
next read; a running holder's early revoke looks for one eligible waiting group, not all of them.
So a look costs per group that wants the GPU, not per group scheduled (bench/bench_wake_cost.py measures
a look at the region's limit).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum

MS = 1_000_000  # ns
# Bucket capacities remembered for accounts out of play; at this many, every account is brought up
# to date and the list starts again (a look then costs per group scheduled, once in this many changes).
_MAX_CAPACITIES = 32


@dataclass(frozen=True)
class Quota:
    """A group's share of one GPU's time: at least `min_util` while it has work, at most `max_util`;
    beyond its MinUtil, a group of a higher `priority` goes before (and revokes) a lower one."""

    min_util: float = 0.0
    max_util: float = 1.0
    priority: int = 0
    # Takes what production groups leave: beside them, released with a queue of a few kernels
    # (Decision.beside), not a turn of the GPU's time; scheduled as any group where none is present.
    opportunistic: bool = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_util <= self.max_util <= 1.0:
            raise ValueError(
                f"quota needs 0 <= MinUtil <= MaxUtil <= 1, got {self.min_util}, {self.max_util}"
            )


@dataclass(frozen=True)
class GroupUsage:
    """What a group got on one GPU: GPU time charged to it, time it wanted the GPU but was held,
    and its share of the GPU's time over the decayed window (0..1)."""

    gpu_seconds: float
    throttled_seconds: float
    util_ratio: float


@dataclass(frozen=True)
class PolicyParams:
    """Times in ns. A slice lasts slice_ns, or drain_slices measured drains (a held group finishing
    its queued work) where that is longer, up to max_slice_ns: by default both are 60 ms, so the
    drains lengthen it only where slice_ns is set lower (tests do). min_slice_ns is the shortest slice
    that pays a MinUtil debt."""

    # Long against what each hold and release costs the released group's work beyond the time charged
    # (a few ms: its restart on a GPU gone idle), so that a share of time is that share of the work
    # (bench/results/models_torch.md compares 20 and 60 ms slices).
    slice_ns: int = 60 * MS
    min_slice_ns: int = 15 * MS
    max_slice_ns: int = 60 * MS
    # The longest slice that pays a MinUtil debt, and the most debt a group carries: a guaranteed group
    # beside hogs then runs in a few long slices, each costing it one restart (bench/results/models_torch.md
    # compares debts of at most 60 and 180 ms).
    max_owed_slice_ns: int = 180 * MS
    drain_slices: int = 4  # a slice lasts at least this many measured drains
    drain_timeout_ns: int = 50 * MS
    # A group whose drain outlasted the timeout is charged on until it finishes, at most this long
    # after it was held (a process that queued work and went off to CPU work reports no finish).
    max_overrun_ns: int = 1000 * MS
    window_ns: int = 1000 * MS  # time constant of the decayed usage (ordering, util_ratio)
    # Looking for a holder that is quiet (or outranked) becoming busy, or for a waiting group's credit,
    # while others wait.
    poll_ns: int = 4 * MS
    # A hog outranked by an idle service is looked at this often (the service's request rings). A busy
    # holder that others wait for is not polled at all: its gates ring the doorbell when their sync
    # leaves the group with nothing queued (Decision.quiet_rings), the look comes with that ring, and
    # the slice's end is the net for a ring that never came (a gate that predates the ring; the agent's
    # reaper rings for a process that exited busy): such a holder keeps the slice it could have used
    # anyway. A look after a sleep costs many times its work back to back (cold caches, a VM's idle
    # vCPU), so the looks that change nothing are what to remove: polled, the looks at a busy holder
    # were most of them (bench/results/agent_cpu.md).
    steady_poll_ns: int = 60 * MS
    # A drain of a holder that was quiet when held ends at once and may not ring: it is looked at once
    # more this soon (or an eighth of the measured drain, up to 1 ms).
    drain_poll_ns: int = 250_000
    # The gates ring when a held process's drain ends (hook/launch.c: its thread blocks on the hold,
    # or its own sync empties its queue while held), and the scheduler sleeps on the bell: a drain
    # needs no fine polling. Where another group waits for it, its timeout is its only net
    # (`_wake_draining`); where groups spanning GPUs are barred here and nobody waits, it is looked at
    # this often besides. A drain with a short queue lasts about GT_QUEUE_BOUND_NS and rings at its
    # end: a net of poll_ns fires before the ring in most drains of processes running 2 ms kernels.
    drain_net_ns: int = 16 * MS
    # A group's first launch rings too (it blocks on its held word): while nobody is released, or the
    # holder is alone on the GPU, the scheduler sleeps on the bell and looks anyway this often, a net
    # for a ring that never came (each look of an agent with no process at all costs CPU for nothing:
    # bench/results/agent_cpu.md).
    ring_net_ns: int = 250 * MS
    # A group owed less than this much wall time is not worth a switch.
    owed_min_ns: int = 1 * MS
    # A holder paid its MinUtil debt that goes quiet keeps the GPU this long (the CPU work between a
    # training loop's steps), then is revoked early as any quiet holder is.
    owed_pause_ns: int = 2 * MS
    # Two looks further apart than this mean the agent did not run (stopped, or starved of CPU): the
    # holder ran unwatched meanwhile, and a MaxUtil bucket charged all of it would hold its group for
    # many times the stall (a group capped at 0.3 after 10 s: 23 s). Its bucket starts again from empty.
    stall_ns: int = 2000 * MS
    # A group that spans GPUs (gemtrace/agent/gang.py) runs in turns this long, and a capped one waits for
    # the credit of a whole turn: each turn costs it a clearing on every GPU of it and a restart of all
    # its ranks at once (a step's worth of work: the ranks line up again at their next collective), so
    # it runs in fewer, longer turns.
    gang_slice_ns: int = 180 * MS
    # A group in its turn across GPUs that goes quiet keeps the GPU this long (its ranks' CPU work
    # between steps) before it is revoked early as any quiet holder is.
    gang_pause_ns: int = 5 * MS
    # Groups that nothing binds share a GPU where a job spanning GPUs runs under the driver's time slicing
    # (Decision.shared). Off: they take turns like any (the fake GPU of tests/test_policy.py, which models
    # turns only).
    share_unbound: bool = True


@dataclass(frozen=True)
class Observation:
    """What the adapter saw in the region at `now`.

    demand: groups that want the GPU (a thread waiting on its word, or launches that moved since the
        last look); the holder is in it while it is busy.
    holder_idle_since: the holder is quiet (nothing queued): when it last had work; None while it
        is busy.
    drained_at: while a held group drains: when its last process finished; None while not done.
    overrun_drained: groups whose drain outlasted the timeout (`TimeSharePolicy.overrunning`) and
        have since finished: when their last process did.
    present: groups with a live process that has launched on this GPU, wanting it now or not. While
        one of a higher priority than the holder's is present, the policy looks every poll for its
        next launch (it revokes the holder then) instead of once a slice.
    holder_burst_from: the quiet holder ran a burst since the last look (it launched, and drained
        at holder_idle_since): when that burst opened. The time between is charged to it, also
        where no look saw it busy (a service's request shorter than a poll). None: no such burst.
        Of a busy holder: when its open burst opened (it ran since then, before this look saw it).
    holder_burst_ns: the length of every burst the holder closed since the last look (the gates'
        busy_ns): where several ran between two looks, holder_burst_from tells only of the last one.
    barred: groups that span several GPUs and whose turn is not open (gemtrace/agent/gang.py): never
        released here, and never a reason to hold the holder; the policy says in `Decision.ready` which
        of them it would release now.
    clearing: groups whose turn across GPUs opens: the holder is held (unless paid its MinUtil debt)
        and nobody is released, so that the turn starts on all its GPUs at once (`Decision.clear`).
    due: groups that span several GPUs and whose turn is open: released here as soon as they want the
        GPU, before any other group, unless the holder is being paid its MinUtil debt.
    pending: the due groups not yet released here in this turn: they count as wanting the GPU while
        present, so that every GPU of the group releases it at the turn's start (a process of it may be
        busy without asking: blocked in a collective that waits for its peers on the other GPUs).
    stranded: barred groups draining here (held, or overrunning) while on another of their GPUs they are
        held and done: what is left here may be a collective that waits for that process (one that began
        its next step before the hold), which only the group's next turn ends: the drain ends when seen,
        charged no further, or its MaxUtil bucket would hold that turn off (_step_draining).
    crowded: groups with more than one live process on this GPU (the driver slices its time by process,
        not by group: such a group takes turns, `_sharable`).
    spanning: groups with a job here that spans GPUs, in gang turns or not (gang.py): where one is, and
        nothing binds, the GPU is shared (`_sharable`).
    shared_busy: of the groups released together at the last look (Decision.shared), how long each had
        work queued since then (ns, the gates' bursts): what their time is charged by.
    """

    demand: frozenset[int] = frozenset()
    holder_idle_since: int | None = None
    drained_at: int | None = None
    overrun_drained: Mapping[int, int] = field(default_factory=dict)
    present: frozenset[int] = frozenset()
    holder_burst_from: int | None = None
    holder_burst_ns: int = 0
    barred: frozenset[int] = frozenset()
    clearing: frozenset[int] = frozenset()
    due: frozenset[int] = frozenset()
    pending: frozenset[int] = frozenset()
    stranded: frozenset[int] = frozenset()
    crowded: frozenset[int] = frozenset()
    shared_busy: Mapping[int, int] = field(default_factory=dict)
    spanning: frozenset[int] = frozenset()


@dataclass(frozen=True)
class Decision:
    released: int | None  # the one group whose launches may proceed on this GPU (None: all held)
    draining: int | None  # the group just held that is finishing its queued work
    wake_at: int  # look again no later than this (ns, the policy's clock)
    # The released group is to keep its queue short (GT_RELEASED_SHORT_QUEUE): a hold is coming,
    # because another group wants the GPU, the released group has a MaxUtil below 1, or a group of a
    # higher priority is present (its next launch revokes the holder, whose drain it then waits for).
    short_queue: bool = False
    # The short queue is the outranked one (GT_RELEASED_OUTRANKED, a few ms at most): a group of a
    # higher priority than the released one's is present, its next request revokes the holder and
    # then waits for the holder's drain, the bulk of that request's added latency.
    outranked: bool = False
    # Look again as soon as a thread starts waiting on a held word (the gates ring the GPU's
    # doorbell), not only at wake_at: where such a wait is news that the policy acts on at once (a
    # group that outranks the holder asks for the GPU; the held group finished draining while
    # another waits; a group's first launch while nobody holds the GPU).
    wake_on_wait: bool = False
    # The barred groups (Observation.barred) this GPU would release now if their turn were open: each
    # would be this GPU's choice beside the holder and every group it may release.
    ready: frozenset[int] = frozenset()
    # Nobody is released or draining here but the clearing group itself: a turn that is clearing
    # (Observation.clearing) may start.
    clear: bool = False
    # Opportunistic groups released beside the production groups present on this GPU (their queue
    # kept to a few kernels while production has work: GT_RELEASED_BESIDE); none of them holds a turn.
    beside: frozenset[int] = frozenset()
    # The released group's gates are to ring the doorbell when their sync leaves the group with nothing
    # queued (control.ring_quiet): it is busy and another group waits, so its going quiet is news that
    # the policy acts on at once (it revokes the holder early). The scheduler sleeps on the bell for
    # that ring alone (other rings bring a look only where wake_on_wait says so), with wake_at (the
    # slice's end at the latest) as the net, not a poll every poll_ns.
    quiet_rings: bool = False
    # The groups released together, none holding a turn: a job spanning GPUs runs here and nothing any of them
    # has binds (no MinUtil, no MaxUtil, one priority, one process each here), so the driver's own time slicing
    # shares the GPU among them (`TimeSharePolicy._sharing`; each keeps the long queue of a group alone:
    # GpuScheduler says why).
    shared: frozenset[int] = frozenset()
    # By this GPU's own groups, it would share, were a job spanning GPUs here (`_sharable`): reported to the
    # turns across GPUs (gang.py), where a group spanning GPUs shares only where every GPU of it would. (A
    # gang is such a job on each of its GPUs: the GPUs need not have seen it yet, or its first look would
    # open a turn.)
    sharable: bool = False


class Phase(Enum):
    IDLE = "idle"  # nobody released
    RUNNING = "running"  # one group released
    DRAINING = "draining"  # the last holder held, its queued work finishing
    SHARED = "shared"  # several groups released together (Decision.shared), none holding a turn


@dataclass
class _Account:
    quota: Quota
    gpu_ns: float = 0.0
    throttled_ns: float = 0.0
    usage: float = 0.0  # decayed GPU time, ns
    cap_credit: float = 0.0  # MaxUtil bucket, ns of GPU time it may still use
    owed: float = 0.0  # MinUtil debt, ns of GPU time it is owed
    last_run: int = -1  # when it was last released, for round-robin among equals
    # The figures above are as of `at` (ns): a group that is neither charged nor the holder is brought
    # up to date only when it is next read (TimeSharePolicy._account); `era`: how many past bucket
    # capacities there were then; `wanting`: whether it wanted the GPU since `at` (its MinUtil debt
    # and its time held back grow meanwhile).
    at: int = 0
    era: int = 0
    wanting: bool = False


@dataclass
class TimeSharePolicy:
    """The scheduling decisions for one GPU. Call `step` whenever the adapter looks at the region,
    and at the latest at the returned `wake_at`."""

    params: PolicyParams = field(default_factory=PolicyParams)
    now: int = 0

    def __post_init__(self) -> None:
        self._accounts: dict[int, _Account] = {}
        self._phase = Phase.IDLE
        self._holder: int | None = None
        self._released_at = 0
        self._slice_end = 0
        self._hold_at = 0
        self._held_in_turn = False  # the group draining was held in its turn across GPUs (this GPU ended it)
        self._charging = False  # the holder is charged for the time passing
        self._holder_idle_since: int | None = None  # the running holder quiet since (at the last look)
        self._busy_look = 0  # the last look that saw the running holder busy
        self._demand: frozenset[int] = frozenset()
        # The MaxUtils of the groups in _demand added up (`_caps_fill_gpu`), kept until the demand or the
        # quotas change: 63 groups summed at every look otherwise.
        self._demand_caps: float | None = None
        self._decay_of = (0, 1.0)  # (elapsed ns, the usage's decay over it): `_settle`'s last
        # Observation.present as seen (unscheduled groups included: only _outranked_present reads it,
        # and only where some group outranks the holder).
        self._present: frozenset[int] = frozenset()
        self._drain_ns = 0.0  # decayed mean of measured drains (_measured_drain)
        self._slice_ns = self._slice_of_drains()  # slice_ns(), kept as the drains move it
        self._window_weight = 0.0  # decayed wall time, the denominator of util_ratio
        self._last = self.now
        self._looked = self.now  # the last step's time
        # Groups whose drain outlasted the timeout while another group waited: that group was
        # released, but their queued work still runs (beside it) and is charged to them until they
        # finish (group -> when they were held). Without this, a process that syncs rarely (hundreds
        # of ms of kernels queued) ran most of its work uncharged: MaxUtil 0.5 alone gave 0.9.
        self._overrun: dict[int, int] = {}
        # Groups that span several GPUs (gemtrace/agent/gang.py): barred while their turn is closed, due while
        # it is open; ready: the barred ones this GPU chose at its last choice (Decision.ready).
        self._barred: frozenset[int] = frozenset()
        self._clearing: frozenset[int] = frozenset()
        self._stranded: frozenset[int] = frozenset()
        self._due: frozenset[int] = frozenset()
        self._ready: frozenset[int] = frozenset()
        # barred | clearing | due, made once a look: `_turn_ns` asks it of every group, 46 times a look
        # at the region's limit.
        self._spanning: frozenset[int] = frozenset()
        self._top_priority = 0  # the highest priority scheduled: a holder of it is never outranked
        # This look follows a stall (stall_ns): what it charges a bucket leaves it empty at worst.
        self._after_stall = False
        self._guaranteed: frozenset[int] = frozenset()  # the groups with a MinUtil
        self._shared: frozenset[int] = frozenset()  # the groups released together (Phase.SHARED)
        self._shared_ns = 0  # time spent in Phase.SHARED (shared_seconds)
        self._opportunistic: frozenset[int] = frozenset()  # the groups with Opportunistic = yes
        # The MaxUtil buckets' capacity (_cap_capacity) at each change since every account was last
        # brought up to date: (until when, capacity) for the past ones, and the one in force.
        self._capacities: list[tuple[int, float]] = []
        self._capacity = self._cap_capacity()

    # -- configuration -------------------------------------------------------------------------

    def set_quotas(self, now: int, quotas: Mapping[int, Quota]) -> None:
        self._advance(now)
        self._settle_all()  # a group's past time counts under its past quota
        for group in list(self._accounts):
            if group not in quotas:
                del self._accounts[group]
                self._overrun.pop(group, None)
                if group == self._holder:
                    # An unscheduled group launches freely (the adapter releases its word); nothing
                    # to drain that would belong to anyone else's account.
                    self._phase, self._holder, self._charging = Phase.IDLE, None, False
        for group, quota in quotas.items():
            account = self._accounts.get(group)
            if account is None:
                self._accounts[group] = _Account(quota, cap_credit=self._cap_capacity(), at=self._last,
                                                 wanting=group in self._demand)
            else:
                account.quota = quota
        self._demand_caps = None
        self._top_priority = max((quota.priority for quota in quotas.values()), default=0)
        self._guaranteed = frozenset(group for group, quota in quotas.items() if quota.min_util > 0.0)
        self._opportunistic = frozenset(group for group, quota in quotas.items() if quota.opportunistic)

    def quotas(self) -> dict[int, Quota]:
        return {group: account.quota for group, account in self._accounts.items()}

    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def holder(self) -> int | None:
        return self._holder

    def overrunning(self) -> dict[int, int]:
        """Groups still finishing work queued before they were held, past the drain timeout: when
        each was held (the adapter reports in `Observation.overrun_drained` when they are done)."""
        return dict(self._overrun)

    def drain_timeout_ns(self) -> int:
        """How long a held group may drain before the next is released beside it: the configured
        timeout, or twice the measured drains where they are longer (a process that queues hundreds
        of ms of kernels between syncs), up to max_overrun_ns."""
        p = self.params
        timeout = max(p.drain_timeout_ns, min(p.max_overrun_ns, 2 * self._drain_ns))
        return int(timeout)

    def slice_ns(self) -> int:
        return self._slice_ns

    def _measured_drain(self, drain: float) -> None:
        """A drain's length joins the decayed mean of drains, and the slice follows it."""
        self._drain_ns = 0.75 * self._drain_ns + 0.25 * drain
        self._slice_ns = self._slice_of_drains()

    def _slice_of_drains(self) -> int:
        p = self.params
        return int(min(p.max_slice_ns, max(p.slice_ns, p.drain_slices * self._drain_ns)))

    # -- the decision ----------------------------------------------------------------------------

    def step(self, now: int, obs: Observation) -> Decision:
        self._advance(now)
        beside = self._beside(obs)
        if beside:
            obs = self._without_beside(obs, beside)
        demand = obs.demand | (obs.pending & obs.present) if obs.pending else obs.demand
        self._set_demand(frozenset(demand & self._accounts.keys()))
        self._present = obs.present
        self._barred, self._clearing, self._due = obs.barred, obs.clearing, obs.due
        self._spanning = obs.barred | obs.clearing | obs.due
        self._stranded = obs.stranded
        for group in [g for g in self._overrun if g in obs.stranded]:
            del self._overrun[group]  # its work left waits for its peers' next turn: charged no further
        for group, drained in obs.overrun_drained.items():
            hold_at = self._overrun.pop(group, None)
            if hold_at is not None:
                end = max(min(drained, now), hold_at)
                self._refund(group, now - end)
                # Learn how long drains really take: the next one is given that long (see
                # drain_timeout) before another group runs beside it.
                self._measured_drain(end - hold_at)
        for group, hold_at in list(self._overrun.items()):
            if now - hold_at >= self.params.max_overrun_ns:
                del self._overrun[group]
                self._refund(group, now - (hold_at + self.params.max_overrun_ns))
        self._ready = (self._gang_readiness(now, obs.holder_idle_since) if self._barred or self._clearing
                       else frozenset())
        here = frozenset(obs.present & self._accounts.keys())  # (the processes the driver slices among)
        sharable = self._sharable(here, obs.crowded)
        shared = self._sharing(here, obs.spanning) if sharable else frozenset()
        if shared:
            self._share(now, shared, obs)
        elif self._phase is Phase.SHARED:
            self._end_sharing(now)
        if self._phase is Phase.RUNNING:
            self._step_running(now, obs)
        if self._phase is Phase.DRAINING:
            self._step_draining(now, obs)
        if self._phase is Phase.IDLE:
            self._step_idle(now)
        self._looked = now  # (the gates' figures at the next look tell of the time since)
        released = self._holder if self._phase is Phase.RUNNING else None
        outranked = released is not None and self._outranked_present(released) and not self._is_owed(released)
        quiet_rings = self._quiet_rings()
        return Decision(released, self._holder if self._phase is Phase.DRAINING else None, self._wake_at(now),
                        released is not None and self._hold_coming(released), outranked,
                        self._wake_on_wait(now, outranked), self._ready,
                        self._clear(released), beside, quiet_rings, self._shared, sharable)

    def _clear(self, released: int | None) -> bool:
        """Decision.clear: nobody's work runs here but the clearing group's own (released, or draining
        after a hold while its turn was closed), so a turn across GPUs may start."""
        if self._phase is Phase.IDLE:
            return True
        return (released if released is not None else self._holder) in self._clearing

    # -- production and opportunistic groups ----------------------------------------------------

    def _beside(self, obs: Observation) -> frozenset[int]:
        """The opportunistic groups to release beside production: all of them, while a group that is
        not opportunistic is present on this GPU (a live process of it launched here), else none. An
        opportunistic holder goes beside at once, with no drain: its gate bounds its queue by the next
        launch, and what it has queued runs beside the production group's first request."""
        opportunistic = self._opportunistic
        if not opportunistic or not any(g in self._accounts and g not in opportunistic for g in obs.present):
            return frozenset()
        for group in opportunistic:
            self._overrun.pop(group, None)
        return opportunistic

    def _without_beside(self, obs: Observation, beside: frozenset[int]) -> Observation:
        """The observation with the groups beside production taken out: they want no turn. An
        opportunistic holder (or draining group) is let go here, with what the look saw of its end."""
        obs = dataclasses.replace(
            obs, demand=obs.demand - beside, present=obs.present - beside,
            overrun_drained={g: t for g, t in obs.overrun_drained.items() if g not in beside},
            barred=obs.barred - beside, clearing=obs.clearing - beside, due=obs.due - beside,
            pending=obs.pending - beside, stranded=obs.stranded - beside)
        if self._holder not in beside:
            return obs
        # (Charged up to now by _advance; from now on its time is not a turn.)
        self._phase, self._holder, self._charging = Phase.IDLE, None, False
        return dataclasses.replace(obs, holder_idle_since=None, drained_at=None, holder_burst_from=None,
                                   holder_burst_ns=0)

    # -- groups that nothing binds: the driver's own time slicing ---------------------------------

    def _sharable(self, groups: frozenset[int], crowded: frozenset[int]) -> bool:
        """Would this GPU's groups (`groups`: those present here) share it (no turns), by this GPU alone, were a
        job spanning GPUs among them (`_sharing` asks that of Observation.spanning)? Where one runs here and every
        group present here has no MinUtil, no MaxUtil, the same priority as the others and one process here:
        then no rule of this policy tells them apart, and the driver's time slicing (by process) gives each
        what turns would, and more: it runs the others' kernels while the job's collective waits for its peers
        on other GPUs, time that exclusive turns leave to the spinning collective. A job over two H200s beside
        single-GPU jobs, none with a quota, did 0.42-0.56 of its solo work in turns and 0.64-0.66 under the
        driver's slicing (bench/results/gang_ddp.md). Groups that all live on this GPU alone keep turns: two
        ResNet-50 trainings did 0.91-0.92 of one solo together under the driver's finer slicing against
        0.95-0.98 in turns (bench/results/colocation.md, 2026-12-07), and turns' fairness evens out a loop that
        pauses. A group spanning GPUs shares only where each of its GPUs would (gang.py: it is barred or due
        here otherwise, `_sharing`). Opportunistic groups with no production group here take turns: their
        word keeps the beside bound, so that a production process's first request waits for half a
        millisecond of their work, not for a shared group's long queue."""
        if not groups or not self.params.share_unbound or crowded & groups:
            return False
        priority = None
        for group in groups:
            quota = self._accounts[group].quota
            if (quota.min_util > 0.0 or quota.max_util < 1.0 or quota.opportunistic
                    or priority not in (None, quota.priority)):
                return False
            priority = quota.priority
        return True

    def _sharing(self, groups: frozenset[int], spanning: frozenset[int]) -> frozenset[int]:
        """The groups to release together on this sharable GPU: those present here (`groups`), where two or
        more are, a job spanning GPUs is among them (`spanning`), and none of them is in a turn across GPUs
        (a group spanning GPUs one of which would not share takes its turns, and the others here take
        theirs); else none (groups of this GPU alone take turns; a group alone runs as the holder, with the
        long queue)."""
        if len(groups) < 2 or not groups & spanning or groups & self._spanning:
            return frozenset()
        return groups

    def _share(self, now: int, shared: frozenset[int], obs: Observation) -> None:
        """Release `shared` together. Coming from turns, the holder and a draining or overrunning group
        simply go on (nothing of theirs waits for a drain). Each is charged its share of the time since
        the last look: how long it had work queued, scaled so that the shares add up to that time at
        most (the driver gives each busy process its time slices in turn)."""
        if self._phase is Phase.SHARED:
            busy = {g: min(ns, now - self._looked) for g, ns in obs.shared_busy.items() if g in self._shared}
            total = sum(busy.values())
            scale = min(1.0, (now - self._looked) / total) if total > 0 else 0.0
            for group, ns in busy.items():
                self._charge(group, ns * scale)
        for group in shared:
            self._overrun.pop(group, None)
        self._phase, self._holder, self._charging = Phase.SHARED, None, False
        self._shared = shared

    def _end_sharing(self, now: int) -> None:
        """The groups released together take turns again: each is held now and, like a drain that timed
        out, charged what it still has queued until its gates report it finished, while
        `_step_idle` releases the group the rules choose (that one goes on, no drain)."""
        for group in self._shared:
            if group in self._accounts:
                self._overrun[group] = now
        self._shared = frozenset()
        self._phase = Phase.IDLE

    # -- groups that span several GPUs -----------------------------------------------------------

    def _gang_readiness(self, now: int, holder_idle_since: int | None) -> frozenset[int]:
        """The barred groups this GPU would release now if their turn were open: each wanting barred
        group that `_choose` picks beside the holder and every group it may release (MinUtil debts,
        priorities, MaxUtil credit and fairness decide, as for any group). A holder keeps the GPU for
        min_slice_ns first, so that turns opening do not cut it shorter. A turn opens only where every
        GPU on which the group wants time consents: no GPU gives a group spanning GPUs more than its
        own rules would, and none keeps it waiting for a slice's end that another GPU does not share."""
        if self._clearing:
            # Still consenting while the turn clears: it starts on every GPU of it, each with the credit.
            return frozenset(g for g in self._clearing if self._eligible(g, now) or g == self._holder
                             and self._phase is Phase.RUNNING and self._may_continue(g))
        # A group present here that asks for nothing may still be busy (blocked in a collective that
        # waits for its peers): this GPU consents where it could release it (its MaxUtil credit).
        idle = frozenset(self._barred_eligible((self._barred & self._present) - self._demand))
        holder = self._holder
        if (self._phase is Phase.RUNNING and holder is not None and holder not in self._barred
                and now - self._released_at < self.params.min_slice_ns
                and (holder_idle_since is None
                     or now - holder_idle_since < max(self._quiet_allowance(holder), self.params.gang_pause_ns))):
            # (Not a holder quiet past the pause it keeps, and past the pause that weighs it as busy
            # (`_paused_holder`): it has nothing to run in the rest of its first 15 ms, and a service's
            # turn across GPUs kept them 7 ms idle at each request.) Those of the last readiness that
            # still want it and are eligible: only they are weighed, not the 62 barred groups of the
            # region's limit at every GPU's release of a turn.
            return idle | frozenset(self._barred_eligible(self._ready & self._barred & self._demand))
        wanting = self._barred_eligible(self._barred & self._demand)
        if not wanting:
            return idle
        return idle | self._chosen_if_admitted(now, wanting, self._paused_holder(now, holder_idle_since))

    def _barred_eligible(self, groups: Iterable[int]) -> list[int]:
        """Those of `groups` (barred) that `_eligible` would let go if their turn were open (gang_ok), in
        their order: one loop where a look at the region's limit made 62 calls through `_eligible` and
        `_credit_to_release` (a barred group's credit is always a turn's: `_turn_ns`)."""
        accounts, last = self._accounts, self._last
        turn = self._gang_turn_ns()
        eligible = []
        for group in groups:
            account = accounts[group]
            max_util = account.quota.max_util
            if max_util < 1.0:
                if max_util <= 0.0:
                    continue
                if account.at < last:
                    self._settle(account, last)
                if account.cap_credit < turn * (1.0 - max_util):
                    continue
            eligible.append(group)
        return eligible

    def _due_waits(self, holder: int, now: int) -> bool:
        """Does a group whose turn across GPUs is open want this GPU, held by another group that is
        not being paid its MinUtil debt? Then the holder is held at once: the group's processes on its
        other GPUs are running, and a collective among them waits for this one."""
        return (not self._is_owed(holder)
                and any(g != holder and g in self._demand and self._eligible(g, now) for g in self._due))

    def _set_demand(self, demand: frozenset[int]) -> None:
        """The groups that want the GPU from this look on: those that start or stop wanting it are
        brought up to date first (their debt and time held back grew until now, or did not)."""
        changed = demand.symmetric_difference(self._demand)
        for group in changed:
            account = self._accounts.get(group)
            if account is not None:
                self._settle(account, self._last).wanting = group in demand
        if changed:
            self._demand_caps = None
        self._demand = demand

    def _wake_on_wait(self, now: int, outranked: bool) -> bool:
        if self._phase is Phase.DRAINING:
            return self._someone_waits(now)
        return (outranked or self._phase in (Phase.IDLE, Phase.SHARED) or self._holder_alone()
                or self._guarantee_unseen())

    def _guarantee_unseen(self) -> bool:
        """Is a group with a MinUtil present on this GPU but not wanting it now? Its debt accrues from
        the look that sees it want the GPU, and a training loop held at its slice's end often drains to
        its step's sync and only blocks on its word after the step's CPU work: that wait is to be seen
        at once (it rings), not a holder's slice later, or the debt falls short by the hogs' slices
        (bench/results/models_torch.md)."""
        return any(g in self._present and g not in self._demand for g in self._guaranteed)

    def _quiet_rings(self) -> bool:
        """Is the released group's going quiet news to wait for on the doorbell (Decision.quiet_rings)?
        While it is busy (charged) and another group wants the GPU (or waits for its turn here:
        `_turn_waiting`), with none of a higher priority present (an outranked holder is polled: the
        request of the higher priority rings anyway, and the holder is revoked then, quiet or not)."""
        holder = self._holder
        return (self._phase is Phase.RUNNING and holder is not None and self._charging
                and (any(g != holder for g in self._demand) or bool(self._turn_waiting(holder)))
                and not self._outranked_present(holder))

    def _holder_alone(self) -> bool:
        """Is the released group the only one that wants the GPU, with none of a higher priority
        present? Then a thread that starts waiting on a held word is news: another group wants it."""
        holder = self._holder
        return (self._phase is Phase.RUNNING and holder is not None and self._demand <= {holder}
                and not self._outranked_present(holder))

    def _hold_coming(self, holder: int) -> bool:
        return (self._accounts[holder].quota.max_util < 1.0 or any(g != holder for g in self._demand)
                or self._outranked_present(holder))

    def _priority(self, group: int) -> int:
        return self._accounts[group].quota.priority

    def _outranked_present(self, holder: int) -> bool:
        """Is a group of a higher priority than the holder's present (or wanting the GPU)? Its next
        launch revokes the holder: look every poll, and keep the holder's queue short."""
        mine = self._priority(holder)
        if mine >= self._top_priority:
            return False  # the common case (one priority for all), whatever the number of groups
        return any(g in self._accounts and self._priority(g) > mine for g in self._present | self._demand)

    def _preempted(self, holder: int, now: int) -> bool:
        """Does a group of a higher priority than the holder's want the GPU, and may it run (under
        its MaxUtil)? A holder paid its MinUtil debt keeps the GPU until the debt is paid: priority
        orders only what the guarantees leave."""
        if self._is_owed(holder):
            return False
        if self._deep_debt(now):
            return True
        mine = self._priority(holder)
        if mine >= self._top_priority:
            return False
        if any(self._priority(g) > mine for g in self._turn_wanted(holder)):
            return True
        return any(self._priority(g) > mine and self._eligible(g, now) for g in self._demand)

    def _turn_overtaken(self, holder: int, now: int) -> bool:
        """Is the holder in its turn across GPUs, past min_slice_ns, and another such group of its
        priority that wants this GPU (`_turn_wanted`) a whole turn behind it in usage? Then the holder's
        turn ends now, as `_overtaken` ends a slice: a service spread over two simulated GPUs beside a
        data-parallel job of the same priority waited the job's whole 180 ms turn at every request (p50
        172 ms, an eighth of its requests). Two busy jobs stay within a turn of each other and keep
        their whole turns."""
        if holder not in self._due or now - self._released_at < self.params.min_slice_ns:
            return False
        mine, lead = self._priority(holder), self._account(holder).usage - self.params.gang_slice_ns
        return any(self._priority(g) == mine and self._account(g).usage < lead for g in self._turn_wanted(holder))

    def _turn_wanted(self, holder: int) -> frozenset[int]:
        """The groups spanning GPUs that want this GPU and that it would release now (Decision.ready)
        while the holder is in its own turn across GPUs. Another such group's turn can open only when
        the holder's has ended on every GPU of both: neither a quiet holder's revocation nor a higher
        priority's preemption, which count eligible groups only, sees them, and the holder's turn ran
        its whole 180 ms: two services over the same two simulated GPUs, each busy 15% of the time,
        waited 180 ms for each other at p99, and a service at Priority 10 beside a data-parallel job
        1.3 s."""
        if holder not in self._due:
            return frozenset()
        return (self._ready & self._demand) - {holder}

    def _turn_waiting(self, holder: int) -> frozenset[int]:
        """`_turn_wanted`, and the groups spanning GPUs present here that this GPU would release now
        without their asking: a rank that waits in a sync for its collective, which waits for its peer
        held on another GPU, asks for nothing here, and its group's turn waits for this GPU too. A quiet
        holder in its own turn is revoked for them as for a group that asks, and its gates ring when it
        goes quiet. Traced on two H200s: a service at Priority 10 went quiet after each request on both
        GPUs; the GPU where a data-parallel job asked was revoked 5 ms later, but the other, where the
        job's rank waited in its sync, looked only at its slice's end (180 ms): the service's turn stayed
        open there, its next request came first, and the job did 1.1 steps/s (14.9 without gemtrace)."""
        if holder not in self._due:
            return frozenset()
        return (self._ready & (self._demand | self._present)) - {holder}

    def _overtaken(self, holder: int, now: int) -> bool:
        """Has a group of the holder's priority that waits fallen a slice behind it in usage, the holder
        having run min_slice_ns? Then the holder's slice ends now. Why: a loop that pauses between its
        steps is revoked at each pause (the GPU goes to whoever wants it), and waiting out the other's
        whole slice each time, it got 0.29 of the GPU beside a hog that never pauses, whatever its
        pause (2-12 ms, 25 ms steps, on the fake GPU). Ordering alone cannot mend it: the loop is chosen
        at every slice's end already. Not a turn across GPUs (its end is every GPU's), nor a holder
        paid its MinUtil debt, nor among groups whose caps fit the GPU (their buckets order them)."""
        return self._overtaken_at(holder, now) <= now

    def _overtaken_at(self, holder: int, now: int) -> float:
        """When `_overtaken` comes true if the holder keeps running (charged all along) and nothing
        else changes; math.inf where it cannot. The holder's usage grows towards window_ns and the
        waiting group's decays, both by the window's exponential, as `_advance` moves them."""
        p = self.params
        if (holder in self._due or self._is_owed(holder) or self._caps_within_gpu()
                or not any(g != holder for g in self._demand)):
            return math.inf
        mine = self._priority(holder)
        behind = [self._account(g).usage for g in self._demand
                  if g != holder and self._priority(g) == mine and self._eligible(g, now)]
        if not behind:
            return math.inf
        lead = self._account(holder).usage - min(behind)  # as of now (the holder is in play: moved to now)
        window, gap = float(p.window_ns), float(self.slice_ns())
        if lead > gap:
            at = float(now)
        elif not self._charging or gap >= window:
            return math.inf
        else:
            # lead(t) = window - (window - lead) * exp(-t / window), charged all along
            at = now + math.ceil(window * math.log((window - lead) / (window - gap)))
        return max(at, float(self._released_at + p.min_slice_ns))

    def _deep_debt(self, now: int) -> bool:
        """Is a waiting group owed a slice's accrual more than the debt that sends it first
        (`_long_slice_debt`)? Then it goes before the holder's slice ends: it would have gone first
        at the last slice's end. A training loop that pauses longer than owed_pause_ns between steps is
        revoked at each pause, and waiting out each other group's slice, it paid one step of its debt
        per slice while the rest ran into the bound (5 ms of CPU a step, MinUtil 0.6 beside two hogs
        on the fake GPU: 0.33 of the GPU)."""
        return any(g != self._holder and self._eligible(g, now) and self._account(g).owed >= self._deep_debt_owed(g)
                   for g in self._demand & self._guaranteed)

    def _deep_debt_owed(self, group: int) -> float:
        """The debt that sends a waiting group before the holder's slice ends (`_deep_debt`)."""
        return self._long_slice_debt(group) + self._accounts[group].quota.min_util * self.slice_ns()

    def _step_running(self, now: int, obs: Observation) -> None:
        holder = self._holder
        assert holder is not None
        # The gates' figures since the last look, where the holder was charged all along: the time it
        # idled between bursts was not GPU time. (A look a slice apart sees a service's requests now
        # and then: a batch-1 service alone was charged 0.5 of the GPU for the 0.08 it used.)
        since = max(self._looked, self._released_at)
        self._holder_idle_since = obs.holder_idle_since
        if obs.holder_idle_since is not None:
            if self._charging:
                # It ran out of work at holder_idle_since: the time since was not GPU time; nor were
                # the gaps between the bursts it closed before. Never before the last look that saw it
                # busy: a holder whose processes all exited has no drain time to tell (0), and refunded
                # from its release, a group that held the GPU alone for minutes lost them all, its
                # GPU-seconds counter going backwards.
                end = max(obs.holder_idle_since, self._released_at, self._busy_look)
                gaps = max(0, end - since - obs.holder_burst_ns) if obs.holder_burst_ns else 0
                self._refund(holder, now - end + gaps)
                self._charging = False
            elif obs.holder_burst_from is not None:
                # Quiet at the last look and at this one, busy in between: charge what it ran, every
                # burst of it, but never more than the time since the last look.
                last = obs.holder_idle_since - max(obs.holder_burst_from, self._released_at)
                self._charge(holder, min(max(last, obs.holder_burst_ns), now - since))
        elif obs.holder_burst_from is not None:
            # Busy: it has run since its open burst opened (charged from there, not from this look),
            # and the bursts it closed since the last look.
            ran = obs.holder_burst_ns + now - max(obs.holder_burst_from, since)
            if not self._charging:
                self._charge(holder, min(ran, now - since))
            elif obs.holder_burst_ns and ran < now - since:
                self._refund(holder, now - since - ran)  # it idled between bursts since the last look
            self._charging, self._busy_look = True, now
        else:
            self._charging, self._busy_look = True, now  # busy again (seen at this look: at most a poll late)
        if not self._may_continue(holder) or holder in self._barred:
            self._hold(now)  # (barred: its turn across GPUs closed on another of them)
        elif self._clearing and holder not in self._clearing and not self._is_owed(holder):
            self._hold(now)  # a turn across GPUs starts here and on its other GPUs together
        elif self._due and self._due_waits(holder, now):
            self._hold(now)
        elif (obs.holder_idle_since is not None and not self._kept_pause(holder, now)
              and (any(g != holder and self._eligible(g, now) for g in self._demand) or self._turn_waiting(holder))):
            self._hold(now)  # revoke early: it does not use its slice, someone else wants the GPU
        elif self._preempted(holder, now):
            self._hold(now)  # revoke at once: a group of a higher priority wants the GPU
        elif self._turn_overtaken(holder, now):
            self._hold(now)  # a group spanning GPUs that waits is a whole turn behind the holder's
        elif self._overtaken(holder, now):
            self._hold(now)  # a waiting group fell a slice behind the holder: its turn now, not at the slice's end
        elif now >= self._slice_end:
            pick = self._choose(now)
            if (pick is None or pick == holder) and not (holder in self._due and self._ready):
                # Nobody else (or the holder again): keep it, no needless switch. (A holder in its turn
                # across GPUs that another such group would have here ends its turn: only then can the
                # other's open.)
                self._slice_end = now + self._slice_for(holder, owed_first=self._is_owed(holder))
            else:
                self._hold(now)

    def _kept_pause(self, holder: int, now: int) -> bool:
        """Is the quiet holder within the pause it keeps the GPU through (`_quiet_allowance`)? A training
        loop pauses between steps (its sync, then its CPU work): revoked at each pause, a loop paid a
        step of its debt a hog's slice (ResNet-50 with 5 ms of CPU a step, MinUtil 0.6 beside two hogs
        on the fake GPU: 0.33 of the GPU)."""
        idle_since = self._holder_idle_since
        return idle_since is not None and now - idle_since < self._quiet_allowance(holder)

    def _quiet_allowance(self, holder: int) -> int:
        """How long a quiet holder keeps the GPU while others want it: owed_pause_ns while it is paid
        its MinUtil debt; gang_pause_ns in its turn across GPUs (a rank quiet between steps, revoked
        there, closes the turn on every GPU of the job, which waits to line up again); else 0."""
        if holder in self._due:
            return self.params.gang_pause_ns
        return self.params.owed_pause_ns if self._is_owed(holder) else 0

    def _step_draining(self, now: int, obs: Observation) -> None:
        holder = self._holder
        assert holder is not None
        if holder in self._due and not self._held_in_turn:
            # Held while its turn across GPUs was closed, and that turn now goes: what it has queued
            # here is its own work of the turn (a rank that ran ahead into a collective waiting for its
            # peer, which only this turn releases), not a drain to wait out. Waited out, that drain
            # ends only when the turn has begun, and the turn begins only when the drain has ended: a
            # service spread over two GPUs beside a job on one of them waited a second a request.
            # _step_idle releases it at once (a due group goes first), charged throughout.
            self._phase, self._holder, self._charging = Phase.IDLE, None, False
            return
        if holder in self._stranded:
            # What is left here is a collective waiting for its peers, held and done on their GPUs: only
            # the group's next turn ends it. No drain to wait out, charge or learn from: charged, each turn
            # end that strands a rank sank one GPU's MaxUtil credit below the others', and a gang's turn
            # waits for its lowest (4 ranks capped at 0.3 did 0.06-0.33 of their solo on 4 simulated GPUs,
            # one GPU charged up to 2.7 x the others); learnt, those waits lengthened every later drain
            # timeout.
            self._phase, self._holder, self._charging = Phase.IDLE, None, False
            return
        # The timeout only matters to a group waiting for the GPU: with nobody to hand it to, the
        # drain is waited out (and charged), up to max_overrun_ns (a process that queued work and went
        # off to CPU work reports no end until it next launches or syncs).
        timed_out = (now >= self._hold_at + self.drain_timeout_ns() and self._someone_waits(now)
                     or now >= self._hold_at + self.params.max_overrun_ns)
        if obs.drained_at is None and not timed_out:
            return
        end = now if obs.drained_at is None else max(min(obs.drained_at, now), self._released_at)
        if self._charging and end < now:
            self._refund(holder, now - end)
        drain = max(0, end - self._hold_at)
        self._measured_drain(drain)
        if obs.drained_at is None and self._charging and now < self._hold_at + self.params.max_overrun_ns:
            self._overrun[holder] = self._hold_at  # charged on until the adapter sees it finish
        self._phase, self._holder, self._charging = Phase.IDLE, None, False

    def _step_idle(self, now: int) -> None:
        if self._clearing:
            return  # (Decision.clear: the turn starts once every GPU of it is clear and still ready)
        pick = self._choose(now)
        if pick is None:
            return
        owed = self._is_owed(pick)
        self._overrun.pop(pick, None)  # charged as the holder from now on
        self._phase, self._holder, self._charging = Phase.RUNNING, pick, True
        self._released_at = now
        self._holder_idle_since = None  # (the last holder's: this one's comes with its first look)
        self._account(pick).last_run = now
        self._slice_end = now + self._slice_for(pick, owed_first=owed, starting=True)

    def _hold(self, now: int) -> None:
        self._phase = Phase.DRAINING
        self._hold_at = now
        self._held_in_turn = self._holder in self._due


    # -- choosing ------------------------------------------------------------------------------

    def _eligible(self, group: int, now: int, slice_ns: int | None = None, gang_ok: bool = False) -> bool:
        """May the group be released now? Under its MaxUtil with the credit `_credit_needed` asks, and
        not barred (a group spanning GPUs whose turn is closed) unless `gang_ok`."""
        if not gang_ok and group in self._barred:
            return False
        account = self._accounts[group]
        max_util = account.quota.max_util
        if max_util >= 1.0:
            return True
        if max_util <= 0.0:
            return False
        if account.at < self._last:
            self._settle(account, self._last)
        return account.cap_credit >= self._credit_needed(group, slice_ns)

    def _credit_needed(self, group: int, slice_ns: int | None = None) -> float:
        """The MaxUtil credit a capped group needs to be released: for a slice of `slice_ns`, or
        what `_credit_to_release` asks."""
        if slice_ns is not None:
            return slice_ns * (1.0 - self._accounts[group].quota.max_util)
        return self._credit_to_release(group)

    def _credit_to_release(self, group: int) -> float:
        """The MaxUtil credit a capped group waits for: a whole slice's, so that it runs in a few long
        slices, not many short ones; alone (nobody else wants the GPU), a full bucket: it then runs
        until the bucket is spent and rests until it is full, half as many holds as a slice's credit
        gives: each hold and release costs a real model some ms of work beyond its charge
        (bench/results/models_torch.md)."""
        demand = self._demand  # (alone: no set built to compare it with, as `demand <= {group}` would)
        alone = not demand or len(demand) == 1 and group in demand
        if alone and not (group in self._barred or group in self._clearing):
            return self._cap_capacity() - 1.0  # (the bucket refills up to its capacity exactly)
        return self._turn_ns(group) * (1.0 - self._accounts[group].quota.max_util)

    def _turn_ns(self, group: int) -> int:
        """A group's slice (what it runs, what a capped group waits for credit for, what the order among
        groups looks half of ahead): a gang turn for a group that spans GPUs."""
        return self._gang_turn_ns() if group in self._spanning else self._slice_ns

    def _gang_turn_ns(self) -> int:
        """The turn of a group that spans GPUs (`_turn_ns` of a barred, clearing or due group)."""
        return max(self._slice_ns, self.params.gang_slice_ns)

    def _caps_fill_gpu(self) -> bool:
        """Do the MaxUtils of the groups that want the GPU add up to all of it? Then none of them
        need wait for a whole slice's credit: the GPU idling meanwhile is time their caps gave them
        and nobody gets (caps 0.1/0.2/0.3/0.4 lost 5% of the GPU that way, all of it the 0.4 group's).
        Below that, a capped group's waits are its cap's, and it waits for a whole slice."""
        if self._demand_caps is None:
            self._demand_caps = sum(self._accounts[g].quota.max_util for g in self._demand)
        return self._demand_caps >= 1.0 - 1e-9

    def _caps_within_gpu(self) -> bool:
        """Is every group that wants the GPU capped, their MaxUtils adding up to at most all of it?
        Then max-min fairness gives each its MaxUtil."""
        quotas = [self._accounts[g].quota for g in self._demand]
        return (len(quotas) > 1 and all(q.max_util < 1.0 for q in quotas)
                and sum(q.max_util for q in quotas) <= 1.0 + 1e-9)

    def _short_candidates(self, now: int) -> list[int]:
        """Nobody may be released for a whole slice: the groups that may for a shorter one, where
        their caps fill the GPU (_caps_fill_gpu)."""
        if not self._caps_fill_gpu():
            return []
        short = self.params.min_slice_ns
        return [g for g in self._demand if g not in self._barred and self._eligible(g, now, short)]

    def _someone_waits(self, now: int) -> bool:
        """Does a group other than the holder wait for the GPU, and may it be released once the
        holder drained?"""
        return bool(self._clearing) or any(g != self._holder and self._eligible(g, now) for g in self._demand) or any(
            g != self._holder for g in self._short_candidates(now))

    def _may_continue(self, group: int) -> bool:
        """May the holder keep the GPU? While its credit lasts for a useful stretch more (what is
        left stays in the bucket for its next slice)."""
        quota = self._accounts[group].quota
        if quota.max_util >= 1.0:
            return True
        return quota.max_util > 0.0 and self._account(group).cap_credit >= MS * (1.0 - quota.max_util)

    def _is_owed(self, group: int) -> bool:
        if self._accounts[group].quota.min_util <= 0.0:
            return False  # (not brought up to date for nothing: a release asks it of every candidate)
        return self._account(group).owed >= self.params.owed_min_ns

    def _long_slice_debt(self, group: int) -> float:
        """The debt that pays a longest owed slice (max_owed_slice_ns): a waiting group goes first for
        its debt from there on, not for each slice's worth of it: each release costs a training loop
        some ms of work beyond its charge, and a debt paid after every other group's slice means many
        releases (bench/results/models_torch.md). Till then fairness orders it, and the least used goes
        first anyway."""
        return (1.0 - self._accounts[group].quota.min_util) * self.params.max_owed_slice_ns

    def _choose(self, now: int) -> int | None:
        """The candidate first in `_rank`'s order (on a tie, the first of them)."""
        return min(self._candidates(now), key=self._rank(), default=None)

    def _chosen_if_admitted(self, now: int, groups: list[int], paused: list[int]) -> frozenset[int]:
        """The groups of `groups` (barred: none of them a candidate already) that `_choose` would pick
        if each alone were counted as a candidate too (`_gang_readiness`): each set against the
        candidates' best, found once (a look at 63 barred groups cost 63 choices over 63 groups), and
        only if strictly before it, as `_choose` keeps the first of equals."""
        rank = self._rank()
        best = min((rank(g) for g in self._candidates(now) + paused), default=None)
        return frozenset(g for g in groups if best is None or rank(g) < best)

    def _paused_holder(self, now: int, idle_since: int | None) -> list[int]:
        """The holder, where it is quiet for less than gang_pause_ns and may go on: a gang's turn is
        weighed against it as if it still had work. Why: a training loop goes quiet at every step's end
        (its sync, then the CPU work that launches the next step); counted out there, it consented to the
        gang's turn at its first pause past min_slice_ns, and did about one step a turn while the gang
        took whole turns. The gang keeps the same pause in its own turn (`_quiet_allowance`)."""
        holder = self._holder
        if (self._phase is Phase.RUNNING and holder is not None and idle_since is not None
                and now - idle_since < self.params.gang_pause_ns and holder not in self._barred
                and self._may_continue(holder)):
            return [holder]
        return []

    def _rank(self) -> Callable[[int], tuple[float, ...]]:
        """The order a choice goes by, first least: MinUtil debt first (most behind, relative to its
        MinUtil; the holder on a tie), whatever the priorities; then a group whose turn across GPUs is
        open, the least used first; then the highest priority, and within it `_order_key` (a holder
        whose turn is open goes on by these rules, not by its turn)."""
        order = self._order_key()
        accounts, due, holder = self._accounts, self._due, self._holder

        def rank(group: int) -> tuple[float, ...]:
            # (A group with no MinUtil is never owed: not asked, for the 62 barred groups a look ranks.)
            if accounts[group].quota.min_util > 0.0 and self._owed_first(group):
                behind, is_holder = self._owed_key(group)
                return (0, -behind, not is_holder)
            if group in due and group != holder:
                return (1, self._due_key(group))
            return (2, -accounts[group].quota.priority, *order(group))

        return rank

    def _candidates(self, now: int) -> list[int]:
        """The groups `_choose` chooses among: the holder while it may go on, the eligible wanting
        groups, or else those eligible for a short slice. Never a barred group (its turn across GPUs is
        closed): passed over first, since at the region's limit nearly every group is one."""
        return [g for g in self._demand if g not in self._barred and (g == self._holder and self._may_continue(g)
                                                                      or self._eligible(g, now))
                ] or self._short_candidates(now)

    def _owed_first(self, group: int) -> bool:
        """Does the group go first for its MinUtil debt (the holder for any, a waiting group for a long slice's)?"""
        return self._is_owed(group) and (group == self._holder
                                         or self._account(group).owed >= self._long_slice_debt(group))

    def _owed_key(self, group: int) -> tuple[float, bool]:
        return self._account(group).owed / self._accounts[group].quota.min_util, group == self._holder

    def _due_key(self, group: int) -> float:
        return self._account(group).usage

    def _order_key(self) -> Callable[[int], tuple[float, bool, int]]:
        """The order among the groups of the highest priority, least first."""
        if self._caps_within_gpu():
            # Every group that wants the GPU can have its whole MaxUtil: the one whose bucket fills
            # first goes first, since credit past a full bucket is lost (caps 0.2/0.3/0.4 by least
            # usage gave the 0.4 group 0.38, its bucket full while the others ran).
            capacity = self._cap_capacity()
            return lambda g: ((capacity - self._account(g).cap_credit) / self._accounts[g].quota.max_util,
                              g != self._holder, self._accounts[g].last_run)
        # By the usage each would have halfway through its slice: a gang's turns are longer than the
        # others' slices, and chosen when its usage just came under theirs it would end each turn
        # further above them than they end theirs above it (no quota beside single-GPU jobs: 0.53 of
        # each GPU against their 0.47).
        accounts, last, holder, spanning = self._accounts, self._last, self._holder, self._spanning
        ahead = (self._gang_turn_ns() - self._slice_ns) / 2  # (_turn_ns's, halved)

        def key(g: int) -> tuple[float, bool, int]:
            account = accounts[g]
            if account.at < last:
                self._settle(account, last)
            return account.usage + (ahead if g in spanning else 0.0), g != holder, account.last_run

        return key

    def _slice_for(self, group: int, owed_first: bool, starting: bool = False) -> int:
        """How long the group may hold the GPU from now: its slice (a gang's turn), or what pays its debt
        where `owed_first`, and no longer than its MaxUtil credit lasts. `starting`: it is released now."""
        p = self.params
        account = self._account(group)
        quota = account.quota
        turn = self._turn_ns(group)
        length = float(turn)
        if owed_first and quota.min_util < 1.0:
            # Long enough to pay the debt (time owed grows at min_util while it runs). A group spanning
            # GPUs starts a whole turn however little it is owed: each turn costs it a restart of every
            # rank, and turns cut to a small debt (43-110 ms, half of them) left four ranks at MinUtil
            # 0.6 charged 0.55 of each H200 and 0.43 of their solo work. Going on past its turn, it pays
            # the debt left and no more (paid in whole turns, it took 0.75 of each GPU).
            debt = min(float(p.max_owed_slice_ns), max(float(p.min_slice_ns), account.owed / (1.0 - quota.min_util)))
            length = max(length, debt) if starting and turn > self.slice_ns() else debt
        if quota.max_util < 1.0:
            # Until the MaxUtil credit is spent (it refills at max_util while it runs).
            length = min(length, max(0.0, account.cap_credit) / (1.0 - quota.max_util))
        return max(1, int(length))

    def _wake_at(self, now: int) -> int:
        """When to look again at the latest. Every news that the policy acts on at once rings the
        GPU's doorbell (Decision.wake_on_wait) or comes at a deadline of the policy's own (a slice's
        end, a MaxUtil bucket filling, a drain's timeout); the rest are nets for a ring that never came."""
        if self._phase is Phase.DRAINING:
            return self._wake_draining(now)
        if self._phase is Phase.RUNNING:
            return self._wake_running(now)
        if self._phase is Phase.SHARED:
            # What is charged comes from the gates' figures however late the look; a newcomer (held)
            # rings (Decision.wake_on_wait). A slice apart: a second process of a group, or a group gone
            # quiet, is seen within a slice.
            return now + self._slice_ns
        return self._wake_idle(now)

    def _wake_draining(self, now: int) -> int:
        p = self.params
        if not self._someone_waits(now):
            # Nobody to hand the GPU to: the drain's end comes from the gate's own timestamp, seeing
            # it late costs nothing (and only max_overrun_ns cuts it short). Where groups spanning GPUs
            # are barred here, the one whose turn opens next needs this GPU clear, and the drain's end
            # rings: the look that ring brings sees the turn clearing too, and the net is the drain's.
            # (Polled at poll_ns, a look that saw only the next turn clearing was 1 in 7 of the looks
            # at the region's limit, with the turns no sooner: bench/results/agent_cpu.md.)
            net = p.drain_net_ns if self._barred else p.poll_ns
            return min(now + net, self._hold_at + p.max_overrun_ns)
        # Someone waits: the GPU idles from the drain's end until a look sees it, and that end rings
        # (the group's last process to finish; the reaper for one that exited; the scheduler looks
        # again where the group finished before its hold was stored), so the drain's timeout, a look
        # due anyway, is its only net: one that went off to CPU work with its queue full is seen
        # there whatever the net. (Nets of drain_net_ns were 3 in 5 of the looks at the region's
        # limit with each group on one GPU, each finding the drain unfinished: bench/results/agent_cpu.md.)
        # A holder quiet when held drains at once and may not ring: looked at once more, finely.
        timeout = self._hold_at + self.drain_timeout_ns()
        if now > self._hold_at or self._charging:
            return timeout
        fine = int(min(MS, max(p.drain_poll_ns, self._drain_ns / 8)))
        return min(now + fine, timeout)

    def _wake_running(self, now: int) -> int:
        p = self.params
        holder = self._holder
        assert holder is not None
        if any(g != holder for g in self._demand) or self._turn_waiting(holder):
            overtaken = self._overtaken_at(holder, now)
            wake = min(self._slice_end, self._wake_to_revoke(holder, now))
            return wake if overtaken >= wake else int(overtaken)
        if self._outranked_present(holder):
            # A request of the higher priority blocks on its held word and rings (Decision.wake_on_wait):
            # the look comes with it, the poll is only a net. An owed holder is not revoked and sleeps
            # through rings: polled.
            return min(self._slice_end, now + (p.poll_ns if self._is_owed(holder) else p.steady_poll_ns))
        capped = self._accounts[holder].quota.max_util < 1.0
        if not self._charging:
            # The holder idles: see when it is busy again, so that its charge starts at most a look
            # late; promptly for a capped group (its cap counts on that charge).
            return min(self._slice_end, now + (p.poll_ns if capped else p.ring_net_ns))
        if not capped:
            # Alone and uncapped: the slice's end would only renew it; the gates' figures charge it
            # however late the next look, and another group's first launch rings.
            return now + p.ring_net_ns
        return min(self._slice_end, now + p.max_slice_ns)  # (a debt's slice may be longer)

    def _wake_to_revoke(self, holder: int, now: int) -> int:
        """Another group wants the GPU: look at the end of a quiet holder's pause, every poll where the
        holder is quiet (for a waiting group's credit) or outranked, and where it is busy when its
        gates ring that it went quiet (`_quiet_rings`), or when a waiting group's MinUtil debt comes to
        send it before the holder's slice ends (`_deep_debt`), the slice's end being the net."""
        p = self.params
        if self._kept_pause(holder, now):
            assert self._holder_idle_since is not None
            return self._holder_idle_since + self._quiet_allowance(holder)
        if self._quiet_rings():
            return self._deep_debt_at(now)
        return now + p.poll_ns

    def _deep_debt_at(self, now: int) -> int:
        """When a waiting group's MinUtil debt next reaches what revokes the holder (`_deep_debt`), or
        its MaxUtil credit comes where the debt is there already, before the holder's slice ends (else
        the slice's end); `now + poll_ns` where that cannot be told. Its debt grows at its MinUtil while
        it waits and its credit at its MaxUtil: a deadline, not a poll, as every look that a busy
        holder's ring replaces must be."""
        wake = math.inf
        for group in self._demand & self._guaranteed:
            if group == self._holder:
                continue
            account, quota = self._account(group), self._accounts[group].quota
            due = self._deep_debt_owed(group)
            if due > self.params.max_owed_slice_ns:
                continue  # (out of reach: a debt grows up to max_owed_slice_ns)
            missing = due - account.owed
            if missing > 0:
                wake = min(wake, now + math.ceil(missing / quota.min_util))
            elif not self._eligible(group, now):
                credit = self._credit_needed(group) - account.cap_credit
                if group in self._barred or credit <= 0 or not 0.0 < quota.max_util < 1.0:
                    wake = min(wake, now + self.params.poll_ns)
                else:
                    wake = min(wake, now + max(1, math.ceil(credit / quota.max_util)))
        return int(min(wake, self._slice_end))

    def _wake_idle(self, now: int) -> int:
        """Nobody released: a group's first launch rings (it blocks on its held word), so the look for
        new demand is only a net; the looks that matter are when a waiting capped group's credit is back.
        A group spanning GPUs that has its credit and waits for its turn (barred, or clearing elsewhere)
        needs no look: its turn's change rings the bell (gang.py). Looked at `now` instead, an idle GPU
        looked as fast as the ring gap allows while turns cleared elsewhere (at the region's limit, 6 of
        10 looks of every GPU)."""
        wake = now + self.params.ring_net_ns
        short = self._caps_fill_gpu()
        waits_for_turn = self._barred | self._clearing
        accounts, last = self._accounts, self._last
        turn = self._gang_turn_ns()  # (the credit a turn across GPUs needs)
        for group in self._demand:
            account = accounts[group]
            max_util = account.quota.max_util
            if 0.0 < max_util < 1.0:
                if account.at < last:
                    self._settle(account, last)
                if group in waits_for_turn:  # (when its readiness comes: _gang_readiness)
                    missing = turn * (1.0 - max_util) - account.cap_credit
                    if missing <= 0:
                        continue
                else:
                    wanted = self._credit_needed(group, self.params.min_slice_ns if short else None)
                    missing = wanted - account.cap_credit
                wake = min(wake, now + max(1, math.ceil(missing / max_util)))
        return wake

    # -- accounting ------------------------------------------------------------------------------

    def _cap_capacity(self) -> float:
        # Room for one slice's worth of credit at most: a capped group that idled may then run one
        # slice at full speed, never a long burst above its MaxUtil. Where drains are longer (work
        # queued far ahead of the syncs), room for two of them: a hold costs a drain that cannot be
        # cut short, and a bucket smaller than that left the GPU idle while both buckets refilled
        # (caps 0.3 / 0.7 with 200 ms drains gave 0.30 / 0.62).
        # Where a group spans GPUs, room for its turn and a slice more: its credit fills while its
        # other GPUs finish their holders' slices, and a bucket that overflowed meanwhile lost the time
        # (a job capped at 0.3 over two GPUs was charged 0.22).
        gangs = self._barred or self._clearing or self._due
        turn = self.params.gang_slice_ns + self.slice_ns() if gangs else 0
        return float(max(self.slice_ns(), 2 * self._drain_ns, turn))

    def _advance(self, now: int) -> None:
        """Move the accounts in play from the last look to `now`: the holder's and those of groups
        still finishing an overrun drain, which are charged the time passing (while busy). Every other
        account only decays, refills and, while it wants the GPU, accrues what MinUtil owes it and its
        time held back: `_settle` does that in one go when it is next read. A look costs per group
        charged, not per group that waits (bench/bench_wake_cost.py: a look at the region's limit)."""
        dt = now - self._last
        if dt <= 0:
            return
        capacity = self._cap_capacity()
        if capacity != self._capacity:
            # The capacity in force from the last look on (it follows the measured drains): accounts
            # out of play refill up to each capacity in turn, as they would have look by look.
            if len(self._capacities) >= _MAX_CAPACITIES:
                self._settle_all()
            self._capacities.append((self._last, self._capacity))
            self._capacity = capacity
        last, self._last = self._last, now
        if self._phase is Phase.SHARED:
            self._shared_ns += dt
        stalled = self._after_stall = dt > self.params.stall_ns
        decay = math.exp(-dt / self.params.window_ns)
        gain = self.params.window_ns * (1.0 - decay)  # decayed weight of dt of continuous time
        self._window_weight = self._window_weight * decay + gain
        for group in [g for g in self._overrun if g not in self._accounts]:
            del self._overrun[group]
        charged_group = (self._holder if self._charging and self._phase in (Phase.RUNNING, Phase.DRAINING)
                         else None)
        in_play = set(self._overrun) | self._shared
        if charged_group is not None:
            in_play.add(charged_group)
        if self._holder is not None and self._holder in self._demand:
            in_play.add(self._holder)  # (never held back while it runs: _settle counts a wait)
        era = len(self._capacities)
        for group in in_play:
            if group not in self._accounts:
                continue  # wanted the GPU at the last look, unscheduled since
            account = self._settle(self._accounts[group], last)
            charged = dt if group == charged_group or group in self._overrun else 0
            account.gpu_ns += charged
            account.usage = account.usage * decay + gain * charged / dt
            quota = account.quota
            if quota.max_util < 1.0:
                account.cap_credit = min(capacity, account.cap_credit + quota.max_util * dt - charged)
                if stalled:
                    account.cap_credit = max(0.0, account.cap_credit)
            if quota.min_util > 0.0:
                # Never negative: time used beyond MinUtil while others did not want the GPU is not
                # a debt against the guarantee later. Bounded: a long wait earns one long slice.
                account.owed = min(float(self.params.max_owed_slice_ns),
                                   max(0.0, account.owed + quota.min_util * dt - charged))
            if not (self._phase is Phase.RUNNING and group == self._holder) and group not in self._shared:
                account.throttled_ns += dt
            account.at, account.era = now, era

    def _settle(self, account: _Account, until: int) -> _Account:
        """Bring an account that was out of play (nothing charged, not the holder) up to `until`: its
        usage decays, its MaxUtil bucket refills under each capacity in force meanwhile and, where it
        wanted the GPU, its MinUtil debt and its time held back grow. The same figures as moving it
        look by look, but for rounding."""
        elapsed = until - account.at
        if elapsed <= 0:
            return account
        if elapsed != self._decay_of[0]:
            # (Every group out of play was settled at the same looks: one exponential serves them all.)
            self._decay_of = (elapsed, math.exp(-elapsed / self.params.window_ns))
        account.usage *= self._decay_of[1]
        if account.wanting:
            account.throttled_ns += elapsed
            if account.quota.min_util > 0.0:
                account.owed = min(float(self.params.max_owed_slice_ns),
                                   account.owed + account.quota.min_util * elapsed)
        rate = account.quota.max_util
        if rate < 1.0:
            credit, at = account.cap_credit, account.at
            if account.era < len(self._capacities):
                for end, capacity in self._capacities[account.era:]:
                    if end > at:
                        credit, at = min(capacity, credit + rate * (end - at)), end
            if until > at:  # (no clamp where no time passed: a look clamps at its end only)
                credit = min(self._capacity, credit + rate * (until - at))
            account.cap_credit = credit
        account.at, account.era = until, len(self._capacities)
        return account

    def _account(self, group: int) -> _Account:
        """A group's account, up to date as of the last look."""
        account = self._accounts[group]
        return account if account.at >= self._last else self._settle(account, self._last)

    def _settle_all(self) -> None:
        for account in self._accounts.values():
            self._settle(account, self._last)
            account.era = 0
        self._capacities.clear()

    def _charge(self, group: int, ns: float) -> None:
        """Charge GPU time that no look saw passing (a burst between two looks): what `_advance`
        charges a busy holder, after the fact."""
        if ns <= 0 or group not in self._accounts:
            return
        account = self._account(group)
        account.gpu_ns += ns
        # A burst that ran through a stall, the holder quiet at the look before it (so not charged as it
        # ran), counts as `_advance` counts a stall: its usage by the window's decayed weight, its bucket
        # empty at worst. Charged whole, a group capped at 0.3 was held for 30 s after a stop of 10 s.
        window = self.params.window_ns
        account.usage += window * (1.0 - math.exp(-ns / window)) if self._after_stall else ns
        if account.quota.max_util < 1.0:
            account.cap_credit -= ns
            if self._after_stall:
                account.cap_credit = max(0.0, account.cap_credit)
        if account.quota.min_util > 0.0:
            account.owed = max(0.0, account.owed - ns)

    def _refund(self, group: int, ns: float) -> None:
        """Take back time charged provisionally that was not GPU time (the holder had idled, or its
        drain ended before this look)."""
        if ns <= 0 or group not in self._accounts:
            return
        account = self._account(group)
        account.gpu_ns = max(0.0, account.gpu_ns - ns)
        account.usage = max(0.0, account.usage - ns)
        if account.quota.max_util < 1.0:
            account.cap_credit = min(self._cap_capacity(), account.cap_credit + ns)
        if account.quota.min_util > 0.0:
            account.owed = min(float(self.params.max_owed_slice_ns), account.owed + ns)

    def figures(self, group: int) -> dict[str, float | None]:
        """A group's GPU seconds charged and MaxUtil credit (ms; None where not capped) as of the last
        look: for the scheduler's debug trace."""
        account = self._accounts.get(group)
        if account is None:
            return {}
        account = self._account(group)
        credit = round(account.cap_credit / 1e6, 2) if account.quota.max_util < 1.0 else None
        return {"gpu_s": round(account.gpu_ns / 1e9, 4), "credit_ms": credit}

    def _up_to(self, now: int) -> None:
        """Every account brought up to `now`, as a read of what the groups got sees them."""
        self._advance(now)
        self._settle_all()

    def usage(self, now: int) -> dict[int, GroupUsage]:
        self._up_to(now)
        weight = self._window_weight or 1.0
        return {
            group: GroupUsage(account.gpu_ns / 1e9, account.throttled_ns / 1e9,
                              min(1.0, max(0.0, account.usage / weight)))
            for group, account in self._accounts.items()
        }

    def shared_seconds(self, now: int) -> float:
        """How long this GPU's groups have shared it under the driver's time slicing (Phase.SHARED) rather
        than taken turns, up to `now`."""
        self._advance(now)
        return self._shared_ns / 1e9

    def gpu_seconds(self, now: int) -> dict[int, float]:
        """usage()'s GPU seconds alone, as usage() leaves the accounts (the accounting asks at every
        poll: 64 groups' usage on each of 8 GPUs cost it more than the rest of its share of their time)."""
        self._up_to(now)
        return {group: account.gpu_ns / 1e9 for group, account in self._accounts.items()}
