"""The agent's /metrics on the simulated GPU, against a golden copy, and through `promtool check metrics`.

The golden file holds every family's HELP and TYPE and every series' labels; values that vary from
run to run (times, counters, the simulated GPU's UUID) are normalised. Regenerate it with
GEMTRACE_UPDATE_GOLDEN=1 after a deliberate change, and read the diff.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from agent_host import Host, stop

from gemtrace.metrics import CATALOGUE

pytestmark = pytest.mark.e2e

GOLDEN = Path(__file__).parent / "golden" / "metrics.txt"
UUID = re.compile(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
# Values that are the same on every run of this setup (quotas, limits, totals, info, reload counts).
STABLE = re.compile(r"^gemtrace_(agent_info|gpu_info|gpu_memory_total_bytes|group_util_(min|max)_ratio|"
                    r"group_memory_limit_bytes|config_reloads_total|config_last_reload_success)\b")


def normalise(text: str) -> str:
    lines = []
    for line in text.splitlines():
        line = UUID.sub("GPU-<uuid>", line)
        if not line.startswith("#") and not STABLE.match(line):
            line = re.sub(r" \S+$", " <value>", line)
        lines.append(line)
    return "\n".join(lines) + "\n"


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
    got = normalise(text)
    if os.environ.get("GEMTRACE_UPDATE_GOLDEN"):
        GOLDEN.write_text(got)
    assert got == GOLDEN.read_text(), "run with GEMTRACE_UPDATE_GOLDEN=1 to update tests/golden/metrics.txt"
