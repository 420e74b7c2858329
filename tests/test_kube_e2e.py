"""gemtrace on the real one-node cluster (tests/k8s/cluster.sh), with the simulated GPU on the node,
installed the README's way: the agent on the host with the node's files, as the .deb puts it, and
`kubectl apply -k deploy/` itself, with the image of `make image` under the name and tag deploy/ gives
it, for the device plugin's DaemonSet and the webhook, whose certificate and caBundle it makes itself.
Pods ask for shares and are gated with nothing set by their user.

Nothing of deploy/ is changed for the test: what this host lacks of a GPU node, the cluster provides
(cluster.sh's header): a pod network, the node's /etc/gemtrace, /run/gemtrace, /var/lib/gemtrace and
/usr/lib/gemtrace (each test's agent takes them, emptied, in turn: `on_the_node`), and the simulated
GPU given to the plugin's container as NVIDIA's container runtime gives a real driver. The pods of
the tests mount the simulated GPU's libraries themselves, as an image would hold CUDA's."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from agent_host import CONFIG, Host, Running, stop
from k8s_cluster import K8sCluster, pod_manifest
from simgpu_env import REPO, SIMGPU_DIR, SimGpu
from testkit import GiB, wait_until

from gemtrace.config import load
from gemtrace.kube import shares
from gemtrace.kube.rooms import ANNOTATION_GPU_ROOM, parse_rooms

pytestmark = [pytest.mark.e2e, pytest.mark.k8s]

GATE = REPO / "build" / "libgemgate.so"
DEPLOY = REPO / "deploy"
NAMESPACE = "gemtrace-system"
PLUGIN = "app.kubernetes.io/name=gemtrace-device-plugin"
WEBHOOK = "app.kubernetes.io/name=gemtrace-webhook"
EXTENDER = "app.kubernetes.io/name=gemtrace-scheduler-extender"
# deploy/scheduler-extender.yaml's nodeSelector: the control-plane hosts, where kube-scheduler calls it.
CONTROL_PLANE = "node-role.kubernetes.io/control-plane"
# deploy/'s webhook configurations, by kind: the webhook puts its CA in both.
CONFIGURATIONS = {"mutatingwebhookconfiguration": "gemtrace-webhook",
                  "validatingwebhookconfiguration": "gemtrace-webhook-validation"}
WINDOW_S = 8  # of both pods busy: 4000 kernels of 2 ms; a share's error of a kernel or two is 0.05 points


def import_image(cluster: K8sCluster) -> str:
    """deploy/'s image, built by `make image` (cached: rebuilt only when its inputs changed) and
    imported into the cluster's containerd, as an operator imports it into each node's."""
    built = subprocess.run(["make", "-C", str(REPO), "--no-print-directory", "image"], capture_output=True,
                           text=True, timeout=1800)
    assert built.returncode == 0, f"make image failed:\n{built.stdout[-3000:]}\n{built.stderr[-3000:]}"
    archive = REPO / "build" / "image" / "gemtrace-image.tar"
    cluster.import_image(archive)
    return (REPO / "build" / "image" / "ref").read_text().strip()


@pytest.fixture(scope="session")
def gemtrace_image(k8s_cluster: K8sCluster) -> str:
    return import_image(k8s_cluster)


def on_the_node(cluster: K8sCluster, sim: SimGpu, tmp: Path) -> Host:
    """A host whose agent has the node's files (the cluster's NODE_ROOT, which the kubelet and the
    containers see as /etc/gemtrace, /run/gemtrace, /var/lib/gemtrace and /usr/lib/gemtrace), emptied
    of an earlier test's, the gate where the .deb installs it, and `sim` as the node's GPU."""
    for directory in cluster.node_dirs:
        for path in directory.iterdir():
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
    gate = cluster.node_root / "usr/lib/gemtrace/libgemgate.so"
    shutil.copy(GATE, gate.with_suffix(".new"))
    gate.with_suffix(".new").rename(gate)  # a new inode: no process maps a file being written
    config = cluster.node_root / "etc/gemtrace/resource.conf"
    config.write_text(CONFIG)
    driver = {k: v for k, v in sim.env().items() if k.startswith("SIMGPU_")}
    cluster.gpu_driver.write_text("".join(f"{k}={v}\n" for k, v in {"LD_LIBRARY_PATH": str(SIMGPU_DIR),
                                                                      **driver}.items()))
    return Host(sim, config, cluster.node_root / "run/gemtrace", tmp)


class Deployment:
    """deploy/ on the cluster, as the README applies it."""

    def __init__(self, cluster: K8sCluster) -> None:
        self.cluster = cluster
        self.applied_at = 0.0

    def apply(self) -> None:
        """The README's operator steps: label the GPU node, `kubectl apply -k deploy/`. The test node is
        the control-plane host too (its kube-scheduler runs with deploy/kube-scheduler/config.yaml's
        extenders: tests/k8s/cluster.sh), labelled so as kubeadm labels one."""
        self.cluster.kubectl("label", "node", self.cluster.node, "gemtrace.io/gpu=true", f"{CONTROL_PLANE}=",
                             "--overwrite")
        self.cluster.kubectl("apply", "-k", str(DEPLOY))
        self.applied_at = time.monotonic()

    def delete(self) -> None:
        """Everything deploy/ made, gone (the namespace too) before the next test applies it again."""
        self.cluster.kubectl("delete", "-k", str(DEPLOY), "--ignore-not-found", "--wait=true", "--timeout=120s",
                             timeout=150)

    def pods(self, selector: str) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = json.loads(self.cluster.kubectl(
            "get", "pods", "-n", NAMESPACE, "-l", selector, "-o", "json"))["items"]
        return [p for p in items if not p["metadata"].get("deletionTimestamp")]

    def logs(self, selector: str) -> str:
        try:
            return self.cluster.kubectl("logs", "-n", NAMESPACE, "-l", selector, "--tail=-1")
        except AssertionError as e:
            return str(e)

    def describe(self) -> str:
        try:
            return self.cluster.kubectl("describe", "pods", "-n", NAMESPACE)
        except AssertionError as e:
            return str(e)


class Node:
    """The node: the agent on the host (restartable) and deploy/'s plugin and webhook in pods."""

    def __init__(self, cluster: K8sCluster, host: Host) -> None:
        self.cluster, self.host = cluster, host
        # Where deploy/'s plugin writes them: /var/lib/gemtrace/kube and /etc/gemtrace/resource.d.
        self.names = cluster.node_root / "var/lib/gemtrace/kube/pods.json"
        self.dropins = host.config.parent / "resource.d"
        self.agent = self.start_agent()
        self.deployment = Deployment(cluster)
        self.plugin_uid = ""

    def start_agent(self) -> Running:
        return self.host.start_agent("--config-poll", "0.2", "--pod-names", str(self.names))

    def plugin_log(self) -> str:
        return self.deployment.logs(PLUGIN)

    def wait_registered(self) -> None:
        """Until a plugin pod other than the last one seen runs and has registered both resources."""
        def registered() -> bool:
            running = [p for p in self.deployment.pods(PLUGIN) if p["status"].get("phase") == "Running"
                       and p["metadata"]["uid"] != self.plugin_uid]
            if len(running) != 1:
                return False
            (pod,) = running
            log = self.cluster.kubectl("logs", "-n", NAMESPACE, pod["metadata"]["name"])
            if '"event": "registered"' not in log:  # both resources, in one event
                return False
            self.plugin_uid = pod["metadata"]["uid"]
            return True
        try:
            wait_until("the plugin's pod registering both resources", registered, timeout=120, step=0.5)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{self.deployment.describe()}\n{self.plugin_log()}") from None

    def install(self, memory: str = "16", util: str | None = None) -> None:
        """deploy/ applied, until this plugin has registered and the node advertises `memory` GiB and
        `util`% (the GPUs' shares; default: what the resource file's own MinUtils leave of them)."""
        if util is None:
            util = self.util_left()
        self.deployment.apply()
        # The node's figures may be the previous test's plugin's: wait for this one's registration, or a
        # pod placed meanwhile fails the kubelet's admission (its devices unknown for a moment).
        self.wait_registered()
        print(f"plugin registered {time.monotonic() - self.deployment.applied_at:.1f} s after kubectl apply -k")

        def advertised() -> bool:
            capacity = self.cluster.get("node", self.cluster.node)["status"]["allocatable"]
            return capacity.get(shares.GPU_MEMORY) == memory and capacity.get(shares.GPU_UTIL) == util

        wait_until(f"the node advertising {memory} GiB and {util}%", advertised, timeout=60, step=0.5)
        self.wait_extender()

    def wait_extender(self) -> None:
        """Until the scheduler extender is ready on this (the control-plane) host: until then the
        scheduler skips it (ignorable), and a pod no GPU takes whole would fail at the node instead."""
        def ready() -> bool:
            return any(c.get("ready") for p in self.deployment.pods(EXTENDER)
                       for c in p["status"].get("containerStatuses", []))
        try:
            wait_until("the scheduler extender ready", ready, timeout=120, step=0.5)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{self.deployment.describe()}\n{self.deployment.logs(EXTENDER)}") from None

    def rooms(self) -> list[tuple[int, int]] | None:
        """(GiB, percent) free on each GPU, as the plugin's annotation on the node says (None: none yet)."""
        text = (self.cluster.get("node", self.cluster.node)["metadata"].get("annotations") or {}).get(
            ANNOTATION_GPU_ROOM)
        return None if text is None else [(r.memory_free, r.util_free) for r in parse_rooms(text)]

    def util_left(self) -> str:
        """The node's util devices as the plugin advertises them: 100 a GPU less the resource file's own
        MinUtils there (gemtrace.kube.shares.util_left)."""
        region = self.host.region()
        try:
            uuids = region.gpu_uuids()
        finally:
            region.close()
        return str(sum(shares.util_left(load(self.host.config).groups.values(), uuids).values()))

    def wait_advertising_util(self) -> None:
        """Until the node advertises what the resource file leaves, after a change of the file."""
        util = self.util_left()
        wait_until(f"the node advertising {util}%", lambda: self.cluster.get("node", self.cluster.node)[
            "status"]["allocatable"].get(shares.GPU_UTIL) == util, timeout=60, step=0.5)

    def restart_plugin(self) -> None:
        """The plugin's pod deleted: its DaemonSet makes another, which must register anew."""
        # As any pod is deleted here: the 1.20 kubelet may take a minute to report a killed pod gone
        # (seen in CI: its containers dead in 1 s, the pod removed 70 s later), and the DaemonSet makes
        # the new pod only then.
        for pod in self.deployment.pods(PLUGIN):
            self.cluster.delete_pod(pod["metadata"]["name"], NAMESPACE)
        self.wait_registered()

    def create(self, manifest: dict[str, Any]) -> None:
        """Create the pod; one that the kubelet's admission refuses (UnexpectedAdmissionError: a device
        plugin registering at that moment, or devices of a pod just deleted still counted) is made
        again, as its controller would."""
        name = manifest["metadata"]["name"]
        for _ in range(5):
            self.cluster.create(manifest)
            pod = self.cluster.wait_pod(name, lambda p: p["status"].get("phase") != "Pending"
                                        or any(c.get("state", {}).get("running") or c.get("state", {}).get("terminated")
                                               for c in p["status"].get("containerStatuses", [])), "admission")
            if pod["status"].get("reason") != "UnexpectedAdmissionError":
                return
            self.cluster.delete_pod(name)
            time.sleep(1)
        raise AssertionError(f"pod {name}: refused by admission 5 times\n{self.cluster.diagnosis(name)}")

    def close(self) -> None:
        try:
            self.deployment.delete()
        finally:
            if self.agent.proc.poll() is None:
                stop(self.agent)

    def pod(self, name: str, script: str, limits: dict[str, str] | None = None,
            labels: dict[str, str] | None = None) -> dict[str, Any]:
        """A pod running `script` with the simulated GPU's driver (only the driver: nothing of gemtrace)."""
        manifest = pod_manifest(name, ["sh", "-c", script], limits=limits)
        if labels:
            manifest["metadata"]["labels"] = labels
        container = manifest["spec"]["containers"][0]
        container["env"] = [{"name": "LD_LIBRARY_PATH", "value": "/simgpu"},
                            {"name": "SIMGPU_STATE_DIR", "value": "/simgpu-state"}]
        container["volumeMounts"] = [{"name": "simgpu", "mountPath": "/simgpu", "readOnly": True},
                                     {"name": "simgpu-state", "mountPath": "/simgpu-state"}]
        manifest["spec"]["volumes"] = [
            {"name": "simgpu", "hostPath": {"path": str(SIMGPU_DIR)}},
            {"name": "simgpu-state", "hostPath": {"path": self.host.sim.env()["SIMGPU_STATE_DIR"]}},
        ]
        return manifest

    def run(self, manifest: dict[str, Any]) -> list[dict[str, Any]]:
        """Create the pod, wait for its end, and return its JSON lines (it must succeed)."""
        name = manifest["metadata"]["name"]
        self.create(manifest)
        pod = self.cluster.wait_pod(name, lambda p: p["status"].get("phase") in ("Succeeded", "Failed"), "end")
        out = self.cluster.kubectl("logs", name)
        assert pod["status"]["phase"] == "Succeeded", f"{out}\n{self.cluster.diagnosis(name)}"
        return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def running_node(cluster: K8sCluster, host: Host, memory: str = "16") -> Iterator[Node]:
    """deploy/ applied for the agent on `host`, once the node advertises `memory` GiB and the util the
    resource file leaves."""
    n = Node(cluster, host)
    try:
        n.install(memory)
        yield n
    finally:
        print(n.plugin_log())
        n.close()


