"""Which group each gated process is in: decided once, by the agent, and written in the region.

A gate asks (the `requested` name in its slot, from GEMTRACE_GROUP; empty when the variable is unset);
this module decides, on the agent's keeper tick, for every slot whose assignment does not name its
process: the group of a binding Cgroup rule that names the process's cgroup (CgroupBinding: a pod's
group, whatever its processes ask for), else the requested group if the process's owner is admitted
to it (Users=/UnixGroups=, gemtrace/config.py), else the group of a matching Cgroup rule
(gemtrace/groups_of.py), else `default`. A binding rule that comes after a process was placed (the
device plugin learns a pod's cgroup once the kubelet has made it) moves the process at the reload
that brings it (`rebind`). A request refused is logged
(`group_refused`) and counted per group (gemtrace_admission_refusals_total). The owner is the real
uid and the groups of /proc/PID/status, read by the agent: nothing the slot says about itself but
the name it asks for is believed. It also clears the assignment of a slot that changed owner, since
a gate frees its slot at exit but cannot write the region (hook/gemtrace_region.h), and records the
job each placed process is part of (`job_of`), by which the schedulers tell a gang (gemtrace/agent/gang.py).

`decide` is pure; `Membership` is the thin adapter over the region and /proc. It never writes a slot
and never decides anything else (dropped groups' processes are moved by the agent's table pass).
"""

from __future__ import annotations

import dataclasses
import ipaddress
from collections import Counter
from collections.abc import Callable, Container, Iterable, Mapping, Sequence

import structlog

from gemtrace import contract
from gemtrace import region as rg
from gemtrace.agent.gang import JobKeys
from gemtrace.config import GroupConfig
from gemtrace.defaults import DEFAULT_GROUP, ENV_GROUP, ENV_JOB
from gemtrace.eventlog import USER_LINES
from gemtrace.groups_of import ProcReader, bound_group, group_for
from gemtrace.kube.pods import pod_of

log = structlog.get_logger("gemtrace.membership")

# A tick decides at most this many new processes (two /proc reads each), so that a thousand programs
# starting at once cannot delay the heartbeat that shares the keeper's thread; the rest wait a tick
# (their gates count as `default` meanwhile).
DECISIONS_PER_TICK = 128


# Longer job names are cut: a process's environment is its own to fill, the agent's memory is not.
MAX_JOB_KEY = 256


@dataclasses.dataclass(frozen=True)
class Placement:
    """The agent's choice of group for one process, and whether it refused the group asked for."""
    group: str
    refused: bool  # the process asked for a defined group its owner is not admitted to
    bound: bool = False  # a binding Cgroup rule chose the group, whatever the process asked for
    job: str = ""  # the job it is part of (job_of); decide leaves it to the caller, which reads the environment


# The variables by which the launchers of distributed runs tell a rank its run: each rank of one run has
# the same values, another run other ones. Those of torch.distributed (torchrun, DeepSpeed, Kubernetes'
# training operators), torchrun's own, Open MPI 5's (PMIx) and 4's, and Slurm's.
RENDEZVOUS = (("MASTER_ADDR", "MASTER_PORT"), ("TORCHELASTIC_RUN_ID",), ("PMIX_NAMESPACE",),
              ("OMPI_MCA_ess_base_jobid",), ("SLURM_JOB_ID", "SLURM_STEP_ID"))


def job_of(uid: int, environ: Mapping[str, str], cgroups: Sequence[str]) -> str:
    """The job a process is part of, for gang turns (gemtrace/agent/gang.py: a group is a gang on the GPUs
    that one of its jobs spans): the ranks of one distributed run (RENDEZVOUS: however each rank was
    started, one `gemtrace run` or several); else its pod (a pod's containers); else the `gemtrace run`
    that started it (GEMTRACE_JOB, inherited by everything it starts, kept by a `gemtrace run` inside);
    else "" (none: a group's processes that name none are one job). Always of its user: one user's
    processes never join another's job, whatever they name."""
    pod = pod_of(cgroups)
    key = ""
    for names in RENDEZVOUS:
        values = [environ.get(name, "").strip() for name in names]
        if all(values):
            key = " ".join(["rendezvous", *values])
            # A loopback address is its network namespace's own: in two pods, the same one is two runs.
            if pod is not None and names[0] == "MASTER_ADDR" and _loopback(values[0]):
                key = f"pod {pod.pod_uid} {key}"
            break
    if not key:
        run = environ.get(ENV_JOB, "").strip()
        if pod is not None:
            key = f"pod {pod.pod_uid}"
        elif run:
            key = f"run {run}"
        else:
            return ""
    return f"{uid} {key}"[:MAX_JOB_KEY]


