"""Isolation=mps (gemtrace/mps.py, docs/mps.md): the key in the resource file, the client variables, and
end to end on the simulated GPU with the stand-in nvidia-cuda-mps-control of simgpu/: the agent starts a
daemon per GPU with its own pipe and log directories and stops it at its stop, `gemtrace run` hands an
mps group's clients the daemon's pipe and their caps, and an mps group's launches are not held while a
time-sliced group's still are."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from agent_host import Host, gemtrace, stop
from simgpu_env import REPO, last_line
from testkit import GiB, wait_until

from gemtrace import mps
from gemtrace import region as rg
from gemtrace.config import ConfigError, GroupConfig, parse_text

FAKE_CONTROL = REPO / "simgpu" / "nvidia-cuda-mps-control"

# -- the key ---------------------------------------------------------------------------------------


@pytest.mark.unit
def test_isolation_is_time_unless_a_group_says_mps() -> None:
    groups = parse_text("[a]\nIsolation = mps\n[b]\nIsolation=Time\n[c]\nMaxUtil=0.5\n").groups
    assert [groups[n].isolation for n in ("a", "b", "c", "default")] == ["mps", "time", "time", "time"]


@pytest.mark.unit
@pytest.mark.parametrize("value", ["spatial", "", "mps;time", "1"])
def test_a_bad_isolation_names_its_line_and_the_two_choices(value: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_text(f"[a]\nMaxUtil = 0.5\nIsolation = {value}\n", "r.conf")
    assert str(e.value).startswith("r.conf:3: Isolation ") and "neither time nor mps" in str(e.value)


@pytest.mark.unit
def test_isolation_set_twice_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"r.conf:3: Isolation is set twice in \[a\] \(first at line 2\)"):
        parse_text("[a]\nIsolation = mps\nIsolation = time\n", "r.conf")


@pytest.mark.unit
def test_check_config_shows_isolation_and_refuses_a_bad_one(tmp_path: Path) -> None:
    good, bad = tmp_path / "good.conf", tmp_path / "bad.conf"
    good.write_text("[infer]\nMaxUtil = 0.3\nIsolation = mps\n")
    bad.write_text("[infer]\n\nIsolation = spatial\n")
    out = subprocess.run(gemtrace("check-config", str(good)), capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    header = out.stdout.splitlines()[1]
    row = next(line for line in out.stdout.splitlines() if line.startswith("infer"))
    end = header.index("Isolation") + len("Isolation")  # (the columns are right-aligned)
    assert row[:end].split()[-1] == "mps"
    out = subprocess.run(gemtrace("check-config", str(bad)), capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 1 and f"{bad}:3: Isolation 'spatial' is neither time nor mps" in out.stderr


# -- the client variables ----------------------------------------------------------------------------


def group(name: str, **kw: Any) -> GroupConfig:
    return GroupConfig(name, isolation="mps", **kw)


@pytest.mark.unit
def test_threads_come_from_maxutil_else_from_what_the_others_minutils_leave() -> None:
    capped = group("a", max_util=0.3)
    assert mps.thread_percentage(capped, [capped]) == 30
    guaranteed, other = group("g", min_util=0.6), group("o")
    assert mps.thread_percentage(guaranteed, [guaranteed, other]) is None  # nobody reserves against it
    assert mps.thread_percentage(other, [guaranteed, other]) == 40
    # The smaller of the two; a time-sliced group's MinUtil is not among the mps groups of the GPU.
    assert mps.thread_percentage(group("c", max_util=0.5), [guaranteed]) == 40
    assert mps.thread_percentage(group("t", max_util=0.001), []) == 1


@pytest.mark.unit
def test_an_opportunistic_mps_group_s_clients_start_at_mps_s_low_priority() -> None:
    """CUDA_MPS_CLIENT_PRIORITY=1 (below normal): the GPU runs the other clients' kernels first."""
    groups = [group("spare", opportunistic=True), group("serve")]
    assert mps.client_variables(groups, "GPU-0") == {"spare": {mps.ENV_PRIORITY: "1"}, "serve": {}}


