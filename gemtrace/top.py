"""`gemtrace top`: a live view of one host's groups, in the spirit of nvtop.

Owns the terminal view: per GPU, each group's share as a bar against its MinUtil and MaxUtil, its
memory against its limit, and its processes with kernel time and memory; refreshed every second, `q`
quits; plain text frames when stdout is not a terminal (`--once` prints one). It reads only the
agent's `/metrics` over HTTP and never touches the region or the agent's state: it is safe to run
as any user. Parsing (metrics text -> Frame) and rendering (Frame -> lines) are pure functions; only
`fetch` and the curses loop touch the world.

With `--state-dir` it reads the region instead (read-only snapshots, never writing a word): the
gates' view, which lacks what only the agent knows (processes without the gate, the scheduler's
window), so a group's share there is the sum of its processes' kernel time rates.
"""

from __future__ import annotations

import argparse
import curses
import http.client
import socket
import sys
import time
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TextIO

from prometheus_client.parser import text_string_to_metric_families

from gemtrace import defaults, region
from gemtrace.config import format_size
from gemtrace.metrics import CATALOGUE

REFRESH_SECONDS = 1.0


@dataclass(frozen=True)
class Process:
    pid: int
    comm: str
    group: str
    gpu: str
    memory_bytes: float = 0.0
    gpu_seconds_total: float = 0.0
    launches_total: float = 0.0
    kernel_share: float | None = None  # kernel time per second of wall time, since the last frame
    launches_per_second: float | None = None


@dataclass(frozen=True)
class GroupRow:
    name: str
    gpu: str
    share: float = 0.0  # gemtrace_group_util_ratio: the scheduler's recent window
    min_util: float = 0.0
    max_util: float = 1.0
    memory_bytes: float = 0.0
    memory_limit_bytes: float | None = None
    throttled_seconds_total: float = 0.0
    processes: tuple[Process, ...] = ()


@dataclass(frozen=True)
class GpuRow:
    uuid: str
    name: str = ""
    index: str = ""
    memory_total_bytes: float | None = None
    groups: tuple[GroupRow, ...] = ()
    shared_seconds_total: float | None = None  # gemtrace_gpu_shared_seconds_total (the agent's /metrics only)
    shared: float | None = None  # of the time since the last frame, how much the groups shared it (no turns)


@dataclass(frozen=True)
class Frame:
    taken_at: float
    agent_version: str = ""
    config_ok: bool | None = None
    probes_attached: float | None = None
    gpus: tuple[GpuRow, ...] = ()
    error: str = ""
    shares_from_processes: bool = False  # the region has no scheduler window: share = sum of rates


@dataclass
class _Builder:
    """Mutable collection while reading one exposition; frozen into a Frame at the end."""
    gpus: dict[str, dict[str, str | float]] = field(default_factory=dict)
    groups: dict[tuple[str, str], dict[str, float]] = field(default_factory=dict)
    settings: dict[str, dict[str, float]] = field(default_factory=dict)  # group -> quota settings
    processes: dict[tuple[str, str], dict[str, float]] = field(default_factory=dict)
    comms: dict[tuple[str, str], tuple[str, str]] = field(default_factory=dict)  # (gpu, pid) -> (comm, group)


_GROUP_FIELDS = {
    "gemtrace_group_util_ratio": "share",
    "gemtrace_group_memory_bytes": "memory_bytes",
    "gemtrace_group_throttled_seconds_total": "throttled_seconds_total",
    "gemtrace_group_gpu_seconds_total": "gpu_seconds_total",
}
_SETTING_FIELDS = {
    "gemtrace_group_util_min_ratio": "min_util",
    "gemtrace_group_util_max_ratio": "max_util",
    "gemtrace_group_memory_limit_bytes": "memory_limit_bytes",
}
_PROCESS_FIELDS = {
    "gemtrace_process_memory_bytes": "memory_bytes",
    "gemtrace_process_gpu_seconds_total": "gpu_seconds_total",
    "gemtrace_process_kernel_launches_total": "launches_total",
}
_SHARED = "gemtrace_gpu_shared_seconds_total"
for _name in (*_GROUP_FIELDS, *_SETTING_FIELDS, *_PROCESS_FIELDS, _SHARED):
    assert _name in CATALOGUE, _name  # one home for metric names: the catalogue


