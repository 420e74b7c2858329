"""Accounting: what every process on the host does with the GPUs, from eBPF, the gates and NVML.

Owns the per-process view (Snapshot) and the enforcement thread. Sources, best first:
  memory       eBPF (every allocation matched to its release, gated or not) > the gate's slot > NVML
               (NVML's figure includes the context's own memory: about 800 MB a process on an H100);
  GPU time     the gate's slot (busy_ns of finished bursts) > NVML's device utilisation integrated over
               time and shared among the ungated processes on that GPU (coarse: a one-second window);
  launches     the gate's slot > eBPF in the opt-in "launches" probe mode > unknown (None).
A watcher thread waits on the eBPF ring buffer: an allocation wakes it, and MemoryEnforcer kills
within milliseconds; it also rescans /proc for libcuda files every LIBCUDA_RESCAN_SECONDS. If bcc
cannot run, one log line says why (ebpf_status keeps it) and the gates and NVML still count.

eBPF cannot know what a process allocated before its libcuda was probed (an agent restart, a
container's copy found late): for such an inherited process the memory is rebuilt from its gate's
slot or, ungated, NVML less the context overhead (memory = max(eBPF, rebuilt)), at start and
whenever one is first seen, and the enforcer acts on it at once. A group's processes are never
given more GPU time together than the scheduler gave the group (GpuTimeShare): a burst measured by
the gate also holds the time it waited behind the group's other processes.
Never writes to the region; never kills but through MemoryEnforcer.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import structlog

from gemtrace import defaults
from gemtrace.enforcement import Holding, MemoryEnforcer
from gemtrace.groups_of import ENV_VISIBLE_DEVICES, ProcReader, group_for, visible_devices
from gemtrace.probes import libcuda
from gemtrace.probes.bpf_loader import EVENT_ALLOC, EVENT_EXIT, BpfProbes, BpfUnavailable, Event, Usage
from gemtrace.probes.nvml import NvmlProcess, NvmlReader

log = structlog.get_logger("gemtrace.accounting")

NVML_WINDOW_NS = 1_000_000_000  # NVML's utilisation is averaged over about this long


@dataclass(frozen=True)
class ProcessAccount:
    pid: int
    comm: str
    group: str
    gpu: str  # UUID
    memory_bytes: int
    gpu_seconds: float
    launches: int | None  # None: not known (ungated process, launches not probed)
    gated: bool
    exited_ns: int | None = None  # set during the grace period after the process exited


@dataclass(frozen=True)
class Snapshot:
    taken_ns: int
    processes: tuple[ProcessAccount, ...]

    def group_memory(self) -> dict[tuple[str, str], int]:
        out: dict[tuple[str, str], int] = {}
        for p in self.processes:
            key = (p.gpu, p.group)
            out[key] = out.get(key, 0) + p.memory_bytes
        return out


class _GroupConfig(Protocol):
    memory_limit: int | None
    cgroups: tuple[str, ...]


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
    exited_ns: int | None = None
    nvml_in_account: float = 0.0  # the part of nvml_seconds already in account.gpu_seconds


@dataclass(frozen=True)
class _SlotView:
    pid: int
    index: int
    memory: tuple[int, ...]
    launches: tuple[int, ...]
    busy_ns: tuple[int, ...]
    gpu_mask: int
    start_time: int


def boot_ticks() -> int:
    """Now, in the unit of /proc/PID/stat's start time (clock ticks since boot)."""
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * os.sysconf("SC_CLK_TCK"))


def _monotonic_of_ticks(ticks: int | None) -> int:
    """A /proc start time as CLOCK_MONOTONIC ns (eBPF's clock); 0 when not known."""
    if ticks is None:
        return 0
    since_boot_ns = ticks * 1_000_000_000 // os.sysconf("SC_CLK_TCK")
    return max(0, since_boot_ns - (time.clock_gettime_ns(time.CLOCK_BOOTTIME) - time.monotonic_ns()))


@dataclass
class _Share:
    raw_seen: float  # the gate's busy seconds at the last apportioning
    charged: float  # what the process has been given


