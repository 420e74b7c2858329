"""bcc adapter: compiles bpf/gemtrace_cuda.bpf.c, attaches it to libcuda files, reads what it counts.

Owns the list of probed entry points (the one place that says which program handles which libcuda
symbol) and the lifetime of each attachment. Each file is attached through an open descriptor
(/proc/self/fd/N), so it can be detached by the same name after every process that mapped it, and
with them its mount namespace, is gone; the descriptor is closed on detach so a container's overlay
can be unmounted (Datadog #13803). Never kills, never decides: gemtrace.accounting does.

The probing modes and their cost are in docs/accounting.md:
  "memory"   (default) allocation, release and context entry points: calls that are rare.
  "launches" adds a uprobe on every kernel launch entry point (about a microsecond per launch).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from gemtrace.probes.libcuda import FileId

BPF_SOURCE_DIRS = (Path(__file__).resolve().parents[2] / "bpf", Path("/usr/share/gemtrace/bpf"))
BPF_PROGRAM = "gemtrace_cuda.bpf.c"

MODES = ("memory", "launches")

# (symbol, program on entry, program on return or None)
MEMORY_PROBES: tuple[tuple[str, str, str | None], ...] = (
    ("cuMemAlloc_v2", "alloc_pointer_enter", "alloc_return"),
    ("cuMemAllocManaged", "alloc_pointer_enter", "alloc_return"),
    ("cuMemAllocAsync", "alloc_pointer_enter", "alloc_return"),
    ("cuMemAllocAsync_ptsz", "alloc_pointer_enter", "alloc_return"),
    ("cuMemAllocFromPoolAsync", "alloc_pointer_enter", "alloc_return"),
    ("cuMemAllocFromPoolAsync_ptsz", "alloc_pointer_enter", "alloc_return"),
    ("cuMemAllocPitch_v2", "alloc_pitch_enter", "alloc_return"),
    ("cuMemCreate", "alloc_create_enter", "alloc_return"),
    ("cuMemFree_v2", "free_pointer_enter", "free_return"),
    ("cuMemFreeAsync", "free_pointer_enter", "free_return"),
    ("cuMemFreeAsync_ptsz", "free_pointer_enter", "free_return"),
    ("cuMemRelease", "free_handle_enter", "free_return"),
    ("cuCtxCreate", "ctx_create_v2_enter", "ctx_return"),
    ("cuCtxCreate_v2", "ctx_create_v2_enter", "ctx_return"),
    ("cuCtxCreate_v3", "ctx_create_v3_enter", "ctx_return"),
    ("cuCtxCreate_v4", "ctx_create_v4_enter", "ctx_return"),
    ("cuDevicePrimaryCtxRetain", "primary_ctx_retain_enter", "ctx_return"),
    ("cuCtxSetCurrent", "ctx_set_current_enter", None),
    ("cuCtxPushCurrent", "ctx_set_current_enter", None),
    ("cuCtxPushCurrent_v2", "ctx_set_current_enter", None),
)
LAUNCH_PROBES: tuple[tuple[str, str, str | None], ...] = tuple(
    (symbol, "launch_enter", None)
    for base in ("cuLaunchKernel", "cuLaunchKernelEx", "cuLaunchCooperativeKernel", "cuGraphLaunch")
    for symbol in (base, base + "_ptsz")
)

EVENT_ALLOC = 1
EVENT_EXIT = 2


class BpfUnavailable(RuntimeError):
    """bcc cannot run here; the message says why and what to do."""


@dataclass(frozen=True)
class Usage:
    pid: int
    dev: int  # device ordinal as the process sees it
    bytes: int
    allocs: int
    last_alloc_ns: int


@dataclass(frozen=True)
class Event:
    type: int
    pid: int
    dev: int
    size: int
    bytes: int
    ts_ns: int


@dataclass
class _Attached:
    fd: int
    name: str  # /proc/self/fd/N
    probes: list[tuple[str, bool]] = field(default_factory=list)  # (symbol, is_return)


_CAP_SYS_ADMIN, _CAP_PERFMON, _CAP_BPF = 21, 38, 39


def has_bpf_privilege(status: str | None = None) -> bool:
    """Whether this process may load BPF and attach uprobes: its effective capabilities
    (/proc/self/status `CapEff`), not its uid, since root can be stripped of them (containers)."""
    if status is None:
        try:
            status = Path("/proc/self/status").read_text()
        except OSError:
            return os.geteuid() == 0
    for line in status.splitlines():
        if line.startswith("CapEff:"):
            caps = int(line.split()[1], 16)
            return bool(caps >> _CAP_SYS_ADMIN & 1) or bool(caps >> _CAP_BPF & 1 and caps >> _CAP_PERFMON & 1)
    return os.geteuid() == 0


def bpf_source_dir() -> Path:
    for d in BPF_SOURCE_DIRS:
        if (d / BPF_PROGRAM).exists():
            return d
    raise BpfUnavailable(f"{BPF_PROGRAM} not found in {', '.join(map(str, BPF_SOURCE_DIRS))}; reinstall gemtrace")


def _import_bcc():  # type: ignore[no-untyped-def]
    try:
        import bcc  # noqa: PLC0415  (the distribution's python3-bpfcc)
    except ImportError as e:
        raise BpfUnavailable(
            f"bcc's Python module is missing ({e}): install the distribution's python3-bpfcc"
        ) from None
    return bcc


class BpfProbes:
    """The compiled program and its attachments to libcuda files."""

    def __init__(self, mode: str = "memory", max_allocs: int = 262144) -> None:
        if mode not in MODES:
            raise ValueError(f"probe mode {mode!r}: use one of {', '.join(MODES)}")
        if not has_bpf_privilege():
            raise BpfUnavailable("eBPF needs root (CAP_SYS_ADMIN, or CAP_BPF with CAP_PERFMON): run the agent as root")
        bcc = _import_bcc()
        src = bpf_source_dir()
        headers = Path("/lib/modules") / os.uname().release / "build"
        if not headers.exists():
            raise BpfUnavailable(
                f"bcc needs kernel headers at {headers}: install linux-headers-{os.uname().release}, or for a "
                "kernel the distribution has none for, link its current headers there (tests/prereqs.sh does)"
            )
        try:
            self._bpf = bcc.BPF(
                src_file=str(src / BPF_PROGRAM).encode(),
                cflags=[f"-I{src}", f"-DGT_MAX_ALLOCS={max_allocs}"],
            )
        except Exception as e:  # bcc raises bare Exception on compile and load failures
            raise BpfUnavailable(f"bcc could not compile or load {BPF_PROGRAM}: {e}") from None
        self.mode = mode
        self.probes = MEMORY_PROBES + (LAUNCH_PROBES if mode == "launches" else ())
        self._files: dict[FileId, _Attached] = {}
        self._on_event: Callable[[Event], None] | None = None

    # -- attachments -------------------------------------------------------------------------

    @property
    def files(self) -> set[FileId]:
        return set(self._files)

    @property
    def probe_count(self) -> int:
        return sum(len(a.probes) for a in self._files.values())

    def attach(self, file_id: FileId, path: Path) -> int:
        """Attach every probe whose symbol the file exports; the number attached (0: not a libcuda)."""
        if file_id in self._files:
            return 0
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        st = os.fstat(fd)
        if st.st_ino != file_id.inode:
            os.close(fd)  # replaced between the maps read and the open: the next scan sees it again
            return 0
        name = f"/proc/self/fd/{fd}"
        attached = _Attached(fd, name)
        for symbol, enter, ret in self.probes:
            try:
                self._bpf.attach_uprobe(name=name.encode(), sym=symbol.encode(), fn_name=enter.encode())
            except Exception:
                continue  # this libcuda does not export the symbol (older driver)
            attached.probes.append((symbol, False))
            if ret is not None:
                self._bpf.attach_uretprobe(name=name.encode(), sym=symbol.encode(), fn_name=ret.encode())
                attached.probes.append((symbol, True))
        if not attached.probes:
            os.close(fd)
            return 0
        self._files[file_id] = attached
        return len(attached.probes)

    def detach(self, file_id: FileId) -> None:
        attached = self._files.pop(file_id, None)
        if attached is None:
            return
        for symbol, is_return in attached.probes:
            detach = self._bpf.detach_uretprobe if is_return else self._bpf.detach_uprobe
            try:
                detach(name=attached.name.encode(), sym=symbol.encode())
            except Exception:
                pass  # already gone with its file; nothing else to release
        os.close(attached.fd)

    # -- reading -----------------------------------------------------------------------------

    def usage(self) -> list[Usage]:
        return [
            Usage(k.tgid, k.dev, v.bytes, v.allocs, v.last_alloc_ns)
            for k, v in self._bpf[b"usage"].items()
        ]

    def devices(self) -> dict[int, int]:
        """pid -> the device ordinal its last context creation or switch named."""
        return {k.value: v.value for k, v in self._bpf[b"proc_dev"].items()}

    def launches(self) -> dict[int, int]:
        return {k.value: v.value for k, v in self._bpf[b"launches"].items()}

    def forget(self, pids: Iterable[int]) -> None:
        """Drop every record of processes that have exited (their bytes were zeroed at exit)."""
        gone = set(pids)
        if not gone:
            return
        for table in (b"usage", b"allocs"):
            t = self._bpf[table]
            stale = [k for k in t.keys() if k.tgid in gone]
            for k in stale:
                try:
                    del t[k]
                except KeyError:
                    pass
        launches = self._bpf[b"launches"]
        for pid in gone:
            try:
                del launches[ctypes.c_uint(pid)]
            except KeyError:
                pass

    def open_events(self, on_event: Callable[[Event], None]) -> None:
        """Deliver ring-buffer events to `on_event` from poll_events()."""
        self._on_event = on_event
        table = self._bpf[b"events"]

        def callback(_ctx: object, data: int, _size: int) -> None:
            ev = table.event(data)
            assert self._on_event is not None
            self._on_event(Event(ev.type, ev.tgid, ev.dev, ev.size, ev.bytes, ev.ts_ns))

        table.open_ring_buffer(callback)

    def poll_events(self, timeout_ms: int) -> None:
        self._bpf.ring_buffer_poll(timeout_ms)

    def close(self) -> None:
        for file_id in list(self._files):
            self.detach(file_id)
        self._bpf.cleanup()
