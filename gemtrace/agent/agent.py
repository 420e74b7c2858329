"""The agent: wires the resource file, the region, one scheduler per GPU, the accounting and /metrics.

Owns the agent's lifecycle: the state dir's lock (one agent per region), the keeper thread (the
heartbeat every tick, since gates ignore a silent agent so a dead agent never hangs a program; the
group of every new gated process decided within the tick, gemtrace/agent/membership.py; and every second
the group table re-asserted, processes of dropped groups moved to default, unused entries freed),
the config thread (reloading the resource file when it changes or on SIGHUP, so that no file can
stall anything else), and the main loop: reaping the slots of processes that died
(the loop sleeps on their pidfds: a watched process's exit wakes it at once, and a look
for new slots, every REAPER_SCAN_SECONDS for a second after a gate joined, else every
REAPER_IDLE_SCAN_SECONDS, bounds the rest) and polling the accounting at the scrape cadence. The
heartbeat has its thread so that no amount of reaping or accounting delays it. It decides nothing
itself: the schedulers decide who runs, membership which group a process is in, the enforcer whom
to kill. On SIGTERM or
SIGINT it stops cleanly and fast: every word released and heartbeat 0 first, so no gate is left
waiting, then the probes detached.
"""

from __future__ import annotations

import contextlib
import errno
import faulthandler
import fcntl
import math
import os
import random
import resource
import select
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import structlog
from prometheus_client import CollectorRegistry

from gemtrace import contract, defaults, mps
from gemtrace import region as rg
from gemtrace.agent.accounting import Accounting, Snapshot, Sources
from gemtrace.agent.collectors import Isolated
from gemtrace.agent.collectors.agent import AgentCollector, AgentView
from gemtrace.agent.collectors.attach import AttachCollector
from gemtrace.agent.collectors.enforcement import EnforcementCollector
from gemtrace.agent.collectors.groups import GroupCollector, GroupQuota, GroupsView
from gemtrace.agent.collectors.processes import ProcessCollector
from gemtrace.agent.enforcement import Enforcement, MemoryEnforcer
from gemtrace.agent.gang import GangTurns, JobKeys
from gemtrace.agent.membership import Membership
from gemtrace.agent.scheduler import GpuScheduler, GroupUsage, Quota
from gemtrace.agent.scheduler_loop import scheduler_threads
from gemtrace.agent.state_dir import StateDirError, open_lock_file, open_state_dir, storage_error
from gemtrace.config import (
    ISOLATION_MPS,
    UNATTACHED,
    UNATTACHED_DEFAULT,
    ConfigError,
    ConfigWatcher,
    GroupConfig,
    ResourceConfig,
    dropin_dir,
    load,
    unknown_gpus,
)
from gemtrace.gpus import Gpu, discover
from gemtrace.groups_of import ProcReader
from gemtrace.kube.pods import NAMES_FILE, PodLabels, refused_file, write_refusals
from gemtrace.region import Region, RegionError
from gemtrace.signals import SignalInbox
from gemtrace.sources.ebpf import BpfUnavailable, EbpfSource
from gemtrace.sources.gate import GateSource
from gemtrace.sources.nvml import NvmlLike, NvmlReader, NvmlSource

log = structlog.get_logger("gemtrace.agent")

# Set to libcuda paths (separated by ':'), the agent probes only those files instead of every
# libcuda on the host: `make demo` sets it to the simulated libcuda, so that its agent neither
# accounts for nor kills the host's other programs.
ENV_PROBE_LIBCUDA = "GEMTRACE_PROBE_LIBCUDA"

DEFAULT_GROUP = defaults.DEFAULT_GROUP

ACCOUNTING_POLL_SECONDS = 1.0  # the scrape cadence: polling faster costs CPU for nothing (docs/accounting.md)
# The second look at a slot seen above what its process holds: longer than an honest reservation
# stays ahead of the driver's answer, short against what a liar's figure denies meanwhile.
AUDIT_AGAIN_SECONDS = 0.2
# How often the main loop looks for slots it does not watch yet, for JOIN_FAST_SECONDS after a gate
# asked for one (it claims it within that), and else. A watched process's exit wakes the loop at once
# (its pidfd), so this bounds only the reaping of a process that died before its first look: within
# 100 ms where it claimed its slot within a second of asking, a quarter second at worst. A wake-up
# costs more CPU than the look it makes (cold caches; a VM deschedules an idle vCPU:
# bench/results/agent_cpu.md), so an idle agent looks only 4 times a second.
REAPER_SCAN_SECONDS = 0.050
REAPER_IDLE_SCAN_SECONDS = 0.250
# A slot claimed but never filled (its gate killed in between: microseconds) is judged after this long.
SLOT_FILL_SECONDS = 1.0
FULL_LOOK_SECONDS = 1.0  # the reaper looks at every slot at least this often
TABLE_SECONDS = 1.0  # how often the group table is re-asserted: a forged limit lasts at most this long
LOCK_FILE = "agent.lock"
KEEPER_NICE = -10  # the keeper thread's nice value (Linux gives each thread its own)
JOIN_FAST_SECONDS = 1.0  # the keeper ticks every TICK_SECONDS this long after a gate asked for a slot