class GpuTimeShare:
    """Per-process GPU time of gated processes, so that a group's processes together never get more
    than the group's time on that GPU (the scheduler's figure, charged once per interval).

    The gate measures a burst from its first launch to the sync that drains it; on a time-sliced GPU
    that includes the time its kernels waited behind the group's other processes, so three busy
    processes of one group measure about three times the group's time. Each poll, the bursts that
    ended since the last (the increase of each process's busy seconds) are paid out of what the group
    was given and not yet paid to its processes: in full if it covers them all, else that remainder is
    split in proportion and the excess (the waiting) is dropped. The remainder carries over, because
    the gate counts a burst only when it ends while the scheduler charges it as it runs.
    Pure: plain figures in, figures out; `apportion` is called with every live gated process.
    """

    def __init__(self) -> None:
        self._procs: dict[tuple[int, str], _Share] = {}
        self._paid: dict[tuple[str, str], float] = {}  # (gpu, group) -> given to its processes so far

    def apportion(self, raw: Mapping[tuple[str, str], Mapping[int, float]],
                  group_seconds: Mapping[tuple[str, str], float],
                  inherited: Collection[int] = ()) -> dict[tuple[int, str], float]:
        """`raw`: (gpu, group) -> pid -> the gate's busy seconds; `group_seconds`: (gpu, group) -> the
        group's GPU seconds; `inherited`: pids whose earlier bursts predate the group's figure (not
        paid). Returns (pid, gpu) -> seconds, never decreasing for a process; a group without a
        figure gets its raw increases unchanged."""
        out: dict[tuple[int, str], float] = {}
        kept: dict[tuple[int, str], _Share] = {}  # processes gone are dropped: the snapshot keeps their figure
        for (gpu, group), procs in raw.items():
            shares: dict[int, _Share] = {}
            increase: dict[int, float] = {}
            for pid, seconds in procs.items():
                share = self._procs.get((pid, gpu))
                if share is None:
                    share = _Share(seconds if pid in inherited else 0.0, 0.0)
                shares[pid] = kept[(pid, gpu)] = share
                increase[pid] = max(0.0, seconds - share.raw_seen)
                share.raw_seen = seconds
            total = sum(increase.values())
            figure = group_seconds.get((gpu, group))
            paid = self._paid.get((gpu, group), 0.0)
            scale = 1.0
            if figure is not None and total > 0:
                scale = min(1.0, max(0.0, figure - paid) / total)
            for pid, share in shares.items():
                share.charged += increase[pid] * scale
                out[(pid, gpu)] = share.charged
            self._paid[(gpu, group)] = paid + total * scale
        self._procs = kept
        return out


