"""The agent's /metrics on the simulated GPU, against a golden copy, and through `promtool check metrics`.

The golden file holds every family's HELP and TYPE and every series' labels; values that vary from
run to run (times, counters, the simulated GPU's UUID) are normalised (tests/golden_metrics.py, which
also says how the two are compared: by meaning, not by how numbers are written). Regenerate it with
GEMTRACE_UPDATE_GOLDEN=1 after a deliberate change, and read the diff. Then the agent behind
--listen unix:PATH and --web-config (the options themselves: tests/test_metrics_access.py).
"""

from __future__ import annotations

import os
import shutil
import signal
import ssl
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
from agent_host import Host, stop
from golden_metrics import GOLDEN, differences, normalise
from test_metrics_access import PASSWORD, basic_auth_yaml, get, make_cert, write_config
from testkit import free_port

from gemtrace import top
from gemtrace.metrics import CATALOGUE

pytestmark = pytest.mark.e2e

T = TypeVar("T")


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


# -- the agent itself, on the simulated GPU ---------------------------------------------------------

def _agent(host: Host, *options: str) -> subprocess.Popen[bytes]:
    log = host.tmp / "agent.log"
    return subprocess.Popen([sys.executable, "-m", "gemtrace.cli", "agent", "--config", str(host.config),
                             "--state-dir", str(host.state_dir), "--no-ebpf", *options],
                            env=host.env(), stdout=subprocess.DEVNULL, stderr=log.open("wb"))


def _until(agent: subprocess.Popen[bytes], host: Host, read: Callable[[], T]) -> T:
    deadline = time.monotonic() + 60
    while True:
        assert agent.poll() is None, (host.tmp / "agent.log").read_text()
        try:
            return read()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_the_agent_serves_its_metrics_only_as_its_options_allow(host: Host, tmp_path: Path) -> None:
    sock = tmp_path / "metrics.sock"
    agent = _agent(host, "--listen", f"unix:{sock}", "--listen-mode", "0600")
    try:
        text = _until(agent, host, lambda: top.fetch(f"unix:{sock}"))
        assert "gemtrace_agent_info" in text
        assert stat.S_IMODE(sock.stat().st_mode) == 0o600
        assert '"event": "metrics_serving"' in (host.tmp / "agent.log").read_text()
    finally:
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=20) == 0
    assert not sock.exists()

    cert, key = make_cert(tmp_path, "localhost")
    config = write_config(tmp_path, f"tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n"
                          + basic_auth_yaml(prometheus=PASSWORD))
    port = free_port()
    agent = _agent(host, "--listen", f"127.0.0.1:{port}", "--web-config", str(config))
    url = f"https://localhost:{port}/metrics"
    trusting = ssl.create_default_context(cafile=str(cert))
    try:
        status, body, _ = _until(agent, host, lambda: get(url, trusting, ("prometheus", PASSWORD)))
        assert status == 200 and "gemtrace_agent_info" in body
        status, body, _ = get(url, trusting)
        assert status == 401 and "gemtrace_" not in body
    finally:
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=20) == 0