@pytest.fixture
def node(k8s_cluster: K8sCluster, gemtrace_image: str, simgpu: SimGpu, tmp_path: Path) -> Iterator[Node]:
    yield from running_node(k8s_cluster, on_the_node(k8s_cluster, simgpu, tmp_path))


@pytest.fixture
def two_gpu_node(k8s_cluster: K8sCluster, gemtrace_image: str, simgpu_factory: Callable[..., SimGpu],
                 tmp_path: Path) -> Iterator[Node]:
    """The node with 2 simulated GPUs of 8 GiB, binpacked as deploy/ places by default. CONFIG's
    [train] reserves MinUtil 0.2 of every GPU: 80 util devices on each, and 0.5 fits on either."""
    host = on_the_node(k8s_cluster, simgpu_factory(devices=2, memory="8GiB"), tmp_path)
    yield from running_node(k8s_cluster, host, "16")


def test_a_pod_asking_for_2_gib_and_30_percent_is_gated_with_nothing_set(node: Node) -> None:
    name = "share-2g-30"
    manifest = node.pod(name, "/simgpu/simgpu-rt meminfo && /simgpu/simgpu-rt alloc --hold 60 1GiB 1536MiB",
                        limits={shares.GPU_MEMORY: "2", shares.GPU_UTIL: "30"})
    manifest["metadata"]["annotations"] = {shares.ANNOTATION_MAX_UTIL: "0.5"}
    cluster = node.cluster
    try:
        node.create(manifest)
        lines = _wait_holding(node, name)
        meminfo, first, second, *_ = lines
        out = f"{cluster.kubectl('logs', name)}\n--- agent\n{node.agent.log.read_text()[-4000:]}"
        assert meminfo["total"] == 2 * GiB, out
        assert first["name"] == "CUDA_SUCCESS", out
        assert second["name"] == "CUDA_ERROR_OUT_OF_MEMORY", out

        # Its group: the requested GiB, 30% guaranteed, the annotation's MaxUtil, its pod's cgroup.
        uid = cluster.get("pod", name)["metadata"]["uid"]
        dropins = list((node.dropins).glob("k8s-*.conf"))
        assert len(dropins) == 1, [(p.name, p.read_text()) for p in dropins]
        (dropin,) = dropins
        group = dropin.stem
        text = wait_until("the Cgroup rule", lambda: "Cgroup" in dropin.read_text() and dropin.read_text())
        assert f"default/{name} container main" in text
        assert "MemoryLimit = 2GiB\nMinUtil = 0.3\nMaxUtil = 0.5\n" in text
        assert f"/pod{uid}\n" in text

        # Its series carry its namespace, pod and container.
        labels = ('namespace="default"', f'pod="{name}"')

        def series() -> list[str]:
            return [line for line in node.agent.metrics().splitlines() if all(x in line for x in labels)]

        try:
            found = wait_until(f"series with {labels}", lambda: (
                any(s.startswith("gemtrace_process_memory_bytes{") and 'container="main"' in s for s in series())
                and series()), timeout=30, step=0.5)
        except AssertionError as e:
            processes = [s for s in node.agent.metrics().splitlines() if s.startswith("gemtrace_process_memory")]
            raise AssertionError(f"{e}\n{processes}\n{node.names.read_text()}") from None
        memory = next(s for s in found if s.startswith("gemtrace_process_memory_bytes{"))
        assert f'group="{group}"' in memory and float(memory.rsplit(" ", 1)[1]) == GiB
        limit = next(s for s in found if s.startswith("gemtrace_group_memory_limit_bytes{"))
        assert float(limit.rsplit(" ", 1)[1]) == 2 * GiB
    finally:
        cluster.delete_pod(name)