@pytest.mark.unit
def test_an_opportunistic_mps_group_s_max_util_caps_its_sms() -> None:
    """The resource file takes MaxUtil beside Opportunistic for an mps group (a share of the SMs, not
    of turns), and its clients start with that share and the low priority."""
    config = parse_text("[serve]\nIsolation = mps\n[spare]\nIsolation = mps\nOpportunistic = yes\n"
                        "MaxUtil = 0.05\n", "r.conf")
    assert mps.client_variables(config.groups.values(), "GPU-0") == {
        "spare": {mps.ENV_THREADS: "5", mps.ENV_PRIORITY: "1"}, "serve": {}}
    with pytest.raises(ConfigError, match="r.conf:4: MaxUtil 0.05 of \\[spare\\] cannot hold"):
        parse_text("[serve]\n[spare]\nOpportunistic = yes\nMaxUtil = 0.05\n", "r.conf")


@pytest.mark.unit
def test_client_variables_per_gpu_follow_gpus_and_memory_limit() -> None:
    groups = [group("a", max_util=0.3, memory_limit=8 * GiB + 5), group("b", min_util=0.7, gpus=("GPU-1",)),
              GroupConfig("t", min_util=0.5)]
    assert mps.client_variables(groups, "GPU-0") == {
        "a": {mps.ENV_THREADS: "30", mps.ENV_MEMORY: "0=8192M"}}
    assert mps.client_variables(groups, "GPU-1") == {"a": {mps.ENV_THREADS: "30", mps.ENV_MEMORY: "0=8192M"},
                                                     "b": {}}


@pytest.mark.unit
def test_client_environment_picks_the_first_visible_gpu_and_keeps_what_the_user_set(tmp_path: Path) -> None:
    for uuid, threads in (("GPU-0", "30"), ("GPU-1", "50")):
        (mps.pipe_dir(tmp_path, uuid)).mkdir(parents=True)
        (mps.pipe_dir(tmp_path, uuid) / mps.CONTROL_PIPE).touch()
        (mps.gpu_dir(tmp_path, uuid) / mps.CLIENTS_FILE).write_text(json.dumps({"a": {mps.ENV_THREADS: threads}}))
    gpus = ["GPU-0", "GPU-1"]
    assert mps.client_environment(tmp_path, "a", gpus, {}) == {
        mps.ENV_PIPE: str(mps.pipe_dir(tmp_path, "GPU-0")), mps.ENV_THREADS: "30"}
    assert mps.client_environment(tmp_path, "a", gpus, {"CUDA_VISIBLE_DEVICES": "1"})[mps.ENV_THREADS] == "50"
    assert mps.client_environment(tmp_path, "a", gpus, {mps.ENV_THREADS: "80", mps.ENV_PIPE: "/mine"}) == {}
    assert mps.client_environment(tmp_path, "b", gpus, {}) == {}  # not an mps group
    (mps.pipe_dir(tmp_path, "GPU-0") / mps.CONTROL_PIPE).unlink()  # its daemon is gone
    assert mps.client_environment(tmp_path, "a", gpus, {}) == {}


# -- end to end on the simulated GPU ------------------------------------------------------------------

CONFIG = "[infer]\nMaxUtil = 0.2\nMemoryLimit = 1GiB\nIsolation = mps\n\n[train]\nMaxUtil = 0.2\n"


def calls(log_dir: Path) -> list[dict[str, Any]]:
    path = log_dir / "control.log"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def environment_of(host: Host, group_name: str) -> dict[str, str]:
    out = subprocess.run(gemtrace("run", "--group", group_name, "--state-dir", str(host.state_dir), "--", "env"),
                         env=host.env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)


def kernel_share(proc: subprocess.Popen[bytes]) -> float:
    last = last_line(proc, 60)
    return float(last["kernel_s"]) / float(last["elapsed_s"])


