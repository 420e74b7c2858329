"""The gate on a host of two or more GPUs (issue 2: the device of an allocation, by UUID; launches held
per GPU). Self-contained; run from the repo root with build/libgemgate.so built:

    python3 -m bench.gpu.gate_multi_gpu

It stands in for the agent (a Region in a temporary state dir with every GPU's NVML UUID, a beating
heartbeat, a group `bench` with MemoryLimit 4 GiB), then, for the second CUDA device:
  1. PyTorch on cuda:1 (default allocator, expandable_segments:True, backend:cudaMallocAsync), the
     current device left at 0: mem_get_info reports 4 GiB, 3 GiB fit, 2 GiB more raise
     OutOfMemoryError, and the process's slot holds the 3 GiB on the region GPU of cuda:1's UUID;
  2. CUDA_VISIBLE_DEVICES=<that GPU's UUID>: cuda:0 of the program is charged to that region GPU;
  3. launches on cuda:1 wait while the group is held on that GPU (about 1 s) and do not while it is
     held on another GPU only.
With fewer than two GPUs it says so and exits 0. Prints a table; with $OUT set, writes
gate_multi_gpu.md there.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.recording import REPO, publish, region_gpus, stamp
from bench.recording import gpus as describe_gpus
from gemtrace.agent.membership import Membership
from gemtrace.region import Region
from tests.testkit import GiB

GATE = REPO / "build" / "libgemgate.so"
HOLD_S = 1.0

UUIDS = r"""
import json, torch
print(json.dumps([str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]))
"""

# Allocates on cuda:DEV without making it the current device, reports, then waits for a line on stdin
# so that the parent can read the process's slot while the memory is held.
ALLOCATE = r"""
import json, os, sys, torch
dev = int(sys.argv[1])
free, total = torch.cuda.mem_get_info(dev)
a = torch.empty(3 * (1 << 30), dtype=torch.uint8, device=f"cuda:{dev}")
try:
    b = torch.empty(2 * (1 << 30), dtype=torch.uint8, device=f"cuda:{dev}")
    past = "allocated"
except torch.cuda.OutOfMemoryError:
    past = "OutOfMemoryError"
torch.cuda.synchronize(dev)
print(json.dumps({"total": total, "past_limit": past, "pid": os.getpid()}), flush=True)
sys.stdin.readline()
"""

# Element-wise ops on cuda:DEV (current device left at 0), timed after the parent says go.
LAUNCH = r"""
import json, sys, time, torch
dev = int(sys.argv[1])
x = torch.ones(1 << 20, device=f"cuda:{dev}")
for _ in range(20):
    x.add_(1)
torch.cuda.synchronize(dev)
print(json.dumps({"ready": True}), flush=True)
sys.stdin.readline()
started = time.monotonic()
for _ in range(200):
    x.add_(1)