def test_restarting_the_plugin_and_the_agent_keeps_a_running_pod_gated_and_grouped(node: Node) -> None:
    name = "share-restarts"
    manifest = node.pod(name, "/simgpu/simgpu-rt alloc --hold 90 1GiB", limits={shares.GPU_MEMORY: "2"})
    cluster = node.cluster
    dropins = node.dropins

    def our_series() -> list[str]:
        return [s for s in node.agent.metrics().splitlines()
                if s.startswith("gemtrace_process_memory_bytes{") and f'pod="{name}"' in s
                and 'container="main"' in s]

    try:
        node.create(manifest)
        _wait_holding(node, name)
        (before,) = wait_until("its series", our_series, timeout=30, step=0.5)
        files = {p.name: p.read_text() for p in dropins.glob("k8s-*.conf")}

        node.restart_plugin()
        stop(node.agent)
        node.agent = node.start_agent()
        time.sleep(3)  # some reconciliations of the new plugin, some polls of the new agent

        # The same one file per grant: a restarted plugin rebuilt it from PodResources, counted nothing twice.
        assert {p.name: p.read_text() for p in dropins.glob("k8s-*.conf")} == files
        (after,) = wait_until("its series from the new agent", our_series, timeout=30, step=0.5)
        assert after == before  # same pid, group, pod labels and 1 GiB
        # Every device back, none counted twice. The plugin calls the GPU unhealthy while no agent beats
        # (a second or so here), and the kubelet reports the devices' return at its next node status.
        wait_until("the node advertising its 16 GiB again", lambda: cluster.get("node", cluster.node)["status"][
            "allocatable"].get(shares.GPU_MEMORY) == "16", timeout=60, step=0.5)
    finally:
        cluster.delete_pod(name)


