"""The resource file: groups and their quotas, in Gemini's XDG desktop-entry format.

    [train]
    MinUtil = 0.2        # share of each GPU's time guaranteed while the group has work (0..1, default 0)
    MaxUtil = 0.6        # share it may never exceed, also alone on the GPU (0..1, default 1)
    Priority = 10        # beyond MinUtils, a higher one goes first and revokes a lower (-1000..1000, default 0)
    MemoryLimit = 8GiB   # device memory per GPU; k M G T powers of 10, Ki Mi Gi Ti powers of 2
    Oversubscribe = 24GiB  # past MemoryLimit (or the GPU), allocations become managed memory, up to this
                         # much per GPU in all (or `true`: up to what the host can back); default false
    Cgroup = /kubepods/pod1234   # processes in this cgroup (prefix) belong to the group
    CgroupBinding = true # ... whatever group they ask for (GEMTRACE_GROUP); default false: a process
                         # admitted to the group it asks for joins that one instead
    Users = alice; 1001  # who may ask for the group (GEMTRACE_GROUP, gemtrace run --group); names or uids
    UnixGroups = ml      # ... or be in one of these Unix groups (names or gids); neither: everyone
    Gpus = GPU-8f3a...   # the GPUs (UUIDs, ;-separated) its MinUtil is reserved on; default: every GPU
    Isolation = mps      # time: launches take turns, but where a job over GPUs runs and nothing binds,
                         # the driver slices (default); mps: side by side under the MPS daemon (docs/mps.md)
    Opportunistic = yes  # takes only what the other groups leave, beside them, with a queue of a few
                         # kernels (no MinUtil; MaxUtil only with Isolation = mps, where it caps
                         # the SMs; docs/scheduler.md); default no

Drop-ins: `*.conf` files in the directory beside it named after it (resource.d for resource.conf)
add groups, read after the main file. Each drop-in is taken or refused alone: one that is bad in
itself, or does not fit beside the main file and the drop-ins taken before it (a group defined
twice, MinUtils over 1 on a GPU, a MemoryLimit above its GPU's memory), is left out with its reason
while every other one stays in force. Those already in force are taken first, so a newcomer never
pushes out a running group. Programs that own groups write drop-ins (the Kubernetes device plugin:
one per container), and one pod's grant that does not fit must cost only that pod.

Owns reading (`read_file`: a bounded regular file), parsing (pure, over text: `parse_text`), and
watching for changes (`ConfigWatcher`). Every bound a value must meet to fit the region is checked
here, once, so `gemtrace check-config` and the agent accept exactly the same files. Never applies
anything: the agent writes accepted settings into the region and the schedulers. A bad file is a
`ConfigError` naming the file and line and saying what to do; the caller keeps the last good settings.
That holds for the operator's own file: a bad main file refuses the whole load.
"""

from __future__ import annotations

import errno
import grp
import math
import os
import pwd
import re
import stat
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from gemtrace import contract, defaults
from gemtrace import region as rg

log = structlog.get_logger("gemtrace.config")


class ConfigError(Exception):
    """A resource file that cannot be used; str() is "FILE:LINE: what is wrong; what to do"."""


ISOLATION_TIME = "time"  # the scheduler gives the groups of a GPU turns (gemtrace/agent/scheduler.py)
ISOLATION_MPS = "mps"  # side by side through the GPU's NVIDIA MPS daemon (gemtrace/mps.py, docs/mps.md)
ISOLATIONS = (ISOLATION_TIME, ISOLATION_MPS)

# The agent's --unattached: what a gate does with its program while it cannot get a slot from the
# live agent (hook/gemtrace_region.h, enum gt_unattached; docs/security.md, "Attaching"). It waits by
# default: a program let through without its slot has no limit the gate can hold it to, and ungated
# memory past its group's limit is met by an OOM kill where eBPF sees it; waiting costs a delay.
UNATTACHED = {"wait": contract.UNATTACHED_WAIT, "ungated": contract.UNATTACHED_UNGATED,
              "refuse": contract.UNATTACHED_REFUSE}
UNATTACHED_DEFAULT = "wait"