def parse(text: str, taken_at: float) -> Frame:
    """The agent's /metrics text as a Frame (pure)."""
    b = _Builder()
    version = ""
    config_ok: bool | None = None
    probes: float | None = None
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name, labels, value = s.name, s.labels, float(s.value)
            if name == "gemtrace_agent_info":
                version = labels.get("version", "")
            elif name == "gemtrace_config_last_reload_success":
                config_ok = value == 1
            elif name == "gemtrace_probes_attached":
                probes = value
            elif name == "gemtrace_gpu_info":
                b.gpus.setdefault(labels["gpu"], {}).update(name=labels.get("name", ""),
                                                             index=labels.get("index", ""))
            elif name == "gemtrace_gpu_memory_total_bytes":
                b.gpus.setdefault(labels["gpu"], {})["memory_total_bytes"] = value
            elif name == _SHARED:
                b.gpus.setdefault(labels["gpu"], {})["shared_seconds_total"] = value
            elif name in _GROUP_FIELDS:
                b.groups.setdefault((labels["gpu"], labels["group"]), {})[_GROUP_FIELDS[name]] = value
            elif name in _SETTING_FIELDS:
                b.settings.setdefault(labels["group"], {})[_SETTING_FIELDS[name]] = value
            elif name in _PROCESS_FIELDS:
                key = (labels["gpu"], labels["pid"])
                b.processes.setdefault(key, {})[_PROCESS_FIELDS[name]] = value
                b.comms[key] = (labels.get("comm", ""), labels.get("group", ""))
    return Frame(taken_at=taken_at, agent_version=version, config_ok=config_ok, probes_attached=probes,
                 gpus=_freeze(b))


def _freeze(b: _Builder) -> tuple[GpuRow, ...]:
    procs: dict[tuple[str, str], list[Process]] = {}
    for (gpu, pid), figures in b.processes.items():
        comm, group = b.comms[(gpu, pid)]
        procs.setdefault((gpu, group), []).append(Process(
            pid=int(pid), comm=comm, group=group, gpu=gpu,
            memory_bytes=figures.get("memory_bytes", 0.0),
            gpu_seconds_total=figures.get("gpu_seconds_total", 0.0),
            launches_total=figures.get("launches_total", 0.0)))
    gpu_ids = set(b.gpus) | {gpu for gpu, _ in b.groups} | {gpu for gpu, _ in procs}
    gpus = []
    for uuid in gpu_ids:
        info = b.gpus.get(uuid, {})
        names = {g for gpu, g in b.groups if gpu == uuid} | {g for gpu, g in procs if gpu == uuid}
        groups = []
        for name in sorted(names):
            figures = b.groups.get((uuid, name), {})
            settings = b.settings.get(name, {})
            groups.append(GroupRow(
                name=name, gpu=uuid,
                share=figures.get("share", 0.0),
                min_util=settings.get("min_util", 0.0),
                max_util=settings.get("max_util", 1.0),
                memory_bytes=figures.get("memory_bytes", 0.0),
                memory_limit_bytes=settings.get("memory_limit_bytes"),
                throttled_seconds_total=figures.get("throttled_seconds_total", 0.0),
                processes=tuple(sorted(procs.get((uuid, name), []), key=lambda p: p.pid))))
        total, shared = info.get("memory_total_bytes"), info.get("shared_seconds_total")
        gpus.append(GpuRow(uuid=uuid, name=str(info.get("name", "")), index=str(info.get("index", "")),
                        memory_total_bytes=float(total) if total is not None else None, groups=tuple(groups),
                        shared_seconds_total=float(shared) if shared is not None else None))
    return tuple(sorted(gpus, key=lambda g: (g.index == "", g.index.zfill(4), g.uuid)))


