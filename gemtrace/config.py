"""The resource file: groups and their quotas, in Gemini's XDG desktop-entry format.

    [train]
    MinUtil = 0.2        # share of each GPU's time guaranteed while the group has work (0..1, default 0)
    MaxUtil = 0.6        # share it may never exceed, also alone on the GPU (0..1, default 1)
    MemoryLimit = 8GiB   # device memory per GPU; k M G T powers of 10, Ki Mi Gi Ti powers of 2
    Cgroup = /kubepods/pod1234   # processes in this cgroup (prefix) belong to the group

Owns parsing (pure, over text: `parse_text`), loading, and watching for changes (`ConfigWatcher`).
Never applies anything: the agent writes accepted settings into the region and the schedulers. A bad
file is a `ConfigError` naming the file and line and saying what to do; the caller keeps the last
good settings.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gemtrace import defaults


class ConfigError(Exception):
    """A resource file that cannot be used; str() is "FILE:LINE: what is wrong; what to do"."""


@dataclass(frozen=True)
class GroupConfig:
    name: str
    min_util: float = 0.0
    max_util: float = 1.0
    memory_limit: int | None = None  # bytes per GPU; None: the whole GPU
    cgroups: tuple[str, ...] = ()


@dataclass
class _Draft:
    """A section while it is being read."""

    line: int
    min_util: float = 0.0
    max_util: float = 1.0
    min_util_line: int = 0
    memory_limit: int | None = None
    cgroups: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ResourceConfig:
    groups: dict[str, GroupConfig] = field(default_factory=dict)
    source: str = ""


_UNITS = {
    "": 1,
    "k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
    "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?|\.\d+)\s*([kKMGT]i?)?\s*B?\s*$")
_SECTION = re.compile(r"^\[([^\[\]]+)\]$")
_KEY = re.compile(r"^([A-Za-z][A-Za-z0-9-]*)\s*=\s*(.*)$")
_GROUP_NAME = re.compile(r"^[A-Za-z0-9_.:@+-]{1,63}$")
KEYS = ("MinUtil", "MaxUtil", "MemoryLimit", "Cgroup")


def format_size(n: float) -> str:
    """Bytes for people: "512 B", "1.5 GiB" (powers of 2, one decimal)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def parse_size(text: str) -> int:
    """Bytes from "2GiB", "500M", "1.5G", "4096": k M G T are powers of 10, Ki Mi Gi Ti powers of 2,
    a trailing B is optional. ValueError says what was wrong."""
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"{text.strip()!r} is not a size (examples: 4096, 500M, 2GiB)")
    number, unit = match.group(1), match.group(2) or ""
    value = float(number) * _UNITS[unit]
    if value != int(value) and value < 1:
        raise ValueError(f"{text.strip()!r} is less than one byte")
    return int(value)


def _ratio(key: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{key} {text!r} is not a number; give a ratio between 0 and 1, e.g. 0.25") from None
    if not 0.0 <= value <= 1.0 or value != value:
        raise ValueError(f"{key} {text} is {'above 1' if value > 1 else 'below 0'}; give a ratio between 0 and 1")
    return value


def parse_text(text: str, filename: str = "resource.conf") -> ResourceConfig:
    """Parse a resource file's text. The group `default` (no quota) exists unless the file defines it."""
    groups: dict[str, _Draft] = {}
    current: str | None = None
    seen_keys: dict[str, int] = {}

    def fail(lineno: int, message: str) -> ConfigError:
        return ConfigError(f"{filename}:{lineno}: {message}")

    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        section = _SECTION.match(line)
        if section:
            name = section.group(1).strip()
            if not _GROUP_NAME.match(name):
                raise fail(lineno, f"group name {name!r} must be 1 to 63 letters, digits or _.:@+-")
            if name in groups:
                raise fail(lineno, f"group [{name}] is defined twice (first at line {groups[name].line}); "
                                   "merge the two sections")
            groups[name] = _Draft(line=lineno)
            current = name
            seen_keys = {}
            continue
        key_value = _KEY.match(line)
        if not key_value:
            raise fail(lineno, f"cannot read {line!r}; expected [group] or Key = value")
        key, value = key_value.group(1), key_value.group(2).strip()
        if current is None:
            raise fail(lineno, f"{key} is outside any [group] section; put it under the group it belongs to")
        if key not in KEYS:
            raise fail(lineno, f"unknown key {key!r}; known keys: {', '.join(KEYS)}")
        if key != "Cgroup" and key in seen_keys:
            raise fail(lineno, f"{key} is set twice in [{current}] (first at line {seen_keys[key]})")
        seen_keys[key] = lineno
        group = groups[current]
        try:
            if key == "MinUtil":
                group.min_util = _ratio(key, value)
                group.min_util_line = lineno
            elif key == "MaxUtil":
                group.max_util = _ratio(key, value)
            elif key == "MemoryLimit":
                size = parse_size(value)
                if size <= 0:
                    raise ValueError(f"MemoryLimit {value} must be above 0; leave it out for no limit")
                group.memory_limit = size
            else:
                paths = [p.strip() for p in value.split(";") if p.strip()]
                if not paths or any(not p.startswith("/") for p in paths):
                    raise ValueError(f"Cgroup {value!r} must be one or more absolute cgroup paths separated by ;")
                group.cgroups.extend(paths)
        except ValueError as e:
            raise fail(lineno, str(e)) from None

    result: dict[str, GroupConfig] = {}
    for name, g in groups.items():
        if g.min_util > g.max_util:
            raise fail(g.min_util_line or g.line,
                       f"MinUtil {g.min_util:g} of [{name}] is above its MaxUtil {g.max_util:g}")
        result[name] = GroupConfig(name, g.min_util, g.max_util, g.memory_limit, tuple(g.cgroups))
    total = sum(g.min_util for g in result.values())
    if total > 1.0 + 1e-9:
        reserving = ", ".join(f"{g.name} {g.min_util:g}" for g in result.values() if g.min_util > 0)
        last = max((groups[g.name].min_util_line for g in result.values() if g.min_util > 0), default=1)
        raise fail(last, f"the MinUtils add up to {total:g}, above 1 ({reserving}); lower some of them")
    if defaults.DEFAULT_GROUP not in result:
        result[defaults.DEFAULT_GROUP] = GroupConfig(defaults.DEFAULT_GROUP)
    return ResourceConfig(groups=result, source=filename)


def load(path: Path) -> ResourceConfig:
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the resource file: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text file (UTF-8 expected)") from None
    return parse_text(text, str(path))


def _stamp(path: Path) -> tuple[int, int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class ConfigWatcher:
    """Calls `on_change(path)` when the file changes (inode, size or times), looking at most every
    `interval` seconds. Editors that replace the file (rename) and in-place writes both count."""

    def __init__(self, path: Path, on_change: Callable[[Path], object],
                 interval: float = defaults.CONFIG_POLL_SECONDS) -> None:
        self.path = path
        self.on_change = on_change
        self.interval = interval
        self._stamp = _stamp(path)

    def check(self) -> bool:
        stamp = _stamp(self.path)
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        self.on_change(self.path)
        return True

    def run(self, stop: threading.Event) -> None:
        while not stop.wait(self.interval):
            self.check()