def _loopback(address: str) -> bool:
    if address.lower() in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return False


def admitted_to(name: str, uid: int, gids: Iterable[int], groups: Mapping[str, GroupConfig],
                defined: Container[str]) -> bool:
    """Whether a process of `uid`/`gids` may join group `name` at its own request: the group must be
    defined; a group the resource file does not restrict (or one defined without it, by a test
    standing in for the agent) admits everyone."""
    if name not in defined:
        return False
    config = groups.get(name)
    return config is None or config.admits(uid, gids)


def binding_rules(groups: Mapping[str, GroupConfig]) -> dict[str, tuple[str, ...]]:
    """group -> its Cgroup prefixes, for the groups whose rules bind (CgroupBinding)."""
    return {name: g.cgroups for name, g in groups.items() if g.cgroup_binding and g.cgroups}


def decide(requested: str, uid: int, gids: Iterable[int], cgroups: Iterable[str],
           groups: Mapping[str, GroupConfig], defined: Container[str]) -> Placement:
    """The group of a process that asked for `requested` ("" or "default": no wish)."""
    gids, cgroups = list(gids), list(cgroups)
    binding = binding_rules(groups)
    bound = bound_group(cgroups, binding, binding, requested)
    if bound is not None:
        return Placement(bound, False, True)
    rules = {name: g.cgroups for name, g in groups.items() if g.cgroups}
    group = group_for({ENV_GROUP: requested}, cgroups, rules,
                      lambda name: admitted_to(name, uid, gids, groups, defined))
    refused = bool(requested) and requested != group and requested in defined and requested != DEFAULT_GROUP
    return Placement(group, refused)


