"""The Kubernetes test cluster itself works: the node registers, a pod runs, and the scheduler holds
back a pod that asks for an extended resource no node offers (what gemtrace's device plugin will
offer). Everything gemtrace's Kubernetes tests build on; see tests/k8s/cluster.sh."""

from __future__ import annotations

import pytest
from k8s_cluster import K8sCluster, pod_manifest

pytestmark = [pytest.mark.e2e, pytest.mark.k8s]

GPU_MEMORY = "gemtrace.io/gpu-memory"


def test_node_registers_with_containerd_and_a_device_plugin_socket(k8s_cluster: K8sCluster) -> None:
    node = k8s_cluster.get("node", k8s_cluster.node)
    info = node["status"]["nodeInfo"]
    assert info["kubeletVersion"] == "v1.20.2"
    assert info["containerRuntimeVersion"].startswith("containerd://")
    # Nobody advertises gemtrace's resource yet: the device plugin test will change exactly this.
    assert GPU_MEMORY not in node["status"]["capacity"]
    # Where a device plugin registers (the kubelet's device manager listens there).
    assert (k8s_cluster.device_plugins / "kubelet.sock").is_socket()


def test_pod_runs_to_completion_and_its_log_is_read(k8s_cluster: K8sCluster) -> None:
    name = "echo-ok"
    k8s_cluster.create(pod_manifest(name, ["sh", "-c", "echo ok"]))
    try:
        pod = k8s_cluster.wait_pod(
            name, lambda p: p["status"].get("phase") in ("Succeeded", "Failed"), "end (Succeeded or Failed)"
        )
        assert pod["status"]["phase"] == "Succeeded", k8s_cluster.diagnosis(name)
        assert pod["spec"]["nodeName"] == k8s_cluster.node
        assert k8s_cluster.kubectl("logs", name) == "ok\n"
    finally:
        k8s_cluster.delete_pod(name)


def test_pod_asking_for_an_unadvertised_resource_stays_pending(k8s_cluster: K8sCluster) -> None:
    name = "wants-gpu-memory"
    k8s_cluster.create(pod_manifest(name, ["true"], limits={GPU_MEMORY: "1"}))
    try:
        events = k8s_cluster.wait_events(name, "FailedScheduling")
        assert any(f"Insufficient {GPU_MEMORY}" in e["message"] for e in events), [e["message"] for e in events]
        pod = k8s_cluster.get("pod", name)
        assert pod["status"]["phase"] == "Pending"
        assert "nodeName" not in pod["spec"]
    finally:
        k8s_cluster.delete_pod(name)
