"""The kubelet's side of the device plugin: where its sockets are, Register, and PodResources List.

Owns the two gRPC clients (thin: one call each, a timeout each) and the kubelet's paths. The
kubelet deletes every socket in its device-plugins directory when it starts, and a plugin must then
serve and register again: `KubeletSocket.changed()` tells when (the socket's inode differs).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from gemtrace.kube.pb import deviceplugin_pb2 as dp
from gemtrace.kube.pb import deviceplugin_pb2_grpc as dp_grpc
from gemtrace.kube.pb import podresources_pb2 as pr
from gemtrace.kube.pb import podresources_pb2_grpc as pr_grpc

DEVICE_PLUGINS = Path("/var/lib/kubelet/device-plugins")
KUBELET_SOCKET = "kubelet.sock"
POD_RESOURCES = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
API_VERSION = "v1beta1"
CALL_TIMEOUT_S = 10.0
# PreStartContainer: the plugin puts a container's binding Cgroup rule in force before it starts.
OPTIONS = dp.DevicePluginOptions(get_preferred_allocation_available=True, pre_start_required=True)


def channel(socket: Path) -> grpc.Channel:
    return grpc.insecure_channel(f"unix://{socket}")


def register(device_plugins: Path, endpoint: str, resource: str) -> None:
    """Tell the kubelet that `resource` is served on device_plugins/endpoint; raises grpc.RpcError."""
    with channel(device_plugins / KUBELET_SOCKET) as ch:
        dp_grpc.RegistrationStub(ch).Register(
            dp.RegisterRequest(version=API_VERSION, endpoint=endpoint, resource_name=resource,
                               options=OPTIONS),
            timeout=CALL_TIMEOUT_S,
        )


class KubeletSocket:
    """Tells a kubelet restart by its registration socket's inode."""

    def __init__(self, device_plugins: Path) -> None:
        self.path = device_plugins / KUBELET_SOCKET
        self._seen: tuple[int, int] | None = None

    def _identity(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_dev, st.st_ino)

    def changed(self) -> bool:
        """True once for each new socket (the first one included); False while there is none."""
        identity = self._identity()
        if identity is None or identity == self._seen:
            return False
        self._seen = identity
        return True


@dataclass(frozen=True)
class ContainerDevices:
    namespace: str
    pod: str
    container: str
    devices: dict[str, tuple[str, ...]] = field(default_factory=dict)  # resource -> device IDs


def list_pod_resources(socket: Path = POD_RESOURCES) -> list[ContainerDevices]:
    """Every container the kubelet has given devices, with them; raises grpc.RpcError."""
    with channel(socket) as ch:
        response = pr_grpc.PodResourcesListerStub(ch).List(pr.ListPodResourcesRequest(), timeout=CALL_TIMEOUT_S)
    out = []
    for pod in response.pod_resources:
        for container in pod.containers:
            devices: dict[str, tuple[str, ...]] = {}
            for d in container.devices:
                devices[d.resource_name] = devices.get(d.resource_name, ()) + tuple(d.device_ids)
            if devices:
                out.append(ContainerDevices(pod.namespace, pod.name, container.name, devices))
    return out