def with_rates(previous: Frame | None, current: Frame) -> Frame:
    """`current` with each process's kernel time and launch rates since `previous`, and each GPU's time
    shared (pure).

    A process absent from `previous`, or whose counters went down (a new process with a reused
    pid, a restarted agent), gets no rate rather than a wrong one."""
    if previous is None or current.taken_at <= previous.taken_at:
        return current
    dt = current.taken_at - previous.taken_at
    before = {(p.gpu, p.pid): p for gpu in previous.gpus for g in gpu.groups for p in g.processes}

    def rated(p: Process) -> Process:
        old = before.get((p.gpu, p.pid))
        if old is None or p.gpu_seconds_total < old.gpu_seconds_total:
            return p
        if p.launches_total < old.launches_total:
            return p
        return replace(p, kernel_share=(p.gpu_seconds_total - old.gpu_seconds_total) / dt,
                       launches_per_second=(p.launches_total - old.launches_total) / dt)

    def group_rated(g: GroupRow) -> GroupRow:
        procs = tuple(rated(p) for p in g.processes)
        if not current.shares_from_processes:
            return replace(g, processes=procs)
        return replace(g, processes=procs, share=sum(p.kernel_share or 0.0 for p in procs))

    shared_before = {gpu.uuid: gpu.shared_seconds_total for gpu in previous.gpus}

    def shared(gpu: GpuRow) -> float | None:
        old, new = shared_before.get(gpu.uuid), gpu.shared_seconds_total
        if old is None or new is None or new < old:
            return None
        return min(1.0, (new - old) / dt)

    gpus = tuple(replace(gpu, groups=tuple(group_rated(g) for g in gpu.groups), shared=shared(gpu))
                 for gpu in current.gpus)
    return replace(current, gpus=gpus)


def from_region(layout: region.RegionLayout, table: region.SlotTableLayout, taken_at: float) -> Frame:
    """A snapshot of the region and the slots (copies) as a Frame (pure). A process is shown in the
    group the agent assigned it; one not assigned yet is not shown."""
    uuids = [layout.gpus[i].uuid.decode() for i in range(min(layout.header.n_gpus, region.MAX_GPUS))]
    names = {i: g.name.decode() for i, g in enumerate(layout.groups) if g.name and g.defined}
    procs: dict[tuple[int, int], list[Process]] = {}
    for slot, group in zip(table.slots, region.SlotColumns(layout, table).groups(), strict=True):
        if not slot.pid or group not in names:
            continue
        for gpu in range(len(uuids)):
            if not slot.gpu_mask & (1 << gpu):
                continue
            procs.setdefault((gpu, group), []).append(Process(
                pid=slot.pid, comm=slot.comm.decode(errors="replace"), group=names[group],
                gpu=uuids[gpu], memory_bytes=float(slot.memory[gpu]),
                gpu_seconds_total=slot.busy_ns[gpu] / 1e9, launches_total=float(slot.launches[gpu])))
    gpus = []
    for gpu, uuid in enumerate(uuids):
        groups = []
        for index, name in sorted(names.items(), key=lambda item: item[1]):
            g = layout.groups[index]
            mine = sorted(procs.get((gpu, index), []), key=lambda p: p.pid)
            groups.append(GroupRow(
                name=name, gpu=uuid, min_util=g.min_util_ppm / region.UTIL_ONE,
                max_util=g.max_util_ppm / region.UTIL_ONE,
                memory_bytes=sum(p.memory_bytes for p in mine),
                memory_limit_bytes=None if g.memory_limit == region.NO_LIMIT else float(g.memory_limit),
                processes=tuple(mine)))
        gpus.append(GpuRow(uuid=uuid, index=str(gpu), memory_total_bytes=float(layout.gpus[gpu].memory_total),
                        groups=tuple(groups)))
    return Frame(taken_at=taken_at, agent_version="(region)", gpus=tuple(gpus), shares_from_processes=True)


