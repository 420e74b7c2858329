"""The device plugin against a fake kubelet: no cluster. The fake serves Registration and
PodResources on sockets of a temporary directory, as the kubelet does, and drives the plugin through
ListAndWatch, GetPreferredAllocation and Allocate (`admit`: as the kubelet's device manager, one
resource after the other); a fake apiserver lists the node's pods; a real agent (on the simulated
GPU) reads the groups the plugin writes."""

from __future__ import annotations

import json
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid as uuidlib
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
import structlog.testing
from agent_host import CONFIG, Host, Running, stop
from simgpu_env import REPO, RT_CLIENT, Client, SimGpu, run_nvml
from testkit import GiB, MiB, scratch_cgroup, wait_until

from gemtrace import region as rg
from gemtrace.config import dropin_dir, load
from gemtrace.kube import kubelet, shares
from gemtrace.kube.deviceplugin import ALLOCATE_WAIT_S, DevicePlugin, group_defined, socket_name
from gemtrace.kube.grants import Grants, PodInfo, Pods
from gemtrace.kube.injection import Injection
from gemtrace.kube.pb import deviceplugin_pb2 as dp
from gemtrace.kube.pb import deviceplugin_pb2_grpc as dp_grpc
from gemtrace.kube.pb import podresources_pb2 as pr
from gemtrace.kube.pb import podresources_pb2_grpc as pr_grpc
from gemtrace.kube.rooms import GpuRoom, parse_rooms
from gemtrace.run.placement import PACKINGS

pytestmark = pytest.mark.e2e



class FakeKubelet(dp_grpc.RegistrationServicer, pr_grpc.PodResourcesListerServicer):
    """Registration on device-plugins/kubelet.sock and PodResources on pod-resources.sock."""

    def __init__(self, directory: Path, gpus: Sequence[tuple[str, int]]) -> None:
        self.dir = directory
        self.gpus = list(gpus)
        self.registrations: queue.Queue[dp.RegisterRequest] = queue.Queue()
        self.pods: list[pr.PodResources] = []
        self.listed: list[tuple[float, list[str]]] = []  # (time, pod names) of each List answered
        self.api: Pods = {}  # the pods `admit` made, as the apiserver says them
        self.server: grpc.Server | None = None
        self.start()

    def start(self) -> None:
        """Start (or restart, as a kubelet does: its sockets and the plugins' deleted first)."""
        if self.server is not None:
            # Wait for the stop: the old server removes its socket files as it ends, which would
            # otherwise be the new server's.
            self.server.stop(0).wait()
        for sock in self.dir.glob("*.sock"):
            sock.unlink(missing_ok=True)
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        dp_grpc.add_RegistrationServicer_to_server(self, self.server)
        pr_grpc.add_PodResourcesListerServicer_to_server(self, self.server)
        self.server.add_insecure_port(f"unix://{self.dir / 'kubelet.sock'}")
        self.server.add_insecure_port(f"unix://{self.dir / 'pod-resources.sock'}")
        self.server.start()

    def Register(self, request: dp.RegisterRequest, context: object) -> dp.Empty:
        self.registrations.put(request)
        return dp.Empty()

    def List(self, request: pr.ListPodResourcesRequest, context: object) -> pr.ListPodResourcesResponse:
        pods = list(self.pods)
        self.listed.append((time.monotonic(), [p.name for p in pods]))
        return pr.ListPodResourcesResponse(pod_resources=pods)

    def seen_without(self, pod: str, since: float) -> float:
        """When the plugin first listed the pods without `pod`, after `since` (when it left the list)."""
        def first() -> float | None:
            times = [t for t, names in self.listed if t >= since and pod not in names]
            return times[0] if times else None
        return float(wait_until(f"a List without {pod}", first, timeout=20))

    def registered(self) -> dict[str, dp.RegisterRequest]:
        got = {}
        while len(got) < len(shares.RESOURCES):
            r = self.registrations.get(timeout=20)
            got[r.resource_name] = r
        return got

    @staticmethod
    def advertised(stub: dp_grpc.DevicePluginStub) -> list[str]:
        """The healthy devices the plugin advertises now (ListAndWatch's first answer)."""
        stream = stub.ListAndWatch(dp.Empty(), timeout=30)
        try:
            return [d.ID for d in next(stream).devices if d.health == "Healthy"]
        finally:
            stream.cancel()

    def plugin(self, resource: str) -> dp_grpc.DevicePluginStub:
        return dp_grpc.DevicePluginStub(kubelet.channel(self.dir / socket_name(resource)))

    def admit(self, name: str, limits: dict[str, int], annotations: dict[str, str] | None = None,
              order: Sequence[str] = (shares.GPU_UTIL, shares.GPU_MEMORY)) -> dict[str, dp.ContainerAllocateResponse]:
        """Admit a pod of one container, `main`, as the kubelet 1.20 device manager does: for each
        resource in turn, GetPreferredAllocation among the devices no container holds, the answer's
        free devices taken (filled up in ID order where it gave too few), Allocate, and the devices
        listed in PodResources at once. The apiserver lists the pod Pending until then, Running
        after; a refusal (grpc.RpcError) fails it, as the kubelet does."""
        key = ("ml", name)
        self.api[key] = PodInfo(str(uuidlib.uuid4()), dict(annotations or {}), phase="Pending",
                                created=f"2026-11-26T10:{len(self.api):02d}:00Z", requests={"main": dict(limits)})
        devices: dict[str, list[str]] = {}
        responses = {}
        try:
            for resource in (r for r in order if r in limits):
                size = limits[resource]
                taken = {d for p in self.pods for c in p.containers for cd in c.devices
                         if cd.resource_name == resource for d in cd.device_ids}
                stub = self.plugin(resource)
                available = [d for d in self.advertised(stub) if d not in taken]
                (answer,) = stub.GetPreferredAllocation(dp.PreferredAllocationRequest(container_requests=[
                    dp.ContainerPreferredAllocationRequest(available_deviceIDs=available, allocation_size=size)]),
                    timeout=30).container_responses
                chosen = [d for d in answer.deviceIDs if d in available][:size]
                chosen += [d for d in available if d not in chosen][: size - len(chosen)]
                (responses[resource],) = stub.Allocate(dp.AllocateRequest(container_requests=[
                    dp.ContainerAllocateRequest(devicesIDs=chosen)]), timeout=30).container_responses
                devices[resource] = chosen
                self.pods = [p for p in self.pods if p.name != name] + [pr.PodResources(
                    name=name, namespace="ml", containers=[pr.ContainerResources(name="main", devices=[
                        pr.ContainerDevices(resource_name=r, device_ids=ds) for r, ds in devices.items()])])]
        except grpc.RpcError:
            self.api[key] = replace(self.api[key], phase="Failed")
            self.pods = [p for p in self.pods if p.name != name]
            raise
        self.api[key] = replace(self.api[key], phase="Running")
        return responses


