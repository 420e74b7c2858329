"""Priority between groups end to end: the real `gemtrace agent` on the simulated GPU, gated clients
started with `gemtrace run`. A service answering short requests (a burst of kernels, a sync, a pause)
shares the GPU with a hog; with the service's group at a higher priority its wait per burst is a poll
and the hog's drain, not the rest of the hog's slice. Both settings are measured in the same test, on
the same machine, and compared by ratio: what a loaded CI machine adds to both cancels out."""

from __future__ import annotations

import pytest
from agent_host import Host, stop
from simgpu_env import last_line
from testkit import wait_until

pytestmark = pytest.mark.e2e

KERNEL_NS = 1_000_000
SECONDS = 4.0
CONFIG = "[hog]\n\n[service]\nPriority = {priority}\n"


def service_beside_a_hog(host: Host) -> tuple[dict[str, float], dict[str, float]]:
    """The service's last line (its per-burst times) and the hog's, run together for SECONDS."""
    hog = host.run("hog", "launch-loop", "--kernel-ns", str(KERNEL_NS), "--launches-per-iter", "4",
                   "--seconds", str(SECONDS + 1.0))
    # Two kernels (2 ms of work) and a sync every 30 ms: about a tenth of the slices' length each.
    service = host.run("service", "launch-loop", "--kernel-ns", str(KERNEL_NS), "--launches-per-iter", "2",
                       "--pause-ns", str(28_000_000), "--seconds", str(SECONDS))
    return last_line(service, SECONDS + 60), last_line(hog, SECONDS + 60)


def test_a_higher_priority_service_waits_a_poll_per_burst_not_a_slice(host: Host) -> None:
    host.config.write_text(CONFIG.format(priority=0))
    agent = host.start_agent()
    try:
        equal, equal_hog = service_beside_a_hog(host)
        host.config.write_text(CONFIG.format(priority=10))
        wait_until("the reload", lambda: 'gemtrace_config_reloads_total{result="success"} 2.0' in agent.metrics())
        first, first_hog = service_beside_a_hog(host)
    finally:
        assert stop(agent) == 0
    burst = 2 * KERNEL_NS / 1e9
    summary = (f"priority 0: p50 {equal['iter_p50_s'] * 1e3:.1f} ms, p99 {equal['iter_p99_s'] * 1e3:.1f} ms, hog "
               f"{equal_hog['launches']} launches; priority 10: p50 {first['iter_p50_s'] * 1e3:.1f} ms, p99 "
               f"{first['iter_p99_s'] * 1e3:.1f} ms, hog {first_hog['launches']} launches")
    # What the worst bursts wait beyond their own 2 ms of kernels: at least halved by the priority (the
    # hog's slice, 60 ms, against a poll and its drain; about a third here). The typical burst
    # finds the GPU free either way (the service holds it while it seems busy): no worse.
    assert first["iter_p99_s"] - burst < 0.5 * (equal["iter_p99_s"] - burst), summary
    assert first["iter_p50_s"] <= 1.25 * equal["iter_p50_s"], summary
    # The service ran as many bursts (it paces itself), and the hog still had the rest of the GPU.
    assert first["iters"] >= 0.9 * equal["iters"], summary
    assert first_hog["launches"] >= 0.7 * equal_hog["launches"], summary


SHORT_KERNEL_NS = 50_000
SHORT_KERNELS = 12


def short_service_beside_a_hog(host: Host, priority: int) -> tuple[dict[str, float], float]:
    """The short service's last line and the hog's share of the GPU, the service's group at `priority`."""
    host.config.write_text(CONFIG.format(priority=priority))
    agent = host.start_agent()
    try:
        hog = host.run("hog", "launch-loop", "--kernel-ns", str(KERNEL_NS), "--launches-per-iter", "4",
                       "--seconds", str(SECONDS + 1.0))
        service = host.run("service", "launch-loop", "--kernel-ns", str(SHORT_KERNEL_NS), "--launches-per-iter",
                           str(SHORT_KERNELS), "--pause-ns", str(20_000_000), "--seconds", str(SECONDS))
        served, hogged = last_line(service, SECONDS + 60), last_line(hog, SECONDS + 60)
    finally:
        assert stop(agent) == 0
    return served, hogged["launches"] * KERNEL_NS / 1e9 / hogged["elapsed_s"]


def test_a_higher_priority_service_is_not_charged_through_its_pauses(host: Host) -> None:
    """A service whose requests (12 kernels of 50 us, a sync) end well within a poll, 20 ms apart, at
    a higher priority beside a hog: it is idle at the scheduler's next look after each request, so the
    hog gets the GPU back at once and runs for all but the service's own time and the switches. Before
    the gate stored when a burst opened, the service counted as busy through its pauses and kept the
    GPU slice after slice (on the simulated GPU: the service charged 0.80, the hog 0.17). Compared
    with the same pair at equal priorities in the same test: a busy host slows both alike."""
    equal, equal_hog = short_service_beside_a_hog(host, 0)
    served, hog_share = short_service_beside_a_hog(host, 10)
    summary = (f"priority 0: p50 {equal['iter_p50_s'] * 1e3:.1f} ms, p99 {equal['iter_p99_s'] * 1e3:.1f} ms, hog "
               f"{equal_hog:.3f} of the GPU; priority 10: p50 {served['iter_p50_s'] * 1e3:.1f} ms, p99 "
               f"{served['iter_p99_s'] * 1e3:.1f} ms, hog {hog_share:.3f}")
    # The hog keeps most of what it has at equal priorities: it loses a switch gap each way per
    # request (the poll that sees the service idle, the hog's drain, a wake-up). 0.81-0.89 of it on the
    # 2-CPU VM, idle or beside two CPU hogs (2026-11-26); the bug this guards against left it 0.2.
    assert hog_share >= 0.7 * equal_hog, summary
    # And the worst request waits at most a poll, the hog's drain (its 4 ms between syncs) and a wake-up:
    # less than the typical request at equal priorities, which waits for the hog's slice (p99 8-26 ms
    # against a p50 of 46 ms on the same VM).
    assert served["iter_p99_s"] < equal["iter_p50_s"], summary
