"""The simulated GPU, run for real: its clients against build/simgpu's libcuda and libnvidia-ml.

Everything else in gemtrace is tested on this simulation, so these tests pin down what it promises:
one timeline per device shared by all processes, memory capacity shared and accounted per process,
NVML's view of the same state, cuGetProcAddress answering by version, CUDA_VISIBLE_DEVICES.
Timing assertions leave wide margins: CI is a loaded 2-core machine.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from simgpu_env import DRIVER_CLIENT, LIBCUDA, LINKED_CLIENT, RT_CLIENT, SimGpu
from testkit import GiB, wait_until

pytestmark = pytest.mark.unit

CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_NOT_INITIALIZED = 3
CUDA_ERROR_INVALID_DEVICE = 101
CUDA_ERROR_INVALID_CONTEXT = 201
CUDA_ERROR_NOT_FOUND = 500


def nvml_processes(sim: SimGpu, index: int = 0) -> dict[int, int]:
    """pid -> used bytes on physical device `index`, as pynvml reports it."""
    lines = sim.nvml(
        f"h = pynvml.nvmlDeviceGetHandleByIndex({index})\n"
        "emit({str(p.pid): p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)})\n"
    )
    return {int(pid): used for pid, used in lines[0].items()}


def meminfo(sim: SimGpu) -> dict[str, int]:
    return sim.run(["meminfo"])[0]


def zombie(pid: int) -> bool:
    """Whether `pid` has exited and waits for its parent to collect it (/proc/PID/stat's state)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2] == "Z"


# ---- the timeline ---------------------------------------------------------------------------


def test_kernels_take_their_time_and_events_measure_it(simgpu: SimGpu) -> None:
    # All 40 kernels are queued at once, so they run back to back: events see the kernel time.
    args = ["launch-loop", "--kernel-ns", "5000000", "--launches-per-iter", "40", "--iters", "1"]
    result = simgpu.run(args)[-1]
    assert result["launches"] == 40
    assert result["kernel_s"] == pytest.approx(0.2)
    assert result["event_s"] >= 0.2 - 1e-5  # never faster than the kernels' own time
    assert result["event_s"] < 0.25  # the launches take microseconds, unless the host stalls
    assert result["elapsed_s"] >= 0.2


@pytest.mark.parametrize("api", ["launch", "ex", "coop", "extra", "graph"])
@pytest.mark.parametrize("ptsz", [False, True])
def test_every_launch_api_runs_kernels(simgpu: SimGpu, api: str, ptsz: bool) -> None:
    args = ["--ptsz"] if ptsz else []
    args += ["launch-loop", "--api", api, "--kernel-ns", "2000000"]
    args += ["--launches-per-iter", "5", "--iters", "4"]
    result = simgpu.run(args)[-1]
    assert result["launches"] == 20
    assert result["event_s"] >= 0.04 - 1e-5
    assert result["elapsed_s"] >= 0.04


@pytest.mark.parametrize("sync", ["stream", "ctx", "event", "memcpy"])
@pytest.mark.parametrize("ptsz", [[], ["--ptsz"]])
def test_synchronising_calls_wait_for_the_kernels(simgpu: SimGpu, sync: str, ptsz: list[str]) -> None:
    args = [*ptsz, "launch-loop", "--kernel-ns", "2000000", "--iters", "20", "--sync", sync]
    result = simgpu.run(args)[-1]
    # Each iteration waited for its kernel, so the loop itself took the kernels' time (a call that
    # did not wait would leave launch_s at microseconds; see test_a_full_queue_makes_launches_wait).
    assert result["launch_s"] >= result["kernel_s"] == pytest.approx(0.04)


@pytest.mark.parametrize("stream", [[], ["--stream"], ["--ptsz"]])
def test_threads_and_streams_of_one_process_share_the_device(simgpu: SimGpu, stream: list[str]) -> None:
    args = ["launch-loop", "--threads", "4", "--kernel-ns", "2000000", "--iters", "25", *stream]
    result = simgpu.run(args)[-1]
    assert result["launches"] == 100
    assert result["elapsed_s"] >= result["kernel_s"] == pytest.approx(0.2)


def test_two_processes_share_one_device_timeline(simgpu: SimGpu) -> None:
    loop = ["launch-loop", "--kernel-ns", "2000000", "--launches-per-iter", "5", "--iters", "50"]
    start = time.monotonic()
    a, b = simgpu.start(loop), simgpu.start(loop)
    ra, rb = a.finish()[-1], b.finish()[-1]
    wall = time.monotonic() - start
    # 0.5 s of kernels each. Serialised, the pair needs at least 1 s; overlapping they would
    # need 0.5 s. Each one also waits for the other's kernels, so each takes much more than 0.5 s.
    assert wall >= 0.98 * (ra["kernel_s"] + rb["kernel_s"])
    assert ra["elapsed_s"] > 1.5 * ra["kernel_s"]
    assert rb["elapsed_s"] > 1.5 * rb["kernel_s"]


def test_devices_have_separate_timelines(simgpu_factory: Callable[..., SimGpu]) -> None:
    sim = simgpu_factory(devices=2)
    # Each queues 0.5 s of kernels at once. On one shared timeline the later one would measure
    # about 1 s between its events; on separate devices both measure 0.5 s.
    loop = ["launch-loop", "--kernel-ns", "5000000", "--launches-per-iter", "100", "--iters", "1"]
    a = sim.start([*loop, "--device", "0"])
    b = sim.start([*loop, "--device", "1"])
    ra, rb = a.finish()[-1], b.finish()[-1]
    assert 0.5 - 1e-5 <= ra["event_s"] < 0.75
    assert 0.5 - 1e-5 <= rb["event_s"] < 0.75


def test_a_full_queue_makes_launches_wait(simgpu: SimGpu) -> None:
    loop = ["launch-loop", "--kernel-ns", "10000000", "--iters", "20", "--no-sync"]
    free = simgpu.run(loop)[-1]
    assert free["launch_s"] < 0.1  # 20 launches return at once: the default queue holds 1024
    full = simgpu.run(loop, SIMGPU_QUEUE_DEPTH="4")[-1]
    # With room for 4 kernels, the 20th launch waits until the 16th kernel has ended (160 ms).
    assert full["launch_s"] >= 0.15
    assert full["event_s"] >= 0.2 - 1e-5


def test_cpu_per_launch_leaves_the_gpu_idle_between_kernels(simgpu: SimGpu) -> None:
    # Launch-bound: 30 us of CPU before each 20 us kernel, so each kernel ends before the next launch.
    args = ["launch-loop", "--kernel-ns", "20000", "--cpu-ns", "30000", "--launches-per-iter", "12", "--iters", "200"]
    result = simgpu.run(args)[-1]
    assert result["launches"] == 2400
    assert result["launch_s"] >= 2400 * 30e-6  # the CPU work is spun, never cut short
    # The kernels fill at most 20 of every 30 us of the loop (less: each sync's wake-up adds a gap).
    assert result["kernel_s"] / result["event_s"] <= 20 / 30 + 0.01


def test_launch_is_cheap(simgpu: SimGpu) -> None:
    result = simgpu.run(["empty-launch-loop", "--launches", "200000"])[-1]
    assert result["ns_per_launch"] < 2000  # about 45 ns unloaded; the gate's benchmark measures it


def test_nvml_utilisation_follows_the_timeline(simgpu: SimGpu) -> None:
    code = (
        "import time\n"
        "h = pynvml.nvmlDeviceGetHandleByIndex(0)\n"
        "pynvml.nvmlDeviceGetUtilizationRates(h)\n"
        "time.sleep(1.0)\n"
        "emit({'gpu': pynvml.nvmlDeviceGetUtilizationRates(h).gpu})\n"
    )
    assert simgpu.nvml(code)[0]["gpu"] == 0
    busy = simgpu.start(["launch-loop", "--kernel-ns", "50000000", "--seconds", "4", "--progress"])
    busy.wait_for("progress")
    assert simgpu.nvml(code)[0]["gpu"] >= 70
    busy.kill()


# ---- memory ---------------------------------------------------------------------------------


@pytest.mark.parametrize("api", ["v2", "pitch", "async", "pool", "create"])
def test_every_allocation_api_counts_exactly(simgpu_factory: Callable[..., SimGpu], api: str) -> None:
    sim = simgpu_factory(memory="4GiB")
    holder = sim.start(["alloc", "--api", api, "--hold", "30", "--free", "1GiB", "2GiB", "2GiB"])
    results = [holder.next_json() for _ in range(3)]
    assert [r["name"] for r in results] == ["CUDA_SUCCESS", "CUDA_SUCCESS", "CUDA_ERROR_OUT_OF_MEMORY"]
    assert results[2]["result"] == CUDA_ERROR_OUT_OF_MEMORY
    holder.wait_for("holding")
    assert meminfo(sim) == {"free": 1 * GiB, "total": 4 * GiB}
    assert nvml_processes(sim)[holder.pid] == 3 * GiB
    holder.kill()


def test_managed_memory_is_the_hosts_not_the_devices(simgpu_factory: Callable[..., SimGpu]) -> None:
    """cuMemAllocManaged takes from SIMGPU_HOST_MEMORY, not from the device: more than the device has
    fits, NVML and cuMemGetInfo leave it out, the driver says the pointer is managed, and past the
    host's memory it is refused."""
    sim = simgpu_factory(memory="4GiB")
    host = {"SIMGPU_HOST_MEMORY": "6GiB"}
    holder = sim.start(["alloc", "--api", "managed", "--hold", "30", "3GiB", "2GiB", "2GiB"], **host)
    results = [holder.next_json() for _ in range(3)]
    assert [r["name"] for r in results] == ["CUDA_SUCCESS", "CUDA_SUCCESS", "CUDA_ERROR_OUT_OF_MEMORY"]
    assert [r.get("managed") for r in results] == [1, 1, None]
    holder.wait_for("holding")
    device = sim.run(["alloc", "--free", "4GiB"], **host)  # the device's memory is all still there
    assert (device[0]["name"], device[0]["managed"]) == ("CUDA_SUCCESS", 0)
    assert meminfo(sim) == {"free": 4 * GiB, "total": 4 * GiB}
    assert nvml_processes(sim)[holder.pid] == 0
    holder.kill()
    # A killed process's managed memory goes back to the host.
    lines = sim.run(["alloc", "--api", "managed", "--free", "6GiB"], **host)
    assert lines[0]["name"] == "CUDA_SUCCESS" and lines[-1] == {"freed": 1}


def test_memory_is_given_back_on_free(simgpu_factory: Callable[..., SimGpu]) -> None:
    sim = simgpu_factory(memory="4GiB")
    for api in ("v2", "async", "create"):
        lines = sim.run(["alloc", "--api", api, "--free", "2GiB", "2GiB"])
        assert lines[-1] == {"freed": 2}
        assert meminfo(sim) == {"free": 4 * GiB, "total": 4 * GiB}


def test_capacity_is_shared_across_processes(simgpu_factory: Callable[..., SimGpu]) -> None:
    sim = simgpu_factory(memory="4GiB")
    first = sim.start(["alloc", "--hold", "30", "3GiB"])
    assert first.next_json()["result"] == CUDA_SUCCESS
    first.wait_for("holding")
    second = sim.run(["alloc", "2GiB", "1GiB"], client=LINKED_CLIENT)
    assert [r["result"] for r in second[:2]] == [CUDA_ERROR_OUT_OF_MEMORY, CUDA_SUCCESS]
    assert meminfo(sim) == {"free": 1 * GiB, "total": 4 * GiB}  # the second process has exited
    first.kill()


def test_processes_starting_together_share_one_state(simgpu_factory: Callable[..., SimGpu]) -> None:
    # Eight processes race to create the state file and then for 4 GiB: exactly four get 1 GiB.
    sim = simgpu_factory(memory="4GiB")
    clients = [sim.start(["alloc", "--hold", "30", "1GiB"]) for _ in range(8)]
    results = [c.next_json()["result"] for c in clients]
    assert sorted(results) == [CUDA_SUCCESS] * 4 + [CUDA_ERROR_OUT_OF_MEMORY] * 4
    for c in clients:
        c.wait_for("holding")
    # Those that got nothing still have a context, so NVML lists them, with 0 bytes (as a real one
    # would list them with their context's memory).
    expected = {c.pid: (1 * GiB if r == CUDA_SUCCESS else 0) for c, r in zip(clients, results, strict=True)}
    assert nvml_processes(sim) == expected


def test_per_process_memory_in_nvml(simgpu_factory: Callable[..., SimGpu]) -> None:
    sim = simgpu_factory(devices=2)
    a = sim.start(["alloc", "--hold", "30", "1GiB"])
    b = sim.start(["alloc", "--api", "create", "--device", "1", "--hold", "30", "2GiB", "6MiB"])
    a.wait_for("holding")
    b.wait_for("holding")
    assert nvml_processes(sim, 0) == {a.pid: 1 * GiB}
    assert nvml_processes(sim, 1) == {b.pid: 2 * GiB + 6 * (1 << 20)}
    memory = sim.nvml(
        "for i in range(2):\n"
        "    m = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i))\n"
        "    emit({'total': m.total, 'used': m.used, 'free': m.free})\n"
    )
    assert memory == [
        {"total": 16 * GiB, "used": 1 * GiB, "free": 15 * GiB},
        {"total": 16 * GiB, "used": 2 * GiB + 6 * (1 << 20), "free": 14 * GiB - 6 * (1 << 20)},
    ]


def test_memory_of_a_killed_process_is_reclaimed(simgpu_factory: Callable[..., SimGpu]) -> None:
    sim = simgpu_factory(memory="4GiB")
    victim = sim.start(["alloc", "--api", "create", "--hold", "60", "4GiB"])
    victim.wait_for("holding")
    assert meminfo(sim)["free"] == 0
    assert sim.run(["alloc", "2MiB"])[0]["result"] == CUDA_ERROR_OUT_OF_MEMORY
    victim.kill()  # SIGKILL: no chance to free anything
    assert victim.pid not in nvml_processes(sim)
    assert meminfo(sim) == {"free": 4 * GiB, "total": 4 * GiB}
    assert sim.run(["alloc", "4GiB"])[0]["result"] == CUDA_SUCCESS


def test_a_killed_process_holds_nothing_before_its_parent_waits(simgpu_factory: Callable[..., SimGpu]) -> None:
    # Its files closed as it died, and the driver's context with them; /proc keeps its pid until the
    # parent collects it, but NVML does not list it and its memory is free.
    sim = simgpu_factory(memory="4GiB")
    victim = sim.start(["alloc", "--hold", "60", "3GiB"])
    victim.wait_for("holding")
    assert nvml_processes(sim) == {victim.pid: 3 * GiB}
    os.kill(victim.pid, signal.SIGKILL)  # and no wait: the client stays a zombie
    wait_until("the killed client to be a zombie", lambda: zombie(victim.pid))
    assert nvml_processes(sim) == {}
    assert meminfo(sim) == {"free": 4 * GiB, "total": 4 * GiB}
    assert zombie(victim.pid)  # still there, uncollected, when NVML and the driver looked


def test_a_process_that_execs_holds_nothing(simgpu: SimGpu) -> None:
    # exec closes the driver's files and ends its contexts: the pid lives on, as another program, with
    # the start time /proc gave it at fork, and holds no memory.
    client = subprocess.Popen([sys.executable, str(DRIVER_CLIENT)], env=simgpu.env(), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert client.stdin is not None and client.stdout is not None
    try:
        client.stdin.write(f"init\nalloc {GiB}\nexec sleep 60\n")
        client.stdin.flush()
        answers = [json.loads(client.stdout.readline()) for _ in range(4)]
        assert answers == [{"pid": client.pid}, {"cmd": "init", "result": CUDA_SUCCESS},
                           {"cmd": "alloc", "result": CUDA_SUCCESS}, {"cmd": "exec", "result": CUDA_SUCCESS}]
        wait_until("the client to be sleep", lambda: Path(f"/proc/{client.pid}/comm").read_text() == "sleep\n")
        assert nvml_processes(simgpu) == {}
        assert meminfo(simgpu) == {"free": 16 * GiB, "total": 16 * GiB}
    finally:
        client.kill()
        client.wait()


def test_concurrent_threads_never_overshoot(simgpu_factory: Callable[..., SimGpu]) -> None:
    sim = simgpu_factory(memory="10GiB")
    result = sim.run(["alloc-threads", "--threads", "16", "--size", "1GiB", "--count", "4"])[-1]
    assert result["successes"] == 10
    assert result["failures"] == result["oom"] == 54
    assert result["free"] == 0


def test_bad_frees_change_nothing(simgpu: SimGpu) -> None:
    result = simgpu.run(["free-checks"], client=LINKED_CLIENT)[-1]
    assert result["unknown"] == CUDA_ERROR_INVALID_VALUE
    assert result["first"] == CUDA_SUCCESS
    assert result["second"] == CUDA_ERROR_INVALID_VALUE
    assert result["free"] == result["total"] == 16 * GiB


def test_a_forked_child_is_a_process_of_its_own(simgpu: SimGpu) -> None:
    family = simgpu.start(["fork-alloc", "--hold", "30", "1GiB"])
    parent, child = family.next_json(), family.next_json()
    assert parent["who"] == "parent" and child["who"] == "child"
    assert parent["result"] == child["result"] == CUDA_SUCCESS
    assert nvml_processes(simgpu) == {parent["pid"]: 1 * GiB, child["pid"]: 1 * GiB}
    family.kill()


def test_a_parent_is_gone_though_its_forked_child_lives_on(simgpu: SimGpu) -> None:
    # The child shares the parent's open files from fork on, until it closes its copies: none of the
    # parent's hold on the device may live on in them.
    family = simgpu.start(["fork-alloc", "--hold", "60", "1GiB"])
    parent, child = family.next_json(), family.next_json()
    assert parent["result"] == child["result"] == CUDA_SUCCESS
    try:
        family.kill()  # the parent; the child, its own process, goes on holding
        assert nvml_processes(simgpu) == {child["pid"]: 1 * GiB}
        assert meminfo(simgpu) == {"free": 15 * GiB, "total": 16 * GiB}
    finally:
        os.kill(child["pid"], signal.SIGKILL)


# ---- the driver API's answers ---------------------------------------------------------------


def test_error_codes_before_init_and_without_context(simgpu: SimGpu) -> None:
    result = simgpu.run(["error-codes"])[-1]
    assert result == {
        "before_init": CUDA_ERROR_NOT_INITIALIZED,
        "init": CUDA_SUCCESS,
        "current_is_null": True,
        "no_ctx_alloc": CUDA_ERROR_INVALID_CONTEXT,
        "no_ctx_meminfo": CUDA_ERROR_INVALID_CONTEXT,
        "no_ctx_sync": CUDA_ERROR_INVALID_CONTEXT,
        "bad_device": CUDA_ERROR_INVALID_DEVICE,
    }


@pytest.fixture(scope="module")
def libcuda() -> ctypes.CDLL:
    # cuGetProcAddress needs no state, so the library can be loaded into the test process itself.
    return ctypes.CDLL(str(LIBCUDA))


PER_THREAD = 1 << 1  # CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM


@pytest.mark.parametrize(
    ("symbol", "version", "flags", "expected"),
    [
        ("cuMemAlloc", 13000, 0, "cuMemAlloc_v2"),
        ("cuMemAlloc", 3020, 0, "cuMemAlloc_v2"),
        ("cuCtxCreate", 3020, 0, "cuCtxCreate_v2"),
        ("cuCtxCreate", 11040, 0, "cuCtxCreate_v3"),
        ("cuCtxCreate", 12000, 0, "cuCtxCreate_v3"),
        ("cuCtxCreate", 13000, 0, "cuCtxCreate_v4"),
        ("cuCtxSynchronize", 12080, 0, "cuCtxSynchronize"),
        ("cuCtxSynchronize", 13000, 0, "cuCtxSynchronize_v2"),
        ("cuDevicePrimaryCtxRelease", 10020, 0, "cuDevicePrimaryCtxRelease"),
        ("cuDevicePrimaryCtxRelease", 11000, 0, "cuDevicePrimaryCtxRelease_v2"),
        ("cuGetProcAddress", 12000, 0, "cuGetProcAddress_v2"),
        ("cuGetProcAddress", 11030, 0, "cuGetProcAddress"),
        ("cuLaunchKernel", 13000, 0, "cuLaunchKernel"),
        ("cuLaunchKernel", 13000, PER_THREAD, "cuLaunchKernel_ptsz"),
        ("cuLaunchKernelEx", 12000, PER_THREAD, "cuLaunchKernelEx_ptsz"),
        ("cuGraphLaunch", 12000, PER_THREAD, "cuGraphLaunch_ptsz"),
        ("cuMemAllocAsync", 12000, PER_THREAD, "cuMemAllocAsync_ptsz"),
        ("cuMemcpyHtoD", 12000, PER_THREAD, "cuMemcpyHtoD_v2_ptds"),
        ("cuMemAlloc", 13000, PER_THREAD, "cuMemAlloc_v2"),
    ],
)
def test_get_proc_address_answers_by_version(
    libcuda: ctypes.CDLL, symbol: str, version: int, flags: int, expected: str
) -> None:
    fn = ctypes.c_void_p()
    status = ctypes.c_int(-1)
    result = libcuda.cuGetProcAddress_v2(
        symbol.encode(), ctypes.byref(fn), version, ctypes.c_uint64(flags), ctypes.byref(status)
    )
    assert (result, status.value) == (CUDA_SUCCESS, 0)
    assert fn.value == ctypes.cast(getattr(libcuda, expected), ctypes.c_void_p).value


@pytest.mark.parametrize(
    ("symbol", "version", "status"),
    [
        ("cuMemAllocAsync", 11000, 2),  # CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT
        ("cuNoSuchFunction", 13000, 1),  # CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND
        ("cuMemAlloc_v2", 13000, 1),  # names are base names, as for the real driver
    ],
)
def test_get_proc_address_refuses(libcuda: ctypes.CDLL, symbol: str, version: int, status: int) -> None:
    fn = ctypes.c_void_p(1)
    got = ctypes.c_int(-1)
    result = libcuda.cuGetProcAddress_v2(
        symbol.encode(), ctypes.byref(fn), version, ctypes.c_uint64(0), ctypes.byref(got)
    )
    assert (result, got.value, fn.value) == (CUDA_ERROR_NOT_FOUND, status, None)


def test_devices_have_stable_distinct_uuids(simgpu_factory: Callable[..., SimGpu]) -> None:
    sim = simgpu_factory(devices=3)
    first = sim.run(["devices"])[0]
    assert first["count"] == 3
    uuids = [d["uuid"] for d in first["devices"]]
    assert len(set(uuids)) == 3
    assert all(len(u) == 40 and u.startswith("GPU-") for u in uuids)
    assert sim.run(["devices"], client=LINKED_CLIENT)[0] == first
    nvml = sim.nvml(
        "emit({'uuids': [pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))"
        " for i in range(pynvml.nvmlDeviceGetCount())]})\n"
    )
    assert nvml[0]["uuids"] == uuids


def test_cuda_visible_devices_by_uuid_reorders(simgpu_factory: Callable[..., SimGpu]) -> None:
    sim = simgpu_factory(devices=3)
    uuids = [d["uuid"] for d in sim.run(["devices"])[0]["devices"]]
    visible = f"{uuids[2]},{uuids[0][:12]}"  # a full UUID and a unique prefix, as CUDA accepts
    seen = sim.run(["devices"], CUDA_VISIBLE_DEVICES=visible)[0]
    assert [d["uuid"] for d in seen["devices"]] == [uuids[2], uuids[0]]
    holder = sim.start(["alloc", "--device", "0", "--hold", "30", "1GiB"], CUDA_VISIBLE_DEVICES=visible)
    holder.wait_for("holding")
    # CUDA device 0 of that process is physical device 2; NVML ignores CUDA_VISIBLE_DEVICES.
    assert nvml_processes(sim, 2) == {holder.pid: 1 * GiB}
    assert nvml_processes(sim, 0) == {}
    holder.kill()


@pytest.mark.parametrize(
    ("visible", "ordinals"),
    [("1", [1]), ("2,0", [2, 0]), ("1,7,0", [1]), ("0,0", [0])],
)
def test_cuda_visible_devices_by_ordinal(
    simgpu_factory: Callable[..., SimGpu], visible: str, ordinals: list[int]
) -> None:
    sim = simgpu_factory(devices=3)
    uuids = [d["uuid"] for d in sim.run(["devices"])[0]["devices"]]
    seen = sim.run(["devices"], CUDA_VISIBLE_DEVICES=visible)[0]
    assert [d["uuid"] for d in seen["devices"]] == [uuids[i] for i in ordinals]


def test_no_visible_device(simgpu: SimGpu) -> None:
    lines = simgpu.run(["error-codes"], CUDA_VISIBLE_DEVICES="")
    assert lines[-1]["init"] == 100  # CUDA_ERROR_NO_DEVICE


def test_linked_client_runs_the_same_workloads(simgpu: SimGpu) -> None:
    result = simgpu.run(["launch-loop", "--kernel-ns", "2000000", "--iters", "20"], client=LINKED_CLIENT)[-1]
    assert result["launches"] == 20
    assert result["event_s"] >= 0.04 - 1e-5
    lines = simgpu.run(["alloc", "--api", "pool", "1GiB"], client=LINKED_CLIENT)
    assert lines[0]["result"] == CUDA_SUCCESS
    assert RT_CLIENT.exists()


def test_entry_points_never_call_one_another() -> None:
    # A uprobe on cuCtxSynchronize_v2 must not fire for a call to cuCtxSynchronize (as with the
    # real libcuda): the library makes no call through its own exported symbols.
    disassembly = subprocess.run(
        ["objdump", "-d", str(LIBCUDA)], capture_output=True, text=True, check=True
    ).stdout
    assert "<cuLaunchKernel>:" in disassembly
    assert re.findall(r"(?:call|jmp)\s+\S+ <cu\w*@plt>", disassembly) == []