class FakeApiserver:
    """The apiserver's pods of the node: those `admit` made (Pending until admitted), and those the
    kubelet lists, as `known` says them (else a uid of their name), ended if said `finished`; the
    events the plugin posts, and each value it patched into its node's annotation of the GPUs' room."""

    def __init__(self, kubelet: FakeKubelet, known: Pods | None = None) -> None:
        self.kubelet = kubelet
        self.known = known or {}
        self.finished: set[str] = set()
        self.events: list[tuple[str, str, str, str]] = []
        self.rooms: list[str | None] = []

    def annotate(self, text: str | None) -> None:
        self.rooms.append(text)

    def pods(self) -> Pods:
        out = dict(self.kubelet.api)
        for p in self.kubelet.pods:
            key = (p.namespace, p.name)
            info = out.get(key) or self.known.get(key) or PodInfo(f"uid-{p.name}")
            out[key] = replace(info, phase="Succeeded") if p.name in self.finished else info
        return out

    def tell(self, namespace: str, pod: str, uid: str, message: str) -> None:
        self.events.append((namespace, pod, uid, message))


@pytest.fixture
def short_dir() -> Iterator[Path]:
    # A unix socket's path must fit in 108 bytes: pytest's tmp_path may not.
    directory = Path(tempfile.mkdtemp(prefix="gt-kubelet-", dir="/tmp"))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


class Stack:
    def __init__(self, host: Host, directory: Path, agent: Running, pods: Pods | None = None,
                 loop: bool = True, placement: str = "binpack") -> None:
        """`pods`: what the apiserver says of those pods beyond their being there (uid, annotations);
        `admit` adds its own. `loop`: the plugin's own loop runs (registration, health,
        reconciliation every second); else the test calls its steps."""
        self.host, self.agent, self.directory, self.loop = host, agent, directory, loop
        region = host.region()
        gpus = [(uuid, region.layout.gpus[i].memory_total) for i, uuid in enumerate(region.gpu_uuids())]
        region.close()
        self.gpus = gpus
        self.kubelet = FakeKubelet(directory, gpus)
        self.api = FakeApiserver(self.kubelet, pods)
        # The GPUs' names as `gemtrace kube-plugin` reads them, from the simulated NVML.
        self.names = {g["uuid"]: g["name"] for g in run_nvml(
            "from gemtrace.gpus import discover\nfor g in discover(): emit({'uuid': g.uuid, 'name': g.name})",
            host.env())}
        self.placement = placement
        self.injection = Injection(gate=REPO / "build" / "libgemgate.so", state_dir=host.state_dir,
                                   preload_file=host.tmp / "ld.so.preload")
        self.injection.write_preload_file()
        self.start_plugin()

    def start_plugin(self) -> None:
        """A plugin process's state, new: its grants known only from the files and the kubelet."""
        self.grants = Grants(dropin_dir(self.host.config))
        self.plugin = DevicePlugin(self.gpus, self.host.state_dir, self.grants, self.injection,
                                   device_plugins=self.directory, pod_resources=self.directory / "pod-resources.sock",
                                   pods=self.api.pods, names_file=self.host.tmp / "pods.json", tell=self.api.tell,
                                   names=self.names, packing=PACKINGS[self.placement](), config=self.host.config,
                                   publish_room=self.api.annotate)
        self.thread = threading.Thread(target=self.plugin.run if self.loop else lambda: None, daemon=True)
        self.thread.start()

    def stop_plugin(self) -> None:
        self.plugin.close()
        self.thread.join(timeout=10)

    def close(self) -> None:
        self.stop_plugin()
        assert self.kubelet.server is not None
        self.kubelet.server.stop(0)


def running_stack(host: Host, short_dir: Path, pods: Pods | None = None, loop: bool = True,
                  placement: str = "binpack") -> Iterator[Stack]:
    """The agent on `host` and the plugin beside a fake kubelet and apiserver, both stopped afterwards.
    `pods`: what the apiserver says of the pods it names (else a uid of their name and no annotations)."""
    agent = host.start_agent("--config-poll", "0.1", "--pod-names", str(host.tmp / "pods.json"))
    s = Stack(host, short_dir, agent, pods, loop, placement)
    yield s
    s.close()
    if agent.proc.poll() is None:
        stop(agent)


@pytest.fixture
def stack(host: Host, short_dir: Path) -> Iterator[Stack]:
    yield from running_stack(host, short_dir)


@pytest.fixture
def two_gpu_stack(simgpu_factory: Callable[..., SimGpu], tmp_path: Path, short_dir: Path) -> Iterator[Stack]:
    config = tmp_path / "resource.conf"
    config.write_text(CONFIG)  # [train] reserves MinUtil 0.2 on every GPU
    host = Host(simgpu_factory(devices=2), config, tmp_path / "state", tmp_path)
    yield from running_stack(host, short_dir)


