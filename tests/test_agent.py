"""The agent and the `gemtrace` command end to end on the simulated GPU: the real `gemtrace agent`
process, real gated clients started with `gemtrace run`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from agent_host import CONFIG, Host, gemtrace, stop
from simgpu_env import REPO, RT_CLIENT
from testkit import MiB, wait_until

from gemtrace import region as rg

pytestmark = pytest.mark.e2e


def test_sigterm_stops_cleanly_and_releases_every_word(host: Host) -> None:
    agent = host.start_agent()
    r = host.region()
    group = r.group_index("train")
    assert group is not None
    assert r.layout.header.heartbeat_ns > 0 and r.layout.header.agent_pid == agent.proc.pid
    assert stop(agent) == 0
    assert r.layout.header.heartbeat_ns == 0 and r.layout.header.agent_pid == 0
    assert not any(r.layout.control[0][g].held for g in range(rg.MAX_GROUPS))
    assert '"event": "agent_stopped"' in agent.log.read_text()
    r.close()


def logged(log: Path, event: str) -> Callable[[], bool]:
    return lambda: f'"event": "{event}"' in log.read_text()


def test_sigterm_amid_a_storm_of_sighups_stops_the_agent(host: Host) -> None:
    """Signals are taken by the main loop, not acted on inside a handler: a SIGTERM landing while the
    main thread held its stop event's lock deadlocked the stop (gemtrace/signals.py)."""
    for _ in range(3):
        agent = host.start_agent("--config-poll", "3600")
        for _ in range(300):
            agent.proc.send_signal(signal.SIGHUP)
        wait_until("a reload on SIGHUP", logged(agent.log, "config_reloaded"))
        for _ in range(300):
            agent.proc.send_signal(signal.SIGHUP)
        assert stop(agent) == 0
        text = agent.log.read_text()
        assert '"signal": "SIGTERM"' in text and '"event": "agent_stopped"' in text


def test_a_reload_reaches_running_gates_and_a_bad_file_keeps_the_last_good(host: Host) -> None:
    agent = host.start_agent()
    try:
        holder = host.run("train", "alloc", "--api", "v2", str(600 * MiB), "--hold", "60")
        assert b"CUDA_SUCCESS" in holder.stdout.readline()  # type: ignore[union-attr]
        probe = host.run("train", "alloc", "--api", "v2", str(600 * MiB))
        assert b"CUDA_ERROR_OUT_OF_MEMORY" in probe.communicate(timeout=30)[0]
        host.config.write_text(CONFIG.replace("MemoryLimit = 1GiB", "MemoryLimit = 2GiB"))
        wait_until("the reload", lambda: 'gemtrace_config_reloads_total{result="success"} 2.0' in agent.metrics())
        probe = host.run("train", "alloc", "--api", "v2", str(600 * MiB))
        assert b"CUDA_SUCCESS" in probe.communicate(timeout=30)[0]  # the running gate sees the new limit

        host.config.write_text(CONFIG + "[broken]\nMaxUtil = 2\n")
        wait_until(
            "the failed reload", lambda: 'gemtrace_config_reloads_total{result="failure"} 1.0' in agent.metrics()
        )
        text = agent.metrics()
        assert "gemtrace_config_last_reload_success 0.0" in text
        assert ('gemtrace_group_memory_limit_bytes{container="",group="train",namespace="",pod=""} 2.147483648e+09'
                in text)
        assert "config_reload_failed" in agent.log.read_text() and "MaxUtil 2 is above 1" in agent.log.read_text()
        holder.kill()
        holder.wait()
    finally:
        stop(agent)