class Membership:
    """The agent's side: `tick()` decides for the slots that need it and clears stale assignments.
    `groups()` gives the resource file's groups in force (for admission and Cgroup rules)."""

    def __init__(self, region: rg.Region, groups: Callable[[], Mapping[str, GroupConfig]],
                 proc: ProcReader | None = None, per_tick: int = DECISIONS_PER_TICK,
                 jobs: JobKeys | None = None) -> None:
        self.region = region
        self.groups = groups
        self.proc = proc or ProcReader()
        self.per_tick = per_tick
        # Where each placed process's job is recorded, for the schedulers' gang turns (the agent's, shared).
        self.jobs = jobs if jobs is not None else JobKeys()
        self.refusals: Counter[str] = Counter()  # requested group -> refusals, for /metrics
        self._foreign: dict[int, int] = {}  # slot -> the other user's pid it named, logged once
        self._binding: dict[str, tuple[str, ...]] = {}  # the binding rules the last rebind applied

    def tick(self) -> int:
        """Decide for new processes; returns how many were decided."""
        region = self.region
        columns = region.slot_columns
        pids, assigned = columns.pid.tolist(), columns.assigned_pid.tolist()
        if pids == assigned:
            return 0  # every tick, mostly: one comparison at C speed
        stale = [i for i, (p, a) in enumerate(zip(pids, assigned, strict=True)) if p != a]
        if not stale:
            return 0
        defined = region.defined_groups()
        groups = self.groups()
        decided = 0
        for index in stale:
            pid = pids[index]
            if not pid:
                region.unassign(index)  # the gate freed its slot at exit
                self.jobs.forget(index)
                continue
            if not columns.flags[index] & contract.SLOT_GATED or decided >= self.per_tick:
                continue  # the gate is still filling its slot; or enough for this tick
            decision = self._decide(index, pid, groups, defined)
            if decision is None:
                continue  # gone, or not (yet) the pid the agent knows it by: the reaper frees or translates it
            group = defined.get(decision.group)
            if group is None:
                continue  # no default group defined (a test standing in for the agent): stays unassigned
            self.jobs.record(index, pid, decision.job)  # before the assignment, which makes the schedulers look
            region.assign(index, pid, group)
            decided += 1
        return decided

    def adopt_jobs(self) -> int:
        """Record the job of every process already placed in an adopted region (an agent before this
        one placed it; its jobs were that agent's memory); returns how many. Call once, at start."""
        adopted = 0
        for index in self.region.slot_groups():
            pid = self.region.slots[index].pid
            credentials = self.proc.credentials(pid) if pid else None
            if credentials is None:
                continue  # gone: the reaper frees its slot
            self.jobs.record(index, pid, self._job(pid, credentials.uid, self.proc.cgroups(pid) or []))
            adopted += 1
        return adopted

    def _job(self, pid: int, uid: int, cgroups: Sequence[str]) -> str:
        """job_of the process, from its environment at its start (/proc/PID/environ)."""
        return job_of(uid, self.proc.environ(pid) or {}, cgroups)

    def rebind(self) -> int:
        """After a reload: move every placed process that a binding Cgroup rule, new since the last
        call, names into that rule's group; returns how many moved. Call with the resource file's
        new groups in force and the region's table written from them."""
        binding = binding_rules(self.groups())
        if binding == self._binding:
            return 0  # every decision since the last call already followed these rules
        region = self.region
        defined = region.defined_groups()
        moved = 0
        for index, group in region.slot_groups().items():
            pid = region.slots[index].pid
            requested = rg.decode_name(region.slots[index].requested).strip()
            bound = bound_group(self.proc.cgroups(pid) or [], binding, binding, requested)
            target = defined.get(bound) if bound is not None else None
            if target is None or target == group:
                continue
            if region.move_slot(index, pid, group, target):
                moved += 1
                log.info("process_bound_to_group", pid=pid, slot=index, group=bound,
                         reason="a binding Cgroup rule names its cgroup")
        self._binding = binding  # last: a pass that raised is tried again at the next reload
        return moved

    def _decide(self, index: int, pid: int, groups: Mapping[str, GroupConfig],
                defined: Mapping[str, int]) -> Placement | None:
        # A gate in a container's PID namespace stored its pid there, which here may be another
        # process: decide only once the start times agree (the reaper gives such a slot its host pid).
        recorded = self.region.slots[index].start_time
        if recorded and self.proc.start_time(pid) != recorded:
            return None
        credentials = self.proc.credentials(pid)
        if credentials is None:
            return None
        uid, gids = credentials.uid, credentials.gids
        # A slot's pid is its gate's word, written in a chunk of the user the socket gave it to: a pid
        # of another user's process there is forged (or the process changed user since), and is not
        # decided for. Its slot's figures stay its writer's own; the reaper frees it when that pid exits.
        owner = int(self.region.layout.chunk_owner[index // contract.CHUNK_SLOTS])
        if owner != contract.NO_OWNER and owner not in credentials.uids:
            if self._foreign.get(index) != pid:
                self._foreign[index] = pid
                USER_LINES.log(log.warning, owner, "slot_names_another_users_process", slot=index, pid=pid,
                               chunk_owner=owner, uid=uid,
                               consequence="not placed in a group; only a process of the chunk's user is")
            return None
        requested = rg.decode_name(self.region.slots[index].requested).strip()
        cgroups = self.proc.cgroups(pid) or []
        decision = dataclasses.replace(decide(requested, uid, gids, cgroups, groups, defined),
                                       job=self._job(pid, uid, cgroups))
        if decision.bound and requested not in ("", DEFAULT_GROUP, decision.group):
            USER_LINES.log(log.info, uid, "group_request_overruled", pid=pid, requested=requested,
                           assigned=decision.group, consequence="its cgroup is bound to the assigned group "
                           "(CgroupBinding); GEMTRACE_GROUP cannot take it out")
        if decision.refused:
            self.refusals[requested] += 1
            USER_LINES.log(log.warning, uid, "group_refused", pid=pid, requested=requested,
                           assigned=decision.group, consequence="the process is scheduled and limited in the "
                           "assigned group; admit its user with Users= or UnixGroups= in the resource file")
        return decision


def group_of(pid: int, environ: Mapping[str, str], proc: ProcReader, region: rg.Region | None,
             groups: Mapping[str, GroupConfig]) -> tuple[str, bool]:
    """The group the agent counts process `pid` in (the accounting, eBPF's figures, /metrics): its
    assignment when it has a slot, else the same decision for an ungated process from the group its
    environment asks for. The flag is False while a gated process awaits its assignment (it counts
    as `default` meanwhile, as its gate does): ask again later."""
    if region is not None:
        pids = region.slot_columns.pid.tolist()
        if pid in pids:
            index = pids.index(pid)
            assigned = region.assigned_group(index, pid)
            name = region.group_names().get(assigned) if assigned is not None else None
            return (DEFAULT_GROUP, False) if name is None else (name, True)
    credentials = proc.credentials(pid)
    uid, gids = (credentials.uid, credentials.gids) if credentials else (-1, [])  # gone: admitted nowhere restricted
    requested = environ.get(ENV_GROUP, "").strip()
    return decide(requested, uid, gids, proc.cgroups(pid) or [], groups, groups).group, True
