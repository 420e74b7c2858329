"""The resource file parser: units, defaults, and every error naming its file and line."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from gemtrace.config import ConfigError, ConfigWatcher, GroupConfig, load, parse_size, parse_text

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4096", 4096),
        ("1k", 1000),
        ("500M", 500_000_000),
        ("2G", 2_000_000_000),
        ("1.5G", 1_500_000_000),
        ("1T", 10**12),
        ("1Ki", 1024),
        ("2GiB", 2 * 2**30),
        ("512MiB", 512 * 2**20),
        ("512Mi", 512 * 2**20),
        ("3GB", 3 * 10**9),
        ("1TiB", 2**40),
        (" 8 GiB ", 8 * 2**30),
    ],
)
def test_sizes_powers_of_ten_and_of_two(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "2 XB", "-1G", "1e9", "two"])
def test_bad_sizes_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="not a size"):
        parse_size(text)


def test_a_full_file_with_defaults_and_comments() -> None:
    config = parse_text(
        "# quotas\n\n[train]\nMinUtil = 0.2\nMaxUtil=0.6\nMemoryLimit = 8GiB\n"
        "Cgroup = /kubepods/pod1; /kubepods/pod2\nCgroup=/system.slice/jobs\n\n[infer]\n",
        "r.conf",
    )
    assert config.groups["train"] == GroupConfig(
        "train", 0.2, 0.6, 8 * 2**30, ("/kubepods/pod1", "/kubepods/pod2", "/system.slice/jobs")
    )
    assert config.groups["infer"] == GroupConfig("infer")
    assert config.groups["default"] == GroupConfig("default")  # always there unless defined


def test_the_file_may_define_the_default_group() -> None:
    config = parse_text("[default]\nMaxUtil = 0.5\n")
    assert config.groups["default"].max_util == 0.5


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[a]\nMaxUtil = 1.5\n", "r.conf:2: MaxUtil 1.5 is above 1"),
        ("[a]\nMinUtil = -0.1\n", "r.conf:2: MinUtil -0.1 is below 0"),
        ("[a]\nMinUtil = half\n", "r.conf:2: MinUtil 'half' is not a number"),
        ("[a]\nMemoryLimit = 2XB\n", "r.conf:2: '2XB' is not a size"),
        ("[a]\nMemoryLimit = 0\n", "r.conf:2: MemoryLimit 0 must be above 0"),
        ("[a]\nMaxMemory = 1G\n", "r.conf:2: unknown key 'MaxMemory'"),
        ("MinUtil = 0.1\n[a]\n", "r.conf:1: MinUtil is outside any [group] section"),
        ("[a]\nMinUtil = 0.6\nMaxUtil = 0.5\n", "r.conf:2: MinUtil 0.6 of [a] is above its MaxUtil 0.5"),
        ("[a]\nMinUtil = 0.6\n[b]\nMinUtil = 0.5\n", "r.conf:4: the MinUtils add up to 1.1, above 1 (a 0.6, b 0.5)"),
        ("[a]\n[b]\n\n[a]\n", "r.conf:4: group [a] is defined twice (first at line 1)"),
        ("[a]\nMinUtil = 0.1\nMinUtil = 0.2\n", "r.conf:3: MinUtil is set twice in [a] (first at line 2)"),
        ("[a]\njust words\n", "r.conf:2: cannot read 'just words'"),
        ("[a b/c]\n", "r.conf:1: group name 'a b/c'"),
        ("[a]\nCgroup = kubepods\n", "r.conf:2: Cgroup 'kubepods' must be one or more absolute cgroup paths"),
    ],
)
def test_every_error_names_the_file_and_line(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_text(text, "r.conf")
    assert str(info.value).startswith(message)


def test_load_reports_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the resource file"):
        load(tmp_path / "absent.conf")


def test_the_watcher_sees_in_place_writes_and_replacements(tmp_path: Path) -> None:
    path = tmp_path / "r.conf"
    path.write_text("[a]\n")
    seen: list[Path] = []
    watcher = ConfigWatcher(path, seen.append, interval=0.01)
    assert not watcher.check()
    path.write_text("[a]\nMaxUtil = 0.5\n")
    assert watcher.check() and seen == [path]
    replacement = tmp_path / "new.conf"
    replacement.write_text("[b]\n")
    replacement.rename(path)
    assert watcher.check() and len(seen) == 2
    stop = threading.Event()
    stop.set()
    watcher.run(stop)  # returns at once when stopped