def first_devices(stub: dp_grpc.DevicePluginStub) -> tuple[Iterator[dp.ListAndWatchResponse], list[dp.Device]]:
    stream = stub.ListAndWatch(dp.Empty(), timeout=60)
    return stream, list(next(stream).devices)


def test_registers_both_resources_and_lists_one_device_per_gib_and_per_percent(stack: Stack) -> None:
    registered = stack.kubelet.registered()
    assert {r: (q.version, q.endpoint) for r, q in registered.items()} == {
        shares.GPU_MEMORY: ("v1beta1", "gemtrace-gpu-memory.sock"),
        shares.GPU_UTIL: ("v1beta1", "gemtrace-gpu-util.sock"),
    }
    assert all(q.options.get_preferred_allocation_available and q.options.pre_start_required
               for q in registered.values())
    (uuid, memory), = stack.gpus
    _, memory_devices = first_devices(stack.kubelet.plugin(shares.GPU_MEMORY))
    assert len(memory_devices) == memory // GiB == 16
    assert {d.health for d in memory_devices} == {"Healthy"}
    _, util_devices = first_devices(stack.kubelet.plugin(shares.GPU_UTIL))
    # 1% each, less the 20 that the resource file's [train] reserves on every GPU (MinUtil 0.2)
    assert [d.ID for d in util_devices] == [f"{uuid}-u{i}" for i in range(80)]


def per_gpu(devices: Sequence[dp.Device]) -> dict[str, int]:
    return dict(Counter(shares.gpu_of(d.ID) for d in devices))


def test_the_util_devices_leave_out_what_the_resource_files_own_groups_reserve(two_gpu_stack: Stack) -> None:
    """A GPU's util devices are the time the operator's groups leave: the kubelet can then never give
    pods a share that would take a GPU's MinUtils past 1, which the agent refuses. They follow the
    file, the operator's drop-ins too; a file the agent would refuse changes nothing."""
    stack = two_gpu_stack
    stack.kubelet.registered()
    (gpu0, _), (gpu1, _) = stack.gpus
    stream, devices = first_devices(stack.kubelet.plugin(shares.GPU_UTIL))
    assert per_gpu(devices) == {gpu0: 80, gpu1: 80}  # [train]'s MinUtil 0.2, on every GPU

    def next_counts() -> dict[str, int]:
        return per_gpu(next(stream).devices)

    # The operator reserves 0.345 of GPU 1 for a group of its own (rounded up to whole devices).
    ops = dropin_dir(stack.host.config) / "ops.conf"
    ops.parent.mkdir(exist_ok=True)
    ops.write_text(f"[ops]\nMinUtil = 0.345\nGpus = {gpu1}\n")
    assert next_counts() == {gpu0: 80, gpu1: 45}
    # The kubelet gives what is advertised: a pod asking 50% of GPU 1 takes GPU 0's devices, not GPU 1's.
    stack.kubelet.admit("half", {shares.GPU_MEMORY: 1, shares.GPU_UTIL: 50}, {shares.ANNOTATION_GPUS: "1"})
    (half,) = stack.kubelet.pods
    util = [d for cd in half.containers[0].devices if cd.resource_name == shares.GPU_UTIL for d in cd.device_ids]
    assert len(util) == 50 and {shares.gpu_of(d) for d in util} == {gpu0}

    # A main file the agent would refuse: the agent keeps its settings, the plugin its devices.
    good = stack.host.config.read_text()
    with structlog.testing.capture_logs() as logs:
        stack.host.config.write_text(good + "[broken\n")
        wait_until("the plugin read the broken file",
                   lambda: any(e["event"] == "resource_file_unusable" for e in logs), timeout=10)
    _, devices = first_devices(stack.kubelet.plugin(shares.GPU_UTIL))
    assert per_gpu(devices) == {gpu0: 80, gpu1: 45}

    # [train] reserves nothing any more: 100 on GPU 0, 65 on GPU 1.
    stack.host.config.write_text(good.replace("MinUtil = 0.2\n", ""))
    wait_until("the devices of a file without [train]'s MinUtil",
               lambda: per_gpu(first_devices(stack.kubelet.plugin(shares.GPU_UTIL))[1]) == {gpu0: 100, gpu1: 65})