@dataclass(frozen=True)
class GroupConfig:
    name: str
    min_util: float = 0.0
    max_util: float = 1.0
    memory_limit: int | None = None  # bytes per GPU; None: the whole GPU
    cgroups: tuple[str, ...] = ()
    # Who may ask for the group (docs/security.md): uids, and gids any of a process's groups may be;
    # both None: everyone (root always). Names are resolved when the file is read.
    users: frozenset[int] | None = None
    unix_groups: frozenset[int] | None = None
    oversubscribe: bool = False  # device allocations the limit (or the GPU) refuses become managed memory
    oversubscribe_limit: int | None = None  # bytes per GPU, device and managed together; None: the host's bound only
    priority: int = 0  # higher goes first on a GPU, within the quotas (docs/scheduler.md)
    # The GPUs (UUIDs) its processes run on, as a pod's CUDA_VISIBLE_DEVICES confines them: its
    # MinUtil counts against these GPUs only. Empty: every GPU. Not enforced by the agent.
    gpus: tuple[str, ...] = ()
    # How it shares a GPU with the others: ISOLATION_TIME (the scheduler gives it turns) or ISOLATION_MPS
    # (its processes run side by side through the GPU's MPS daemon, capped in SMs: docs/mps.md).
    isolation: str = ISOLATION_TIME
    # Its Cgroup rules bind: a process in one of those cgroups is in this group whatever it asks for
    # (a pod's processes cannot leave their pod's quota by setting or clearing GEMTRACE_GROUP).
    cgroup_binding: bool = False
    # Runs beside the GPU's production groups (those not opportunistic) in what they leave, rather
    # than taking turns with them (docs/scheduler.md, "Production and opportunistic work").
    opportunistic: bool = False

    def admits(self, uid: int, gids: Iterable[int]) -> bool:
        """Whether a process of `uid` with the groups `gids` (its real gid and supplementary groups)
        may join this group at its own request."""
        if uid == 0 or (self.users is None and self.unix_groups is None):
            return True
        return uid in (self.users or ()) or not (self.unix_groups or frozenset()).isdisjoint(gids)

    def oversubscribe_word(self) -> int:
        """The region's oversubscribe_limit for this group (hook/gemtrace_region.h)."""
        if not self.oversubscribe:
            return 0
        return rg.NO_LIMIT if self.oversubscribe_limit is None else self.oversubscribe_limit


@dataclass
class _Draft:
    """A section while it is being read."""

    name: str
    line: int
    min_util: float = 0.0
    max_util: float = 1.0
    priority: int = 0
    min_util_line: int = 0
    max_util_line: int = 0
    memory_limit: int | None = None
    memory_limit_line: int = 0
    oversubscribe: bool = False
    oversubscribe_limit: int | None = None
    oversubscribe_line: int = 0
    cgroups: list[str] = field(default_factory=list)
    users: frozenset[int] | None = None
    unix_groups: frozenset[int] | None = None
    admission_line: int = 0
    gpus: tuple[str, ...] = ()
    isolation: str = ISOLATION_TIME
    cgroup_binding: bool = False
    cgroup_binding_line: int = 0
    opportunistic: bool = False
    opportunistic_line: int = 0
    keys_seen: dict[str, int] = field(default_factory=dict)  # key -> the line that set it


@dataclass(frozen=True)
class Refusal:
    """A drop-in left out of the settings: its path and why ("FILE:LINE: what; what to do")."""

    path: str
    reason: str


@dataclass(frozen=True)
class ResourceConfig:
    groups: dict[str, GroupConfig] = field(default_factory=dict)
    source: str = ""
    refused: tuple[Refusal, ...] = ()  # the drop-ins left out (load)


# Bounds. The region is the one home of its capacities; these follow from it.
MAX_FILE_BYTES = 1 << 20  # a resource file of 64 groups fits in a few KiB: 1 MiB is a mistake, not a config
MAX_GROUPS = rg.MAX_GROUPS  # `default` included: the agent always defines it (it reserves one entry)
MAX_NAME_BYTES = rg.NAME_LEN - 1  # the region stores names NUL-terminated
MAX_MEMORY_LIMIT = rg.NO_LIMIT - 1  # the region's u64; NO_LIMIT (2**64-1) means no limit
MIN_MAX_UTIL = 1 / rg.UTIL_ONE  # the region stores ratios in millionths: less would be 0, a group never run
MAX_CGROUP_BYTES = 4096  # PATH_MAX
# Priorities are levels, a few of them in any real file: the bound keeps a typo (a value pasted from
# elsewhere) from being taken for one. The agent keeps them (the region does not store them).
MIN_PRIORITY, MAX_PRIORITY = -1000, 1000

_UNITS = {
    "": 1,
    "k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
}
# ASCII digits only: float() would take any Unicode digit. No two repeats may match the same
# characters: `\s*([kKMGT]i?)?\s*B?\s*` took 46 s on "1", 4000 spaces and "x", holding the GIL.
# Values are stripped before they are matched.
_SIZE = re.compile(r"(?:([0-9]+)(?:\.([0-9]+))?|\.([0-9]+))[ \t]*(?:([kKMGT]i?)[ \t]*)?B?")
_PRIORITY = re.compile(r"[+-]?[0-9]+")
_RATIO = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_SECTION = re.compile(r"\[([^\[\]]+)\]")
_KEY = re.compile(r"([A-Za-z][A-Za-z0-9-]*)\s*=\s*(.*)", re.ASCII)
_GROUP_NAME = re.compile(rf"[A-Za-z0-9_.:@+-]{{1,{MAX_NAME_BYTES}}}", re.ASCII)

