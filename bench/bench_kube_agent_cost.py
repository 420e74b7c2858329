"""The pods' admission and the agent's cost with many pods on a node of several GPUs (issues 12 and
26), on the one-node test cluster (tests/k8s/cluster.sh) with --gpus simulated GPUs of 16 GiB,
installed as tests/test_kube_e2e.py installs it (its `Node`): the agent on the host with the node's
files, and deploy/'s device plugin (binpacking, its default) and webhook as pods of the image
`make image` builds, through `kubectl apply -k deploy/`.

--pods pods are created one after another without waiting for any, each holding a little of the
simulated GPU's memory (a process the agent follows, labels with its pod and exports): --shared of
them, spread evenly among the others, ask for 2 GiB + 10% (a group each, on one GPU; the region has
64 groups), the others carry the label gemtrace.io/group=pods and are gated by the webhook in the
resource file's group `pods` (MemoryLimit 4 GiB). Each prints its clock, then what its gate says of
the GPU's memory, then holds.

A pod's admission: from just before its `kubectl create` to its container's first instruction, by
its own clock (`date`, the host's), as bench/bench_kube_churn.py times it; it was gated when its
gate showed it its limit (2 GiB, or the group's 4 GiB; ungated it would see the GPU's 16) and the
agent followed its process. Then, with no pod and with all of them holding: the agent's CPU (utime +
stime from /proc/PID/stat over --window seconds, as % of one core) and its /metrics scrape time
(median and worst of --scrapes) and size. Where a pod's admission went, from the kubelet's log (its
times are the host's, as the container's clock is): to its arrival at the kubelet (the apiserver, the
webhook, the scheduler), to its sandbox begun (volumes), to its sandbox started as the kubelet's PLEG
saw it (it relists every second: the split between this step and the next is as coarse), to its
container's first instruction (the plugin's Allocate and PreStartContainer, the container made); the
median of each step. And the metric families with the most series, with no pod and with all.
Appends a dated table to bench/results/kube_admission.md.

    sudo flock /tmp/gemtrace-k8s.lock .venv/bin/python -m bench.bench_kube_agent_cost [--pods 100] \
        [--gpus 8] [--shared 50] [--no-record]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from k8s_cluster import CLUSTER_SH, K8sCluster, cluster_env
from simgpu_env import SimGpu
from test_kube_e2e import Node, import_image, on_the_node
from testkit import GiB, owning_host_dirs

from bench.bench_kube_churn import klog_time, summary
from bench.recording import RESULTS as RESULTS_DIR
from bench.recording import add_record_flag, record
from gemtrace.kube import shares

RESULTS = RESULTS_DIR / "kube_admission.md"
GPU_GIB = 16
SHARE = {shares.GPU_MEMORY: "2", shares.GPU_UTIL: "10"}
GROUP, GROUP_LIMIT_GIB = "pods", 4
CONFIG = f"[{GROUP}]\nMemoryLimit = {GROUP_LIMIT_GIB}GiB\n"
SCRIPT = "date +%s.%N && /simgpu/simgpu-rt meminfo && /simgpu/simgpu-rt alloc --hold 3600 16MiB"
BENCH_LABEL = "gemtrace-bench=kube-agent-cost"
# A pod's steps in the kubelet's log (klog, --v 2), in order: its first line of each.
STEPS = {"arrived": 'SyncLoop (ADD, "api"): "{name}_', "sandbox begun": 'No sandbox for pod "{name}_',
         "sandbox started": 'SyncLoop (PLEG): "{name}_'}
POD_IN_LINE = re.compile(r'"(cost-[0-9]+)_')  # each step's line names its pod "NAME_NAMESPACE(UID)"
WAIT_S = 420  # for every pod to hold; on two shared cores 100 took about 3 min


@dataclass
class Pod:
    name: str
    shared: bool
    created: float = 0.0  # time.time() just before `kubectl create`
    started: float | None = None  # its container's first instruction, by its clock
    total: int | None = None  # the memory its gate showed it
    holding: bool = False

    @property
    def limit(self) -> int:
        return int(SHARE[shares.GPU_MEMORY]) * GiB if self.shared else GROUP_LIMIT_GIB * GiB

    @property
    def admission(self) -> float | None:
        return None if self.started is None else self.started - self.created


def manifest(node: Node, pod: Pod, gpus: int) -> dict[str, Any]:
    """A holder pod: the simulated GPU's driver as node.pod mounts it, with all `gpus` devices (a pod of
    the group has no device from the plugin, so the container runtime gives it no driver settings)."""
    m = node.pod(pod.name, SCRIPT, limits=SHARE if pod.shared else None,
                 labels=None if pod.shared else {shares.LABEL_GROUP: GROUP})
    key, value = BENCH_LABEL.split("=")
    m["metadata"].setdefault("labels", {})[key] = value
    env = node.host.sim.env()
    m["spec"]["containers"][0]["env"] += [{"name": k, "value": env[k]} for k in ("SIMGPU_DEVICES", "SIMGPU_MEMORY")]
    return m


def webhook_ready(node: Node, gpus: int) -> None:
    """Until a labelled pod is admitted and patched: the apiserver calls a new webhook once its informer
    has it and reaches it once its Service names the pod, refusing labelled pods until then."""
    probe = Pod("cost-webhook-probe", shared=False)
    deadline = time.monotonic() + 180
    while True:
        try:
            node.cluster.create(manifest(node, probe, gpus))
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)
            continue
        volumes = {v["name"] for v in node.cluster.get("pod", probe.name)["spec"]["volumes"]}
        node.cluster.delete_pod(probe.name)
        if "gemtrace-gate" in volumes:
            return
        if time.monotonic() > deadline:
            raise SystemExit("the webhook did not patch a labelled pod within 180 s")
        time.sleep(1)


def read_started(cluster: K8sCluster, pods: list[Pod]) -> None:
    """Fill in what the Running pods have printed so far: their clock, their memory, their hold."""
    listed = json.loads(cluster.kubectl("get", "pods", "-l", BENCH_LABEL, "-o", "json"))["items"]
    running = {p["metadata"]["name"] for p in listed if p["status"].get("phase") == "Running"}
    for pod in pods:
        if pod.holding or pod.name not in running:
            continue
        try:
            lines = cluster.kubectl("logs", pod.name).splitlines()
        except AssertionError:
            continue
        if lines and pod.started is None:
            pod.started = float(lines[0])
        found = [json.loads(line) for line in lines if line.startswith("{")]
        pod.total = next((f["total"] for f in found if "total" in f), pod.total)
        pod.holding = any("holding" in f for f in found)


def followed(body: str) -> set[str]:
    """The bench's pods whose process the agent exports."""
    return {line.split('pod="', 1)[1].split('"', 1)[0] for line in body.splitlines()
            if line.startswith("gemtrace_process_memory_bytes{") and 'pod="cost-' in line}


