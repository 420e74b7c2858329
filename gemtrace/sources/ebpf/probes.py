"""bcc adapter: compiles bpf/gemtrace_cuda.bpf.c, attaches it to libcuda files, reads what it counts.

Owns the list of probed entry points (the one place that says which program handles which libcuda
symbol) and the lifetime of each attachment. Each file is attached through an open descriptor
(/proc/self/fd/N), so it can be detached by the same name after every process that mapped it, and
with them its mount namespace, is gone; the descriptor is closed on detach so a container's overlay
can be unmounted (Datadog #13803). Never kills, never decides: gemtrace.agent.accounting does.

Where the kernel has them (Linux 6.6+), the probes of one program on one file are one uprobe_multi
link (BPF_LINK_CREATE, BPF_TRACE_UPROBE_MULTI) rather than a perf event each: closing a perf event
waits for an RCU tasks-trace grace period under a global mutex, one probe after another (so a stop
with a few dozen probes can outlive systemd's TimeoutStopSec), while a link waits once for all its
probes and links close in parallel (bench/results/agent_stop.md). Older kernels get bcc's per-probe
attachment.

The probing modes (gemtrace.defaults.PROBE_MODES) and their cost are in docs/accounting.md:
  "memory"   (the default) allocation, release and context entry points: calls that are rare.
  "launches" adds a uprobe on every kernel launch entry point (about a microsecond per launch).
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from gemtrace import defaults
from gemtrace.sources.ebpf.libcuda import FileId

# The checkout's bpf/, then the package's.
BPF_SOURCE_DIRS = (Path(__file__).resolve().parents[3] / "bpf", defaults.BPF_INSTALLED)
BPF_PROGRAM = "gemtrace_cuda.bpf.c"

MODES = defaults.PROBE_MODES

# (symbol, program on entry, program on return or None)
MEMORY_PROBES: tuple[tuple[str, str, str | None], ...] = (
    ("cuMemAlloc_v2", "alloc_pointer_enter", "alloc_return"),
    ("cuMemAllocManaged", "alloc_managed_enter", "alloc_return"),
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


class BpfUnavailable(RuntimeError):
    """bcc cannot run here; the message says why and what to do."""


@dataclass(frozen=True)
class Usage:
    pid: int
    dev: int  # device ordinal as the process sees it
    bytes: int
    allocs: int
    last_alloc_ns: int
    managed: int = 0  # managed memory (cuMemAllocManaged), apart from `bytes`


@dataclass(frozen=True)
class Event:
    type: int  # enum gt_event_type: gemtrace.contract.EVENT_ALLOC or EVENT_EXIT
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
    links: list[int] = field(default_factory=list)  # uprobe_multi link fds (none with per-probe attachment)
    each: list[tuple[str, bool]] = field(default_factory=list)  # beside links: attached one by one by bcc


# The kernel's uapi (include/uapi/linux/bpf.h, Linux 6.6+); Debian 12's headers predate it.
_NR_BPF = 321  # x86-64, as the rest of gemtrace
_BPF_LINK_CREATE = 28
_BPF_TRACE_UPROBE_MULTI = 48  # enum bpf_attach_type
_BPF_F_UPROBE_MULTI_RETURN = 1
_u32, _u64 = ctypes.c_uint32, ctypes.c_uint64


class _UprobeMultiAttr(ctypes.Structure):
    """union bpf_attr's link_create member with its uprobe_multi arm."""

    _fields_ = [
        ("prog_fd", _u32), ("target_fd", _u32), ("attach_type", _u32), ("flags", _u32),
        ("path", _u64), ("offsets", _u64), ("ref_ctr_offsets", _u64), ("cookies", _u64),
        ("cnt", _u32), ("multi_flags", _u32), ("pid", _u32), ("pad", _u32),
    ]


_libc = ctypes.CDLL(None, use_errno=True)


def _link_uprobe_multi(prog_fd: int, path: bytes, offsets: list[int], is_return: bool) -> int:
    """One link running `prog_fd` at every offset of the file; its fd, or OSError."""
    path_buf = ctypes.create_string_buffer(path)
    offsets_buf = (_u64 * len(offsets))(*offsets)
    attr = _UprobeMultiAttr(prog_fd=prog_fd, attach_type=_BPF_TRACE_UPROBE_MULTI,
                            path=ctypes.addressof(path_buf), offsets=ctypes.addressof(offsets_buf),
                            cnt=len(offsets), multi_flags=_BPF_F_UPROBE_MULTI_RETURN if is_return else 0)
    fd = _libc.syscall(_NR_BPF, _BPF_LINK_CREATE, ctypes.byref(attr), ctypes.sizeof(attr))
    if fd < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return int(fd)


