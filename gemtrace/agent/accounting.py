"""Accounting: what every process on the host does with the GPUs, from eBPF, the gates and NVML.

Owns the per-process view (Snapshot) and what it keeps across polls for it: GPU time shared within a
group, NVML's time integrated, and each process's last merge and account, kept while its figures and
facts stay the same (a poll makes anew only what changed). A process is in a snapshot only while it
runs: one whose /proc entry is gone, a zombie, or one whose pid now names another process (another
start time) is left out at the next poll, whatever a source still says of it (its series leave
/metrics within a poll). It merges the three sources it is given behind one interface
(gemtrace/sources/: eBPF, the gates' slots, NVML; the agent opens the host's,
gemtrace.agent.agent.open_accounting, a test passes fakes) with gemtrace/agent/merge.py, whose
functions are docs/accounting.md's table "Sources, best first", row by row.
The enforcement it is given (gemtrace/agent/enforcement.py, at start()) subscribes: to eBPF's allocation
events (the source's thread wakes it within milliseconds) and to each snapshot (the audit of the
slots). Without eBPF (bcc cannot run, or disabled) ebpf_status says why and the gates and NVML still
count.

The parts it leans on, each a module of its own: each process's facts (gemtrace/agent/process_facts.py:
group, GPUs, start time, kept while it lives); the memory eBPF never saw, rebuilt for inherited
processes (gemtrace/agent/inherited.py: memory = max(eBPF, rebuilt), and the enforcer acts on it at once);
the verified memory and trust it writes to the region (gemtrace/agent/verified.py, issue 25). A group's
processes are never given more GPU time together than the scheduler gave the group (GpuTimeShare):
a burst measured by the gate also holds the time it waited behind the group's other processes.
Never kills but through the enforcement it is given; never reads bcc, the slots or NVML but through
a source.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from gemtrace.agent import merge
from gemtrace.agent.enforcement import Enforcement, Holding
from gemtrace.agent.gpu_time import GpuTimeShare
from gemtrace.agent.inherited import InheritedMemory
from gemtrace.agent.merge import Merged
from gemtrace.agent.process_facts import Facts, ProcessFacts, Rules, inherited
from gemtrace.agent.snapshot import ProcessAccount, Snapshot
from gemtrace.agent.verified import VerifiedMemory
from gemtrace.groups_of import ProcReader
from gemtrace.region import Region
from gemtrace.sources import AllocationSource, Key, Source, SourceReading
from gemtrace.sources.ebpf import EbpfSource, boot_ticks
from gemtrace.sources.ebpf.probes import BpfProbes
from gemtrace.sources.nvml import NvmlSource


@dataclass
class _Seen:
    """A live process on one GPU as the last poll left it. Most processes show the figures they showed
    a second before (at the region's limit most groups wait their turn of the GPU: 9 slots in 10 are
    unchanged from one poll to the next), and a gated one whose figures and facts are the same keeps
    its merge, its GPU time (its group had nothing new to pay it: GpuTimeShare) and its account: each
    poll makes these anew only for what changed."""

    inputs: merge.Inputs  # what its merge read
    merged: Merged
    facts: Facts
    account: ProcessAccount
    nvml_seconds: float = 0.0  # NVML's time integrated (an ungated process)


@dataclass
class _Change:
    """A live process whose account a poll makes anew: first seen, its figures or facts changed, or
    ungated (NVML's time grows)."""

    key: Key
    inputs: merge.Inputs
    merged: Merged
    facts: Facts
    before: _Seen | None  # as the last poll left it (None: first seen)
    nvml_seconds: float = 0.0  # NVML's time integrated, this poll's included (an ungated process)


def _suspended_ns() -> int:
    """CLOCK_BOOTTIME - CLOCK_MONOTONIC: the time the host spent suspended."""
    return time.clock_gettime_ns(time.CLOCK_BOOTTIME) - time.monotonic_ns()


def _monotonic_of_ticks(ticks: int | None, suspended_ns: int) -> int:
    """A /proc start time as CLOCK_MONOTONIC ns (eBPF's clock); 0 when not known. `suspended_ns`
    is read once per look, so that processes started in the same tick stay equal (then an ungated
    one goes before a gated one, docs/accounting.md) rather than ordered by the clocks' jitter."""
    if ticks is None:
        return 0
    since_boot_ns = ticks * 1_000_000_000 // os.sysconf("SC_CLK_TCK")
    return max(0, since_boot_ns - suspended_ns)


class SnapshotListener(Protocol):
    def on_snapshot(self, snapshot: Snapshot, merged: Mapping[Key, Merged]) -> None:
        """A poll's live processes, with the figures they were merged from (called on the poller)."""


@dataclass(frozen=True)
class Sources:
    """What the accounting merges, opened by whoever builds it: the agent (gemtrace.agent.agent.open_accounting,
    the host's) or a test (the fakes of tests/fake_sources.py)."""

    gate: Source  # the gates' slots
    nvml: NvmlSource
    ebpf: AllocationSource | None = None
    ebpf_reason: str = "eBPF disabled by configuration"  # why `ebpf` is None, for ebpf_status


class Accounting:
    def __init__(
        self,
        region: Region | None,
        config_getter: Callable[[], Rules | None],
        sources: Sources,
        proc_root: Path = Path("/proc"),
        clock: Callable[[], int] = time.monotonic_ns,
        group_seconds: Callable[[], Mapping[tuple[str, str], float]] | None = None,
        watched: Callable[[int], int | None] | None = None,
    ) -> None:
        """Merges `sources`; start() subscribes the enforcement and starts eBPF's thread. `group_seconds`:
        (GPU UUID, group) -> the GPU seconds the scheduler charged the group; with it, a group's gated
        processes together are never given more (None: the gates' figures as they are). `watched(pid)`:
        the start time of a process that something watching its exit (the agent's reaper, through a
        pidfd) knows runs, else None; such a process needs no /proc read at each poll (None: every
        process's liveness from /proc)."""
        self.region = region
        self.config_getter = config_getter
        self.proc = ProcReader(proc_root)
        self.nvml = sources.nvml
        self.gate = sources.gate
        self.ebpf = sources.ebpf
        self.ebpf_reason = sources.ebpf_reason
        self.enforcement: Enforcement | None = None
        self.clock = clock
        self._watched = watched
        self.facts = ProcessFacts(self.proc, region, self.nvml.gpu_uuids)
        self.inherited_memory = InheritedMemory(self.facts, self.enforce_soon)
        self.verified = VerifiedMemory(region) if region is not None else None
        self._seen: dict[tuple[int, str], _Seen] = {}  # (pid, gpu): the process as the last poll left it
        self._order: list[Key] = []  # the live processes by GPU, then pid
        self._order_of: set[Key] = set()  # the processes _order sorts
        self._last_poll_ns: int | None = None
        self.group_seconds = group_seconds
        self._time_share = GpuTimeShare()
        # A gated process started by now ran bursts the group's figure (restarted with the agent) never
        # counted: they are not paid (GpuTimeShare's `inherited`).
        self._since_ticks = boot_ticks()
        self._listeners: list[SnapshotListener] = []

    def start(self, enforcement: Enforcement) -> None:
        """Subscribes `enforcement` (built on limits() and holdings()) to each snapshot (the audit of the
        slots) and to eBPF's allocations, then starts eBPF's thread: its first look enforces on the
        figures rebuilt at start."""
        self.enforcement = enforcement
        self.subscribe(enforcement)
        if self.ebpf is not None:
            self.ebpf.subscribe(enforcement)
            self.ebpf.start()

    def subscribe(self, listener: SnapshotListener) -> None:
        self._listeners.append(listener)

    def enforce_soon(self) -> None:
        """Check every limit at the watcher's next wake-up (within 50 ms) rather than at the next
        allocation: after a reload, a MemoryLimit lowered below a group's use acts at once."""
        if self.ebpf is not None:
            self.ebpf.nudge()

    # -- status ----------------------------------------------------------------------------------

    @property
    def ebpf_status(self) -> str:
        return self.ebpf_reason if self.ebpf is None else self.ebpf.status

    @property
    def probes(self) -> BpfProbes | None:
        """bcc's probes when the real eBPF source runs."""
        return self.ebpf.probes if isinstance(self.ebpf, EbpfSource) else None

    @property
    def probes_attached(self) -> int:
        return 0 if self.ebpf is None else self.ebpf.probes_attached

    @property
    def libcuda_files(self) -> int:
        return 0 if self.ebpf is None else self.ebpf.libcuda_files

    # -- what enforcement reads --------------------------------------------------------------------

    def limits(self) -> dict[str, int | None]:
        config = self.config_getter()
        if config is None:
            return {}
        return {name: g.memory_limit for name, g in config.groups.items()}

    def holdings(self) -> list[Holding]:
        """What every process holds on every GPU now, for the enforcer: eBPF's figures, rebuilt for the
        processes whose earlier allocations eBPF cannot have seen. Reads eBPF's memory alone (and the
        slots and NVML only while a rebuilt figure matters): this is on the OOM killer's path."""
        assert self.ebpf is not None
        config = self.config_getter()
        devices = self.facts.devices(config)
        ebpf = self.ebpf.memory(devices)
        memory = {key: f.memory or 0 for key, f in ebpf.figures.items()}
        if self.verified is not None:
            self.verified.publish_from_ebpf(devices, ebpf, self.inherited_memory.holding)
        gated: Collection[int] = ()
        if self.inherited_memory.due(ebpf):
            gate = self.gate.read(self.clock(), devices)
            gated = gate.start_times
            nvml = self.nvml.read(self.clock(), devices, utilization=False)
            for key, rebuilt in self.inherited_memory.rebuild(config, ebpf, gate, nvml).items():
                memory[key] = max(memory.get(key, 0), rebuilt)
        holdings = []
        suspended_ns = _suspended_ns()
        for (pid, uuid), used in memory.items():
            info = self.facts.kept(pid)
            if used <= 0 or info is None:
                continue
            # A process eBPF saw allocate nothing since the start: its own start is the latest its
            # allocations can be known to be, so the newest such process goes first.
            f = ebpf.figures.get((pid, uuid))
            when = (f.last_alloc_ns if f is not None else 0) or _monotonic_of_ticks(info.start_time, suspended_ns)
            # The uid says whose process it is: a victim is chosen among the users who took the group
            # over (gemtrace.agent.enforcement). Read at each check, not kept with the group: a process may
            # change its uid (setuid) after it started.
            holdings.append(Holding(pid, info.group, uuid, used, when, pid in gated, uid=self.proc.uid(pid)))
        return holdings

    def trust_new_chunks(self) -> None:
        """Trust decided for chunks made or given to another user since (the keeper's tick:
        VerifiedMemory.trust_new_chunks)."""
        if self.verified is not None:
            self.verified.trust_new_chunks()

    # -- the snapshot ------------------------------------------------------------------------------

    def poll(self, now_ns: int | None = None) -> Snapshot:
        now = self.clock() if now_ns is None else now_ns
        config = self.config_getter()
        devices = self.facts.devices(config)
        ebpf = self.ebpf.read(now, devices) if self.ebpf is not None else None
        gate = self.gate.read(now, devices)
        nvml = self.nvml.read(now, devices, utilization=self._last_poll_ns is not None)
        rebuilt = self.inherited_memory.rebuild(config, ebpf, gate, nvml) if ebpf is not None else {}
        alive = ebpf.alive if ebpf is not None else frozenset()

        merged: dict[Key, Merged] = {}
        changed: list[_Change] = []  # the live processes whose account is made anew
        previous = self._seen
        seen: dict[Key, _Seen] = {}
        nvml_on = self.nvml.available
        running, facts_of = self._running, self.facts.of  # (per process: 1024 at the region's limit)
        for key in merge.places(ebpf, gate, nvml):
            pid = key[0]
            # eBPF removes a process's context at its exit: those need no /proc read to be known alive.
            if pid not in alive and not running(pid, gate):
                continue
            info = facts_of(pid, config)
            if info is None:
                continue
            late = ebpf is not None and inherited(pid, info, ebpf.missed, ebpf.since_ticks)
            i = merge.inputs(key, ebpf, gate, nvml, rebuilt.get(key), nvml_on, late)
            kept = previous.get(key)  # (after running(): a reused pid's records are gone)
            if kept is not None and kept.inputs == i:
                m = merged[key] = kept.merged
                if i.gated and kept.facts is info:  # the same GPU time and account too (_Seen)
                    seen[key] = kept
                    continue
            else:
                m = merged[key] = merge.merged(i)
            changed.append(_Change(key, i, m, info, kept, kept.nvml_seconds if kept is not None else 0.0))
        seconds = ({} if self.group_seconds is None else
                   self._share_gpu_time(changed, merged, ebpf.missed if ebpf is not None else frozenset()))
        self._integrate_nvml(now, changed, seconds, nvml.utilization)
        for c in changed:
            seen[c.key] = self._remember(c, seconds.get(c.key, c.merged.gate_seconds))
        self._seen = seen  # the records of the processes gone are dropped with them
        snapshot = Snapshot(now, self._in_order(seen))
        if self.verified is not None:
            self.verified.publish(devices, gate.start_times, merged)
        for listener in self._listeners:
            listener.on_snapshot(snapshot, merged)
        if self.verified is not None:
            if self.enforcement is not None:
                self.verified.untrust(self.enforcement.over_reporters())
            self.verified.trust_chunks()
        return snapshot

    def _running(self, pid: int, gate: SourceReading) -> bool:
        """Whether `pid` is the running process the sources mean. Gone or a zombie: no (a source may
        still list it: NVML until the driver destroys its context, a slot until the reaper frees it).
        Another start time than its slot recorded: the slot is a dead process's, or a pod's gate's
        pid from its own namespace not yet translated (gemtrace/agent/agent.py's Reaper), and this pid is
        another process's. Another start time than the facts kept of it: the pid was reused, those
        facts are forgotten and read afresh."""
        start = self._watched(pid) if self._watched is not None else None
        running = start is not None
        if not running:
            running, start = self.proc.running(pid)
        if not running:
            self.facts.forget(pid)
            return False
        kept = self.facts.kept(pid)
        if kept is not None and kept.start_time != start:
            self.facts.forget(pid)
            for key in [key for key in self._seen if key[0] == pid]:
                del self._seen[key]  # the new process's GPU time starts from nothing
        recorded = gate.start_times.get(pid)
        return not (recorded and start is not None and recorded != start)

    def _share_gpu_time(self, changed: list[_Change], live: Mapping[Key, Merged], missed: Collection[int]
                        ) -> dict[Key, float]:
        """The GPU time of the gated processes in `changed`, their gates' figures apportioned within
        each group (GpuTimeShare): (pid, GPU) -> seconds. The other live processes (`live`: all of
        them) are gated, showed the same figures at the last poll, and keep what they were given."""
        assert self.group_seconds is not None
        raw: dict[tuple[str, str], dict[int, float]] = {}
        unpaid: set[int] = set()  # inherited: bursts before the agent's start are not paid
        ungated: set[Key] = set()
        for c in changed:
            if not c.merged.gated:
                ungated.add(c.key)
                continue
            pid, uuid = c.key
            raw.setdefault((uuid, c.facts.group), {})[pid] = c.merged.gate_seconds
            if inherited(pid, c.facts, missed, self._since_ticks):
                unpaid.add(pid)
        self._time_share.keep(live.keys() - ungated)
        return self._time_share.apportion(raw, self.group_seconds(), unpaid)

    def _integrate_nvml(self, now: int, changed: list[_Change], seconds: Mapping[Key, float],
                        util: Mapping[str, float]) -> None:
        """GPU time of ungated processes: NVML's busy fraction x elapsed time, less what the gates
        account on that GPU, shared equally among the ungated processes on it. Coarse by nature.
        `seconds`: the GPU time of the gated processes in `changed` (_share_gpu_time); every other gated
        process's is what it was at the last poll."""
        last, self._last_poll_ns = self._last_poll_ns, now
        dt = 0.0 if last is None else (now - last) / 1e9
        gated_busy: dict[str, float] = {}  # per GPU, what the gates accounted since the last poll
        ungated: dict[str, list[_Change]] = {}
        for c in changed:  # one pass over the processes, not one a GPU
            uuid = c.key[1]
            if not c.merged.gated:
                ungated.setdefault(uuid, []).append(c)
            elif c.before is not None:  # (a process first seen now: nothing since the last poll)
                busy = seconds.get(c.key, c.merged.gate_seconds) - c.before.account.gpu_seconds
                if busy > 0.0:
                    gated_busy[uuid] = gated_busy.get(uuid, 0.0) + busy
        for uuid, fraction in util.items():
            share = ungated.get(uuid)
            if share:
                each = max(0.0, fraction * dt - gated_busy.get(uuid, 0.0)) / len(share)
                for c in share:
                    c.nvml_seconds += each

    @staticmethod
    def _remember(c: _Change, gpu_seconds: float) -> _Seen:
        """The record of a changed process, its account made with its GPU time (a gated process's
        shared within its group, an ungated one's NVML's integrated) where it differs."""
        m, info, kept = c.merged, c.facts, c.before
        if not m.gated and c.nvml_seconds:
            gpu_seconds = gpu_seconds + c.nvml_seconds
        if (kept is None or kept.merged is not m or kept.facts is not info
                or kept.account.gpu_seconds != gpu_seconds):
            account = ProcessAccount(c.key[0], info.comm, info.group, c.key[1], m.memory, gpu_seconds, m.launches,
                                     m.gated, managed_bytes=m.managed)
        else:
            account = kept.account
        if kept is None:
            return _Seen(c.inputs, m, info, account, c.nvml_seconds)
        kept.inputs, kept.merged, kept.facts, kept.account, kept.nvml_seconds = (c.inputs, m, info, account,
                                                                                c.nvml_seconds)
        return kept

    def _in_order(self, live: Mapping[Key, _Seen]) -> tuple[ProcessAccount, ...]:
        """The live processes' accounts by GPU, then pid (the snapshot's order), sorted again only when
        the live processes are not those of the last poll (sorting 1024 accounts cost as much as making
        them)."""
        if live.keys() != self._order_of:
            self._order = sorted(live, key=lambda key: (key[1], key[0]))
            self._order_of = set(live)
        return tuple([live[key].account for key in self._order])

    def stop_watching(self) -> None:
        """Stop the eBPF source's thread (enforcement, rescans); close() detaches the probes after it."""
        if self.ebpf is not None:
            self.ebpf.stop_watching()

    def close(self) -> None:
        """Stops the eBPF source's thread and detaches every uprobe."""
        if self.ebpf is not None:
            self.ebpf.close()
            self.ebpf = None
