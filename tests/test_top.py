"""`gemtrace top`: the pure part (metrics text -> Frame -> lines) against a fixture exposition
(tests/top_metrics.prom, written by prometheus-client from the catalogue's families), the plain-text
mode against a small HTTP server serving it, and the terminal mode for real inside tmux."""

from __future__ import annotations

import http.server
import io
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from testkit import wait_until

from gemtrace import contract, region, top
from gemtrace.region.server import ask

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = (Path(__file__).parent / "top_metrics.prom").read_text()
GPU = "GPU-0b1c2d3e-0000-4000-8000-000000000001"
GIB = 2**30


@pytest.mark.unit
def test_parse_builds_gpus_groups_and_processes() -> None:
    frame = top.parse(FIXTURE, taken_at=100.0)
    assert frame.agent_version == "0.1.0" and frame.config_ok is True and frame.probes_attached == 12
    (gpu,) = frame.gpus
    assert (gpu.uuid, gpu.name, gpu.index, gpu.memory_total_bytes) == (GPU, "Simulated GPU", "0", 16 * GIB)
    groups = {g.name: g for g in gpu.groups}
    assert list(groups) == ["greedy", "infer", "train"]
    train = groups["train"]
    assert (train.share, train.min_util, train.max_util) == (0.55, 0.2, 0.7)
    assert train.memory_bytes == 4 * GIB and train.memory_limit_bytes == 8 * GIB
    assert [(p.pid, p.comm, p.memory_bytes) for p in train.processes] == [(1201, "python", 3 * GIB),
                                                                         (1202, "python", GIB)]
    assert train.processes[0].gpu_seconds_total == pytest.approx(0.2)
    assert train.processes[0].kernel_share is None  # one sample: no rate yet
    assert groups["infer"].max_util == 1.0


def _set(text: str, metric: str, pid: int, value: float) -> str:
    """The exposition with one process's sample set to `value`."""
    pattern = re.compile(rf'^({metric}{{[^}}]*pid="{pid}"[^}}]*}}) \S+$', re.MULTILINE)
    new, count = pattern.subn(rf"\g<1> {value}", text)
    assert count == 1, (metric, pid)
    return new


@pytest.mark.unit
def test_rates_come_from_two_frames_and_a_reused_pid_gets_none() -> None:
    first = top.parse(FIXTURE, taken_at=100.0)
    later_text = _set(FIXTURE, "gemtrace_process_gpu_seconds_total", 1201, 1.0)
    later_text = _set(later_text, "gemtrace_process_kernel_launches_total", 1201, 500.0)
    later_text = _set(later_text, "gemtrace_process_gpu_seconds_total", 1401, 0.1)
    second = top.with_rates(first, top.parse(later_text, taken_at=102.0))
    procs = {p.pid: p for g in second.gpus[0].groups for p in g.processes}
    assert procs[1201].kernel_share == pytest.approx(0.4)
    assert procs[1201].launches_per_second == pytest.approx(200.0)
    assert procs[1202].kernel_share == pytest.approx(0.0)
    assert procs[1401].kernel_share is None  # counter went down: a new process behind an old pid


@pytest.mark.unit
def test_a_gpu_its_groups_shared_since_the_last_frame_says_how_much_of_that_time() -> None:
    first = top.parse(FIXTURE, taken_at=100.0)
    assert first.gpus[0].shared_seconds_total == 40.0 and first.gpus[0].shared is None  # one sample: no rate
    shared = f'gemtrace_gpu_shared_seconds_total{{gpu="{GPU}"}} '
    later = top.with_rates(first, top.parse(FIXTURE.replace(shared + "40.0", shared + "41.5"), taken_at=102.0))
    assert later.gpus[0].shared == pytest.approx(0.75)
    assert top.render(later, "here")[2].startswith("GPU 0  Simulated GPU  shared 75%  GPU-")
    # Turns all along (the counter stood still), or a restarted agent (it went down): no word of sharing.
    for value in ("40.0", "0.0"):
        still = top.with_rates(first, top.parse(FIXTURE.replace(shared + "40.0", shared + value), taken_at=102.0))
        assert "shared" not in top.render(still, "here")[2]


@pytest.mark.unit
@pytest.mark.parametrize(
    ("share", "lo", "hi", "bar"),
    [
        (0.5, 0.2, 0.7, "[##|##..   ]"),
        (0.0, 0.0, 1.0, "[..........]"),
        (1.0, 0.0, 1.0, "[##########]"),
        (0.3, 0.0, 0.3, "[###       ]"),
        (1.7, 0.5, 1.0, "[#####|####]"),
    ],
)
def test_share_bar_shows_share_against_min_and_max(share: float, lo: float, hi: float, bar: str) -> None:
    assert top.share_bar(share, lo, hi, 10) == bar


