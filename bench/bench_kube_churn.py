"""Pods created and deleted one after another (issue 26): does each get its limit, how long is its
admission, and where does a slow one lose its time? On the one-node test cluster
(tests/k8s/cluster.sh) with the simulated GPU, installed as tests/test_kube_e2e.py installs it (its
`Node`): the agent on the host with the node's files, and deploy/'s device plugin and webhook as pods
of the image `make image` builds, through `kubectl apply -k deploy/`. The main file reserves MinUtil
0.2 of the GPU; each pod asks for 2 GiB and 30%, prints what its gate says of the GPU's memory, and is
deleted (waiting until it is gone) before the next is made; after every fifth, a plain pod asking for
nothing of gemtrace takes its turn, so that both kinds meet the cluster in the same state.

A pod got its limit when it saw 2 GiB (in `default` it would see the GPU's 16). Admission: from just
before `kubectl create` to the container's first instruction, by its own clock (`date`, the host's);
the kubelet's status of a started container comes later and at its own pace (its PLEG relists every
second), so polling the pod would measure that instead. Where the time went, per pod: the plugin's
answers to the kubelet (Allocate and PreStartContainer, their `took_s` in its log; one pod at a time,
so a line's time names its pod) and, for each pod at 2 s or more, the kubelet's steps from its log:
the pod's arrival (SyncLoop ADD), its service-account token volume mounted (the kubelet's secret
cache, which the Node authorizer refuses until it has the new pod bound to the node, then retries),
its sandbox begun, and its container's first instruction. Appends a dated table to
bench/results/kube_churn.md.

    sudo flock /tmp/gemtrace-k8s.lock .venv/bin/python -m bench.bench_kube_churn [--pods 50] [--no-record]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from k8s_cluster import CLUSTER_SH, K8sCluster, cluster_env
from simgpu_env import SimGpu
from test_kube_e2e import Node, import_image, on_the_node
from testkit import GiB, owning_host_dirs

from bench.recording import RESULTS as RESULTS_DIR
from bench.recording import add_record_flag, record
from gemtrace.kube import shares

RESULTS = RESULTS_DIR / "kube_churn.md"
PLAIN_EVERY = 5
BOUND_S = 2.0  # the admission bound
# The kubelet's log (klog, --v 2): I1126 23:51:20.595532 ..., and its lines of a pod's steps.
KLOG_TIME = re.compile(r"^[IWE](\d\d)(\d\d) (\d\d:\d\d:\d\d\.\d+)")
SECRET_RETRY = "failed to sync secret cache"
STEPS = {"arrived": 'SyncLoop (ADD, "api"): "{name}_', "token": 'SetUp succeeded for volume "default-token-',
         "sandbox": 'No sandbox for pod "{name}_'}


@dataclass
class Cycle:
    name: str
    created: float  # time.time() just before `kubectl create`
    started: float  # the container's first instruction, by its clock
    total: int | None  # the memory its gate showed it
    grant_gone_s: float

    @property
    def admission(self) -> float:
        return self.started - self.created


def cycle(node: Node, name: str, limits: dict[str, str] | None) -> Cycle:
    """Create, read, delete one pod and wait until no grant of it is left."""
    cluster = node.cluster
    script = "date +%s.%N && " + ("/simgpu/simgpu-rt meminfo && sleep 60" if limits else "sleep 60")
    created = time.time()
    node.create(node.pod(name, script, limits=limits))
    started, total = 0.0, None
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            lines = cluster.kubectl("logs", name).splitlines()
            json_lines = [json.loads(line) for line in lines if line.startswith("{")]
            if lines and (json_lines or not limits):
                started, total = float(lines[0]), json_lines[0]["total"] if json_lines else None
                break
            time.sleep(0.1)
    finally:
        cluster.delete_pod(name)
    deleted = time.monotonic()
    while list(node.dropins.glob("k8s-*.conf")) and time.monotonic() - deleted < 120:
        time.sleep(0.05)
    return Cycle(name, created, started, total, time.monotonic() - deleted)


def plugin_waits(log: str) -> list[tuple[float, float]]:
    """(time, took_s) of each Allocate and PreStartContainer answer in the plugin's log."""
    found = []
    for line in log.splitlines():
        if line.startswith("{"):
            event = json.loads(line)
            if event.get("event") in ("allocated", "prestart_answered") and "took_s" in event:
                found.append((datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp(),
                              event["took_s"]))
    return found


def klog_time(line: str, year: int) -> float | None:
    """When a line of the kubelet's log was written (klog gives no year), or None for no klog line."""
    m = KLOG_TIME.match(line)
    return datetime.fromisoformat(f"{year}-{m[1]}-{m[2]}T{m[3]}+00:00").timestamp() if m else None


def secret_retries(log: str, year: int) -> list[float]:
    """The times of the kubelet's token volume retries."""
    return [t for line in log.splitlines() if SECRET_RETRY in line and (t := klog_time(line, year)) is not None]


def kubelet_steps(log: str, year: int, name: str) -> dict[str, float]:
    """The time of each of STEPS for pod `name` in the kubelet's log."""
    found: dict[str, float] = {}
    for line in log.splitlines():
        t = klog_time(line, year)
        if t is None:
            continue
        for step, text in STEPS.items():
            mine = f'pod "{name}"' in line if step == "token" else True
            if step not in found and mine and text.format(name=name) in line:
                found[step] = t
    return found


