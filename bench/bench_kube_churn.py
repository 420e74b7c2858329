"""Pods created and deleted one after another (issue 26): does each get its limit, and how long is its
admission? On the one-node test cluster (tests/k8s/cluster.sh) with the simulated GPU, installed as
tests/test_kube_e2e.py installs it (its `Node`): the agent on the host with the node's files, and
deploy/'s device plugin and webhook as pods of the image `make image` builds, through
`kubectl apply -k deploy/`. The main file
reserves MinUtil 0.2 of the GPU; each pod asks for 2 GiB and 30%, prints what its gate says of the
GPU's memory, and is deleted (waiting until it is gone) before the next is made.
A pod got its limit when it saw 2 GiB (in `default` it would see the GPU's 16). Admission: from the
create to the container started, against plain pods asking for nothing of gemtrace in the same run.
Appends a dated table to bench/results/kube_churn.md.

    sudo flock /tmp/gemtrace-k8s.lock .venv/bin/python -m bench.bench_kube_churn [--pods 50] [--no-record]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from k8s_cluster import CLUSTER_SH, K8sCluster, cluster_env
from simgpu_env import SimGpu
from test_kube_e2e import Node, import_image, on_the_node
from testkit import GiB

from bench.recording import RESULTS as RESULTS_DIR
from bench.recording import add_record_flag, record
from gemtrace.kube import shares

RESULTS = RESULTS_DIR / "kube_churn.md"
PLAIN_PODS = 5


def cycle(node: Node, name: str, limits: dict[str, str] | None) -> tuple[float, int | None, float]:
    """Create, read, delete one pod: (admission s, the memory total it saw, s from its deletion
    returning to no grant of it left)."""
    cluster = node.cluster
    script = "/simgpu/simgpu-rt meminfo && sleep 60" if limits else "sleep 60"
    started = time.monotonic()
    node.create(node.pod(name, script, limits=limits))
    admission = time.monotonic() - started
    total = None
    try:
        if limits:
            deadline = time.monotonic() + 60
            while total is None and time.monotonic() < deadline:
                lines = [json.loads(line) for line in cluster.kubectl("logs", name).splitlines()
                         if line.startswith("{")]
                total = lines[0]["total"] if lines else None
                time.sleep(0.2)
    finally:
        cluster.delete_pod(name)
    deleted = time.monotonic()
    while list(node.dropins.glob("k8s-*.conf")) and time.monotonic() - deleted < 120:
        time.sleep(0.05)
    return admission, total, time.monotonic() - deleted


def summary(values: list[float]) -> str:
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]
    return f"{statistics.median(ordered):.2f} / {p90:.2f} / {ordered[-1]:.2f} s"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pods", type=int, default=50)
    add_record_flag(ap, RESULTS)
    args = ap.parse_args()
    up = subprocess.run([str(CLUSTER_SH), "up"], capture_output=True, text=True)
    if up.returncode != 0:
        raise SystemExit(f"tests/k8s/cluster.sh up failed:\n{up.stderr}")
    cluster = K8sCluster(cluster_env())
    tmp = Path(tempfile.mkdtemp(prefix="gt-kube-churn-"))
    host = on_the_node(cluster, SimGpu(tmp / "sim"), tmp)  # CONFIG: [train] reserves MinUtil 0.2 of the GPU
    node = None
    try:
        import_image(cluster)
        node = Node(cluster, host)
        node.install()
        plain = [cycle(node, f"churn-plain-{i}", None)[0] for i in range(PLAIN_PODS)]
        shared = [cycle(node, f"churn-{i}", {shares.GPU_MEMORY: "2", shares.GPU_UTIL: "30"})
                  for i in range(args.pods)]
        refused = node.agent.log.read_text().count('"event": "dropin_refused"')
    finally:
        if node is not None:
            node.close()
        subprocess.run([str(CLUSTER_SH), "down"], capture_output=True)
    admissions = [a for a, _, _ in shared]
    limited = sum(total == 2 * GiB for _, total, _ in shared)
    table = (
        "| pods | asking | got their limit | admission median / p90 / max | grant gone after the delete, max "
        "| drop-ins refused |\n| --- | --- | --- | --- | --- | --- |\n"
        f"| {PLAIN_PODS} | nothing of gemtrace | - | {summary(plain)} | - | - |\n"
        f"| {args.pods} | 2 GiB + 30% each | {limited} of {args.pods} | {summary(admissions)} | "
        f"{max(g for _, _, g in shared):.2f} s | {refused} |\n\n"
        f"Each pod's admission, in order (s): {', '.join(f'{a:.2f}' for a in admissions)}\n")
    print(table)
    if not args.no_record:
        record(RESULTS, "Pods created and deleted one after another", table, about="bench/bench_kube_churn.py, "
               "the main file's MinUtil 0.2, agent --config-poll 0.2, deploy/'s plugin and webhook in pods")
    return 0 if limited == args.pods else 1


if __name__ == "__main__":
    sys.exit(main())
