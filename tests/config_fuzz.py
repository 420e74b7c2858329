"""Resource files for the config fuzzer (tests/test_config_fuzz.py): seeded, so a failure replays.

`generate(seed, n)` yields n files as bytes: a valid file drawn at random, rendered with random
spacing, comments and line ends, then put through up to four mutations from MUTATIONS (random
bytes, huge numbers, Unicode line separators, form feeds, NULs, many groups, long names, duplicate
keys and sections, bad units, invalid UTF-8, truncation, long runs of spaces). `check_config` says
whether a ResourceConfig keeps every bound the region needs. Set GEMTRACE_FUZZ_SEED to replay a run.
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Callable, Iterator

from gemtrace import defaults
from gemtrace import region as rg
from gemtrace.config import MAX_PRIORITY, MIN_PRIORITY, ResourceConfig

SEED = int(os.environ.get("GEMTRACE_FUZZ_SEED", "20240611"))
# Few names, so that hot reloads into one agent do not use up the region's entries at once (a name
# keeps its entry for the region's life); the mutations still make new ones.
NAMES = ["train", "infer", "notebook", "batch", "a", "b-1", "x.y", "team@lab", "g:1", "z_9"]
HUGE = [
    "9" * 400, str(2**64), str(2**64 - 1), str(2**64 - 2), str(2**63), "1" + "0" * 20, "1e400", "-1e400",
    "nan", "NaN", "inf", "-inf", "Infinity", "1e-400", "0", "-0", "0.0", "0.0000001", "1e-6", "0.000001",
    "1_0", "0x10", "\u0663", "\u0660.5", "\uff11", "1.", ".5", "+.5", "-.5", "00000000000000000000001",
    "0." + "9" * 400, "1" * 5000, "16EiB", "16777215Ti", "16777216Ti", "1" + " " * 3000 + "x",
]
UNITS = ["", "k", "K", "M", "G", "T", "Ki", "Mi", "Gi", "Ti", "B", "KiB", "GiB", "XB", "KI", "gib", "Gi B",
         "iB", "E", "EiB", "P", " G", "G ", "\tG", "G\x0c"]
SEPARATORS = ["\x0c", "\x0b", "\u2028", "\u2029", "\x1c", "\x1d", "\x1e", "\x85", "\r", "\x00", "\t", "\ufeff"]


def _ratio(rng: random.Random) -> str:
    return rng.choice(["0", "1", "0.5", "0.25", "0.1", "0.75", "0.05", f"{rng.random():.3f}", f"{rng.random():g}"])


def _size(rng: random.Random) -> str:
    number = rng.choice(["1", "2", "512", "1.5", "8", "4096", "0.5", str(rng.randrange(1, 10**6))])
    return number + rng.choice(["", "M", "G", "Gi", "Mi", "GiB", "MiB", "k", "Ki", "T"])


def valid_file(rng: random.Random) -> str:
    """A file the parser accepts (MinUtils adding up to at most 1, each under its MaxUtil)."""
    names = rng.sample(NAMES, rng.randint(0, 5))
    if rng.random() < 0.2:
        names.append(defaults.DEFAULT_GROUP)
    budget = 1.0
    eol = rng.choice(["\n", "\n", "\r\n"])
    lines = ["# gemtrace resource file"] if rng.random() < 0.5 else []
    for name in names:
        lines.append(f"[{name}]")
        max_util = rng.choice([1.0, 0.5, 0.8, 0.3, 0.05])
        min_util = round(rng.uniform(0, min(max_util, budget)), 3) if rng.random() < 0.6 else 0.0
        budget -= min_util
        eq = rng.choice(["=", " = ", " =", "= ", "\t=\t"])
        if min_util:
            lines.append(f"MinUtil{eq}{min_util:g}")
        if rng.random() < 0.7:
            lines.append(f"MaxUtil{eq}{max_util:g}")
        if rng.random() < 0.3:
            lines.append(f"Priority{eq}{rng.choice(['0', '1', '-1', '+5', '10', '-1000', '1000', '007'])}")
        if rng.random() < 0.5:
            lines.append(f"MemoryLimit{eq}{_size(rng)}".replace("0.5", "1.5"))
        if rng.random() < 0.3:
            more = "; /system.slice/x" if rng.random() < 0.3 else ""
            lines.append(f"Cgroup{eq}/kubepods/pod{rng.randrange(1000)}{more}")
        if rng.random() < 0.3:
            lines.append(rng.choice(["", "# a comment", "   ", "#MaxUtil = 2"]))
    return eol.join(lines) + (eol if rng.random() < 0.9 else "")


# -- mutations: text -> text (or bytes at the end) -------------------------------------------------


def _lines(text: str) -> list[str]:
    return text.split("\n")


def _replace_value(rng: random.Random, text: str, value: str) -> str:
    lines = _lines(text)
    keyed = [i for i, line in enumerate(lines) if "=" in line]
    if not keyed:
        key = rng.choice(["MinUtil", "MaxUtil", "MemoryLimit", "Priority"])
        return text + f"\n[{rng.choice(NAMES)}]\n{key} = {value}\n"
    i = rng.choice(keyed)
    lines[i] = lines[i].split("=", 1)[0] + "= " + value
    return "\n".join(lines)


def huge_number(rng: random.Random, text: str) -> str:
    return _replace_value(rng, text, rng.choice(HUGE) + (rng.choice(UNITS) if rng.random() < 0.3 else ""))


def bad_unit(rng: random.Random, text: str) -> str:
    return _replace_value(rng, text, rng.choice(["1", "2.5", "0.001", "4096", ".5"]) + rng.choice(UNITS))


def separator(rng: random.Random, text: str) -> str:
    """A form feed, U+2028, NUL... in a comment, in a value, or between lines."""
    sep = rng.choice(SEPARATORS)
    where = rng.random()
    if where < 0.5:
        return f"# before{sep}after = 2\n" + text
    pos = rng.randrange(len(text) + 1)
    return text[:pos] + sep + text[pos:]


def random_chars(rng: random.Random, text: str) -> str:
    pos = rng.randrange(len(text) + 1)
    junk = "".join(chr(rng.choice([rng.randrange(32, 127), rng.randrange(0, 32), rng.randrange(128, 0x3000)]))
                   for _ in range(rng.randint(1, 12)))
    return text[:pos] + junk + text[pos + rng.randint(0, 3):]


def many_groups(rng: random.Random, text: str) -> str:
    n = rng.choice([rg.MAX_GROUPS - 2, rg.MAX_GROUPS - 1, rg.MAX_GROUPS, rg.MAX_GROUPS + 1, 200, 10_000])
    body = "".join(f"[g{i}]\nMaxUtil = 0.5\n" for i in range(n))
    return text + "\n" + body + (f"[{defaults.DEFAULT_GROUP}]\n" if rng.random() < 0.3 else "")


def long_name(rng: random.Random, text: str) -> str:
    length = rng.choice([rg.NAME_LEN - 2, rg.NAME_LEN - 1, rg.NAME_LEN, 1000])
    name = rng.choice(["n", "\u00e9", "_", "-", " "]) * length
    return text + f"\n[{name}]\nMaxUtil = 0.5\n"


def duplicate(rng: random.Random, text: str) -> str:
    lines = _lines(text)
    candidates = [i for i, line in enumerate(lines) if line.strip()]
    if not candidates:
        return text + "\n[a]\n[a]\n"
    i = rng.choice(candidates)
    lines.insert(rng.randint(i + 1, len(lines)), lines[i])
    return "\n".join(lines)


def shuffle_lines(rng: random.Random, text: str) -> str:
    lines = _lines(text)
    rng.shuffle(lines)
    return "\n".join(lines)


def drop_line(rng: random.Random, text: str) -> str:
    lines = _lines(text)
    if lines:
        del lines[rng.randrange(len(lines))]
    return "\n".join(lines)


def truncate(rng: random.Random, text: str) -> str:
    return text[: rng.randrange(len(text) + 1)]


def bad_quota(rng: random.Random, text: str) -> str:
    """Values that parse one by one but not together, and MaxUtil 0."""
    name = rng.choice(NAMES)
    return text + rng.choice([
        f"\n[{name}]\nMinUtil = 0.6\nMaxUtil = 0.5\n",
        f"\n[{name}]\nMinUtil = 0.9\n[{name}2]\nMinUtil = 0.9\n",
        f"\n[{name}]\nMaxUtil = 0\n",
        f"\n[{name}]\nMaxUtil = 1e-7\n",
        f"\n[{name}]\nMemoryLimit = 0\n",
        f"\n[{name}]\nCgroup = relative/path\n",
        f"\n[{name}]\nCgroup = /a\x1bb\n",
        f"\n[{name}]\nUnknownKey = 1\n",
        "\nMaxUtil = 0.5\n",
        f"\n[{name}]\nmaxutil = 0.5\n",
    ])


def long_spaces(rng: random.Random, text: str) -> str:
    """Long runs inside a value: patterns with two adjacent repeats backtrack for minutes on these."""
    run = rng.choice([" ", "\t", "0", "1"]) * rng.choice([1000, 20_000])
    return _replace_value(rng, text, rng.choice(["1", "1G", "0."]) + run + rng.choice(["x", "", "G", "B!"]))


MUTATIONS: list[Callable[[random.Random, str], str]] = [
    huge_number, bad_unit, separator, random_chars, many_groups, long_name, duplicate, shuffle_lines,
    drop_line, truncate, bad_quota, long_spaces,
]


def _to_bytes(rng: random.Random, text: str) -> bytes:
    data = text.encode()
    roll = rng.random()
    if roll < 0.04:  # invalid UTF-8: a lone continuation byte, a cut sequence, Latin-1
        pos = rng.randrange(len(data) + 1)
        bad = rng.choice([b"\x80", b"\xc3", b"\xff", b"\xe9", b"\xed\xa0\x80", b"\xf4\x90\x80\x80"])
        data = data[:pos] + bad + data[pos:]
    elif roll < 0.06:  # random bytes
        pos = rng.randrange(len(data) + 1)
        data = data[:pos] + rng.randbytes(rng.randint(1, 16)) + data[pos:]
    elif roll < 0.08:
        data = b"\xef\xbb\xbf" + data  # a byte-order mark
    return data


def generate(seed: int, n: int) -> Iterator[bytes]:
    rng = random.Random(seed)
    for _ in range(n):
        text = valid_file(rng)
        for mutate in rng.sample(MUTATIONS, rng.choice([0, 1, 1, 1, 2, 2, 3, 4])):
            text = mutate(rng, text)
        yield _to_bytes(rng, text)


def check_config(config: ResourceConfig) -> list[str]:
    """Every bound a ResourceConfig must keep to fit the region; what it breaks (empty: none)."""
    broken: list[str] = []
    groups = config.groups
    if not 1 <= len(groups) <= rg.MAX_GROUPS or defaults.DEFAULT_GROUP not in groups:
        broken.append(f"{len(groups)} groups")
    for name, g in groups.items():
        if name != g.name or not 1 <= len(name.encode()) <= rg.NAME_LEN - 1 or not name.isascii() \
                or not name.isprintable() or any(c in name for c in " []=#"):
            broken.append(f"name {name!r}")
        for ratio in (g.min_util, g.max_util):
            if not (isinstance(ratio, float) and math.isfinite(ratio) and 0.0 <= ratio <= 1.0):
                broken.append(f"[{name}] ratio {ratio!r}")
        if not g.min_util <= g.max_util or round(g.max_util * rg.UTIL_ONE) < 1:
            broken.append(f"[{name}] MinUtil {g.min_util} MaxUtil {g.max_util}")
        if g.memory_limit is not None and not (
            isinstance(g.memory_limit, int) and 1 <= g.memory_limit <= rg.NO_LIMIT - 1
            and rg.GroupRecord(memory_limit=g.memory_limit).memory_limit == g.memory_limit
        ):
            broken.append(f"[{name}] MemoryLimit {g.memory_limit!r}")
        if g.oversubscribe_limit is not None and not (
            g.oversubscribe and 1 <= g.oversubscribe_limit <= rg.NO_LIMIT - 1
            and (g.memory_limit is None or g.oversubscribe_limit > g.memory_limit)
        ):
            broken.append(f"[{name}] Oversubscribe {g.oversubscribe_limit!r}")
        if not (type(g.priority) is int and MIN_PRIORITY <= g.priority <= MAX_PRIORITY):
            broken.append(f"[{name}] Priority {g.priority!r}")
        for path in g.cgroups:
            if not path.startswith("/") or not path.isprintable() or len(path.encode()) > 4096:
                broken.append(f"[{name}] Cgroup {path!r}")
    if math.fsum(g.min_util for g in groups.values()) > 1.0 + 1e-9:
        broken.append("MinUtils above 1")
    return broken
