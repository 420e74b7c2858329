"""The one-node Kubernetes cluster of the e2e tests, and what a test does with it.

`tests/k8s/cluster.sh` owns the cluster (build, up, down; a person runs it by hand too); this module
only drives it: the session fixture `k8s_cluster` brings it up once and down at the end, and
`K8sCluster` runs kubectl against it, waits on pods, and puts the daemons' logs into every failure
message, since a pod that never starts is explained by the kubelet's or containerd's log, not by the
test's. It never starts a daemon itself.

`pod_manifest` makes pods that run once from the locally built test image, on the cluster's pod network.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from testkit import owning_host_dirs

CLUSTER_SH = Path(__file__).parent / "k8s" / "cluster.sh"
# Building Kubernetes the first time takes minutes on two cores; `up` itself well under one.
UP_TIMEOUT_S = 1800
POD_TIMEOUT_S = 120

Manifest = dict[str, Any]


def pod_manifest(
    name: str,
    command: list[str],
    image: str = "gemtrace.local/test:1",
    limits: dict[str, str] | None = None,
) -> Manifest:
    """A pod that runs `command` once on the test node, from an image containerd already holds."""
    container: Manifest = {"name": "main", "image": image, "imagePullPolicy": "Never", "command": command}
    if limits:
        container["resources"] = {"limits": limits}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "containers": [container],
        },
    }


class K8sCluster:
    """kubectl against the cluster that `cluster.sh up` started; `env` is what `cluster.sh env` prints."""

    def __init__(self, env: dict[str, str]) -> None:
        self.kubectl_bin = env["KUBECTL"]
        self.kubeconfig = env["KUBECONFIG"]
        self.logs = Path(env["GEMTRACE_K8S_LOGS"])
        self.node = env["GEMTRACE_K8S_NODE"]
        self.test_image = env["GEMTRACE_K8S_TEST_IMAGE"]
        self.device_plugins = Path(env["GEMTRACE_K8S_DEVICE_PLUGINS"])
        self.ca_cert = Path(env["GEMTRACE_K8S_CA_CERT"])
        self.ca_key = Path(env["GEMTRACE_K8S_CA_KEY"])
        self.containerd = env["GEMTRACE_K8S_CONTAINERD_SOCK"]
        self.ctr = env.get("GEMTRACE_K8S_CTR", "ctr")  # (bookworm's where the host's containerd is 2: cluster.sh)
        # What the node's kubelet and containers see as /etc/gemtrace, /run/gemtrace... (NODE_DIRS), and
        # the simulated GPU that its containers asking NVIDIA_VISIBLE_DEVICES get (KEY=VALUE lines).
        self.node_root = Path(env["GEMTRACE_K8S_NODE_ROOT"])
        self.node_dirs = [self.node_root / d.lstrip("/") for d in env["GEMTRACE_K8S_NODE_DIRS"].split()]
        self.gpu_driver = Path(env["GEMTRACE_K8S_GPU_DRIVER"])
        self.node_ns_pidfile = Path(env["GEMTRACE_K8S_NODE_NS_PIDFILE"])
        self.host_node_dirs = env["GEMTRACE_K8S_NODE_DIRS"].split()

    def check_node(self) -> None:
        """Fail loudly where the node's directories are no longer its own: their binds in its mount
        namespace go when the host's mount points are removed (an `apt purge gemtrace` beside the
        cluster), and its pods then get the host's paths instead."""
        pid = self.node_ns_pidfile.read_text().strip()
        mounted = {line.split()[4] for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines()}
        lost = [d for d in self.host_node_dirs if d not in mounted]
        assert not lost, (f"the test node's binds of {', '.join(lost)} are gone: something removed those host "
                          "directories while the cluster ran (an apt purge of gemtrace does); run it again alone")

    def import_image(self, archive: Path) -> None:
        """An image archive (`docker save` or OCI) into the node's containerd, where the kubelet finds it."""
        done = subprocess.run([self.ctr, "-a", self.containerd, "-n", "k8s.io", "images", "import", str(archive)],
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"ctr images import {archive} failed: {done.stderr.strip()}"

    def serving_cert(self, directory: Path, ip: str = "127.0.0.1") -> tuple[Path, Path]:
        """A TLS certificate and key for a server at `ip` (a webhook's), signed by the cluster's CA:
        the apiserver trusts it given `ca_cert` as the caBundle."""
        cert, key, ext = directory / "serving.crt", directory / "serving.key", directory / "serving.ext"
        ext.write_text(f"subjectAltName=IP:{ip}\nextendedKeyUsage=serverAuth\n")
        for argv in (
            [
                "openssl",
                "req",
                "-new",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-keyout",
                key,
                "-subj",
                "/CN=" + ip,
                "-out",
                directory / "serving.csr",
            ],
            [
                "openssl",
                "x509",
                "-req",
                "-in",
                directory / "serving.csr",
                "-CA",
                self.ca_cert,
                "-CAkey",
                self.ca_key,
                "-CAcreateserial",
                "-CAserial",
                directory / "ca.srl",
                "-days",
                "1",
                "-extfile",
                ext,
                "-out",
                cert,
            ],
        ):
            subprocess.run([str(a) for a in argv], check=True, capture_output=True)
        return cert, key

    def kubectl(self, *args: str, stdin: str | None = None, timeout: float = 60) -> str:
        """`timeout`: more than any --timeout among `args`, so that kubectl's own says what it waited for."""
        proc = subprocess.run(
            [self.kubectl_bin, "--kubeconfig", self.kubeconfig, *args],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc.stdout

    def get(self, kind: str, name: str) -> Manifest:
        result: Manifest = json.loads(self.kubectl("get", kind, name, "-o", "json"))
        return result

    def create(self, manifest: Manifest) -> None:
        self.check_node()
        self.kubectl("create", "-f", "-", stdin=json.dumps(manifest))

    def delete_pod(self, name: str, namespace: str = "default") -> None:
        """Delete the pod and wait until it is gone: until then the kubelet counts its devices as taken,
        and the next test's pod, which the scheduler may already place, fails admission with
        UnexpectedAdmissionError ("requested number of devices unavailable").

        Kubernetes 1.20's kubelet can leave a pod deleted while it was starting in Terminating for good
        (it killed the container but never reported the pod gone: seen in CI): after a while the pod
        is removed by force, which the kubelet then acts on."""
        try:
            self.kubectl("delete", "pod", name, "-n", namespace, "--ignore-not-found", "--grace-period=1",
                         "--wait=true", "--timeout=30s")
        except AssertionError as err:
            if "timed out waiting" not in str(err):
                raise
            self.kubectl("delete", "pod", name, "-n", namespace, "--ignore-not-found", "--grace-period=0", "--force",
                         "--wait=true")
            time.sleep(2)  # the kubelet's next sync releases the pod's devices

    def events(self, name: str, reason: str) -> list[Manifest]:
        out = self.kubectl(
            "get", "events", "-o", "json", "--field-selector", f"involvedObject.name={name},reason={reason}"
        )
        items: list[Manifest] = json.loads(out)["items"]
        return items

    def wait_pod(self, name: str, until: Callable[[Manifest], bool], what: str) -> Manifest:
        """The pod once `until(pod)` holds; fails with the pod's description and the logs after POD_TIMEOUT_S."""
        deadline = time.monotonic() + POD_TIMEOUT_S
        while True:
            pod = self.get("pod", name)
            if until(pod):
                return pod
            if time.monotonic() > deadline:
                raise AssertionError(f"pod {name}: no {what} after {POD_TIMEOUT_S}s\n{self.diagnosis(name)}")
            time.sleep(0.5)

    def wait_events(self, name: str, reason: str) -> list[Manifest]:
        deadline = time.monotonic() + POD_TIMEOUT_S
        while not (events := self.events(name, reason)):
            if time.monotonic() > deadline:
                raise AssertionError(f"pod {name}: no {reason} event after {POD_TIMEOUT_S}s\n{self.diagnosis(name)}")
            time.sleep(0.5)
        return events

    def diagnosis(self, pod: str) -> str:
        try:
            described = self.kubectl("describe", "pod", pod)
        except AssertionError as err:
            described = str(err)
        return f"{described}\n{log_tails(self.logs)}"


def log_tails(logs: Path, lines: int = 25) -> str:
    """The last lines of every daemon's log, headed by its path."""
    parts = []
    for log in sorted(logs.glob("*.log")):
        tail = log.read_text(errors="replace").splitlines()[-lines:]
        parts.append(f"--- {log} (last {len(tail)} lines)\n" + "\n".join(tail))
    return "\n".join(parts) or f"(no logs in {logs})"


def _cluster_sh(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(CLUSTER_SH), *args], capture_output=True, text=True, timeout=timeout)


def cluster_env() -> dict[str, str]:
    """What `cluster.sh env` prints: the running cluster's addresses and paths."""
    return dict(line.split("=", 1) for line in _cluster_sh("env", timeout=60).stdout.splitlines() if "=" in line)


@pytest.fixture(scope="session")
def k8s_cluster() -> Iterator[K8sCluster]:
    """The cluster, up for the whole session (building Kubernetes first if the cache has no build), and
    the host's gemtrace directories its node binds over held meanwhile (tests/test_deb.py waits)."""
    with owning_host_dirs("the Kubernetes test cluster"):
        up = _cluster_sh("up", timeout=UP_TIMEOUT_S)
        env = cluster_env()
        try:
            if up.returncode != 0:
                logs = log_tails(Path(env["GEMTRACE_K8S_LOGS"]))
                pytest.fail(f"tests/k8s/cluster.sh up failed:\n{up.stderr}\n{logs}")
            cluster = K8sCluster(env)
            cluster.check_node()
            yield cluster
        finally:
            down = _cluster_sh("down", timeout=300)
            assert down.returncode == 0, f"tests/k8s/cluster.sh down failed:\n{down.stderr}"