def test_two_pods_asking_for_30_and_70_percent_get_their_shares_within_2_points(node: Node) -> None:
    # Each pod runs 2 ms kernels without pause for longer than the test; the window opens once both
    # groups' GPU time grows. Their shares are each group's part of the GPU time the agent counted
    # in the window; the GPU must have been kept busy (a share of an idle GPU would prove nothing).
    targets = {"share-30": 30, "share-70": 70}
    cluster = node.cluster
    loop = "/simgpu/simgpu-rt launch-loop --kernel-ns 2000000 --launches-per-iter 4 --seconds 60"

    def gpu_seconds() -> dict[str, float]:
        return _pod_gpu_seconds(node, targets)

    # The main file's [train] reserves 0.2 of every GPU, which leaves 80 util devices: 30 + 70 need all
    # 100, which the plugin advertises once [train] reserves nothing.
    node.host.config.write_text(CONFIG.replace("MinUtil = 0.2\n", ""))
    node.wait_advertising_util()

    def quotas() -> dict[str, int] | None:
        found = {}
        region = node.host.region()
        try:
            for dropin in (node.dropins).glob("k8s-*.conf"):
                for name in targets:
                    index = region.group_index(dropin.stem)
                    if f"default/{name} " in dropin.read_text() and index is not None:
                        found[name] = region.layout.groups[index].max_util_ppm
        finally:
            region.close()
        return found if found == {n: u * 10_000 for n, u in targets.items()} else None

    try:
        for name, util in targets.items():
            node.create(node.pod(name, loop, limits={shares.GPU_MEMORY: "1", shares.GPU_UTIL: str(util)}))
        wait_until("the agent capping the pods' groups at 0.3 and 0.7", quotas, timeout=120, step=0.5)
        first = wait_until("both pods' groups counting GPU time", lambda: (
            len(seen := gpu_seconds()) == 2 and all(v > 0 for v in seen.values()) and seen), timeout=120, step=0.5)
        time.sleep(1)  # past the first launches, before the scheduler has both groups
        start, t0 = gpu_seconds(), time.monotonic()
        time.sleep(WINDOW_S)
        end, t1 = gpu_seconds(), time.monotonic()
        used = {name: end[name] - start[name] for name in targets}
        busy = sum(used.values()) / (t1 - t0)
        shares_ = {name: used[name] / sum(used.values()) for name in targets}
        assert busy > 0.85, f"the GPU was busy {busy:.2f} of the window: {used}, first {first}"
        for name, util in targets.items():
            assert abs(shares_[name] - util / 100) <= 0.02, (shares_, used, busy)
        print(f"shares {shares_}, GPU busy {busy:.3f} over {t1 - t0:.1f} s")
        for name in targets:  # both still running: the window saw both busy
            assert cluster.get("pod", name)["status"]["phase"] == "Running", cluster.diagnosis(name)
    finally:
        for name in targets:
            cluster.delete_pod(name)


CHURN_PODS = 8  # enough to pass 1 with the main file's 0.2 and 0.3 a grant when deleted grants lingered