def test_allocate_gates_the_container_and_the_agent_defines_its_group(stack: Stack) -> None:
    stack.kubelet.registered()
    (uuid, _), = stack.gpus
    memory = [f"{uuid}-m{i}" for i in (3, 7)]
    response = stack.kubelet.plugin(shares.GPU_MEMORY).Allocate(
        dp.AllocateRequest(container_requests=[dp.ContainerAllocateRequest(devicesIDs=memory)]), timeout=30)
    (container,) = response.container_responses
    group = shares.group_name(memory)
    assert dict(container.envs) == {"GEMTRACE_GROUP": group, "GEMTRACE_STATE_DIR": "/run/gemtrace",
                                     "CUDA_VISIBLE_DEVICES": uuid, "NVIDIA_VISIBLE_DEVICES": uuid}
    assert {(m.container_path, m.host_path, m.read_only) for m in container.mounts} == {
        ("/etc/ld.so.preload", str(stack.host.tmp / "ld.so.preload"), True),
        ("/usr/lib/gemtrace/libgemgate.so", str(REPO / "build" / "libgemgate.so"), True),
        ("/run/gemtrace", str(stack.host.state_dir), False),
    }
    assert (stack.host.tmp / "ld.so.preload").read_text() == "/usr/lib/gemtrace/libgemgate.so\n"
    # Allocate returned only once the agent had the group, with its limit.
    region = stack.host.region()
    index = region.group_index(group)
    assert index is not None and region.layout.groups[index].memory_limit == 2 * GiB
    region.close()

    # The kubelet then lists the container with its util devices too: the group gets its MinUtil.
    util = [f"{uuid}-u{i}" for i in range(30)]
    stack.kubelet.pods = [pr.PodResources(name="trainer", namespace="ml", containers=[pr.ContainerResources(
        name="main", devices=[pr.ContainerDevices(resource_name=shares.GPU_MEMORY, device_ids=memory),
                              pr.ContainerDevices(resource_name=shares.GPU_UTIL, device_ids=util)])])]
    wait_until("MinUtil 0.3 in the pod's drop-in", lambda: load(stack.host.config).groups[group].min_util == 0.3)
    settings = load(stack.host.config).groups[group]
    assert (settings.memory_limit, settings.max_util) == (2 * GiB, 0.3)
    assert "ml/trainer container main" in stack.grants.path(group).read_text()

    # A kubelet restart: the plugin serves and registers again; the same grant keeps its one file.
    stack.kubelet.start()
    assert set(stack.kubelet.registered()) == set(shares.RESOURCES)
    time.sleep(1.5)  # a reconciliation or two after the restart
    assert [p.name for p in dropin_dir(stack.host.config).iterdir()] == [f"{group}.conf"]

    # The pod is gone: its file goes at once, not after the grace an Allocate's file is given.
    stack.kubelet.pods = []
    wait_until("the drop-in removed", lambda: not stack.grants.path(group).exists())
    wait_until("the agent dropped the group", lambda: group not in load(stack.host.config).groups)


def test_minutils_add_up_per_gpu_and_a_spread_grant_gets_what_it_holds_on_each(two_gpu_stack: Stack) -> None:
    stack = two_gpu_stack
    stack.kubelet.registered()
    (gpu0, _), (gpu1, _) = stack.gpus

    def devices(gpu: str, kind: str, units: range) -> list[str]:
        return [f"{gpu}-{kind}{i}" for i in units]

    def container(pod: str, memory: list[str], util: list[str]) -> pr.PodResources:
        return pr.PodResources(name=pod, namespace="ml", containers=[pr.ContainerResources(name="main", devices=[
            pr.ContainerDevices(resource_name=shares.GPU_MEMORY, device_ids=memory),
            pr.ContainerDevices(resource_name=shares.GPU_UTIL, device_ids=util)])])

    # 70% on each GPU (with [train]'s 0.2 of every GPU: 1.6 in all, 0.9 on each), and a pod whose 20
    # util devices the kubelet spread over both GPUs, 10 each: it holds 0.1 of each GPU, not 0.2 of one.
    on0 = devices(gpu0, "m", range(2))
    on1 = devices(gpu1, "m", range(2))
    spread = devices(gpu1, "m", range(2, 3))
    stack.kubelet.pods = [
        container("seventy-0", on0, devices(gpu0, "u", range(70))),
        container("seventy-1", on1, devices(gpu1, "u", range(70))),
        container("spread", spread, devices(gpu0, "u", range(70, 80)) + devices(gpu1, "u", range(70, 80))),
    ]
    groups = [shares.group_name(m) for m in (on0, on1, spread)]
    wait_until("the agent defining the three pods' groups",
               lambda: all(group_defined(stack.host.state_dir, g) for g in groups), timeout=20, step=0.1)
    settings = load(stack.host.config).groups
    assert [(settings[g].min_util, settings[g].max_util, settings[g].gpus) for g in groups] == [
        (0.7, 0.7, (gpu0,)), (0.7, 0.7, (gpu1,)), (0.1, 0.2, (gpu1, gpu0))]
    region = stack.host.region()
    indexes = [region.group_index(g) for g in groups]
    assert [region.layout.groups[i].min_util_ppm for i in indexes if i is not None] == [
        round(u * rg.UTIL_ONE) for u in (0.7, 0.7, 0.1)]
    region.close()

    # A container asking only for util is confined to the GPU of its devices, where its MinUtil is.
    response = stack.kubelet.plugin(shares.GPU_UTIL).Allocate(dp.AllocateRequest(container_requests=[
        dp.ContainerAllocateRequest(devicesIDs=devices(gpu1, "u", range(80, 90)))]), timeout=30)
    (allocated,) = response.container_responses
    assert allocated.envs["CUDA_VISIBLE_DEVICES"] == gpu1 and "GEMTRACE_GROUP" not in allocated.envs


def pod(name: str, memory: list[str], util: list[str] | None = None) -> pr.PodResources:
    devices = [pr.ContainerDevices(resource_name=shares.GPU_MEMORY, device_ids=memory)]
    if util:
        devices.append(pr.ContainerDevices(resource_name=shares.GPU_UTIL, device_ids=util))
    return pr.PodResources(name=name, namespace="ml", containers=[pr.ContainerResources(name="main", devices=devices)])


def test_a_deleted_pods_grant_goes_within_a_second_of_the_deletion_being_seen(stack: Stack) -> None:
    stack.kubelet.registered()
    (uuid, _), = stack.gpus
    memory = {name: [f"{uuid}-m{i}"] for i, name in enumerate(("deleted", "ended", "stays"))}
    stack.kubelet.pods = [pod("deleted", memory["deleted"], [f"{uuid}-u{i}" for i in range(40)]),
                          pod("ended", memory["ended"], [f"{uuid}-u{i}" for i in range(40, 70)]),
                          pod("stays", memory["stays"], [f"{uuid}-u{i}" for i in range(70, 80)])]
    group = {name: shares.group_name(m) for name, m in memory.items()}
    wait_until("the three pods' groups", lambda: all(group_defined(stack.host.state_dir, g) for g in group.values()))

    # The kubelet no longer lists it: the file goes at the reconciliation that sees it (the old grace
    # kept it 60 s, its MinUtil still counted), and the agent drops the group.
    deleted = time.monotonic()
    stack.kubelet.pods = [p for p in stack.kubelet.pods if p.name != "deleted"]
    seen = stack.kubelet.seen_without("deleted", deleted)
    wait_until("the deleted pod's drop-in removed", lambda: not stack.grants.path(group["deleted"]).exists(),
               timeout=5, step=0.005)
    assert time.monotonic() - seen < 1.0
    wait_until("the agent dropping its group", lambda: not group_defined(stack.host.state_dir, group["deleted"]))

    # A pod that ended is still listed by the kubelet until it is deleted: the apiserver says it ended.
    stack.api.finished.add("ended")
    wait_until("the ended pod's drop-in removed", lambda: not stack.grants.path(group["ended"]).exists(), timeout=5)
    assert stack.grants.path(group["stays"]).exists() and group_defined(stack.host.state_dir, group["stays"])


