"""`make demo`: quiet while its agent starts, frames headed as the demo's, only its own programs
shown (a stranger on another libcuda is neither probed nor shown), one line on eBPF, a kept log."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from agent_host import Host
from simgpu_env import LIBCUDA, LIBNVML, RT_CLIENT, Client, simgpu_env

from dev import demo
from gemtrace import top

FRAME = top.Frame(taken_at=0.0, agent_version="0.1.0", probes_attached=0.0,
                  gpus=(top.GpuRow(uuid="GPU-1", index="0", groups=(top.GroupRow(name="train", gpu="GPU-1"),)),))
UNAVAILABLE = json.dumps({"reason": "eBPF needs root: run the agent as root", "event": "ebpf_unavailable",
                          "level": "warning"})


@pytest.mark.unit
def test_frames_are_headed_as_the_demo() -> None:
    lines = demo.frame_lines(FRAME)
    assert lines[0].startswith("gemtrace demo  on the simulated GPU  agent 0.1.0  no eBPF probes")
    assert not any("gemtrace top" in line for line in lines)
    assert any(line.lstrip().startswith("train ") for line in lines)


@pytest.mark.unit
def test_the_ebpf_line_says_on_or_why_not() -> None:
    assert demo.ebpf_line(replace(FRAME, probes_attached=37.0), "", as_root=True) == (
        "eBPF accounting on: 37 uprobes on the simulated libcuda")
    log = '{"event": "agent_starting"}\n' + UNAVAILABLE + "\n"
    assert demo.ebpf_line(FRAME, log, as_root=True) == (
        "eBPF accounting off, the gates and NVML still count: eBPF needs root: run the agent as root")
    assert demo.ebpf_line(FRAME, log, as_root=False).endswith("run the agent as root (here: make demo as root)")
    # The agent's advice to an operator becomes the demo's own.
    missing = json.dumps({"event": "ebpf_unavailable", "reason": "bcc's Python module is missing (x): run "
                          "`apt-get install python3-bpfcc` as root, then restart the agent"})
    assert demo.ebpf_line(FRAME, missing, as_root=True).endswith("as root, then run the demo again")
    assert "see the agent's log" in demo.ebpf_line(FRAME, "not json\n", as_root=True)


@pytest.mark.e2e
def test_the_demo_is_quiet_and_shows_only_its_own_programs(host: Host, tmp_path: Path) -> None:
    # A stranger on the host: a program on its own copy of libcuda, in a group the demo defines.
    other = tmp_path / "other-lib"
    other.mkdir()
    for lib in (LIBCUDA, LIBNVML):
        shutil.copy(lib, other / lib.name)
    env = simgpu_env(tmp_path / "other-sim", LD_LIBRARY_PATH=str(other), GEMTRACE_GROUP="notebook")
    stranger = Client(["alloc", "--api", "v2", "64MiB", "--hold", "120"], env, client=RT_CLIENT)
    log_path: Path | None = None
    try:
        stranger.wait_for("holding")
        out = subprocess.run([sys.executable, "-m", "dev.demo", "--seconds", "4"], env=host.env(),
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        assert out.stderr == ""  # nothing while the agent starts: no refused connections
        lines = out.stdout.splitlines()
        assert lines[0].startswith("gemtrace demo: the agent is up on the simulated GPU")
        assert lines[0].endswith("train, infer, notebook at work for 4 s (default: every other program; "
                                 "--seconds N or Ctrl-C)"), lines[0]
        assert re.match(r"gemtrace demo: eBPF accounting (on: \d+ uprobes|off, the gates and NVML still count: )",
                        lines[1]), lines[1]
        match = re.match(r"gemtrace demo: the agent's log: (\S+) \(kept\)$", lines[2])
        assert match, lines[2]
        log_path = Path(match.group(1))
        assert out.stdout.count("\ngemtrace demo  on the simulated GPU") >= 3  # a frame a second
        assert "gemtrace top" not in out.stdout
        assert lines[-1] == f"gemtrace demo: stopped; the agent's log is kept in {log_path}"
        for group in ("train", "infer", "notebook"):
            assert f"  {group} " in out.stdout
        assert f" {stranger.pid} " not in out.stdout

        # The log outlives the demo, and its agent probed the simulated libcuda only.
        # (The stranger allocated before the agent started, so even an agent that probed its
        # libcuda would not show it: the attachments in the log are what says it was left alone.)
        events = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
        attached = {e["path"] for e in events if e["event"] == "libcuda_attached"}
        if "eBPF accounting on" in lines[1]:
            assert attached == {str(demo.SIMGPU / "libcuda.so.1")}
        else:
            assert attached == set()
        assert any(e["event"] == "agent_stopped" for e in events)
    finally:
        stranger.kill()
        if log_path is not None:
            log_path.unlink(missing_ok=True)
