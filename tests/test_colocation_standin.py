"""bench/gpu/colocation.py's orchestration on the simulated GPU, with stand-in workers.

The GPU bench runs a Hugging Face decoder, ResNets and MPS; this machine has none of them. The test
runs the bench as the lead engineer does, a separate process, with `--stand-in`: its workers drive the
simulated GPU's kernels through the gate (the simulated GPU's stand-in control daemon for the mps
cases), with the same start and window protocol. It checks what the single GPU run depends on: every
setting's resource file accepted by a real agent, the rows and ratios in the table and the JSON, the
service's GPU busy measured through NVML, and solo before and after. The figures of record come from
the GPU (bench/results/colocation.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from simgpu_env import REPO, require_build, simgpu_env

pytestmark = pytest.mark.e2e


def test_every_setting_runs_through_the_agent_and_reaches_the_table(tmp_path: Path) -> None:
    require_build()
    out = tmp_path / "out"
    env = simgpu_env(tmp_path / "sim", OUT=str(out))
    cases = "cnn-gate,cnn-mps,decoder-gate0,pair-gate,pair-mps-sm5,cnn-off,cnn-equal,pair-turns"
    done = subprocess.run([sys.executable, "-m", "bench.gpu.colocation", "--stand-in", "--seconds", "2",
                           "--settle", "0.5", "--cases", cases],
                          cwd=REPO, env=env, text=True, capture_output=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode in (0, 1), output  # 1: a target missed; the simulated GPU runs kernels one at a time
    result = json.loads((out / "colocation.json").read_text())
    table = (out / "colocation.md").read_text()
    rows = {r["case"]: r for r in result["rows"]}
    assert set(rows) == {"cnn-gate", "cnn-mps", "decoder-gate0", "pair-gate", "pair-mps-sm5", "cnn-off", "cnn-equal",
                         "pair-turns"}, output
    assert result["skipped"] == [], output
    for name in ("cnn-gate", "cnn-mps", "decoder-gate0", "cnn-off", "cnn-equal"):
        r = rows[name]
        assert r["requests"] > 10 and r["p99_ratio"] > 0 and r["train_rate"] > 0, output
        assert r["result"] in ("met", "missed", "- (before issue 30)", "-"), output
    # The opportunistic group is not charged time; with Priority (off) both groups take turns.
    assert rows["cnn-gate"]["train_charged"] == 0.0 and rows["cnn-off"]["train_charged"] > 0.1, output
    assert rows["pair-gate"]["prod_rate"] > 0 and rows["pair-gate"]["result"] in ("met", "missed"), output
    # An opportunistic mps group with a MaxUtil (its share of the SMs): the agent takes the resource file.
    assert rows["pair-mps-sm5"]["prod_rate"] > 0 and rows["pair-mps-sm5"]["train_rate"] > 0, output
    # Both production (equal: shared, turns: MinUtil 0.01 each): each charged its part of the time, no target.
    for name in ("cnn-equal", "pair-turns"):
        assert rows[name]["train_charged"] > 0.1 and rows[name]["result"] == "-", output
    assert rows["pair-turns"]["prod_charged"] > 0.1, output
    # The services' busy fraction, from NVML over the solo window: the stand-in CNN's 12 kernels of
    # 50 us every 20 ms or so keep the simulated GPU busy a few percent of the time.
    busy = result["solo"]["cnn-infer"]["busy"]
    assert busy is not None and 0.0 < busy < 0.5, output
    for workload in ("cnn-infer", "decoder-infer", "cnn-train"):
        assert {"before", "after"} <= result["solo"][workload].keys(), output
    assert "| cnn-infer | Opportunistic, Isolation=mps (MPS client priority) |" in table, table