@pytest.mark.unit
def test_memory_bar_and_units() -> None:
    assert top.memory_bar(GIB, 4 * GIB, 8) == "[##......]"
    assert top.memory_bar(9 * GIB, 4 * GIB, 4) == "[####]"
    assert top.memory_bar(GIB, None, 3) == "[   ]"
    assert [top.human_bytes(n) for n in (512, 1536, 3 * GIB, None)] == ["512 B", "1.5 KiB", "3.0 GiB", "-"]


@pytest.mark.unit
def test_render_lists_each_group_with_its_processes() -> None:
    first = top.parse(FIXTURE, taken_at=100.0)
    frame = replace(first, config_ok=False)
    lines = top.render(frame, "http://x/metrics", width=120)
    text = "\n".join(lines)
    assert "agent 0.1.0" in lines[0] and "RESOURCE FILE FAILED TO LOAD" in lines[0]
    assert f"GPU 0  Simulated GPU  {GPU}  memory 5.0 GiB / 16.0 GiB" in text
    train = next(line for line in lines if line.lstrip().startswith("train"))
    assert "55%" in train and "20%" in train and "70%" in train and "8.0 GiB" in train
    idx = lines.index(train)
    assert "1201 python" in lines[idx + 1] and "3.0 GiB" in lines[idx + 1]
    # A group without a MemoryLimit: its bar is against the whole GPU (0.5 of 16 GiB), and it says so.
    gpu = frame.gpus[0]
    unlimited = [replace(g, memory_limit_bytes=None) if g.name == "infer" else g for g in gpu.groups]
    lines = top.render(replace(frame, gpus=[replace(gpu, groups=unlimited)]), "u", width=120)
    infer = next(line for line in lines if line.lstrip().startswith("infer"))
    assert infer.endswith("[..........]   whole GPU"), infer
    assert all(len(line) <= 60 for line in top.render(frame, "u", width=60))


@pytest.mark.unit
def test_render_says_when_the_agent_cannot_be_reached() -> None:
    frame = top.snapshot("http://127.0.0.1:1/metrics", None)
    assert frame.error.startswith("cannot read http://127.0.0.1:1/metrics")
    assert "gemtrace agent" in top.render(frame, "u")[-1]


