"""GPU time of an ungated process from NVML, against the ground truth: kernels of known duration on
the simulated GPU. The accounting runs in a child process, because an NVML library binds one
simulation per process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from simgpu_env import REPO, SimGpu

pytestmark = pytest.mark.e2e

CHILD = r"""
import json, select, subprocess, sys, time
from gemtrace.agent.agent import open_accounting
from gemtrace.sources.nvml import NvmlReader
nvml = NvmlReader()
assert nvml.available, nvml.reason
acc = open_accounting(None, lambda: None, use_ebpf=False, nvml=nvml)
end = time.monotonic() + 1.2  # an agent polls all along: NVML's window is full before the work starts
while time.monotonic() < end:
    acc.poll()
    time.sleep(0.05)
# The client holds after its report: an exited process leaves the snapshot at the next poll, and
# NVML's window still holds its last second of work.
client = subprocess.Popen([*sys.argv[1:], "--hold", "30"], stdout=subprocess.PIPE, text=True)
while not select.select([client.stdout], [], [], 0.05)[0]:
    acc.poll()
truth = json.loads(client.stdout.readline())
end = time.monotonic() + 1.5
while time.monotonic() < end:
    acc.poll()
    time.sleep(0.05)
snapshot = acc.poll()
client.kill()
client.wait()
seconds = {p.pid: p.gpu_seconds for p in snapshot.processes}
print(json.dumps({"kernel_s": truth["kernel_s"], "gpu_seconds": seconds.get(client.pid, 0.0),
                  "gated": [p.gated for p in snapshot.processes]}))
"""


def test_gpu_seconds_of_an_ungated_process_alone_within_5_percent(simgpu: SimGpu) -> None:
    # A count of iterations, not seconds: 3 s of kernels however long a busy host takes to launch them.
    client = [str(REPO / "build/simgpu/simgpu-rt"), "launch-loop", "--kernel-ns", "2000000",
              "--launches-per-iter", "5", "--iters", "300"]
    out = subprocess.run([sys.executable, "-c", CHILD, *client], env=simgpu.env(PYTHONPATH=str(REPO)),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["kernel_s"] == pytest.approx(3.0)
    assert result["gpu_seconds"] == pytest.approx(result["kernel_s"], rel=0.05), result
    assert result["gated"] == [False]
