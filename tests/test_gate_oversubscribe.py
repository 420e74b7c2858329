"""Oversubscription through the gate on the simulated GPU (docs/gate.md, "Oversubscription"): a group
whose resource file says Oversubscribe gets cuMemAlloc_v2 past its MemoryLimit (or past the GPU) as
managed memory, bounded by its Oversubscribe size and by what the host backs; every other group still
gets CUDA_ERROR_OUT_OF_MEMORY. The test stands in for the agent, as tests/test_gate.py does."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from simgpu_env import SimGpu
from test_gate import GATE, Agent, run

from gemtrace import region as rg

pytestmark = pytest.mark.e2e

MiB = 1 << 20
GiB = 1 << 30


@pytest.fixture
def agent(simgpu_factory, tmp_path: Path) -> Iterator[Agent]:  # type: ignore[no-untyped-def]
    if not GATE.exists():
        pytest.fail(f"{GATE} is missing: run `make gate`", pytrace=False)
    a = Agent(simgpu_factory(memory="4GiB"), tmp_path / "state")
    a.region.set_managed_host_limit(8 * GiB)
    yield a
    a.close()


def allocations(lines: list[dict]) -> list[tuple[str, int | None]]:
    return [(line["name"], line.get("managed")) for line in lines if "size" in line]


def held(agent: Agent, pid: int) -> tuple[int, int]:
    """(device, managed) bytes that the gate counts for pid on GPU 0."""
    (slot,) = agent.slots_of(pid)
    return slot.memory[0], slot.managed[0]


def test_past_its_limit_an_oversubscribing_group_gets_managed_memory_and_frees_it(agent: Agent) -> None:
    agent.region.set_group("train", GiB, 0, 1, oversubscribe=3 * GiB)
    sizes = [str(512 * MiB), str(512 * MiB), str(GiB), str(GiB)]
    holder = agent.sim.start(["alloc", "--hold", "3", "--free", "--hold-after", "30", *sizes], **agent.env("train"))
    try:
        lines = [holder.next_json() for _ in range(4)]
        assert allocations(lines) == [("CUDA_SUCCESS", 0), ("CUDA_SUCCESS", 0), ("CUDA_SUCCESS", 1),
                                      ("CUDA_SUCCESS", 1)]
        holder.wait_for("holding")
        assert held(agent, holder.pid) == (GiB, 2 * GiB)
        # cuMemGetInfo keeps reporting the limit: the device share is used up.
        lines, _ = run(["meminfo"], agent.env("train"))
        assert lines[-1] == {"free": 0, "total": GiB}
        # cuMemFree_v2 frees managed and device pointers alike (the client exits 1 if one fails) ...
        assert holder.wait_for("freed")["freed"] == 4
        assert held(agent, holder.pid) == (0, 0)
    finally:
        holder.kill()
    # ... so the group has all of it again, served the same way; the switch is told once.
    lines, stderr = run(["alloc", "--free", *sizes], agent.env("train"))
    assert [m for _, m in allocations(lines)] == [0, 0, 1, 1]
    assert stderr.count("allocations beyond it are managed memory") == 1, stderr


def test_a_group_without_oversubscription_still_runs_out_of_memory(agent: Agent) -> None:
    agent.region.set_group("train", GiB, 0, 1, oversubscribe=3 * GiB)
    agent.region.set_group("strict", GiB, 0, 1)
    lines, stderr = run(["alloc", str(512 * MiB), str(512 * MiB), str(MiB)], agent.env("strict"))
    assert allocations(lines) == [("CUDA_SUCCESS", 0), ("CUDA_SUCCESS", 0), ("CUDA_ERROR_OUT_OF_MEMORY", None)]
    assert "managed" not in stderr


def test_the_oversubscribe_size_bounds_device_and_managed_memory_together(agent: Agent) -> None:
    agent.region.set_group("train", GiB, 0, 1, oversubscribe=3 * GiB)
    first = agent.sim.start(["alloc", "--hold", "30", str(GiB), str(GiB)], **agent.env("train"))
    try:
        assert allocations([first.next_json(), first.next_json()]) == [("CUDA_SUCCESS", 0), ("CUDA_SUCCESS", 1)]
        first.wait_for("holding")
        # Another process of the group: 1 GiB more fits (managed), then the 3 GiB are taken.
        lines, stderr = run(["alloc", str(GiB), str(MiB)], agent.env("train"))
        assert allocations(lines) == [("CUDA_SUCCESS", 1), ("CUDA_ERROR_OUT_OF_MEMORY", None)]
        assert "more than its Oversubscribe size" in stderr
        # That process has exited: 1 GiB is left, and the program's own cuMemAllocManaged is bounded alike.
        lines, _ = run(["alloc", "--api", "managed", str(GiB + MiB), str(GiB)], agent.env("train"))
        assert allocations(lines) == [("CUDA_ERROR_OUT_OF_MEMORY", None), ("CUDA_SUCCESS", 1)]
    finally:
        first.kill()


def test_managed_memory_stops_at_what_the_host_backs(agent: Agent) -> None:
    agent.region.set_managed_host_limit(GiB)
    agent.region.set_group("a", 512 * MiB, 0, 1, oversubscribe=rg.NO_LIMIT)
    agent.region.set_group("b", 512 * MiB, 0, 1, oversubscribe=rg.NO_LIMIT)
    holder = agent.sim.start(["alloc", "--hold", "30", str(512 * MiB), str(768 * MiB)], **agent.env("a"))
    try:
        assert allocations([holder.next_json(), holder.next_json()]) == [("CUDA_SUCCESS", 0), ("CUDA_SUCCESS", 1)]
        holder.wait_for("holding")
        # The host bound is for all groups together: b has 256 MiB of it left.
        lines, stderr = run(["alloc", str(512 * MiB), str(512 * MiB), str(256 * MiB)], agent.env("b"))
        assert allocations(lines) == [("CUDA_SUCCESS", 0), ("CUDA_ERROR_OUT_OF_MEMORY", None), ("CUDA_SUCCESS", 1)]
        assert "what this host backs" in stderr and "--managed-host-limit" in stderr
    finally:
        holder.kill()


def test_an_agent_that_set_no_host_bound_allows_no_managed_memory(agent: Agent) -> None:
    agent.region.set_managed_host_limit(0)
    agent.region.set_group("train", GiB, 0, 1, oversubscribe=rg.NO_LIMIT)
    lines, _ = run(["alloc", str(GiB), str(MiB)], agent.env("train"))
    assert allocations(lines) == [("CUDA_SUCCESS", 0), ("CUDA_ERROR_OUT_OF_MEMORY", None)]


def test_without_a_limit_the_gpu_running_out_turns_allocations_managed(agent: Agent) -> None:
    """Oversubscribe with no MemoryLimit (or one above the GPU): the driver's own out-of-memory is the
    device share's end."""
    agent.region.set_group("big", None, 0, 1, oversubscribe=rg.NO_LIMIT)
    lines, _ = run(["alloc", str(3 * GiB), str(2 * GiB)], agent.env("big"))
    assert allocations(lines) == [("CUDA_SUCCESS", 0), ("CUDA_SUCCESS", 1)]


def test_device_memory_regrown_after_managed_cannot_pass_the_total(agent: Agent) -> None:
    agent.region.set_group("train", GiB, 0, 1, oversubscribe=2 * GiB)
    managed = agent.sim.start(["alloc", "--api", "managed", "--hold", "30", str(1536 * MiB)], **agent.env("train"))
    try:
        assert allocations([managed.next_json()]) == [("CUDA_SUCCESS", 1)]
        managed.wait_for("holding")
        # MemoryLimit alone would allow 1 GiB of device memory; the total leaves 512 MiB.
        lines, _ = run(["alloc", "--api", "async", str(512 * MiB), str(MiB)], agent.env("train"))
        assert allocations(lines) == [("CUDA_SUCCESS", 0), ("CUDA_ERROR_OUT_OF_MEMORY", None)]
    finally:
        managed.kill()