def test_a_killed_process_slot_is_freed_within_100_ms(host: Host) -> None:
    agent = host.start_agent()
    try:
        holder = host.run("train", "alloc", "--api", "v2", str(100 * MiB), "--hold", "60")
        assert b"CUDA_SUCCESS" in holder.stdout.readline()  # type: ignore[union-attr]
        r = host.region()
        assert holder.pid in r.slot_pids()
        os.kill(holder.pid, signal.SIGKILL)  # not reaped yet: a zombie, as a parent that is slow to wait leaves it
        killed = time.monotonic()
        wait_until("the slot to be freed", lambda: holder.pid not in r.slot_pids(), timeout=5)
        assert time.monotonic() - killed < 0.1
        holder.wait()
        r.close()
    finally:
        stop(agent)


def test_an_agent_restart_adopts_the_region_and_running_programs_keep_going(host: Host) -> None:
    agent = host.start_agent()
    holder = host.run("train", "alloc", "--api", "v2", str(700 * MiB), "--hold", "60")
    try:
        assert b"CUDA_SUCCESS" in holder.stdout.readline()  # type: ignore[union-attr]
        r = host.region()
        index = r.group_index("train")
        assert stop(agent) == 0
        agent = host.start_agent()
        assert r.group_index("train") == index
        assert holder.poll() is None and holder.pid in r.slot_pids()
        # The adopted slot still counts against the limit.
        probe = host.run("train", "alloc", "--api", "v2", str(700 * MiB))
        assert b"CUDA_ERROR_OUT_OF_MEMORY" in probe.communicate(timeout=30)[0]
        r.close()
    finally:
        holder.kill()
        holder.wait()
        stop(agent)


def _bells_inode(pid: int, where: str) -> int | None:
    """The inode of the doorbells memfd that process `pid` maps (where="map_files") or holds open
    (where="fd"), or None."""
    try:
        entries = list(Path(f"/proc/{pid}/{where}").iterdir())
    except OSError:
        return None
    for entry in entries:
        try:
            if "memfd:gemtrace-bells" in os.readlink(entry):
                return os.stat(entry).st_ino
        except OSError:
            continue
    return None


def test_after_an_agent_restart_running_gates_ring_the_new_agents_doorbells(host: Host) -> None:
    """The doorbells are the agent's memfd: a restarted agent makes new ones, and gates that keep
    running map them at their next hold (the restart bumps chunk_generation)."""
    agent = host.start_agent()
    loops = [host.run(group, "launch-loop", "--kernel-ns", "500000", "--seconds", "60") for group in ("train", "infer")]
    try:
        first = _bells_inode(agent.proc.pid, "fd")
        assert first is not None
        wait_until("both gates map the agent's doorbells",
                   lambda: all(_bells_inode(loop.pid, "map_files") == first for loop in loops), timeout=10)
        assert stop(agent) == 0
        agent = host.start_agent()
        second = _bells_inode(agent.proc.pid, "fd")
        assert second is not None and second != first
        # The two groups take turns on the GPU: each loop is held, and its hold maps the new page.
        wait_until("both gates map the restarted agent's doorbells",
                   lambda: all(_bells_inode(loop.pid, "map_files") == second for loop in loops), timeout=10)
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()
        stop(agent)