def kubelet_steps(log: str, year: int, names: set[str]) -> dict[str, dict[str, float]]:
    """For each pod of `names`, the time of each of STEPS in the kubelet's log."""
    found: dict[str, dict[str, float]] = {name: {} for name in names}
    for line in log.splitlines():
        if not (pod := POD_IN_LINE.search(line)) or (steps := found.get(pod[1])) is None:
            continue
        if (t := klog_time(line, year)) is None:
            continue
        for step, text in STEPS.items():
            if step not in steps and text.format(name=pod[1]) in line:
                steps[step] = t
    return found


def steps_row(label: str, pods: list[Pod], steps: dict[str, dict[str, float]]) -> str:
    """The median of each step's time over the pods that the kubelet's log has every step of."""
    marks = ["created", *STEPS, "first instruction"]
    spans: list[list[float]] = [[] for _ in marks[1:]]
    for pod in pods:
        mine = steps.get(pod.name, {})
        if pod.started is None or any(s not in mine for s in STEPS):
            continue
        times = [pod.created, *(mine[s] for s in STEPS), pod.started]
        for i, (a, b) in enumerate(zip(times, times[1:], strict=False)):
            spans[i].append(b - a)
    cells = " | ".join(f"{statistics.median(v):.2f}" if v else "-" for v in spans)
    return f"| {label} | {len(spans[0])} | {cells} |\n"


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def largest_families(body: str, top: int = 5) -> str:
    """The metric families with the most series in a scrape, with their counts."""
    counts: dict[str, int] = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            family = line.split("{", 1)[0].split(" ", 1)[0]
            counts[family] = counts.get(family, 0) + 1
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])
    return (f"{sum(counts.values())} series in {len(counts)} families, the most in "
            + ", ".join(f"`{name}` {n}" for name, n in ranked[:top]))