def test_a_grant_that_does_not_fit_is_refused_alone_and_its_pod_told_why(stack: Stack) -> None:
    stack.kubelet.registered()
    (uuid, _), = stack.gpus
    # [train] reserves 0.2 of every GPU, which the kubelet does not know: its 100 util devices are
    # all given, 70 + 30, and the second grant takes the GPU's MinUtils to 1.2.
    first, over, memory_only = [f"{uuid}-m0"], [f"{uuid}-m1"], [f"{uuid}-m2"]
    stack.kubelet.pods = [pod("first", first, [f"{uuid}-u{i}" for i in range(70)])]
    wait_until("the first grant defined", lambda: group_defined(stack.host.state_dir, shares.group_name(first)))
    stack.kubelet.pods.append(pod("over", over, [f"{uuid}-u{i}" for i in range(70, 100)]))
    wait_until("the pod told", lambda: stack.api.events, timeout=20)
    ((namespace, name, uid, message),) = stack.api.events
    assert (namespace, name, uid) == ("ml", "over", "uid-over")
    refused_file = stack.grants.path(shares.group_name(over))
    assert message == (f"gemtrace refused container main's GPU share: {refused_file}:4: the MinUtils add up to 1.2 "
                       f"on GPU {uuid}, above 1 (train 0.2, {shares.group_name(first)} 0.7, "
                       f"{shares.group_name(over)} 0.3); lower some of them")
    assert "dropin_refused" in stack.agent.log.read_text()

    # Every other grant stays in force, and a later one that fits is defined: the set is not refused.
    stack.kubelet.pods.append(pod("later", memory_only))
    wait_until("the later grant defined", lambda: group_defined(stack.host.state_dir, shares.group_name(memory_only)))
    assert group_defined(stack.host.state_dir, shares.group_name(first))
    assert not group_defined(stack.host.state_dir, shares.group_name(over))
    time.sleep(1.5)  # reconciliations enough to tell it twice
    assert len(stack.api.events) == 1

    # Allocate for the refused grant stops waiting for a group that will not come.
    started = time.monotonic()
    stack.kubelet.plugin(shares.GPU_MEMORY).Allocate(
        dp.AllocateRequest(container_requests=[dp.ContainerAllocateRequest(devicesIDs=over)]), timeout=30)
    assert time.monotonic() - started < ALLOCATE_WAIT_S

    # The first pod goes: the refused grant now fits, is defined, and its refusal is forgotten.
    stack.kubelet.pods = [p for p in stack.kubelet.pods if p.name != "first"]
    wait_until("the refused grant defined once it fits",
               lambda: group_defined(stack.host.state_dir, shares.group_name(over)), timeout=20)


def test_a_restarted_plugin_keeps_the_running_pods_grants(stack: Stack) -> None:
    stack.kubelet.registered()
    (uuid, _), = stack.gpus
    running, gone = [f"{uuid}-m0", f"{uuid}-m1"], [f"{uuid}-m2"]
    stack.kubelet.pods = [pod("running", running, [f"{uuid}-u{i}" for i in range(30)]),
                          pod("gone", gone, [f"{uuid}-u{i}" for i in range(30, 80)])]
    path = {name: stack.grants.path(shares.group_name(m)) for name, m in (("running", running), ("gone", gone))}
    wait_until("both groups", lambda: all(group_defined(stack.host.state_dir, p.stem) for p in path.values()))
    before = path["running"].stat()

    stack.stop_plugin()
    stack.kubelet.pods = stack.kubelet.pods[:1]  # deleted while no plugin ran
    listed = len(stack.kubelet.listed)
    stack.start_plugin()
    wait_until("the new plugin's reconciliations", lambda: len(stack.kubelet.listed) >= listed + 3, timeout=20)
    after = path["running"].stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)  # never rewritten nor removed
    assert group_defined(stack.host.state_dir, path["running"].stem)
    # Its file says a pod was behind it: gone at once, not after the grace an unknown file gets.
    assert not path["gone"].exists()
    wait_until("the agent dropping the gone pod's group", lambda: not group_defined(stack.host.state_dir,
                                                                                   path["gone"].stem))


POD_UID = "5e1f0c2a-7d3b-4f6e-9a80-1b2c3d4e5f60"
OTHER_UID = "5e1f0c2a-7d3b-4f6e-9a80-1b2c3d4e5f61"


def pod_cgroup(uid: str) -> str:
    """The systemd driver's layout (gemtrace.kube.pods): the test cluster's kubelet (cgroupfs) never looks there."""
    return f"kubepods.slice/kubepods-pod{uid.replace('-', '_')}.slice"


POD_CGROUP = pod_cgroup(POD_UID)


PODS = {("ml", "util-only"): PodInfo(POD_UID, {shares.ANNOTATION_PRIORITY: "5"}),
        ("ml", "env-cleared"): PodInfo(OTHER_UID)}


