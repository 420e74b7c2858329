"""The agent: wires the resource file, the region, one scheduler per GPU, the accounting and /metrics.

Owns the agent's lifecycle and its loop: the heartbeat (gates ignore a silent agent, so a dead agent
never hangs a program), reaping the slots of processes that died (pidfds: a dead process is seen
within a tick), and polling the accounting at the scrape cadence; and, on a thread of its own so that
no file can stall the heartbeat, reloading the resource file when it changes or on SIGHUP. It
decides nothing itself: the schedulers decide who runs, the enforcer whom to kill. On SIGTERM or
SIGINT it stops cleanly: every word released, heartbeat 0, so no gate is left waiting.
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from gemtrace import defaults
from gemtrace.accounting import Accounting, Snapshot
from gemtrace.collectors.agent import AgentView
from gemtrace.collectors.groups import GroupQuota, GroupsView
from gemtrace.config import ConfigError, ConfigWatcher, ResourceConfig, load
from gemtrace.gpus import Gpu, discover
from gemtrace.groups_of import ProcReader
from gemtrace.region import MAX_GROUPS, Region, RegionError
from gemtrace.scheduler import GpuScheduler, GroupUsage, Quota

log = structlog.get_logger("gemtrace.agent")

# Set to libcuda paths (separated by ':'), the agent probes only those files instead of every
# libcuda on the host: `make demo` sets it to the simulated libcuda, so that its agent neither
# accounts for nor kills the host's other programs.
ENV_PROBE_LIBCUDA = "GEMTRACE_PROBE_LIBCUDA"

ACCOUNTING_POLL_SECONDS = 1.0  # the scrape cadence: polling faster costs CPU for nothing (docs/accounting.md)


class Reaper:
    """Frees the slots of processes that died, within one tick: each live slot's process is watched
    through a pidfd, which becomes readable when the process exits (zombies included)."""

    def __init__(self, region: Region, proc_root: Path = Path("/proc")) -> None:
        self.region = region
        self.proc = ProcReader(proc_root)
        self._watched: dict[int, tuple[int, int]] = {}  # slot index -> (pid, pidfd)
        self._poll = select.poll()
        self._index_of_fd: dict[int, int] = {}
        self._last_pids: list[int] = []

    def tick(self) -> list[int]:
        """Free dead processes' slots; returns their pids."""
        freed: list[int] = []
        pids = self.region.slot_pids()
        if pids != self._last_pids:
            self._last_pids = pids
            for index, (pid, _) in list(self._watched.items()):
                if pids[index] != pid:
                    self._unwatch(index)  # the gate freed its own slot at exit
            for index, pid in enumerate(pids):
                if pid and index not in self._watched and not self._watch(index, pid):
                    if self.region.free_slot(index, pid):
                        freed.append(pid)
        for fd, _ in self._poll.poll(0) if self._watched else ():
            index = self._index_of_fd[fd]
            pid = self._watched[index][0]
            self._unwatch(index)
            if self.region.free_slot(index, pid):
                freed.append(pid)
        for pid in freed:
            log.info("process_reaped", pid=pid)
        if freed:
            self._last_pids = self.region.slot_pids()
        return freed

    def _watch(self, index: int, pid: int) -> bool:
        """Start watching a newly seen slot; False when its process is already gone or the pid was
        reused by another process (its start time differs from the slot's)."""
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            return False
        except OSError:
            return True  # not ours to judge (e.g. no pidfd support): leave the slot alone
        recorded = self.region.layout.slots[index].start_time
        actual = self.proc.start_time(pid)
        if actual is None or (recorded and actual != recorded):
            os.close(fd)
            return False
        self._watched[index] = (pid, fd)
        self._index_of_fd[fd] = index
        self._poll.register(fd, select.POLLIN)
        return True

    def _unwatch(self, index: int) -> None:
        _, fd = self._watched.pop(index)
        self._poll.unregister(fd)
        del self._index_of_fd[fd]
        os.close(fd)

    def close(self) -> None:
        for index in list(self._watched):
            self._unwatch(index)


