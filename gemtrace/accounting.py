"""Accounting: what every process on the host does with the GPUs, from eBPF, the gates and NVML.

Owns the per-process view (Snapshot) and what it keeps across polls: the facts of each process
(/proc: group, GPUs), the memory rebuilt after an agent restart, GPU time shared within a group, NVML's
time integrated. A process is in a snapshot only while it runs: one whose /proc entry is gone, a
zombie, or one whose pid now names another process (another start time) is left out at the next poll,
whatever a source still says of it (its series leave /metrics within a poll). It merges the three
sources it is given behind one interface (gemtrace/sources/: eBPF, the gates' slots, NVML; the agent
opens the host's, gemtrace.agent.open_accounting, a test passes fakes) with gemtrace/merge.py, whose
functions are docs/accounting.md's table "Sources, best first", row by row. The enforcement it is
given (gemtrace/enforcement.py, at start()) subscribes: to eBPF's allocation events (the source's
thread wakes it within milliseconds) and to each snapshot (the audit of the slots). Without eBPF
(bcc cannot run, or disabled) ebpf_status says why and the gates and NVML still count.

eBPF cannot know what a process allocated before its libcuda was probed (an agent restart, a
container's copy found late): for such an inherited process the memory is rebuilt from its gate's
slot or, ungated, NVML less the context overhead (memory = max(eBPF, rebuilt)), at start and
whenever one is first seen, and the enforcer acts on it at once. A group's processes are never
given more GPU time together than the scheduler gave the group (GpuTimeShare): a burst measured by
the gate also holds the time it waited behind the group's other processes.
Writes to the region only what it verified each gated process holds (Region.publish_verified: what
other users' gates count for it, issue 25); never kills but through MemoryEnforcer; never reads bcc,
the slots or NVML but through a source.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import structlog

from gemtrace import merge
from gemtrace.enforcement import Enforcement, Holding
from gemtrace.gpu_time import GpuTimeShare
from gemtrace.groups_of import ENV_VISIBLE_DEVICES, ProcReader, visible_devices
from gemtrace.membership import group_of
from gemtrace.merge import Merged
from gemtrace.region import Region
from gemtrace.snapshot import ProcessAccount, Snapshot
from gemtrace.sources import AllocationSource, Figures, Key, Source, SourceReading
from gemtrace.sources.ebpf import EbpfSource, boot_ticks
from gemtrace.sources.ebpf.probes import BpfProbes
from gemtrace.sources.nvml import NvmlLike, NvmlSource

log = structlog.get_logger("gemtrace.accounting")


class _Config(Protocol):
    @property
    def groups(self) -> Mapping[str, Any]: ...


@dataclass
class _Info:
    start_time: int | None
    comm: str
    group: str
    uuids: list[str]  # the GPUs its ordinals 0, 1, ... name
    rules_id: int


@dataclass
class _Seen:
    account: ProcessAccount
    nvml_seconds: float = 0.0


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


class _Devices:
    """The host's GPUs and each process's ordinals as UUIDs, for the sources of one reading: what the
    accounting knows, through the three functions it hands over."""

    def __init__(self, gpu_list: Callable[[], list[str]], info_of: Callable[[int], _Info | None],
                 forget: Callable[[int], object]) -> None:
        self._gpu_list = gpu_list
        self._info_of = info_of
        self._forget = forget
        self._physical: list[str] | None = None

    def physical(self) -> list[str]:
        if self._physical is None:
            self._physical = self._gpu_list()
        return self._physical

    def of(self, pid: int, ordinal: int) -> str | None:
        info = self._info_of(pid)
        if info is None or ordinal >= len(info.uuids):
            return None
        return info.uuids[ordinal]

    def forget(self, pids: Collection[int]) -> None:
        for pid in pids:
            self._forget(pid)


@dataclass(frozen=True)
class Sources:
    """What the accounting merges, opened by whoever builds it: the agent (gemtrace.agent.open_accounting,
    the host's) or a test (the fakes of tests/fake_sources.py)."""

    gate: Source  # the gates' slots
    nvml: NvmlLike
    ebpf: AllocationSource | None = None
    ebpf_reason: str = "eBPF disabled by configuration"  # why `ebpf` is None, for ebpf_status


class Accounting:
    def __init__(
        self,
        region: Region | None,
        config_getter: Callable[[], _Config | None],
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
        self.nvml_reader = sources.nvml
        self.nvml = NvmlSource(self.nvml_reader)
        self.gate = sources.gate
        self.ebpf = sources.ebpf
        self.ebpf_reason = sources.ebpf_reason
        self.enforcement: Enforcement | None = None
        self.clock = clock
        self._watched = watched
        self._info: dict[int, _Info] = {}
        self._seen: dict[tuple[int, str], _Seen] = {}  # (pid, gpu): its account at the last poll
        self._last_poll_ns: int | None = None
        self.group_seconds = group_seconds
        self._time_share = GpuTimeShare()
        # A gated process started by now ran bursts the group's figure (restarted with the agent) never
        # counted: they are not paid (GpuTimeShare's `inherited`).
        self._since_ticks = boot_ticks()
        self._inherited_holding: set[int] = set()  # inherited processes with rebuilt memory, last look
        self._rebuild_due = True
        self._missed: frozenset[int] = frozenset()  # eBPF's late pids at the last look
        self._context_bytes: dict[str, int] = {}  # per GPU: NVML's per-process figure less the true one
        self._listeners: list[SnapshotListener] = []
        self._untrusted_uids: frozenset[int] = frozenset()  # users caught over-reporting (_trust_chunks)
        self._trusted_generation = -1  # the chunk generation _trust_chunks last looked at

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
        devices = self._devices(config)
        ebpf = self.ebpf.memory(devices)
        memory = {key: f.memory or 0 for key, f in ebpf.figures.items()}
        self._publish_verified_from_ebpf(devices, ebpf)
        gated: Collection[int] = ()
        if self._rebuild_due or self._inherited_holding or ebpf.missed - self._missed:
            gate = self.gate.read(self.clock(), devices)
            gated = gate.start_times
            nvml = self.nvml.read(self.clock(), devices, utilization=False)
            for key, rebuilt in self._rebuild(config, ebpf, gate, nvml).items():
                memory[key] = max(memory.get(key, 0), rebuilt)
        holdings = []
        suspended_ns = _suspended_ns()
        for (pid, uuid), used in memory.items():
            info = self._info.get(pid)
            if used <= 0 or info is None:
                continue
            # A process eBPF saw allocate nothing since the start: its own start is the latest its
            # allocations can be known to be, so the newest such process goes first.
            f = ebpf.figures.get((pid, uuid))
            when = (f.last_alloc_ns if f is not None else 0) or _monotonic_of_ticks(info.start_time, suspended_ns)
            # The uid says whose process it is: a victim is chosen among the users who took the group
            # over (gemtrace.enforcement). Read at each check, not kept with the group: a process may
            # change its uid (setuid) after it started.
            holdings.append(Holding(pid, info.group, uuid, used, when, pid in gated, uid=self.proc.uid(pid)))
        return holdings

    # -- verified memory: what other users' gates count for a gated process (issue 25) --------------

    def _publish_verified(self, devices: _Devices, gated: Collection[int], merged: Mapping[Key, Merged]) -> None:
        """At each poll: every gated process's memory as eBPF or NVML checks it (merge's row
        "verified"; the slot's own figure where nothing checks it), into the region's verified[]. A
        gated process no source places on a GPU holds nothing there."""
        if self.region is None:
            return
        index = {uuid: g for g, uuid in enumerate(devices.physical())}
        out: dict[int, dict[int, tuple[int, int]]] = {pid: {} for pid in gated}
        for (pid, uuid), m in merged.items():
            if m.gated and uuid in index:
                memory = m.verified if m.verified is not None else (m.slot_memory or 0)
                out.setdefault(pid, {})[index[uuid]] = (memory, m.verified_managed)
        self.region.publish_verified(out)

    def trust_new_chunks(self) -> None:
        """_trust_chunks' decision for chunks made or given to another user since (the keeper's tick:
        a gate waits for its group, which the same tick decides, before it allocates)."""
        if self.region is not None and self.region.layout.header.chunk_generation != self._trusted_generation:
            self._trust_chunks()

    def _untrust_over_reporters(self) -> None:
        """The users of the processes the audit just counted over-reporting lose the trust of the
        other users' gates (the poller's: the audit's state is the poller's)."""
        if self.region is None or self.enforcement is None:
            return
        for pid in self.enforcement.over_reporters():
            uid = self.region.owner_of(pid)
            if uid is not None and uid not in self._untrusted_uids:
                self._untrusted_uids = self._untrusted_uids | {uid}  # a new set: the keeper reads it
                log.warning("user_untrusted", uid=uid, pid=pid,
                            consequence="other users' gates count this user's memory as the agent verifies it")

    def _trust_chunks(self) -> None:
        """Which users' slots other users' gates count at their own figures (chunk_trusted): every
        user's but those caught over-reporting, for as long as this agent runs. The verified figures
        lag each allocation (eBPF's event, else a poll), and in that lag two users allocating at once
        each took most of a shared limit (docs/gate.md, Memory)."""
        if self.region is None:
            return
        untrusted = self._untrusted_uids
        generation = self.region.layout.header.chunk_generation
        self.region.trust_chunks(lambda uid: uid not in untrusted)
        self._trusted_generation = generation

    def _publish_verified_from_ebpf(self, devices: _Devices, ebpf: SourceReading) -> None:
        """On each eBPF wake-up while some user is untrusted: the gated processes' eBPF figures (merge's
        row "verified"), so that an untrusted user's allocation counts in the others' gates within the
        watcher's reaction, not at the next poll. While every user is trusted the gates count live
        figures, and the polls publish enough: the watcher, woken by every allocation, stays as light
        as it was. Processes holding rebuilt memory are the poll's to publish (their slot, clamped)."""
        if self.region is None or not self._untrusted_uids:
            return
        columns = self.region.slot_columns
        physical = devices.physical()
        slot_managed = [columns.managed(g) for g in range(len(physical))]
        out: dict[int, dict[int, tuple[int, int]]] = {}
        for slot in columns.live():
            pid = columns.pid[slot]
            if not pid or pid in self._inherited_holding:
                continue
            held = out[pid] = {}
            for g, uuid in enumerate(physical):
                f = ebpf.figures.get((pid, uuid))
                if f is not None:
                    slot_figures = Figures(managed=slot_managed[g][slot])
                    device, managed = merge.verified(True, f, slot_figures, None, False, False)
                    held[g] = (device or 0, managed)
        self.region.publish_verified(out)

    # -- after a restart: memory eBPF never saw ----------------------------------------------------

    def _inherited(self, pid: int, info: _Info, missed: Collection[int], since_ticks: int | None) -> bool:
        """Started by `since_ticks` (or mapped a libcuda file before it was probed: `missed`)."""
        return pid in missed or (since_ticks is not None and info.start_time is not None
                                 and info.start_time <= since_ticks)

    def _rebuild(self, config: _Config | None, ebpf: SourceReading, gate: SourceReading,
                 nvml: SourceReading) -> dict[Key, int]:
        """Memory of the live inherited processes by (pid, GPU UUID) (merge.rebuilt_memory); learns each
        GPU's context overhead on the way (merge.context_overhead). Logs `memory_rebuilt` and wakes the
        enforcer for a process first found holding rebuilt memory."""
        reused = set()
        for pid, start in gate.start_times.items():
            info = self._info_of(pid, config)
            if info is not None and start and info.start_time is not None and start != info.start_time:
                reused.add(pid)  # a reused pid: the slot is a dead process's, left for the agent to free
        candidates = {pid for (pid, _), s in gate.figures.items() if s.placed and s.memory and pid not in reused}
        candidates |= {pid for pid, _ in nvml.figures if pid not in gate.start_times}
        inherited = set()
        for pid in candidates:
            info = self._info_of(pid, config)
            if info is not None and self.proc.alive(pid) and self._inherited(pid, info, ebpf.missed, ebpf.since_ticks):
                inherited.add(pid)
        self._context_bytes.update(merge.context_overhead(gate, nvml, ebpf, inherited, reused))
        keys = {key for key, s in gate.figures.items() if s.placed} | nvml.figures.keys()
        out = merge.rebuilt(keys, gate, nvml, inherited, reused, self._context_bytes)
        holding = {pid for (pid, _), used in out.items() if used > 0}
        new = holding - self._inherited_holding
        if new:
            log.info("memory_rebuilt", pids=sorted(new)[:20],
                     bytes={f"{pid}/{uuid}": used for (pid, uuid), used in sorted(out.items()) if pid in new})
            assert self.ebpf is not None
            self.ebpf.nudge()  # the watcher enforces on them at once
        self._inherited_holding = holding
        self._rebuild_due = False
        self._missed = ebpf.missed
        return out

    # -- per-process facts -------------------------------------------------------------------------

    def _devices(self, config: _Config | None) -> _Devices:
        return _Devices(self._gpu_list, lambda pid: self._info_of(pid, config), lambda pid: self._info.pop(pid, None))

    def _gpu_list(self) -> list[str]:
        if self.region is not None:
            uuids = list(self.region.gpu_uuids())
            if uuids:
                return uuids
        return self.nvml.gpu_uuids()

    def _info_of(self, pid: int, config: _Config | None) -> _Info | None:
        # Cached while the process lives: eBPF's exit events (or, without eBPF, a failed liveness
        # check in poll) drop the entry, so a reused pid is read afresh.
        rules_id = id(config)
        info = self._info.get(pid)
        if info is not None and info.rules_id == rules_id:
            return info
        start = self.proc.start_time(pid)
        env = self.proc.environ(pid)
        if env is None:
            return None
        # The agent's one decision (gemtrace/membership.py): a gated process's assignment, else the
        # same admission for an ungated one.
        group, final = group_of(pid, env, self.proc, self.region, config.groups if config is not None else {})
        info = _Info(
            start_time=start,
            comm=self.proc.comm(pid) or "?",
            group=group,
            uuids=visible_devices(env.get(ENV_VISIBLE_DEVICES), self._gpu_list()),
            rules_id=rules_id,
        )
        if final:
            self._info[pid] = info
        return info

    # -- the snapshot ------------------------------------------------------------------------------

    def poll(self, now_ns: int | None = None) -> Snapshot:
        now = self.clock() if now_ns is None else now_ns
        config = self.config_getter()
        devices = self._devices(config)
        ebpf = self.ebpf.read(now, devices) if self.ebpf is not None else None
        gate = self.gate.read(now, devices)
        nvml = self.nvml.read(now, devices, utilization=self._last_poll_ns is not None)
        rebuilt = self._rebuild(config, ebpf, gate, nvml) if ebpf is not None else {}
        alive = ebpf.alive if ebpf is not None else frozenset()

        live: dict[Key, ProcessAccount] = {}
        merged: dict[Key, Merged] = {}
        nvml_on = self.nvml_reader.available
        for key in merge.places(ebpf, gate, nvml):
            pid, uuid = key
            # eBPF removes a process's context at its exit: those need no /proc read to be known alive.
            if pid not in alive and not self._running(pid, gate):
                continue
            info = self._info_of(pid, config)
            if info is None:
                continue
            inherited = ebpf is not None and self._inherited(pid, info, ebpf.missed, ebpf.since_ticks)
            m = merged[key] = merge.merge(key, ebpf, gate, nvml, rebuilt.get(key), nvml_on, inherited)
            live[key] = ProcessAccount(pid, info.comm, info.group, uuid, m.memory, m.gate_seconds, m.launches, m.gated,
                                       managed_bytes=m.managed)

        if self.group_seconds is not None:
            self._share_gpu_time(live, config, ebpf.missed if ebpf is not None else frozenset())
        self._integrate_nvml(now, live, nvml.utilization)
        snapshot = self._remember(now, live)
        self._publish_verified(devices, gate.start_times, merged)
        for listener in self._listeners:
            listener.on_snapshot(snapshot, merged)
        self._untrust_over_reporters()
        self._trust_chunks()
        return snapshot

    def _running(self, pid: int, gate: SourceReading) -> bool:
        """Whether `pid` is the running process the sources mean. Gone or a zombie: no (a source may
        still list it: NVML until the driver destroys its context, a slot until the reaper frees it).
        Another start time than its slot recorded: the slot is a dead process's, or a pod's gate's
        pid from its own namespace not yet translated (gemtrace/agent.py's Reaper), and this pid is
        another process's. Another start time than the facts kept of it: the pid was reused, those
        facts are forgotten and read afresh."""
        start = self._watched(pid) if self._watched is not None else None
        running = start is not None
        if not running:
            running, start = self.proc.running(pid)
        if not running:
            self._info.pop(pid, None)
            return False
        kept = self._info.get(pid)
        if kept is not None and kept.start_time != start:
            del self._info[pid]
            for key in [key for key in self._seen if key[0] == pid]:
                del self._seen[key]  # the new process's GPU time starts from nothing
        recorded = gate.start_times.get(pid)
        return not (recorded and start is not None and recorded != start)

    def _share_gpu_time(self, live: dict[Key, ProcessAccount], config: _Config | None,
                        missed: Collection[int]) -> None:
        """Gated processes' GPU time, apportioned within each group (GpuTimeShare)."""
        assert self.group_seconds is not None
        raw: dict[tuple[str, str], dict[int, float]] = {}
        inherited: set[int] = set()
        for (pid, uuid), acc in live.items():
            if acc.gated:
                raw.setdefault((uuid, acc.group), {})[pid] = acc.gpu_seconds
                info = self._info_of(pid, config)
                if info is not None and self._inherited(pid, info, missed, self._since_ticks):
                    inherited.add(pid)
        shared = self._time_share.apportion(raw, self.group_seconds(), inherited)
        for key, seconds in shared.items():
            if seconds != live[key].gpu_seconds:
                live[key] = replace(live[key], gpu_seconds=seconds)

    def _integrate_nvml(self, now: int, live: dict[Key, ProcessAccount], util: Mapping[str, float]) -> None:
        """GPU time of ungated processes: NVML's busy fraction x elapsed time, less what the gates
        account on that GPU, shared equally among the ungated processes on it. Coarse by nature."""
        last, self._last_poll_ns = self._last_poll_ns, now
        dt = 0.0 if last is None else (now - last) / 1e9
        on_gpu: dict[str, list[tuple[Key, ProcessAccount]]] = {}  # one pass over the processes, not one a GPU
        for key, acc in live.items():
            on_gpu.setdefault(key[1], []).append((key, acc))
        for uuid, fraction in util.items():
            gated_busy = 0.0  # what the gates accounted on this GPU since the last poll
            for key, acc in on_gpu.get(uuid, ()):
                if acc.gated:
                    prev = self._seen.get(key)
                    gated_busy += max(0.0, acc.gpu_seconds - (prev.account.gpu_seconds if prev else acc.gpu_seconds))
            share = [k for k, a in on_gpu.get(uuid, ()) if not a.gated]
            each = max(0.0, fraction * dt - gated_busy) / len(share) if share else 0.0
            for key in share:
                seen = self._seen.get(key)
                if seen is None:
                    seen = self._seen[key] = _Seen(live[key])
                seen.nvml_seconds += each
        for key, acc in live.items():
            seen = self._seen.get(key)
            if seen is not None and seen.nvml_seconds and not acc.gated:
                live[key] = replace(acc, gpu_seconds=acc.gpu_seconds + seen.nvml_seconds)

    def _remember(self, now: int, live: dict[tuple[int, str], ProcessAccount]) -> Snapshot:
        """The snapshot of the live processes; what is kept of each (_seen) is dropped with it."""
        seen = self._seen
        self._seen = {}
        for key, acc in live.items():
            kept = seen.get(key)
            if kept is None:
                kept = _Seen(acc)
            else:
                kept.account = acc  # its own: no one else holds a _Seen
            self._seen[key] = kept
        return Snapshot(now, tuple(sorted(live.values(), key=lambda a: (a.gpu, a.pid))))

    def stop_watching(self) -> None:
        """Stop the eBPF source's thread (enforcement, rescans); close() detaches the probes after it."""
        if self.ebpf is not None:
            self.ebpf.stop_watching()

    def close(self) -> None:
        """Stops the eBPF source's thread and detaches every uprobe."""
        if self.ebpf is not None:
            self.ebpf.close()
            self.ebpf = None
