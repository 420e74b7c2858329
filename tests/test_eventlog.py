"""The agent's log lines carry the journal's priority prefix only when stderr is the journal.

Each case runs a small program in a subprocess whose stderr is a file: JOURNAL_STREAM names that
file's device:inode (as systemd names the journal's socket), or another one, or nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from simgpu_env import REPO
from structlog.testing import capture_logs

from gemtrace.eventlog import UserLines, is_journal_stream

pytestmark = pytest.mark.unit

PROGRAM = """
import structlog
from gemtrace import eventlog
eventlog.configure("debug", json=True)
log = structlog.get_logger("test")
log.debug("a_debug")
log.info("an_info")
log.warning("a_warning")
log.error("an_error")
try:
    raise ValueError("boom")
except ValueError:
    log.exception("an_exception")
"""


def _log_lines(tmp_path: Path, journal_stream: str | None) -> list[str]:
    err = tmp_path / "stderr"
    env = {k: v for k, v in os.environ.items() if k != "JOURNAL_STREAM"}
    env["PYTHONPATH"] = str(REPO)
    with err.open("wb") as f:
        if journal_stream == "this file":
            st = os.fstat(f.fileno())
            journal_stream = f"{st.st_dev}:{st.st_ino}"
        if journal_stream is not None:
            env["JOURNAL_STREAM"] = journal_stream
        subprocess.run([sys.executable, "-c", PROGRAM], env=env, stderr=f, check=True, timeout=60)
    return [line for line in err.read_text().splitlines() if line.startswith(("<", "{"))]


def test_each_level_gets_its_syslog_priority_when_stderr_is_the_journal(tmp_path: Path) -> None:
    lines = _log_lines(tmp_path, "this file")
    got = [(line[: line.index(">") + 1], json.loads(line[line.index(">") + 1:])["event"]) for line in lines]
    assert got == [("<7>", "a_debug"), ("<6>", "an_info"), ("<4>", "a_warning"), ("<3>", "an_error"),
                   ("<3>", "an_exception")]


@pytest.mark.parametrize("journal_stream", [None, "", "1:1", "not-a-device"])
def test_no_prefix_when_stderr_is_not_the_journal(tmp_path: Path, journal_stream: str | None) -> None:
    lines = _log_lines(tmp_path, journal_stream)
    assert [json.loads(line)["event"] for line in lines] == ["a_debug", "an_info", "a_warning", "an_error",
                                                              "an_exception"]


def test_journal_stream_must_name_both_device_and_inode(tmp_path: Path) -> None:
    f = tmp_path / "x"
    f.write_text("")
    st = os.stat(f)
    assert is_journal_stream(f"{st.st_dev}:{st.st_ino}", st)
    assert not is_journal_stream(f"{st.st_dev}:{st.st_ino + 1}", st)
    assert not is_journal_stream(f"{st.st_dev + 1}:{st.st_ino}", st)
    assert not is_journal_stream(f"{st.st_dev}", st)
    assert not is_journal_stream(None, st)


class FakeWorld:
    """UserLines' clock and timer: time moves when the test says, a scheduled action runs when it calls it."""

    def __init__(self) -> None:
        self.now = 0.0
        self.scheduled: list[tuple[float, Callable[[], None]]] = []

    def schedule(self, seconds: float, action: Callable[[], None]) -> None:
        self.scheduled.append((seconds, action))


def test_a_flooding_uid_logs_its_burst_then_a_line_a_second_and_one_summary_counting_the_rest() -> None:
    world = FakeWorld()
    lines = UserLines(burst=20, line_seconds=1.0, summary_seconds=10.0, clock=lambda: world.now,
                      schedule=world.schedule)
    emitted: list[tuple[str, dict[str, object]]] = []

    def emit(event: str, **values: object) -> None:
        emitted.append((event, values))

    for k in range(1000):  # 1000 bad requests from uid 1000 over 5 seconds
        world.now = k * 0.005
        lines.log(emit, 1000, "slot_request_refused", pid=7, size=3)
        if k == 500:
            assert lines.log(emit, 0, "slot_request_refused", pid=1, size=0)  # another uid in the middle
    assert [v["uid"] for _, v in emitted].count(0) == 1
    flooded = [v for _, v in emitted if v["uid"] == 1000]
    assert len(flooded) == 20 + 4  # the burst, then one a second over 4.995 s
    assert [seconds for seconds, _ in world.scheduled] == [10.0]  # one summary armed, not one per drop
    world.now = 10.0
    with capture_logs() as summary:
        world.scheduled[0][1]()
    assert summary == [{"event": "log_lines_dropped", "log_level": "warning", "uid": 1000, "dropped": 1000 - 24,
                        "events": {"slot_request_refused": 1000 - 24}, "seconds": 10.0 - 0.1,
                        "consequence": "this user's input triggered more than 20 lines at once or one a 1 s; the "
                        "rest were counted, not logged"}]
    with capture_logs() as again:
        lines.summarize()
    assert again == []  # counted once
    world.now = 40.0
    lines.summarize()
    assert lines._buckets == {}  # quiet uids are forgotten


def test_a_uid_the_agent_cannot_tell_has_its_own_budget() -> None:
    world = FakeWorld()
    lines = UserLines(burst=2, clock=lambda: world.now, schedule=world.schedule)
    out: list[object] = []
    sent = [lines.log(lambda event, **v: out.append(v["uid"]), uid, "slot_socket_accept_failed")
            for uid in (None, None, None, 5)]
    assert sent == [True, True, False, True] and out == [None, None, 5]


def test_debug_enabled_says_whether_the_configured_level_is_debug() -> None:
    """The scheduler builds its debug trace only where `debug_enabled` says so: never before `configure`,
    at debug only (in a child: configuring here would change this process's logging)."""
    program = ("from gemtrace import eventlog\n"
               "print(eventlog.debug_enabled())\n"
               "for level in ('info', 'debug', 'warning'):\n"
               "    eventlog.configure(level)\n"
               "    print(eventlog.debug_enabled())\n")
    out = subprocess.run([sys.executable, "-c", program], env={**os.environ, "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, check=True, timeout=60).stdout
    assert out.split() == ["False", "False", "True", "False"]