class Agent:
    def __init__(
        self,
        config_path: Path = defaults.CONFIG_PATH,
        state_dir: Path = defaults.STATE_DIR,
        use_ebpf: bool = True,
        probe_mode: str = "memory",
        gpus: list[Gpu] | None = None,
        libcuda_paths: list[Path] | None = None,
        config_poll_seconds: float = defaults.CONFIG_POLL_SECONDS,
    ) -> None:
        """`libcuda_paths`: probe only these libcuda files (None: ENV_PROBE_LIBCUDA's, or when it is
        unset every libcuda file on the host)."""
        self.config_path = config_path
        self.state_dir = state_dir
        self.config: ResourceConfig = load(config_path)  # a bad file at start is fatal: nothing to keep
        # Written by the reload thread only; read by /metrics.
        self.reloads = {"success": 1, "failure": 0}
        self.last_reload_ok = True
        self.gpus = discover() if gpus is None else gpus
        self.region = Region.create(state_dir)
        self.region.set_gpus([(g.uuid, g.memory_total) for g in self.gpus])
        self.schedulers = [GpuScheduler(self.region, g.index) for g in self.gpus]
        self._apply(self.config)
        self.region.heartbeat(time.monotonic_ns())
        if libcuda_paths is None and os.environ.get(ENV_PROBE_LIBCUDA):
            libcuda_paths = [Path(p) for p in os.environ[ENV_PROBE_LIBCUDA].split(":") if p]
        self.accounting = Accounting(self.region, lambda: self.config, use_ebpf=use_ebpf, probe_mode=probe_mode,
                                     libcuda_paths=libcuda_paths, scan_host=libcuda_paths is None,
                                     group_seconds=self.group_seconds)
        self.snapshot: Snapshot | None = None
        self.reaper = Reaper(self.region)
        self.watcher = ConfigWatcher(config_path, self.reload, config_poll_seconds)
        self._reload_lock = threading.Lock()  # one reload at a time: the thread's, or a caller's
        self._stop = threading.Event()
        self.stop_signal: str | None = None  # the signal that asked for the stop, for the log
        self._threads: list[threading.Thread] = []

    # -- the resource file -------------------------------------------------------------------------

    def _check_room(self, config: ResourceConfig) -> None:
        """Refuse, before writing anything, a file whose new groups the region has no entry left for.
        An entry keeps its name for the region's life (running gates hold its index), so groups
        dropped from earlier files still take theirs."""
        taken = self.region.group_names()
        new = sorted(set(config.groups) - set(taken.values()))
        if len(new) > MAX_GROUPS - len(taken):
            dropped = sorted(set(taken.values()) - set(config.groups))
            raise RegionError(
                f"{config.source}: the region has room for {MAX_GROUPS} groups over the agent's life and "
                f"{len(taken)} are taken, {len(dropped)} by groups no longer in the file ({', '.join(dropped)}); "
                f"{len(new)} new groups do not fit: reuse the dropped names, or stop the agent and the gated "
                f"programs and remove {self.region.path}"
            )

    def _apply(self, config: ResourceConfig) -> None:
        """Write accepted settings where they act: the region (gates read limits there) and the schedulers."""
        self._check_room(config)
        quotas: dict[int, Quota] = {}
        for group in config.groups.values():
            index = self.region.set_group(group.name, group.memory_limit, group.min_util, group.max_util)
            quotas[index] = Quota(group.min_util, group.max_util)
        for index, name in self.region.group_names().items():
            if name not in config.groups:
                self.region.undefine_group(index)
        self.region.bump_generation()
        for scheduler in self.schedulers:
            scheduler.set_quotas(quotas)

    def reload(self, path: Path) -> bool:
        """Read, check and apply the resource file; on any failure the last good settings stay and
        /metrics says so (the failure counter, last reload success 0)."""
        with self._reload_lock:
            try:
                config = load(path)
                self._apply(config)
            except (ConfigError, RegionError) as e:
                return self._reload_failed(str(e))
            except Exception as e:  # a bug: report it, and keep reloading on the next change
                log.exception("config_reload_crashed")
                return self._reload_failed(f"{path}: {type(e).__name__}: {e}")
            self.config = config
            self.last_reload_ok = True
            self.reloads["success"] += 1
            log.info("config_reloaded", path=str(path), groups=sorted(config.groups))
            return True

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
        """GPU seconds the schedulers charged each group, by (GPU UUID, group name)."""
        return {key: usage.gpu_seconds for key, usage in self.group_usage().items()}

    # -- what /metrics reads (collect apart from expose: gemtrace/collectors/) ------------------------

    def agent_view(self) -> AgentView:
        return AgentView(self.reloads["success"], self.reloads["failure"], self.last_reload_ok, tuple(self.gpus))

    def groups_view(self) -> GroupsView:
        config = self.config
        return GroupsView(
            quotas=tuple(GroupQuota(name, g.min_util, g.max_util, g.memory_limit) for name, g in config.groups.items()),
            usage=tuple((gpu, group, usage) for (gpu, group), usage in self.group_usage().items()),
            snapshot=self.snapshot,
        )

    # -- running -----------------------------------------------------------------------------------

    def start(self) -> None:
        for scheduler in self.schedulers:
            thread = threading.Thread(target=scheduler.run, args=(self._stop,), name=f"gemtrace-gpu{scheduler.gpu}",
                                      daemon=True)
            thread.start()
            self._threads.append(thread)
        watcher = threading.Thread(target=self.watcher.run, args=(self._stop,), name="gemtrace-config", daemon=True)
        watcher.start()
        self._threads.append(watcher)
        self.snapshot = self.accounting.poll()
        log.info("agent_started", pid=os.getpid(), state_dir=str(self.state_dir), config=str(self.config_path),
                 gpus=[g.uuid for g in self.gpus], groups=sorted(self.config.groups),
                 ebpf=self.accounting.ebpf_status)

    def run_until_stopped(self, on_tick: Callable[[], None] | None = None) -> None:
        next_poll = time.monotonic()
        while not self._stop.wait(defaults.TICK_SECONDS):
            self.region.heartbeat(time.monotonic_ns())
            self.reaper.tick()
            now = time.monotonic()
            if now >= next_poll:
                self.snapshot = self.accounting.poll()
                next_poll = now + ACCOUNTING_POLL_SECONDS
            if on_tick is not None:
                on_tick()
        if self.stop_signal is not None:
            log.info("signal_received", signal=self.stop_signal)

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        """Clean stop: schedulers release their words, the region says no agent, probes detach."""
        self._stop.set()
        self.watcher.wake()
        for thread in self._threads:
            thread.join(timeout=5)
        self.region.stop()
        self.accounting.close()
        self.reaper.close()
        self.region.close()
        log.info("agent_stopped")


def install_signal_handlers(agent: Agent) -> None:
    # The handler runs between two bytecodes of the main thread, which may be inside a log call
    # holding structlog's (non-reentrant) write lock: logging here could deadlock the stop. It only
    # records the signal; the main loop logs it when it returns.
    def handler(signum: int, _frame: Any) -> None:
        agent.stop_signal = signal.Signals(signum).name
        agent.stop()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    # SIGHUP: reload the resource file now (systemctl reload), changed or not. Only sets an event.
    signal.signal(signal.SIGHUP, lambda _signum, _frame: agent.watcher.request())