MAX_ID = 2**32 - 2  # uid_t/gid_t; 2**32-1 is (uid_t)-1, "no id"
# A size's decimals past this many cannot change its byte count: n / 2**40 has at most 40 decimals.
_SIZE_DECIMALS = 40


def _shown(text: str, limit: int = 60) -> str:
    """What the user wrote, for a message: cut short (a message quotes a value, not a megabyte) and
    with control characters escaped (a message is one line of a log)."""
    short = text if len(text) <= limit else text[:limit] + "..."
    return short if short.isprintable() else repr(short)[1:-1]


def _quote(text: str, limit: int = 60) -> str:
    return repr(text) if len(text) <= limit else repr(text[:limit]) + "..."


def format_size(n: float) -> str:
    """Bytes for people: "512 B", "1.5 GiB" (powers of 2, one decimal)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if abs(n) < 1024 or unit == "EiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def parse_size(text: str) -> int:
    """Bytes from "2GiB", "500M", "1.5G", "4096": k M G T are powers of 10, Ki Mi Gi Ti powers of 2,
    a trailing B is optional; a fraction of a byte is dropped. Exact integer arithmetic, so no number
    is too long to read and none rounds. ValueError says what was wrong."""
    match = _SIZE.fullmatch(text.strip())
    if not match:
        raise ValueError(f"{_quote(text.strip())} is not a size (examples: 4096, 500M, 2GiB)")
    whole = (match.group(1) or "").lstrip("0")
    decimals = (match.group(2) or match.group(3) or "")[:_SIZE_DECIMALS]
    too_large = ValueError(f"{_shown(text.strip())} is above {MAX_MEMORY_LIMIT} bytes "
                           f"({format_size(MAX_MEMORY_LIMIT)}), the largest size; leave MemoryLimit out for no limit")
    if len(whole) > len(str(MAX_MEMORY_LIMIT)):  # read no more digits than a size can have
        raise too_large
    scaled = int(whole + decimals or "0") * _UNITS[match.group(4) or ""]
    value = scaled // 10 ** len(decimals)
    if value == 0 and scaled > 0:
        raise ValueError(f"{_quote(text.strip())} is less than one byte")
    if value > MAX_MEMORY_LIMIT:
        raise too_large
    return value


def _ratio(key: str, text: str) -> float:
    if not _RATIO.fullmatch(text):
        raise ValueError(f"{key} {_quote(text)} is not a number; give a ratio between 0 and 1, e.g. 0.25")
    # + 0.0: -0 is 0. The pattern lets no NaN through; an exponent past a double's range reads as an
    # infinity of the number's own sign, so -1e309 is below 0 and 1e309 above 1, as written.
    value = float(text) + 0.0
    if value < 0.0:
        raise ValueError(f"{key} {_shown(text)} is below 0; give a ratio between 0 and 1")
    if value > 1.0:
        raise ValueError(f"{key} {_shown(text)} is above 1; give a ratio between 0 and 1")
    return value


def _oversubscribe(text: str) -> tuple[bool, int | None]:
    """`Oversubscribe`: true, false, or a size (the most the group may hold per GPU, device and managed
    memory together). Returns (on, bound)."""
    word = text.strip().lower()
    if word in ("true", "yes", "on"):
        return True, None
    if word in ("false", "no", "off"):
        return False, None
    try:
        return True, parse_size(text)
    except ValueError:
        raise ValueError(f"Oversubscribe {_quote(text.strip())} is neither true, false nor a size; give true, "
                         "false, or the most memory per GPU the group may hold in all, e.g. 48GiB") from None


def _flag(key: str, text: str) -> bool:
    word = text.strip().lower()
    if word in ("true", "yes", "on"):
        return True
    if word in ("false", "no", "off"):
        return False
    raise ValueError(f"{key} {_quote(text.strip())} is neither yes nor no; give yes or no (or true or false)")


def _priority(text: str) -> int:
    bounds = f"give a whole number from {MIN_PRIORITY} to {MAX_PRIORITY} (higher goes first; default 0)"
    if not _PRIORITY.fullmatch(text):
        raise ValueError(f"Priority {_quote(text)} is not a whole number; {bounds}")
    digits = text.lstrip("+-").lstrip("0")
    # Read no more digits than a bound has: int() of thousands of digits is slow, then refused.
    if len(digits) > len(str(MAX_PRIORITY)) or not MIN_PRIORITY <= int(text) <= MAX_PRIORITY:
        raise ValueError(f"Priority {_shown(text)} is out of range; {bounds}")
    return int(text)


def _isolation(text: str) -> str:
    word = text.strip().lower()
    if word not in ISOLATIONS:
        raise ValueError(f"Isolation {_quote(text.strip())} is neither time nor mps; give time (launches take "
                         "turns, the default) or mps (side by side through NVIDIA MPS: docs/mps.md)")
    return word


def _cgroups(text: str) -> list[str]:
    paths = [p.strip() for p in text.split(";") if p.strip()]
    if not paths or any(not p.startswith("/") for p in paths):
        raise ValueError(f"Cgroup {_quote(text)} must be one or more absolute cgroup paths separated by ;")
    for p in paths:
        if not p.isprintable():
            raise ValueError(f"Cgroup {_quote(p)} holds a control or separator character; "
                             "give the path as /proc/PID/cgroup shows it")
        if len(p.encode()) > MAX_CGROUP_BYTES:
            raise ValueError(f"Cgroup {_quote(p)} is longer than {MAX_CGROUP_BYTES} bytes, the longest path")
    return paths


def _gpus(text: str) -> tuple[str, ...]:
    uuids = tuple(dict.fromkeys(u.strip() for u in text.split(";") if u.strip()))
    if not uuids or any(not u.isprintable() or not u.isascii() or " " in u for u in uuids):
        raise ValueError(f"Gpus {_quote(text)} must be one or more GPU UUIDs separated by ; "
                         "(as nvidia-smi -L shows them), or be left out for every GPU")
    return uuids


def _ids(key: str, text: str, lookup: Callable[[str], int], kind: str) -> frozenset[int]:
    """`Users`/`UnixGroups`: names or numeric ids separated by ;, names resolved now (the agent
    resolves them again at every reload)."""
    items = [item.strip() for item in text.split(";") if item.strip()]
    if not items:
        raise ValueError(f"{key} is empty; give one or more {kind} names or ids separated by ;, or leave it out")
    ids = set()
    for item in items:
        if item.isascii() and item.isdigit():
            if int(item) > MAX_ID:
                raise ValueError(f"{key} {_quote(item)} is not a valid {kind} id (0 to {MAX_ID})")
            ids.add(int(item))
            continue
        try:
            ids.add(lookup(item))
        except (KeyError, ValueError):
            raise ValueError(f"{key}: no {kind} named {_quote(item)} on this host; create it, or give its "
                             "numeric id") from None
    return frozenset(ids)


def _uid(name: str) -> int:
    return pwd.getpwnam(name).pw_uid


def _gid(name: str) -> int:
    return grp.getgrnam(name).gr_gid


def parse_text(text: str, filename: str = "resource.conf") -> ResourceConfig:
    """Parse a resource file's text. The group `default` (no quota) exists unless the file defines it.

    Lines end at "\\n" only (a "\\r" before it is dropped), as an editor counts them: str.splitlines
    would also split at a form feed or U+2028 inside a comment and shift every line number after it."""
    return _combine([_parse_sections(text, filename)])


@dataclass(frozen=True)
class _Parsed:
    """One file's groups, with the lines that a check spanning files names."""

    filename: str
    groups: dict[str, GroupConfig]
    lines: dict[str, int]  # group -> its section's line
    min_util_lines: dict[str, int]  # group -> its MinUtil's line (0: none)


