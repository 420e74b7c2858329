"""Gang turns: a group whose processes use several GPUs takes its turns on all of them at once.

Each GPU has its own scheduler and policy (gemtrace/agent/scheduler.py, gemtrace/agent/policy.py). A job spread over
GPUs (a DistributedDataParallel run: one rank per GPU, an all-reduce at every step) makes progress only
while all its ranks run: a rank released on one GPU reaches its collective and spins there, charged, until
the rank held back on another GPU runs. Scheduled on independent clocks, such a job did under 1% of its
work at MaxUtil 0.3 (docs/scheduler.md, "Groups that span GPUs").

This module owns which such groups' turns are open. The unit of turns is the group; what makes it a gang is
a job of it (`JobKeys`: one distributed run, pod or `gemtrace run`, as membership reads it once per process)
with live processes (launched or waiting) on two GPUs or more: the group is a gang on the GPUs of such
jobs, and independent jobs of one group on one GPU each are scheduled by each GPU alone. Its turn is closed (barred on
every GPU of it: no policy releases it) until every GPU on which it wants time would choose it by its own
rules, and every other GPU of it could release it (`Decision.ready`); then it opens. First it clears:
each GPU of it holds its holder and releases nobody until it is clear (`Decision.clear`: the holder
drained); then it goes (due on every GPU of it: released there at once, whether it asks or not: a process
blocked in a collective asks for nothing). So the group's processes start together: one released first
would run into its collective and spin there, charged, while its peer's GPU still drains. It stays open
until one of its GPUs holds it again while it has work there, for any of its own reasons (its slice ended,
its MaxUtil credit ran out). A process held in the middle of a collective that a peer, held first,
never joins is `stranded` (draining where another GPU of its group holds it done): its drain ends when
seen, charged no further.
A GPU is in one open turn at a time. So each GPU's MinUtil, MaxUtil, Priority and fairness still decide
how much time the group gets there, and the turns only line up in time. A group present on one GPU is
never barred nor due: its scheduling is the single GPU's, unchanged.

Pure bookkeeping behind one lock: the schedulers report after each look (`report`) and read their barred and
due groups before the next (`view`); it never touches the region. A change of turn is announced through
`wake(gpu)`, the GPU's doorbell, so that a scheduler asleep on it looks at once.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

__all__ = ["NO_JOB", "GangTurns", "GpuReport", "JobKeys", "Turns"]

log = structlog.get_logger("gemtrace.gang")


@dataclass(frozen=True)
class GpuReport:
    """What one GPU's scheduler saw and decided at its last look."""

    present: frozenset[int] = frozenset()  # groups with a live process on this GPU
    demand: frozenset[int] = frozenset()  # groups that want this GPU now
    ready: frozenset[int] = frozenset()  # barred groups this GPU would release now (Decision.ready)
    released: int | None = None  # the group released here (None: all held)
    clear: bool = False  # nobody released or draining here, or only the clearing group (Decision.clear)
    draining: int | None = None  # the group held here whose queued work still runs
    # The groups clearing in the view this look decided on: its `ready` speaks for their turns only then.
    clearing: frozenset[int] = frozenset()
    # (group, job) of the live processes here (JobKeys' numbers); a group present without one counts
    # as its job NO_JOB, the job of its processes that name none.
    jobs: frozenset[tuple[int, int]] = frozenset()
    # Groups held here earlier whose queued work still runs past the drain timeout (the policy's overrun).
    overrunning: frozenset[int] = frozenset()
    # By its own groups, this GPU would let the driver share it (Decision.sharable): a gang all of whose
    # GPUs would is no gang (no turns), and shares each of them with their other groups.
    sharable: bool = False


@dataclass(frozen=True)
class Turns:
    """One GPU's view of the groups that span GPUs (Observation.barred, .clearing and .due)."""

    barred: frozenset[int] = frozenset()
    clearing: frozenset[int] = frozenset()
    due: frozenset[int] = frozenset()
    pending: frozenset[int] = frozenset()  # due, not yet released here in this turn
    stranded: frozenset[int] = frozenset()  # barred, draining here, held and done on another GPU of it

    def __bool__(self) -> bool:
        return bool(self.barred or self.clearing or self.due)


