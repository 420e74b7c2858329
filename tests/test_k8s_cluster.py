"""The Kubernetes test cluster itself works: the node registers, a pod runs, the scheduler holds back
a pod that asks for an extended resource no node offers, and the apiserver applies a mutating
webhook's patch (the reflect2 that Debian's kubernetes vendors crashed there under Go 1.19).
Everything gemtrace's Kubernetes tests build on; see tests/k8s/cluster.sh."""

from __future__ import annotations

import base64
import json
import ssl
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from k8s_cluster import K8sCluster, pod_manifest

pytestmark = [pytest.mark.e2e, pytest.mark.k8s]

# A resource no device plugin offers (gemtrace's own are tested in test_kube_e2e.py, whose plugin may
# have registered its resources with the node earlier in the session).
UNADVERTISED = "example.com/unadvertised"


def test_node_registers_with_containerd_and_a_device_plugin_socket(k8s_cluster: K8sCluster) -> None:
    node = k8s_cluster.get("node", k8s_cluster.node)
    info = node["status"]["nodeInfo"]
    assert info["kubeletVersion"] == "v1.20.2"
    assert info["containerRuntimeVersion"].startswith("containerd://")
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
    k8s_cluster.create(pod_manifest(name, ["true"], limits={UNADVERTISED: "1"}))
    try:
        events = k8s_cluster.wait_events(name, "FailedScheduling")
        assert any(f"Insufficient {UNADVERTISED}" in e["message"] for e in events), [e["message"] for e in events]
        pod = k8s_cluster.get("pod", name)
        assert pod["status"]["phase"] == "Pending"
        assert "nodeName" not in pod["spec"]
    finally:
        k8s_cluster.delete_pod(name)


MUTATED_LABEL = "gemtrace.io/mutated"


class _LabellingWebhook(BaseHTTPRequestHandler):
    """Answers every AdmissionReview by allowing it with a JSON patch that adds MUTATED_LABEL."""

    def do_POST(self) -> None:
        review = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        patch = [{"op": "add", "path": "/metadata/labels/" + MUTATED_LABEL.replace("/", "~1"), "value": "yes"}]
        body = json.dumps(
            {
                "apiVersion": "admission.k8s.io/v1",
                "kind": "AdmissionReview",
                "response": {
                    "uid": review["request"]["uid"],
                    "allowed": True,
                    "patchType": "JSONPatch",
                    "patch": base64.b64encode(json.dumps(patch).encode()).decode(),
                },
            }
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def labelling_webhook(k8s_cluster: K8sCluster, tmp_path: Path) -> Iterator[str]:
    """A mutating webhook on 127.0.0.1 for pods labelled webhook-test=1; yields the label's key."""
    cert, key = k8s_cluster.serving_cert(tmp_path)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _LabellingWebhook)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    selector = "gemtrace.io/webhook-test"
    config = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": "gemtrace-test-labeller"},
        "webhooks": [
            {
                "name": "labeller.gemtrace.io",
                "clientConfig": {
                    "url": f"https://127.0.0.1:{server.server_address[1]}/mutate",
                    "caBundle": base64.b64encode(k8s_cluster.ca_cert.read_bytes()).decode(),
                },
                "rules": [{"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"], "resources": ["pods"]}],
                "objectSelector": {"matchLabels": {selector: "1"}},
                "failurePolicy": "Fail",
                "sideEffects": "None",
                "admissionReviewVersions": ["v1"],
                "timeoutSeconds": 5,
            }
        ],
    }
    k8s_cluster.create(config)
    try:
        yield selector
    finally:
        k8s_cluster.kubectl("delete", "mutatingwebhookconfiguration", "gemtrace-test-labeller", "--ignore-not-found")
        server.shutdown()


def test_mutating_webhook_patch_is_applied(k8s_cluster: K8sCluster, labelling_webhook: str) -> None:
    name = "webhook-mutated"
    manifest = pod_manifest(name, ["true"])
    manifest["metadata"]["labels"] = {labelling_webhook: "1"}
    # The apiserver starts calling a new webhook once its informer has the configuration: not at once.
    deadline = time.monotonic() + 30
    try:
        while True:
            k8s_cluster.create(manifest)
            labels = k8s_cluster.get("pod", name)["metadata"]["labels"]
            if MUTATED_LABEL in labels or time.monotonic() > deadline:
                break
            k8s_cluster.kubectl("delete", "pod", name, "--wait=true", "--grace-period=0", "--force")
            time.sleep(0.5)
        assert labels.get(MUTATED_LABEL) == "yes", f"{labels}\n{k8s_cluster.diagnosis(name)}"
        # Deleted once it has run, not while the kubelet starts it (delete_pod says why).
        k8s_cluster.wait_pod(name, lambda pod: pod["status"].get("phase") in ("Succeeded", "Failed"), "end")
    finally:
        k8s_cluster.delete_pod(name)