def _set_min_util(group: _Draft, value: str, line: int) -> None:
    group.min_util, group.min_util_line = _ratio("MinUtil", value), line


def _set_max_util(group: _Draft, value: str, line: int) -> None:
    group.max_util, group.max_util_line = _ratio("MaxUtil", value), line
    if group.max_util < MIN_MAX_UTIL:
        # A group that may never run holds its programs at their first launch for ever, with nothing
        # to say why: refuse it here, where the reason can be given.
        raise ValueError(f"MaxUtil {_shown(value)} of [{group.name}] would stop its programs for ever; give a "
                         f"positive share of at least {MIN_MAX_UTIL:g}, or remove the group")


def _set_priority(group: _Draft, value: str, line: int) -> None:
    group.priority = _priority(value)


def _set_memory_limit(group: _Draft, value: str, line: int) -> None:
    size = parse_size(value)
    if size <= 0:
        raise ValueError(f"MemoryLimit {_shown(value)} must be above 0; leave it out for no limit")
    group.memory_limit, group.memory_limit_line = size, line


def _set_oversubscribe(group: _Draft, value: str, line: int) -> None:
    group.oversubscribe, group.oversubscribe_limit = _oversubscribe(value)
    group.oversubscribe_line = line


def _add_cgroups(group: _Draft, value: str, line: int) -> None:
    group.cgroups.extend(_cgroups(value))