def _close_all(fds: list[int]) -> None:
    """Close link fds side by side: each close waits for a grace period, and these waits overlap."""
    if len(fds) <= 1:
        for fd in fds:
            os.close(fd)
        return
    with ThreadPoolExecutor(max_workers=min(len(fds), 32), thread_name_prefix="gemtrace-detach") as pool:
        list(pool.map(os.close, fds))


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


def _read_os_release() -> str:
    for path in (Path("/etc/os-release"), Path("/usr/lib/os-release")):
        try:
            return path.read_text()
        except OSError:
            continue
    return ""


def distribution(os_release: str) -> str:
    """"ubuntu", "debian" or "" (another or unknown) from os-release(5) text (pure): ID, then ID_LIKE,
    since a derivative names its parent there (Linux Mint: ID_LIKE="ubuntu debian")."""
    fields = {}
    for line in os_release.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            fields[key.strip()] = value.strip().strip("\"'")
    for name in (fields.get("ID", ""), *fields.get("ID_LIKE", "").split()):
        if name in ("ubuntu", "debian"):
            return name
    return ""


# The package that follows the newest distribution kernel, by distribution and machine.
_HEADERS_META = {("debian", "x86_64"): "linux-headers-amd64", ("debian", "aarch64"): "linux-headers-arm64",
                 ("ubuntu", "x86_64"): "linux-headers-generic", ("ubuntu", "aarch64"): "linux-headers-generic"}


def missing_headers_help(headers: Path, release: str, machine: str, os_release: str) -> str:
    """What to tell an operator whose running kernel has no headers where bcc looks (pure).

    The package's Recommends pulls the headers of the newest distribution kernel, which are not the
    running kernel's until a reboot into it, and a kernel that is not the distribution's has none."""
    distro = distribution(os_release)
    exact = f"linux-headers-{release}"
    meta = _HEADERS_META.get((distro, machine))
    if distro:
        install = f"run `apt-get install {exact}` as root"
        if meta:
            install += f" (if the archive no longer has it, `apt-get install {meta}` and reboot into the newest kernel)"
    else:
        install = (f"install the headers of kernel {release} (Debian and Ubuntu: `apt-get install {exact}`; "
                   "other distributions: their kernel headers or kernel-devel package)")
    return (f"bcc compiles the eBPF probes against the running kernel's headers, and {headers} is missing: "
            f"{install}, then restart the agent. Until then the agent accounts what the gates and NVML report")


def _import_bcc():  # type: ignore[no-untyped-def]
    try:
        import bcc  # noqa: PLC0415  (the distribution's python3-bpfcc)
    except ImportError as e:
        raise BpfUnavailable(
            f"bcc's Python module is missing ({e}): run `apt-get install python3-bpfcc` as root, "
            "then restart the agent"
        ) from None
    return bcc