torch.cuda.synchronize(dev)
print(json.dumps({"elapsed_s": time.monotonic() - started}), flush=True)
"""


def bare(uuid: str) -> str:
    """NVML's "GPU-xxxxxxxx-xxxx-..." and torch's UUID text reduced to the same hex digits."""
    return uuid.lower().removeprefix("gpu-").replace("-", "")


class Child:
    """A Python child speaking JSON lines, fed lines on stdin."""

    def __init__(self, code: str, args: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, *args],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def line(self) -> dict:
        assert self.proc.stdout is not None
        text = self.proc.stdout.readline()
        if not text:
            err = self.proc.stderr.read()[-800:] if self.proc.stderr else ""
            raise RuntimeError(f"child ended: {self.proc.wait()} {err}")
        return json.loads(text)

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        try:
            self.go()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def main() -> int:
    # No options: --help says what the run does, and anything else is refused before a GPU is touched.
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    gpus = region_gpus()
    if len(gpus) < 2:
        print(f"gate_multi_gpu: {len(gpus)} GPU(s) here; this check needs two.")
        return 0
    rows: list[tuple[str, str, str]] = []
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        region = Region.create(Path(tmp))
        region.set_gpus(gpus)
        region.set_group("default", None, 0.0, 1.0)  # the agent always defines it
        group = region.set_group("bench", 4 * GiB, 0.0, 1.0)
        stop = threading.Event()
        membership = Membership(region, lambda: {})  # the agent's decision of each process's group

        def beat() -> None:
            while not stop.wait(0.01):
                region.heartbeat(time.monotonic_ns())
                membership.tick()

        region.heartbeat(time.monotonic_ns())
        threading.Thread(target=beat, daemon=True).start()
        gated = dict(os.environ, LD_PRELOAD=str(GATE), GEMTRACE_STATE_DIR=tmp, GEMTRACE_GROUP="bench")
        gated.pop("CUDA_VISIBLE_DEVICES", None)
        region_uuids = [bare(u) for u, _ in gpus]

        listed = subprocess.run([sys.executable, "-c", UUIDS], capture_output=True, text=True, check=True)
        cuda_uuids = [bare(u) for u in json.loads(listed.stdout.splitlines()[-1])]
        # The region GPU that is CUDA device 1 (CUDA orders devices fastest first, NVML by PCI bus).
        target = region_uuids.index(cuda_uuids[1]) if cuda_uuids[1] in region_uuids else 1
        other = next(i for i in range(len(gpus)) if i != target)
        print(f"CUDA device 1 is region GPU {target} ({gpus[target][0]})")

        def slot_memory(pid: int) -> list[int]:
            for _, slot in region.live_slots():
                if slot.pid == pid:
                    return list(slot.memory)[: len(gpus)]
            return []

        def allocation_row(name: str, env: dict[str, str], dev: int) -> None:
            nonlocal failures
            child = Child(ALLOCATE, [str(dev)], env)
            try:
                got = child.line()
                memory = slot_memory(got["pid"])
            except (RuntimeError, ValueError) as e:
                got, memory = {"error": str(e)[-300:]}, []
            finally:
                child.close()
            # 3 GiB on CUDA device 1's GPU (an allocator may round up a little), nothing elsewhere.
            charged = len(memory) == len(gpus) and 3 * GiB <= memory[target] <= 3 * GiB + 64 * (1 << 20)
            charged = charged and all(m == 0 for i, m in enumerate(memory) if i != target)
            ok = got.get("total") == 4 * GiB and got.get("past_limit") == "OutOfMemoryError" and charged
            failures += not ok
            rows.append(
                (
                    name,
                    f"4 GiB total, OOM past it, 3 GiB on region GPU {target}",
                    f"total {got.get('total', 0) / GiB:.2f} GiB, {got.get('past_limit', got.get('error'))}, "
                    f"slot GiB per region GPU {[round(m / GiB, 2) for m in memory]}",
                )
            )

        for conf in ("", "expandable_segments:True", "backend:cudaMallocAsync"):
            env = dict(gated, PYTORCH_CUDA_ALLOC_CONF=conf) if conf else gated
            allocation_row(f"torch cuda:1, {conf or 'default allocator'}", env, 1)
        allocation_row(
            "torch cuda:0 with CUDA_VISIBLE_DEVICES=<UUID of CUDA device 1>",
            dict(gated, CUDA_VISIBLE_DEVICES=gpus[target][0]),
            0,
        )

        for held_gpu, should_wait in ((target, True), (other, False)):
            child = Child(LAUNCH, ["1"], gated)
            try:
                child.line()
                region.hold(held_gpu, group)
                child.go()
                time.sleep(HOLD_S)
                region.release(held_gpu, group)
                elapsed = child.line()["elapsed_s"]
            except (RuntimeError, ValueError) as e:
                elapsed = float("nan")
                print(e)
            finally:
                region.release(held_gpu, group)
                child.close()
            ok = elapsed >= HOLD_S * 0.9 if should_wait else elapsed < HOLD_S * 0.5
            failures += not ok
            rows.append(
                (
                    f"launches on cuda:1, group held {HOLD_S:.0f} s on region GPU {held_gpu}",
                    "wait about 1 s" if should_wait else "do not wait",
                    f"200 ops took {elapsed:.3f} s",
                )
            )
        stop.set()
        region.stop()
        region.close()

    text = [
        f"# Gate on a host of several GPUs, {stamp()} ({platform.node()}, {describe_gpus()})",
        "",
        "| check | expected | measured |",
        "| --- | --- | --- |",
    ]
    text += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    publish("\n".join(text) + "\n", "gate_multi_gpu")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
