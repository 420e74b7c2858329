"""The config fuzzer (issue 11, "nothing crashes or hangs"): generated resource files (tests/config_fuzz.py)
through the parser, through `gemtrace check-config`, and hot-reloaded into a running agent on the
simulated GPU; and the reads that once hung or killed the agent (a FIFO, a link to /dev/zero).

Seeded: a failure names its seed and file index; GEMTRACE_FUZZ_SEED=N replays (or varies) a run.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from agent_host import Host, Running, gemtrace, stop
from config_fuzz import SEED, check_config, generate
from simgpu_env import REPO

from gemtrace import region as rg
from gemtrace.config import ConfigError, load

N_PARSED = 1200
N_RELOADED = 200
N_PROMTOOL = 8  # promtool takes a while per call: a sample of the scrapes
N_CHECK_CONFIG = 10  # a process each: a sample


def error_shape(path: Path, data: bytes, message: str) -> str | None:
    """What is wrong with a ConfigError's message for this file (None: nothing): it must be one line,
    start with FILE:LINE: where LINE is a line of the file, and go on with a sentence."""
    match = re.match(rf"{re.escape(str(path))}:(\d+): \S", message)
    if match is None:
        return "does not start with FILE:LINE: and a sentence"
    if not 1 <= int(match.group(1)) <= data.count(b"\n") + 1:
        return f"line {match.group(1)} is not a line of the file"
    if "\n" in message or len(message) > 5000:
        return "is not one short line"
    return None


@pytest.mark.unit
@pytest.mark.fuzz
def test_every_generated_file_is_a_bounded_config_or_an_error_at_a_line(tmp_path: Path) -> None:
    path = tmp_path / "resource.conf"
    failures: list[str] = []
    accepted = refused = 0
    slowest = 0.0
    for index, data in enumerate(generate(SEED, N_PARSED)):
        path.write_bytes(data)
        started = time.monotonic()
        try:
            config = load(path)
        except ConfigError as e:
            refused += 1
            wrong = error_shape(path, data, str(e))
            if wrong:
                failures.append(f"file {index}: error {str(e)[:200]!r} {wrong}")
        except Exception as e:  # the property under test: nothing else, ever
            failures.append(f"file {index}: {type(e).__name__}: {e}")
        else:
            accepted += 1
            failures += [f"file {index}: {broken}" for broken in check_config(config)]
        slowest = max(slowest, time.monotonic() - started)
        if failures and not (tmp_path / "first-failure.conf").exists():
            (tmp_path / "first-failure.conf").write_bytes(data)
    assert not failures, f"seed {SEED}: {len(failures)} failures, e.g. {failures[:5]} (file in {tmp_path})"
    # The generator must reach both sides, or the run proves little.
    assert accepted >= N_PARSED // 10 and refused >= N_PARSED // 2, (accepted, refused)
    assert slowest < 2.0, f"seed {SEED}: a file took {slowest:.2f} s to read (backtracking?)"


@pytest.mark.unit
@pytest.mark.fuzz
def test_check_config_says_what_the_agent_would(tmp_path: Path) -> None:
    """The same function decides: check-config accepts what load() accepts and prints its error."""
    path = tmp_path / "fuzzed.conf"
    for index, data in enumerate(generate(SEED + 1, N_CHECK_CONFIG)):
        path.write_bytes(data)
        try:
            expected: str | None = f"{path}: OK, {len(load(path).groups)} groups"
        except ConfigError as e:
            expected = None
            error = f"gemtrace: {e}\n"
        out = subprocess.run(gemtrace("check-config", str(path)), cwd=REPO, capture_output=True, text=True, timeout=30)
        if expected is not None:
            assert out.returncode == 0 and out.stdout.startswith(expected), (index, out.stdout, out.stderr)
        else:
            assert out.returncode == 1 and out.stderr == error, (index, out.stderr)


# -- hot reloads into a running agent -------------------------------------------------------------


def scrape(agent: Running) -> dict[str, float]:
    """/metrics as {series: value}, e.g. {'gemtrace_config_last_reload_success': 1.0}."""
    series = {}
    for line in agent.metrics().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            series[name] = float(value)
    return series


def reloads(series: dict[str, float]) -> float:
    return sum(series[f'gemtrace_config_reloads_total{{result="{r}"}}'] for r in ("success", "failure"))


class HeartbeatWatch:
    """The agent's heartbeat age, read from the region as a gate reads it."""

    def __init__(self, region: rg.Region) -> None:
        self.region = region
        self.oldest_ns = 0

    def look(self) -> None:
        age = time.monotonic_ns() - self.region.layout.header.heartbeat_ns
        self.oldest_ns = max(self.oldest_ns, age)


def reload_now(agent: Running, heartbeat: HeartbeatWatch, timeout: float = 10) -> dict[str, float]:
    """SIGHUP the agent and wait for that one reload; /metrics after it."""
    before = reloads(scrape(agent))
    agent.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        heartbeat.look()
        assert agent.proc.poll() is None, agent.log.read_text()[-3000:]
        series = scrape(agent)
        if reloads(series) > before:
            assert reloads(series) == before + 1
            return series
        time.sleep(0.005)
    raise AssertionError(f"no reload within {timeout} s of SIGHUP")


def settings_in_force(region: rg.Region, series: dict[str, float]) -> dict[str, tuple[int, int, int]]:
    """The defined groups as the gates see them (region) and as /metrics says, which must agree."""
    in_region = {}
    for index, name in region.group_names().items():
        group = region.layout.groups[index]
        if group.defined:
            in_region[name] = (group.memory_limit, group.min_util_ppm, group.max_util_ppm)
    max_util = re.compile(r'gemtrace_group_util_max_ratio\{container="",group="(.*)",namespace="",pod=""\}')
    in_metrics = {m.group(1) for s in series if (m := max_util.fullmatch(s))}
    assert in_metrics == set(in_region), (in_metrics, set(in_region))
    return in_region


