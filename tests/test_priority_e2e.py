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
SERVICE_KERNELS = 20
SERVICE_PAUSE_NS = 5_000_000
SECONDS = 4.0
CONFIG = "[hog]\n\n[service]\nPriority = {priority}\n"


def service_beside_a_hog(host: Host) -> tuple[dict[str, float], dict[str, float]]:
    """The service's last line (its per-burst times) and the hog's launches, run together for SECONDS. The
    hog is two processes: at equal priorities the groups then take turns (one process each, nothing binding,
    they would share the GPU under the driver's slicing: docs/scheduler.md, "Where nothing binds")."""
    hogs = [host.run("hog", "launch-loop", "--kernel-ns", str(KERNEL_NS), "--launches-per-iter", "4",
                     "--seconds", str(SECONDS + 1.0)) for _ in range(2)]
    # Requests of 20 kernels (20 ms of work) and a sync, 5 ms apart: a service that wants the GPU most of
    # the time, so that at equal priorities it is about even with the hog in usage and waits for the
    # hog's slice (a lighter one, a slice behind, cuts it to 15 ms: docs/scheduler.md, "Which group
    # next", step 3, and the test below).
    service = host.run("service", "launch-loop", "--kernel-ns", str(KERNEL_NS), "--launches-per-iter",
                       str(SERVICE_KERNELS), "--pause-ns", str(SERVICE_PAUSE_NS), "--seconds", str(SECONDS))
    served = last_line(service, SECONDS + 60)
    return served, {"launches": sum(last_line(hog, SECONDS + 60)["launches"] for hog in hogs)}


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
    burst = SERVICE_KERNELS * KERNEL_NS / 1e9
    summary = (f"priority 0: p50 {equal['iter_p50_s'] * 1e3:.1f} ms, p99 {equal['iter_p99_s'] * 1e3:.1f} ms, hog "
               f"{equal_hog['launches']} launches; priority 10: p50 {first['iter_p50_s'] * 1e3:.1f} ms, p99 "
               f"{first['iter_p99_s'] * 1e3:.1f} ms, hog {first_hog['launches']} launches")
    print(summary)
    # What the worst bursts wait beyond their own 20 ms of kernels: at least halved by the priority (the
    # rest of the hog's slice against a poll and its drain). The typical burst: no worse.
    assert first["iter_p99_s"] - burst < 0.5 * (equal["iter_p99_s"] - burst), summary
    assert first["iter_p50_s"] <= 1.25 * equal["iter_p50_s"], summary
    # The service ran at least as many bursts, and the hog still had the rest of the GPU: the service's
    # pauses and the switches, about two thirds of what it had at equal priorities (0.61-0.68 on the
    # 2-CPU VM beside the busy suite).
    assert first["iters"] >= 0.9 * equal["iters"], summary
    assert first_hog["launches"] >= 0.5 * equal_hog["launches"], summary


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
    print(summary)
    # The hog keeps most of what it has at equal priorities: it loses a switch gap each way per
    # request (the poll that sees the service idle, the hog's drain, a wake-up). 0.81-0.89 of it on the
    # 2-CPU VM, idle or beside two CPU hogs (2026-11-26); the bug this guards against left it 0.2.
    assert hog_share >= 0.7 * equal_hog, summary
    # Its requests' wait is not compared here: a service this light is a slice behind the hog in usage
    # at equal priorities too, and then waits for the hog's first 15 ms at most, about what a priority
    # gives it (docs/scheduler.md, "Which group next", step 3; on the 2-CPU VM beside the busy suite,
    # p99 5-7 ms at equal priorities and 8-9 ms at 10). The test above compares the waits where they differ.