def slow_pods(cycles: list[Cycle], waits: list[tuple[float, float]], log: str, year: int) -> str:
    """A line for each pod at BOUND_S or more: where its time went."""
    lines = []
    for c in cycles:
        if c.admission < BOUND_S:
            continue
        steps = kubelet_steps(log, year, c.name)
        marks = [("create", c.created), *((s, steps[s]) for s in STEPS if s in steps), ("first instruction", c.started)]
        parts = ", ".join(f"to {b} {tb - ta:.2f}" for (_, ta), (b, tb) in zip(marks, marks[1:], strict=False))
        plugin = sum(took for t, took in waits if c.created <= t <= c.started)
        lines.append(f"- {c.name}: {c.admission:.2f} s; {parts} s (from the step before); the plugin's answers "
                     f"{plugin:.2f} s\n")
    return "".join(lines)


def summary(values: list[float]) -> str:
    """Median / p90 / max of admission times."""
    ordered = sorted(values)
    if not ordered:
        return "none started"
    p90 = ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]
    return f"{statistics.median(ordered):.2f} / {p90:.2f} / {ordered[-1]:.2f} s"


def row(label: str, cycles: list[Cycle], waits: list[tuple[float, float]], retries: list[float],
        limited: str, refused: str) -> str:
    def during(c: Cycle) -> tuple[float, bool]:
        plugin = sum(took for t, took in waits if c.created <= t <= c.started)
        return plugin, any(c.created <= t <= c.started for t in retries)
    spans = [during(c) for c in cycles]
    over = [c.admission for c in cycles if c.admission >= BOUND_S]
    over_retried = sum(1 for c, (_, retried) in zip(cycles, spans, strict=True) if c.admission >= BOUND_S and retried)
    gone = f"{max(c.grant_gone_s for c in cycles):.2f} s" if limited != "-" else "-"
    return (f"| {len(cycles)} | {label} | {limited} | {summary([c.admission for c in cycles])} | "
            f"{len(over)} ({over_retried} with a token volume retry) | {sum(r for _, r in spans)} | "
            f"{max(p for p, _ in spans):.2f} s | {gone} | {refused} |\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pods", type=int, default=50)
    add_record_flag(ap, RESULTS)
    args = ap.parse_args()
    with owning_host_dirs("bench_kube_churn"):  # the cluster's node binds over the host's gemtrace dirs
        return churn(args)


def churn(args: argparse.Namespace) -> int:
    up = subprocess.run([str(CLUSTER_SH), "up"], capture_output=True, text=True)
    if up.returncode != 0:
        raise SystemExit(f"tests/k8s/cluster.sh up failed:\n{up.stderr}")
    cluster = K8sCluster(cluster_env())
    tmp = Path(tempfile.mkdtemp(prefix="gt-kube-churn-"))
    node = None
    plain: list[Cycle] = []
    shared: list[Cycle] = []
    try:
        import_image(cluster)
        node = Node(cluster, on_the_node(cluster, SimGpu(tmp / "sim"), tmp))  # CONFIG: [train]'s MinUtil 0.2
        node.install()
        for i in range(args.pods):
            shared.append(cycle(node, f"churn-{i}", {shares.GPU_MEMORY: "2", shares.GPU_UTIL: "30"}))
            if i % PLAIN_EVERY == PLAIN_EVERY - 1:
                plain.append(cycle(node, f"churn-plain-{i}", None))
        refused = node.agent.log.read_text().count('"event": "dropin_refused"')
        waits = plugin_waits(node.plugin_log())
        year = datetime.now(UTC).year
        kubelet_log = (cluster.logs / "kubelet.log").read_text()
        retries = secret_retries(kubelet_log, year)
        slow = slow_pods(plain + shared, waits, kubelet_log, year)
    finally:
        if node is not None:
            node.close()
        subprocess.run([str(CLUSTER_SH), "down"], capture_output=True)
    limited = sum(c.total == 2 * GiB for c in shared)
    table = (
        f"| pods | asking | got their limit | admission median / p90 / max | {BOUND_S:g} s or more "
        "| pods with a token volume retry | the plugin's answers, max a pod | grant gone after the delete, max "
        "| drop-ins refused |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n"
        + row("nothing of gemtrace", plain, waits, retries, "-", "-")
        + row("2 GiB + 30% each", shared, waits, retries, f"{limited} of {len(shared)}", str(refused))
        + f"\nEach pod's admission, in order (s): {', '.join(f'{c.admission:.2f}' for c in shared)}\n"
        + (f"\nThe kubelet's steps of the pods at {BOUND_S:g} s or more:\n\n{slow}" if slow else ""))
    print(table)
    if not args.no_record:
        record(RESULTS, "Pods created and deleted one after another", table, about="bench/bench_kube_churn.py, "
               "the main file's MinUtil 0.2, agent --config-poll 0.2, `kubectl apply -k deploy/`, admission "
               "by the container's clock")
    return 0 if limited == args.pods else 1


if __name__ == "__main__":
    sys.exit(main())