def test_pods_created_and_deleted_one_after_another_each_get_their_limit(node: Node) -> None:
    """Each pod asks for 2 GiB and 30%; the main file reserves 0.2 of the GPU. Were a deleted pod's
    grant kept a while, its MinUtil would still count, and the fourth pod's would take the GPU past 1.
    Admission is measured from the create to the container started, against plain pods' in the
    same run: the cluster's own pace on this machine."""
    cluster, dropins = node.cluster, node.dropins

    def admitted(manifest: dict[str, Any]) -> float:
        started = time.monotonic()
        node.create(manifest)
        return time.monotonic() - started

    plain = []
    for i in range(3):
        name = f"churn-plain-{i}"
        try:
            plain.append(admitted(node.pod(name, "sleep 60")))
        finally:
            cluster.delete_pod(name)
    latencies, limits = [], []
    for i in range(CHURN_PODS):
        name = f"churn-{i}"
        manifest = node.pod(name, "/simgpu/simgpu-rt meminfo && sleep 60",
                            limits={shares.GPU_MEMORY: "2", shares.GPU_UTIL: "30"})
        try:
            latencies.append(admitted(manifest))
            lines = wait_until("its meminfo", partial(_json_lines, cluster, name), timeout=60, step=0.2)
            limits.append(lines[0]["total"])
        finally:
            cluster.delete_pod(name)
        # Gone with its pod: no grant of it left for the next pod's to add up with.
        wait_until("its grant removed", lambda: not list(dropins.glob("k8s-*.conf")), timeout=5, step=0.1)
    print(f"admission: plain {[round(x, 2) for x in plain]} s, shared {[round(x, 2) for x in latencies]} s")
    assert limits == [2 * GiB] * CHURN_PODS, (limits, node.agent.log.read_text()[-3000:])
    assert "dropin_refused" not in node.agent.log.read_text()
    # An Allocate that waits for a group never defined adds its 5 s (deviceplugin.ALLOCATE_WAIT_S).
    assert max(latencies) < max(plain) + 3, (plain, latencies)


def test_a_share_the_resource_file_leaves_no_room_for_stays_pending_and_one_that_stops_fitting_is_refused_alone(
        node: Node) -> None:
    """The main file's [train] reserves 0.2: the node advertises 80 util devices, so a pod asking 30%
    beside a 70% one stays Pending with the scheduler's reason (before, the kubelet handed out all
    100 and the agent refused the second grant, which then ran in no group of its own). When the
    operator raises [train]'s MinUtil to 0.4, the 70% grant no longer fits: it is refused alone, with an
    event on its pod, and the 30% pod still waits."""
    cluster = node.cluster
    try:
        node.create(node.pod("fits-70", "/simgpu/simgpu-rt meminfo && sleep 120",
                             limits={shares.GPU_MEMORY: "2", shares.GPU_UTIL: "70"}))
        wait_until("fits-70's meminfo", partial(_json_lines, cluster, "fits-70"), timeout=60, step=0.2)
        cluster.create(node.pod("over-30", "true", limits={shares.GPU_MEMORY: "2", shares.GPU_UTIL: "30"}))
        events = cluster.wait_events("over-30", "FailedScheduling")
        assert any(f"Insufficient {shares.GPU_UTIL}" in e["message"] for e in events), events
        assert cluster.get("pod", "over-30")["status"]["phase"] == "Pending"
        assert _json_lines(cluster, "fits-70")[0]["total"] == 2 * GiB

        node.host.config.write_text(CONFIG.replace("MinUtil = 0.2\n", "MinUtil = 0.4\n"))
        (event,) = cluster.wait_events("fits-70", "GemtraceGrantRefused")
        assert event["type"] == "Warning" and event["involvedObject"]["uid"] == cluster.get("pod", "fits-70")[
            "metadata"]["uid"]
        assert "the MinUtils add up to 1.1" in event["message"] and "train 0.4" in event["message"], event
        node.wait_advertising_util()  # 60: still no room for the 30% pod beside the 70% one's devices
        assert cluster.get("pod", "over-30")["status"]["phase"] == "Pending"
    finally:
        for name in ("fits-70", "over-30"):
            cluster.delete_pod(name)


def _pod_gpu_seconds(node: Node, pods: Iterable[str]) -> dict[str, float]:
    """The GPU seconds the agent counted in each pod's groups, by pod name."""
    found: dict[str, float] = {}
    for line in node.agent.metrics().splitlines():
        if line.startswith("gemtrace_group_gpu_seconds_total{"):
            for name in pods:
                if f'pod="{name}"' in line:
                    found[name] = found.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return found


def test_a_util_only_pod_is_its_group_and_held_to_its_cap(node: Node) -> None:
    """A pod asking only for gemtrace.io/gpu-util: 20 gets no GEMTRACE_GROUP; its processes are its
    group by their cgroup. Alone on the GPU, its group gets 0.2 of it and no more."""
    name = "util-only-20"
    loop = "/simgpu/simgpu-rt launch-loop --kernel-ns 2000000 --launches-per-iter 4 --seconds 60"
    cluster = node.cluster
    try:
        node.create(node.pod(name, loop, limits={shares.GPU_UTIL: "20"}))
        first = wait_until("its group counting GPU time", lambda: _pod_gpu_seconds(node, [name]).get(name),
                           timeout=120, step=0.5)
        time.sleep(1)  # past the first launches
        start, t0 = _pod_gpu_seconds(node, [name])[name], time.monotonic()
        time.sleep(WINDOW_S)
        end, t1 = _pod_gpu_seconds(node, [name])[name], time.monotonic()
        share = (end - start) / (t1 - t0)
        print(f"util-only pod: {share:.3f} of the GPU over {t1 - t0:.1f} s (first {first:.3f} s)")
        # Work-conserving but capped: alone it would take the whole GPU.
        assert 0.15 <= share <= 0.23, share
        assert cluster.get("pod", name)["status"]["phase"] == "Running", cluster.diagnosis(name)
    finally:
        cluster.delete_pod(name)


