"""`gemtrace kube-plugin`: the kubelet's device plugin (API v1beta1) for gemtrace's GPU shares.

One gRPC server per resource (gemtrace.kube.shares: gpu-memory, gpu-util) on its own socket in the
kubelet's device-plugins directory, each registered with the kubelet. Owns the plugin's lifecycle:

- Health. Every device of a GPU is Healthy while the agent beats (its heartbeat in the region is
  fresh) and NVML still lists the GPU; otherwise Unhealthy, and ListAndWatch sends the change at
  once, so the kubelet stops placing pods there.
- Placement. GetPreferredAllocation answers with the devices that gemtrace.kube.placer decided for
  the container being admitted, both resources at once: its memory and time whole on each of its
  GPUs, of the model it asks, binpacked or spread (`--placement`). Allocate refuses, with the
  reason, a container that could not be placed: the kubelet fails the pod with that message.
- Allocate hands a container the gate (gemtrace.kube.injection: mounts and envs) and, for memory, its
  group (GEMTRACE_GROUP) after writing the group's drop-in and waiting, briefly, for the agent to
  define it; CUDA_VISIBLE_DEVICES/NVIDIA_VISIBLE_DEVICES name the GPUs of its devices (each
  resource's; the kubelet keeps the first when they differ, and the grant's MinUtil allows for it).
- PreStartContainer (asked for at registration): before a container starts, its grant's drop-in gets
  the pod's binding Cgroup rule (the pod's cgroup exists by then) and the agent applies it, so that
  the container's first process is its pod's whatever its environment says (a program under env -i
  has no GEMTRACE_GROUP). Bounded by PRESTART_WAIT_S; a process placed before the rule moves at the
  reload that brings it (gemtrace.agent.membership).
- Restarts. When the kubelet restarts it deletes every socket here: the plugin sees its socket's new
  inode, serves again and registers again. Every second it reconciles the drop-ins with PodResources
  and the apiserver (gemtrace.kube.grants), which is also how a restarted plugin picks up the running
  pods, and how a pod's grant goes when the pod does.
- Refusals. A grant the agent leaves out (it does not fit beside the others: gemtrace.config.load)
  is told to its pod as a Warning event, once per reason, and Allocate stops waiting for its group.
- Room. Each GPU's free room goes on this node as its annotation (gemtrace.kube.rooms), patched at
  the loop's pass after it changes and only then, for the scheduler extender to check each pod's fit
  on each GPU before it binds it (gemtrace.kube.extender).

Never decides quotas itself: the agent reads the drop-ins like any resource file.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import structlog

from gemtrace import contract
from gemtrace import region as rg
from gemtrace.config import ConfigError, dropins, load
from gemtrace.kube import kubelet, shares
from gemtrace.kube.grants import Grants, Pods
from gemtrace.kube.injection import Injection
from gemtrace.kube.pb import deviceplugin_pb2 as dp
from gemtrace.kube.pb import deviceplugin_pb2_grpc as dp_grpc
from gemtrace.kube.placer import Placer
from gemtrace.kube.pods import Names, read_refusals, refused_file, write_names
from gemtrace.kube.rooms import node_rooms, room_text
from gemtrace.kube.shares import Grant
from gemtrace.run.placement import DEFAULT_PACKING, PACKINGS, Packing

log = structlog.get_logger("gemtrace.kube.plugin")

HEALTHY, UNHEALTHY = "Healthy", "Unhealthy"
CHECK_SECONDS = 1.0
ALLOCATE_WAIT_S = 5.0  # for the agent to define a new group (it reloads its resource file every second)
PRESTART_WAIT_S = 5.0  # for a container's Cgroup rule to be written and applied before it starts
EVENT_REASON = "GemtraceGrantRefused"
ROOM_RETRY_S = 10.0  # before the same room is patched again after a failed patch (a refused RBAC: not each second)


def socket_name(resource: str) -> str:
    return "gemtrace-" + resource.split("/", 1)[1] + ".sock"


def agent_alive(state_dir: Path) -> bool:
    """The agent's heartbeat in the region is fresh (the gates' own test)."""
    try:
        region = rg.Region.open(state_dir, writable=False)
    except (OSError, rg.RegionError):
        return False
    try:
        beat = region.layout.header.heartbeat_ns
        return beat != 0 and time.monotonic_ns() - beat < contract.HEARTBEAT_STALE_NS
    finally:
        region.close()


def ask_agent_to_reload(state_dir: Path) -> None:
    """SIGHUP to the agent (its pid is in the region): it reloads at once instead of at its next look
    at the resource file (every second), which would pace admissions at one pod a second."""
    try:
        region = rg.Region.open(state_dir, writable=False)
    except (OSError, rg.RegionError):
        return
    try:
        pid = region.layout.header.agent_pid
    finally:
        region.close()
    if pid > 0:
        try:
            os.kill(pid, signal.SIGHUP)
        except OSError:
            pass  # gone, or not ours to signal: it reloads on its own within a second


def config_generation(state_dir: Path) -> int | None:
    """The agent's count of applied resource files (the region's config_generation); None: no region."""
    try:
        region = rg.Region.open(state_dir, writable=False)
    except (OSError, rg.RegionError):
        return None
    try:
        return int(region.layout.header.config_generation)
    finally:
        region.close()


def group_defined(state_dir: Path, group: str) -> bool:
    try:
        region = rg.Region.open(state_dir, writable=False)
    except (OSError, rg.RegionError):
        return False
    try:
        index = region.group_index(group)
        return index is not None and bool(region.layout.groups[index].defined)
    finally:
        region.close()


class Inventory:
    """The GPUs (uuid, memory) this node advertises and which of them are healthy; `changed` wakes
    every ListAndWatch stream."""

    def __init__(self, gpus: Sequence[tuple[str, int]]) -> None:
        self.gpus = list(gpus)
        self.healthy: set[str] = set()
        self.util_units: dict[str, int] = {}  # a GPU's util devices where fewer than shares.UTIL_UNITS
        self.version = 0
        self.changed = threading.Condition()

    def set_util_units(self, units: dict[str, int]) -> bool:
        with self.changed:
            if units == self.util_units:
                return False
            self.util_units = units
            self.wake()  # (the condition's lock is reentrant)
            return True

    def device_ids(self, resource: str) -> list[tuple[str, str]]:
        """(device ID, GPU UUID) of each device advertised for `resource` now."""
        with self.changed:
            return shares.device_ids(resource, self.gpus, self.util_units)

    def set_healthy(self, healthy: set[str]) -> bool:
        with self.changed:
            if healthy == self.healthy:
                return False
            self.healthy = healthy
            self.wake()
            return True

    def devices(self, resource: str) -> list[dp.Device]:
        return [dp.Device(ID=device, health=HEALTHY if gpu in self.healthy else UNHEALTHY)
                for device, gpu in self.device_ids(resource)]

    def wake(self) -> None:
        with self.changed:
            self.version += 1
            self.changed.notify_all()


class ResourceServicer(dp_grpc.DevicePluginServicer):
    def __init__(self, resource: str, inventory: Inventory, grants: Grants, injection: Injection,
                 state_dir: Path, stopping: threading.Event, refused: Callable[[], dict[str, str]],
                 placer: Placer, before_start: Callable[[Sequence[str]], None]) -> None:
        self.refused = refused
        self.resource = resource
        self.placer = placer
        self.before_start = before_start
        self.inventory = inventory
        self.grants = grants
        self.injection = injection
        self.state_dir = state_dir
        self.stopping = stopping

    def GetDevicePluginOptions(self, request: dp.Empty, context: Any) -> dp.DevicePluginOptions:
        return kubelet.OPTIONS

    def ListAndWatch(self, request: dp.Empty, context: Any) -> Iterator[dp.ListAndWatchResponse]:
        seen = -1
        while context.is_active() and not self.stopping.is_set():
            with self.inventory.changed:
                if self.inventory.version == seen:
                    self.inventory.changed.wait(CHECK_SECONDS)
                    continue
                seen = self.inventory.version
            yield dp.ListAndWatchResponse(devices=self.inventory.devices(self.resource))

    def GetPreferredAllocation(self, request: dp.PreferredAllocationRequest, context: Any
                               ) -> dp.PreferredAllocationResponse:
        return dp.PreferredAllocationResponse(container_responses=[
            dp.ContainerPreferredAllocationResponse(deviceIDs=self.placer.preferred(
                self.resource, list(r.available_deviceIDs), list(r.must_include_deviceIDs), r.allocation_size))
            for r in request.container_requests])

    def Allocate(self, request: dp.AllocateRequest, context: Any) -> dp.AllocateResponse:
        return dp.AllocateResponse(container_responses=[self._allocate(list(r.devicesIDs), context)
                                                        for r in request.container_requests])

    def _allocate(self, devices: list[str], context: Any) -> dp.ContainerAllocateResponse:
        started = time.monotonic()
        decision = self.placer.allocating(self.resource, devices)
        if decision is not None and decision.refusal is not None:
            # The kubelet fails the pod with this message (UnexpectedAdmissionError): its owner reads why.
            log.warning("allocate_refused", resource=self.resource, namespace=decision.key[0], pod=decision.key[1],
                        container=decision.key[2], reason=decision.refusal)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"gemtrace: {decision.refusal}")
        mounts = [dp.Mount(container_path=str(m.container_path), host_path=str(m.host_path), read_only=m.read_only)
                  for m in self.injection.mounts()]
        group = None
        envs: dict[str, str] = {}
        if self.resource == shares.GPU_MEMORY:
            # Only the memory resource names the group: the kubelet merges the two resources' envs
            # in no fixed order, keeping the first of a name, so two writers could disagree.
            # With a decision its util devices are known already: the drop-in has its MinUtil at once.
            util = decision.devices.get(shares.GPU_UTIL, ()) if decision is not None else ()
            grant = shares.Grant(memory=tuple(devices), util=util, gpus_asked=decision.gpus if decision else 1)
            group = grant.group
            if self.grants.write(grant, keep_existing=True):
                ask_agent_to_reload(self.state_dir)
            self._wait_defined(group)
        # Each resource confines the container to its devices' GPUs: a container asking only for
        # util must not run on a GPU where it holds none (its MinUtil is reserved where it holds some).
        gpus = ",".join(dict.fromkeys(shares.gpu_of(d) for d in devices))
        envs = {"CUDA_VISIBLE_DEVICES": gpus, "NVIDIA_VISIBLE_DEVICES": gpus}
        envs.update(self.injection.env(group))
        # took_s: what the kubelet's admission of the pod waited on the plugin (with prestart_answered's).
        log.info("allocated", resource=self.resource, devices=len(devices), group=group,
                 took_s=round(time.monotonic() - started, 3))
        return dp.ContainerAllocateResponse(envs=envs, mounts=mounts)

    def _wait_defined(self, group: str) -> None:
        deadline = time.monotonic() + ALLOCATE_WAIT_S
        while not group_defined(self.state_dir, group):
            reason = self.refused().get(self.grants.path(group).name)
            if reason is not None:  # it will not come: the pod hears why once PodResources names it
                log.warning("group_refused", group=group, reason=reason,
                            consequence="the container starts in no group of its own")
                return
            if time.monotonic() > deadline:
                # The gate retries every second: the container's first allocations run ungated.
                log.warning("group_not_defined_yet", group=group, waited_s=ALLOCATE_WAIT_S,
                            consequence="the container starts; its gate joins the group once the agent has it")
                return
            time.sleep(0.05)

    def PreStartContainer(self, request: dp.PreStartContainerRequest, context: Any
                          ) -> dp.PreStartContainerResponse:
        started = time.monotonic()
        self.before_start(list(request.devicesIDs))
        log.info("prestart_answered", resource=self.resource, devices=len(request.devicesIDs),
                 took_s=round(time.monotonic() - started, 3))
        return dp.PreStartContainerResponse()


class DevicePlugin:
    """Serves both resources, keeps them registered, healthy and reconciled until `stop()`."""

    def __init__(self, gpus: Sequence[tuple[str, int]], state_dir: Path, grants: Grants, injection: Injection,
                 device_plugins: Path = kubelet.DEVICE_PLUGINS, pod_resources: Path | None = kubelet.POD_RESOURCES,
                 gpus_present: Callable[[], set[str]] | None = None,
                 pods: Callable[[], Pods] | None = None, names_file: Path | None = None,
                 tell: Callable[[str, str, str, str], None] | None = None,
                 names: dict[str, str] | None = None, packing: Packing | None = None,
                 config: Path | None = None, publish_room: Callable[[str | None], None] | None = None) -> None:
        """`pods`: the apiserver's pods of this node (gemtrace.kube.apiserver), for placement, the
        grants' Cgroup rule and MaxUtil annotation, and which pods are gone; None: without them.
        `names_file`: where to write the pods' names for the agent's metrics labels
        (gemtrace.kube.pods.NAMES_FILE); the agent's refusals are read beside it. `tell(namespace,
        pod, uid, message)`: a Warning event on a pod whose grant the agent refused. `names`: each
        GPU's NVML name (uuid -> name), for gemtrace.io/gpu-model; `packing`: binpack by default.
        `config`: the agent's resource file, whose own groups' MinUtil the util devices leave out.
        `publish_room(text)`: sets this node's annotation of each GPU's room (gemtrace.kube.rooms),
        and removes it given None; None: not published."""
        self.inventory = Inventory(gpus)
        self.config = config
        self._config_seen: tuple[object, ...] | None = None  # the files' stat when last read
        self.state_dir = state_dir
        self.grants = grants
        self.injection = injection
        self.device_plugins = device_plugins
        self.pod_resources = pod_resources
        self.pods = pods
        self.names_file = names_file
        self.refused_file = refused_file(names_file) if names_file is not None else None
        self.tell = tell
        self._told: dict[str, str] = {}  # group -> the refusal its pod was told
        # PreStartContainer reconciles beside the loop: one of them tells, the other does not wait on
        # the apiserver for it (the loop tells within a second what a skipped pass would have).
        self._telling = threading.Lock()
        self.gpus_present = gpus_present or (lambda: {uuid for uuid, _ in gpus})
        self.kubelet_socket = kubelet.KubeletSocket(device_plugins)
        self._servers: list[grpc.Server] = []
        self._stop = threading.Event()
        self.registrations = 0
        # The loop and PreStartContainer both reconcile; the grants' files are written by one at a time.
        self._reconciling = threading.Lock()
        # The agent's config_generation before the last write of a drop-in: it has applied the write
        # once its generation passes this (None: nothing written since it last did).
        self._unapplied: int | None = None
        self.names = names or {}
        self.publish_room = publish_room
        self._room_published: str | None = None
        self._room_failed: tuple[str, float] | None = None  # the room whose patch failed, and when
        # A patch of the loop's and close()'s removal, one after the other: none after the removal.
        self._room_lock = threading.Lock()
        self.placer = Placer(gpus, self.names, packing or PACKINGS[DEFAULT_PACKING](), pods, self._listed,
                             advertised=self.inventory.device_ids)

    def _listed(self) -> list[kubelet.ContainerDevices]:
        return kubelet.list_pod_resources(self.pod_resources) if self.pod_resources is not None else []

    def check_health(self) -> None:
        alive = agent_alive(self.state_dir)
        try:
            present = self.gpus_present()
        except Exception as e:  # NVML gone: no GPU is usable
            log.warning("gpu_discovery_failed", error=str(e))
            present = set()
        healthy = present & {uuid for uuid, _ in self.inventory.gpus} if alive else set()
        if self.inventory.set_healthy(healthy):
            log.info("health_changed", agent_alive=alive, healthy=sorted(healthy),
                     unhealthy=sorted({u for u, _ in self.inventory.gpus} - healthy))

    def check_reserved(self) -> None:
        """Advertise, on each GPU, the util devices that the resource file's own groups leave
        (shares.util_left); read again when the file or its drop-in directory changed. A file the
        agent would refuse leaves the devices as they were, as the agent keeps its settings."""
        if self.config is None:
            return
        seen: list[object] = []
        # The pods' own files (shares.GROUP_PREFIX) are left out: their shares are the devices given.
        for path in (self.config, *(p for p in dropins(self.config) if not p.name.startswith(shares.GROUP_PREFIX))):
            try:
                st = path.stat()
                seen.append((path.name, st.st_ino, st.st_mtime_ns, st.st_size))
            except OSError:
                seen.append((path.name, None))
        if tuple(seen) == self._config_seen:
            return
        self._config_seen = tuple(seen)
        try:
            groups = load(self.config).groups.values()
        except (ConfigError, OSError) as e:
            log.warning("resource_file_unusable", config=str(self.config), error=str(e),
                        consequence="the util devices stay as they were")
            return
        units = {uuid: n for uuid, n in shares.util_left(groups, [u for u, _ in self.inventory.gpus]).items()
                 if n < shares.UTIL_UNITS}
        if self.inventory.set_util_units(units):
            log.info("util_devices_changed",
                     util_devices={u: units.get(u, shares.UTIL_UNITS) for u, _ in self.inventory.gpus})

    def serve_and_register(self) -> None:
        """(Re)start the servers on fresh sockets and register each resource with the kubelet."""
        self.stop_servers()
        for resource in shares.RESOURCES:
            path = self.device_plugins / socket_name(resource)
            path.unlink(missing_ok=True)
            server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
            dp_grpc.add_DevicePluginServicer_to_server(
                ResourceServicer(resource, self.inventory, self.grants, self.injection, self.state_dir, self._stop,
                                 self.refusals, self.placer, self.before_start),
                server)
            server.add_insecure_port(f"unix://{path}")
            server.start()
            self._servers.append(server)
        for resource in shares.RESOURCES:
            kubelet.register(self.device_plugins, socket_name(resource), resource)
        self.registrations += 1
        log.info("registered", resources=list(shares.RESOURCES), device_plugins=str(self.device_plugins),
                 registrations=self.registrations)

    def stop_servers(self) -> None:
        for server in self._servers:
            server.stop(grace=0.5)
        self._servers = []

    def reconcile(self) -> dict[str, Grant] | None:
        """Make the drop-ins say PodResources' grants; returns them (None: PodResources unavailable)."""
        if self.pod_resources is None:
            return None
        try:
            containers = kubelet.list_pod_resources(self.pod_resources)
        except grpc.RpcError as e:
            log.warning("pod_resources_unavailable", socket=str(self.pod_resources), error=str(e.code()))
            return None
        pods = None
        if self.pods is not None and containers:
            try:
                pods = self.pods()
            except Exception as e:  # ApiError; the grants are written without what it would add
                log.warning("apiserver_unavailable", error=str(e), consequence="no Cgroup rule or MaxUtil annotation")
        with self._reconciling:
            self.placer.prune(containers, pods)
            writes, generation = self.grants.writes, config_generation(self.state_dir)
            grants = self.grants.reconcile(containers, pods)
            if self.grants.writes != writes:
                if self._unapplied is None and generation is not None:
                    self._unapplied = generation
                ask_agent_to_reload(self.state_dir)
        if self.names_file is not None:
            write_names(self.names_file, Names(
                {info.uid: (namespace, name, info.containers) for (namespace, name), info in (pods or {}).items()},
                {group: (g.namespace, g.pod, g.container) for group, g in grants.items()}))
        self.tell_refusals(grants, pods or {})
        return grants

    def refusals(self) -> dict[str, str]:
        """The agent's: drop-in file name -> why it left it out."""
        return read_refusals(self.refused_file) if self.refused_file is not None else {}

    def tell_refusals(self, grants: dict[str, Grant], pods: Pods) -> None:
        """Log, and tell its pod, each grant the agent refused, once per reason."""
        if not self._telling.acquire(blocking=False):
            return
        try:
            self._tell_refusals(grants, pods)
        finally:
            self._telling.release()

    def _tell_refusals(self, grants: dict[str, Grant], pods: Pods) -> None:
        refused = self.refusals()
        for group in self._told.keys() - {g for g in grants if self.grants.path(g).name in refused}:
            del self._told[group]  # in force now, or gone: a later refusal is news again
        for group, grant in grants.items():
            reason = refused.get(self.grants.path(group).name)
            if reason is None or self._told.get(group) == reason or not grant.pod:
                continue
            self._told[group] = reason
            log.warning("grant_refused", group=group, namespace=grant.namespace, pod=grant.pod,
                        container=grant.container, reason=reason,
                        consequence="its container runs in no group of its own; every other grant stays in force")
            if self.tell is None:
                continue
            info = pods.get((grant.namespace, grant.pod))
            try:
                self.tell(grant.namespace, grant.pod, info.uid if info else "",
                          f"gemtrace refused container {grant.container}'s GPU share: {reason}")
            except Exception as e:  # ApiError; not tried again: a refused RBAC would make it a flood
                log.warning("event_failed", namespace=grant.namespace, pod=grant.pod, error=str(e),
                            consequence="the refusal is in this log only (grant_refused)")

    def before_start(self, devices: Sequence[str]) -> None:
        """PreStartContainer's work: the container's grant written with its pod's Cgroup rule and
        applied by the agent, within PRESTART_WAIT_S."""
        wanted = set(devices)
        deadline = time.monotonic() + PRESTART_WAIT_S
        while True:
            grant = next((g for g in (self.reconcile() or {}).values() if wanted & set(g.memory + g.util)), None)
            if grant is not None and grant.cgroup:
                break
            if time.monotonic() > deadline or self._stop.is_set():
                log.warning("container_starts_without_cgroup_rule", devices=len(devices), waited_s=PRESTART_WAIT_S,
                            consequence="its processes that set no GEMTRACE_GROUP join its group once the rule comes")
                return
            time.sleep(0.1)
        while self._unapplied is not None:
            generation = config_generation(self.state_dir)
            if generation is not None and generation > self._unapplied:
                self._unapplied = None
            elif time.monotonic() > deadline or self._stop.is_set():
                log.warning("cgroup_rule_not_applied_yet", group=grant.group, waited_s=PRESTART_WAIT_S,
                            consequence="the container starts; its processes join its group once the agent has it")
                return
            else:
                time.sleep(0.02)

    def publish(self, grants: dict[str, Grant]) -> None:
        """Patch this node's annotation with each GPU's room if it changed since the last patch: the
        devices advertised on healthy GPUs that neither `grants` nor a placement decision not yet
        recorded by the kubelet holds."""
        if self.publish_room is None:
            return
        with self._room_lock:
            if not self._stop.is_set():
                self._publish(self.publish_room, grants)

    def _publish(self, publish_room: Callable[[str | None], None], grants: dict[str, Grant]) -> None:
        held = {d for g in grants.values() for d in g.memory + g.util} | self.placer.undelivered()
        rooms = node_rooms(self.inventory.gpus, self.names, self.inventory.healthy,
                           {r: self.inventory.device_ids(r) for r in shares.RESOURCES}, held)
        text = room_text(rooms)
        now = time.monotonic()
        if text == self._room_published or (
                self._room_failed is not None and self._room_failed[0] == text
                and now - self._room_failed[1] < ROOM_RETRY_S):
            return
        try:
            publish_room(text)
        except Exception as e:  # ApiError: the extender reads the last room published meanwhile
            self._room_failed = (text, now)
            log.warning("gpu_room_not_published", error=str(e), retry_s=ROOM_RETRY_S,
                        consequence="the scheduler extender checks pods against the node's previous room")
            return
        self._room_published, self._room_failed = text, None
        log.info("gpu_room_published", free={r.index: (r.memory_free, r.util_free) for r in rooms})

    def step(self) -> None:
        """One pass of the loop: health, the util devices, registration after a kubelet (re)start,
        reconciliation, this node's room."""
        self.check_health()
        self.check_reserved()
        sockets_gone = self._servers and not all(
            (self.device_plugins / socket_name(r)).exists() for r in shares.RESOURCES)
        if self.kubelet_socket.changed() or sockets_gone:
            try:
                self.serve_and_register()
            except grpc.RpcError as e:
                log.warning("registration_failed", error=str(e.code()), consequence="retried in a second")
                self.kubelet_socket = kubelet.KubeletSocket(self.device_plugins)  # retry next step
        grants = self.reconcile()
        if grants is not None:
            self.publish(grants)

    def run(self) -> None:
        while not self._stop.is_set():
            try:
                self.step()
            except Exception:
                log.exception("plugin_step_failed")
            self._stop.wait(CHECK_SECONDS)

    def stop(self) -> None:
        self._stop.set()
        self.inventory.wake()

    def close(self) -> None:
        self.stop()
        self.stop_servers()
        for resource in shares.RESOURCES:
            (self.device_plugins / socket_name(resource)).unlink(missing_ok=True)
        with self._room_lock:  # after stop(): the loop patches no more
            if self.publish_room is None or self._room_published is None:
                return
            # Nobody keeps the room once the plugin stops: without it the scheduler extender passes
            # the node and the node checks pods itself, rather than the extender judging a stale room.
            try:
                self.publish_room(None)
                self._room_published = None
            except Exception as e:  # ApiError
                log.warning("gpu_room_not_removed", error=str(e),
                            consequence="the scheduler extender reads the last room until a plugin publishes again")
