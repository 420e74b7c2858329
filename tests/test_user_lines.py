"""Issue 25: a user's garbage on the attach socket cannot flood the agent's log. A real unprivileged
user (test_trust's) sends hundreds of malformed requests to the real agent; its lines are bounded by
the per-uid budget (gemtrace/eventlog.py), one summary counts every dropped one, and root's line right
after the flood still appears."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from agent_host import Host, Running
from simgpu_env import REPO
from test_trust import Adversary, adversary, agent, as_user, host  # noqa: F401  (fixtures)
from testkit import wait_until

from gemtrace import contract, eventlog

pytestmark = pytest.mark.e2e

# Sends argv[2] malformed requests, one connection each, reading every answer (so none fails on the
# agent's side); prints how many were answered.
GARBAGE = r"""
import socket, sys
answered = 0
for _ in range(int(sys.argv[2])):
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.connect(sys.argv[1])
        s.send(b"not a request")
        answered += bool(s.recv(4096))
print(answered)
"""


def refusals(log: str) -> list[dict[str, object]]:
    events = (json.loads(line) for line in log.splitlines() if line.startswith("{"))
    return [e for e in events if e["event"] in ("attach_refused", "log_lines_dropped")]


def test_a_users_garbage_logs_a_bounded_number_of_lines_and_one_summary_with_the_count(
        adversary: Adversary, host: Host, agent: Running) -> None:  # noqa: F811
    sent = 400
    socket_path = str(host.state_dir / contract.ATTACH_SOCKET)
    started = time.monotonic()
    out = as_user(adversary, host, sys.executable, "-c", GARBAGE, socket_path, str(sent), PYTHONPATH=str(REPO))
    assert (out.returncode, out.stdout) == (0, f"{sent}\n"), out.stderr
    mine = subprocess.run([sys.executable, "-c", GARBAGE, socket_path, "1"], env=host.env(PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=60)  # root, right after: a budget of its own
    assert mine.stdout == "1\n", mine.stderr
    flood_seconds = time.monotonic() - started
    summary = wait_until("the summary of the dropped lines", lambda: [
        e for e in refusals(agent.log.read_text()) if e["event"] == "log_lines_dropped"],
        timeout=eventlog.SUMMARY_SECONDS + 10)
    lines = refusals(agent.log.read_text())
    theirs = [e for e in lines if e["event"] == "attach_refused" and e["uid"] == adversary.uid]
    assert 0 < len(theirs) <= eventlog.USER_BURST + flood_seconds / eventlog.LINE_SECONDS + 1
    assert [e for e in lines if e["event"] == "attach_refused" and e["uid"] == 0] != []
    assert [(e["uid"], e["dropped"], e["events"]) for e in summary] == [
        (adversary.uid, sent - len(theirs), {"attach_refused": sent - len(theirs)})]