class AgentRunning(RegionError):
    """Another agent holds the state dir's lock."""


class AgentLock:
    """An exclusive flock on $STATE_DIR/agent.lock, held for the agent's life: two agents on one
    region would each release a group, and both would run at once. The file holds the owner's pid,
    for the message the second one gives. The kernel drops the lock when the process dies.

    Taking it is the agent's first step in the state dir: the directory is checked to be the agent's
    own (gemtrace/agent/state_dir.py) and `state_dir` is then its resolved path, the one the agent uses."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir, dir_fd = open_state_dir(state_dir)
        try:
            fd = open_lock_file(dir_fd, self.state_dir, LOCK_FILE)
        finally:
            os.close(dir_fd)
        path = self.state_dir / LOCK_FILE
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            raise AgentRunning(f"another gemtrace agent (pid {owner}) owns {state_dir}; stop it first") from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as e:
            os.close(fd)
            raise storage_error(path, e) or StateDirError(f"{path}: {e.strerror or e}") from None
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


# The kernel gives its initial PID namespace this inode number (PROC_PID_INIT_INO, include/linux/proc_ns.h).
INIT_PID_NAMESPACE_INO = 0xEFFFFFFC


def nested_pid_namespace(proc_root: Path = Path("/proc")) -> bool:
    """True when this process is not in the host's (the initial) PID namespace. An agent there sees
    other pids than eBPF and the gates report (a container without hostPID: docs/kubernetes.md).
    /proc/self/status's NSpid would not tell: a container's own /proc shows only its own level."""
    try:
        return os.stat(proc_root / "self" / "ns" / "pid").st_ino != INIT_PID_NAMESPACE_INO
    except OSError:
        return False


def raise_fd_limit() -> tuple[int, int]:
    """Raise RLIMIT_NOFILE's soft limit to the hard one: the reaper holds a pidfd per gated process
    (1000 processes with the default 1024 ran out). Returns (soft, hard) after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass  # keep the soft limit; the reaper copes with EMFILE (retries, never takes it for gone)
    return soft, hard