@pytest.fixture
def apiserver_stack(host: Host, short_dir: Path) -> Iterator[Stack]:
    yield from running_stack(host, short_dir, PODS)


@pytest.fixture
def stepped_stack(host: Host, short_dir: Path) -> Iterator[Stack]:
    """The plugin without its loop: nothing reconciles but what the test calls."""
    yield from running_stack(host, short_dir, PODS, loop=False)


def gated_env(stack: Stack) -> dict[str, str]:
    """A process of a container the plugin allocated: the gate, and no GEMTRACE_GROUP (env -i)."""
    return stack.host.env(LD_PRELOAD=str(REPO / "build" / "libgemgate.so"),
                          GEMTRACE_STATE_DIR=str(stack.host.state_dir))


def start_in(procs: Path, env: dict[str, str]) -> Client:
    """The simulated GPU's client holding 1 MiB, started in the cgroup whose cgroup.procs is `procs`."""
    return Client(["-c", f'echo $$ > {procs}; exec "$0" "$@"', str(RT_CLIENT), "alloc", "--api", "v2",
                   "--hold", "60", str(MiB)], env, client=Path("/bin/sh"))


def group_of(stack: Stack, client: Client) -> str | None:
    region = stack.host.region()
    try:
        names = region.group_names()
        return next((names.get(region.assigned_group(i, s.pid) or -1) for i, s in region.live_slots()
                     if s.pid == client.proc.pid), None)
    finally:
        region.close()


def test_a_util_only_pods_processes_are_its_group_whatever_their_environment(apiserver_stack: Stack) -> None:
    """A pod asking only for gemtrace.io/gpu-util: no GEMTRACE_GROUP reaches it, so its group is its
    cgroup's binding rule. A process that started before the plugin knew the pod (in `default`) moves
    there at the reload that brings the rule; one that asks for [train], open to all, stays there."""
    stack = apiserver_stack
    stack.kubelet.registered()
    (uuid, _), = stack.gpus
    util = [f"{uuid}-u{i}" for i in range(20)]
    group = shares.group_name(util)
    with scratch_cgroup(POD_CGROUP) as procs:
        early = start_in(procs, gated_env(stack))
        try:
            assert early.next_json()["name"] == "CUDA_SUCCESS"
            assert group_of(stack, early) == "default"  # no rule names its cgroup yet
            stack.kubelet.pods = [pr.PodResources(name="util-only", namespace="ml", containers=[
                pr.ContainerResources(name="main", devices=[
                    pr.ContainerDevices(resource_name=shares.GPU_UTIL, device_ids=util)])])]
            wait_until("the pod's group defined", lambda: group_defined(stack.host.state_dir, group), timeout=20)
            settings = load(stack.host.config).groups[group]
            assert (settings.min_util, settings.max_util, settings.priority, settings.cgroups,
                    settings.cgroup_binding) == (0.2, 0.2, 5, (f"/{POD_CGROUP}",), True)
            wait_until("the early process moved to its pod's group", lambda: group_of(stack, early) == group,
                       timeout=10)
            later = start_in(procs, {**gated_env(stack), "GEMTRACE_GROUP": "train"})
            assert later.next_json()["name"] == "CUDA_SUCCESS"
            assert group_of(stack, later) == group
            region = stack.host.region()
            index = region.group_index(group)
            assert index is not None and region.layout.groups[index].max_util_ppm == 0.2 * rg.UTIL_ONE
            region.close()
        finally:
            early.kill()
            if "later" in locals():
                later.kill()


def test_prestart_puts_the_pods_rule_in_force_before_its_container_starts(stepped_stack: Stack) -> None:
    """The kubelet calls PreStartContainer once the pod's cgroup exists and before the container
    starts: when it returns, the first process of the container, under env -i, is already its pod's
    (the plugin's own reconciliation, once a second, would come too late for its first allocations)."""
    stack = stepped_stack
    stack.plugin.step()
    stack.kubelet.registered()
    (uuid, _), = stack.gpus
    memory = [f"{uuid}-m{i}" for i in (8, 9)]
    group = shares.group_name(memory)
    with scratch_cgroup(pod_cgroup(OTHER_UID)) as procs:
        stack.kubelet.pods = [pr.PodResources(name="env-cleared", namespace="ml", containers=[
            pr.ContainerResources(name="main", devices=[
                pr.ContainerDevices(resource_name=shares.GPU_MEMORY, device_ids=memory)])])]
        stack.kubelet.plugin(shares.GPU_MEMORY).PreStartContainer(dp.PreStartContainerRequest(devicesIDs=memory),
                                                                  timeout=30)
        client = start_in(procs, gated_env(stack))
        try:
            assert client.next_json()["name"] == "CUDA_SUCCESS"
            assert group_of(stack, client) == group
            # Placed there at once, not moved there by a later reload (its first allocations in default).
            moved = [json.loads(line) for line in stack.agent.log.read_text().splitlines()
                     if '"process_bound_to_group"' in line]
            assert client.proc.pid not in [e["pid"] for e in moved]
        finally:
            client.kill()


def test_health_follows_the_agent(stack: Stack) -> None:
    stack.kubelet.registered()
    stream, devices = first_devices(stack.kubelet.plugin(shares.GPU_UTIL))
    assert {d.health for d in devices} == {"Healthy"}
    stop(stack.agent)
    update = next(stream)  # sent at once, not at the next registration
    assert {d.health for d in update.devices} == {"Unhealthy"}


def test_preferred_allocation_keeps_a_grant_on_one_gpu() -> None:
    available = [f"GPU-a-m{i}" for i in range(2)] + [f"GPU-b-m{i}" for i in range(4)]
    assert shares.preferred(available, [], 3) == ["GPU-b-m0", "GPU-b-m1", "GPU-b-m2"]
    assert shares.preferred(available, ["GPU-a-m1"], 2) == ["GPU-a-m1", "GPU-a-m0"]