@pytest.mark.e2e
def test_an_mps_group_runs_under_a_daemon_per_gpu_unheld_and_the_daemons_stop_with_the_agent(
        simgpu_factory: Any, tmp_path: Path) -> None:
    host = Host(simgpu_factory(devices=2), tmp_path / "resource.conf", tmp_path / "state", tmp_path)
    host.config.write_text(CONFIG)
    agent = host.start_agent("--mps-control", str(FAKE_CONTROL))
    try:
        r = host.region()
        uuids = [g.uuid.decode() for g in r.layout.gpus[: r.layout.header.n_gpus]]
        assert len(uuids) == 2
        for uuid in uuids:  # a daemon per GPU, seeing that GPU only, in the agent's state dir
            started = [c for c in calls(mps.gpu_dir(host.state_dir, uuid) / "log") if c["event"] == "daemon_started"]
            assert len(started) == 1 and started[0]["env"] == {
                mps.ENV_PIPE: str(mps.pipe_dir(host.state_dir, uuid)),
                mps.ENV_LOG: str(mps.gpu_dir(host.state_dir, uuid) / "log"), "CUDA_VISIBLE_DEVICES": uuid}
            assert (mps.pipe_dir(host.state_dir, uuid) / mps.CONTROL_PIPE).exists()
        infer, train = r.group_index("infer"), r.group_index("train")
        assert infer is not None and train is not None

        env = environment_of(host, "infer")
        assert env[mps.ENV_PIPE] == str(mps.pipe_dir(host.state_dir, uuids[0]))
        assert env[mps.ENV_THREADS] == "20" and env[mps.ENV_MEMORY] == "0=1024M"
        assert env["GEMTRACE_GROUP"] == "infer" and "libgemgate.so" in env["LD_PRELOAD"]  # still gated
        assert mps.ENV_PIPE not in environment_of(host, "train")

        # Side by side: the mps group's launches run as they come; the time-sliced group is held to its cap.
        loop = ("launch-loop", "--kernel-ns", "2000000", "--launches-per-iter", "4", "--seconds", "3")
        side, turns = host.run("infer", *loop), host.run("train", *loop)
        wait_until("train held", lambda: r.layout.control[0][train].held == rg.HELD, timeout=10)
        assert r.layout.control[0][infer].held == rg.RELEASED
        infer_share, train_share = kernel_share(side), kernel_share(turns)
        assert infer_share > 0.6 and train_share < 0.3, (infer_share, train_share)
        r.close()
    finally:
        assert stop(agent) == 0
    for uuid in uuids:
        log = calls(mps.gpu_dir(host.state_dir, uuid) / "log")
        assert [c["commands"] for c in log if c["event"] == "sent"] == ["quit\n"]
        assert any(c["event"] == "daemon_quit" for c in log)
        assert not (mps.pipe_dir(host.state_dir, uuid) / mps.CONTROL_PIPE).exists()
    assert '"event": "mps_daemon_stopped"' in agent.log.read_text()


@pytest.mark.e2e
def test_without_the_control_program_the_agent_says_so_once_and_keeps_time_slicing(host: Host) -> None:
    host.config.write_text(CONFIG)
    missing = host.tmp / "no-such-dir" / "nvidia-cuda-mps-control"
    agent = host.start_agent("--mps-control", str(missing))
    try:
        r = host.region()
        infer = r.group_index("infer")
        assert infer is not None
        wait_until("infer held", lambda: r.layout.control[0][infer].held == rg.HELD, timeout=10)
        assert mps.ENV_PIPE not in environment_of(host, "infer")
        side = host.run("infer", "launch-loop", "--kernel-ns", "2000000", "--launches-per-iter", "4",
                        "--seconds", "3")
        assert kernel_share(side) < 0.3  # its MaxUtil 0.2, as a time-sliced group
        r.close()
    finally:
        assert stop(agent) == 0
    events = [json.loads(line) for line in agent.log.read_text().splitlines() if line.startswith("{")]
    missing_lines = [e for e in events if e.get("event") == "mps_control_missing"]
    assert len(missing_lines) == 1 and missing_lines[0]["program"] == str(missing)
    assert "time-sliced" in missing_lines[0]["consequence"]
