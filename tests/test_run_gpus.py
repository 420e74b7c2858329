"""`gemtrace run --gpus N` end to end on the simulated GPU (DGX-1 topology, 8 GPUs): the UUIDs it
sets, the warning without an agent, CUDA_VISIBLE_DEVICES already set, the claims of a running
agent's groups; and allotment.group_uses over a real region file."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from agent_host import Host, gemtrace, stop
from testkit import GiB, wait_until

from gemtrace import region as rg
from gemtrace.run.allotment import group_uses
from gemtrace.run.placement import GroupUse


def uuids(host: Host) -> list[str]:
    return [line["uuid"] for line in host.sim.nvml(
        "for i in range(pynvml.nvmlDeviceGetCount()):\n"
        "    emit({'uuid': pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))})\n",
        SIMGPU_TOPOLOGY="dgx1")]  # the first process makes the simulation: a DGX-1


@pytest.fixture
def dgx1(host: Host) -> tuple[Host, list[str]]:
    host.sim.devices = 8
    return host, uuids(host)


def run_env(host: Host, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        gemtrace("run", "--group", "train", "--config", str(host.config), "--state-dir", str(host.state_dir),
                 *args, "--", "env"),
        env=host.env(**extra), capture_output=True, text=True, timeout=60,
    )


def environment(out: subprocess.CompletedProcess[str]) -> dict[str, str]:
    assert out.returncode == 0, out.stderr
    return dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)


@pytest.mark.e2e
def test_best_effort_sets_the_uuids_of_the_best_pair_and_warns_without_an_agent(dgx1: tuple[Host, list[str]]) -> None:
    host, uuid = dgx1
    out = run_env(host, "--gpus", "2", "--policy", "best-effort")
    env = environment(out)
    assert env["CUDA_VISIBLE_DEVICES"] == f"{uuid[0]},{uuid[3]}"  # 2 NVLinks (docs/placement.md)
    assert out.stderr.count("warning") == 1, out.stderr  # one line for the missing agent and what it means here
    assert "agent is not running" in out.stderr and "every GPU counts as free for --gpus" in out.stderr
    # train's 1 GiB limit on 16 GiB GPUs: the frameworks' share (docs/frameworks.md).
    assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "1.0"  # all of the limit to a JAX process alone in train
    assert env["GEMTRACE_GPU_MEMORY_LIMIT"] == str(GiB)
    assert env["GEMTRACE_GPU_MEMORY_TOTAL"] == str(16 * GiB)
    assert environment(run_env(host, "--gpus", "2", "--policy", "simple"))["CUDA_VISIBLE_DEVICES"] == \
        f"{uuid[0]},{uuid[1]}"


@pytest.mark.e2e
def test_a_jax_memory_variable_the_user_set_keeps_jax_as_they_chose(dgx1: tuple[Host, list[str]]) -> None:
    host, _ = dgx1
    env = environment(run_env(host, "--gpus", "1", XLA_PYTHON_CLIENT_MEM_FRACTION="0.5"))
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.5"
    assert "XLA_PYTHON_CLIENT_PREALLOCATE" not in env
    assert env["TF_FORCE_GPU_ALLOW_GROWTH"] == "true"


@pytest.mark.e2e
def test_gpus_are_chosen_among_those_cuda_visible_devices_allows(dgx1: tuple[Host, list[str]]) -> None:
    host, uuid = dgx1
    out = run_env(host, "--gpus", "2", CUDA_VISIBLE_DEVICES=f"1,2,{uuid[5][:12]},6")
    assert environment(out)["CUDA_VISIBLE_DEVICES"] == f"{uuid[1]},{uuid[2]}"  # 1-2: 2 NVLinks, 5-6 too
    out = run_env(host, "--gpus", "3", CUDA_VISIBLE_DEVICES="1,2")
    assert out.returncode == 2
    assert "--gpus 3: CUDA_VISIBLE_DEVICES=1,2 allows only 2 GPUs; ask for fewer" in out.stderr


@pytest.mark.e2e
def test_a_running_agents_groups_claim_their_gpus(dgx1: tuple[Host, list[str]]) -> None:
    host, uuid = dgx1
    agent = host.start_agent()
    try:
        # infer has no MemoryLimit: where its process runs it claims the whole GPU.
        holder = host.run("infer", "alloc", "--device", "0", "--hold", "60", "1MiB")
        try:
            assert holder.stdout is not None
            wait_until("infer's process holding GPU 0", lambda: b"holding" in holder.stdout.readline())
            out = run_env(host, "--gpus", "2")
            assert "warning" not in out.stderr
            assert environment(out)["CUDA_VISIBLE_DEVICES"] == f"{uuid[2]},{uuid[3]}"  # docs/placement.md
            refused = run_env(host, "--gpus", "8")
            assert refused.returncode == 1
            assert "of the 8 GPUs this host has, only 7 have room for group 'train'" in refused.stderr
        finally:
            holder.kill()
            holder.wait()
    finally:
        assert stop(agent) == 0


@pytest.mark.unit
def test_group_uses_reads_limits_and_live_slots_by_uuid(tmp_path: Path) -> None:
    region = rg.Region.create(tmp_path)
    try:
        region.set_gpus([("GPU-b", 16 * GiB), ("GPU-a", 16 * GiB)])
        train = region.set_group("train", GiB, 0.0, 1.0)
        region.set_group("infer", None, 0.0, 1.0)
        slot = region.slots[3]
        slot.pid, slot.gpu_mask = 4242, 0b01
        region.assign(3, 4242, train)
        slot.memory[0], slot.memory[1] = 100, 7  # on GPU-a without a context: held, not present
        uses = group_uses(region.layout, region.slots_layout, {"GPU-a": 0, "GPU-b": 1})  # the topology's order differs
    finally:
        region.close()
    assert uses == [
        GroupUse("train", GiB, present=frozenset({1}), memory={1: 100, 0: 7}),
        GroupUse("infer", None),
    ]