class Reaper:
    """Frees the slots of processes that died, within one tick: each live slot's process is watched
    through a pidfd, which becomes readable when the process exits (zombies included).

    Only a process known to be gone (ESRCH, no /proc entry, another start time) is freed: a failure
    to look (out of file descriptors, say) is retried on later ticks, never taken for an exit (that
    once freed live processes' slots, and their memory left the group's sum)."""

    def __init__(self, region: Region, proc_root: Path = Path("/proc")) -> None:
        self.region = region
        self.proc = ProcReader(proc_root)
        self._watched: dict[int, tuple[int, int]] = {}  # slot index -> (pid, pidfd)
        self._start_times: dict[int, int] = {}  # pid -> start time, of every watched process
        # epoll, not poll: poll(2) walks every registered pidfd at each wait and tick (1024 at the
        # region's limit, pidfd_poll in a perf profile of the main thread), epoll only the ready ones.
        self._poll = select.epoll()
        self._also: set[int] = set()  # descriptors `wait` also watches, registered once
        self._index_of_fd: dict[int, int] = {}
        self._last_pids: list[int] = []
        self._retry = False  # some live slot could not be looked at: look again next tick
        self._filling: dict[int, tuple[int, float]] = {}  # slot index -> (pid, when first seen unfilled)
        self._next_full_look = 0.0
        self.fd_limit_hits = 0  # how often a look failed for want of file descriptors

    def tick(self) -> list[int]:
        """Free dead processes' slots; returns their pids."""
        freed: list[int] = []
        exited = False  # a watched process left (its gate may have freed its slot itself)
        pids = self.region.slot_pids()
        now = time.monotonic()
        # Every second a full look whatever changed: a slot claimed while a tick was freeing others
        # could otherwise go unwatched for good (6 of 150 killed processes kept their slots, 1 run in 10).
        if pids != self._last_pids or self._retry or now >= self._next_full_look:
            self._last_pids = pids
            self._retry = False
            self._next_full_look = now + FULL_LOOK_SECONDS
            for index, (pid, _) in list(self._watched.items()):
                if pids[index] != pid:
                    self._unwatch(index)  # the gate freed its own slot at exit
                    exited = True
            for index, pid in enumerate(pids):
                if not pid or index in self._watched:
                    continue
                if not self._filled(index, pid):
                    self._retry = True
                    continue
                state = self._watch(index, pid)
                if state is None:
                    self._retry = True
                elif not state and self.region.free_slot(index, pid):
                    freed.append(pid)
        exited = exited or bool(freed)
        for fd, _ in self._poll.poll(0) if self._watched else ():
            if fd not in self._index_of_fd:
                continue  # one of `wait`'s own descriptors
            watched = self._index_of_fd[fd]
            pid = self._watched[watched][0]
            self._unwatch(watched)
            exited = True
            if self.region.free_slot(watched, pid):
                freed.append(pid)
        if exited and self.region.doorbells is not None:
            # A process that left with work queued rang nobody: where it was its group's last busy one
            # on a GPU (a drain's end, or a holder going quiet while another group waits), that GPU's
            # scheduler would see it only at a net or its slice's end. A ring costs a look at most.
            self.region.doorbells.ring_all()
        for pid in freed:
            log.info("process_reaped", pid=pid)
        if freed:
            # Look at every slot next tick: a fresh read here would also take in slots claimed since
            # this tick's read, which then no tick would ever look at.
            self._last_pids = []
        return freed

    def wait(self, timeout: float, *also: int) -> None:
        """Sleep until a watched process exits, one of `also` (descriptors: the signals' pipe, the
        joins' eventfd) is readable, or `timeout` seconds pass."""
        wanted = set(also)
        for fd in self._also - wanted:
            with contextlib.suppress(OSError):  # (closed since: epoll forgot it)
                self._poll.unregister(fd)
        for fd in wanted - self._also:
            self._poll.register(fd, select.EPOLLIN)
        self._also = wanted
        self._poll.poll(max(0.0, timeout))

    def _filled(self, index: int, pid: int) -> bool:
        """Whether the slot's gate has filled it (its flag is written last, hook/attach.c), so that its
        start time can be believed: judged before, a pod's gate's pid from its own namespace (which
        here names another process, or none) was watched as it stood, never translated, and the
        process never placed in its group (1 of 100 pods), or its slot freed while it lived. A slot
        left unfilled for SLOT_FILL_SECONDS (its gate killed while filling) is judged as it stands."""
        if self.region.slots[index].flags & contract.SLOT_GATED:
            self._filling.pop(index, None)
            return True
        seen = self._filling.get(index)
        if seen is None or seen[0] != pid:
            seen = self._filling[index] = (pid, time.monotonic())
        if time.monotonic() - seen[1] < SLOT_FILL_SECONDS:
            return False
        del self._filling[index]
        return True

    def _watch(self, index: int, pid: int) -> bool | None:
        """Start watching a newly seen slot: True when watched (or not ours to judge), False when
        its process is gone or the pid was reused by another process (its start time differs from
        the slot's), None when it cannot tell now (retry)."""
        fd: int | None
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            fd = None  # no such pid here: gone, or a pod's gate's pid from its own namespace
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE):
                self._out_of_fds(e)
                return None
            return True  # not ours to judge (e.g. no pidfd support): leave the slot alone
        recorded = self.region.slots[index].start_time
        actual = None
        if fd is not None:
            try:
                actual = self.proc.start_time_strict(pid)
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.EMFILE, errno.ENFILE):
                    self._out_of_fds(e)
                return None
        if fd is None or actual is None or (recorded and actual != recorded):
            # Before taking it for gone, look for it under its host pid: a pod's process whose pid
            # names no process here had its slot freed while it ran, and was never placed in its
            # group (the 2 GiB and 30/70 e2e tests, in the fresh-machine run).
            if fd is not None:
                os.close(fd)
            host_pid = self.host_pid(pid, recorded)
            if host_pid is None:
                return False
            # A gate in a container's PID namespace (a pod) stored its pid there. The slot gets the
            # pid the process has here, which the accounting, eBPF and /proc all speak; the gate
            # then leaves the freeing at exit to this reaper (docs/kubernetes.md).
            try:
                fd = os.pidfd_open(host_pid)
            except OSError:
                return False
            if not self.region.translate_slot(index, pid, host_pid):
                os.close(fd)
                return None  # the slot changed owner meanwhile: look again
            pid, actual = host_pid, recorded  # host_pid() found it by that start time
        self._watched[index] = (pid, fd)
        self._start_times[pid] = actual
        self._index_of_fd[fd] = index
        self._poll.register(fd, select.EPOLLIN)
        return True

    def host_pid(self, pid: int, start_time: int) -> int | None:
        """The pid in this namespace of the process that is `pid` in its own (innermost) namespace
        and started at `start_time` (the same in every namespace), or None. Reads every process's
        status: done once per slot, and only for a slot whose pid is not a process of ours."""
        if not start_time:
            return None
        root = self.proc.proc_root
        for entry in os.scandir(root):
            if not entry.name.isdigit():
                continue
            try:
                status = (root / entry.name / "status").read_bytes()
            except OSError:
                continue
            nspid = next((line.split()[1:] for line in status.splitlines() if line.startswith(b"NSpid:")), [])
            if len(nspid) > 1 and int(nspid[-1]) == pid and self.proc.start_time(int(entry.name)) == start_time:
                return int(entry.name)
        return None

    def _out_of_fds(self, e: OSError) -> None:
        if not self.fd_limit_hits:
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            log.warning("fd_limit_reached", error=e.strerror, soft=soft, hard=hard, watched=len(self._watched),
                        consequence="processes beyond it are watched once descriptors free up; none is taken "
                        "for gone (raise LimitNOFILE in the unit)")
        self.fd_limit_hits += 1

    def start_time(self, pid: int) -> int | None:
        """The start time of `pid` if the reaper watches it (alive at the last tick: its pidfd had not
        signalled the exit, and a pidfd names one process, never a reused pid), else None. The
        accounting asks this instead of reading /proc/PID/stat of every gated process at every poll."""
        return self._start_times.get(pid)

    def _unwatch(self, index: int) -> None:
        pid, fd = self._watched.pop(index)
        self._start_times.pop(pid, None)
        self._poll.unregister(fd)
        del self._index_of_fd[fd]
        os.close(fd)

    def close(self) -> None:
        for index in list(self._watched):
            self._unwatch(index)
        self._poll.close()


