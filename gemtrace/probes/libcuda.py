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
from collections.abc import Iterable
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


class Scanner:
    """Rescans /proc for libcuda users. A process seen mapping a libcuda is not read again while it
    lives (the library stays mapped until it exits); the others are re-read on every scan, so a file
    that a running process loads later is found on the next one. Reading maps is the cost of a scan:
    most processes are dismissed by one substring test of their raw bytes before any parsing."""

    def __init__(self, proc_root: Path = Path("/proc")) -> None:
        self.proc_root = proc_root
        self._users: dict[int, dict[FileId, str]] = {}

    def scan(self, skip: int | None = None) -> dict[FileId, LibcudaFile]:
        """Every libcuda file mapped by a live process, with the pids that map it. `skip`: the agent."""
        files: dict[FileId, LibcudaFile] = {}
        live = set(_pids(self.proc_root))
        for pid in list(self._users):
            if pid not in live:
                del self._users[pid]
        for pid in live:
            if pid == skip:
                continue
            mapped = self._users.get(pid)
            if mapped is None:
                try:
                    with open(f"{self.proc_root}/{pid}/maps", "rb") as f:
                        raw = f.read()
                except OSError:
                    continue  # exited meanwhile, or not ours to read
                if b"libcuda.so" not in raw:
                    continue
                mapped = parse_maps(_libcuda_lines(raw))
                if not mapped:
                    continue
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