def test_run_sets_the_environment_keeps_ld_preload_and_exits_with_the_command_status(host: Host) -> None:
    env = host.env(LD_PRELOAD="libfoo.so")
    out = subprocess.run(
        gemtrace(
            "run",
            "--group",
            "infer",
            "--config",
            str(host.config),
            "--state-dir",
            "/tmp/somewhere",
            "--",
            "sh",
            "-c",
            'echo "$LD_PRELOAD|$GEMTRACE_GROUP|$GEMTRACE_STATE_DIR"; exit 7',
        ),
        env=env,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 7
    assert out.stdout.strip() == f"{REPO / 'build' / 'libgemgate.so'} libfoo.so|infer|/tmp/somewhere"


def test_run_refuses_a_group_the_file_does_not_define(host: Host) -> None:
    out = subprocess.run(
        gemtrace("run", "--group", "nosuch", "--config", str(host.config), "--", "true"),
        env=host.env(),
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2
    assert "group 'nosuch' is not defined" in out.stderr and "default, infer, train" in out.stderr


def test_run_exits_as_a_shell_does_when_the_command_cannot_run(host: Host, tmp_path: Path) -> None:
    not_executable = tmp_path / "script"
    not_executable.write_text("#!/bin/sh\n")
    for command, status, said in ((str(tmp_path / "missing"), 127, "command not found"),
                                  (str(not_executable), 126, "permission denied")):
        out = subprocess.run(gemtrace("run", "--group", "train", "--config", str(host.config), "--", command),
                             env=host.env(), capture_output=True, text=True)
        assert out.returncode == status and f"{command}: {said}" in out.stderr, out.stderr


def test_check_config_and_status(host: Host) -> None:
    out = subprocess.run(gemtrace("check-config", str(host.config)), env=host.env(), capture_output=True, text=True)
    assert out.returncode == 0 and "train" in out.stdout and "1073741824 B" in out.stdout
    bad = host.tmp / "bad.conf"
    bad.write_text("[a]\nMinUtil = 2\n")
    out = subprocess.run(gemtrace("check-config", str(bad)), env=host.env(), capture_output=True, text=True)
    assert out.returncode == 1 and f"{bad}:2: MinUtil 2 is above 1" in out.stderr

    agent = host.start_agent()
    try:
        listen = agent.url.split("/")[2]
        out = subprocess.run(gemtrace("status", "--listen", listen), env=host.env(), capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        assert "train" in out.stdout and "infer" in out.stdout
    finally:
        stop(agent)
    out = subprocess.run(gemtrace("status", "--listen", listen), env=host.env(), capture_output=True, text=True)
    assert out.returncode == 1 and "gemtrace status:" in out.stderr


def test_a_gpus_uuid_no_gpu_has_is_warned_of_by_check_config_and_the_agents_log(host: Host) -> None:
    agent = host.start_agent()
    try:
        # (/metrics answers before the agent logs agent_started: wait for the line, not a read.)
        (started,) = wait_until("the agent's start line", lambda: [
            json.loads(line) for line in agent.log.read_text().splitlines() if '"agent_started"' in line])
        here = started["gpus"][0]
        host.config.write_text(CONFIG + f"\n[pinned]\nGpus = {here};GPU-not-here\n")
        warned = wait_until("the agent's warning", lambda: [json.loads(line) for line in agent.log.read_text()
                                                           .splitlines() if '"config_gpu_unknown"' in line])
    finally:
        stop(agent)
    warning = ("group [pinned]: Gpus names GPU-not-here, which no GPU of this host has, so nothing is reserved for "
               "it there; correct the UUID if it is meant for this host (nvidia-smi -L lists its GPUs)")
    assert [(w["level"], w["warning"]) for w in warned] == [("warning", warning)]
    out = subprocess.run(gemtrace("check-config", str(host.config)), env=host.env(), capture_output=True, text=True)
    assert (out.returncode, out.stderr) == (0, f"gemtrace: warning: {host.config}: {warning}\n")
    table = out.stdout.splitlines()[1:]
    column = table[0].index("Gpus")
    assert [line[column:].split()[0] for line in table] == ["Gpus", "all", "all", f"{here};GPU-not-here", "all"]


def test_run_without_a_config_checks_the_running_agents_groups(host: Host) -> None:
    agent = host.start_agent()
    try:
        base = ["run", "--state-dir", str(host.state_dir)]
        out = subprocess.run(
            gemtrace(*base, "--group", "train", "--", str(RT_CLIENT), "meminfo"),
            env=host.env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        assert '"total":1073741824' in out.stdout  # gated, in train, whose limit is 1 GiB
        out = subprocess.run(
            gemtrace(*base, "--group", "nosuch", "--", "true"), env=host.env(), capture_output=True, text=True
        )
        assert out.returncode == 2 and "running agent's resource file" in out.stderr
    finally:
        stop(agent)