def _set_cgroup_binding(group: _Draft, value: str, line: int) -> None:
    group.cgroup_binding, group.cgroup_binding_line = _flag("CgroupBinding", value), line


def _set_users(group: _Draft, value: str, line: int) -> None:
    group.users = _ids("Users", value, _uid, "user")
    group.admission_line = group.admission_line or line


def _set_unix_groups(group: _Draft, value: str, line: int) -> None:
    group.unix_groups = _ids("UnixGroups", value, _gid, "Unix group")
    group.admission_line = group.admission_line or line


def _set_gpus(group: _Draft, value: str, line: int) -> None:
    group.gpus = _gpus(value)


def _set_isolation(group: _Draft, value: str, line: int) -> None:
    group.isolation = _isolation(value)


def _set_opportunistic(group: _Draft, value: str, line: int) -> None:
    group.opportunistic, group.opportunistic_line = _flag("Opportunistic", value), line


# Every key a section may hold, with what reads its value into the section (a ValueError says what
# is wrong with it). Only Cgroup may be given more than once: each adds cgroups.
_SETTERS: dict[str, Callable[[_Draft, str, int], None]] = {
    "MinUtil": _set_min_util,
    "MaxUtil": _set_max_util,
    "Priority": _set_priority,
    "MemoryLimit": _set_memory_limit,
    "Oversubscribe": _set_oversubscribe,
    "Cgroup": _add_cgroups,
    "CgroupBinding": _set_cgroup_binding,
    "Users": _set_users,
    "UnixGroups": _set_unix_groups,
    "Gpus": _set_gpus,
    "Isolation": _set_isolation,
    "Opportunistic": _set_opportunistic,
}
KEYS = tuple(_SETTERS)
_REPEATABLE = frozenset({"Cgroup"})


def check_value(key: str, value: str) -> None:
    """Whether a section's `key` takes `value` on its own (ValueError: what is wrong and what to give),
    for values that reach a drop-in from elsewhere (a pod's annotations): the file's own rules, once."""
    _SETTERS[key](_Draft("check", 0), value.strip(), 0)


def _parse_sections(text: str, filename: str) -> _Parsed:
    """The groups of one file, each checked on its own; the checks across groups are _combine's."""
    groups: dict[str, _Draft] = {}
    current: _Draft | None = None
    for lineno, raw in enumerate(text.split("\n"), start=1):
        line = raw.removesuffix("\r").strip()
        if not line or line.startswith("#"):
            continue
        try:
            section = _SECTION.fullmatch(line)
            if section:
                current = _new_section(groups, section.group(1).strip(), lineno)
            else:
                _set_key(current, line, lineno)
        except ValueError as e:
            raise ConfigError(f"{filename}:{lineno}: {e}") from None
    result: dict[str, GroupConfig] = {}
    for name, draft in groups.items():
        try:
            result[name] = _group_config(draft)
        except _RuleError as e:
            raise ConfigError(f"{filename}:{e.line}: {e}") from None
    return _Parsed(filename, result, {name: g.line for name, g in groups.items()},
                   {name: g.min_util_line for name, g in groups.items()})


def _new_section(groups: dict[str, _Draft], name: str, line: int) -> _Draft:
    """A `[name]` line: the group it starts, added to `groups`."""
    if not _GROUP_NAME.fullmatch(name):
        raise ValueError(f"group name {_quote(name)} must be 1 to {MAX_NAME_BYTES} letters, digits or _.:@+-")
    if name in groups:
        raise ValueError(f"group [{name}] is defined twice (first at line {groups[name].line}); merge the two sections")
    # `default` always exists, so it counts whether or not the file has come to it yet.
    if name != defaults.DEFAULT_GROUP and len(groups.keys() - {defaults.DEFAULT_GROUP}) + 1 >= MAX_GROUPS:
        raise ValueError(f"[{name}] is one group too many: the agent has room for {MAX_GROUPS} groups, "
                         f"{defaults.DEFAULT_GROUP} included; merge or remove some groups")
    groups[name] = _Draft(name, line)
    return groups[name]


def _set_key(group: _Draft | None, text: str, line: int) -> None:
    """A `Key = value` line of the section `group` (None: before any section)."""
    key_value = _KEY.fullmatch(text)
    if not key_value:
        raise ValueError(f"cannot read {_quote(text)}; expected [group] or Key = value")
    key, value = key_value.group(1), key_value.group(2).strip()
    if group is None:
        raise ValueError(f"{key} is outside any [group] section; put it under the group it belongs to")
    setter = _SETTERS.get(key)
    if setter is None:
        raise ValueError(f"unknown key {_quote(key)}; known keys: {', '.join(KEYS)}")
    if key not in _REPEATABLE and key in group.keys_seen:
        raise ValueError(f"{key} is set twice in [{group.name}] (first at line {group.keys_seen[key]}); keep one")
    group.keys_seen[key] = line
    setter(group, value, line)