def measure(pid: int, url: str, window: float, scrapes: int) -> tuple[dict[str, float], str]:
    """The agent's CPU over `window` s (no scrape in it), then `scrapes` scrapes a second apart; and
    the last scrape's body."""
    c0, t0 = cpu_seconds(pid), time.monotonic()
    time.sleep(window)
    cpu = (cpu_seconds(pid) - c0) / (time.monotonic() - t0)
    times, size, processes = [], 0, 0
    for _ in range(scrapes):
        start = time.monotonic()
        with urllib.request.urlopen(url, timeout=10) as r:
            body = r.read().decode()
        times.append(time.monotonic() - start)
        size = len(body)
        processes = sum(1 for line in body.splitlines() if line.startswith("gemtrace_process_memory_bytes{"))
        time.sleep(1)
    return {"cpu": cpu, "median_ms": statistics.median(times) * 1e3, "max_ms": max(times) * 1e3,
            "kib": size / 1024, "processes": processes}, body


def admission_row(label: str, pods: list[Pod], exported: set[str]) -> str:
    started = [a for p in pods if (a := p.admission) is not None]
    limited = sum(p.total == p.limit for p in pods)
    return (f"| {len(pods)} | {label} | {len(started)} | {limited} | {sum(p.name in exported for p in pods)} | "
            f"{summary(started)} | {sum(a >= 2 for a in started)} |\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pods", type=int, default=100)
    ap.add_argument("--shared", type=int, default=50)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--window", type=float, default=30)
    ap.add_argument("--scrapes", type=int, default=10)
    add_record_flag(ap, RESULTS)
    args = ap.parse_args()
    # Pod i asks for a share where the count of shares so far steps up: the two kinds spread evenly.
    pods = [Pod(f"cost-{i}", shared=(i + 1) * args.shared // args.pods > i * args.shared // args.pods)
            for i in range(args.pods)]
    tmp = Path(tempfile.mkdtemp(prefix="gt-kube-cost-"))
    with owning_host_dirs("bench_kube_agent_cost"):
        up = subprocess.run([str(CLUSTER_SH), "up"], capture_output=True, text=True)
        if up.returncode != 0:
            raise SystemExit(f"tests/k8s/cluster.sh up failed:\n{up.stderr}")
        cluster = K8sCluster(cluster_env())
        node = None
        try:
            import_image(cluster)
            host = on_the_node(cluster, SimGpu(tmp / "sim", devices=args.gpus, memory=f"{GPU_GIB}GiB"), tmp)
            host.config.write_text(CONFIG)
            node = Node(cluster, host)
            node.install(str(GPU_GIB * args.gpus), str(100 * args.gpus))
            webhook_ready(node, args.gpus)
            agent = node.agent
            idle, idle_body = measure(agent.proc.pid, agent.url, args.window, args.scrapes)
            first = time.monotonic()
            for pod in pods:
                pod.created = time.time()
                cluster.create(manifest(node, pod, args.gpus))
            created_s = time.monotonic() - first
            while True:
                read_started(cluster, pods)
                exported = followed(agent.metrics())
                if all(p.holding and p.name in exported for p in pods) or time.monotonic() - first > WAIT_S:
                    break
                time.sleep(2)
            held_s = time.monotonic() - first
            busy, busy_body = measure(agent.proc.pid, agent.url, args.window, args.scrapes)
            refused = agent.log.read_text().count('"event": "dropin_refused"')
            steps = kubelet_steps((cluster.logs / "kubelet.log").read_text(), datetime.now(UTC).year,
                                  {p.name for p in pods})
            load = os.getloadavg()[0]
        finally:
            subprocess.run([cluster.kubectl_bin, "--kubeconfig", cluster.kubeconfig, "delete", "pods", "-l",
                            BENCH_LABEL, "--wait=false", "--grace-period=0", "--force"], capture_output=True)
            if node is not None:
                node.close()
            subprocess.run([str(CLUSTER_SH), "down"], capture_output=True)
    shared = [p for p in pods if p.shared]
    grouped = [p for p in pods if not p.shared]
    rows = "".join(f"| {label} | {m['processes']:.0f} | {m['cpu'] * 100:.1f}% | {m['median_ms']:.1f} ms | "
                   f"{m['max_ms']:.1f} ms | {m['kib']:.0f} KiB |\n"
                   for label, m in (("none", idle), (f"{args.pods}", busy)))
    table = (
        f"{args.gpus} simulated GPUs of {GPU_GIB} GiB; {args.pods} pods created one after another in "
        f"{created_s:.0f} s without waiting for any, every pod started and holding (or the wait given up) "
        f"{held_s:.0f} s after the first create; agent --config-poll 0.2, without eBPF; drop-ins refused: "
        f"{refused}; load {load:.1f} with all the pods up.\n\n"
        "| pods | asking | started | saw their limit | followed by the agent | admission median / p90 / max "
        "| 2 s or more |\n| --- | --- | --- | --- | --- | --- | --- |\n"
        + admission_row(f"{SHARE[shares.GPU_MEMORY]} GiB + {SHARE[shares.GPU_UTIL]}% each", shared, exported)
        + admission_row(f"label {shares.LABEL_GROUP}={GROUP} ({GROUP_LIMIT_GIB} GiB group)", grouped, exported)
        + "\nEach pod's admission, in the order created (s; * asked for a share): "
        + ", ".join(f"{p.admission:.1f}{'*' if p.shared else ''}" if p.admission is not None else "-" for p in pods)
        + "\n\nWhere the admissions went, by the kubelet's log: the median of each step (s)\n\n"
        "| pods | with every step logged | to arrival at the kubelet | to sandbox begun | to sandbox started "
        "| to first instruction |\n| --- | --- | --- | --- | --- | --- |\n"
        + steps_row("with a share", shared, steps) + steps_row(f"in `{GROUP}`", grouped, steps)
        + f"\nThe agent, over {args.window:g} s and {args.scrapes} scrapes a second apart:\n\n"
        "| pods on the node | processes exported | agent CPU (one core) | scrape median | scrape worst "
        "| /metrics size |\n| --- | --- | --- | --- | --- | --- |\n" + rows
        + f"\nWith no pod: {largest_families(idle_body)}.\nWith {args.pods}: {largest_families(busy_body)}.\n")
    print(table)
    if not args.no_record:
        record(RESULTS, "Pods admitted per second through the device plugin", table,
               about=f"bench/bench_kube_agent_cost.py, {args.pods} pods on {args.gpus} GPUs, `kubectl apply -k "
               "deploy/`, admission by the container's clock")
    print(json.dumps({"idle": idle, "busy": busy, "admissions": {p.name: p.admission for p in pods}}))
    return 0 if all(p.total == p.limit and p.name in exported for p in pods) else 1


if __name__ == "__main__":
    sys.exit(main())