def test_a_pods_processes_stay_in_its_memory_limit_whatever_their_environment(node: Node) -> None:
    """A container that clears its environment (env -i: no GEMTRACE_GROUP, no GEMTRACE_STATE_DIR) and
    one that asks for [infer], open to all and without a MemoryLimit: both are held to their pod's 1 GiB."""
    rt = "/simgpu/simgpu-rt"
    escapes = {"env-cleared": f"env -i LD_LIBRARY_PATH=/simgpu SIMGPU_STATE_DIR=/simgpu-state {rt}",
               "other-group": f"GEMTRACE_GROUP=infer {rt}"}
    cluster = node.cluster
    try:
        for name, program in escapes.items():
            node.create(node.pod(name, f"{program} meminfo && {program} alloc --hold 60 768MiB 512MiB",
                                 limits={shares.GPU_MEMORY: "1"}))
        for name in escapes:
            meminfo, first, second, *_ = _wait_holding(node, name)
            out = f"{name}: {cluster.kubectl('logs', name)}\n--- agent\n{node.agent.log.read_text()[-3000:]}"
            assert meminfo["total"] == GiB, out
            assert (first["name"], second["name"]) == ("CUDA_SUCCESS", "CUDA_ERROR_OUT_OF_MEMORY"), out
    finally:
        for name in escapes:
            cluster.delete_pod(name)


def _wait_holding(node: Node, name: str) -> list[dict[str, Any]]:
    try:
        lines: list[dict[str, Any]] = wait_until("the pod holding its memory", lambda: _holding(node.cluster, name),
                                                 timeout=120, step=0.5)
        return lines
    except AssertionError as e:
        raise AssertionError(f"{e}\n{node.cluster.diagnosis(name)}\n--- plugin\n"
                             f"{node.plugin_log()[-3000:]}") from None


def _holding(cluster: K8sCluster, name: str) -> list[dict[str, Any]] | None:
    if cluster.get("pod", name)["status"].get("phase") != "Running":
        return None
    lines = _json_lines(cluster, name)
    return lines if any("holding" in line for line in lines) else None


def _json_lines(cluster: K8sCluster, name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in cluster.kubectl("logs", name).splitlines() if line.startswith("{")]


def test_a_pod_asking_for_more_than_a_gpu_has_stays_pending_and_says_why(node: Node) -> None:
    name = "share-too-big"
    node.cluster.create(node.pod(name, "true", limits={shares.GPU_MEMORY: "17"}))
    try:
        events = node.cluster.wait_events(name, "FailedScheduling")
        assert any(f"Insufficient {shares.GPU_MEMORY}" in e["message"] for e in events), events
        assert node.cluster.get("pod", name)["status"]["phase"] == "Pending"
    finally:
        node.cluster.delete_pod(name)


@pytest.fixture
def webhook(node: Node) -> Iterator[dict[str, dict[str, Any]]]:
    """deploy/'s webhook, once it has filled its Secret and put the CA in both its configurations,
    with nobody's help: the configurations as they are then, by kind."""
    cluster = node.cluster

    def ready() -> dict[str, dict[str, Any]] | None:
        configs = {kind: cluster.get(kind, name) for kind, name in CONFIGURATIONS.items()}
        running = [p for p in node.deployment.pods(WEBHOOK)
                   if any(c.get("ready") for c in p["status"].get("containerStatuses", []))]
        bundles = [c["webhooks"][0]["clientConfig"].get("caBundle") for c in configs.values()]
        return configs if running and all(bundles) else None

    try:
        configs = wait_until("the webhook's caBundle in both its configurations", ready, timeout=120, step=0.5)
        print(f"webhook ready with its own certificate {time.monotonic() - node.deployment.applied_at:.1f} s "
              "after kubectl apply -k")
    except AssertionError as e:
        raise AssertionError(f"{e}\n{node.deployment.describe()}\n{node.deployment.logs(WEBHOOK)}") from None
    yield configs
    print(node.deployment.logs(WEBHOOK))


