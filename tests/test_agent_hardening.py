"""Issue 11 end to end: the real `gemtrace agent` against what an adversary did to it: a second
agent, a full or read-only filesystem, garbage in the region, forged words, a renamed group, many
processes starting and exiting while the heartbeat is watched, and the stop."""

from __future__ import annotations

import errno
import mmap
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from agent_host import CONFIG, Host, gemtrace, stop
from simgpu_env import RT_CLIENT
from testkit import MiB, wait_until

from gemtrace import defaults
from gemtrace import region as rg

pytestmark = pytest.mark.e2e

GATE = Path(__file__).resolve().parents[1] / "build" / "libgemgate.so"


def agent_command(host: Host, state_dir: Path) -> list[str]:
    return gemtrace("agent", "--config", str(host.config), "--state-dir", str(state_dir), "--listen",
                    "127.0.0.1:0", "--no-ebpf")


def test_a_second_agent_on_the_same_state_dir_exits_naming_the_first(host: Host) -> None:
    agent = host.start_agent()
    try:
        out = subprocess.run(agent_command(host, host.state_dir), env=host.env(), capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 1
        assert out.stderr == (f"gemtrace: another gemtrace agent (pid {agent.proc.pid}) owns {host.state_dir}; "
                              "stop it first\n")
        assert agent.proc.poll() is None
    finally:
        stop(agent)


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs of 16 KiB (the region needs about 60 KiB); root only, as the agent is."""
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(mount)], check=True)
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_a_full_filesystem_and_a_read_only_one_each_give_one_line(host: Host, small_fs: Path) -> None:
    out = subprocess.run(agent_command(host, small_fs / "state"), env=host.env(), capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 1
    assert out.stderr == (f"gemtrace: {small_fs / 'state'}: no space left for the {rg.REGION_SIZE}-byte region; "
                          "free space on that filesystem (or point --state-dir elsewhere) and start the agent "
                          "again\n")
    assert not (small_fs / "state" / rg.REGION_FILE).exists()
    assert [p.name for p in (small_fs / "state").iterdir()] == ["agent.lock"]  # no temporary file left
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
    out = subprocess.run(agent_command(host, small_fs / "ro"), env=host.env(), capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 1
    assert out.stderr.count("\n") == 1 and "read-only filesystem" in out.stderr, out.stderr


def fill(directory: Path) -> None:
    """Write zeros into `directory` until its filesystem has not one byte left."""
    with (directory / "filler").open("wb", buffering=0) as f:
        for size in (1 << 16, 1 << 12, 1):
            try:
                while True:
                    f.write(bytes(size))
            except OSError as e:
                assert e.errno == errno.ENOSPC


def test_a_filesystem_full_to_the_last_byte_and_a_read_only_one_each_give_one_line_at_the_lock(
        host: Host, small_fs: Path) -> None:
    state = small_fs / "state"
    state.mkdir(mode=0o755)
    fill(small_fs)
    out = subprocess.run(agent_command(host, state), env=host.env(), capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stderr) == (1, f"gemtrace: {state / 'agent.lock'}: no space left on the state dir's "
                                               "filesystem; free space there (or point --state-dir elsewhere) and "
                                               "start the agent again\n")
    (small_fs / "filler").unlink()
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
    out = subprocess.run(agent_command(host, state), env=host.env(), capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stderr) == (1, f"gemtrace: {state / 'agent.lock'}: the state dir is on a read-only "
                                               "filesystem; the agent needs a writable --state-dir (the unit's "
                                               "RuntimeDirectory, /run/gemtrace)\n")


def test_garbage_past_the_header_is_replaced_with_a_log_event(host: Host) -> None:
    agent = host.start_agent()
    assert stop(agent) == 0
    fd = os.open(host.state_dir / rg.REGION_FILE, os.O_RDWR)
    raw = mmap.mmap(fd, rg.REGION_SIZE, mmap.MAP_SHARED)
    os.close(fd)
    start = rg.RegionLayout.groups.offset
    raw[start : start + rg.MAX_GROUPS * 128] = os.urandom(rg.MAX_GROUPS * 128)
    raw.close()
    agent = host.start_agent()
    try:
        assert '"event": "region_replaced"' in agent.log.read_text()
        r = host.region()
        assert sorted(r.group_names().values()) == ["default", "infer", "train"]
        r.close()
    finally:
        stop(agent)


def test_a_forged_release_lasts_one_look_and_a_forged_limit_a_second(host: Host) -> None:
    agent = host.start_agent()
    try:
        r = host.region()
        infer, train = r.group_index("infer"), r.group_index("train")
        assert infer is not None and train is not None
        wait_until("infer held (nobody wants the GPU)", lambda: r.is_held(0, infer), timeout=5)
        r.layout.control[0][infer].held = rg.RELEASED
        forged = time.monotonic()
        wait_until("the scheduler to hold infer again", lambda: r.is_held(0, infer), timeout=5)
        # Within a look: nobody wants the GPU, so the scheduler sleeps on its doorbell, looking at
        # least every ring_net_ns (250 ms).
        assert time.monotonic() - forged < 0.35
        r.layout.groups[train].memory_limit = rg.NO_LIMIT
        forged = time.monotonic()
        wait_until("the limit back", lambda: r.layout.groups[train].memory_limit == 1 << 30, timeout=5)
        assert time.monotonic() - forged < 1.2
        r.close()
    finally:
        stop(agent)


def test_a_renamed_groups_process_moves_to_default_and_is_scheduled(host: Host) -> None:
    agent = host.start_agent()
    worker = host.run("infer", "launch-loop", "--kernel-ns", "200000", "--seconds", "30")
    try:
        r = host.region()
        infer, default = r.group_index("infer"), r.group_index("default")
        assert infer is not None and default is not None
        # (A one-tuple: slot 0 is a slot, and wait_until waits for a true value.)
        (slot,) = wait_until("the worker's slot", lambda: next(
            ((i,) for i, g in r.slot_groups().items() if r.slots[i].pid == worker.pid), None))
        assert r.assigned_group(slot, worker.pid) == infer
        host.config.write_text(CONFIG.replace("[infer]", "[serve]"))
        wait_until("the move to default", lambda: r.assigned_group(slot, worker.pid) == default, timeout=5)
        wait_until("infer's entry to be freed", lambda: r.group_index("infer") is None, timeout=5)
        # Scheduled in default: with a train worker beside it the two take turns, so default's word is
        # held and released again and again (an unscheduled word would stay released), and it launches.
        rival = host.run("train", "launch-loop", "--kernel-ns", "200000", "--seconds", "30")
        grants = r.layout.control[0][default].grant_seq
        launches = r.slots[slot].launches[0]
        wait_until("turns for default", lambda: r.layout.control[0][default].grant_seq >= grants + 3, timeout=10)
        assert r.slots[slot].launches[0] > launches
        rival.kill()
        rival.wait()
        r.close()
    finally:
        worker.kill()
        worker.wait()
        stop(agent)


def test_the_heartbeat_stays_fresh_while_hundreds_of_processes_start_and_exit(host: Host) -> None:
    agent = host.start_agent()
    clients: list[subprocess.Popen[bytes]] = []
    worst = [0]
    done = threading.Event()
    r = host.region()

    def sample() -> None:
        while not done.is_set():
            beat = r.layout.header.heartbeat_ns
            if beat:
                worst[0] = max(worst[0], time.monotonic_ns() - beat)
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        env = host.env(LD_PRELOAD=str(GATE), GEMTRACE_STATE_DIR=str(host.state_dir))
        for i in range(300):
            env["GEMTRACE_GROUP"] = ("train", "infer", "default")[i % 3]
            clients.append(subprocess.Popen([str(RT_CLIENT), "alloc", "--api", "v2", str(MiB), "--hold", "60"],
                                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        wait_until("300 slots", lambda: sum(1 for p in r.slot_pids() if p) >= 300, timeout=120)
        for c in clients[::2]:
            c.send_signal(signal.SIGKILL)
        try:
            wait_until("150 reaped", lambda: sum(1 for p in r.slot_pids() if p) <= 150, timeout=30)
        except AssertionError as e:
            killed = {c.pid for c in clients[::2]}
            left = [(i, p) for i, p in enumerate(r.slot_pids()) if p in killed]
            raise AssertionError(f"{e}: {len(left)} killed still in slots, e.g. {left[:5]}; flags "
                                 f"{[r.slots[i].flags for i, _ in left[:5]]}\n"
                                 f"{agent.log.read_text()[-3000:]}") from None
    finally:
        done.set()
        sampler.join()
        for c in clients:
            c.kill()
            c.wait()
        stop(agent)
        r.close()
    # The keeper beats every KEEPER_IDLE_SECONDS when no gate joins (every 10 ms for a second after
    # one does): a starved keeper shows as whole tenths of a second more.
    bound = defaults.KEEPER_IDLE_SECONDS + 0.1
    assert worst[0] < bound * 1e9, f"heartbeat age reached {worst[0] / 1e6:.1f} ms (bound {bound * 1e3:.0f} ms)"


def test_a_stop_releases_the_gates_at_once_and_exits_within_2_s(host: Host) -> None:
    agent = host.start_agent()
    holder = host.run("train", "alloc", "--api", "v2", str(100 * MiB), "--hold", "60")
    try:
        assert b"CUDA_SUCCESS" in holder.stdout.readline()  # type: ignore[union-attr]
        t0 = time.monotonic()
        assert stop(agent) == 0
        assert time.monotonic() - t0 < 2
        stopped = [line for line in agent.log.read_text().splitlines() if '"agent_stopped"' in line]
        assert stopped and '"release": ' in stopped[0]
    finally:
        holder.kill()
        holder.wait()
