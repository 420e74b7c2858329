"""The resource file parser: units, defaults, and every error naming its file and line."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from gemtrace import region as rg
from gemtrace.config import (
    MAX_FILE_BYTES,
    ConfigError,
    ConfigWatcher,
    GroupConfig,
    load,
    parse_size,
    parse_text,
    unknown_gpus,
)

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


def test_priority_is_a_bounded_integer_defaulting_to_0() -> None:
    config = parse_text("[low]\nPriority = -3\n[high]\nPriority=+1000\n[plain]\n[zeros]\nPriority = 007\n")
    assert {name: g.priority for name, g in config.groups.items()} == {
        "low": -3, "high": 1000, "plain": 0, "zeros": 7, "default": 0}


def test_opportunistic_is_yes_or_no_defaulting_to_no_and_goes_with_priority_and_isolation() -> None:
    config = parse_text("[spare]\nOpportunistic = YES\nPriority = 3\nIsolation = mps\n[serve]\nOpportunistic = no\n"
                        "MinUtil = 0.5\n[plain]\n")
    assert config.groups["spare"].opportunistic and config.groups["spare"].priority == 3
    assert not config.groups["serve"].opportunistic and not config.groups["plain"].opportunistic


def test_the_file_may_define_the_default_group() -> None:
    config = parse_text("[default]\nMaxUtil = 0.5\n")
    assert config.groups["default"].max_util == 0.5


def test_minutils_add_up_per_gpu_when_groups_name_their_gpus() -> None:
    # Two pods' groups at 0.7, each on a GPU of its own, beside a group of every GPU at 0.3.
    config = parse_text("[all]\nMinUtil = 0.3\n[p1]\nMinUtil = 0.7\nGpus = G1\n[p2]\nMinUtil = 0.7\nGpus = G2\n")
    assert config.groups["p2"] == GroupConfig("p2", min_util=0.7, gpus=("G2",))
    assert config.groups["all"].gpus == ()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[a]\nMaxUtil = 1.5\n", "r.conf:2: MaxUtil 1.5 is above 1"),
        ("[a]\nMinUtil = -0.1\n", "r.conf:2: MinUtil -0.1 is below 0"),
        ("[a]\nMinUtil = half\n", "r.conf:2: MinUtil 'half' is not a number"),
        ("[a]\nMemoryLimit = 2XB\n", "r.conf:2: '2XB' is not a size"),
        ("[a]\nPriority = high\n", "r.conf:2: Priority 'high' is not a whole number; give a whole number from -1000"),
        ("[a]\nPriority = 1.5\n", "r.conf:2: Priority '1.5' is not a whole number"),
        ("[a]\n\nPriority = 1001\n", "r.conf:3: Priority 1001 is out of range; give a whole number from -1000 to 1000"),
        ("[a]\nPriority = -1001\n", "r.conf:2: Priority -1001 is out of range"),
        ("[a]\nPriority = " + "9" * 5000 + "\n", "r.conf:2: Priority 99999"),
        ("[a]\nPriority = 1\nPriority = 2\n", "r.conf:3: Priority is set twice in [a] (first at line 2)"),
        ("[a]\nMemoryLimit = 0\n", "r.conf:2: MemoryLimit 0 must be above 0"),
        ("[a]\nMaxMemory = 1G\n", "r.conf:2: unknown key 'MaxMemory'"),
        ("MinUtil = 0.1\n[a]\n", "r.conf:1: MinUtil is outside any [group] section"),
        ("[a]\nMinUtil = 0.6\nMaxUtil = 0.5\n", "r.conf:2: MinUtil 0.6 of [a] is above its MaxUtil 0.5"),
        ("[a]\nMinUtil = 0.6\n[b]\nMinUtil = 0.5\n", "r.conf:4: the MinUtils add up to 1.1, above 1 (a 0.6, b 0.5)"),
        ("[a]\nMinUtil = 0.3\n[b]\nMinUtil = 0.5\nGpus = G1\n[c]\nMinUtil = 0.3\nGpus = G2; G1\n",
         "r.conf:7: the MinUtils add up to 1.1 on GPU G1, above 1 (a 0.3, b 0.5, c 0.3)"),
        ("[a]\nGpus = ;\n", "r.conf:2: Gpus ';' must be one or more GPU UUIDs"),
        ("[a]\n[b]\n\n[a]\n", "r.conf:4: group [a] is defined twice (first at line 1)"),
        ("[a]\nMinUtil = 0.1\nMinUtil = 0.2\n", "r.conf:3: MinUtil is set twice in [a] (first at line 2)"),
        ("[a]\njust words\n", "r.conf:2: cannot read 'just words'"),
        ("[a b/c]\n", "r.conf:1: group name 'a b/c'"),
        ("[a]\nCgroup = kubepods\n", "r.conf:2: Cgroup 'kubepods' must be one or more absolute cgroup paths"),
        ("[a]\nOpportunistic = maybe\n",
         "r.conf:2: Opportunistic 'maybe' is neither yes nor no; give yes or no (or true or false)"),
        ("[a]\nOpportunistic = yes\nMinUtil = 0.2\n",
         "r.conf:3: MinUtil 0.2 of [a] cannot hold: the group is opportunistic (line 2) and gets only what the "
         "others leave; remove MinUtil or Opportunistic"),
        ("[a]\nMaxUtil = 0.5\n\nOpportunistic = on\n",
         "r.conf:2: MaxUtil 0.5 of [a] cannot hold: the group is opportunistic (line 4) and runs beside the "
         "others, not in turns; remove MaxUtil or Opportunistic, or make it Isolation = mps, where MaxUtil is a "
         "share of the SMs"),
        ("[a]\nOpportunistic = yes\nOpportunistic = no\n", "r.conf:3: Opportunistic is set twice in [a]"),
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


def test_a_request_reloads_at_once_changed_or_not_and_wake_ends_the_run(tmp_path: Path) -> None:
    path = tmp_path / "r.conf"
    path.write_text("[a]\n")
    seen: list[Path] = []
    watcher = ConfigWatcher(path, seen.append, interval=3600)
    stop = threading.Event()
    thread = threading.Thread(target=watcher.run, args=(stop,))
    thread.start()
    watcher.request()  # SIGHUP: the file has not changed, it is read all the same
    deadline = time.monotonic() + 5
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen == [path]
    stop.set()
    watcher.wake()
    thread.join(timeout=1)
    assert not thread.is_alive() and seen == [path]


class _RequestAfterTimeout(threading.Event):
    """A wait that times out while a request lands before the watcher goes on: the first wait only."""

    def __init__(self, watcher: ConfigWatcher) -> None:
        super().__init__()
        self.watcher, self.first = watcher, True

    def wait(self, timeout: float | None = None) -> bool:
        if not self.first:
            return super().wait(timeout)
        self.first = False
        timed_out = super().wait(0)
        self.watcher.request()  # the SIGHUP, between the wait's end and what follows it
        return timed_out


def test_a_request_that_lands_as_the_poll_times_out_is_not_lost(tmp_path: Path) -> None:
    path = tmp_path / "r.conf"
    path.write_text("[a]\n")
    seen: list[Path] = []
    watcher = ConfigWatcher(path, seen.append, interval=0.01)
    watcher._requested = _RequestAfterTimeout(watcher)
    stop = threading.Event()
    thread = threading.Thread(target=watcher.run, args=(stop,))
    thread.start()
    deadline = time.monotonic() + 5
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)
    stop.set()
    watcher.wake()
    thread.join(timeout=1)
    assert seen == [path]  # the file never changed: only the request reloads it


# -- what an adversary tried (issue 11): every one a ConfigError with its line, nothing else -------


def error_of(text: str) -> str:
    with pytest.raises(ConfigError) as info:
        parse_text(text, "r.conf")
    return str(info.value)


def test_a_fifo_at_the_path_is_refused_at_once(tmp_path: Path) -> None:
    fifo = tmp_path / "resource.conf"
    os.mkfifo(fifo)
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"resource.conf: the resource file is a FIFO; give the path of a regular"):
        load(fifo)  # opening a FIFO without O_NONBLOCK waits for a writer: for ever
    assert time.monotonic() - started < 0.5


def test_a_link_to_a_device_is_refused_and_a_link_to_a_file_followed(tmp_path: Path) -> None:
    zero = tmp_path / "zero.conf"
    zero.symlink_to("/dev/zero")  # read_text() on it filled memory
    with pytest.raises(ConfigError, match="the resource file is a device"):
        load(zero)
    real = tmp_path / "real.conf"
    real.write_text("[a]\nMaxUtil = 0.5\n")
    linked = tmp_path / "linked.conf"
    linked.symlink_to(real)  # operators link the file from a config repository
    assert load(linked).groups["a"].max_util == 0.5
    with pytest.raises(ConfigError, match="the resource file is a directory"):
        load(tmp_path)


def test_a_file_above_the_size_cap_is_refused(tmp_path: Path) -> None:
    big = tmp_path / "big.conf"
    big.write_bytes(b"#" * MAX_FILE_BYTES + b"\n[a]\n")
    with pytest.raises(ConfigError, match=r"big.conf: the resource file is larger than 1024 KiB"):
        load(big)
    big.write_bytes(b"#" * (MAX_FILE_BYTES - 5) + b"\n[a]\n")  # exactly the cap: read
    assert "a" in load(big).groups


def test_invalid_utf8_is_reported_at_its_line(tmp_path: Path) -> None:
    path = tmp_path / "r.conf"
    path.write_bytes(b"[a]\n# caf\xe9\n")
    with pytest.raises(ConfigError, match=r"r.conf:2: byte 0xe9 is not UTF-8 text; save the file as UTF-8"):
        load(path)
    path.write_bytes("\ufeff[a]\r\nMaxUtil = 0.5\r\n".encode())  # a byte-order mark and CRLF: fine
    assert load(path).groups["a"].max_util == 0.5


@pytest.mark.parametrize("digits", [400, 5000])
def test_a_number_of_hundreds_of_digits_is_an_error_not_an_overflow(digits: int) -> None:
    assert error_of("[a]\nMemoryLimit = " + "9" * digits + "\n").startswith("r.conf:2: 999")
    assert "is above 18446744073709551614 bytes" in error_of("[a]\nMemoryLimit = " + "9" * digits + "\n")
    assert "MaxUtil 999" in error_of("[a]\nMaxUtil = " + "9" * digits + "\n")
    assert error_of("[a]\nMaxUtil = 0.5\nMinUtil = 0." + "9" * digits + "\n") == (
        "r.conf:3: MinUtil 1 of [a] is above its MaxUtil 0.5 (line 2)"
    )


@pytest.mark.parametrize(
    ("limit", "accepted"),
    [
        (str(2**64), False),  # wrapped to 0 in the region's u64: every allocation failed
        (str(2**64 - 1), False),  # the region's NO_LIMIT
        (str(2**64 - 2), True),
        ("16EiB", False),
        ("16777215Ti", True),
        ("16777216Ti", False),
        ("0.5", False),
        ("0.0009765625Ki", True),  # exactly one byte
        ("1" + "0" * 19, True),
        ("1e400", False),
        ("inf", False),
        ("nan", False),
        ("\u0663G", False),  # an Arabic-Indic 3: float() takes it, a size does not
    ],
)
def test_memory_limits_fit_the_regions_u64(limit: str, accepted: bool) -> None:
    text = f"[a]\nMemoryLimit = {limit}\n"
    if accepted:
        value = parse_text(text).groups["a"].memory_limit
        assert value is not None and 1 <= value <= rg.NO_LIMIT - 1
        assert rg.GroupRecord(memory_limit=value).memory_limit == value  # stored as written, no wrap
    else:
        assert error_of(text).startswith("r.conf:2: ")


def test_groups_up_to_the_regions_capacity_with_default_counted() -> None:
    capacity = rg.MAX_GROUPS
    most = "".join(f"[g{i}]\n" for i in range(capacity - 1))
    assert len(parse_text(most).groups) == capacity  # default added
    assert len(parse_text(most + "[default]\n").groups) == capacity
    assert len(parse_text("[default]\n" + most).groups) == capacity
    assert error_of(most + f"[g{capacity}]\n") == (
        f"r.conf:{capacity}: [g{capacity}] is one group too many: the agent has room for {capacity} groups, "
        "default included; merge or remove some groups"
    )
    assert error_of("".join(f"[g{i}]\n" for i in range(10_000))).startswith(f"r.conf:{capacity}: ")


def test_group_names_fit_the_regions_name_field() -> None:
    longest = "n" * (rg.NAME_LEN - 1)
    assert longest in parse_text(f"[{longest}]\n").groups
    assert f"must be 1 to {rg.NAME_LEN - 1} letters" in error_of(f"[{longest}n]\n")
    assert "must be 1 to" in error_of("[gr\u00fcn]\n")  # a sane character set: ASCII only
    assert "must be 1 to" in error_of("[a\x00]\n")


@pytest.mark.parametrize("value", ["0", "0.0", "-0", "0.0000001", "1e-9"])
def test_max_util_zero_is_refused_with_what_to_do(value: str) -> None:
    assert error_of(f"[a]\nMaxUtil = {value}\n") == (
        f"r.conf:2: MaxUtil {value} of [a] would stop its programs for ever; give a positive share of at least "
        "1e-06, or remove the group"
    )


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e400", "0x1", "1_0", "\u0660.5", "0.5 # half"])
def test_ratios_are_finite_ascii_decimals(value: str) -> None:
    assert error_of(f"[a]\nMinUtil = {value}\n").startswith("r.conf:2: MinUtil ")


@pytest.mark.parametrize(("key", "value", "said"), [
    ("MinUtil", "-1e309", "is below 0"),  # a double's -inf: below 0, not above 1
    ("MaxUtil", "-1E400", "is below 0"),
    ("MinUtil", "-9" + "9" * 400, "is below 0"),
    ("MinUtil", "1e309", "is above 1"),
    ("MaxUtil", "+1e99999", "is above 1"),
])
def test_a_ratio_past_a_doubles_range_is_said_below_0_or_above_1_as_its_sign_is(key: str, value: str,
                                                                                 said: str) -> None:
    assert error_of(f"[a]\n{key} = {value}\n").startswith(f"r.conf:2: {key} {value[:60]}")
    assert f" {said}; give a ratio between 0 and 1" in error_of(f"[a]\n{key} = {value}\n")


def test_a_gpus_uuid_no_gpu_of_the_host_has_gets_a_warning_per_group_and_uuid() -> None:
    config = parse_text("[b]\nGpus = GPU-1;GPU-typo\n[a]\nGpus = GPU-gone\n[c]\nMinUtil = 0.1\n")
    assert unknown_gpus(config, ["GPU-1", "GPU-2"]) == [
        "group [a]: Gpus names GPU-gone, which no GPU of this host has, so nothing is reserved for it there; "
        "correct the UUID if it is meant for this host (nvidia-smi -L lists its GPUs)",
        "group [b]: Gpus names GPU-typo, which no GPU of this host has, so nothing is reserved for it there; "
        "correct the UUID if it is meant for this host (nvidia-smi -L lists its GPUs)",
    ]
    assert unknown_gpus(config, ["GPU-1", "GPU-typo", "GPU-gone"]) == []


@pytest.mark.parametrize("separator", ["\x0c", "\u2028", "\u2029", "\x0b", "\x1c", "\x85"])
def test_line_separators_inside_a_comment_do_not_split_the_line(separator: str) -> None:
    assert error_of(f"# one{separator}two\n[a]\nMaxUtil = x\n").startswith("r.conf:3: MaxUtil 'x'")
    assert parse_text(f"[a]\n# one{separator}two = 3\nMaxUtil = 0.5\n").groups["a"].max_util == 0.5


def test_line_numbers_count_lf_only_and_crlf_lines_are_read() -> None:
    assert error_of("[a]\r\nMaxUtil = 0.5\r\nMaxUtil = 0.6\r\n") == (
        "r.conf:3: MaxUtil is set twice in [a] (first at line 2); keep one"
    )
    assert error_of("[a]\r\r\nMaxUtil = x\n").startswith("r.conf:2: ")  # a lone \r is no line end


def test_cgroup_paths_are_printable() -> None:
    assert "control or separator character" in error_of("[a]\nCgroup = /kube\x1bpods\n")
    assert "longer than 4096 bytes" in error_of("[a]\nCgroup = /" + "p" * 4096 + "\n")


def test_cgroup_binding_is_a_flag_of_a_group_with_cgroup_paths() -> None:
    groups = parse_text("[pod]\nCgroup = /kubepods/pod1\nCgroupBinding = yes\n[plain]\nCgroup = /x\n").groups
    assert (groups["pod"].cgroup_binding, groups["plain"].cgroup_binding) == (True, False)
    assert error_of("[a]\nCgroupBinding = true\n") == (
        "r.conf:2: CgroupBinding of [a] binds nothing: the group has no Cgroup; give its Cgroup paths, or remove "
        "CgroupBinding")
    assert error_of("[a]\nCgroup = /x\nCgroupBinding = maybe\n") == (
        "r.conf:3: CgroupBinding 'maybe' is neither yes nor no; give yes or no (or true or false)")


def test_values_that_once_took_seconds_to_match_are_refused_at_once() -> None:
    # `\s*([kKMGT]i?)?\s*B?\s*` backtracked cubically: 4000 spaces took 46 s, holding the GIL.
    started = time.monotonic()
    for value in ["1" + " " * 200_000 + "x", "1 G" + " " * 200_000 + "x", "1" * 200_000 + "x"]:
        error_of(f"[a]\nMemoryLimit = {value}\n")
        error_of(f"[a]\nMaxUtil = {value}\n")
    assert time.monotonic() - started < 1.0


def test_messages_quote_a_long_value_short() -> None:
    message = error_of("[a]\nfoo bar" + "x" * 100_000 + "\n")
    assert message.startswith("r.conf:2: cannot read 'foo bar") and len(message) < 200


def _with_dropins(tmp_path: Path, main: str, **dropins: str) -> Path:
    path = tmp_path / "resource.conf"
    path.write_text(main)
    directory = tmp_path / "resource.d"
    directory.mkdir()
    for name, text in dropins.items():
        (directory / f"{name}.conf").write_text(text)
    return path


def test_dropins_add_groups_after_the_main_file(tmp_path: Path) -> None:
    path = _with_dropins(tmp_path, "[train]\nMinUtil = 0.2\n", pod_b="[b]\nMinUtil = 0.3\n",
                         pod_a="[a]\nMemoryLimit = 2GiB\nCgroup = /kubepods/podX\n")
    (tmp_path / "resource.d" / "notes.txt").write_text("[ignored]\n")
    config = load(path)
    assert list(config.groups) == ["train", "a", "b", "default"]
    assert config.groups["a"] == GroupConfig("a", memory_limit=2 * 2**30, cgroups=("/kubepods/podX",))


@pytest.mark.parametrize(
    ("dropin", "message"),
    [
        ("[a]\nMaxUtil = 2\n", "pod.conf:2: MaxUtil 2 is above 1"),
        ("\n[train]\n", "pod.conf:2: group [train] is already defined in {main}:1; remove one of them"),
        ("[a]\nMinUtil = 0.9\n", "pod.conf:2: the MinUtils add up to 1.1, above 1 (train 0.2, a 0.9)"),
        ("[a]\nMemoryLimit = 17GiB\n", "pod.conf:1: MemoryLimit 17.0 GiB of [a] is above the 16.0 GiB of GPU "
                                        "GPU-small; ask for at most the GPU's memory"),
    ],
)
def test_a_bad_dropin_is_refused_alone_naming_itself(tmp_path: Path, dropin: str, message: str) -> None:
    path = _with_dropins(tmp_path, "[train]\nMinUtil = 0.2\n", pod=dropin, other="[b]\nMaxUtil = 0.5\n")
    config = load(path, gpu_memory={"GPU-small": 16 * 2**30, "GPU-large": 80 * 2**30})
    directory = tmp_path / "resource.d"
    (refusal,) = config.refused
    assert refusal.path == str(directory / "pod.conf")
    assert refusal.reason.startswith(f"{directory}/{message.format(main=path)}")
    # Every other file stays in force: the main file's groups and the other drop-in's.
    assert list(config.groups) == ["train", "b", "default"]
    assert config.groups["b"].max_util == 0.5


def test_a_memory_limit_counts_against_the_gpus_its_group_may_run_on(tmp_path: Path) -> None:
    path = _with_dropins(tmp_path, "", pod="[a]\nMemoryLimit = 40GiB\nGpus = GPU-large\n",
                         wide="[b]\nMemoryLimit = 40GiB\n", far="[c]\nMemoryLimit = 40GiB\nGpus = GPU-elsewhere\n")
    config = load(path, gpu_memory={"GPU-small": 16 * 2**30, "GPU-large": 80 * 2**30})
    assert [r.path.rsplit("/", 1)[1] for r in config.refused] == ["wide.conf"]
    assert {"a", "c"} <= set(config.groups)
    assert not load(path).refused  # no GPUs given: no memory to compare with


def test_a_bad_main_file_refuses_the_whole_load_whatever_the_dropins(tmp_path: Path) -> None:
    path = _with_dropins(tmp_path, "[train]\nMinUtil = 2\n", pod="[a]\nMinUtil = 0.1\n")
    with pytest.raises(ConfigError, match=r"resource.conf:2: MinUtil 2 is above 1"):
        load(path)


def test_dropins_in_force_are_taken_before_newcomers_whatever_their_names(tmp_path: Path) -> None:
    # Two grants of 0.6 cannot both fit: the one already running keeps its place, though the newcomer
    # sorts first, and the newcomer alone is refused.
    path = _with_dropins(tmp_path, "", a_new="[new]\nMinUtil = 0.6\n", b_running="[running]\nMinUtil = 0.6\n")
    assert [r.path.rsplit("/", 1)[1] for r in load(path).refused] == ["b_running.conf"]
    in_force = {"running": GroupConfig("running", min_util=0.6), "default": GroupConfig("default")}
    config = load(path, in_force=in_force)
    assert [r.path.rsplit("/", 1)[1] for r in config.refused] == ["a_new.conf"]
    assert "running" in config.groups and "new" not in config.groups
    assert "the MinUtils add up to 1.2, above 1 (running 0.6, new 0.6)" in config.refused[0].reason
    # A pod's group is defined with its memory first and given its MinUtil a moment later: in force by
    # name, it is a newcomer for what it adds, and does not push out the running one.
    config = load(path, in_force={**in_force, "new": GroupConfig("new")})
    assert [r.path.rsplit("/", 1)[1] for r in config.refused] == ["a_new.conf"]


def test_an_unreadable_dropin_is_refused_alone(tmp_path: Path) -> None:
    path = _with_dropins(tmp_path, "[train]\n", good="[a]\n")
    (tmp_path / "resource.d" / "bad.conf").write_bytes(b"[b]\n\xff\n")
    config = load(path)
    assert [r.path.rsplit("/", 1)[1] for r in config.refused] == ["bad.conf"]
    assert "bad.conf:2: byte 0xff is not UTF-8 text" in config.refused[0].reason
    assert "a" in config.groups


def test_the_watcher_sees_a_dropin_come_and_go(tmp_path: Path) -> None:
    path = _with_dropins(tmp_path, "[train]\n")
    seen: list[Path] = []
    watcher = ConfigWatcher(path, seen.append, interval=0.01)
    assert not watcher.check()
    (tmp_path / "resource.d" / "pod.conf").write_text("[a]\n")
    assert watcher.check()
    (tmp_path / "resource.d" / "pod.conf").unlink()
    assert watcher.check()
    assert seen == [path, path]


# -- admission: Users= and UnixGroups= (docs/security.md) -------------------------------------------


def test_users_and_unix_groups_take_names_and_ids_and_admit_root_always() -> None:
    config = parse_text("[ml]\nUsers = root; 1001\nUnixGroups = root; 2000\n[open]\n")
    ml = config.groups["ml"]
    assert (ml.users, ml.unix_groups) == (frozenset({0, 1001}), frozenset({0, 2000}))
    assert ml.admits(1001, [50]) and ml.admits(7, [2000]) and ml.admits(0, [])
    assert not ml.admits(7, [50, 51])
    assert config.groups["open"].admits(7, [50])  # neither key: everyone, as before
    only_users = parse_text("[ml]\nUsers = 1001\n").groups["ml"]
    assert only_users.unix_groups is None and not only_users.admits(7, [1001])  # a gid is not a uid


@pytest.mark.parametrize(("text", "error"), [
    ("[ml]\nMinUtil = 0.1\nUsers = no-such-user-here\n",
     "resource.conf:3: Users: no user named 'no-such-user-here' on this host; create it, or give its numeric id"),
    ("[ml]\nUnixGroups = no-such-group-here\n",
     "resource.conf:2: UnixGroups: no Unix group named 'no-such-group-here' on this host; create it, or give its "
     "numeric id"),
    ("[ml]\nUsers = ; ;\n",
     "resource.conf:2: Users is empty; give one or more user names or ids separated by ;, or leave it out"),
    ("[ml]\nUsers = 4294967295\n", "resource.conf:2: Users '4294967295' is not a valid user id (0 to 4294967294)"),
    ("[ml]\nUsers = 1\nUsers = 2\n", "resource.conf:3: Users is set twice in [ml] (first at line 2); keep one"),
    ("[default]\nUnixGroups = 0\n", "resource.conf:2: [default] cannot restrict who joins it: a process admitted "
     "to no other group runs there; remove Users/UnixGroups from it"),
])
def test_admission_mistakes_name_their_line(text: str, error: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_text(text)
    assert str(e.value) == error


# -- Oversubscribe ----------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("value", "on", "bound", "word"),
    [
        ("true", True, None, rg.NO_LIMIT),
        ("Yes", True, None, rg.NO_LIMIT),
        ("false", False, None, 0),
        ("off", False, None, 0),
        ("24GiB", True, 24 * 2**30, 24 * 2**30),
    ],
)
def test_oversubscribe_is_true_false_or_the_total_size(value: str, on: bool, bound: int | None, word: int) -> None:
    group = parse_text(f"[a]\nMemoryLimit = 8GiB\nOversubscribe = {value}\n").groups["a"]
    assert (group.oversubscribe, group.oversubscribe_limit) == (on, bound)
    assert group.oversubscribe_word() == word  # what the region's oversubscribe_limit says
    assert GroupConfig("b").oversubscribe_word() == 0  # off unless the file says so


def test_oversubscribe_without_a_memory_limit_reaches_past_the_gpu() -> None:
    group = parse_text("[a]\nOversubscribe = 100GB\n").groups["a"]
    assert (group.memory_limit, group.oversubscribe_limit) == (None, 100 * 10**9)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[a]\nMemoryLimit = 8GiB\nOversubscribe = 8GiB\n",
         "r.conf:3: Oversubscribe 8.0 GiB of [a] is not above its MemoryLimit 8.0 GiB (line 2), so it would never "
         "allow managed memory; give the total the group may hold in device and managed memory, or true"),
        ("[a]\nOversubscribe = 4GiB\nMemoryLimit = 6GiB\n",
         "r.conf:2: Oversubscribe 4.0 GiB of [a] is not above its MemoryLimit 6.0 GiB (line 3), so it would never "
         "allow managed memory; give the total the group may hold in device and managed memory, or true"),
        ("[a]\nOversubscribe = maybe\n",
         "r.conf:2: Oversubscribe 'maybe' is neither true, false nor a size; give true, false, or the most memory "
         "per GPU the group may hold in all, e.g. 48GiB"),
        ("[a]\nOversubscribe = true\nOversubscribe = false\n",
         "r.conf:3: Oversubscribe is set twice in [a] (first at line 2); keep one"),
    ],
)
def test_oversubscribe_errors_say_what_to_do(text: str, message: str) -> None:
    assert error_of(text) == message