class BpfProbes:
    """The compiled program and its attachments to libcuda files."""

    def __init__(self, mode: str = defaults.PROBE_MODE, max_allocs: int | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"probe mode {mode!r}: use one of {', '.join(MODES)}")
        if not has_bpf_privilege():
            raise BpfUnavailable("eBPF needs root (CAP_SYS_ADMIN, or CAP_BPF with CAP_PERFMON): run the agent as root")
        bcc = _import_bcc()
        src = bpf_source_dir()
        headers = Path("/lib/modules") / os.uname().release / "build"
        if not headers.exists():
            raise BpfUnavailable(missing_headers_help(headers, os.uname().release, os.uname().machine,
                                                      _read_os_release()))
        try:
            self._bpf = bcc.BPF(
                src_file=str(src / BPF_PROGRAM).encode(),
                # GT_MAX_ALLOCS: the program's own default unless asked
                cflags=[f"-I{src}"] + ([f"-DGT_MAX_ALLOCS={max_allocs}"] if max_allocs is not None else []),
            )
        except Exception as e:  # bcc raises bare Exception on compile and load failures
            raise BpfUnavailable(f"bcc could not compile or load {BPF_PROGRAM}: {e}") from None
        self.mode = mode
        self.probes = MEMORY_PROBES + (LAUNCH_PROBES if mode == "launches" else ())
        self._files: dict[FileId, _Attached] = {}
        self._on_event: Callable[[Event], None] | None = None
        self._bcc = bcc
        self.multi: bool | None = None  # uprobe_multi links: None until the first file says
        self._multi_fds: dict[str, int] = {}  # program -> fd of its copy loaded for uprobe_multi

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
        if self.multi is not False:
            self._attach_multi(attached)
        if self.multi is False:
            self._attach_each(attached)
        if not attached.probes:
            os.close(fd)
            return 0
        self._files[file_id] = attached
        return len(attached.probes)

    def _attach_multi(self, attached: _Attached) -> None:
        """One uprobe_multi link per (program, entry or return). An entry point the kernel will not
        take in a link (seen: a function that is a lone 2-byte tail jump) gets bcc's per-probe
        attachment; a kernel without links at all sets self.multi False for every later file."""
        offsets: dict[tuple[str, bool], dict[int, str]] = {}
        for symbol, enter, ret in self.probes:
            try:
                # bcc's own resolution, the one attach_uprobe uses: the symbol's offset in the file.
                _, offset = self._bcc.BPF._check_path_symbol(attached.name.encode(), symbol.encode(), None, -1)
            except Exception:
                continue  # this libcuda does not export the symbol (older driver)
            offsets.setdefault((enter, False), {}).setdefault(offset, symbol)  # aliases: one probe
            if ret is not None:
                offsets.setdefault((ret, True), {}).setdefault(offset, symbol)
        path = attached.name.encode()
        refused: list[tuple[str, str, bool]] = []
        for (program, is_return), at in offsets.items():
            prog_fd = self._multi_program(program)
            if prog_fd is None:
                break
            try:
                attached.links.append(_link_uprobe_multi(prog_fd, path, list(at), is_return))
                attached.probes.extend((symbol, is_return) for symbol in at.values())
                continue
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
            good = []
            for offset, symbol in at.items():  # which ones? one link each to find out, then one for all
                try:
                    os.close(_link_uprobe_multi(prog_fd, path, [offset], is_return))
                    good.append(offset)
                except OSError:
                    refused.append((symbol, program, is_return))
            if good:
                attached.links.append(_link_uprobe_multi(prog_fd, path, good, is_return))
                attached.probes.extend((at[offset], is_return) for offset in good)
        if not attached.links and self.multi is None:
            # Nothing linked on the first file: the kernel has no uprobe_multi (before 6.6).
            self._forget_multi_programs()
            attached.probes.clear()
            self.multi = False
            return
        self.multi = True
        for symbol, program, is_return in refused:
            attach = self._bpf.attach_uretprobe if is_return else self._bpf.attach_uprobe
            try:
                attach(name=path, sym=symbol.encode(), fn_name=program.encode())
            except Exception:
                continue
            attached.probes.append((symbol, is_return))
            attached.each.append((symbol, is_return))

    def _multi_program(self, program: str) -> int | None:
        """The program loaded for uprobe_multi links (kept apart from bcc's cache, where the copy for
        per-probe attachment lives), or None where the kernel cannot load one."""
        if program not in self._multi_fds:
            try:
                fn = self._bpf.load_func(program.encode(), self._bcc.BPF.KPROBE, attach_type=_BPF_TRACE_UPROBE_MULTI)
            except Exception:
                return None
            del self._bpf.funcs[program.encode()]
            self._multi_fds[program] = fn.fd
        return self._multi_fds[program]

    def _forget_multi_programs(self) -> None:
        for fd in self._multi_fds.values():
            os.close(fd)
        self._multi_fds.clear()

    def _attach_each(self, attached: _Attached) -> None:
        name = attached.name
        for symbol, enter, ret in self.probes:
            try:
                self._bpf.attach_uprobe(name=name.encode(), sym=symbol.encode(), fn_name=enter.encode())
            except Exception:
                continue  # this libcuda does not export the symbol (older driver)
            attached.probes.append((symbol, False))
            if ret is not None:
                self._bpf.attach_uretprobe(name=name.encode(), sym=symbol.encode(), fn_name=ret.encode())
                attached.probes.append((symbol, True))
        attached.each = list(attached.probes)

    def detach(self, file_id: FileId) -> None:
        attached = self._files.pop(file_id, None)
        if attached is None:
            return
        _close_all(attached.links)
        for symbol, is_return in attached.each:
            detach = self._bpf.detach_uretprobe if is_return else self._bpf.detach_uprobe
            try:
                detach(name=attached.name.encode(), sym=symbol.encode())
            except Exception:
                pass  # already gone with its file; nothing else to release
        os.close(attached.fd)

    # -- reading -----------------------------------------------------------------------------

    def usage(self) -> list[Usage]:
        return [
            Usage(k.tgid, k.dev, v.bytes, v.allocs, v.last_alloc_ns, v.managed)
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
        """Detach everything: every file's links at once (their grace periods overlap), then bcc's
        cleanup() for per-probe attachments (one grace period each, in turn: the kernel's
        perf_uprobe_destroy holds a global mutex) and the programs."""
        _close_all([fd for attached in self._files.values() for fd in attached.links])
        self._bpf.cleanup()
        self._forget_multi_programs()
        for attached in self._files.values():
            os.close(attached.fd)
        self._files.clear()
