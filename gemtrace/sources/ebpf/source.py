"""The eBPF source: bcc's uprobes on every libcuda file on the host, and the thread that waits on them.

Owns the probes' lifetime (attach at start, rescan /proc for libcuda files every
LIBCUDA_RESCAN_SECONDS, detach what no live process maps), the ring-buffer thread, and reading
eBPF's maps into per-process figures. An allocation's event wakes the thread, which wakes the
listeners (the enforcer) at once: the OOM killer's latency is this thread's. Any user can allocate and
free in a loop (no gate needed: the probes see every process), so what that costs is bounded on both
sides: the BPF program writes at most one allocation event per GT_ALLOC_EVENT_GAP_NS (the thread looks
again that long after each event, for the allocations written none), and the listeners run at most
CHECK_CPU_SHARE of the time they take (a check that took 1 ms comes 10 ms after the last at the
soonest, and at once where none ran for that long). It also knows its own
blindness: what a process allocated before its libcuda was probed (started before the probes, or a
container's copy found late) was never seen. Never merges, decides or kills.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path

import structlog

from gemtrace import defaults
from gemtrace.contract import ALLOC_EVENT_GAP_NS, EVENT_ALLOC, EVENT_EXIT
from gemtrace.groups_of import ProcReader
from gemtrace.sources import AllocationListener, Devices, Figures, Key, SourceReading
from gemtrace.sources.ebpf import libcuda
from gemtrace.sources.ebpf.probes import BpfProbes, Event, Usage

log = structlog.get_logger("gemtrace.accounting")

# The share of the watcher's time that the listeners' checks (the enforcer's, reading every process's
# memory) may take, however often events come: 0.1 is 10% of a core at most. A user's allocate-and-free
# loop made the agent burn 98% of a core before this bound, 12% with it (bench/results/tenant_loops.md).
CHECK_CPU_SHARE = 0.1
# The longest the watcher blocks in the ring buffer's poll (the stop and the rescan are seen within it).
POLL_MS = 50


def boot_ticks() -> int:
    """Now, in the unit of /proc/PID/stat's start time (clock ticks since boot)."""
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * os.sysconf("SC_CLK_TCK"))


def memory_figures(usage: Iterable[Usage], devices: Devices, skip: Collection[int] = ()) -> dict[Key, Figures]:
    """eBPF's bytes (device and managed) and last allocation time by (pid, GPU UUID), the processes in
    `skip` left out (pure)."""
    memory: dict[Key, int] = {}
    managed: dict[Key, int] = {}
    last_alloc: dict[Key, int] = {}
    for u in usage:
        if u.pid in skip:
            continue
        uuid = devices.of(u.pid, u.dev)
        if uuid is None:
            continue
        key = (u.pid, uuid)
        memory[key] = memory.get(key, 0) + u.bytes
        managed[key] = managed.get(key, 0) + u.managed
        last_alloc[key] = max(last_alloc.get(key, 0), u.last_alloc_ns)
    return {key: Figures(memory=used, last_alloc_ns=last_alloc[key], managed=managed[key])
            for key, used in memory.items()}


def usage_figures(usage: Iterable[Usage], contexts: Mapping[int, int], launches: Mapping[int, int],
                  devices: Devices) -> dict[Key, Figures]:
    """eBPF's maps as figures (pure): `usage`, a process's bytes per device ordinal; `contexts`, pid ->
    the ordinal of its current context (a context and no memory yet is a GPU user too); `launches`,
    pid -> launches (the "launches" mode), counted on the device it works on last."""
    figures = memory_figures(usage, devices)
    launch_gpu: dict[int, str] = {}
    for pid, uuid in figures:  # in `usage`'s order: a process's first device until a context says
        launch_gpu.setdefault(pid, uuid)
    for pid, dev in contexts.items():
        current = devices.of(pid, dev)
        if current is not None:
            figures.setdefault((pid, current), Figures(memory=0, last_alloc_ns=0))
            launch_gpu[pid] = current
    return {
        (pid, uuid): f._replace(launches=launches[pid] if pid in launches and launch_gpu.get(pid) == uuid else None)
        for (pid, uuid), f in figures.items()
    }


