"""The agent's /metrics on the simulated GPU, against a golden copy, and through `promtool check metrics`.

The golden file holds every family's HELP and TYPE and every series' labels; values that vary from
run to run (times, counters, the simulated GPU's UUID) are normalised (tests/golden_metrics.py, which
also says how the two are compared: by meaning, not by how numbers are written). Regenerate it with
GEMTRACE_UPDATE_GOLDEN=1 after a deliberate change, and read the diff.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from agent_host import Host, stop
from golden_metrics import GOLDEN, differences, normalise

from gemtrace.metrics import CATALOGUE

pytestmark = pytest.mark.e2e


def test_metrics_match_the_golden_copy_and_pass_promtool(host: Host) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is missing: apt-get install prometheus (sudo make prereqs does)", pytrace=False)
    agent = host.start_agent()
    try:
        text = agent.metrics()
    finally:
        stop(agent)
    check = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    families = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}
    # Every family the agent exports is in the catalogue.
    known = set(CATALOGUE)
    assert families <= known, families - known
    if os.environ.get("GEMTRACE_UPDATE_GOLDEN"):
        GOLDEN.write_text(normalise(text))
    found = differences(GOLDEN.read_text(), text)
    assert not found, ("/metrics and tests/golden/metrics.txt differ in meaning:\n" + "\n".join(found)
                       + "\nAfter a deliberate change, run with GEMTRACE_UPDATE_GOLDEN=1 and read the diff.")
