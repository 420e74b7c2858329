"""Pods admitted per second through the device plugin (issue 12), on the one-node test cluster
(tests/k8s/cluster.sh) with the simulated GPU: the agent and `gemtrace kube-plugin` on the host, as
in tests/test_kube_e2e.py. --pods pods, each asking for 1 GiB and 1%, are created at once; a pod is
admitted when it is Running (Allocate done: its group written and defined by the agent, the gate
mounted). Reports the time from the first create to the last Running, against the same pods asking
for nothing of gemtrace (the cluster's own pace), and appends a dated table to
bench/results/kube_admission.md.

    sudo .venv/bin/python -m bench.bench_kube_admission [--pods 16] [--no-record]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from agent_host import Host, gemtrace, stop
from k8s_cluster import CLUSTER_SH, K8sCluster, cluster_env, pod_manifest
from simgpu_env import SimGpu

from bench.recording import REPO, add_record_flag, record
from bench.recording import RESULTS as RESULTS_DIR
from gemtrace.kube import shares

RESULTS = RESULTS_DIR / "kube_admission.md"


def admit(cluster: K8sCluster, n: int, limits: dict[str, str] | None, prefix: str) -> float:
    """Seconds from the first create to the last pod Running."""
    names = [f"{prefix}-{i}" for i in range(n)]
    start = time.monotonic()
    for name in names:
        cluster.create(pod_manifest(name, ["sleep", "300"], limits=limits))
    pending = set(names)
    while pending:
        pods = json.loads(cluster.kubectl("get", "pods", "-o", "json"))["items"]
        pending -= {p["metadata"]["name"] for p in pods if p["status"].get("phase") == "Running"}
        if time.monotonic() - start > 300:
            raise SystemExit(f"pods not Running after 300 s: {sorted(pending)}")
        time.sleep(0.1)
    elapsed = time.monotonic() - start
    for name in names:
        cluster.kubectl("delete", "pod", name, "--wait=false", "--grace-period=0", "--force")
    while any(p["metadata"]["name"].startswith(prefix)
              for p in json.loads(cluster.kubectl("get", "pods", "-o", "json"))["items"]):
        time.sleep(0.5)
    return elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pods", type=int, default=16)
    add_record_flag(ap, RESULTS)
    args = ap.parse_args()
    subprocess.run([str(CLUSTER_SH), "up"], check=True, capture_output=True)
    cluster = K8sCluster(cluster_env())
    tmp = Path(tempfile.mkdtemp(prefix="gt-kube-bench-"))
    host = Host(SimGpu(tmp / "sim"), tmp / "resource.conf", tmp / "state", tmp)
    host.config.write_text("")
    agent = host.start_agent()  # the default --config-poll (1 s): the plugin's SIGHUP is what paces it
    plugin = subprocess.Popen(gemtrace("kube-plugin", "--config", str(host.config), "--state-dir", str(host.state_dir),
                                       "--device-plugins", str(cluster.device_plugins),
                                       "--gate", str(REPO / "build" / "libgemgate.so"),
                                       "--preload-file", str(tmp / "ld.so.preload"), "--pod-names",
                                       str(tmp / "pods.json"), "--log-level", "warning",
                                       # As the DaemonSet runs it: with its node's pods, so that it places.
                                       "--node-name", cluster.node, "--kubeconfig", cluster.kubeconfig),
                              env=host.env(), stderr=subprocess.DEVNULL)
    try:
        while cluster.get("node", cluster.node)["status"]["allocatable"].get(shares.GPU_MEMORY) != "16":
            time.sleep(0.2)
        plain = admit(cluster, args.pods, None, "plain")
        shared = admit(cluster, args.pods, {shares.GPU_MEMORY: "1", shares.GPU_UTIL: "1"}, "shared")
    finally:
        plugin.terminate()
        plugin.wait(timeout=20)
        stop(agent)
        subprocess.run([str(CLUSTER_SH), "down"], capture_output=True)
    table = ("| pods | asking | first create to last Running | pods/s |\n| --- | --- | --- | --- |\n"
             f"| {args.pods} | nothing of gemtrace | {plain:.1f} s | {args.pods / plain:.1f} |\n"
             f"| {args.pods} | 1 GiB + 1% each | {shared:.1f} s | {args.pods / shared:.1f} |\n")
    print(table)
    if not args.no_record:
        record(RESULTS, "Pods admitted per second through the device plugin", table,
               about="bench/bench_kube_admission.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
