"""The scheduler of one GPU: reads the gates' slots, asks the policy, writes the futex words.

This module owns the adapter between the region (hook/gemtrace_region.h) and the pure time-share
policy (gemtrace/agent/policy.py): it turns the slots of one GPU into an `Observation` (which groups want the
GPU, whether the released group went idle, whether a held group finished draining) and carries out
the `Decision` by holding and releasing control[gpu][group] words. The agent has one `GpuScheduler`
per GPU, all of them looked at from one thread (gemtrace/agent/scheduler_loop.py, which says when each
looks; `run(stop)` is that loop for one GPU). It never decides anything itself, never writes a slot,
and never blocks a gate: on any way out of its loop (stop, or an error) it releases every word it held.
Every look re-asserts all of its GPU's words (held, released, released with a short queue, and
released for every group it does not schedule), comparing first and storing only what differs: any
user can write the region, and a forged release must last one look at most, not until the next
decision.

Cost: a look reads three columns (launches, waiting thread, pid) of this GPU's users only, at C
speed: the live slots that launched, waited or were placed here. The whole table is scanned for them
only when a gate counted a new user of this GPU in the doorbells (`joined`: its first use of the GPU,
before its first launch waits and rings) or an assignment changed (the agent assigns a new slot
before its first launch passes attach), and every second as a net.
It visits one by one only the users whose launches moved and the slots of the groups whose end the
policy waits for (holder, draining, overrunning); the other users' groups come from set
operations over the columns, with each user's group kept while no pid, assignment or quota changed.
So a look costs per group in play and per process that launched since the last one, not per process
of the host. It looks at the policy's next deadline (gemtrace/agent/policy.py, `_wake_at`): a slice's end
while others wait, every few ms while a holder that idles keeps others waiting, a MaxUtil bucket
filling, a drain's timeout; every other look is a net for a ring that never came.
Where the policy says a thread's wait is news (`Decision.wake_on_wait`: a group that outranks the
holder asks for the GPU, a held group drained while another waits, nobody holds the GPU, or another
group's first wait beside a holder alone), and while a group here spans GPUs, it listens for the GPU's
doorbell (`listens_for_rings`), which a gate rings when one of its threads starts waiting on a held
word or a held process's own sync ends its drain, and a gang turn's change rings: it looks at once,
not a poll later. Where a busy holder keeps another group waiting (`Decision.quiet_rings`), it asks
the holder's gates to ring when their sync leaves the group with nothing queued (control.ring_quiet,
set before the release) and listens for that ring alone: a ring while the holder still has work
brings no look (`ring_is_news`). During a drain a ring brings a look only once no process of the
drained group has work left; a gate whose group is still draining elsewhere does not ring at all
(hook/launch.c, ring_drain_end: the last to finish rings), so with two processes a group a switch
costs the scheduler one wake-up fewer.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import itertools
import operator
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import structlog

from gemtrace import eventlog
from gemtrace import region as rg
from gemtrace.agent.gang import GangTurns, GpuReport, JobKeys
from gemtrace.agent.policy import Decision, GroupUsage, Observation, PolicyParams, Quota, TimeSharePolicy
from gemtrace.agent.scheduler_loop import SchedulerLoop

__all__ = ["GpuScheduler", "GroupUsage", "Quota", "SlotTable"]

log = structlog.get_logger("gemtrace.scheduler")

# The gates count new users in the doorbells (gt_bells.joined: a gate's first use of a GPU): the
# whole slot table is scanned for this GPU's users when that count or an assignment moved, and at
# least this often, a net for a count that a gate of an older build or a forger did not move (only
# its own first launch waits, up to the net). A scan of 1024 live slots costs ~100 us of Python warm,
# several times that after a sleep (bench/results/agent_cpu.md): between scans a look reads only the
# users it knows. Every gate of this build counts its first use, so the net is seldom: at 1 s, the
# region's limit scanned 8 times a second (once per GPU), 0.3% of a core for nothing new.
RESCAN_NET_NS = 5_000_000_000
_FOREVER = 1 << 63  # (`_unfinished`: work queued that no sync covered at all)
# The word of the groups that share a GPU (Decision.shared): the long queue of a group alone
# (`GpuScheduler._carry_out_shared` says why).
_SHARED_WORD = rg.RELEASED_LONG_QUEUE


class SlotTable:
    """One GPU's columns of the region's SlotColumns (region.py: the one reader of the slots'
    counters): element i of `pid` is slots[i].pid, of `launches` slots[i].launches[gpu], and so on;
    `group` is the agent's assignment, which counts only where `assigned_pid` is the slot's pid."""

    def __init__(self, region: rg.Region, gpu: int) -> None:
        columns = region.slot_columns
        self.pid = columns.pid
        self.group = columns.group
        self.assigned_pid = columns.assigned_pid
        self.waiting = columns.waiting(gpu)
        self.launches = columns.launches(gpu)
        self.drained_ns = columns.drained_ns(gpu)
        self.burst_start_ns = columns.burst_start_ns(gpu)
        self.busy_ns = columns.busy_ns(gpu)
        self.gpu_mask = columns.gpu_mask
        self.live = columns.live
        self.assignments = columns.assignments


# The parts of an Observation that a GPU's view of the turns sets (GpuScheduler._with_turns).
_TURN_FIELDS = ("barred", "clearing", "due", "pending", "stranded")


def _decides_the_same(before: Observation, after: Observation, decision: Decision,
                      overrunning: Mapping[int, int]) -> bool:
    """Would deciding again on `after` (the turns as this look's report left them) decide what `decision`
    did on `before`? Yes where one part of the turns changed, and only in a way the policy does not act on:
    - `pending`, in that the group this GPU released left it: pending only counts a due group that asks
      for nothing as wanting the GPU, so that it is released; released, it is the charged holder, in play
      whatever it asks (6 in 10 of the looks that decided twice at the region's limit, each the same);
    - `stranded`, none of them this GPU's drain or an overrunning group: the policy reads it only to end
      such a drain or overrun (tests/test_gang.py holds it to that). A GPU whose drain ends reports it,
      and the group it drained is stranded here no longer: 9 in 10 of the drain ends' looks decided twice
      for this alone."""
    changed = [part for part in _TURN_FIELDS if getattr(before, part) != getattr(after, part)]
    if changed == ["pending"]:
        return decision.released in before.pending and after.pending == before.pending - {decision.released}
    if changed == ["stranded"]:
        return decision.draining not in after.stranded and not any(g in after.stranded for g in overrunning)
    return False


def _gatherer(indices: Sequence[int]) -> Callable[[Sequence[int]], tuple[int, ...]]:
    """A function that reads elements `indices` of a column into a tuple, at C speed."""
    if not indices:
        return lambda column: ()
    if len(indices) == 1:
        index = indices[0]
        return lambda column: (column[index],)
    return operator.itemgetter(*indices)  # type: ignore[return-value]


@dataclass
class _SlotSeen:
    pid: int
    launches: int
    busy_ns: int = 0  # the slot's busy_ns as of its last visit


@dataclass
class _Drain:
    group: int
    hold_at: int


@dataclass(slots=True)
class _SlotLook:
    """What a look read of one user's slot on this GPU."""

    group: int
    launched: int
    waits: int
    drained: int  # drained_ns
    burst_start: int  # burst_start_ns
    moved: bool  # it launched since the last visit (or, at its first sight, ever)
    busy_added: int  # busy_ns added since the last visit: the bursts it closed meanwhile
    quiet: bool  # nothing queued (GpuScheduler._quiet)
    finished: int  # when it last finished its work


class _Ends:
    """What a look's visits tell of the groups whose end the policy waits for: the holder going quiet
    (and the bursts it ran), the held group finishing its drain, overrunning groups finishing."""

    def __init__(self, holder: int | None, drain: _Drain | None, overrun: Mapping[int, int]) -> None:
        self.holder, self.drain, self.overrun = holder, drain, overrun
        self.groups = {g for g in (holder, drain.group if drain is not None else None, *overrun) if g is not None}
        self.holder_busy = False
        self.holder_drained = 0
        # The earliest burst the quiet holder ran since the last look; of a busy one, its open bursts'
        # earliest opening. And the length of the bursts it closed since the last look (busy_ns).
        self.holder_burst_from: int | None = None
        self.holder_open_from: int | None = None
        self.holder_burst_ns = 0
        self.drain_done = True
        self.drain_ends: list[int] = []
        # Overrunning groups (still finishing work queued before a drain that timed out): those with
        # work left, and when the others' processes finished.
        self.overrun_busy: set[int] = set()
        self.overrun_ends: dict[int, int] = {}

    def add(self, look: _SlotLook) -> None:
        group = look.group
        if group == self.holder:
            self._add_holder(look)
        if self.drain is not None and group == self.drain.group:
            if look.drained >= self.drain.hold_at or look.quiet:
                self.drain_ends.append(look.finished)
            else:
                self.drain_done = False
        if group in self.overrun:
            if look.drained >= self.overrun[group] or look.quiet:
                self.overrun_ends[group] = max(self.overrun_ends.get(group, 0), look.finished)
            else:
                self.overrun_busy.add(group)

    def _add_holder(self, look: _SlotLook) -> None:
        self.holder_burst_ns += look.busy_added
        if look.quiet and look.waits == 0:
            self.holder_drained = max(self.holder_drained, look.drained)
            if look.moved and look.burst_start:
                self.holder_burst_from = min(self.holder_burst_from or look.burst_start, look.burst_start)
        else:
            self.holder_busy = True
            if not look.quiet and look.burst_start:
                self.holder_open_from = min(self.holder_open_from or look.burst_start, look.burst_start)

    def observation(self, now: int, demand: set[int], present: set[int], crowded: frozenset[int],
                    shared_busy: Mapping[int, int]) -> Observation:
        holder, drain = self.holder, self.drain
        if holder is not None and self.holder_busy:
            demand.add(holder)
        elif holder is not None:
            demand.discard(holder)
        drained_at = None
        if drain is not None and self.drain_done:
            # When its last process finished; with no process left, when it was held.
            drained_at = min(now, max(self.drain_ends)) if self.drain_ends else drain.hold_at
        # An overrunning group with no process left (they exited) is done when it was held.
        overrun_done = {g: min(now, self.overrun_ends.get(g, hold_at)) for g, hold_at in self.overrun.items()
                        if g not in self.overrun_busy}
        quiet_holder = holder is not None and not self.holder_busy
        return Observation(frozenset(demand), self.holder_drained if quiet_holder else None, drained_at,
                           overrun_done, frozenset(present),
                           self.holder_burst_from if quiet_holder else self.holder_open_from, self.holder_burst_ns,
                           crowded=crowded, shared_busy=shared_busy)


class GpuScheduler:
    """Schedules the groups on one GPU of the region. `set_quotas` and `usage` may be called from any
    thread; `run` (or, in tests, `step`) from one thread only."""

    def __init__(self, region: rg.Region, gpu: int, clock: Callable[[], int] = time.monotonic_ns,
                 params: PolicyParams | None = None, rescan_ns: int | None = None,
                 gang: GangTurns | None = None, jobs: JobKeys | None = None) -> None:
        if not 0 <= gpu < rg.MAX_GPUS:
            raise ValueError(f"gpu index {gpu} is outside 0..{rg.MAX_GPUS - 1}")
        if region.doorbells is None:
            raise ValueError("a scheduler needs the agent's region (Region.create): an opened one has no doorbells")
        self.region = region
        self._bells = region.doorbells
        self.gpu = gpu
        self._clock = clock
        self._slots = SlotTable(region, gpu)
        control = region.layout.control[gpu]
        raw = memoryview((ctypes.c_char * ctypes.sizeof(control)).from_address(ctypes.addressof(control))).cast("B")
        self._held = raw.cast("I")[rg.Control.held.offset // 4 :: ctypes.sizeof(rg.Control) // 4]
        self._short_queue = False
        self._outranked = False
        self._wake_on_wait = False
        # The released group whose gates ring when it goes quiet (Decision.quiet_rings), if any. A
        # restarted agent's region may still ask it of a group: nobody's until a decision says so.
        self._ringing: int | None = None
        for group in range(rg.MAX_GROUPS):
            region.set_ring_quiet(gpu, group, False)
        # The turns of groups that span GPUs, shared with the other GPUs' schedulers (gemtrace/agent/gang.py);
        # while a group here spans GPUs, this scheduler sleeps on its doorbell, which a turn's change rings.
        self._gang = gang
        self._gang_here = False
        # Which job each process is in (the agent's, shared with membership): a group is a gang where one
        # of its jobs spans GPUs.
        self._jobs = jobs if jobs is not None else JobKeys()
        self._user_jobs: tuple[tuple[int, int], ...] = ()  # (group, job) of each user
        # Which users launched or wait here (one byte each: `_read_users`), as of the present jobs.
        self._active_users: bytes | None = None
        self._present_jobs: frozenset[tuple[int, int]] = frozenset()
        self._lock = threading.Lock()
        self._policy = TimeSharePolicy(params or PolicyParams(), now=clock())
        self._pending_quotas: dict[int, Quota] | None = None
        self._scheduled: frozenset[int] = frozenset()  # groups whose words this scheduler drives
        self._released: int | None = None
        self._drain: _Drain | None = None
        self._seen: dict[int, _SlotSeen] = {}
        self._live: list[int] = []
        # What the last look read of this GPU's users (_rescan, _observe), and the slots by group.
        self._users: list[int] = []
        self._gather_users = _gatherer(self._users)
        self._user_groups: tuple[int, ...] | None = None
        self._user_pids: tuple[int, ...] = ()
        self._user_launches: tuple[int, ...] = ()
        self._user_assignments = b""
        self._user_scheduled: frozenset[int] | None = None
        self._by_group: dict[int, list[int]] | None = None
        self._by_group_assignments = b""
        # What the words should say, and the decision they were worked out for.
        self._expected_words: tuple[tuple[object, ...], list[int]] | None = None
        self._beside: frozenset[int] = frozenset()  # opportunistic groups released beside production
        self._shared: frozenset[int] = frozenset()  # groups released together (Decision.shared)
        self._crowded: frozenset[int] = frozenset()  # groups with several processes active here
        self._looked_at = clock()  # the last look's time (what the shared groups' busy time counts from)
        self._opportunistic: frozenset[int] = frozenset()  # the scheduled groups that are opportunistic
        if rescan_ns is None:
            rescan_ns = RESCAN_NET_NS
        self._rescan_ns = rescan_ns
        self._scanned_at = clock() - rescan_ns
        # The assignments and the doorbells' count of new users as of the last scan of the whole table.
        self._live_assignments = b""
        self._joined = -1
        self.looks = 0  # how often it looked at the region (the CPU it costs), for tests and benches
        self.scans = 0  # how often a look scanned the whole slot table for users (most of a look's CPU)
        self.switches = 0  # how often it held a released group to hand the GPU on (or to cap it)
        # At --log-level debug, each look whose decision or turns differ from the last one's is logged
        # (`_trace`): what a gang's turns did on each GPU, for an operator asking why a job waits.
        self._tracing = eventlog.debug_enabled()
        self._traced: tuple[object, ...] = ()

    # -- the agent's side --------------------------------------------------------------------------

    def set_quotas(self, quotas: Mapping[int, Quota]) -> None:
        """The groups to schedule on this GPU and their quotas (group index -> Quota); takes effect
        at the next look. A group left out is no longer held: its launches proceed. A new group is
        held at once: a process of it that started before the next look would otherwise launch
        unscheduled (and fill the driver's queue with seconds of work)."""
        with self._lock:
            self._pending_quotas = dict(quotas)
            for group in quotas.keys() - self._scheduled:
                self.region.hold(self.gpu, group)
        self._bells.ring(self.gpu)  # (it may be asleep on the bell for long)

    def usage(self) -> dict[int, GroupUsage]:
        with self._lock:
            usage = self._policy.usage(self._clock())
            # A group set since the last look is there at 0, not missing until the look (a scrape
            # right after the agent's start or a reload would lose its series).
            for group in self._pending_quotas or ():
                usage.setdefault(group, GroupUsage(0.0, 0.0, 0.0))
            return usage

    def shared_seconds(self) -> float:
        """How long the groups here have shared this GPU under the driver's time slicing (no turns)."""
        with self._lock:
            return self._policy.shared_seconds(self._clock())

    def gpu_seconds(self) -> dict[int, float]:
        """usage()'s GPU seconds alone (a group set since the last look at 0, as there)."""
        with self._lock:
            seconds = self._policy.gpu_seconds(self._clock())
            for group in self._pending_quotas or ():
                seconds.setdefault(group, 0.0)
            return seconds

    def run(self, stop: threading.Event) -> None:
        """Schedule this GPU alone in this thread until `stop` is set (the agent runs all its GPUs in
        one: gemtrace/agent/scheduler_loop.py); every word it held is released on the way out."""
        SchedulerLoop([self], self._bells, self._clock).run(stop)

    # -- the loop's side (gemtrace/agent/scheduler_loop.py) ----------------------------------------------

    def listens_for_rings(self) -> bool:
        """Since the last look, may a ring of this GPU's bell bring a look before its deadline? Where the
        policy says a thread's wait is news, while a group here spans GPUs (a turn's change rings), and
        while the holder's gates are to ring when it goes quiet."""
        return self._wake_on_wait or self._gang_here or self._ringing is not None

    def ring_is_news(self) -> bool:
        """Does a ring since the last look bring a look (where `listens_for_rings`)? Not while waiting
        for the busy holder's quiet ring alone and the holder still has work (the ring was a held
        group's thread that starts waiting), unless quotas changed; not during a drain while a process
        of the drained group still has work (another of its processes finished, an older gate, or
        another group rang, which the look at the drain's end sees)."""
        with self._lock:
            if (not self._wake_on_wait and not self._gang_here and self._ringing is not None
                    and self._unfinished(self._ringing, _FOREVER)):
                return self._pending_quotas is not None
            return not self._drain_unfinished()

    def release_all(self) -> None:
        """Release every word this scheduler held (a look failed: no gate waits on a scheduler that
        cannot decide); the next look starts from all held again."""
        with self._lock:
            # Groups set but not yet applied are held too (set_quotas holds new groups at once).
            for group in self._scheduled | (self._pending_quotas or {}).keys():
                self.region.release(self.gpu, group)
            self._released = None
            self._drain = None
            self._beside = frozenset()
            self._shared = frozenset()
            self._set_ringing(None)
            # The next look starts from all held again (a restarted loop must not leave two released).
            self._pending_quotas = self._pending_quotas or self._policy.quotas()

    def stopped(self) -> None:
        """Its loop stopped: its GPU counts in no gang, and every word it held is released."""
        if self._gang is not None:
            self._gang.forget(self.gpu)
        self.release_all()

    # -- one look ----------------------------------------------------------------------------------

    def step(self) -> int:
        """Look at the region once, decide, write the words; returns when to look again (clock ns)."""
        with self._lock:
            now = self._clock()
            if self._pending_quotas is not None:
                self._apply_quotas(now, self._pending_quotas)
                self._pending_quotas = None
            observation = self._observe(now)
            turned = self._with_turns(observation)
            decision = self._policy.step(now, turned)
            # A turn across GPUs that opened, went or closed at this look: decide again before carrying
            # out (a few times at most: each report moves a turn on by one state).
            for _ in range(3):
                overrunning = self._policy.overrunning()
                if self._gang is None or not self._gang.report(self.gpu, GpuReport(
                        observation.present, observation.demand, decision.ready, decision.released, decision.clear,
                        decision.draining, turned.clearing, self._present_jobs, frozenset(overrunning),
                        decision.sharable)):
                    break
                before, turned = turned, self._with_turns(observation)
                if _decides_the_same(before, turned, decision, overrunning):
                    break
                decision = self._policy.step(now, turned)
            ringing, released, drain = self._ringing, self._released, self._drain
            self._carry_out(now, decision)
            self._assert_words()
            self.looks += 1
            if self._tracing:
                self._trace(turned, decision)
            return now if self._ended_before_asked(ringing, released, drain) else decision.wake_at

    def _ended_before_asked(self, ringing: int | None, released: int | None, drain: _Drain | None) -> bool:
        """Did this look ask for a ring at a group's end (a hold that starts its drain, whose next net is
        its timeout; a group asked to ring when it goes quiet while it was already released) where that
        group has ended already? Its last process may have gone quiet after the look read its slots and
        before the word was stored, its sync reading the word as it was: no ring. Then look again at once.
        `ringing`, `released`, `drain`: as they were before the look carried out its decision."""
        if drain is None and self._drain is not None and not self._drain_unfinished():
            return True
        return (self._ringing is not None and self._ringing != ringing and self._ringing == released
                and not self._unfinished(self._ringing, _FOREVER))

    def _trace(self, turned: Observation, decision: Decision) -> None:
        """Log the look where what it decided, or the turns it saw, changed (debug level only)."""
        traced = (decision.released, decision.draining, decision.clear, decision.ready, turned.barred,
                  turned.clearing, turned.due, turned.stranded, decision.shared, frozenset(self._policy.overrunning()))
        if traced == self._traced:
            return
        self._traced = traced
        gangs = turned.barred | turned.clearing | turned.due
        log.debug("look", gpu=self.gpu, released=decision.released, draining=decision.draining,
                  clear=decision.clear, ready=sorted(decision.ready), barred=sorted(turned.barred),
                  clearing=sorted(turned.clearing), due=sorted(turned.due), stranded=sorted(turned.stranded),
                  shared=sorted(decision.shared), overrunning=sorted(traced[-1]), demand=sorted(turned.demand),
                  gangs={g: self._policy.figures(g) for g in sorted(gangs)})

    def _with_turns(self, observation: Observation) -> Observation:
        """The observation with the groups spanning GPUs here (gang.py): those barred and due, and all of them,
        in turns or not."""
        if self._gang is None:
            return observation
        turns, spanning = self._gang.view(self.gpu), self._gang.spanning_on(self.gpu)
        self._gang_here = bool(turns)
        if not turns and not spanning:
            return observation
        scheduled = self._scheduled
        return dataclasses.replace(observation, barred=turns.barred & scheduled, clearing=turns.clearing & scheduled,
                                   due=turns.due & scheduled, pending=turns.pending & scheduled,
                                   stranded=turns.stranded & scheduled, spanning=spanning & scheduled)

    def _apply_quotas(self, now: int, quotas: dict[int, Quota]) -> None:
        self._policy.set_quotas(now, quotas)
        self._opportunistic = frozenset(group for group, quota in quotas.items() if quota.opportunistic)
        dropped = self._scheduled - quotas.keys()
        self._scheduled = frozenset(quotas)
        for group in dropped:
            self.region.release(self.gpu, group)
        if self._released in dropped:
            self._released = None
        if self._ringing in dropped:
            self._set_ringing(None)
        if self._drain is not None and self._drain.group in dropped:
            self._drain = None
        # Every scheduled group is held but the one the policy released (a new group starts held:
        # its first launch waits at most a poll for the policy to see it).
        self._beside &= self._scheduled
        self._shared &= self._scheduled
        for group in self._scheduled:
            if group != self._released and group not in self._beside and group not in self._shared:
                self.region.hold(self.gpu, group)

    @staticmethod
    def _quiet(waiting: int, drained: int, burst_start: int) -> bool:
        """Has the process nothing queued on this GPU?

        Yes if a thread waits on the word (the gate drained before waiting), or a sync that covered
        every launch came after its last burst opened (the gate stores the opening's time, its one
        clock read, and drained_ns only for such a sync: hook/launch.c). Exact at any look, so a
        service that answered a request and paused between two looks is idle at the next one; a
        process in a long synchronisation, or with other streams still running, is busy.
        """
        return waiting > 0 or drained >= burst_start

    def _rescan(self, now: int, assignments: bytes, joined: int) -> None:
        """When a gate began to use this GPU or an assignment changed, and at the net (RESCAN_NET_NS):
        the live slots of the whole table (1024 pids), and among them this GPU's users."""
        slots = self._slots
        live = slots.live()
        gather = _gatherer(live)
        self._live_assignments, self._joined, self._scanned_at = assignments, joined, now
        self.scans += 1
        # This GPU's users (those that launched or wait on it, or were placed on it): the only slots a
        # look reads.
        on_this_gpu = map(operator.and_, gather(slots.gpu_mask), itertools.repeat(1 << self.gpu))
        users = list(itertools.compress(live, map(any, zip(gather(slots.launches), gather(slots.waiting),
                                                           on_this_gpu, strict=True))))
        self._live = live
        if users != self._users:
            self._users, self._gather_users = users, _gatherer(users)
            self._user_groups = None
            self._by_group = None

    def _drain_unfinished(self) -> bool:
        """Does a process of the drained group still have work queued from before the hold (neither a
        thread waiting on its word nor a sync since the hold, nor nothing queued)? As `_observe`
        judges a drain's end, on the drained group's slots only."""
        drain = self._drain
        return drain is not None and self._unfinished(drain.group, drain.hold_at)

    def _unfinished(self, group: int, since: int) -> bool:
        """Does a process of `group` have work queued on this GPU that no sync since `since` covered?"""
        slots = self._slots
        for index in self._slots_of_groups({group}, slots.assignments()):
            pid = slots.pid[index]
            if not pid or slots.assigned_pid[index] != pid or slots.group[index] != group:
                continue
            drained = slots.drained_ns[index]
            if drained < since and not self._quiet(slots.waiting[index], drained, slots.burst_start_ns[index]):
                return True
        return False

    def _slots_of_groups(self, groups: set[int], assignments: bytes) -> list[int]:
        """This GPU's users whose assignment names one of `groups` (whatever their process: the look
        checks that), from a table by group rebuilt only when the users or an assignment changed. Only
        this GPU's: a slot elsewhere has nothing queued here and tells nothing of a drain here (at the
        region's limit a group's slots on the 7 other GPUs were 14 of the 16 a look visited one by one)."""
        by_group = self._by_group
        if by_group is None or assignments != self._by_group_assignments:
            by_group = {}
            for index, group in zip(self._users, self._gather_users(self._slots.group), strict=True):
                by_group.setdefault(group, []).append(index)
            self._by_group, self._by_group_assignments = by_group, assignments
        return [index for group in groups for index in by_group.get(group, ())]

    def _observe(self, now: int) -> Observation:
        """What the gates' slots of this GPU say at `now`: the groups present and wanting the GPU from
        the columns, and from the slots visited one by one (the users whose launches moved, and those
        of the groups whose end the policy waits for), whether those groups ended."""
        assignments = self._slots.assignments()
        self._scan_if_news(now, assignments)
        present, demand, changed = self._read_users(assignments)
        ends = _Ends(self._released, self._drain, self._policy.overrunning())
        indices = set(changed)
        if ends.groups:
            indices.update(self._slots_of_groups(ends.groups, assignments))
        shared, since = self._shared, self._looked_at
        shared_busy = dict.fromkeys(shared, 0)
        if shared:
            indices.update(self._slots_of_groups(set(shared), assignments))
        for index in indices:
            look = self._visit(index, now)
            if look is None:
                continue
            if look.launched or look.waits > 0:
                present.add(look.group)
            if look.waits > 0 or look.moved:
                demand.add(look.group)
            ends.add(look)
            if look.group in shared:
                # The bursts it closed since the last visit, and the part of its open one since the last look.
                open_ns = now - max(look.burst_start, since) if not look.quiet and look.burst_start else 0
                shared_busy[look.group] += look.busy_added + max(0, open_ns)
        self._forget_freed()
        self._looked_at = now
        return ends.observation(now, demand, present, self._crowded, shared_busy)

    def _scan_if_news(self, now: int, assignments: bytes) -> None:
        """Scan the table for users when the doorbells' count of new users or an assignment moved, or
        at the net. A process's first launch here sets its gpu_mask bit and counts itself in `joined`
        before its thread waits (and rings, once), and the agent's keeper assigns a slot before its
        first launch passes attach: not at every ring (two a switch)."""
        joined = self._bells.joined(self.gpu)
        if (now - self._scanned_at >= self._rescan_ns or joined != self._joined
                or assignments != self._live_assignments):
            self._rescan(now, assignments, joined)

    def _read_users(self, assignments: bytes) -> tuple[set[int], set[int], Iterable[int]]:
        """The groups present (launched or waiting) and wanting the GPU (waiting) from three columns of
        this GPU's users read at C speed, and the users to visit one by one: those whose launches moved,
        or all of them where a pid, an assignment or the quotas changed. Each user's group (its
        assignment where that names its process, and scheduled here) is kept while none of those
        changed: a user whose launches did not move tells nothing that the columns do not say."""
        slots, gather = self._slots, self._gather_users
        launches, waiting, pids = gather(slots.launches), gather(slots.waiting), gather(slots.pid)
        user_groups = self._user_groups
        if (user_groups is None or pids != self._user_pids or assignments != self._user_assignments
                or self._scheduled is not self._user_scheduled):
            scheduled, unassigned = self._scheduled, rg.GROUP_UNASSIGNED
            user_groups = tuple(group if pid and owner == pid and group in scheduled else unassigned
                                for pid, owner, group in zip(pids, gather(slots.assigned_pid), gather(slots.group),
                                                             strict=True))
            self._user_groups, self._user_pids = user_groups, pids
            self._user_jobs = tuple((group, self._jobs.of(index, pid))
                                    for index, pid, group in zip(self._users, pids, user_groups, strict=True))
            self._active_users = None
            self._user_assignments, self._user_scheduled = assignments, self._scheduled
            changed: Iterable[int] = self._users  # look at each once: their first sight, or a new group
        elif launches != self._user_launches:
            changed = itertools.compress(self._users, map(operator.ne, launches, self._user_launches))
        else:
            changed = ()
        self._user_launches = launches
        demand = set(itertools.compress(user_groups, waiting))
        present = set(itertools.compress(user_groups, launches)) | demand
        present.discard(rg.GROUP_UNASSIGNED)
        demand.discard(rg.GROUP_UNASSIGNED)
        # The jobs present, and the groups with several processes here: worked out again only when a user
        # starts (or stops) launching or waiting, or the users' groups or jobs changed; not at every look (a
        # set of 128 pairs at the region's limit).
        active = bytes(map(operator.truth, map(operator.or_, launches, waiting)))
        if active != self._active_users:
            self._active_users = active
            counts = collections.Counter(itertools.compress(user_groups, active))
            self._crowded = frozenset(g for g, n in counts.items() if n > 1 and g != rg.GROUP_UNASSIGNED)
            if self._gang is not None:
                jobs = frozenset(pair for pair in itertools.compress(self._user_jobs, active)
                                 if pair[0] != rg.GROUP_UNASSIGNED)
                if jobs != self._present_jobs:
                    self._present_jobs = jobs
        return present, demand, changed

    def _visit(self, index: int, now: int) -> _SlotLook | None:
        """One slot read field by field (None: freed, or of no group scheduled here), remembering its
        launches and busy time for the next visit."""
        slots = self._slots
        pid = slots.pid[index]
        if not pid:
            return None  # freed since the last scan
        group = slots.group[index] if slots.assigned_pid[index] == pid else rg.GROUP_UNASSIGNED
        if group not in self._scheduled:
            return None
        launched = slots.launches[index]
        waits = slots.waiting[index]
        drained = slots.drained_ns[index]
        # Read after drained_ns: a burst that opens between the two reads is seen open (the gate
        # stores its start before counting its first launch).
        burst_start = slots.burst_start_ns[index]
        busy = slots.busy_ns[index]
        slot = self._seen.get(index)
        if slot is None or slot.pid != pid:
            # First sight (a new process, or the agent restarted): work it launched may be queued.
            slot = self._seen[index] = _SlotSeen(pid, launched, busy)
            moved = launched != 0
        else:
            moved = launched != slot.launches
            slot.launches = launched
        busy_added, slot.busy_ns = max(0, busy - slot.busy_ns), busy
        # When it finished: its last drain, unless it had work after that and is quiet only because a
        # thread now waits on its word: a process with work on several streams whose stream sync
        # closed its burst stores no drain time (hook/launch.c, synced), and its old one would make
        # the drain end before the hold, the whole slice refunded. Then this look is the end.
        finished = now if waits > 0 and drained < burst_start else drained
        return _SlotLook(group, launched, waits, drained, burst_start, moved, busy_added,
                         self._quiet(waits, drained, burst_start), finished)

    def _forget_freed(self) -> None:
        """Drop what visits remembered of slots no longer live."""
        seen = self._seen
        if len(seen) > len(self._live):
            known = set(self._live)
            for index in [i for i in seen if i not in known]:
                del seen[index]

    def _carry_out(self, now: int, decision: Decision) -> None:
        if decision.draining is not None and self._drain is None:
            # Hold it first: its next launch drains (the gate synchronises) and then waits.
            self.region.hold(self.gpu, decision.draining)
            self._drain = _Drain(decision.draining, now)
            self.switches += 1
            self._released = None
        elif decision.draining is None:
            self._drain = None
        if decision.released != self._released:
            if (self._released is not None and self._released not in decision.beside
                    and self._released not in decision.shared):
                self.region.hold(self.gpu, self._released)
            self._released = decision.released
        # Before the release below: every sync of the group's slice sees that it is to ring.
        self._set_ringing(decision.released if decision.quiet_rings else None)
        self._carry_out_beside(decision.beside)
        self._carry_out_shared(decision.shared)
        self._short_queue = decision.short_queue
        self._outranked = decision.outranked
        self._wake_on_wait = decision.wake_on_wait
        if decision.released is not None:
            if decision.released in self._opportunistic:
                self.region.set_beside(self.gpu, decision.released, ())  # (no production present)
            # Also when only the queue's bound changed (a no-op when the word already says it).
            self.region.release(self.gpu, decision.released, self._released_word())

    def _set_ringing(self, group: int | None) -> None:
        if group == self._ringing:
            return
        if self._ringing is not None:
            self.region.set_ring_quiet(self.gpu, self._ringing, False)
        if group is not None:
            self.region.set_ring_quiet(self.gpu, group, True)
        self._ringing = group

    def _carry_out_shared(self, shared: frozenset[int]) -> None:
        """Release the groups that share the GPU, each with the long queue of a group alone; those that no
        longer do are held, but the one released. Why not the short queue: its gate waits on an event half-way
        through its queue, and where another process's kernels run between its own that wait comes late and
        leaves it nothing queued; on the simulated GPUs a job beside a single-GPU job did 0.29 of its solo
        with it and 0.55 with the long queue, as without gemtrace. What a group has queued when the sharing
        ends runs on, charged to it (the policy's overrun), beside the group released then."""
        for group in self._shared - shared:
            if group in self._scheduled and group != self._released:
                self.region.hold(self.gpu, group)
        self._shared = shared
        for group in shared:
            self.region.release(self.gpu, group, _SHARED_WORD)

    def _carry_out_beside(self, beside: frozenset[int]) -> None:
        """Release the opportunistic groups beside production (RELEASED_BESIDE), naming the slots of
        this GPU's production processes to their gates; those no longer beside are held, for the
        policy to schedule them as any group."""
        for group in self._beside - beside:
            if group in self._scheduled and group != self._released:
                self.region.hold(self.gpu, group)
        self._beside = beside
        if not beside:
            return
        groups = self._user_groups or ()
        production = [index for index, group, launched in zip(self._users, groups, self._user_launches, strict=False)
                      if launched and group != rg.GROUP_UNASSIGNED and group not in beside]
        for group in beside:
            self.region.set_beside(self.gpu, group, production)
            self.region.release(self.gpu, group, rg.RELEASED_BESIDE)

    def _released_word(self) -> int:
        """The released group's word: its queue bounded by how soon it may be held (a group that
        outranks it waits on that drain; a hold is coming; none in sight, where the bound only keeps a
        newcomer's first wait short: a process that never syncs would queue seconds). An opportunistic
        group's is the one it has beside production, with no production named: a production
        process's first request then waits for half a millisecond of its work, not for 100 ms."""
        if self._released in self._opportunistic:
            return rg.RELEASED_BESIDE
        return (rg.RELEASED_OUTRANKED if self._outranked else rg.RELEASED_SHORT_QUEUE if self._short_queue
                else rg.RELEASED_LONG_QUEUE)

    def _assert_words(self) -> None:
        """Put back any word that says other than this scheduler means: one strided read of 64 words
        and one comparison with what they should say (kept while the decision stays) when nothing was
        forged."""
        released = self._released_word()
        key = (self._scheduled, self._released, self._short_queue, self._outranked, self._beside, self._opportunistic,
               self._shared)
        if self._expected_words is None or self._expected_words[0] != key:
            self._expected_words = (key, [rg.RELEASED if group not in self._scheduled else
                                          released if group == self._released else
                                          rg.RELEASED_BESIDE if group in self._beside else
                                          _SHARED_WORD if group in self._shared else rg.HELD
                                          for group in range(len(self._held))])
        words = self._held.tolist()
        if words == self._expected_words[1]:
            return
        for group, word in enumerate(words):
            if group not in self._scheduled:
                if word != rg.RELEASED:
                    self.region.release(self.gpu, group)
            elif group == self._released:
                if word != released:
                    self.region.release(self.gpu, group, released)
            elif group in self._beside:
                if word != rg.RELEASED_BESIDE:
                    self.region.release(self.gpu, group, rg.RELEASED_BESIDE)
            elif group in self._shared:
                if word != _SHARED_WORD:
                    self.region.release(self.gpu, group, _SHARED_WORD)
            elif word != rg.HELD:
                self.region.hold(self.gpu, group)
