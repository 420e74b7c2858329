"""The agent's log lines carry the journal's priority prefix only when stderr is the journal.

Each case runs a small program in a subprocess whose stderr is a file: JOURNAL_STREAM names that
file's device:inode (as systemd names the journal's socket), or another one, or nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from simgpu_env import REPO

from gemtrace.eventlog import is_journal_stream

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