class _RuleError(ValueError):
    """A rule across a section's keys broken, at `line`: the line of the key to change."""

    def __init__(self, line: int, message: str) -> None:
        super().__init__(message)
        self.line = line


def _group_config(g: _Draft) -> GroupConfig:
    """A whole section, checked across its keys."""
    name = g.name
    if g.min_util > g.max_util:
        raise _RuleError(g.min_util_line or g.line,
                         f"MinUtil {g.min_util:g} of [{name}] is above its MaxUtil {g.max_util:g}"
                         + (f" (line {g.max_util_line})" if g.max_util_line else ""))
    if g.oversubscribe_limit is not None and g.memory_limit is not None and g.oversubscribe_limit <= g.memory_limit:
        raise _RuleError(g.oversubscribe_line,
                         f"Oversubscribe {format_size(g.oversubscribe_limit)} of [{name}] is not above its MemoryLimit "
                         f"{format_size(g.memory_limit)} (line {g.memory_limit_line}), so it would never allow managed "
                         "memory; give the total the group may hold in device and managed memory, or true")
    if g.opportunistic and g.min_util > 0.0:
        raise _RuleError(g.min_util_line, f"MinUtil {g.min_util:g} of [{name}] cannot hold: the group is opportunistic "
                                          f"(line {g.opportunistic_line}) and gets only what the others leave; "
                                          "remove MinUtil or Opportunistic")
    # Under MPS a MaxUtil is a share of the SMs, which holds beside production as well as in turns: an
    # opportunistic training held to a few SMs costs the production one little (docs/scheduler.md).
    if g.opportunistic and g.max_util < 1.0 and g.isolation != ISOLATION_MPS:
        raise _RuleError(g.max_util_line, f"MaxUtil {g.max_util:g} of [{name}] cannot hold: the group is opportunistic "
                                          f"(line {g.opportunistic_line}) and runs beside the others, not in turns; "
                                          "remove MaxUtil or Opportunistic, or make it Isolation = mps, where "
                                          "MaxUtil is a share of the SMs")
    if name == defaults.DEFAULT_GROUP and g.admission_line:
        raise _RuleError(g.admission_line, f"[{name}] cannot restrict who joins it: a process admitted to no other "
                                           "group runs there; remove Users/UnixGroups from it")
    if g.cgroup_binding and not g.cgroups:
        raise _RuleError(g.cgroup_binding_line, f"CgroupBinding of [{name}] binds nothing: the group has no Cgroup; "
                                                "give its Cgroup paths, or remove CgroupBinding")
    return GroupConfig(name, g.min_util, g.max_util, g.memory_limit, tuple(g.cgroups), g.users, g.unix_groups,
                       g.oversubscribe, g.oversubscribe_limit, g.priority, g.gpus, g.isolation, g.cgroup_binding,
                       g.opportunistic)


def _combine(files: list[_Parsed]) -> ResourceConfig:
    """The groups of the main file and its drop-ins together, checked as one file would be: a group
    defined once, no more than MAX_GROUPS, MinUtils adding up to at most 1 on every GPU (a group
    without Gpus counts on each, one with Gpus on those only: two pods' groups at 0.7 on two GPUs are
    fine). An error names the file and line where the rule was broken (the later file's, for a group
    defined twice)."""
    result: dict[str, GroupConfig] = {}
    where: dict[str, tuple[_Parsed, int]] = {}  # group -> (its file, its MinUtil's line)
    for parsed in files:
        for name, g in parsed.groups.items():
            line = parsed.lines[name]
            if name in where:
                first = where[name][0]
                raise ConfigError(f"{parsed.filename}:{line}: group [{name}] is already defined in "
                                  f"{first.filename}:{first.lines[name]}; remove one of them")
            if name != defaults.DEFAULT_GROUP and len(result.keys() - {defaults.DEFAULT_GROUP}) + 1 >= MAX_GROUPS:
                raise ConfigError(f"{parsed.filename}:{line}: [{name}] is one group too many: the agent has room "
                                  f"for {MAX_GROUPS} groups, {defaults.DEFAULT_GROUP} included; merge or remove "
                                  "some groups")
            result[name] = g
            where[name] = (parsed, parsed.min_util_lines[name] or line)
    named = sorted({gpu for g in result.values() for gpu in g.gpus})
    for gpu in named or [""]:  # "": no group names a GPU, so all count on each
        on_it = [g for g in result.values() if g.min_util > 0 and (not g.gpus or gpu in g.gpus)]
        total = math.fsum(g.min_util for g in on_it)
        if total > 1.0 + 1e-9:
            reserving = ", ".join(f"{g.name} {g.min_util:g}" for g in on_it)
            order = {id(parsed): i for i, parsed in enumerate(files)}
            _, last_line, last_file = max((order[id(where[g.name][0])], where[g.name][1], where[g.name][0].filename)
                                          for g in on_it)
            raise ConfigError(f"{last_file}:{last_line}: the MinUtils add up to {total:g}"
                              f"{f' on GPU {gpu}' if gpu else ''}, above 1 ({reserving}); lower some of them")
    if defaults.DEFAULT_GROUP not in result:
        result[defaults.DEFAULT_GROUP] = GroupConfig(defaults.DEFAULT_GROUP)
    return ResourceConfig(groups=result, source=files[0].filename if files else "")