@pytest.fixture
def agent_url() -> Iterator[str]:
    """A stand-in for the agent's /metrics serving the fixture."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            body = FIXTURE.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.unit
def test_once_prints_one_plain_frame(agent_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert top.main(["--once", "--listen", agent_url]) == 0
    out = capsys.readouterr().out
    assert out.count("gemtrace top") == 1 and "train" in out and "1401 hog" in out


@pytest.mark.unit
def test_plain_mode_repeats_frames_with_rates(agent_url: str) -> None:
    """Not a terminal and no --once: frames follow one another, like `top -b`."""
    proc = subprocess.Popen([sys.executable, "-m", "gemtrace.top", "--listen", agent_url, "--interval", "0.2"],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        headers = 0
        lines = []
        deadline = time.monotonic() + 20
        while headers < 3 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            lines.append(line)
            headers += line.startswith("gemtrace top")
        assert headers == 3, "".join(lines)
        # Second frame on: a rate (the fixture's counters stand still, so 0%).
        assert any("kernel   0%" in line for line in lines), "".join(lines)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.mark.unit
def test_plain_once_fails_when_the_agent_is_unreachable() -> None:
    buf = io.StringIO()
    assert top._plain("http://127.0.0.1:1/metrics", once=True, interval=0, out=buf) == 1
    assert "cannot read" in buf.getvalue()


def _tmux() -> str:
    """A missing prerequisite fails, everywhere: a skip would pass a run that tested nothing."""
    path = shutil.which("tmux")
    if path is None:
        pytest.fail("tmux not found: apt-get install tmux (sudo make prereqs does); the terminal mode is tested "
                    "inside it", pytrace=False)
    return path


@pytest.mark.e2e
def test_terminal_mode_in_tmux_refreshes_and_quits_on_q(agent_url: str, tmp_path: Path) -> None:
    tmux = _tmux()
    socket = str(tmp_path / "tmux.sock")
    done = tmp_path / "exit-status"
    cmd = f"{sys.executable} -m gemtrace.top --listen {agent_url}; echo $? > {done}"
    base = [tmux, "-S", socket]
    subprocess.run([*base, "new-session", "-d", "-x", "120", "-y", "40", "-c", str(ROOT), cmd], check=True)
    try:
        def pane() -> str:
            return subprocess.run([*base, "capture-pane", "-p"], capture_output=True, text=True).stdout

        deadline = time.monotonic() + 20
        screen = ""
        while time.monotonic() < deadline:
            screen = pane()
            if "1201 python" in screen and "kernel   0%" in screen:  # a second frame drew rates
                break
            time.sleep(0.2)
        assert "1201 python" in screen and "q quits" in screen, screen
        assert "kernel   0%" in screen, screen
        first_clock = screen.splitlines()[0][-8:]
        # Refreshed every second: the clock in the first line changes within 2.5 s.
        wait_until(f"the clock of the first line to change from {first_clock}",
                   lambda: (pane().splitlines() or [""])[0][-8:] != first_clock, timeout=2.5, step=0.1)
        subprocess.run([*base, "send-keys", "q"], check=True)
        wait_until("`gemtrace top` to quit on q and its shell to write the exit status", done.exists, timeout=10,
                   step=0.1)
        assert done.read_text().strip() == "0"
    finally:
        subprocess.run([*base, "kill-server"], capture_output=True)


def _layout_with(busy_s: float, launches: int) -> tuple[region.RegionLayout, region.SlotTableLayout]:
    layout, table = region.RegionLayout(), region.SlotTableLayout()
    layout.header.n_gpus = 1
    layout.gpus[0].uuid = GPU.encode()
    layout.gpus[0].memory_total = 16 * GIB
    for index, (name, lo, hi, limit) in enumerate([("train", 0.2, 0.7, 4 * GIB), ("idle", 0.0, 1.0, None)]):
        g = layout.groups[index]
        g.name, g.defined = name.encode(), 1
        g.min_util_ppm, g.max_util_ppm = round(lo * region.UTIL_ONE), round(hi * region.UTIL_ONE)
        g.memory_limit = region.NO_LIMIT if limit is None else limit
    layout.groups[5].name = b"dropped"  # undefined: no longer in the resource file
    for slot_index, (pid, busy) in enumerate([(4242, busy_s), (4243, 0.0)]):
        slot = table.slots[slot_index + 3]
        slot.pid, slot.gpu_mask, slot.comm = pid, 1, b"python"
        layout.assigned[slot_index + 3].pid, layout.assigned[slot_index + 3].group = pid, 0
        slot.memory[0], slot.busy_ns[0], slot.launches[0] = GIB, int(busy * 1e9), launches
    table.slots[9].pid = 4244  # not assigned yet: not shown
    return layout, table


@pytest.mark.unit
def test_region_snapshot_gives_groups_processes_and_shares_from_rates() -> None:
    first = top.from_region(*_layout_with(1.0, 100), taken_at=10.0)
    (gpu,) = first.gpus
    assert (gpu.uuid, gpu.memory_total_bytes) == (GPU, 16 * GIB)
    assert [g.name for g in gpu.groups] == ["idle", "train"]
    idle, train = gpu.groups
    assert idle.memory_limit_bytes is None and idle.processes == ()
    assert (train.min_util, train.max_util, train.memory_limit_bytes) == (0.2, 0.7, 4 * GIB)
    assert [p.pid for p in train.processes] == [4242, 4243] and train.memory_bytes == 2 * GIB
    second = top.with_rates(first, top.from_region(*_layout_with(2.0, 400), taken_at=12.0))
    train = second.gpus[0].groups[1]
    assert train.processes[0].kernel_share == pytest.approx(0.5)
    assert train.processes[0].launches_per_second == pytest.approx(150)
    assert train.share == pytest.approx(0.5)  # the sum of its processes' rates


@pytest.mark.unit
def test_once_reads_a_region_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    r = region.Region.create(tmp_path)
    try:
        r.set_gpus([(GPU, 16 * GIB)])
        r.set_group("train", 4 * GIB, 0.2, 0.7)
        reply, fds = ask(tmp_path, contract.ATTACH_JOIN)  # a gate's ask makes our user's chunk
        for fd in fds:
            os.close(fd)
        index = reply.entries[0].chunk * contract.CHUNK_SLOTS
        slot = r.slots[index]
        slot.gpu_mask, slot.comm, slot.memory[0] = 1, b"trainer", 3 * GIB
        slot.pid = 777
        r.assign(index, 777, 0)
        assert top.main(["--once", "--state-dir", str(tmp_path)]) == 0  # reads the chunks from the agent's socket
    finally:
        r.close()
    out = capsys.readouterr().out
    assert "train" in out and "777 trainer" in out and "3.0 GiB" in out
    assert top.main(["--once", "--state-dir", str(tmp_path / "nowhere")]) == 1
    assert "cannot read the region" in capsys.readouterr().out
