"""Oversubscription through the gate on the simulated GPU (docs/gate.md, "Oversubscription"): a group
whose resource file says Oversubscribe gets cuMemAlloc_v2 past its MemoryLimit (or past the GPU) as
managed memory, bounded by its Oversubscribe size and by what the host backs; every other group still
gets CUDA_ERROR_OUT_OF_MEMORY. The test stands in for the agent, as tests/test_gate.py does."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from agent_host import Host, gemtrace, stop
from test_gate import GATE, Agent, run
from testkit import GiB, MiB, wait_until

from gemtrace import region as rg
from gemtrace.contract import ENV_MANAGED_HINTS

pytestmark = pytest.mark.e2e



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


# --- the allocators that do not switch ---------------------------------------------------------------


@pytest.mark.parametrize("api", ["pitch", "async", "pool", "create"])
def test_only_cu_mem_alloc_switches_the_other_allocators_stop_at_the_limit(agent: Agent, api: str) -> None:
    """A pool's memory (cudaMallocAsync, CuPy's async pool), a handle to map (cuMemCreate: PyTorch's
    expandable segments) or a pitched allocation cannot be managed memory: past MemoryLimit they get
    CUDA_ERROR_OUT_OF_MEMORY, as in a group without Oversubscribe (docs/gate.md)."""
    agent.region.set_group("train", GiB, 0, 1, oversubscribe=4 * GiB)
    holder = agent.sim.start(["alloc", "--api", api, "--hold", "30", str(512 * MiB), str(512 * MiB), str(2 * MiB)],
                             **agent.env("train"))
    try:
        lines = [holder.next_json() for _ in range(3)]
        assert allocations(lines) == [("CUDA_SUCCESS", 0), ("CUDA_SUCCESS", 0), ("CUDA_ERROR_OUT_OF_MEMORY", None)]
        holder.wait_for("holding")
        assert held(agent, holder.pid) == (GiB, 0)
    finally:
        holder.kill()


# --- hints: advice when managed memory stands in for device memory, a prefetch after a hold ----------


@pytest.fixture
def agent2(simgpu_factory, tmp_path: Path) -> Iterator[Agent]:  # type: ignore[no-untyped-def]
    """Two GPUs: the gated programs see only the second (CUDA_VISIBLE_DEVICES=its UUID), so its CUDA
    ordinal 0 is the simulation's device 1 and the region's GPU 1."""
    if not GATE.exists():
        pytest.fail(f"{GATE} is missing: run `make gate`", pytrace=False)
    a = Agent(simgpu_factory(devices=2, memory="4GiB"), tmp_path / "state")
    a.region.set_managed_host_limit(8 * GiB)
    yield a
    a.close()


def hint_calls(log: Path) -> list[dict]:
    """What the simulated driver was asked (SIMGPU_HINT_LOG), in order."""
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def second_gpu_env(agent: Agent, log: Path, **extra: str) -> dict[str, str]:
    """The hints on (GEMTRACE_MANAGED_HINTS=1) unless `extra` says otherwise."""
    extra = {ENV_MANAGED_HINTS: "1", **extra}
    return agent.env("train", CUDA_VISIBLE_DEVICES=agent.uuids[1], SIMGPU_HINT_LOG=str(log), **extra)


def test_managed_memory_served_for_device_memory_is_advised_to_its_gpu(agent2: Agent, tmp_path: Path) -> None:
    agent2.region.set_group("train", GiB, 0, 1, oversubscribe=4 * GiB)
    log = tmp_path / "hints.log"
    lines, _ = run(["alloc", str(GiB), str(512 * MiB), str(256 * MiB)], second_gpu_env(agent2, log))
    assert allocations(lines) == [("CUDA_SUCCESS", 0), ("CUDA_SUCCESS", 1), ("CUDA_SUCCESS", 1)]
    managed = [(line["ptr"], line["size"]) for line in lines if line.get("managed")]
    # Each managed allocation, whole, gets the GPU as its preferred location and as a processor that
    # accesses it: CUDA ordinal 0, which is the simulation's device 1. The device memory gets nothing.
    assert [(c["call"], c["ptr"], c["size"], c["advice"], c["location"], c["device"], c["phys"], c["result"])
            for c in hint_calls(log)] == [
        ("cuMemAdvise", ptr, size, advice, "device", 0, 1, 0)
        for ptr, size in managed for advice in (3, 5)  # CU_MEM_ADVISE_SET_PREFERRED_LOCATION, _SET_ACCESSED_BY
    ]


def launch_held_then_released(agent: Agent, env: dict[str, str], sizes: list[int], free_first: int = 0) -> list[dict]:
    """A process of train allocates `sizes` (and frees the first `free_first` of them), then launches
    while train is held on GPU 1; released, its launches run. Returns its allocation lines."""
    group = agent.region.group_index("train")
    assert group is not None
    agent.region.hold(1, group)
    loop = agent.sim.start(["launch-loop", "--kernel-ns", "1000000", "--iters", "5", "--hold", "30",
                            "--free-first", str(free_first), *map(str, sizes)], **env)
    try:
        lines = [loop.next_json() for _ in sizes]
        if free_first:
            assert loop.wait_for("freed")["freed"] == free_first
        wait_until("the launch held", lambda: any(s.waiting[1] for s in agent.slots_of(loop.pid)))
        assert not [c for c in hint_calls(Path(env["SIMGPU_HINT_LOG"])) if c["call"] == "cuMemPrefetchAsync"]
        agent.region.release(1, group)
        assert loop.wait_for("iters")["iters"] == 5
        return lines
    finally:
        loop.kill()


def test_a_release_after_a_hold_prefetches_the_managed_memory_back_to_the_gpu(agent2: Agent, tmp_path: Path) -> None:
    agent2.region.set_group("train", GiB, 0, 1, oversubscribe=4 * GiB)
    log = tmp_path / "hints.log"
    # One prefetch moves at most 768 MiB: all of the first managed allocation, half of the second.
    env = second_gpu_env(agent2, log, GEMTRACE_MANAGED_PREFETCH_MAX="768MiB")
    lines = launch_held_then_released(agent2, env, [GiB, 512 * MiB, 512 * MiB])
    assert allocations(lines) == [("CUDA_SUCCESS", 0), ("CUDA_SUCCESS", 1), ("CUDA_SUCCESS", 1)]
    first, second = (line["ptr"] for line in lines if line["managed"])
    prefetches = [(c["ptr"], c["size"], c["location"], c["device"], c["phys"], c["stream"], c["result"])
                  for c in hint_calls(log) if c["call"] == "cuMemPrefetchAsync"]
    # Once for the release, on the stream of the launch that waited (the legacy one), to CUDA ordinal 0.
    assert prefetches == [(first, 512 * MiB, "device", 0, 1, "legacy", 0),
                          (second, 256 * MiB, "device", 0, 1, "legacy", 0)]


def test_managed_memory_freed_before_the_release_is_not_prefetched(agent2: Agent, tmp_path: Path) -> None:
    agent2.region.set_group("train", GiB, 0, 1, oversubscribe=4 * GiB)
    log = tmp_path / "hints.log"
    # The device allocation and the first managed one are freed while the group is held: the prefetch
    # names only the managed memory still allocated, oldest first, none of it cut (4 GiB by default).
    lines = launch_held_then_released(agent2, second_gpu_env(agent2, log), [GiB, 512 * MiB, 512 * MiB, 256 * MiB],
                                      free_first=2)
    assert allocations(lines) == [("CUDA_SUCCESS", 0), ("CUDA_SUCCESS", 1), ("CUDA_SUCCESS", 1), ("CUDA_SUCCESS", 1)]
    _, second, third = (line["ptr"] for line in lines if line["managed"])
    prefetches = [(c["ptr"], c["size"], c["result"]) for c in hint_calls(log) if c["call"] == "cuMemPrefetchAsync"]
    assert prefetches == [(second, 512 * MiB, 0), (third, 256 * MiB, 0)]


@pytest.mark.parametrize("setting", ["0", None])
def test_with_hints_off_the_gate_neither_advises_nor_prefetches(agent2: Agent, tmp_path: Path,
                                                                setting: str | None) -> None:
    """Off by default (bench/results/oversubscribe.md: two jobs that page each other did 2.4 times
    less with them), and with GEMTRACE_MANAGED_HINTS=0."""
    agent2.region.set_group("train", GiB, 0, 1, oversubscribe=4 * GiB)
    log = tmp_path / "hints.log"
    env = second_gpu_env(agent2, log)
    if setting is None:
        del env[ENV_MANAGED_HINTS]
    else:
        env[ENV_MANAGED_HINTS] = setting
    lines = launch_held_then_released(agent2, env, [GiB, 512 * MiB])
    assert allocations(lines) == [("CUDA_SUCCESS", 0), ("CUDA_SUCCESS", 1)]
    assert hint_calls(log) == []


# --- through the agent: the resource file, the host bound, /metrics ---------------------------------


def test_the_agent_applies_oversubscribe_and_its_metrics_show_managed_memory_apart(host: Host) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    host.config.write_text("[train]\nMemoryLimit = 1GiB\nOversubscribe = 3GiB\n")
    agent = host.start_agent("--managed-host-limit", "2GiB")
    try:
        region = host.region()
        train = region.group_index("train")
        assert train is not None
        assert region.layout.groups[train].oversubscribe_limit == 3 * GiB
        assert region.layout.header.managed_host_limit == 2 * GiB
        region.close()
        client = host.run("train", "alloc", "--hold", "30", str(GiB), str(1536 * MiB))
        lines = [json.loads(client.stdout.readline()) for _ in range(2)]  # type: ignore[union-attr]
        assert allocations(lines) == [("CUDA_SUCCESS", 0), ("CUDA_SUCCESS", 1)]

        def figures() -> dict[str, float]:
            out = {}
            for family in text_string_to_metric_families(agent.metrics()):
                for s in family.samples:
                    if s.labels.get("group") == "train" and s.name in (
                            "gemtrace_group_memory_bytes", "gemtrace_group_managed_memory_bytes"):
                        out[s.name] = s.value
            return out

        wait_until("train's managed memory in /metrics",
                   lambda: figures() == {"gemtrace_group_memory_bytes": GiB,
                                         "gemtrace_group_managed_memory_bytes": 1536 * MiB})
        client.kill()
        client.wait()
    finally:
        stop(agent)


def test_the_agent_refuses_a_host_bound_above_the_hosts_memory(host: Host) -> None:
    proc = subprocess.run(gemtrace("agent", "--managed-host-limit", "1000TiB", "--no-ebpf"), env=host.env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "more than this host's memory" in proc.stderr and "give less" in proc.stderr