def unknown_gpus(config: ResourceConfig, host_uuids: Iterable[str]) -> list[str]:
    """A warning for each Gpus UUID no GPU of the host has, by group name then UUID (pure): a typo there
    is no error (the file may be written for other hosts too), but on this host it reserves nothing."""
    present = set(host_uuids)
    return [f"group [{g.name}]: Gpus names {_shown(uuid)}, which no GPU of this host has, so nothing is "
            "reserved for it there; correct the UUID if it is meant for this host (nvidia-smi -L lists its GPUs)"
            for g in sorted(config.groups.values(), key=lambda g: g.name) for uuid in g.gpus if uuid not in present]


def read_file(path: Path) -> bytes:
    """The bytes of a resource file, refusing anything but a regular file of at most MAX_FILE_BYTES.

    Symbolic links are followed (operators link the file from a config repository). The open is
    non-blocking so that a FIFO at the path opens at once instead of waiting for a writer, and the
    opened descriptor (not the path, which may change in between) must then be a regular file: a
    FIFO, a socket or a device (/dev/zero) is refused before a byte is read. A regular file's read
    does not wait on another process, so these two steps are the read timeout; the size cap stops a
    file that keeps growing. A hung network file system can still stall a read: the agent reads on
    its own thread, never the heartbeat's, for that reason."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the resource file: {e.strerror}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode)
                    else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file")
            raise ConfigError(f"{path}: the resource file is {kind}; give the path of a regular file")
        chunks: list[bytes] = []
        size = 0
        while size <= MAX_FILE_BYTES:
            try:
                chunk = os.read(fd, MAX_FILE_BYTES + 1 - size)
            except BlockingIOError:
                raise ConfigError(f"{path}: the resource file would block on reading; "
                                  "give the path of a regular file") from None
            except OSError as e:
                if e.errno == errno.EINTR:
                    continue
                raise ConfigError(f"{path}: cannot read the resource file: {e.strerror}") from None
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > MAX_FILE_BYTES:
            raise ConfigError(f"{path}: the resource file is larger than {MAX_FILE_BYTES // 1024} KiB, the "
                              "most gemtrace reads; is this the right file?")
        return b"".join(chunks)
    finally:
        os.close(fd)


def decode(data: bytes, filename: str) -> str:
    """UTF-8 text (a leading byte-order mark, as some editors write, is dropped); an invalid byte
    is an error at its line."""
    try:
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        lineno = data.count(b"\n", 0, e.start) + 1
        raise ConfigError(f"{filename}:{lineno}: byte {data[e.start]:#04x} is not UTF-8 text; "
                          "save the file as UTF-8") from None


def dropin_dir(path: Path) -> Path:
    """The directory of drop-ins that complete the resource file `path`: /etc/gemtrace/resource.conf's
    is /etc/gemtrace/resource.d. Programs that own groups (the Kubernetes device plugin: one file per
    pod) write there, so that they never edit the operator's file."""
    return path.with_name(path.stem + ".d")


def dropins(path: Path) -> list[Path]:
    """The drop-ins of the resource file `path`, `*.conf` in its drop-in directory, by name (the order
    they are read in). No directory: none."""
    try:
        return sorted(p for p in dropin_dir(path).iterdir() if p.name.endswith(".conf") and not p.name.startswith("."))
    except FileNotFoundError:
        return []
    except OSError as e:
        raise ConfigError(f"{dropin_dir(path)}: cannot list the drop-in directory: {e.strerror}") from None