def open_accounting(
    region: Region | None,
    config_getter: Callable[[], ResourceConfig | None],
    *,
    use_ebpf: bool = True,
    probe_mode: str = defaults.PROBE_MODE,
    libcuda_paths: Sequence[Path] | None = None,
    scan_host: bool = True,
    rescan_seconds: float = defaults.LIBCUDA_RESCAN_SECONDS,
    nvml: NvmlLike | None = None,
    enforcer: MemoryEnforcer | None = None,
    group_seconds: Callable[[], Mapping[tuple[str, str], float]] | None = None,
    watched: Callable[[int], int | None] | None = None,
) -> Accounting:
    """The host's accounting, started: the gates' slots of `region`, NVML (`nvml`; None: the host's
    libnvidia-ml), eBPF through bcc when `use_ebpf` (if bcc cannot run, one log line says why and the
    gates and NVML still count), and memory enforcement by `enforcer` (None: one that kills).
    `libcuda_paths`: files probed from the start (None: the host's, from ldconfig). `scan_host` False:
    probe only those, never the other libcuda files that processes map (the demo, which must not
    account for, nor kill, the host's other programs). `group_seconds`, `watched`: Accounting's."""
    ebpf: EbpfSource | None = None
    reason = "eBPF disabled by configuration"
    if use_ebpf:
        try:
            ebpf = EbpfSource(probe_mode, Path("/proc"), libcuda_paths, scan_host, rescan_seconds, time.monotonic_ns)
        except BpfUnavailable as e:
            reason = str(e)
            log.warning("ebpf_unavailable", reason=reason,
                        consequence="memory and launches come from the gates and NVML only")
    sources = Sources(GateSource(region), NvmlSource(nvml if nvml is not None else NvmlReader()), ebpf, reason)
    accounting = Accounting(region, config_getter, sources, group_seconds=group_seconds, watched=watched)
    accounting.start(Enforcement(enforcer or MemoryEnforcer(), accounting.limits, accounting.holdings))
    return accounting