def share_bar(share: float, min_util: float, max_util: float, width: int) -> str:
    """`[###|....   ]`: `#` the share used, `|` MinUtil, `.` room up to MaxUtil, blank beyond it."""
    cells = []
    used = round(max(0.0, min(share, 1.0)) * width)
    floor = round(min_util * width)
    cap = round(max_util * width)
    for i in range(width):
        if i < used:
            cells.append("#")
        elif i < cap:
            cells.append(".")
        else:
            cells.append(" ")
    if 0 < min_util and floor < width:
        cells[floor] = "|"
    return "[" + "".join(cells) + "]"


def memory_bar(used: float, limit: float | None, width: int) -> str:
    """Used against the limit; blank when there is nothing to measure against."""
    if not limit:
        return "[" + " " * width + "]"
    filled = round(max(0.0, min(used / limit, 1.0)) * width)
    return "[" + "#" * filled + "." * (width - filled) + "]"


def human_bytes(n: float | None) -> str:
    return "-" if n is None else format_size(n)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.0f}%"


def render(frame: Frame, source: str, width: int = 100) -> list[str]:
    """The frame as lines of at most `width` characters (pure): what both modes print."""
    clock = time.strftime("%H:%M:%S", time.localtime(frame.taken_at))
    status = [f"agent {frame.agent_version or '?'}"]
    if frame.config_ok is False:
        status.append("RESOURCE FILE FAILED TO LOAD")
    if frame.probes_attached == 0:
        status.append("no eBPF probes")
    lines = [f"gemtrace top  {source}  {'  '.join(status)}  {clock}"]
    if frame.error:
        return [*lines, "", frame.error]
    if not frame.gpus:
        return [*lines, "", "no GPU reported by the agent"]
    bar_w = max(10, min(30, width - 70))
    for gpu in frame.gpus:
        used = sum(g.memory_bytes for g in gpu.groups)
        # (The driver's own slicing, not turns: docs/scheduler.md, "Where nothing binds".)
        shared = f"  shared {_pct(gpu.shared)}" if gpu.shared else ""
        lines += ["", f"GPU {gpu.index or '?'}  {gpu.name}{shared}  {gpu.uuid}  memory {human_bytes(used)} / "
                      f"{human_bytes(gpu.memory_total_bytes)}"]
        lines.append(f"  {'GROUP':<12} {'SHARE':<{bar_w + 2}} {'NOW':>4} {'MIN':>4} {'MAX':>4}  "
                     f"{'MEMORY':<24}  {'LIMIT':>10}")
        for g in gpu.groups:
            # A group without a MemoryLimit may use the whole GPU: its bar is against that.
            limit = g.memory_limit_bytes or gpu.memory_total_bytes
            mem = memory_bar(g.memory_bytes, limit, 10)
            shown_limit = human_bytes(g.memory_limit_bytes) if g.memory_limit_bytes else "whole GPU"
            lines.append(f"  {g.name[:12]:<12} {share_bar(g.share, g.min_util, g.max_util, bar_w)} "
                         f"{_pct(g.share):>4} {_pct(g.min_util):>4} {_pct(g.max_util):>4}  "
                         f"{human_bytes(g.memory_bytes):<12}{mem}  {shown_limit:>10}")
            for p in g.processes:
                rate = "" if p.launches_per_second is None else f"  {p.launches_per_second:.0f} launches/s"
                lines.append(f"      {p.pid:>7} {p.comm[:15]:<15} kernel {_pct(p.kernel_share):>4} "
                             f"({p.gpu_seconds_total:.1f} s)  memory {human_bytes(p.memory_bytes)}{rate}")
    return [line[:width] for line in lines]


