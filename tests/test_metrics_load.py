"""/metrics under load and under failure, over real sockets: a legitimate scrape is answered within 1 s
while an unprivileged user's 200 clients scrape back to back or hold connections open (plain and TLS),
and a collector that raises loses only its own series, shows in gemtrace_scrape_collector_success and
is logged once, not per scrape. Who may read /metrics: tests/test_metrics_access.py."""

from __future__ import annotations

import json
import statistics
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from test_metrics_access import SYSTEM_PYTHON, get, make_cert, write_config
from test_trust import Adversary, adversary  # noqa: F401 (a fixture)
from test_webhook_server import flood

from gemtrace.agent import collectors, web_config
from gemtrace.agent.exporter import MIN_COLLECT_INTERVAL_SECONDS, Exporter

DEADLINE_S = 1.0
CLIENTS = 200
PIDS = 200  # a host's worth of gated processes: series enough that a collection is not free


class Processes(Collector):
    """Per-process series as the agent's processes collector makes them, for PIDS processes."""

    def collect(self) -> Iterator[Metric]:
        for name in ("gemtrace_test_process_memory_bytes", "gemtrace_test_process_gpu_seconds"):
            family = GaugeMetricFamily(name, "A per-process series.", labels=["gpu", "group", "pid", "comm"])
            for pid in range(PIDS):
                family.add_metric(["GPU-0", f"group{pid % 8}", str(1000 + pid), "python3"], float(pid))
            yield family


class Broken(Collector):
    def __init__(self) -> None:
        self.calls = 0

    def collect(self) -> Iterator[Metric]:
        self.calls += 1
        yield GaugeMetricFamily("gemtrace_test_half_made", "Yielded before the failure.", value=1.0)
        raise RuntimeError("the view it reads is gone")


def isolated_registry(**named: Collector) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collectors.Isolated(named))
    return registry


@pytest.fixture
def exporter(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Exporter]:
    web = None
    if getattr(request, "param", "plain") == "tls":
        cert, key = make_cert(tmp_path, "localhost")
        web = web_config.load(write_config(tmp_path, f"tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n"))
    served = Exporter(isolated_registry(processes=Processes()), "127.0.0.1:0", web)
    served.start()
    yield served
    served.stop()


# The legitimate scraper, a process of its own as Prometheus is: in the test's process it would share
# the GIL with the server it times.
TIMED_SCRAPES = r"""
import json, ssl, sys, time, urllib.request
url, count, needle = sys.argv[1], int(sys.argv[2]), sys.argv[3]
context = ssl._create_unverified_context() if url.startswith("https") else None
times = []
for _ in range(count):
    began = time.monotonic()
    with urllib.request.urlopen(url, timeout=30, context=context) as r:
        body = r.read().decode()
    times.append(time.monotonic() - began)
    assert needle in body, body[:500]
    time.sleep(0.05)
print(json.dumps(times))
"""
SERIES = 'gemtrace_test_process_memory_bytes{comm="python3",gpu="GPU-0",group="group7",pid="1199"} 199.0'


def timed_scrapes(exporter: Exporter, count: int) -> list[float]:
    """Seconds of `count` scrapes, one after the other, each checked for the last process's series."""
    done = subprocess.run([SYSTEM_PYTHON, "-c", TIMED_SCRAPES, f"{exporter.scheme}://{exporter.address}/metrics",
                           str(count), SERIES], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    times: list[float] = json.loads(done.stdout)
    return times


@pytest.mark.e2e
@pytest.mark.parametrize("exporter", ["plain", "tls"], indirect=True)
@pytest.mark.parametrize("held", ["idle", "slow"])
def test_a_scrape_is_answered_within_a_second_while_200_other_clients_scrape_or_hold_connections(
        exporter: Exporter, adversary: Adversary, held: str) -> None:  # noqa: F811 (the fixture)
    """Side by side: scrapes with nobody else connected, then while the user scrapes back to back from
    half the clients and holds the other half's connections idle (or trickles their heads)."""
    tls = exporter.scheme == "https"
    port = int(exporter.address.rpartition(":")[2])
    quiet = timed_scrapes(exporter, 3)
    attackers = [flood(adversary, port, "scrape", CLIENTS // 2, tls), flood(adversary, port, held, CLIENTS // 2, tls)]
    try:
        time.sleep(1.0)  # the scrapers under way
        loaded = timed_scrapes(exporter, 10)
    finally:
        for attacker in attackers:
            attacker.kill()
            attacker.wait()
    assert max(loaded) < DEADLINE_S, (f"scrapes took {[round(t, 3) for t in loaded]} s under the load, "
                                      f"{statistics.median(quiet):.3f} s alone")


@pytest.mark.unit
def test_a_collector_that_raises_loses_only_its_own_series_and_is_logged_once(tmp_path: Path) -> None:
    broken = Broken()
    served = Exporter(isolated_registry(processes=Processes(), broken=broken), "127.0.0.1:0")
    served.start()
    url = f"http://{served.address}/metrics"
    try:
        with structlog.testing.capture_logs() as logged:
            scrapes = []
            for _ in range(3):
                status, body, _ = get(url)
                assert status == 200
                scrapes.append(body)
                time.sleep(MIN_COLLECT_INTERVAL_SECONDS)
    finally:
        served.stop()
    assert broken.calls == 3
    for body in scrapes:
        families = {f.name: f for f in text_string_to_metric_families(body)}
        assert len(families["gemtrace_test_process_memory_bytes"].samples) == PIDS
        # What the broken collector yielded before it raised is not trusted: none of its series.
        assert "gemtrace_test_half_made" not in families
        success = {s.labels["collector"]: s.value for s in families["gemtrace_scrape_collector_success"].samples}
        assert success == {"processes": 1.0, "broken": 0.0}
        durations = {s.labels["collector"]: s.value
                     for s in families["gemtrace_scrape_collector_duration_seconds"].samples}
        assert set(durations) == {"processes", "broken"} and all(0 <= d < 5 for d in durations.values())
    failures = [e for e in logged if e["event"].startswith("collector_")]
    assert [e["event"] for e in failures] == ["collector_failed"], failures
    assert failures[0]["collector"] == "broken" and "the view it reads is gone" in failures[0]["error"]


@pytest.mark.unit
def test_a_failing_collector_is_logged_again_only_after_the_interval_and_when_it_recovers() -> None:
    now = [0.0]
    failing = [True]

    class Flaky(Collector):
        def collect(self) -> Iterator[Metric]:
            if failing[0]:
                raise OSError("gone")
            yield GaugeMetricFamily("gemtrace_test_flaky", "Back.", value=1.0)

    isolated = collectors.Isolated({"flaky": Flaky()}, clock=lambda: now[0])
    with structlog.testing.capture_logs() as logged:
        for t in range(0, 1200, 15):  # a scrape every 15 s for 20 minutes
            now[0] = float(t)
            list(isolated.collect())
        failing[0] = False
        names = [m.name for m in isolated.collect()]
    assert "gemtrace_test_flaky" in names
    events = [(e["event"], e.get("failed_scrapes"), e.get("failed_scrapes_since_last_line")) for e in logged]
    interval_scrapes = int(collectors.FAILURE_LOG_INTERVAL_S / 15)
    assert events == [("collector_failed", None, None),
                      ("collector_still_failing", interval_scrapes, None),
                      ("collector_recovered", None, 80 - 1 - interval_scrapes)], events