def test_the_agent_tells_a_pid_namespace_of_its_own() -> None:
    code = "from gemtrace.agent.agent import nested_pid_namespace; print(nested_pid_namespace())"
    here = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert here.stdout == "False\n"
    inside = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", code],
                            capture_output=True, text=True)
    assert inside.stdout == "True\n", inside.stderr


# ---- placement: a container's share whole on each of its GPUs -------------------------------------

PLACEMENT_CONFIG = "[infer]\nMaxUtil = 0.5\n"  # no MinUtil of its own: the pods' may fill every GPU
MEM, UTIL = shares.GPU_MEMORY, shares.GPU_UTIL


@pytest.fixture
def gpu_stack(simgpu_factory: Callable[..., SimGpu], tmp_path: Path,
              short_dir: Path) -> Iterator[Callable[..., Stack]]:
    """make(devices, placement): the agent and the plugin on a node of `devices` GPUs of 8 GiB."""
    made: list[Iterator[Stack]] = []

    def make(devices: int, placement: str = "binpack") -> Stack:
        config = tmp_path / "resource.conf"
        config.write_text(PLACEMENT_CONFIG)
        host = Host(simgpu_factory(devices=devices, memory="8GiB"), config, tmp_path / "state", tmp_path)
        running = running_stack(host, short_dir, placement=placement)
        made.append(running)
        stack = next(running)
        stack.kubelet.registered()
        return stack

    yield make
    for running in made:
        next(running, None)


def pod_devices(stack: Stack, pod: str) -> dict[str, list[str]]:
    (listed,) = [p for p in stack.kubelet.pods if p.name == pod]
    return {d.resource_name: list(d.device_ids) for c in listed.containers for d in c.devices}


def group_of_pod(stack: Stack, pod: str) -> str:
    return shares.group_name(pod_devices(stack, pod)[MEM])


def defined(stack: Stack, pod: str) -> tuple[int | None, float | None, tuple[str, ...]]:
    """(MemoryLimit, MinUtil, Gpus) of the pod's group, once the agent has it with its MinUtil."""
    group = group_of_pod(stack, pod)
    wait_until(f"the agent defining {pod}'s group", lambda: group_defined(stack.host.state_dir, group), timeout=20)
    settings = load(stack.host.config).groups[group]
    region = stack.host.region()
    index = region.group_index(group)
    assert index is not None
    entry = region.layout.groups[index]
    assert (entry.memory_limit, entry.min_util_ppm) == (settings.memory_limit, round(settings.min_util * rg.UTIL_ONE))
    region.close()
    return settings.memory_limit, settings.min_util, settings.gpus


def placed_on(stack: Stack, pod: str) -> list[int]:
    """The indexes of the GPUs the pod's devices are on (each resource's)."""
    uuids = [uuid for uuid, _ in stack.gpus]
    return sorted({uuids.index(shares.gpu_of(d)) for ds in pod_devices(stack, pod).values() for d in ds})


