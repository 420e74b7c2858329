"""Which libcuda files the processes on the host map: the files the eBPF probes attach to.

A file is told apart by the (device, inode) that /proc/PID/maps shows, so the same library seen by
many processes, or by a process in another mount namespace under another path, is probed once. A
file in another mount namespace is reached through /proc/PID/root (Datadog #33626). The parser is
pure text; the reader takes its /proc root so tests can point it at a fixture tree. Never opens
anything but /proc.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

# libcuda.so, libcuda.so.1, libcuda.so.580.159.04 (the real file behind the links)
_LIBCUDA_NAME = re.compile(r"(^|/)libcuda\.so(\.[0-9.]+)?$")


@dataclass(frozen=True, order=True)
class FileId:
    """A file as the kernel knows it: the device (major:minor, as maps writes it) and the inode."""

    dev: str
    inode: int


@dataclass
class LibcudaFile:
    file_id: FileId
    path: str  # the path inside the mount namespace of the processes that map it
    pids: set[int] = field(default_factory=set)

    def reachable_path(self, proc_root: Path) -> Path | None:
        """A path to the file from the agent's mount namespace: through a live user's /proc/PID/root."""
        for pid in sorted(self.pids):
            candidate = proc_root / str(pid) / "root" / self.path.lstrip("/")
            if candidate.exists():
                return candidate
        return None


def file_id_of(path: Path) -> FileId:
    """The id of a file by path, written as /proc/PID/maps writes it."""
    st = os.stat(path)
    return FileId(f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}", st.st_ino)


def parse_maps(text: str) -> dict[FileId, str]:
    """The libcuda files named in one /proc/PID/maps text, by file id."""
    found: dict[FileId, str] = {}
    for line in text.splitlines():
        parts = line.split(None, 5)
        if len(parts) < 6:
            continue
        path = parts[5].strip()
        if path.endswith(" (deleted)"):
            continue  # replaced on disk; the processes still run it, but it cannot be opened by path
        if not _LIBCUDA_NAME.search(path):
            continue
        try:
            inode = int(parts[4])
        except ValueError:
            continue
        found[FileId(parts[3], inode)] = path
    return found


def _pids(proc_root: Path) -> Iterable[int]:
    try:
        names = os.listdir(proc_root)
    except OSError:
        return []
    return (int(name) for name in names if name.isdigit())


_LIBCUDA_LINE = re.compile(rb"^.*libcuda\.so.*$", re.MULTILINE)


def _libcuda_lines(raw: bytes) -> str:
    """Only the maps lines that name a libcuda: a large process's maps are mostly other files."""
    return "\n".join(m.decode("utf-8", "replace") for m in _LIBCUDA_LINE.findall(raw))


# A process seen without a libcuda is read again after 1 s, then 2, 4, up to this: a program that
# loads CUDA late (a notebook importing torch) is found within it, while the host's thousand other
# processes cost a maps read each every few seconds, not every second (+2.5 points of a core per
# 1,000 of them, issue 13). The host's own libcuda is probed from the start (system_paths), and a
# container's is usually that same file bind-mounted: what a late find can miss is a libcuda of
# another inode (a container's cuda-compat), for at most this long.
NON_USER_RECHECK_MAX_SECONDS = 8.0


class Scanner:
    """Rescans /proc for libcuda users. A process seen mapping a libcuda is not read again while it
    lives (the library stays mapped until it exits); a new process is read at the next scan, and one
    seen without a libcuda again later, less and less often (NON_USER_RECHECK_MAX_SECONDS), so a
    file that a running process loads later is found. Reading maps is the cost of a scan: most
    processes are dismissed by one substring test of their raw bytes before any parsing."""

    def __init__(self, proc_root: Path = Path("/proc"), clock: Callable[[], float] = time.monotonic) -> None:
        self.proc_root = proc_root
        self._clock = clock
        self._users: dict[int, dict[FileId, str]] = {}
        self._non_users: dict[int, tuple[float, float]] = {}  # pid -> (when to read it again, the wait after)

    def scan(self, skip: int | None = None) -> dict[FileId, LibcudaFile]:
        """Every libcuda file mapped by a live process, with the pids that map it. `skip`: the agent."""
        files: dict[FileId, LibcudaFile] = {}
        live = set(_pids(self.proc_root))
        now = self._clock()
        for known in (self._users, self._non_users):
            for pid in [pid for pid in known if pid not in live]:
                del known[pid]
        for pid in live:
            if pid == skip:
                continue
            mapped = self._users.get(pid)
            if mapped is None:
                due, wait = self._non_users.get(pid, (now, 0.5))
                if due - now > 0.1:  # (a scan a little early for its period still reads)
                    continue
                try:
                    with open(f"{self.proc_root}/{pid}/maps", "rb") as f:
                        raw = f.read()
                except OSError:
                    continue  # exited meanwhile, or not ours to read
                mapped = parse_maps(_libcuda_lines(raw)) if b"libcuda.so" in raw else {}
                if not mapped:
                    wait = min(2 * wait, NON_USER_RECHECK_MAX_SECONDS)
                    self._non_users[pid] = (now + wait, wait)
                    continue
                self._non_users.pop(pid, None)
                self._users[pid] = mapped
            for file_id, path in mapped.items():
                entry = files.setdefault(file_id, LibcudaFile(file_id, path))
                entry.pids.add(pid)
        return files


def scan(proc_root: Path = Path("/proc"), skip: int | None = None) -> dict[FileId, LibcudaFile]:
    """One scan without memory of the previous ones."""
    return Scanner(proc_root).scan(skip)


def parse_ldconfig(text: str) -> list[Path]:
    """The libcuda.so.1 entries of `ldconfig -p` output, e.g.
    `\tlibcuda.so.1 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libcuda.so.1`."""
    out: list[Path] = []
    for line in text.splitlines():
        name, sep, path = line.strip().partition(" => ")
        if sep and name.split(" ", 1)[0] == "libcuda.so.1" and path not in map(str, out):
            out.append(Path(path))
    return out


def system_paths() -> list[Path]:
    """The host's own libcuda, as the dynamic linker finds it: probed before any process maps it,
    so the first allocations of the first CUDA process are not missed. Empty when there is none."""
    # LD_LIBRARY_PATH first, as the dynamic linker does: an agent started with it (the simulated GPU,
    # a driver outside the linker's cache) probes the libcuda its programs load too.
    found = [Path(d) / "libcuda.so.1" for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d]
    try:
        text = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        text = ""
    found += parse_ldconfig(text)
    unique: dict[Path, None] = {}
    for path in found:
        if path.exists():
            unique.setdefault(path.resolve(), None)
    return list(unique)