def host_memory() -> int:
    """The host's physical memory in bytes (MemTotal)."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class Agent:
    def __init__(
        self,
        config_path: Path = defaults.CONFIG_PATH,
        state_dir: Path = defaults.STATE_DIR,
        use_ebpf: bool = True,
        probe_mode: str = defaults.PROBE_MODE,
        gpus: list[Gpu] | None = None,
        libcuda_paths: list[Path] | None = None,
        config_poll_seconds: float = defaults.CONFIG_POLL_SECONDS,
        pod_names: Path = NAMES_FILE,
        managed_host_limit: int | None = None,
        mps_control: str = mps.CONTROL,
        unattached: str = UNATTACHED_DEFAULT,
    ) -> None:
        """`libcuda_paths`: probe only these libcuda files (None: ENV_PROBE_LIBCUDA's, or when it is
        unset every libcuda file on the host). `managed_host_limit`: the managed memory Oversubscribe
        groups may hold in all (None: MANAGED_HOST_SHARE of the host's memory). `mps_control`: the
        nvidia-cuda-mps-control program for groups with Isolation=mps (gemtrace/mps.py). `unattached`:
        what a gate without a slot does (config.UNATTACHED)."""
        self.unattached = UNATTACHED[unattached]
        self.managed_host_limit = (int(host_memory() * defaults.MANAGED_HOST_SHARE) if managed_host_limit is None
                                   else managed_host_limit)
        self.config_path = config_path
        self.state_dir = state_dir
        self.gpus = discover() if gpus is None else gpus
        self.refused_file = refused_file(pod_names)
        self._refused: dict[str, str] = {}  # drop-in file name -> why it is left out, as last told
        self.config: ResourceConfig = self._load(config_path, in_force={})  # a bad file at start is fatal
        # Written by the reload thread only; read by /metrics.
        self.reloads = {"success": 1, "failure": 0}
        self.last_reload_ok = True
        self._warn_unknown_gpus(self.config)
        self.fd_limit = raise_fd_limit()
        self._lock = AgentLock(state_dir)  # before the region is touched: one agent per region
        state_dir = self.state_dir = self._lock.state_dir  # checked, and resolved: see AgentLock
        self._joined = threading.Event()  # a gate asked for its slot (the socket's thread sets it)
        self._fast_scan_until = -math.inf  # the main loop's: it scans for new slots fast until then
        self._join_bell = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)  # wakes the main loop at a join
        self._audit_seen: list[int] = []  # the slots' audit_requests at the last tick (_audit_asked)
        try:
            self.region = Region.create(state_dir, on_replace=lambda reason: log.warning(
                "region_replaced", reason=reason,
                consequence="programs still mapping the old file run ungated until they restart"), log=log.info,
                on_join=self._on_join)
        except BaseException:
            os.close(self._join_bell)
            self._lock.release()
            raise
        self._table_lock = threading.Lock()  # _apply (reloads) against the keeper's table pass
        self._groups: dict[int, GroupConfig] = {}  # group index -> what the region must say there
        # One set of turns for the groups that span GPUs; a change of turn rings the GPUs' doorbells.
        bells = self.region.doorbells
        self.gang = GangTurns(bells.ring if bells is not None else lambda gpu: None)
        self.jobs = JobKeys()
        self.schedulers = [GpuScheduler(self.region, g.index, gang=self.gang, jobs=self.jobs) for g in self.gpus]
        self.mps = mps.MpsDaemons(state_dir, mps_control)
        try:
            self._apply(self.config)
        except BaseException:
            self.mps.stop()
            raise
        self.membership = Membership(self.region, lambda: self.config.groups, jobs=self.jobs)
        self.membership.adopt_jobs()  # of the processes an agent before it placed in this region
        self.region.heartbeat(time.monotonic_ns())
        if libcuda_paths is None and os.environ.get(ENV_PROBE_LIBCUDA):
            libcuda_paths = [Path(p) for p in os.environ[ENV_PROBE_LIBCUDA].split(":") if p]
        self.reaper = Reaper(self.region)
        self.enforcer = MemoryEnforcer()  # its kills and tampering are counted on /metrics
        self.accounting = open_accounting(self.region, lambda: self.config, use_ebpf=use_ebpf, probe_mode=probe_mode,
                                          libcuda_paths=libcuda_paths, scan_host=libcuda_paths is None,
                                          enforcer=self.enforcer, group_seconds=self.group_seconds,
                                          watched=self.reaper.start_time)
        self.snapshot: Snapshot | None = None
        self.pod_labels = PodLabels(pod_names)
        self.watcher = ConfigWatcher(config_path, self.reload, config_poll_seconds)
        self._reload_lock = threading.Lock()  # one reload at a time: the thread's, or a caller's
        self._stop = threading.Event()
        self.stop_signal: str | None = None  # the signal that asked for the stop, for the log
        self.stop_signal_at: float | None = None  # when (time.monotonic()), for the stop's timings
        self._threads: list[threading.Thread] = []
        self._keeper: threading.Thread | None = None

    # -- the resource file -------------------------------------------------------------------------

    def _apply(self, config: ResourceConfig) -> None:
        """Write accepted settings where they act: the region (gates read limits there) and the schedulers."""
        with self._table_lock:
            if self._groups:
                known = {g.name: index for index, g in self._groups.items()}
            else:  # the first time: a group of the adopted region keeps its index (running gates use it)
                known = {name: index for index, name in self.region.group_names().items()
                         if self.region.layout.groups[index].defined}
            groups = {known[name]: g for name, g in config.groups.items() if name in known}
            self._sync_table(groups)  # drops the others first, so that new names find room
            for name, g in config.groups.items():
                if name not in known:
                    groups[self.region.set_group(name, g.memory_limit, g.min_util, g.max_util,
                                                 g.oversubscribe_word())] = g
            self._groups = groups
            self._sync_table(groups)
            self.region.bump_generation()
        log.debug("group_numbers", groups={index: g.name for index, g in sorted(groups.items())})  # (the trace's)
        # An mps group runs side by side on a GPU whose daemon serves it, so that GPU's scheduler leaves
        # it out (its launches are never held); where no daemon could start, it takes turns as before.
        served = self.mps.ensure(g.uuid for g in self.gpus if mps.mps_groups(config.groups.values(), g.uuid))
        self.mps.publish(config.groups.values())
        quotas = {index: Quota(g.min_util, g.max_util, g.priority, g.opportunistic) for index, g in groups.items()}
        for gpu, scheduler in zip(self.gpus, self.schedulers, strict=True):
            scheduler.set_quotas({index: quota for index, quota in quotas.items()
                                  if not (gpu.uuid in served and groups[index].isolation == ISOLATION_MPS)})

    def _sync_table(self, groups: Mapping[int, GroupConfig]) -> None:
        """Make the region's group table say `groups` and nothing else, storing only what differs: a
        process whose group is not among them is moved to default (its assignment is rewritten: gates
        read their group there), and an entry no assignment refers to is freed, so renames never
        exhaust the table."""
        region = self.region
        default = next((index for index, g in groups.items() if g.name == DEFAULT_GROUP), None)
        slot_groups = region.slot_groups()
        if default is not None:
            for slot, group in slot_groups.items():
                if group not in groups:
                    pid = region.slots[slot].pid
                    if region.move_slot(slot, pid, group, default):
                        log.info("process_moved_to_default", pid=pid, slot=slot, group=group)
            slot_groups = region.slot_groups()
        used = set(slot_groups.values())
        for index in range(rg.MAX_GROUPS):
            entry = region.layout.groups[index]
            if index in groups:
                g = groups[index]
                region.put_group(index, g.name, g.memory_limit, g.min_util, g.max_util, g.oversubscribe_word())
            elif entry.defined or entry.name:
                region.undefine_group(index)
                if index not in used:
                    region.free_group(index)
        region.set_gpus([(g.uuid, g.memory_total) for g in self.gpus])
        region.set_managed_host_limit(self.managed_host_limit)
        region.set_unattached(self.unattached)

    def _keep_region(self) -> None:
        """The keeper thread: the heartbeat every tick, the table every TABLE_SECONDS; on the stop,
        every word released and the heartbeat 0 within a tick of the signal, whatever the main loop
        is in the middle of (an accounting poll of a thousand processes takes seconds)."""
        try:
            # Ahead of the agent's other threads for the CPU (1000 programs starting at once on a small
            # host starved it of whole tenths of a second); it wakes for a few microseconds a tick.
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), KEEPER_NICE)
        except OSError:
            pass  # without CAP_SYS_NICE: the default priority
        try:
            self._beat_until_stopped()
        finally:
            self.region.stop()

    def _beat_until_stopped(self) -> None:
        next_table = time.monotonic() + TABLE_SECONDS
        fast_until = 0.0
        while not self._stop.is_set():
            # Every TICK_SECONDS for a second after a gate asked for its slot (it waits for its group,
            # GT_ASSIGN_WAIT_NS): a plain sleep, half the CPU of an Event.wait wake-up. Else every
            # KEEPER_IDLE_SECONDS, or at once when a gate asks (the socket's thread sets _joined) or the
            # agent stops (close() sets it too).
            if time.monotonic() < fast_until:
                time.sleep(defaults.TICK_SECONDS)
            else:
                self._joined.wait(defaults.KEEPER_IDLE_SECONDS)
            if self._joined.is_set():
                self._joined.clear()
                fast_until = time.monotonic() + JOIN_FAST_SECONDS
            if self._stop.is_set():
                break
            self.region.heartbeat(time.monotonic_ns())
            try:
                # Every tick: new gates wait for it (GT_ASSIGN_WAIT_NS). Under the table's lock, so that
                # no decision names an entry a reload is freeing at that moment.
                with self._table_lock:
                    # First: a user's new chunk is trusted or not (issue 25) before its gate is placed.
                    try:
                        self.accounting.trust_new_chunks()
                    except Exception:
                        log.exception("chunk_trust_pass_failed")
                    self.membership.tick()
            except Exception:
                log.exception("membership_pass_failed")
            now = time.monotonic()
            if now >= next_table:
                next_table = now + TABLE_SECONDS
                try:
                    with self._table_lock:
                        self._sync_table(self._groups)
                except Exception:
                    log.exception("group_table_pass_failed")

    def reload(self, path: Path) -> bool:
        """Read, check and apply the resource file; on any failure the last good settings stay and
        /metrics says so (the failure counter, last reload success 0)."""
        with self._reload_lock:
            try:
                config = self._load(path, in_force=self.config.groups)
                self._apply(config)
            except (ConfigError, RegionError) as e:
                return self._reload_failed(str(e))
            except Exception as e:
                # The MPS clients' file in the state dir, on a filesystem now full or read-only: a sentence.
                found = storage_error(Path(e.filename or self.state_dir), e) if isinstance(e, OSError) else None
                if found is not None:
                    return self._reload_failed(str(found))
                log.exception("config_reload_crashed")  # a bug: report it, and keep reloading on the next change
                return self._reload_failed(f"{path}: {type(e).__name__}: {e}")
            self.config = config
            try:
                with self._table_lock:
                    self.membership.rebind()
            except Exception:
                log.exception("rebind_failed")  # a bug: the next reload that changes a binding rule tries again
            self._warn_unknown_gpus(config)
            self.last_reload_ok = True
            self.reloads["success"] += 1
            log.info("config_reloaded", path=str(path), groups=sorted(config.groups))
            # A MemoryLimit lowered below what a group holds acts now, not at its next allocation.
            self.accounting.enforce_soon()
            return True

    def _load(self, path: Path, in_force: Mapping[str, GroupConfig]) -> ResourceConfig:
        """The resource file and the drop-ins that fit (gemtrace.config.load); each drop-in left out
        is logged once per reason and told to the device plugin (gemtrace.kube.pods.write_refusals)."""
        config = load(path, gpu_memory={g.uuid: g.memory_total for g in self.gpus}, in_force=in_force)
        refused = {Path(r.path).name: r.reason for r in config.refused}
        for name, reason in refused.items():
            if self._refused.get(name) != reason:
                log.warning("dropin_refused", path=str(dropin_dir(path) / name), reason=reason,
                            consequence="its groups are not defined; every other file stays in force")
        self._refused = refused
        try:
            write_refusals(self.refused_file, refused)
        except OSError as e:  # the plugin then waits its full time for the group: no more than that
            log.warning("refusals_unwritable", path=str(self.refused_file), error=e.strerror)
        return config

    def _warn_unknown_gpus(self, config: ResourceConfig) -> None:
        for warning in unknown_gpus(config, (g.uuid for g in self.gpus)):
            log.warning("config_gpu_unknown", path=str(self.config_path), warning=warning)

    def _reload_failed(self, error: str) -> bool:
        self.last_reload_ok = False
        self.reloads["failure"] += 1
        log.error("config_reload_failed", error=error, consequence="the last good settings stay in force")
        return False

    def group_usage(self) -> dict[tuple[str, str], GroupUsage]:
        """What the schedulers gave each group, by (GPU UUID, group name), GPU by GPU in index order."""
        names = self.region.group_names()
        return {(gpu.uuid, names[index]): usage
                for gpu, scheduler in zip(self.gpus, self.schedulers, strict=True)
                for index, usage in sorted(scheduler.usage().items()) if index in names}

    def group_seconds(self) -> dict[tuple[str, str], float]:
        """GPU seconds the schedulers charged each group, by (GPU UUID, group name): group_usage()'s,
        read without the rest of the usage (the accounting asks at every poll)."""
        names = self.region.group_names()
        return {(gpu.uuid, names[index]): seconds
                for gpu, scheduler in zip(self.gpus, self.schedulers, strict=True)
                for index, seconds in scheduler.gpu_seconds().items() if index in names}

    # -- what /metrics reads (collect apart from expose: gemtrace/agent/collectors/) ------------------------

    def metrics_registry(self) -> CollectorRegistry:
        """What /metrics serves: each collector reads a view of what this agent keeps, and runs on its own
        (collectors.Isolated). One line registers a collector."""
        acc = self.accounting
        collectors = {
            "agent": AgentCollector(self.agent_view),
            "groups": GroupCollector(self.groups_view),
            "processes": ProcessCollector(lambda: self.snapshot, lambda: (acc.probes_attached, acc.libcuda_files),
                                          self.pod_labels.process),
            "enforcement": EnforcementCollector(self.enforcer, lambda: self.config.groups),
            "attach": AttachCollector(self.region.attach_counts, self.region.chunk_holdings),
        }
        registry = CollectorRegistry(auto_describe=False)
        registry.register(Isolated(collectors))
        return registry

    def agent_view(self) -> AgentView:
        return AgentView(self.reloads["success"], self.reloads["failure"], self.last_reload_ok, tuple(self.gpus),
                         tuple(sorted(dict(self.membership.refusals).items())),
                         tuple(scheduler.shared_seconds() for scheduler in self.schedulers))

    def groups_view(self) -> GroupsView:
        config = self.config
        return GroupsView(
            quotas=tuple(GroupQuota(name, g.min_util, g.max_util, g.memory_limit) for name, g in config.groups.items()),
            usage=tuple((gpu, group, usage) for (gpu, group), usage in self.group_usage().items()),
            snapshot=self.snapshot,
            pods={name: self.pod_labels.group(name) for name in config.groups},
        )

    # -- running -----------------------------------------------------------------------------------

    def start(self) -> None:
        if nested_pid_namespace():
            log.warning("pid_namespace_not_host", consequence="eBPF reports host pids this agent cannot see: "
                        "processes are misattributed and over-limit ones are not killed; run the agent on the "
                        "host or in a pod with hostPID: true")
        self._keeper = threading.Thread(target=self._keep_region, name="gemtrace-keeper", daemon=True)
        self._keeper.start()
        assert self.region.doorbells is not None  # (the agent's region: GpuScheduler refuses one without)
        for name, loop in scheduler_threads(self.schedulers, self.region.doorbells):
            thread = threading.Thread(target=loop.run, args=(self._stop,), name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        watcher = threading.Thread(target=self.watcher.run, args=(self._stop,), name="gemtrace-config", daemon=True)
        watcher.start()
        self._threads.append(watcher)
        self.snapshot = self.accounting.poll()
        self.pod_labels.refresh([p.pid for p in self.snapshot.processes])
        log.info("agent_started", pid=os.getpid(), state_dir=str(self.state_dir), config=str(self.config_path),
                 gpus=[g.uuid for g in self.gpus], groups=sorted(self.config.groups),
                 ebpf=self.accounting.ebpf_status)

    def run_until_stopped(self, signals: SignalInbox | None = None,
                          on_tick: Callable[[], None] | None = None) -> None:
        """The main loop, until stop() or, with `signals`, SIGTERM or SIGINT (SIGHUP: reload now)."""
        next_poll = last_poll = time.monotonic()
        audit_due = False
        while not self._wait_tick(signals, next_poll):
            self.reaper.tick()
            now = time.monotonic()
            # A gate waits for a look (issue 25, GT_AUDIT_WAIT_NS): now, but never more often than the
            # second look's spacing, whatever a user writes into the counter.
            audit_due = self._audit_asked() or audit_due  # kept until a poll has looked
            if audit_due and now - last_poll >= 0.75 * AUDIT_AGAIN_SECONDS:
                next_poll = now
            if now >= next_poll:
                last_poll, audit_due = now, False
                self.snapshot = self.accounting.poll()
                self.pod_labels.refresh([p.pid for p in self.snapshot.processes])
                # A slot above what its process holds is looked at again soon (issue 25): until the
                # second look counts it, its user's figure still holds the others' allocations back.
                # Each wait drawn at random around its mean, so that a liar cannot time its figure
                # between the agent's looks (the verified figures it publishes show when it looked).
                enforcement = self.accounting.enforcement
                again = enforcement is not None and enforcement.over_reporting_suspected()
                mean = AUDIT_AGAIN_SECONDS if again else ACCOUNTING_POLL_SECONDS
                next_poll = now + random.uniform(0.75 * mean, 1.25 * mean)
            if on_tick is not None:
                on_tick()
        if self.stop_signal is not None:
            log.info("signal_received", signal=self.stop_signal)

    def _audit_asked(self) -> bool:
        """Whether a gate bumped its slot's audit_requests since the last tick (hook/memory.c); a slot
        freed meanwhile (its counter back to 0) asks nothing."""
        asked = self.region.slot_columns.audit_requests().tolist()
        seen, self._audit_seen = self._audit_seen, asked
        return asked != seen and (not seen or any(a > b for a, b in zip(asked, seen, strict=True)))

    def _wait_tick(self, signals: SignalInbox | None, next_poll: float) -> bool:
        """Wait for the reaper's next look (less on a signal or a watched process's exit, and no later
        than the accounting's `next_poll`) and act on the signals received; True once stopped. Without
        `signals` (a caller that stops the agent with stop()), a plain tick."""
        if signals is None:
            return self._stop.wait(defaults.TICK_SECONDS)
        now = time.monotonic()
        scan = REAPER_SCAN_SECONDS if now < self._fast_scan_until else REAPER_IDLE_SCAN_SECONDS
        self.reaper.wait(min(scan, next_poll - now), signals.fileno(), self._join_bell)
        try:
            os.eventfd_read(self._join_bell)
            self._fast_scan_until = time.monotonic() + JOIN_FAST_SECONDS  # a gate joined: it claims a slot
        except BlockingIOError:
            pass
        for signum, at in signals.take():
            if signum == signal.SIGHUP:  # systemctl reload: the resource file now, changed or not
                self.watcher.request()
            elif self.stop_signal is None:
                self.stop_signal, self.stop_signal_at = signum.name, at
                self.stop()
        return self._stop.is_set()

    def _on_join(self) -> None:
        """A gate asked for its slot (the socket's thread): it claims one next and waits for its group."""
        self._joined.set()
        try:
            os.eventfd_write(self._join_bell, 1)
        except OSError:
            pass  # closed by a stop in progress, or full: the loop wakes anyway

    def stop(self) -> None:
        self._stop.set()
        self._joined.set()  # the keeper sees the stop now, not at its next idle tick

    def close(self) -> None:
        """Clean stop, gates first: the keeper stops beating and every word is released with the
        heartbeat 0 before anything slow, then the schedulers and the probes stop (the kernel detaches
        uprobes slowly: bench/results/agent_stop.md)."""
        steps: dict[str, float] = {}
        started = mark = time.monotonic()

        def step(name: str) -> None:
            nonlocal mark
            now = time.monotonic()
            steps[name] = round((now - mark) * 1e3, 1)
            mark = now

        if self.stop_signal_at is not None:
            steps["main_loop"] = round((started - self.stop_signal_at) * 1e3, 1)  # the signal to here
        self._stop.set()
        self._joined.set()
        if self._keeper is not None:
            self._keeper.join(timeout=1)  # it released every word on its way out
        self.region.stop()  # (and this, for an agent never started)
        step("release")
        self.watcher.wake()
        for thread in self._threads:
            thread.join(timeout=5)
        self.region.stop()  # a scheduler's last look may have held a word again
        step("schedulers")
        self.accounting.stop_watching()
        step("watcher")
        self.accounting.close()
        step("probes")
        self.mps.stop()
        step("mps")
        self.reaper.close()
        self.region.close()  # (its socket's thread, which rings the join bell, is gone with it)
        os.close(self._join_bell)
        self._lock.release()
        step("region")
        log.info("agent_stopped", seconds=round(time.monotonic() - (self.stop_signal_at or started), 3),
                 steps_ms=steps)


def agent_signals() -> SignalInbox:
    """The agent's signals (install from the main thread, before the agent starts its threads).
    SIGUSR1 (root only: the agent is root's) writes every thread's stack to stderr, the journal, for
    a stop or a reload that hangs: faulthandler writes from C, with no lock a stuck thread could hold."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    return SignalInbox((signal.SIGTERM, signal.SIGINT, signal.SIGHUP))