def test_a_share_lands_whole_on_one_gpu_memory_and_time_together(gpu_stack: Callable[..., Stack]) -> None:
    stack = gpu_stack(2)
    (gpu0, _), (gpu1, _) = stack.gpus

    # Already running: 1 GiB + 60% on GPU 0, 2 GiB + 10% on GPU 1. GPU 0 has the most memory free
    # (7 GiB), GPU 1 the most time (90%): each resource chosen alone would split the pod between them.
    def held(pod: str, gpu: str, memory: int, util: int) -> pr.PodResources:
        return pr.PodResources(name=pod, namespace="ml", containers=[pr.ContainerResources(name="main", devices=[
            pr.ContainerDevices(resource_name=MEM, device_ids=[f"{gpu}-m{i}" for i in range(memory)]),
            pr.ContainerDevices(resource_name=UTIL, device_ids=[f"{gpu}-u{i}" for i in range(util)])])])

    stack.kubelet.pods = [held("b", gpu0, 1, 60), held("a", gpu1, 2, 10)]
    responses = stack.kubelet.admit("x", {MEM: 4, UTIL: 50})
    assert placed_on(stack, "x") == [1]
    assert defined(stack, "x") == (4 * GiB, 0.5, (gpu1,))
    assert {r.envs["CUDA_VISIBLE_DEVICES"] for r in responses.values()} == {gpu1}
    assert responses[MEM].envs["GEMTRACE_GROUP"] == group_of_pod(stack, "x")

    # Its processes get the 4 GiB: 3.5 GiB is allocated, 4.5 GiB is not.
    group = group_of_pod(stack, "x")
    fits = stack.host.run(group, "alloc", "--api", "v2", str(7 * GiB // 2))
    assert b"CUDA_SUCCESS" in fits.communicate(timeout=60)[0]
    over = stack.host.run(group, "alloc", "--api", "v2", str(9 * GiB // 2))
    assert b"CUDA_ERROR_OUT_OF_MEMORY" in over.communicate(timeout=60)[0]


def test_a_pod_asking_two_gpus_gets_both_each_limited(gpu_stack: Callable[..., Stack]) -> None:
    stack = gpu_stack(2)
    (gpu0, _), (gpu1, _) = stack.gpus
    # The resources are the totals the kubelet counts; gemtrace.io/gpus splits them over the GPUs.
    responses = stack.kubelet.admit("pair", {MEM: 8, UTIL: 100}, {shares.ANNOTATION_GPUS: "2"},
                                    order=(MEM, UTIL))
    devices = pod_devices(stack, "pair")
    assert sorted(shares.gpu_of(d) for d in devices[MEM]) == sorted([gpu0] * 4 + [gpu1] * 4)
    assert sorted(shares.gpu_of(d) for d in devices[UTIL]) == sorted([gpu0] * 50 + [gpu1] * 50)
    assert defined(stack, "pair") == (4 * GiB, 0.5, (gpu0, gpu1))
    assert load(stack.host.config).groups[group_of_pod(stack, "pair")].max_util == 0.5  # of each GPU, as asked
    assert {r.envs["CUDA_VISIBLE_DEVICES"] for r in responses.values()} == {f"{gpu0},{gpu1}"}

    # Each GPU has 4 GiB and 50% left: 5 GiB on one is refused, with the reason, though 8 GiB are free.
    with pytest.raises(grpc.RpcError) as refused:
        stack.kubelet.admit("big", {MEM: 5, UTIL: 10})
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "needs 1 GPU(s) with 5 GiB and 10% free on each, and this node has 0" in refused.value.details()
    # An uneven split is refused before any GPU is chosen.
    with pytest.raises(grpc.RpcError) as uneven:
        stack.kubelet.admit("odd", {MEM: 3}, {shares.ANNOTATION_GPUS: "2"})
    assert "3 does not split evenly over gemtrace.io/gpus=2" in uneven.value.details()
    # What fits still does: 4 GiB + 50% twice more, one on each GPU.
    stack.kubelet.admit("fill-0", {MEM: 4, UTIL: 50})
    stack.kubelet.admit("fill-1", {MEM: 4, UTIL: 50})
    assert [placed_on(stack, p) for p in ("fill-0", "fill-1")] == [[0], [1]]


def test_a_gpu_model_is_matched_by_name_and_a_model_the_node_lacks_is_refused(
        gpu_stack: Callable[..., Stack]) -> None:
    stack = gpu_stack(2)
    with pytest.raises(grpc.RpcError) as refused:
        stack.kubelet.admit("h100", {MEM: 1, UTIL: 10}, {shares.ANNOTATION_GPU_MODEL: "H100"})
    assert refused.value.details() == (
        "gemtrace: no GPU of this node is a H100 (its GPUs: Simulated GPU); ask for one of those models, or "
        "schedule the pod on a node that has it (a nodeSelector)")
    assert stack.kubelet.api[("ml", "h100")].phase == "Failed" and not stack.grants.owned()
    stack.kubelet.admit("sim", {MEM: 1, UTIL: 10}, {shares.ANNOTATION_GPU_MODEL: "A100, simulated"})
    assert defined(stack, "sim")[:2] == (GiB, 0.1)


@pytest.mark.parametrize(("placement", "small", "whole"), [("binpack", [0, 0, 0, 0], [1]),
                                                          ("spread", [0, 1, 2, 3], [4])])
def test_binpack_fills_one_gpu_first_and_spread_one_pod_per_gpu_on_eight_gpus(
        gpu_stack: Callable[..., Stack], placement: str, small: list[int], whole: list[int]) -> None:
    stack = gpu_stack(8, placement)
    for i in range(4):
        stack.kubelet.admit(f"small-{i}", {MEM: 2, UTIL: 20})
    assert [placed_on(stack, f"small-{i}")[0] for i in range(4)] == small
    # A pod wanting a whole GPU: binpack kept GPUs 1-7 whole; spread left 4-7.
    stack.kubelet.admit("whole", {MEM: 8, UTIL: 100})
    assert placed_on(stack, "whole") == whole
    assert defined(stack, "whole")[:2] == (8 * GiB, 1.0)
    assert defined(stack, "small-3")[:2] == (2 * GiB, 0.2)


def test_the_plugin_puts_each_gpus_room_on_its_node_as_grants_come_and_go(gpu_stack: Callable[..., Stack]) -> None:
    """The node's annotation (gemtrace.kube.rooms), which the scheduler extender reads: each GPU's GiB and
    percent that no container holds, patched when a grant comes or goes and only then."""
    stack = gpu_stack(2)
    (gpu0, _), (gpu1, _) = stack.gpus

    def room_is(*free: tuple[int, int]) -> bool:
        expected = [GpuRoom(i, uuid, "Simulated GPU", 8, memory, util)
                    for i, ((uuid, _), (memory, util)) in enumerate(zip(stack.gpus, free, strict=True))]
        text = stack.api.rooms[-1] if stack.api.rooms else None
        return text is not None and parse_rooms(text) == expected

    wait_until("the room of two empty GPUs", lambda: room_is((8, 100), (8, 100)), timeout=20)
    stack.kubelet.admit("five", {MEM: 5, UTIL: 30})
    wait_until("GPU 0's room less the grant", lambda: room_is((3, 70), (8, 100)), timeout=20)
    stack.kubelet.admit("two", {MEM: 2, UTIL: 80})  # binpack: GPU 0 has 3 GiB but 70%: GPU 1
    wait_until("GPU 1's room less the second grant", lambda: room_is((3, 70), (6, 20)), timeout=20)
    patches = len(stack.api.rooms)
    listed = len(stack.kubelet.listed)
    wait_until("three more passes of the plugin", lambda: len(stack.kubelet.listed) >= listed + 3, timeout=20)
    assert len(stack.api.rooms) == patches  # nothing changed: nothing patched
    # The first pod ends: its grant goes, and its room comes back.
    stack.api.finished.add("five")
    wait_until("GPU 0 empty again", lambda: room_is((8, 100), (6, 20)), timeout=20)
    # The kubelet forgets it (no change of room: no patch), then the second pod goes.
    stack.kubelet.pods = [p for p in stack.kubelet.pods if p.name != "five"]
    stack.kubelet.pods = [p for p in stack.kubelet.pods if p.name != "two"]
    wait_until("both GPUs empty again", lambda: room_is((8, 100), (8, 100)), timeout=20)
    assert len(stack.api.rooms) == patches + 2
    # A plugin that stops takes its room away: the extender then leaves the node to check pods itself.
    stack.stop_plugin()
    assert stack.api.rooms[-1] is None and len(stack.api.rooms) == patches + 3