def load(path: Path, gpu_memory: Mapping[str, int] | None = None,
         in_force: Mapping[str, GroupConfig] | None = None) -> ResourceConfig:
    """Read and parse a resource file and then its drop-ins (`dropins`), with the same checks and
    FILE:LINE errors: what `gemtrace check-config` and the agent both call.

    A bad main file raises ConfigError. A drop-in is refused alone (`ResourceConfig.refused`): bad in
    itself, or not fitting beside what was taken before it. `gpu_memory` (GPU UUID -> bytes): a
    drop-in's MemoryLimit above the memory of a GPU it may run on is refused too. `in_force`: the
    groups of the settings in force; drop-ins holding only those, each reserving no more than it
    does now, are taken first, then the others, each in name order."""
    main = _parse_sections(decode(read_file(path), str(path)), str(path))
    taken = [main]
    _combine(taken)  # the operator's file must hold on its own
    parsed: list[_Parsed] = []
    refused: list[Refusal] = []
    for p in dropins(path):
        try:
            parsed.append(_parse_sections(decode(read_file(p), str(p)), str(p)))
        except ConfigError as e:
            refused.append(Refusal(str(p), str(e)))
    parsed.sort(key=lambda f: not _reserved_already(f, in_force or {}))  # stable: by name within
    for dropin in parsed:
        try:
            _check_memory(dropin, gpu_memory or {})
            _combine([*taken, dropin])
        except ConfigError as e:
            refused.append(Refusal(dropin.filename, str(e)))
            continue
        taken.append(dropin)
    config = _combine(taken)
    return ResourceConfig(config.groups, config.source, tuple(sorted(refused, key=lambda r: r.path)))


def _reserved_already(parsed: _Parsed, in_force: Mapping[str, GroupConfig]) -> bool:
    """Every group of the file is in force, with no more MinUtil and on the same GPUs: taking it first
    pushes out no one. A group in force that now asks for more (a pod's grant, defined with its memory
    first and given its MinUtil a moment later) is a newcomer for what it adds."""
    return bool(parsed.groups) and all(
        name in in_force and g.min_util <= in_force[name].min_util and g.gpus == in_force[name].gpus
        for name, g in parsed.groups.items())


def _check_memory(parsed: _Parsed, gpu_memory: Mapping[str, int]) -> None:
    """A drop-in's MemoryLimit must fit the smallest GPU it may run on (its Gpus, or every GPU): a
    grant past the GPU would promise memory that is not there."""
    for name, g in parsed.groups.items():
        if g.memory_limit is None or not gpu_memory:
            continue
        on = [(memory, uuid) for uuid, memory in gpu_memory.items() if not g.gpus or uuid in g.gpus]
        if not on:
            continue  # no GPU of this host: unknown_gpus says so
        memory, uuid = min(on)
        if g.memory_limit > memory:
            raise ConfigError(f"{parsed.filename}:{parsed.lines[name]}: MemoryLimit {format_size(g.memory_limit)} of "
                              f"[{name}] is above the {format_size(memory)} of GPU {uuid}; ask for at most the GPU's "
                              "memory")


def _stamp(path: Path) -> tuple[int, int, int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _stamps(path: Path) -> tuple[object, ...]:
    """The file's stamp, its drop-in directory's (a drop-in added or removed) and each drop-in's."""
    try:
        files = dropins(path)
    except ConfigError:
        files = []
    return (_stamp(path), _stamp(dropin_dir(path)), *((p.name, _stamp(p)) for p in files))


class ConfigWatcher:
    """Calls `on_change(path)` when the file or one of its drop-ins changes (device, inode, size or
    times; a drop-in added or removed), looking at most
    every `interval` seconds, or at once (changed or not) after `request()`. Editors that replace the
    file (rename) and in-place writes both count. `run` is meant for a thread of its own: a slow
    file system then delays only the next reload."""

    def __init__(self, path: Path, on_change: Callable[[Path], object],
                 interval: float = defaults.CONFIG_POLL_SECONDS) -> None:
        self.path = path
        self.on_change = on_change
        self.interval = interval
        self._stamp = _stamps(path)
        self._requested = threading.Event()

    def check(self, force: bool = False) -> bool:
        stamp = _stamps(self.path)
        if stamp == self._stamp and not force:
            return False
        self._stamp = stamp
        self.on_change(self.path)
        return True

    def request(self) -> None:
        """Reload at once, changed or not (SIGHUP). Only sets an event: safe in a signal handler."""
        self._requested.set()

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self._requested.wait(self.interval)
            if stop.is_set():
                return
            # Read the request where it is cleared, not what the wait returned: one that came after a
            # wait timed out and before the clear was lost (a SIGHUP with the file unchanged then
            # reloaded nothing: seen with the agent's CPUs busy).
            requested = self._requested.is_set()
            if requested:
                self._requested.clear()
            self.check(force=requested)

    def wake(self) -> None:
        """Let `run` see a stop set since it began waiting now, not after `interval`."""
        self._requested.set()