class EbpfSource:
    """Raises BpfUnavailable (from BpfProbes) when bcc cannot run here."""

    def __init__(
        self,
        probe_mode: str = defaults.PROBE_MODE,
        proc_root: Path = Path("/proc"),
        libcuda_paths: Sequence[Path] | None = None,
        scan_host: bool = True,
        rescan_seconds: float = defaults.LIBCUDA_RESCAN_SECONDS,
        clock: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        """`libcuda_paths`: files probed from the start (None: the host's, from ldconfig). `scan_host`
        False: probe only those, never the other libcuda files that processes map. `clock`:
        CLOCK_MONOTONIC's, as the BPF program's timestamps (the looks after an event are timed by them)."""
        # A process started by now may hold memory that eBPF never saw (probes attach below).
        self.since_ticks = boot_ticks()
        self.probes = BpfProbes(probe_mode)
        self.proc = ProcReader(proc_root)
        self.proc_root = proc_root
        self._scanner = libcuda.Scanner(proc_root)
        # Probed from the start even before any process maps them, so that a process's first
        # allocations are not missed while the next rescan is due.
        self.libcuda_paths = tuple(libcuda.system_paths() if libcuda_paths is None else libcuda_paths)
        self.scan_host = scan_host
        self.rescan_ns = int(rescan_seconds * 1e9)
        self.clock = clock
        self._lock = threading.RLock()  # guards bcc and the sets below
        self._listeners: list[AllocationListener] = []
        self._exited: set[int] = set()  # exit events not yet reaped
        self._gone: set[int] = set()  # reaped, not yet reported in a reading
        self._late_pids: set[int] = set()  # mapped a libcuda file before a rescan probed it
        self._wake = False
        self._last_alloc_ns: int | None = None
        self._trailing_ns: int | None = None  # a look due once the last event's gap passed
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.probes.open_events(self._on_event)
        self.rescan()

    # -- status --------------------------------------------------------------------------------------

    @property
    def status(self) -> str:
        with self._lock:
            return f"attached {self.probes.probe_count} probes to {len(self.probes.files)} files"

    @property
    def probes_attached(self) -> int:
        return self.probes.probe_count

    @property
    def libcuda_files(self) -> int:
        return len(self.probes.files)

    # -- events and the thread -----------------------------------------------------------------------

    def subscribe(self, listener: AllocationListener) -> None:
        self._listeners.append(listener)

    def start(self) -> None:
        self._wake = True  # the first look checks what was rebuilt at start
        self._thread = threading.Thread(target=self._watch, name="gemtrace-accounting", daemon=True)
        self._thread.start()

    def nudge(self) -> None:
        self._wake = True

    def _on_event(self, ev: Event) -> None:
        if ev.type == EVENT_ALLOC:
            self._wake = True
            self._last_alloc_ns = ev.ts_ns
            # The allocations after it and within the gap were written no event: a look once it passed.
            self._trailing_ns = ev.ts_ns + ALLOC_EVENT_GAP_NS
        elif ev.type == EVENT_EXIT:
            with self._lock:  # _reap swaps the set from the polling thread
                self._exited.add(ev.pid)
            self._wake = True  # memory went: a pending kill may be settled

    def _watch(self) -> None:
        next_scan = self.clock() + self.rescan_ns
        check_at = 0  # the soonest the listeners may run again (CHECK_CPU_SHARE)
        while not self._stop.is_set():
            now = self.clock()
            due = [next_scan, now + POLL_MS * 1_000_000]
            if self._wake:
                due.append(check_at)
            if self._trailing_ns is not None:
                due.append(self._trailing_ns)
            # (bcc's poll counts in ms: a deadline within the next one is waited for the whole ms.)
            self.probes.poll_events(max(1, -(-(min(due) - now) // 1_000_000)))
            now = self.clock()
            if self._trailing_ns is not None and now >= self._trailing_ns:
                self._trailing_ns, self._wake = None, True
            if self._wake and now >= check_at:
                self._wake = False
                cpu = time.thread_time_ns()
                self._check()
                check_at = now + int((time.thread_time_ns() - cpu) / CHECK_CPU_SHARE)
            if self.clock() >= next_scan:
                next_scan = self.clock() + self.rescan_ns
                try:
                    self.rescan()
                except Exception:
                    log.exception("libcuda_rescan_failed")

    def _check(self) -> None:
        """The exits reaped, then every listener asked to check (the enforcer: every group's memory)."""
        with self._lock:
            self._reap()
        for listener in self._listeners:
            try:
                listener.on_allocation(self._last_alloc_ns)
            except Exception:
                log.exception("enforcement_failed")

    # -- libcuda files -------------------------------------------------------------------------------

    def rescan(self) -> None:
        """Attach to libcuda files newly mapped; detach from those no live process maps any more."""
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

    def _reap(self) -> None:
        """Drop every record of the processes seen exiting (caller holds the lock)."""
        if self._exited:
            gone, self._exited = self._exited, set()
            self.probes.forget(gone)
            self._late_pids -= gone
            self._gone |= gone

    # -- readings ------------------------------------------------------------------------------------

    def _reap_for(self, devices: Devices) -> None:
        """Reap, and tell `devices` which processes went (before it maps any of their ordinals)."""
        with self._lock:
            self._reap()
            gone, self._gone = self._gone, set()
        if gone:
            devices.forget(gone)

    def _reading(self, figures: dict[Key, Figures], alive: frozenset[int] = frozenset()) -> SourceReading:
        with self._lock:
            missed = frozenset(self._late_pids)
        return SourceReading(figures, alive=alive, since_ticks=self.since_ticks, missed=missed)

    def memory(self, devices: Devices) -> SourceReading:
        self._reap_for(devices)
        with self._lock:
            usage = self.probes.usage()
            exited = set(self._exited)
        return self._reading(memory_figures(usage, devices, skip=exited))

    def read(self, now_ns: int, devices: Devices) -> SourceReading:
        usage: list[Usage]
        launches: dict[int, int] = {}
        self._reap_for(devices)
        with self._lock:
            usage = self.probes.usage()
            contexts = self.probes.devices()
            if self.probes.mode == "launches":
                launches = self.probes.launches()
        stale = [pid for pid in launches if pid not in contexts and not self.proc.alive(pid)]
        if stale:  # counted launches, but its context (and so its exit) was never seen
            with self._lock:
                self.probes.forget(stale)
        figures = usage_figures(usage, contexts, launches, devices)
        return self._reading(figures, alive=frozenset(contexts))

    def stop_watching(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)

    def close(self) -> None:
        self.stop_watching()
        with self._lock:
            self.probes.close()