class Accounting:
    def __init__(
        self,
        region: Any,
        config_getter: Callable[[], _Config | None],
        proc_root: Path = Path("/proc"),
        use_ebpf: bool = True,
        probe_mode: str = "memory",
        nvml: NvmlReader | None = None,
        enforcer: MemoryEnforcer | None = None,
        grace_seconds: float = defaults.PROCESS_SERIES_GRACE_SECONDS,
        rescan_seconds: float = defaults.LIBCUDA_RESCAN_SECONDS,
        clock: Callable[[], int] = time.monotonic_ns,
        libcuda_paths: Sequence[Path] | None = None,
        scan_host: bool = True,
        group_seconds: Callable[[], Mapping[tuple[str, str], float]] | None = None,
    ) -> None:
        """`libcuda_paths`: files probed from the start (None: the host's, from ldconfig). `scan_host`
        False: probe only those, never the other libcuda files that processes map (the demo, which
        must not account for, nor kill, the host's other programs). `group_seconds`: (GPU UUID,
        group) -> the GPU seconds the scheduler charged the group; with it, a group's gated processes
        together are never given more (None: the gates' figures as they are)."""
        self.region = region
        self.config_getter = config_getter
        self.proc = ProcReader(proc_root)
        self.proc_root = proc_root
        self._scanner = libcuda.Scanner(proc_root)
        self.nvml = nvml if nvml is not None else NvmlReader()
        self.enforcer = enforcer or MemoryEnforcer()
        self.grace_ns = int(grace_seconds * 1e9)
        self.rescan_ns = int(rescan_seconds * 1e9)
        self.clock = clock
        # Probed from the start even before any process maps them, so that a process's first
        # allocations are not missed while the next rescan is due (None: the host's, from ldconfig).
        self.libcuda_paths = tuple(libcuda.system_paths() if libcuda_paths is None else libcuda_paths)
        self.scan_host = scan_host
        self._lock = threading.RLock()  # guards bcc and the caches below
        self._info: dict[int, _Info] = {}
        self._seen: dict[tuple[int, str], _Seen] = {}  # (pid, gpu): last account, kept for the grace
        self._exited: set[int] = set()
        self._alloc_event = False
        self._last_alloc_ns: int | None = None
        self._last_poll_ns: int | None = None
        self._tamper_suspect: dict[tuple[int, str], tuple[int, int]] = {}
        self._tampered: set[tuple[int, str]] = set()
        self.group_seconds = group_seconds
        self._time_share = GpuTimeShare()
        # A process started by now may hold memory that eBPF never saw (probes attach below); so may
        # one mapping a libcuda file that a later rescan is the first to probe (_late_pids).
        self._since_ticks = boot_ticks()
        self._late_pids: set[int] = set()
        self._inherited_holding: set[int] = set()  # inherited processes with rebuilt memory, last look
        self._rebuild_due = True
        self._context_bytes: dict[str, int] = {}  # per GPU: NVML's per-process figure less the true one
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.probes: BpfProbes | None = None
        self.ebpf_reason = "eBPF disabled by configuration"
        if use_ebpf:
            try:
                self.probes = BpfProbes(probe_mode)
            except BpfUnavailable as e:
                self.ebpf_reason = str(e)
                log.warning("ebpf_unavailable", reason=self.ebpf_reason,
                            consequence="memory and launches come from the gates and NVML only")
        if self.probes is not None:
            self.probes.open_events(self._on_event)
            self.rescan()
            self._alloc_event = True  # the watcher's first look enforces on the rebuilt figures
            self._thread = threading.Thread(target=self._watch, name="gemtrace-accounting", daemon=True)
            self._thread.start()

    # -- status ----------------------------------------------------------------------------------

    @property
    def ebpf_status(self) -> str:
        if self.probes is None:
            return self.ebpf_reason
        with self._lock:
            return f"attached {self.probes.probe_count} probes to {len(self.probes.files)} files"

    @property
    def probes_attached(self) -> int:
        return 0 if self.probes is None else self.probes.probe_count

    @property
    def libcuda_files(self) -> int:
        return 0 if self.probes is None else len(self.probes.files)

    # -- the watcher: ring buffer, enforcement, rescans --------------------------------------------

    def _on_event(self, ev: Event) -> None:
        if ev.type == EVENT_ALLOC:
            self._alloc_event = True
            self._last_alloc_ns = ev.ts_ns
        elif ev.type == EVENT_EXIT:
            with self._lock:  # _reap swaps the set from the polling thread
                self._exited.add(ev.pid)
            self._alloc_event = True  # memory went: a pending kill may be settled

    def enforce_soon(self) -> None:
        """Check every limit at the watcher's next wake-up (within 50 ms) rather than at the next
        allocation: after a reload, a MemoryLimit lowered below a group's use acts at once."""
        self._alloc_event = True

    def _watch(self) -> None:
        assert self.probes is not None
        next_scan = self.clock() + self.rescan_ns
        while not self._stop.is_set():
            self.probes.poll_events(50)
            if self._alloc_event:
                self._alloc_event = False
                try:
                    self.enforce()
                except Exception:
                    log.exception("enforcement_failed")
            if self.clock() >= next_scan:
                next_scan = self.clock() + self.rescan_ns
                try:
                    self.rescan()
                except Exception:
                    log.exception("libcuda_rescan_failed")

    def rescan(self) -> None:
        """Attach to libcuda files newly mapped; detach from those no live process maps any more."""
        assert self.probes is not None
        files = self._scanner.scan(skip=os.getpid()) if self.scan_host else {}
        pinned = {}
        for path in self.libcuda_paths:
            try:
                file_id = libcuda.file_id_of(path)
            except OSError:
                continue
            pinned[file_id] = path
        with self._lock:
            # A late pid that maps no libcuda any more has exited (or let go of the GPU): forget it.
            self._late_pids &= {pid for entry in files.values() for pid in entry.pids}
            for file_id, pinned_path in pinned.items():
                if file_id not in self.probes.files and self.probes.attach(file_id, pinned_path):
                    log.info("libcuda_attached", path=str(pinned_path), probes=self.probes.probe_count)
                    self._note_late(files.get(file_id))
            for file_id, entry in files.items():
                if file_id in self.probes.files:
                    continue
                via = entry.reachable_path(self.proc_root)
                if via is None:
                    continue
                try:
                    n = self.probes.attach(file_id, via)
                except OSError as e:
                    log.warning("libcuda_attach_failed", path=entry.path, pids=sorted(entry.pids)[:5], error=str(e))
                    continue
                if n:
                    log.info("libcuda_attached", path=entry.path, via=str(via), probes=n)
                    self._note_late(entry)
            for file_id in self.probes.files - set(files) - set(pinned):
                self.probes.detach(file_id)
                log.info("libcuda_detached", inode=file_id.inode, dev=file_id.dev)

    def _note_late(self, entry: libcuda.LibcudaFile | None) -> None:
        """Processes that mapped a libcuda file before it was probed: eBPF missed what they did."""
        if entry is not None and entry.pids:
            self._late_pids |= entry.pids
            self._rebuild_due = True

    def enforce(self) -> None:
        """Check every group's memory on every GPU against its limit: eBPF's figures, rebuilt for the
        processes whose earlier allocations eBPF cannot have seen."""
        assert self.probes is not None
        config = self.config_getter()
        limits: dict[str, int | None] = {}
        if config is not None:
            limits = {name: g.memory_limit for name, g in config.groups.items()}
        with self._lock:
            self._reap()
            if not any(limit is not None for limit in limits.values()):
                return  # no group has a limit: nothing to read
            usage = self.probes.usage()
        ebpf_mem, last_alloc = self._ebpf_memory(usage, config)
        memory = dict(ebpf_mem)
        gated: set[int] = set()
        if self._rebuild_due or self._inherited_holding:  # slots and NVML read only while they matter
            slots = self._slots()
            gated = set(slots)
            nvml_procs = self.nvml.processes() if self.nvml.available else []
            for key, rebuilt in self._rebuilt(config, slots, nvml_procs, self._gpu_list(), ebpf_mem).items():
                memory[key] = max(memory.get(key, 0), rebuilt)
        holdings = []
        for (pid, uuid), used in memory.items():
            info = self._info.get(pid)
            if used <= 0 or info is None or pid in self._exited:
                continue
            # A process eBPF saw allocate nothing since the start: its own start is the latest its
            # allocations can be known to be, so the newest such process goes first.
            when = last_alloc.get((pid, uuid)) or _monotonic_of_ticks(info.start_time)
            # The uid says whose process it is: a victim is chosen among the users who took the group
            # over (gemtrace.enforcement). Read at each check, not kept with the group: a process may
            # change its uid (setuid) after it started.
            holdings.append(Holding(pid, info.group, uuid, used, when, pid in gated, uid=self.proc.uid(pid)))
        if any(limits.get(h.group) is not None for h in holdings):
            self.enforcer.check(holdings, limits, event_ns=self._last_alloc_ns)

    def _reap(self) -> None:
        if self._exited and self.probes is not None:
            gone, self._exited = self._exited, set()
            self.probes.forget(gone)
            for pid in gone:
                self._info.pop(pid, None)
            self._late_pids -= gone

    def _ebpf_memory(self, usage: Sequence[Usage], config: _Config | None
                     ) -> tuple[dict[tuple[int, str], int], dict[tuple[int, str], int]]:
        """eBPF's bytes and last allocation time by (pid, GPU UUID); exited processes left out."""
        memory: dict[tuple[int, str], int] = {}
        last_alloc: dict[tuple[int, str], int] = {}
        for u in usage:
            if u.pid in self._exited:
                continue
            info = self._info_of(u.pid, config)
            if info is None or u.dev >= len(info.uuids):
                continue
            key = (u.pid, info.uuids[u.dev])
            memory[key] = memory.get(key, 0) + u.bytes
            last_alloc[key] = max(last_alloc.get(key, 0), u.last_alloc_ns)
        return memory, last_alloc

    def _inherited(self, pid: int, info: _Info) -> bool:
        """Started before the probes (or mapped a libcuda file before it was probed)."""
        return pid in self._late_pids or (info.start_time is not None and info.start_time <= self._since_ticks)

    def _rebuilt(self, config: _Config | None, slots: Mapping[int, _SlotView], nvml_procs: Sequence[NvmlProcess],
                 physical: Sequence[str], ebpf_mem: Mapping[tuple[int, str], int]) -> dict[tuple[int, str], int]:
        """Memory of the live inherited processes by (pid, GPU UUID), from what survives eBPF's
        blindness: a gated process's slot (the gate counted from the process's start), else NVML's
        figure less the context overhead (learnt per GPU from processes whose true figure is known:
        the smallest difference; none known yet: nothing taken off, an over-count that errs toward
        holding the limit). The caller takes max(eBPF, rebuilt): eBPF only ever adds what it saw."""
        nvml_mem = {(p.pid, p.gpu): p.used_bytes for p in nvml_procs}
        out: dict[tuple[int, str], int] = {}
        inherited: dict[int, bool] = {}

        def is_inherited(pid: int) -> bool:
            if pid not in inherited:
                info = self._info_of(pid, config)
                inherited[pid] = info is not None and self.proc.alive(pid) and self._inherited(pid, info)
            return inherited[pid]

        overhead: dict[str, int] = {}
        for pid, sv in slots.items():
            info = self._info_of(pid, config)
            if info is not None and sv.start_time and info.start_time is not None and sv.start_time != info.start_time:
                continue  # a reused pid: the slot is a dead process's, left for the agent to free
            for g, uuid in enumerate(physical):
                if not sv.gpu_mask >> g & 1:
                    continue
                if (pid, uuid) in nvml_mem:
                    diff = max(0, nvml_mem[(pid, uuid)] - sv.memory[g])
                    overhead[uuid] = min(overhead.get(uuid, diff), diff)
                if sv.memory[g] and is_inherited(pid):
                    out[(pid, uuid)] = sv.memory[g]
        for (pid, uuid), used in nvml_mem.items():
            if pid in slots or is_inherited(pid) or (pid, uuid) not in ebpf_mem:
                continue
            diff = max(0, used - ebpf_mem[(pid, uuid)])  # eBPF saw all of this one's allocations
            overhead[uuid] = min(overhead.get(uuid, diff), diff)
        self._context_bytes.update(overhead)
        for (pid, uuid), used in nvml_mem.items():
            if pid not in slots and is_inherited(pid):
                out[(pid, uuid)] = max(0, used - self._context_bytes.get(uuid, 0))
        holding = {pid for (pid, _), used in out.items() if used > 0}
        new = holding - self._inherited_holding
        if new:
            log.info("memory_rebuilt", pids=sorted(new)[:20],
                     bytes={f"{pid}/{uuid}": used for (pid, uuid), used in sorted(out.items()) if pid in new})
            self._alloc_event = True  # the watcher enforces on them at once
        self._inherited_holding = holding
        self._rebuild_due = False
        return out

    # -- per-process facts -------------------------------------------------------------------------

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
        rules: dict[str, Sequence[str]] = {}
        if config is not None:
            rules = {name: tuple(getattr(g, "cgroups", ())) for name, g in config.groups.items()}
        info = _Info(
            start_time=start,
            comm=self.proc.comm(pid) or "?",
            group=group_for(env, self.proc.cgroups(pid) or [], rules),
            uuids=visible_devices(env.get(ENV_VISIBLE_DEVICES), self._gpu_list()),
            rules_id=rules_id,
        )
        self._info[pid] = info
        return info

    def _slots(self) -> dict[int, _SlotView]:
        if self.region is None:
            return {}
        out: dict[int, _SlotView] = {}
        for index, s in self.region.live_slots():
            out[s.pid] = _SlotView(s.pid, index, tuple(s.memory), tuple(s.launches), tuple(s.busy_ns), s.gpu_mask,
                                   s.start_time)
        return out

    # -- the snapshot ------------------------------------------------------------------------------

    def poll(self, now_ns: int | None = None) -> Snapshot:
        now = self.clock() if now_ns is None else now_ns
        config = self.config_getter()
        usage: list[Usage] = []
        ebpf_launches: dict[int, int] = {}
        ebpf_devices: dict[int, int] = {}
        with self._lock:
            if self.probes is not None:
                self._reap()
                usage = self.probes.usage()
                ebpf_devices = self.probes.devices()
                if self.probes.mode == "launches":
                    ebpf_launches = self.probes.launches()
        stale = [pid for pid in ebpf_launches if pid not in ebpf_devices and not self.proc.alive(pid)]
        if stale:  # counted launches, but its context (and so its exit) was never seen
            with self._lock:
                if self.probes is not None:
                    self.probes.forget(stale)
        slots = self._slots()
        nvml_procs = self.nvml.processes() if self.nvml.available else []
        physical = self._gpu_list()

        # (pid, gpu uuid) -> figures from each source
        ebpf_mem: dict[tuple[int, str], int] = {}
        ebpf_gpus: dict[int, list[str]] = {}
        for u in usage:
            info = self._info_of(u.pid, config)
            if info is None or u.dev >= len(info.uuids):
                continue
            uuid = info.uuids[u.dev]
            ebpf_mem[(u.pid, uuid)] = ebpf_mem.get((u.pid, uuid), 0) + u.bytes
            ebpf_gpus.setdefault(u.pid, []).append(uuid)
        launch_gpu = {pid: gpus[0] for pid, gpus in ebpf_gpus.items()}
        for pid, dev in ebpf_devices.items():  # a context and no memory (yet) is a GPU user too
            info = self._info_of(pid, config)
            if info is not None and dev < len(info.uuids):
                ebpf_mem.setdefault((pid, info.uuids[dev]), 0)
                launch_gpu[pid] = info.uuids[dev]  # launches count on the device it works on last
        nvml_mem = {(p.pid, p.gpu): p.used_bytes for p in nvml_procs}
        rebuilt = self._rebuilt(config, slots, nvml_procs, physical, ebpf_mem) if self.probes is not None else {}

        keys: set[tuple[int, str]] = set(ebpf_mem) | set(nvml_mem)
        for pid, sv in slots.items():
            for g, uuid in enumerate(physical):
                if sv.gpu_mask >> g & 1:
                    keys.add((pid, uuid))

        live: dict[tuple[int, str], ProcessAccount] = {}
        for pid, uuid in keys:
            # eBPF removes a process's device at its exit: those need no /proc read to be known alive.
            if pid not in ebpf_devices and not self.proc.alive(pid):
                self._info.pop(pid, None)
                continue
            info = self._info_of(pid, config)
            if info is None:
                continue
            slot = slots.get(pid)
            g = physical.index(uuid) if uuid in physical else -1
            gated = slot is not None
            if (pid, uuid) in rebuilt:
                memory = max(rebuilt[(pid, uuid)], ebpf_mem.get((pid, uuid), 0))
            elif self.probes is not None and (pid, uuid) in ebpf_mem:
                memory = ebpf_mem[(pid, uuid)]
            elif slot is not None and g >= 0:
                memory = slot.memory[g]
            else:
                memory = nvml_mem.get((pid, uuid), 0)
            launches: int | None = None
            busy = 0.0
            if slot is not None and g >= 0:
                launches = slot.launches[g]
                busy = slot.busy_ns[g] / 1e9
            elif pid in ebpf_launches and launch_gpu.get(pid) == uuid:
                launches = ebpf_launches[pid]
            live[(pid, uuid)] = ProcessAccount(pid, info.comm, info.group, uuid, memory, busy, launches, gated)
            if slot is not None and g >= 0 and self.probes is not None and (pid, uuid) in ebpf_mem:
                self._check_tampering(pid, info.group, uuid, slot.memory[g], ebpf_mem[(pid, uuid)])

        if self.group_seconds is not None:
            self._share_gpu_time(live, config)
        self._integrate_nvml(now, live, slots, physical)
        return self._with_exited(now, live)

    def _share_gpu_time(self, live: dict[tuple[int, str], ProcessAccount], config: _Config | None) -> None:
        """Gated processes' GPU time, apportioned within each group (GpuTimeShare)."""
        assert self.group_seconds is not None
        raw: dict[tuple[str, str], dict[int, float]] = {}
        inherited: set[int] = set()
        for (pid, uuid), acc in live.items():
            if acc.gated:
                raw.setdefault((uuid, acc.group), {})[pid] = acc.gpu_seconds
                info = self._info_of(pid, config)
                if info is not None and self._inherited(pid, info):
                    inherited.add(pid)
        shared = self._time_share.apportion(raw, self.group_seconds(), inherited)
        for key, seconds in shared.items():
            live[key] = replace(live[key], gpu_seconds=seconds)

    def _check_tampering(self, pid: int, group: str, uuid: str, slot_bytes: int, ebpf_bytes: int) -> None:
        """A slot that shows less than eBPF saw is hiding memory from the gates' quota. The gate
        reserves before it calls the driver, so a slot may lead eBPF for a moment, never trail it
        for two polls in a row with the same figures."""
        key = (pid, uuid)
        if slot_bytes >= ebpf_bytes:
            self._tamper_suspect.pop(key, None)
            self._tampered.discard(key)
            return
        if self._tamper_suspect.get(key) == (slot_bytes, ebpf_bytes) and key not in self._tampered:
            self._tampered.add(key)
            self.enforcer.note_tampering(pid, group, uuid, slot_bytes, ebpf_bytes)
        self._tamper_suspect[key] = (slot_bytes, ebpf_bytes)

    def _integrate_nvml(
        self, now: int, live: dict[tuple[int, str], ProcessAccount], slots: Mapping[int, _SlotView],
        physical: Sequence[str],
    ) -> None:
        """GPU time of ungated processes: NVML's busy fraction x elapsed time, less what the gates
        account on that GPU, shared equally among the ungated processes on it. Coarse by nature."""
        last, self._last_poll_ns = self._last_poll_ns, now
        util = self.nvml.utilization() if self.nvml.available and last is not None else {}
        dt = 0.0 if last is None else (now - last) / 1e9
        for uuid, fraction in util.items():
            gated_busy = 0.0  # what the gates accounted on this GPU since the last poll
            for key, acc in live.items():
                if key[1] == uuid and acc.gated:
                    prev = self._seen.get(key)
                    gated_busy += max(0.0, acc.gpu_seconds - (prev.account.gpu_seconds if prev else acc.gpu_seconds))
            share = [k for k, a in live.items() if k[1] == uuid and not a.gated]
            if not share:  # NVML's window still holds the work of a process that just exited
                share = [k for k, s in self._seen.items()
                         if k[1] == uuid and s.exited_ns is not None and now - s.exited_ns < NVML_WINDOW_NS
                         and not s.account.gated]
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

    def _with_exited(self, now: int, live: dict[tuple[int, str], ProcessAccount]) -> Snapshot:
        for key, acc in live.items():
            seen = self._seen.get(key)
            if seen is None:
                seen = self._seen[key] = _Seen(acc)
            seen.account, seen.exited_ns = acc, None
            seen.nvml_in_account = 0.0 if acc.gated else seen.nvml_seconds
        out = list(live.values())
        for key, seen in list(self._seen.items()):
            if key in live:
                continue
            if seen.exited_ns is None:
                seen.exited_ns = now
            if now - seen.exited_ns >= self.grace_ns:
                del self._seen[key]
                continue
            tail = seen.nvml_seconds - seen.nvml_in_account  # NVML's window after the exit
            out.append(replace(seen.account, memory_bytes=0, exited_ns=seen.exited_ns,
                               gpu_seconds=seen.account.gpu_seconds + tail))
        return Snapshot(now, tuple(sorted(out, key=lambda a: (a.gpu, a.pid))))

    def stop_watching(self) -> None:
        """Stop the watcher thread (enforcement, rescans); close() detaches the probes after it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)

    def close(self) -> None:
        self.stop_watching()
        if self.probes is not None:
            with self._lock:
                self.probes.close()
            self.probes = None