class _UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP over the agent's unix socket: the socket's mode and group decide who may read /metrics."""

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.socket_path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.socket_path)


def fetch(url: str, timeout: float = 2.0) -> str:
    if url.startswith(defaults.UNIX_PREFIX):
        conn = _UnixHTTPConnection(url[len(defaults.UNIX_PREFIX):], timeout)
        try:
            conn.request("GET", "/metrics")
            reply = conn.getresponse()
            if reply.status != 200:
                raise OSError(f"HTTP {reply.status} {reply.reason}")
            return reply.read().decode("utf-8")
        finally:
            conn.close()
    with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 (operator-given URL)
        body: bytes = response.read()
    return body.decode("utf-8")


def snapshot(source: str, previous: Frame | None) -> Frame:
    """The next frame from an agent URL, or from a state dir's region when `source` is a path."""
    now = time.time()
    if not source.startswith(("http://", "https://", defaults.UNIX_PREFIX)):
        try:
            r = region.Region.open(Path(source), writable=False)
        except (OSError, region.RegionError) as exc:
            return Frame(taken_at=now, error=f"cannot read the region in {source}: {exc}")
        try:
            return with_rates(previous, from_region(r.layout, r.slots_layout, now))
        finally:
            r.close()
    try:
        return with_rates(previous, parse(fetch(source), now))
    except (OSError, ValueError) as exc:
        return Frame(taken_at=now, error=f"cannot read {source}: {exc}. Is `gemtrace agent` running there?")


def _plain(url: str, once: bool, interval: float, out: TextIO | None = None) -> int:
    stream = out or sys.stdout
    previous: Frame | None = None
    while True:
        frame = snapshot(url, previous)
        print("\n".join(render(frame, url)), file=stream, flush=True)
        if once:
            return 1 if frame.error else 0
        previous = frame if not frame.error else None
        time.sleep(interval)
        print(file=stream)


def _curses(stdscr: curses.window, url: str, interval: float) -> int:
    curses.curs_set(0)
    stdscr.timeout(int(interval * 1000))
    previous: Frame | None = None
    while True:
        frame = snapshot(url, previous)
        previous = frame if not frame.error else None
        height, width = stdscr.getmaxyx()
        stdscr.erase()
        for y, line in enumerate(render(frame, url, max(width - 1, 20))[: height - 1]):
            attr = curses.A_BOLD if y == 0 or line.startswith("GPU ") else curses.A_NORMAL
            stdscr.addnstr(y, 0, line, width - 1, attr)
        stdscr.addnstr(height - 1, 0, "q quits", width - 1, curses.A_DIM)
        stdscr.refresh()
        deadline = time.monotonic() + interval
        while (left := deadline - time.monotonic()) > 0:
            stdscr.timeout(max(1, int(left * 1000)))
            key = stdscr.getch()
            if key in (ord("q"), ord("Q")):
                return 0
            if key == curses.KEY_RESIZE:
                break


def metrics_url(address: str) -> str:
    """`host:port`, `unix:PATH` or a full URL; the agent serves /metrics."""
    if "://" in address or address.startswith(defaults.UNIX_PREFIX):
        return address
    return f"http://{address}/metrics"


def parser() -> argparse.ArgumentParser:
    """`gemtrace top`'s options (the Debian package's man page is generated from this parser too)."""
    ap = argparse.ArgumentParser(prog="gemtrace top",
                                 description="Live view of gemtrace's groups on this host.")
    ap.add_argument("--listen", default=defaults.LISTEN, metavar="HOST:PORT",
                    help="the agent's address (its `agent --listen`: HOST:PORT or unix:PATH) or /metrics URL "
                    f"(default {defaults.LISTEN})")
    # The first name of --listen, kept working for scripts; `gemtrace status` always said --listen.
    ap.add_argument("--url", dest="listen", help=argparse.SUPPRESS)
    ap.add_argument("--state-dir", type=Path, default=None, metavar="DIR",
                    help="read the region in this state dir instead of the agent's /metrics "
                         f"(the gates' view; the agent's is {defaults.STATE_DIR})")
    ap.add_argument("--once", action="store_true", help="print one frame as plain text and exit")
    ap.add_argument("--interval", type=float, default=REFRESH_SECONDS, metavar="SECONDS",
                    help=f"seconds between frames (default {REFRESH_SECONDS:g})")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    url = str(args.state_dir) if args.state_dir is not None else metrics_url(args.listen)
    if args.once or not sys.stdout.isatty():
        try:
            return _plain(url, args.once, args.interval)
        except KeyboardInterrupt:
            return 0
    try:
        return curses.wrapper(_curses, url, args.interval)
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
