"""The simulated GPU's collectives (simgpu/collective.c, issue 29), run for real: `ddp-loop` ranks, one
process per simulated device, as torchrun starts a data-parallel job.

What the scheduler's tests lean on: a rank whose peer has not started its collective holds its device
(busy in NVML; another process's launch there takes it, as the driver time-slices) and makes no
progress; a rank whose peer is gone ends with an error within SIMGPU_COLLECTIVE_TIMEOUT instead of
hanging. Rates are read on the simulated device's clock (events), so that a loaded machine cannot fail
them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable

import pytest
from simgpu_env import Client, ClientError, SimGpu

pytestmark = pytest.mark.unit

CUDA_ERROR_LAUNCH_FAILED = 719
KERNEL_NS = 5_000_000
LAUNCHES = 4
COLLECTIVE_NS = 5_000_000
STEP_S = (KERNEL_NS * LAUNCHES + COLLECTIVE_NS) / 1e9

UTILISATION = (
    "import time\n"
    "hs = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(2)]\n"
    "[pynvml.nvmlDeviceGetUtilizationRates(h) for h in hs]\n"
    "time.sleep(1.0)\n"
    "emit({'gpu': [pynvml.nvmlDeviceGetUtilizationRates(h).gpu for h in hs]})\n"
)

# One rank of communicator 5 through the driver's entry points: collectives of simgpu_collective_max,
# each with its value from argv, printing what each launch left in its value.
MAX_RANK = (
    "import ctypes, json, sys\n"
    "cuda = ctypes.CDLL('libcuda.so.1')\n"
    "u64 = ctypes.c_uint64\n"
    "world, r, values = int(sys.argv[1]), int(sys.argv[2]), [int(v) for v in sys.argv[3:]]\n"
    "ctx, module, func = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()\n"
    "assert cuda.cuInit(0) == 0 and cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), r) == 0\n"
    "assert cuda.cuCtxSetCurrent(ctx) == 0 and cuda.cuModuleLoadData(ctypes.byref(module), b'x') == 0\n"
    "assert cuda.cuModuleGetFunction(ctypes.byref(func), module, b'simgpu_collective_max_flag') == 0\n"
    "got = []\n"
    "for v in values:\n"
    "    value = u64(v)\n"
    "    args = [u64(1000), u64(5), u64(world), u64(r), u64(ctypes.addressof(value))]\n"
    "    params = (ctypes.c_void_p * 5)(*[ctypes.addressof(a) for a in args])\n"
    "    assert cuda.cuLaunchKernel(func, 1, 1, 1, 32, 1, 1, 0, None, params, None) == 0\n"
    "    assert cuda.cuCtxSynchronize() == 0\n"
    "    got.append(value.value)\n"
    "print(json.dumps({'rank': r, 'got': got}), flush=True)\n"
)


def rank(sim: SimGpu, r: int, *extra: str, comm: int = 7, **env: str) -> Client:
    args = ["ddp-loop", "--rank", str(r), "--world", "2", "--comm", str(comm), "--device", str(r)]
    args += ["--kernel-ns", str(KERNEL_NS), "--launches-per-iter", str(LAUNCHES)]
    args += ["--collective-ns", str(COLLECTIVE_NS), *extra]
    return sim.start(args, **env)


def test_two_ranks_step_together_at_the_kernels_rate(simgpu_factory: Callable[..., SimGpu]) -> None:
    sim = simgpu_factory(devices=2)
    ranks = [rank(sim, r, "--seconds", "2") for r in (0, 1)]
    results = [c.finish()[-1] for c in ranks]
    # --seconds: each step's collective also agrees on whether the time is up, so both stop after the same step.
    assert results[0]["steps"] == results[1]["steps"]
    for result in results:
        assert result["gpu_s"] == pytest.approx(result["steps"] * STEP_S + COLLECTIVE_NS / 1e9)
        # Never faster than the kernels; the spin while the other rank's launches come is small
        # next to a 25 ms step even when the host is loaded (2 s: 80 steps at most).
        assert result["event_s"] >= result["gpu_s"] - 1e-4
        assert result["steps"] >= 0.6 * result["event_s"] / STEP_S
        assert result["steps"] <= 2.0 / STEP_S + 2


def test_a_rank_spins_on_its_device_until_its_peer_starts(simgpu_factory: Callable[..., SimGpu]) -> None:
    sim = simgpu_factory(devices=2)
    first = rank(sim, 0, "--iters", "10")
    ready = first.wait_for("ready")
    # Rank 1 is not there: rank 0's first collective spins, and NVML counts its device busy.
    gpu = sim.nvml(UTILISATION)[0]["gpu"]
    assert first.proc.poll() is None and "first_step" not in str(first.lines)
    assert gpu[0] >= 70
    assert gpu[1] == 0
    second = rank(sim, 1, "--iters", "10")
    peer_ready = second.wait_for("ready")
    first_step = first.wait_for("first_step")
    # Rank 0's first step ended only once rank 1 had started its first collective (after its ready).
    assert first_step["t_ns"] >= peer_ready["t_ns"]
    results = [first.finish()[-1], second.finish()[-1]]
    assert results[0]["steps"] == results[1]["steps"] == 10
    # The spin is on rank 0's device clock: its 10 steps took the wait for rank 1 on top of their kernels.
    waited_s = (peer_ready["t_ns"] - ready["t_ns"]) / 1e9
    assert results[0]["event_s"] - results[0]["gpu_s"] >= 0.9 * waited_s
    assert results[1]["event_s"] - results[1]["gpu_s"] < 0.5 * waited_s


def test_another_processs_kernels_run_beside_a_spinning_rank_as_the_driver_time_slices(
        simgpu_factory: Callable[..., SimGpu]) -> None:
    sim = simgpu_factory(devices=2)
    first = rank(sim, 0, "--iters", "5")
    first.wait_for("ready")
    time.sleep(0.3)  # rank 0 reaches its first collective and spins
    # Before (the spin held its device against every process): the 1 ms kernel waited for rank 1, here
    # a second; a stranded rank so stopped whichever group its GPU went to (collective.c).
    result = sim.run(["launch-loop", "--device", "0", "--kernel-ns", "1000000", "--iters", "1"])[-1]
    assert result["elapsed_s"] < 0.5
    assert first.proc.poll() is None and "first_step" not in str(first.lines)  # still waiting for rank 1
    second = rank(sim, 1, "--iters", "5")
    assert first.finish()[-1]["steps"] == second.finish()[-1]["steps"] == 5


def test_a_killed_rank_ends_its_peer_with_an_error(simgpu_factory: Callable[..., SimGpu]) -> None:
    sim = simgpu_factory(devices=2)
    ranks = [rank(sim, r, "--seconds", "60", "--progress", SIMGPU_COLLECTIVE_TIMEOUT="2") for r in (0, 1)]
    for c in ranks:
        c.wait_for("progress")
    ranks[1].kill()
    killed_at = time.monotonic()
    with pytest.raises(ClientError, match="no live process has reached a collective as that rank"):
        ranks[0].finish(timeout=15)
    took = time.monotonic() - killed_at
    error = ranks[0].lines[-1]
    assert error["error"] == "collective"
    assert error["result"] == CUDA_ERROR_LAUNCH_FAILED
    assert error["step"] > 0
    assert 1.5 <= took < 8


def test_a_spin_whose_process_died_frees_its_device(simgpu_factory: Callable[..., SimGpu]) -> None:
    sim = simgpu_factory(devices=2)
    alone = rank(sim, 1, "--iters", "1")
    alone.wait_for("ready")
    time.sleep(0.3)  # spinning on device 1 for rank 0, which never comes
    alone.kill()
    # The next launch on device 1 ends the dead process's spin instead of waiting behind it.
    result = sim.run(["launch-loop", "--device", "1", "--kernel-ns", "1000000", "--iters", "3"])[-1]
    assert result["elapsed_s"] < 1.0
    # The communicator's rank is free again: a new run of it steps as the first did.
    pair = [rank(sim, r, "--iters", "3") for r in (0, 1)]
    assert [c.finish()[-1]["steps"] for c in pair] == [3, 3]


def test_a_rank_held_by_a_live_process_is_refused(simgpu_factory: Callable[..., SimGpu]) -> None:
    sim = simgpu_factory(devices=2)
    holder = rank(sim, 0, "--iters", "1")
    holder.wait_for("ready")
    time.sleep(0.2)
    # On the other device, with no kernel before its collective: device 0 is held by the spin.
    twin = sim.start(["ddp-loop", "--rank", "0", "--world", "2", "--comm", "7", "--device", "1",
                      "--kernel-ns", "0", "--launches-per-iter", "0", "--collective-ns", "1000"])
    with pytest.raises(ClientError, match="held by another live process"):
        twin.finish(timeout=10)
    assert twin.lines[-1]["name"] == "CUDA_ERROR_INVALID_VALUE"
    holder.kill()


def test_two_jobs_on_the_same_devices_share_them(simgpu_factory: Callable[..., SimGpu]) -> None:
    # Job 11's rank 0 spins on device 0 and job 12's rank 1 on device 1, each for its peer, whose
    # kernels wait behind the other job's spin. The spins give way, as the driver time-slices, instead
    # of both jobs waiting for each other until the timeout.
    sim = simgpu_factory(devices=2)
    env = {"SIMGPU_COLLECTIVE_TIMEOUT": "20"}
    first = [rank(sim, 0, "--seconds", "2", comm=11, **env), rank(sim, 1, "--seconds", "2", comm=12, **env)]
    for c in first:
        c.wait_for("ready")
    time.sleep(0.3)
    second = [rank(sim, 1, "--seconds", "2", comm=11, **env), rank(sim, 0, "--seconds", "2", comm=12, **env)]
    results = [[c.finish(timeout=30)[-1] for c in (first[j], second[j])] for j in (0, 1)]
    for job in results:
        assert job[0]["steps"] == job[1]["steps"]
    # Each device runs both jobs' kernels one at a time: together no faster than that, each a fair part.
    steps = [job[0]["steps"] for job in results]
    event_s = max(r["event_s"] for job in results for r in job)
    assert sum(steps) * STEP_S <= 1.1 * event_s
    assert sum(steps) >= 0.5 * 2.0 / STEP_S
    assert min(steps) >= 0.3 * sum(steps)


def test_a_max_collective_gives_every_rank_the_largest_value(simgpu_factory: Callable[..., SimGpu]) -> None:
    # How a job's ranks agree on when to stop (ddp-loop --seconds): each round's values apart.
    sim = simgpu_factory(devices=3)
    values = [[5, 0, 1], [9, 0, 0], [2, 0, 7]]
    procs = [subprocess.Popen([sys.executable, "-c", MAX_RANK, "3", str(r), *map(str, values[r])],
                              env=sim.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(3)]
    outputs = [p.communicate(timeout=30) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [err for _, err in outputs]
    assert [json.loads(out)["got"] for out, _ in outputs] == [[9, 0, 7]] * 3