def test_the_webhook_gates_a_labelled_pod_in_its_group(node: Node, webhook: dict[str, dict[str, Any]]) -> None:
    name = "labelled-train"
    manifest = node.pod(name, "/simgpu/simgpu-rt meminfo", labels={shares.LABEL_GROUP: "train"})
    # Both caBundles are the CA of the Secret the webhook filled.
    secret = node.cluster.kubectl("get", "secret", "-n", NAMESPACE, "gemtrace-webhook-tls", "-o", "json")
    for config in webhook.values():
        assert config["webhooks"][0]["clientConfig"]["caBundle"] == json.loads(secret)["data"]["ca.crt"]
    # The apiserver calls a new webhook once its informer has it, and reaches it once the Service's
    # endpoints name the pod: until then a labelled pod is refused (failurePolicy Fail).
    deadline = time.monotonic() + 30
    try:
        while True:
            try:
                node.cluster.create(manifest)
            except AssertionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
                continue
            mutated = any(v["name"] == "gemtrace-gate" for v in node.cluster.get("pod", name)["spec"]["volumes"])
            if mutated or time.monotonic() > deadline:
                break
            node.cluster.kubectl("delete", "pod", name, "--wait=true", "--grace-period=0", "--force")
            time.sleep(0.5)
        pod = node.cluster.wait_pod(name, lambda p: p["status"].get("phase") in ("Succeeded", "Failed"), "end")
        out = node.cluster.kubectl("logs", name)
        assert pod["status"]["phase"] == "Succeeded", out
        meminfo = json.loads(out.splitlines()[-1])
        assert meminfo["total"] == 1 * GiB  # [train]'s MemoryLimit in agent_host.CONFIG
    finally:
        node.cluster.delete_pod(name)
    # A label naming no group of the resource file, an annotation it would refuse: refused, with the reason
    # (the second by the validating configuration, failurePolicy Ignore: the apiserver may take a moment
    # more to call it with its caBundle, and admits the pod meanwhile).
    refusals = {
        "labelled-nosuch": (node.pod("labelled-nosuch", "true", labels={shares.LABEL_GROUP: "nosuch"}),
                            "label gemtrace.io/group=nosuch names no group of the nodes' resource file"),
        "priority-high": (node.pod("priority-high", "true", limits={shares.GPU_MEMORY: "1"}),
                          "annotation gemtrace.io/priority: Priority 'high' is not a whole number"),
    }
    refusals["priority-high"][0]["metadata"]["annotations"] = {shares.ANNOTATION_PRIORITY: "high"}
    for name, (manifest, reason) in refusals.items():
        assert re.search(re.escape(reason), _refusal(node, manifest))
        assert name not in node.cluster.kubectl("get", "pods", "-o", "name")
    unlabelled = node.cluster.create  # an unlabelled pod is left as it is
    name = "unlabelled"
    unlabelled(node.pod(name, "true"))
    try:
        volumes = {v["name"] for v in node.cluster.get("pod", name)["spec"]["volumes"]}
        assert "gemtrace-gate" not in volumes
    finally:
        node.cluster.delete_pod(name)


def _refusal(node: Node, manifest: dict[str, Any]) -> str:
    """What the apiserver said refusing the pod; a pod admitted is deleted and created again for 30 s."""
    name = manifest["metadata"]["name"]
    deadline = time.monotonic() + 30
    while True:
        try:
            node.cluster.create(manifest)
        except AssertionError as e:
            return str(e)
        node.cluster.delete_pod(name)
        assert time.monotonic() < deadline, f"pod {name}: admitted for 30 s"
        time.sleep(0.5)


def _dropin(node: Node, name: str) -> str:
    """The drop-in of the pod's one container, once the plugin has its pod (its Cgroup rule)."""
    def written() -> str | None:
        texts = [p.read_text() for p in (node.dropins).glob("k8s-*.conf")]
        mine = [t for t in texts if f"default/{name} container main" in t and "Cgroup" in t]
        return mine[0] if mine else None
    text: str = wait_until(f"{name}'s drop-in", written, timeout=30, step=0.2)
    return text


def test_4_gib_and_50_percent_on_two_8_gib_gpus_gets_4_gib_and_half_of_one_gpu(two_gpu_node: Node) -> None:
    node, name = two_gpu_node, "share-4g-50"
    # Two pods first, 1 GiB + 60% and 2 GiB + 10%: chosen one resource at a time, the first goes to one
    # GPU and the second to the other, which leaves one GPU the most memory and the other the most
    # time, and the 4 GiB + 50% pod split between them.
    before = [("share-1g-60", "1", "60"), ("share-2g-10", "2", "10")]
    manifest = node.pod(name, "/simgpu/simgpu-rt devices && /simgpu/simgpu-rt meminfo && "
                              "/simgpu/simgpu-rt alloc --hold 60 3GiB 1536MiB",
                        limits={shares.GPU_MEMORY: "4", shares.GPU_UTIL: "50"})
    try:
        for other, memory, util in before:
            node.create(node.pod(other, "sleep 120", limits={shares.GPU_MEMORY: memory, shares.GPU_UTIL: util}))
            node.cluster.wait_pod(other, lambda p: p["status"].get("phase") == "Running", "running")
        node.create(manifest)
        devices, meminfo, first, second, *_ = _wait_holding(node, name)
        out = f"{node.cluster.kubectl('logs', name)}\n--- plugin\n{node.plugin_log()[-3000:]}"
        # One GPU, seen as 4 GiB: 3 GiB is allocated, 1.5 GiB more is not.
        assert devices["count"] == 1 and meminfo["total"] == 4 * GiB, out
        assert (first["name"], second["name"]) == ("CUDA_SUCCESS", "CUDA_ERROR_OUT_OF_MEMORY"), out
        text = _dropin(node, name)
        assert "MemoryLimit = 4GiB\nMinUtil = 0.5\nMaxUtil = 0.5\n" in text, text
        assert f"Gpus = {devices['devices'][0]['uuid']}\n" in text, text
    finally:
        for pod in (name, *(other for other, _, _ in before)):
            node.cluster.delete_pod(pod)


