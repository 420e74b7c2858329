"""Production and opportunistic work on one GPU end to end: the real `gemtrace agent` on the simulated
GPU, gated clients started with `gemtrace run`. A group with `Opportunistic = yes` runs beside the
production groups present on its GPU rather than taking turns with them (docs/scheduler.md,
"Production and opportunistic work"): its gates keep GT_BESIDE_KERNELS kernels queued while a
production process has work queued, and a short time's worth otherwise.

The simulated GPU runs every process's kernels one at a time in order of arrival, so what a
production kernel waits is exactly the opportunistic work queued ahead of it: the tests read it off
the device's timeline (SIMGPU_SYNC_LOG: each synchronisation's wait), which a busy host does not
change, and compare throughputs only side by side within one test."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from agent_host import Host, stop
from simgpu_env import last_line

from gemtrace import contract

pytestmark = pytest.mark.e2e

CONFIG = "[train]\nOpportunistic = yes\n\n[service]\n"
SECONDS = 3.0


def sync_waits(log: Path, pid: int) -> list[int]:
    """How long each synchronisation of `pid` waited on the device's timeline, in order (ns)."""
    if not log.exists():
        return []
    return [c["wait_ns"] for c in map(json.loads, log.read_text().splitlines()) if c["pid"] == pid]


def percentile(values: list[int], q: float) -> float:
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])


SHORT_KERNEL_NS = 20_000


def opportunistic_rates(host: Host) -> tuple[float, float]:
    """Kernels a second of two loops of 20 us kernels (200 between syncs) in the opportunistic group,
    run at the same time: on GPU 0 beside a production process that launched once and then idles,
    and on GPU 1 alone."""
    host.sim.devices = 2
    host.config.write_text(CONFIG)
    agent = host.start_agent()
    service = None
    try:
        service = host.run("service", "launch-per-line", "--kernel-ns", "1000", "--device", "0", stdin=subprocess.PIPE)
        assert service.stdin is not None and service.stdout is not None
        assert json.loads(service.stdout.readline())["ready"]
        service.stdin.write(b"\n")
        service.stdin.flush()
        assert "returned_ns" in json.loads(service.stdout.readline())
        loops = [host.run("train", "launch-loop", "--kernel-ns", str(SHORT_KERNEL_NS), "--launches-per-iter", "200",
                          "--seconds", str(SECONDS), "--device", str(device)) for device in (0, 1)]
        beside, alone = (last_line(loop, SECONDS + 60) for loop in loops)
    finally:
        if service is not None:
            service.communicate(b"", timeout=30)
        assert stop(agent) == 0
    return beside["launches"] / beside["elapsed_s"], alone["launches"] / alone["elapsed_s"]


def test_an_opportunistic_group_beside_an_idle_production_group_runs_at_full_speed(host: Host) -> None:
    """Beside a production process that has nothing queued, the opportunistic group's queue is
    bounded in time (half a millisecond), not in kernels: a loop of 20 us kernels keeps the GPU fed,
    where two kernels queued would let it run dry at each of the loop's wake-ups. Compared with the
    same loop alone on another GPU at the same time, so that a busy host slows both alike."""
    beside, alone = opportunistic_rates(host)
    assert beside >= 0.8 * alone, f"{beside:.0f} kernels/s beside an idle service, {alone:.0f} alone"


KERNEL_NS = 1_000_000
SERVICE_KERNELS = 2


def service_waits(host: Host, with_training: bool, beside_kernels: int | None = None,
                  ) -> tuple[list[int], dict[str, float] | None]:
    """The service's waits per request on the device's timeline (2 kernels of 1 ms and a sync every
    20 ms), and the opportunistic training loop's last line (1 ms kernels, 50 between syncs; with
    GEMTRACE_BESIDE_KERNELS=`beside_kernels` where given)."""
    log = host.tmp / f"sync-{with_training}-{beside_kernels}.log"
    agent = host.start_agent()
    train = None
    try:
        if with_training:
            train = host.run("train", "launch-loop", "--kernel-ns", str(KERNEL_NS), "--launches-per-iter", "50",
                             "--seconds", str(SECONDS + 2.0), "--progress",
                             env={} if beside_kernels is None else {contract.ENV_BESIDE_KERNELS: str(beside_kernels)})
            assert train.stdout is not None
            assert "progress" in json.loads(train.stdout.readline())  # running for a second
        service = host.run("service", "launch-loop", "--kernel-ns", str(KERNEL_NS), "--launches-per-iter",
                           str(SERVICE_KERNELS), "--pause-ns", str(18_000_000), "--seconds", str(SECONDS),
                           env={"SIMGPU_SYNC_LOG": str(log)})
        last_line(service, SECONDS + 60)
        trained = last_line(train, SECONDS + 60) if train is not None else None
    finally:
        assert stop(agent) == 0
    return sync_waits(log, service.pid), trained


@pytest.mark.parametrize("beside_kernels", [None, 0], ids=["default", "none"])
def test_a_production_request_waits_a_few_opportunistic_kernels_not_their_backlog(host: Host,
                                                                                  beside_kernels: int | None) -> None:
    """A service in a production group beside a training loop in an opportunistic group. Each of the
    service's requests waits, beyond its own 2 ms, only for the opportunistic kernels queued ahead of
    it: what the time bound left queued before the request (half a millisecond and the kernel past it)
    and GT_BESIDE_KERNELS more (plus the one whose launch raced the request's): a few ms, where the
    training loop's own backlog is 50 ms (it syncs every 50 kernels), and time slicing would make it
    wait for the loop's slice. With GEMTRACE_BESIDE_KERNELS=0 the loop adds none while the service
    has work queued: the request waits for what the time bound left queued only. The loop still gets
    most of the GPU."""
    host.config.write_text(CONFIG)
    solo, _ = service_waits(host, with_training=False)
    beside, trained = service_waits(host, with_training=True, beside_kernels=beside_kernels)
    assert len(solo) > 50 and len(beside) > 50 and trained is not None
    own = SERVICE_KERNELS * KERNEL_NS
    kernels = contract.BESIDE_KERNELS if beside_kernels is None else beside_kernels
    allowed = own + (kernels + 3) * KERNEL_NS
    summary = (f"service waits: solo p50 {percentile(solo, 0.5) / 1e6:.1f} ms, beside training p50 "
               f"{percentile(beside, 0.5) / 1e6:.1f} ms, p99 {percentile(beside, 0.99) / 1e6:.1f} ms, max "
               f"{max(beside) / 1e6:.1f} ms; training {trained['kernel_s'] / trained['elapsed_s']:.2f} of the GPU")
    assert percentile(solo, 0.99) <= own + KERNEL_NS, summary
    assert max(beside) <= allowed, summary
    assert percentile(beside, 0.99) <= percentile(solo, 0.99) + allowed - own, summary
    # The service uses about a tenth of the GPU; the opportunistic loop has most of the rest.
    assert trained["kernel_s"] / trained["elapsed_s"] >= 0.5, summary
