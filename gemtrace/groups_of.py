"""The group of a process, and the GPUs it sees: read from /proc, decided by pure functions.

A process in a cgroup that a binding rule names (`Cgroup` with `CgroupBinding = true`: the device
plugin's rule for a pod) belongs to that group whatever its environment says; else to the group it
asks for (GEMTRACE_GROUP) if its owner is admitted there (the caller says who is:
gemtrace/agent/membership.py decides for gated processes, once); else to the group whose `Cgroup` rule in
the resource file is the longest prefix (at a path boundary) of one of its cgroup paths (e.g.
/kubepods/pod1234); else to `default`. Its device ordinals map to physical GPUs through
CUDA_VISIBLE_DEVICES (ordinals or UUIDs or unique UUID prefixes, as CUDA reads them), never by
ordinal alone (HAMi #1218). It also reads a process's uid and groups, for admission and enforcement's choice of victim.
Parsers take text; ProcReader takes its /proc root. Never writes.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

from gemtrace.defaults import DEFAULT_GROUP, ENV_GROUP

ENV_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"


def parse_environ(raw: bytes) -> dict[str, str]:
    """/proc/PID/environ: NUL-separated KEY=VALUE."""
    env: dict[str, str] = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
    return env


def parse_cgroup(text: str) -> list[str]:
    """/proc/PID/cgroup: `hierarchy:controllers:path` lines; the paths (v2's unified one first)."""
    paths: list[str] = []
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3 and parts[2]:
            if parts[0] == "0":
                paths.insert(0, parts[2])
            elif parts[2] not in paths:
                paths.append(parts[2])
    return paths


def _under(path: str, prefix: str) -> bool:
    prefix = prefix.rstrip("/") or "/"
    return prefix == "/" or path == prefix or path.startswith(prefix + "/")


def group_for(environ: Mapping[str, str], cgroups: Sequence[str], rules: Mapping[str, Sequence[str]],
              admitted: Callable[[str], bool] | None = None) -> str:
    """The group of a process that no binding rule names (gemtrace/agent/membership.py looks at those
    first, with bound_group). `rules`: group name -> its Cgroup prefixes from the resource file;
    `admitted(name)`: whether the process may join the group it asks for (None: it may)."""
    named = environ.get(ENV_GROUP, "").strip()
    if named and (admitted is None or admitted(named)):
        return named
    return cgroup_group(cgroups, rules) or DEFAULT_GROUP


def bound_group(cgroups: Sequence[str], rules: Mapping[str, Sequence[str]], binding: Container[str],
                requested: str = "") -> str | None:
    """The group a binding Cgroup rule puts the process in, whatever it asks for: the longest binding
    prefix of one of its cgroup paths. Several groups binding that same prefix (the containers of one
    pod, each with its grant) hold their processes among them: the one asked for if it is one of
    them, else the first by name."""
    best: list[str] = []
    best_len = -1
    for group, prefixes in rules.items():
        if group not in binding:
            continue
        for prefix in prefixes:
            if len(prefix) >= best_len and any(_under(path, prefix) for path in cgroups):
                if len(prefix) > best_len:
                    best, best_len = [], len(prefix)
                if group not in best:
                    best.append(group)
    if not best:
        return None
    return requested if requested in best else min(best)


def cgroup_group(cgroups: Sequence[str], rules: Mapping[str, Sequence[str]]) -> str | None:
    """The group whose Cgroup rule is the longest prefix of one of the process's cgroup paths."""
    best, best_len = None, -1
    for group, prefixes in rules.items():
        for prefix in prefixes:
            if len(prefix) > best_len and any(_under(path, prefix) for path in cgroups):
                best, best_len = group, len(prefix)
    return best


def visible_devices(value: str | None, physical: Sequence[str]) -> list[str]:
    """The UUIDs a process's ordinals 0, 1, ... name, given its CUDA_VISIBLE_DEVICES and the GPUs in
    physical order. As CUDA does, the list stops at the first entry that names no GPU."""
    if value is None:
        return list(physical)
    out: list[str] = []
    for item in (part.strip() for part in value.split(",")):
        if not item:
            break
        if item.isdigit():
            index = int(item)
            if index >= len(physical):
                break
            out.append(physical[index])
            continue
        matches = [uuid for uuid in physical if uuid.startswith(item)]
        if len(matches) != 1:
            break
        out.append(matches[0])
    return out


def parse_start_time(stat: bytes) -> int | None:
    """Field 22 of a /proc/PID/stat line; comm (field 2) may hold spaces and parentheses."""
    fields = stat.rsplit(b")", 1)[-1].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def parse_uid(status: bytes) -> int | None:
    """/proc/PID/status's `Uid:` line (real, effective, saved, filesystem): the real uid, the user who
    started the process (a set-uid program keeps its caller's)."""
    for line in status.splitlines():
        if line.startswith(b"Uid:"):
            fields = line.split()
            return int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else None
    return None


class Credentials(NamedTuple):
    uid: int  # the real uid: who started the process (admission)
    gids: list[int]  # the real gid, then the supplementary ones
    uids: set[int]  # every uid it holds: real, effective, saved, filesystem


def parse_uids(status: bytes) -> set[int]:
    """Every uid of /proc/PID/status's `Uid:` line (real, effective, saved, filesystem)."""
    for line in status.splitlines():
        if line.startswith(b"Uid:"):
            return {int(f) for f in line.split()[1:] if f.isdigit()}
    return set()


def parse_gids(status: bytes) -> list[int] | None:
    """/proc/PID/status's real gid (`Gid:`) and supplementary groups (`Groups:`): the Unix groups a
    process is in, as the kernel checks them."""
    gids: list[int] = []
    for line in status.splitlines():
        if line.startswith(b"Gid:"):
            fields = line.split()
            if len(fields) < 2 or not fields[1].isdigit():
                return None
            gids.insert(0, int(fields[1]))
        elif line.startswith(b"Groups:"):
            gids += [int(f) for f in line.split()[1:] if f.isdigit()]
    return gids or None


class ProcReader:
    """Reads one process's facts from a /proc tree; every reader returns None when the process is gone."""

    def __init__(self, proc_root: Path = Path("/proc")) -> None:
        self.proc_root = proc_root

    def _read(self, pid: int, name: str) -> bytes | None:
        try:
            return (self.proc_root / str(pid) / name).read_bytes()
        except OSError:
            return None

    def environ(self, pid: int) -> dict[str, str] | None:
        raw = self._read(pid, "environ")
        return None if raw is None else parse_environ(raw)

    def cgroups(self, pid: int) -> list[str] | None:
        raw = self._read(pid, "cgroup")
        return None if raw is None else parse_cgroup(raw.decode("utf-8", "replace"))

    def comm(self, pid: int) -> str | None:
        raw = self._read(pid, "comm")
        return None if raw is None else raw.decode("utf-8", "replace").strip()

    def uid(self, pid: int) -> int | None:
        """The real uid (/proc/PID/status): whose process it is, for enforcement's choice of victim."""
        raw = self._read(pid, "status")
        return None if raw is None else parse_uid(raw)

    def credentials(self, pid: int) -> Credentials | None:
        """The process's uids and gids from one read of /proc/PID/status (None: gone)."""
        raw = self._read(pid, "status")
        if raw is None:
            return None
        uid, gids = parse_uid(raw), parse_gids(raw)
        return None if uid is None or gids is None else Credentials(uid, gids, parse_uids(raw))

    def start_time(self, pid: int) -> int | None:
        """Field 22 of /proc/PID/stat (clock ticks since boot): tells a reused pid apart."""
        raw = self._read(pid, "stat")
        return None if raw is None else parse_start_time(raw)

    def start_time_strict(self, pid: int) -> int | None:
        """As start_time, but None only when the process is gone: any other failure to read (out of
        file descriptors, say) raises OSError, so that a caller never takes it for an exit."""
        try:
            raw = (self.proc_root / str(pid) / "stat").read_bytes()
        except (FileNotFoundError, ProcessLookupError):
            return None
        return parse_start_time(raw)

    def alive(self, pid: int) -> bool:
        """Running: a zombie (killed, not yet waited for) holds no GPU memory and counts as gone."""
        return self.running(pid)[0]

    def running(self, pid: int) -> tuple[bool, int | None]:
        """(alive, start_time) from one read of /proc/PID/stat: a poll asks both of every process."""
        raw = self._read(pid, "stat")
        if raw is None:
            return False, None
        state = raw.rsplit(b")", 1)[-1].split()[:1]
        return bool(state) and state[0] not in (b"Z", b"X", b"x"), parse_start_time(raw)
