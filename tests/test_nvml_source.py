"""The accounting's NVML reader against the simulated NVML, with pynvml's own answers as the reference:
the reader binds NVML through pynvml, but lists processes through its own calls (room learnt from
NVML's answers, gemtrace/sources/nvml.py), so that listing is what can go wrong."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from simgpu_env import SimGpu

pytestmark = pytest.mark.unit

COMPARE = """
from gemtrace.sources.nvml import NvmlReader
reader = NvmlReader(room=1)
assert reader.available, reader.reason
reference = sorted([p.pid, pynvml.nvmlDeviceGetUUID(h), p.usedGpuMemory]
                   for h in (pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount()))
                   for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h))
for _ in range(2):  # the first read outgrows its room of one; the second fits in the room it learnt
    emit({"read": sorted([p.pid, p.gpu, p.used_bytes] for p in reader.processes()), "reference": reference,
          "gpus": reader.gpu_uuids(), "busy": reader.utilization()})
"""


def test_the_reader_lists_each_process_on_each_gpu_as_pynvml_does_past_its_first_room(
        simgpu_factory: Callable[..., SimGpu]) -> None:
    sim = simgpu_factory(devices=2)
    holders = [sim.start(["alloc", "--device", str(device), "--hold", "30", f"{size}MiB"])
               for device, size in ((0, 64), (0, 96), (0, 128), (1, 32))]
    pids = {h.wait_for("holding")["pid"] for h in holders}
    first, second = sim.nvml(COMPARE)
    assert {pid for pid, _, _ in first["reference"]} == pids
    assert len(first["reference"]) == 4
    assert first["read"] == first["reference"]
    assert second["read"] == first["reference"]
    assert len(first["gpus"]) == 2 and sorted({gpu for _, gpu, _ in first["read"]}) == sorted(first["gpus"])
    assert set(first["busy"]) == set(first["gpus"])