def expected_settings(path: Path, last_good: dict[str, tuple[int, int, int]]
                      ) -> tuple[bool, dict[str, tuple[int, int, int]]]:
    """Whether the agent must accept the file, and the settings in force after it: the file's, or the
    last good ones. Every file that loads fits: the agent frees the entries of dropped groups that no
    process refers to (none here), and the file's groups are bounded by the region's entries."""
    try:
        config = load(path)
    except ConfigError:
        return False, last_good
    return True, {
        name: (rg.NO_LIMIT if g.memory_limit is None else g.memory_limit,
               round(g.min_util * rg.UTIL_ONE), round(g.max_util * rg.UTIL_ONE))
        for name, g in config.groups.items()
    }


@pytest.mark.e2e
@pytest.mark.fuzz
def test_hot_reloads_of_generated_files_never_crash_or_stall_the_agent(host: Host) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is missing: apt-get install prometheus (Debian's package has promtool)", pytrace=False)
    agent = host.start_agent("--config-poll", "3600")  # reloads on SIGHUP only: one per file
    region = host.region()
    heartbeat = HeartbeatWatch(region)
    try:
        last_good = settings_in_force(region, scrape(agent))
        outcomes = {True: 0, False: 0}
        promtool_every = N_RELOADED // N_PROMTOOL
        for index, data in enumerate(generate(SEED, N_RELOADED)):
            host.config.write_bytes(data)
            accept, last_good = expected_settings(host.config, last_good)
            series = reload_now(agent, heartbeat)
            outcomes[accept] += 1
            assert series["gemtrace_config_last_reload_success"] == float(accept), (
                f"seed {SEED} file {index}: {data[:300]!r}\n{agent.log.read_text()[-2000:]}"
            )
            assert settings_in_force(region, series) == last_good, f"seed {SEED} file {index}"
            if index % promtool_every == 0:
                text = agent.metrics()
                check = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
                assert check.returncode == 0, f"file {index}: {check.stdout}{check.stderr}"
        assert heartbeat.oldest_ns < 1_000_000_000, f"the heartbeat went {heartbeat.oldest_ns / 1e9:.2f} s stale"
        assert outcomes[True] >= 20 and outcomes[False] >= 100, outcomes
        log = agent.log.read_text()
        assert "config_reload_crashed" not in log and "Traceback" not in log
    finally:
        region.close()
        assert stop(agent) == 0


@pytest.mark.e2e
def test_a_fifo_or_a_device_at_the_path_fails_the_reload_fast_and_the_heartbeat_stays_fresh(host: Host) -> None:
    agent = host.start_agent("--config-poll", "0.05")
    region = host.region()
    heartbeat = HeartbeatWatch(region)
    try:
        good = settings_in_force(region, scrape(agent))
        host.config.unlink()
        os.mkfifo(host.config)  # no writer: an open without O_NONBLOCK waited for one for ever
        changed = time.monotonic()
        while scrape(agent)['gemtrace_config_reloads_total{result="failure"}'] < 1:
            heartbeat.look()
            assert time.monotonic() - changed < 2, "the FIFO was not seen and refused within 2 s"
            time.sleep(0.01)
        series = scrape(agent)
        assert series["gemtrace_config_last_reload_success"] == 0.0
        assert settings_in_force(region, series) == good
        for _ in range(100):  # a second of the agent with the FIFO in place, reloads requested
            heartbeat.look()
            time.sleep(0.01)
        series = reload_now(agent, heartbeat)
        assert series["gemtrace_config_last_reload_success"] == 0.0
        assert "the resource file is a FIFO; give the path of a regular file" in agent.log.read_text()

        host.config.unlink()
        host.config.symlink_to("/dev/zero")  # read_text() on it filled the agent's memory
        series = reload_now(agent, heartbeat)
        assert series["gemtrace_config_last_reload_success"] == 0.0
        assert "the resource file is a device" in agent.log.read_text()

        host.config.unlink()
        host.config.write_text("[train]\nMaxUtil = 0.4\n")
        series = reload_now(agent, heartbeat)
        assert series["gemtrace_config_last_reload_success"] == 1.0
        assert series['gemtrace_group_util_max_ratio{container="",group="train",namespace="",pod=""}'] == 0.4
        assert heartbeat.oldest_ns < 1_000_000_000, f"the heartbeat went {heartbeat.oldest_ns / 1e9:.2f} s stale"
    finally:
        region.close()
        assert stop(agent) == 0


@pytest.mark.e2e
def test_renaming_every_group_twice_fits_since_dropped_groups_entries_are_freed(host: Host) -> None:
    """60 groups, then 60 others, then 60 more: the region has 64 entries, and a dropped group's entry
    is freed once no process refers to it."""
    host.config.write_text("".join(f"[first{i}]\n" for i in range(60)))
    agent = host.start_agent("--config-poll", "3600")
    region = host.region()
    heartbeat = HeartbeatWatch(region)
    try:
        for prefix in ("second", "third"):
            host.config.write_text("".join(f"[{prefix}{i}]\nMaxUtil=0.5\n" for i in range(60)))
            series = reload_now(agent, heartbeat)
            assert series["gemtrace_config_last_reload_success"] == 1.0, agent.log.read_text()[-2000:]
            in_force = settings_in_force(region, series)
            assert len(in_force) == 61 and all(name.startswith(prefix) or name == "default" for name in in_force)
    finally:
        region.close()
        assert stop(agent) == 0