def test_a_pod_asking_2_gpus_gets_both_each_limited(two_gpu_node: Node) -> None:
    node, name = two_gpu_node, "share-2-gpus"
    script = ("/simgpu/simgpu-rt devices && /simgpu/simgpu-rt meminfo --device 0 && "
              "/simgpu/simgpu-rt meminfo --device 1 && /simgpu/simgpu-rt alloc --device 1 --hold 60 3GiB 1536MiB")
    manifest = node.pod(name, script, limits={shares.GPU_MEMORY: "8", shares.GPU_UTIL: "100"})
    manifest["metadata"]["annotations"] = {shares.ANNOTATION_GPUS: "2"}
    try:
        node.create(manifest)
        devices, zero, one, first, second, *_ = _wait_holding(node, name)
        out = f"{node.cluster.kubectl('logs', name)}\n--- plugin\n{node.plugin_log()[-3000:]}"
        assert devices["count"] == 2 and (zero["total"], one["total"]) == (4 * GiB, 4 * GiB), out
        assert (first["name"], second["name"]) == ("CUDA_SUCCESS", "CUDA_ERROR_OUT_OF_MEMORY"), out
        text = _dropin(node, name)
        assert "MemoryLimit = 4GiB\nMinUtil = 0.5\nMaxUtil = 0.5\n" in text, text
        (gpus,) = [line.removeprefix("Gpus = ").split("; ") for line in text.splitlines() if line.startswith("Gpus")]
        assert sorted(gpus) == sorted(d["uuid"] for d in devices["devices"]), text
    finally:
        node.cluster.delete_pod(name)


def _unschedulable(pod: dict[str, Any]) -> str | None:
    """The scheduler's message on a pod it could place on no node (its PodScheduled condition)."""
    condition: dict[str, Any] = next(
        (c for c in pod["status"].get("conditions", []) if c["type"] == "PodScheduled"), {})
    message = condition.get("message")
    return message if condition.get("reason") == "Unschedulable" and isinstance(message, str) else None


def test_a_pod_asking_a_model_the_2_gpus_are_not_stays_pending_saying_why(two_gpu_node: Node) -> None:
    """The scheduler extender reads the node's GPUs in the plugin's annotation: a model the node lacks
    keeps the pod Pending with the reason, where the kubelet used to fail it (the fake kubelet's tier
    tests that fallback, gemtrace/kube/placer.py)."""
    node, name = two_gpu_node, "share-h100"
    manifest = node.pod(name, "true", limits={shares.GPU_MEMORY: "1", shares.GPU_UTIL: "10"})
    manifest["metadata"]["annotations"] = {shares.ANNOTATION_GPU_MODEL: "H100"}
    try:
        wait_until("the node's room", node.rooms, timeout=30, step=0.5)
        node.cluster.create(manifest)
        pod = node.cluster.wait_pod(name, lambda p: _unschedulable(p) is not None, "the scheduler's refusal")
        assert f"no GPU of {node.cluster.node} is a H100 (its GPUs: Simulated GPU)" in (_unschedulable(pod) or ""), pod
        time.sleep(2)
        pod = node.cluster.get("pod", name)
        assert pod["status"]["phase"] == "Pending" and not pod["spec"].get("nodeName"), pod["status"]
        assert not list((node.dropins).glob("k8s-*.conf"))
    finally:
        node.cluster.delete_pod(name)


def test_a_pod_no_gpu_takes_whole_stays_pending_until_one_does(two_gpu_node: Node) -> None:
    """Two pods of 5 GiB, one on each 8 GiB GPU: the node has 6 GiB free in all, 3 on each. A pod of
    4 GiB stays Pending with the scheduler extender's reason (the scheduler alone would bind it, and
    the kubelet fail it); once a 5 GiB pod is deleted, it is scheduled and gets its 4 GiB."""
    node, cluster = two_gpu_node, two_gpu_node.cluster
    fives, name = ("five-a", "five-b"), "four-waits"
    try:
        for five in fives:
            node.create(node.pod(five, "sleep 300", limits={shares.GPU_MEMORY: "5", shares.GPU_UTIL: "10"}))
            cluster.wait_pod(five, lambda p: p["status"].get("phase") == "Running", "running")
        # [train] reserves 20% of each GPU: 80 util devices, 70 free beside a pod's 10.
        wait_until("the plugin's room: 3 GiB and 70% on each GPU", lambda: node.rooms() == [(3, 70), (3, 70)],
                   timeout=30, step=0.5)
        cluster.create(node.pod(name, "/simgpu/simgpu-rt meminfo && sleep 120",
                                limits={shares.GPU_MEMORY: "4", shares.GPU_UTIL: "10"}))
        pod = cluster.wait_pod(name, lambda p: _unschedulable(p) is not None, "the scheduler's refusal")
        assert (f"no GPU of {cluster.node} has 4 GiB and 10% free (free: GPU 0 3 GiB 70%, GPU 1 3 GiB 70%)"
                in (_unschedulable(pod) or "")), pod["status"]
        time.sleep(3)  # the scheduler's retries meanwhile: still Pending, never at the node
        pod = cluster.get("pod", name)
        assert pod["status"]["phase"] == "Pending" and not pod["spec"].get("nodeName"), pod["status"]

        cluster.delete_pod(fives[0])
        deleted = time.monotonic()
        # The scheduler tries it again at the deletion; where the node's room had not changed yet, a
        # minute or so later (its unschedulable queue: docs/kubernetes.md, "Again when room comes").
        try:
            wait_until("the pending pod running once a GPU has room", lambda: cluster.get("pod", name)["status"].get(
                "phase") == "Running", timeout=180, step=0.5)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{cluster.diagnosis(name)}\n--- plugin\n{node.plugin_log()[-3000:]}") from None
        print(f"the pending pod ran {time.monotonic() - deleted:.1f} s after the 5 GiB pod's deletion")
        lines = wait_until("its meminfo", partial(_json_lines, cluster, name), timeout=60, step=0.2)
        assert lines[0]["total"] == 4 * GiB, (lines, cluster.diagnosis(name))
    finally:
        for pod_name in (name, *fives):
            cluster.delete_pod(pod_name)
