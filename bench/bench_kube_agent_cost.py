"""The agent's cost with many pods on a node (issue 12), on the one-node test cluster
(tests/k8s/cluster.sh) with the simulated GPU: the agent and `gemtrace kube-plugin` on the host, as in
tests/test_kube_e2e.py. --pods pods each hold a little of the simulated GPU's memory (a process the
agent follows, labels with its pod and exports): --shared of them ask for 1 GiB + 1% (gated, a group
each: the simulated GPU has 16 GiB and the region 64 groups), the others are gated in one group
`pods` of the resource file, as the webhook puts a labelled pod (its mounts and envs in the manifest:
the agent follows only gated processes when it runs without eBPF, as here).
Measures, with no pod and then with all of them Running and holding: the agent's CPU (utime + stime
from /proc/PID/stat over --window seconds, as % of one core) and its /metrics scrape time (median and
worst of --scrapes) and size; appends a dated table to bench/results/kube_admission.md.

    sudo .venv/bin/python -m bench.bench_kube_agent_cost [--pods 100] [--shared 15] [--no-record]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from agent_host import Host, gemtrace, stop
from k8s_cluster import CLUSTER_SH, K8sCluster, cluster_env, pod_manifest
from simgpu_env import SIMGPU_DIR, SimGpu

from bench.recording import REPO, add_record_flag, record
from bench.recording import RESULTS as RESULTS_DIR
from gemtrace.kube import shares
from gemtrace.kube.injection import Injection

HOLD = "/simgpu/simgpu-rt alloc --hold 3600 16MiB"
GROUP = "pods"

RESULTS = RESULTS_DIR / "kube_admission.md"


def holder(name: str, sim_state: str, limits: dict[str, str] | None, injection: Injection) -> dict[str, Any]:
    """A pod holding 16 MiB of the simulated GPU (its driver through a hostPath, as in the e2e tests);
    without limits, gated in the group `pods` as the webhook would."""
    manifest = pod_manifest(name, ["sh", "-c", HOLD], limits=limits)
    container = manifest["spec"]["containers"][0]
    container["env"] = [{"name": "LD_LIBRARY_PATH", "value": "/simgpu"},
                        {"name": "SIMGPU_STATE_DIR", "value": "/simgpu-state"}]
    container["volumeMounts"] = [{"name": "simgpu", "mountPath": "/simgpu", "readOnly": True},
                                 {"name": "simgpu-state", "mountPath": "/simgpu-state"}]
    manifest["spec"]["volumes"] = [{"name": "simgpu", "hostPath": {"path": str(SIMGPU_DIR)}},
                                   {"name": "simgpu-state", "hostPath": {"path": sim_state}}]
    if limits is None:
        for mount in injection.mounts():
            container["volumeMounts"].append({"name": mount.name, "mountPath": str(mount.container_path),
                                              "readOnly": mount.read_only})
            manifest["spec"]["volumes"].append({"name": mount.name, "hostPath": {"path": str(mount.host_path)}})
        container["env"] += [{"name": k, "value": v} for k, v in injection.env(GROUP).items()]
    return manifest


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def measure(pid: int, url: str, window: float, scrapes: int) -> dict[str, float]:
    """The agent's CPU over `window` s (no scrape in it), then `scrapes` scrapes a second apart."""
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
            "kib": size / 1024, "processes": processes}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pods", type=int, default=100)
    ap.add_argument("--shared", type=int, default=15)
    ap.add_argument("--window", type=float, default=30)
    ap.add_argument("--scrapes", type=int, default=10)
    add_record_flag(ap, RESULTS)
    args = ap.parse_args()
    subprocess.run([str(CLUSTER_SH), "up"], check=True, capture_output=True)
    cluster = K8sCluster(cluster_env())
    tmp = Path(tempfile.mkdtemp(prefix="gt-kube-cost-"))
    host = Host(SimGpu(tmp / "sim"), tmp / "resource.conf", tmp / "state", tmp)
    host.config.write_text(f"[{GROUP}]\n")
    injection = Injection(gate=REPO / "build" / "libgemgate.so", state_dir=host.state_dir,
                          preload_file=tmp / "ld.so.preload")
    sim_state = host.sim.env()["SIMGPU_STATE_DIR"]
    agent = host.start_agent("--pod-names", str(tmp / "pods.json"))
    plugin = subprocess.Popen(gemtrace("kube-plugin", "--config", str(host.config), "--state-dir", str(host.state_dir),
                                       "--device-plugins", str(cluster.device_plugins),
                                       "--gate", str(REPO / "build" / "libgemgate.so"),
                                       "--preload-file", str(tmp / "ld.so.preload"), "--pod-names",
                                       str(tmp / "pods.json"), "--node-name", cluster.node,
                                       "--kubeconfig", cluster.kubeconfig, "--log-level", "warning"),
                              env=host.env(), stderr=subprocess.DEVNULL)
    names = [f"cost-{i}" for i in range(args.pods)]
    try:
        while cluster.get("node", cluster.node)["status"]["allocatable"].get(shares.GPU_MEMORY) != "16":
            time.sleep(0.2)
        idle = measure(agent.proc.pid, agent.url, args.window, args.scrapes)
        start = time.monotonic()
        for i, name in enumerate(names):
            limits = {shares.GPU_MEMORY: "1", shares.GPU_UTIL: "1"} if i < args.shared else None
            cluster.create(holder(name, sim_state, limits, injection))
        while True:  # every pod Running and its process followed by the agent
            body = agent.metrics()
            followed = sum(1 for line in body.splitlines()
                           if line.startswith("gemtrace_process_memory_bytes{") and 'pod="cost-' in line)
            # One gated process in 100 was left unplaced in a run (its gate said so): measure anyway.
            if followed >= args.pods or time.monotonic() - start > 300:
                break
            time.sleep(2)
        admitted = time.monotonic() - start
        busy = measure(agent.proc.pid, agent.url, args.window, args.scrapes)
    finally:
        for name in names:
            subprocess.run([cluster.kubectl_bin, "--kubeconfig", cluster.kubeconfig, "delete", "pod", name,
                            "--wait=false", "--grace-period=0", "--force", "--ignore-not-found"], capture_output=True)
        plugin.terminate()
        plugin.wait(timeout=20)
        stop(agent)
        subprocess.run([str(CLUSTER_SH), "down"], capture_output=True)
    load = os.getloadavg()[0]
    rows = "".join(f"| {label} | {m['processes']:.0f} | {m['cpu'] * 100:.1f}% | {m['median_ms']:.1f} ms | "
                   f"{m['max_ms']:.1f} ms | {m['kib']:.0f} KiB |\n"
                   for label, m in (("no pod", idle), (f"{args.pods} pods ({args.shared} with shares)", busy)))
    table = (f"Each pod holds 16 MiB of the simulated GPU; agent CPU over {args.window:g} s, {args.scrapes} scrapes; "
             f"{args.pods} pods Running and followed {admitted:.0f} s after the first create; "
             f"load {load:.1f} at the end.\n\n"
             "| pods on the node | processes exported | agent CPU (one core) | scrape median | scrape worst "
             "| /metrics size |\n| --- | --- | --- | --- | --- | --- |\n" + rows)
    print(table)
    if not args.no_record:
        record(RESULTS, "Pods admitted per second through the device plugin", table,
               about=f"the agent's cost with {args.pods} pods (bench/bench_kube_agent_cost.py)")
    print(json.dumps({"idle": idle, "busy": busy, "admitted_s": admitted}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
