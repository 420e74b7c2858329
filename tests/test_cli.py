"""What a first-time operator meets at the command line: one name for the agent's address, a
check-config that needs no argument, `gemtrace run` saying when no agent enforces quotas (or refusing
with --require-agent), and an agent that stops for good, with a distinct status, on a host without
the NVIDIA driver. The commands run as a person runs them (a child `python -m gemtrace.cli`)."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from simgpu_env import simgpu_env

from gemtrace import cli, defaults, top
from gemtrace.contract import HEARTBEAT_STALE_NS
from gemtrace.region import Region, RegionLayout
from gemtrace.run.launcher import agent_absence

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
UNIT = REPO / "packaging" / "deb" / "gemtrace.service"


def gemtrace(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gemtrace.cli", *args], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=timeout)


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "resource.conf"
    path.write_text("[train]\nMaxUtil = 0.5\n")
    return path


# -- one name for the agent's address ----------------------------------------------------------------

@pytest.mark.parametrize("name", ["status", "top"])
def test_status_and_top_take_the_agents_address_as_listen(name: str) -> None:
    parser = cli.help_parsers()[name]
    assert parser.parse_args(["--listen", "10.0.0.1:9843"]).listen == "10.0.0.1:9843"
    assert parser.parse_args([]).listen == defaults.LISTEN
    # top's first name for it still works, and --help shows one name only.
    assert parser.parse_args(["--url", "10.0.0.2:9843"]).listen == "10.0.0.2:9843"
    assert "--listen" in parser.format_help() and "--url" not in parser.format_help()


def test_top_reads_the_address_given_as_listen_or_url() -> None:
    """An address nothing listens on: both spellings reach it (and say so), exit 1."""
    for flag in ("--listen", "--url"):
        out = subprocess.run([sys.executable, "-m", "gemtrace.cli", "top", "--once", flag, "127.0.0.1:9"],
                             capture_output=True, text=True, cwd=REPO, timeout=30)
        assert out.returncode == 1
        assert "http://127.0.0.1:9/metrics" in out.stdout, out.stdout


def test_every_command_help_is_the_parser_the_man_page_documents() -> None:
    assert set(cli.help_parsers()) == {"", "agent", "run", "check-config", "status", "top", "kube-plugin",
                                        "kube-webhook", "kube-extender"}
    assert cli.help_parsers()["top"].format_help() == top.parser().format_help()
    out = gemtrace("top", "--help")
    assert out.returncode == 0 and out.stdout == top.parser().format_help()


def test_every_option_has_help_text() -> None:
    for name, parser in cli.help_parsers().items():
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):  # each command's help is checked below
                assert all(choice.help for choice in action._choices_actions)
                continue
            assert action.help, f"gemtrace {name} {'/'.join(action.option_strings) or action.dest} has no help"


# -- check-config ------------------------------------------------------------------------------------

def test_check_config_without_an_argument_checks_the_default_file_and_names_it() -> None:
    assert cli.parser().parse_args(["check-config"]).file == defaults.CONFIG_PATH
    out = gemtrace("check-config")
    # Whether or not this machine has the file, the line says which file was checked.
    if defaults.CONFIG_PATH.is_file():
        assert out.returncode == 0 and out.stdout.startswith(f"{defaults.CONFIG_PATH}: OK"), out.stdout
    else:
        assert out.returncode == 1
        assert out.stderr == (f"gemtrace: {defaults.CONFIG_PATH}: cannot read the resource file: "
                              "No such file or directory\n")


def test_check_config_names_the_file_it_was_given(config: Path) -> None:
    out = gemtrace("check-config", str(config))
    assert out.returncode == 0 and out.stdout.startswith(f"{config}: OK, 2 groups"), out.stdout


def test_check_config_warns_of_each_dropin_it_leaves_out(config: Path) -> None:
    dropins = config.with_name(config.stem + ".d")
    dropins.mkdir()
    (dropins / "a.conf").write_text("[a]\nMinUtil = 0.6\n")
    (dropins / "b.conf").write_text("[b]\nMinUtil = 0.5\n")
    out = gemtrace("check-config", str(config))
    assert out.returncode == 0 and out.stdout.startswith(f"{config}: OK, 3 groups"), out.stdout
    assert out.stderr.startswith(f"gemtrace: warning: drop-in left out: {dropins / 'b.conf'}:2: the MinUtils add "
                                 "up to 1.1"), out.stderr


# -- gemtrace run without an agent -------------------------------------------------------------------

def test_no_region_means_no_agent(tmp_path: Path) -> None:
    assert agent_absence(None, f"no region in {tmp_path}", tmp_path / "region", 10**12) == f"no region in {tmp_path}"


@pytest.mark.parametrize(("beat_age_ns", "said"), [
    (0, None),
    (HEARTBEAT_STALE_NS - 1, None),
    (HEARTBEAT_STALE_NS, "the heartbeat in /s/region is 2 s old"),
    (61 * 10**9, "the heartbeat in /s/region is 61 s old"),
])
def test_a_heartbeat_older_than_the_gates_limit_means_no_agent(beat_age_ns: int, said: str | None) -> None:
    layout = RegionLayout()
    now = 10**15
    layout.header.heartbeat_ns = now - beat_age_ns
    assert agent_absence(layout, "", Path("/s/region"), now) == said


def test_a_cleanly_stopped_agent_is_no_agent() -> None:
    layout = RegionLayout()  # heartbeat 0: what Region.stop leaves
    assert agent_absence(layout, "", Path("/s/region"), 10**15) == "it stopped and left /s/region"


def _run_echo(config: Path, state_dir: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return gemtrace("run", "--group", "train", "--config", str(config), "--state-dir", str(state_dir), *extra,
                    "--", "sh", "-c", "echo ran in $GEMTRACE_GROUP")


def test_run_without_an_agent_warns_in_one_line_and_runs(config: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    out = _run_echo(config, state)
    assert out.returncode == 0 and out.stdout == "ran in train\n"
    assert out.stderr == (
        f"gemtrace: warning: the gemtrace agent is not running (no region in {state}), so sh -c 'echo ran in "
        "$GEMTRACE_GROUP' runs without the quotas of group 'train'. Start the agent: sudo systemctl start gemtrace\n"
    )


def test_run_names_one_job_for_what_it_starts_and_keeps_a_job_named_before(config: Path, tmp_path: Path) -> None:
    def job(**env: str) -> str:
        out = gemtrace("run", "--group", "train", "--config", str(config), "--state-dir", str(tmp_path / "state"),
                       "--", "sh", "-c", "echo $GEMTRACE_JOB; sh -c 'echo $GEMTRACE_JOB'", env={**os.environ, **env})
        assert out.returncode == 0, out.stderr
        first, child = out.stdout.split()
        assert first == child  # inherited: a launcher's ranks are one job
        return first

    one, two = job(), job()
    assert len(one) >= 16 and one != two  # each `gemtrace run` its own
    assert job(GEMTRACE_JOB="sweep-7") == "sweep-7"  # one inside another's, or ranks given one by hand


def test_run_with_require_agent_refuses_without_an_agent(config: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    out = _run_echo(config, state, "--require-agent")
    assert out.returncode == 1 and out.stdout == ""  # the command did not run
    assert out.stderr.count("\n") == 1
    assert out.stderr.startswith(f"gemtrace: the gemtrace agent is not running (no region in {state}); not starting")
    assert out.stderr.endswith("(--require-agent). Start the agent: sudo systemctl start gemtrace\n")


def test_run_with_a_live_agent_says_nothing_and_a_silent_one_is_reported(config: Path, tmp_path: Path) -> None:
    """The region as an agent keeps it: a fresh heartbeat, then one 5 s old (what the gates ignore)."""
    region = Region.create(tmp_path)
    try:
        region.heartbeat(time.monotonic_ns())
        out = _run_echo(config, tmp_path, "--require-agent")
        assert out.returncode == 0 and out.stdout == "ran in train\n" and out.stderr == ""

        region.heartbeat(time.monotonic_ns() - 5 * 10**9)
        out = _run_echo(config, tmp_path, "--require-agent")
        assert out.returncode == 1 and out.stdout == ""
        assert re.search(rf"not running \(the heartbeat in {tmp_path}/region is [5-9] s old\)", out.stderr), out.stderr

        region.stop()
        out = _run_echo(config, tmp_path)
        assert out.returncode == 0 and out.stdout == "ran in train\n"
        assert f"not running (it stopped and left {tmp_path}/region)" in out.stderr
    finally:
        region.close()


# -- the agent on a host without the NVIDIA driver ---------------------------------------------------

def test_agent_without_the_driver_exits_78_and_says_what_is_missing(config: Path, tmp_path: Path) -> None:
    """The simulated NVML answers NVML_ERROR_DRIVER_NOT_LOADED when it cannot set up its state (here a
    state dir under a regular file): what nvmlInit says on a host whose driver is not loaded."""
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    env = simgpu_env(blocker / "simgpu")
    out = gemtrace("agent", "--config", str(config), "--state-dir", str(tmp_path / "state"),
                   "--listen", "127.0.0.1:0", "--no-ebpf", env=env)
    assert out.returncode == cli.EXIT_NO_GPU_DRIVER == 78, out.stderr
    # The simulation's own line about its state dir aside, gemtrace says one line.
    said = [line for line in out.stderr.splitlines() if not line.startswith("simgpu: ")]
    assert len(said) == 1 and said[0].startswith("gemtrace: "), out.stderr
    for words in ("Driver Not Loaded", "the NVIDIA driver", "libnvidia-ml.so.1", "systemctl restart gemtrace",
                  "exit status 78"):
        assert words in said[0], (words, out.stderr)
    assert not re.search(r"tests/|build/|simgpu|\w+\.py\b", said[0]), said[0]
    assert not (tmp_path / "state" / "region").exists()  # nothing set up for gates to find


def test_the_unit_does_not_restart_an_agent_without_the_driver_and_has_fds_for_every_slot() -> None:
    unit = UNIT.read_text()
    prevent = re.findall(r"^RestartPreventExitStatus=(.*)$", unit, re.M)
    assert prevent == [str(cli.EXIT_NO_GPU_DRIVER)]
    # A host without a GPU yet: the unit ends inactive, not failed (no degraded system).
    assert re.findall(r"^SuccessExitStatus=(.*)$", unit, re.M) == [str(cli.EXIT_NO_GPU_DRIVER)]
    nofile = re.findall(r"^LimitNOFILE=(\d+)$", unit, re.M)
    assert len(nofile) == 1 and int(nofile[0]) >= 65536