NO_TURNS = Turns()
NO_JOB = 0  # the job of a group's processes that name none: together, as one job


class JobKeys:
    """Which job each gated process is in, by slot: written by membership when it places a process (before
    the assignment that makes the schedulers look), read by every GPU's scheduler without a lock (the
    table is replaced whole). A job's key becomes a number, the same for the same key while a slot holds
    it; a key no slot holds is forgotten (every `gemtrace run` names a new one: kept, they would grow
    with the runs of the agent's lifetime)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: dict[str, tuple[int, int]] = {}  # key -> (its number, how many slots hold it)
        self._next = NO_JOB + 1
        self._by_slot: dict[int, tuple[int, int, str]] = {}  # slot -> (pid, job, key)

    def record(self, slot: int, pid: int, key: str) -> None:
        """The job of the process `pid` in `slot`: `key` (membership.job_of's; "" for none)."""
        with self._lock:
            by_slot = dict(self._by_slot)
            self._release(by_slot.pop(slot, None))
            job = NO_JOB
            if key:
                if key in self._jobs:
                    job, holders = self._jobs[key]
                else:
                    job, holders, self._next = self._next, 0, self._next + 1
                self._jobs[key] = (job, holders + 1)
            by_slot[slot] = (pid, job, key)
            self._by_slot = by_slot

    def forget(self, slot: int) -> None:
        with self._lock:
            if slot in self._by_slot:
                by_slot = dict(self._by_slot)
                self._release(by_slot.pop(slot))
                self._by_slot = by_slot

    def of(self, slot: int, pid: int) -> int:
        """The job of the process `pid` in `slot` (NO_JOB: none recorded for that process)."""
        entry = self._by_slot.get(slot)
        return entry[1] if entry is not None and entry[0] == pid else NO_JOB

    def __len__(self) -> int:
        """The keys held: for tests."""
        return len(self._jobs)

    def _release(self, entry: tuple[int, int, str] | None) -> None:
        """A slot's entry no longer holds its key: the key goes with its last holder."""
        if entry is None or not entry[2]:
            return
        job, holders = self._jobs[entry[2]]
        if holders > 1:
            self._jobs[entry[2]] = (job, holders - 1)
        else:
            del self._jobs[entry[2]]


# One GPU's part of the turns: its barred, clearing, due and pending groups (Turns' first four).
_TurnView = tuple[frozenset[int], frozenset[int], frozenset[int], frozenset[int]]
_GONE = GpuReport()  # a GPU whose scheduler stopped


@dataclass
class _Turn:
    gpus: frozenset[int]  # the gang's GPUs when the turn opened (a GPU it starts to use joins)
    clearing_on: frozenset[int]  # its GPUs when it opened: they clear first
    go: bool = False  # every one of them cleared: the group is due on all its GPUs
    seen: set[int] = field(default_factory=set)  # GPUs that reported since it opened (saw it clearing)
    released_on: set[int] = field(default_factory=set)  # GPUs that released the group in this turn


class GangTurns:
    """The open turns of the groups that span GPUs, shared by every GPU's scheduler. Thread-safe."""

    def __init__(self, wake: Callable[[int], None] = lambda gpu: None) -> None:
        self._wake = wake
        self._lock = threading.Lock()
        self._reports: dict[int, GpuReport] = {}
        self._open: dict[int, _Turn] = {}
        # The groups that had a turn, the one whose last turn opened longest ago first.
        self._last_opened: dict[int, None] = {}
        # Replaced whole at each report, never changed in place: `view` reads it without the lock, which
        # every GPU's every look would otherwise queue on behind another GPU's report.
        self._views: dict[int, Turns] = {}
        self._gangs: frozenset[int] = frozenset()  # the groups that spanned GPUs at the last report
        # Per GPU, the groups with a job spanning it and another GPU, in turns or sharing (`spanning_on`), and
        # the members they came from; replaced whole, read without the lock.
        self._spanning_on: dict[int, frozenset[int]] = {}
        self._spanning_from: dict[int, frozenset[int]] | None = None
        # `_unshared`'s last answer: (the members it came from, the sharable GPUs, the members that take turns).
        self._unshared_of: tuple[dict[int, frozenset[int]], frozenset[int], dict[int, frozenset[int]]] | None = None
        # `_members` walks every group on every GPU (63 x 8 at the region's limit): kept while no GPU's
        # (group, job) pairs change (`_pairs_changed`), which is as processes come and go; its demand
        # changes at nearly every look. Per GPU: its jobs, the groups they name, and the groups present
        # or wanting it that name none.
        self._members_cache: dict[int, frozenset[int]] | None = None
        self._pairs: dict[int, tuple[frozenset[tuple[int, int]], frozenset[int], frozenset[int]]] = {}
        # The gangs on each GPU (all barred where no turn is open) and by the GPUs they span, kept with
        # the members they came from (`_gangs_placed`).
        self._placed: tuple[dict[int, frozenset[int]], dict[int, frozenset[int]],
                            dict[frozenset[int], frozenset[int]]] | None = None
        self._turn_views_of: tuple[object, ...] | None = None
        self._turn_views: dict[int, _TurnView] = {}
        # What the views were last worked out from (`_views_unchanged`): the turn views, and the open
        # turns' groups (the stranded groups also read the reports, checked against the last report).
        self._views_from: tuple[dict[int, _TurnView], frozenset[int]] | None = None
        self.turns = 0  # turns opened so far, for tests and benches

    def view(self, gpu: int) -> Turns:
        """The groups spanning GPUs barred on this GPU (turn closed), clearing and due (turn open)."""
        return self._views.get(gpu, NO_TURNS)

    def spanning_on(self, gpu: int) -> frozenset[int]:
        """The groups with a job on this GPU and another, whether they take turns or share (Observation.spanning)."""
        return self._spanning_on.get(gpu, frozenset())

    def report(self, gpu: int, report: GpuReport) -> bool:
        """A GPU's look: closes the turns it ended, opens those every GPU consents to. True if this
        GPU's view changed (the caller decides again before carrying out its decision)."""
        with self._lock:
            previous = self._reports.get(gpu)
            self._reports[gpu] = report
            if previous == report and not self._open:
                return False
            if self._pairs_changed(gpu, report):
                self._members_cache = None
            before = self._views
            spanning = self._members()
            members = self._unshared(spanning)
            changed = self._spanning_changed(spanning)
            # A GPU sees a turn clearing when it decided on a view that says so: a look that read its view
            # before another GPU's report opened the turn reports the readiness of a barred group, which
            # would close the turn at once (8 of 10 turns at the region's limit: turns opened and closed
            # 40 times a second, each waking every GPU of it).
            for group, turn in self._open.items():
                if group in report.clearing:
                    turn.seen.add(gpu)
            for group, turn in list(self._open.items()):
                why = ("shared" if group in spanning and group not in members
                       else self._turn_over(group, turn, members.get(group, frozenset())))
                if why:
                    del self._open[group]
                    changed |= turn.gpus | members.get(group, frozenset())
                    log.debug("gang_turn_over", group=group, why=why, reported_by=gpu, went=turn.go)
                    continue
                turn.gpus |= members.get(group, frozenset())
                if not turn.go and turn.seen >= turn.clearing_on and all(
                        self._reports[g].clear and group in self._reports[g].ready for g in turn.clearing_on
                        if g in self._reports):
                    turn.go = True
                    changed |= turn.gpus
                    log.debug("gang_turn_goes", group=group, gpus=sorted(turn.gpus))
            changed |= self._open_turns(members)
            self._gangs = frozenset(members)
            if not self._views_unchanged(members, previous, report):
                self._views = self._compute_views(members)
                changed |= {g for g in self._views.keys() | before.keys() if self._views.get(g) != before.get(g)}
        for other in changed - {gpu}:
            self._wake(other)
        return gpu in changed

    def forget(self, gpu: int) -> None:
        """A scheduler stopped: its GPU no longer counts in any gang."""
        with self._lock:
            self._reports.pop(gpu, None)
            self._pairs.pop(gpu, None)
            self._members_cache, self._turn_views_of, self._views_from = None, None, None
            self._views = {g: turns for g, turns in self._views.items() if g != gpu}
            self._spanning_on = {g: groups for g, groups in self._spanning_on.items() if g != gpu}
            self._spanning_from = None

    def open_turns(self) -> dict[int, frozenset[int]]:
        """Each group whose turn is open (clearing or going) and its GPUs."""
        with self._lock:
            return {group: turn.gpus for group, turn in self._open.items()}

    # -- under the lock ----------------------------------------------------------------------------

    def _spanning_changed(self, spanning: dict[int, frozenset[int]]) -> set[int]:
        """`spanning_on` brought up to `spanning` (the groups with a job over several GPUs); the GPUs whose
        groups changed (they may share now, or take turns again)."""
        if spanning is self._spanning_from:
            return set()
        on: dict[int, set[int]] = {}
        for group, gpus in spanning.items():
            for gpu in gpus:
                on.setdefault(gpu, set()).add(group)
        before, self._spanning_from = self._spanning_on, spanning
        self._spanning_on = {gpu: frozenset(groups) for gpu, groups in on.items()}
        return {gpu for gpu in before.keys() | self._spanning_on.keys()
                if before.get(gpu) != self._spanning_on.get(gpu)}

    def _unshared(self, members: dict[int, frozenset[int]]) -> dict[int, frozenset[int]]:
        """The gangs of `members` that take turns: those with a GPU that would not share (Decision.sharable).
        One whose every GPU would is scheduled on each like a group of that GPU alone, its ranks released
        together with the others there: the driver's time slicing runs each rank in its neighbours' gaps, and
        no rank waits for a turn that its peer's GPU has not given. The same dict while nothing changed."""
        sharable = frozenset(gpu for gpu, report in self._reports.items() if report.sharable)
        if not sharable:
            return members
        kept = self._unshared_of
        if kept is None or kept[0] is not members or kept[1] != sharable:
            turns = {group: gpus for group, gpus in members.items() if not gpus <= sharable}
            kept = self._unshared_of = (members, sharable, members if len(turns) == len(members) else turns)
        return kept[2]

    def _pairs_changed(self, gpu: int, report: GpuReport) -> bool:
        """Did the GPU's (group, job) pairs change with `report` (its jobs, and the groups present or
        wanting it that no job names, each of job NO_JOB)? The groups its jobs name are worked out again
        only when its jobs changed."""
        jobs = report.jobs
        kept = self._pairs.get(gpu)
        if kept is not None and (kept[0] is jobs or kept[0] == jobs):
            named = kept[1]
        else:
            named = frozenset(group for group, _ in jobs)
        unnamed = (report.present | report.demand) - named
        self._pairs[gpu] = (jobs, named, unnamed)
        return kept is None or kept[1] is not named or kept[2] != unnamed

    def _members(self) -> dict[int, frozenset[int]]:
        """Each group with a job present on two GPUs or more, and the GPUs of its such jobs (kept while
        no GPU's pairs change: `_pairs_changed`)."""
        if self._members_cache is not None:
            return self._members_cache
        where: dict[tuple[int, int], set[int]] = {}
        for gpu, (jobs, _, unnamed) in self._pairs.items():
            for pair in itertools.chain(jobs, ((group, NO_JOB) for group in unnamed)):
                where.setdefault(pair, set()).add(gpu)
        members: dict[int, set[int]] = {}
        for (group, _), gpus in where.items():
            if len(gpus) > 1:
                members.setdefault(group, set()).update(gpus)
        self._members_cache = {group: frozenset(gpus) for group, gpus in members.items()}
        return self._members_cache

    def _turn_over(self, group: int, turn: _Turn, gpus: frozenset[int]) -> str:
        """Why the group's open turn is over ("": it is not). It no longer spans GPUs; or a GPU that
        released it in this turn holds it again while it has work there (one that held it for being
        quiet lets the others go on); or it wants none of its GPUs and none holds it (its processes went
        to CPU work, or exited)."""
        if len(gpus) < 2:
            return "one gpu"
        if not turn.go:
            # Clearing: over where it no longer wants any GPU, or a GPU that saw it clearing no longer
            # consents (its MaxUtil credit went meanwhile): a turn one GPU cannot give would leave the
            # group's processes on the others spinning in their collectives.
            reports = [self._reports[gpu] for gpu in gpus if gpu in self._reports]
            if not any(group in r.demand or r.released == group for r in reports):
                return "wants no gpu"
            refused = [gpu for gpu in turn.seen if gpu in self._reports and group not in self._reports[gpu].ready]
            return f"gpu {refused[0]} no longer consents" if refused else ""
        released_now = set()
        for gpu in turn.gpus:
            report = self._reports.get(gpu)
            if report is not None and report.released == group:
                released_now.add(gpu)
        held = [gpu for gpu in turn.released_on - released_now if group in self._reports.get(gpu, _GONE).demand]
        if held:
            return f"gpu {held[0]} holds it"
        turn.released_on |= released_now
        if not released_now and not any(group in self._reports[gpu].demand for gpu in gpus if gpu in self._reports):
            return "quiet everywhere"
        return ""

    def _open_turns(self, members: dict[int, frozenset[int]]) -> set[int]:
        """Open the turn of each closed gang that every GPU on which it wants time would release now,
        on GPUs in no other open turn: the one whose last turn is oldest first (one that never had a
        turn before all). Returns the GPUs whose view changed."""
        busy = set().union(*(turn.gpus for turn in self._open.values())) if self._open else set()
        free = self._reports.keys() - busy
        if len(free) < 2:
            return set()  # (a gang's GPUs are two or more of those reporting)
        # Set by set over the gangs that span the same GPUs (one such set at the region's limit), not gang
        # by gang against each GPU's report (63 x 8): a gang may open where it wants one of its GPUs and
        # all of them are ready for it, or (as a job's second process starts) where it is not yet a gang
        # and released on one of them: its turn opens at once, or its process there would spin in its
        # first collective until a turn came.
        may_open: set[int] = set()
        for gpus, gangs in self._gangs_placed(members)[1].items():
            if not gpus <= free:
                continue
            reports = [self._reports[gpu] for gpu in gpus]
            ready = frozenset.intersection(*(r.ready for r in reports))
            wanting = frozenset().union(*(r.demand for r in reports))
            may_open |= gangs & ready & wanting
            may_open |= (gangs & {r.released for r in reports}) - self._gangs
        may_open -= self._open.keys()
        if not may_open:
            return set()
        changed: set[int] = set()
        oldest_first = ([g for g in members if g in may_open and g not in self._last_opened]
                        + [g for g in self._last_opened if g in may_open])
        for group in oldest_first:
            gpus = members[group]
            if not gpus <= free:
                continue
            self._open[group] = _Turn(gpus, gpus)
            log.debug("gang_turn_opens", group=group, gpus=sorted(gpus))
            self._last_opened.pop(group, None)
            self._last_opened[group] = None
            self.turns += 1
            free -= gpus
            changed |= gpus
        return changed

    def _views_unchanged(self, members: dict[int, frozenset[int]], previous: GpuReport | None,
                         report: GpuReport) -> bool:
        """Would `_compute_views` give the views as they are? Yes where the turn views are the ones they
        came from (the same gangs and open turns) and the stranded groups read the same: the same open
        turns, and this GPU's report says what the last did of what it drains, overruns and released
        (the other GPUs' reports did not change since). Most reports change only what a GPU wants and
        would release: at the region's limit, the views and their comparison were half a report's work.
        Where not, it records what the views are now worked out from (the caller works them out)."""
        turn_views = self._turn_views_for(members)
        opened = frozenset(self._open)
        if (self._views_from is None or self._views_from[0] is not turn_views or self._views_from[1] != opened
                or previous is None or previous.draining != report.draining or previous.released != report.released
                or previous.overrunning != report.overrunning):
            self._views_from = (turn_views, opened)
            return False
        return True

    def _compute_views(self, members: dict[int, frozenset[int]]) -> dict[int, Turns]:
        """Per GPU: its turns (`_turn_views`) and the groups stranded on it (`_stranded`); the views of
        GPUs whose parts are unchanged are kept, so that comparing them with the last costs little."""
        turn_views = self._turn_views_for(members)
        stranded = self._stranded(members)
        views: dict[int, Turns] = {}
        for gpu, (barred, clearing, due, pending) in turn_views.items():  # (a stranded group is barred there)
            here = stranded.get(gpu, frozenset())
            old = self._views.get(gpu)
            if (old is not None and old.barred is barred and old.clearing is clearing and old.due is due
                    and old.pending is pending and old.stranded == here):
                views[gpu] = old
            else:
                views[gpu] = Turns(barred, clearing, due, pending, here)
        return views

    def _turn_views_for(self, members: dict[int, frozenset[int]]) -> dict[int, _TurnView]:
        """`_turn_views`, computed again only where the gangs or the open turns changed."""
        key = (members, tuple((group, turn.gpus, turn.clearing_on, turn.go, frozenset(turn.released_on))
                              for group, turn in self._open.items()))
        if key != self._turn_views_of:
            self._turn_views, self._turn_views_of = self._turn_views_now(members), key
        return self._turn_views

    def _turn_views_now(self, members: dict[int, frozenset[int]]) -> dict[int, _TurnView]:
        """Per GPU (barred, clearing, due, pending): a gang with no open turn is barred; one whose turn
        clears, clearing on the GPUs that clear (and barred, not yet released, on its others); one whose
        turn goes, due (and pending where not yet released in this turn). Walks the open turns, not the
        gangs: a GPU in none has its gangs barred, the same set as long as the gangs are the same."""
        gangs_on, _ = self._gangs_placed(members)
        turns_on: dict[int, list[tuple[int, _Turn]]] = {}
        for group, turn in self._open.items():
            gpus = members.get(group)
            if gpus is None:
                continue  # (no longer a gang: `report` ends its turn)
            for gpu in gpus | turn.gpus:
                turns_on.setdefault(gpu, []).append((group, turn))
        views: dict[int, _TurnView] = {}
        for gpu in gangs_on.keys() | turns_on.keys():
            if gpu not in turns_on:
                views[gpu] = (gangs_on[gpu], frozenset(), frozenset(), frozenset())
                continue
            barred = set(gangs_on.get(gpu, frozenset()) - self._open.keys())
            clearing: set[int] = set()
            due: set[int] = set()
            pending: set[int] = set()
            for group, turn in turns_on[gpu]:
                if not turn.go and gpu not in turn.clearing_on:
                    barred.add(group)
                else:
                    (due if turn.go else clearing).add(group)
                    if turn.go and gpu not in turn.released_on:
                        pending.add(group)
            views[gpu] = (frozenset(barred), frozenset(clearing), frozenset(due), frozenset(pending))
        return views

    def _gangs_placed(self, members: dict[int, frozenset[int]]
                      ) -> tuple[dict[int, frozenset[int]], dict[frozenset[int], frozenset[int]]]:
        """The gangs on each GPU, and by the GPUs they span: worked out again only when the gangs changed."""
        if self._placed is None or self._placed[0] is not members:
            on: dict[int, set[int]] = {}
            spanning: dict[frozenset[int], set[int]] = {}
            for group, gpus in members.items():
                spanning.setdefault(gpus, set()).add(group)
                for gpu in gpus:
                    on.setdefault(gpu, set()).add(group)
            self._placed = (members, {gpu: frozenset(groups) for gpu, groups in on.items()},
                            {gpus: frozenset(groups) for gpus, groups in spanning.items()})
        return self._placed[1], self._placed[2]

    def _stranded(self, members: dict[int, frozenset[int]]) -> dict[int, frozenset[int]]:
        """Per GPU, the barred groups still draining there (held, or past the drain timeout) while on
        another of their GPUs they are held and done: the work left where they drain may be a collective
        that waits for that process (a rank that began its next step before the turn ended), which only
        their next turn ends. With more than two ranks, several may wait so at once. Walks the GPUs'
        reports, not the gangs."""
        draining_on: dict[int, list[int]] = {}
        for gpu, report in self._reports.items():
            for group in report.overrunning | ({report.draining} if report.draining is not None else set()):
                draining_on.setdefault(group, []).append(gpu)
        stranded: dict[int, set[int]] = {}
        for group, on in draining_on.items():
            gpus = members.get(group)
            if gpus is None or group in self._open:
                continue
            here = [gpu for gpu in on if gpu in gpus]
            if here and len(here) < len(gpus) and not any(self._reports[gpu].released == group for gpu in gpus):
                for gpu in here:
                    stranded.setdefault(gpu, set()).add(group)
        return {gpu: frozenset(groups) for gpu, groups in stranded.items()}
