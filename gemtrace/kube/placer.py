"""Where a container's share goes on this node: the device plugin's decision, made once per container.

The kubelet chooses each resource's devices apart (GetPreferredAllocation, then Allocate, for one
resource and then the other, in no fixed order) and never says whose they are. Left to itself it
would put a container's memory on one GPU and its time on another, or spread either over several.
So, at the first of a container's two GetPreferredAllocation calls, the Placer finds the container
the kubelet is admitting, decides its GPUs for both resources at once (gemtrace.run.placement.place:
whole on each GPU, of the model asked, binpacked or spread) and answers both calls with those
devices; Allocate refuses, with the reason, a container it could not place.

Finding the container: the kubelet admits one pod at a time, its containers in order, and calls the
plugin back to back for each resource. The container is the oldest pending pod's first container
(init containers first) that asks for this many units of this resource and holds none yet (neither
in PodResources nor in a decision here). Two pending containers that both fit that are told apart
only when they ask differently; when they ask the same, either answer is the same decision.
Without the apiserver (no --node-name) nothing is known of the pods: the devices are chosen per
resource, on one GPU where they fit (shares.preferred), as before placement.

Never writes anything: the device plugin turns decisions into answers and drop-ins.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import structlog

from gemtrace.kube import shares
from gemtrace.kube.grants import Pods
from gemtrace.kube.kubelet import ContainerDevices
from gemtrace.run.placement import Packing, Room, Unplaceable, place

log = structlog.get_logger("gemtrace.kube.placer")

Key = tuple[str, str, str]  # namespace, pod, container
DECISION_TTL_S = 600.0  # a decision the kubelet never acted on (the pod deleted while admitted)
UNDELIVERED_S = 30.0  # a decision counts as holding its devices (the node's room) this long at most


@dataclass
class Decision:
    key: Key
    devices: dict[str, tuple[str, ...]]  # resource -> the devices chosen for it
    refusal: str | None  # why it could not be placed, for Allocate to say
    made: float
    gpus: int = 1  # how many GPUs it asked for
    answered: set[str] = field(default_factory=set)  # the resources whose preferred call it answered


def pending_containers(pods: Pods, listed: Sequence[ContainerDevices], resource: str, units: int,
                       decisions: dict[Key, Decision]) -> list[tuple[Key, dict[str, int], dict[str, str]]]:
    """(key, its limits, its pod's annotations) of every container that may be the one the kubelet
    is admitting with `units` of `resource`, the likeliest first: one whose other resource was just
    decided, then pods by age, containers in order."""
    holding = {(c.namespace, c.pod, c.container) for c in listed if resource in c.devices}
    out = []
    for (namespace, name), info in sorted(pods.items(), key=lambda item: (item[1].created, item[0])):
        if info.phase not in ("", "Pending"):
            continue
        for container, limits in info.requests.items():
            key = (namespace, name, container)
            decision = decisions.get(key)
            if (limits.get(resource) == units and key not in holding
                    and (decision is None or resource not in decision.answered and decision.refusal is None)):
                out.append((key, limits, info.annotations))
    out.sort(key=lambda c: c[0] not in decisions)  # stable: age order within each
    return out


class Placer:
    def __init__(self, gpus: Sequence[tuple[str, int]], names: dict[str, str], packing: Packing,
                 pods: Callable[[], Pods] | None, listed: Callable[[], list[ContainerDevices]],
                 clock: Callable[[], float] = time.monotonic,
                 advertised: Callable[[str], list[tuple[str, str]]] | None = None) -> None:
        """`gpus`: (uuid, memory bytes) as advertised; `names`: uuid -> NVML name; `pods`: the
        apiserver's pods of this node (None: unknown); `listed`: the kubelet's PodResources;
        `advertised`: a resource's devices advertised now (default: every unit of the GPUs)."""
        self.gpus = [uuid for uuid, _ in gpus]
        self.advertised = advertised or (lambda resource: shares.device_ids(resource, gpus))
        self.names = names
        self.packing = packing
        self.pods = pods
        self.listed = listed
        self.clock = clock
        self.decisions: dict[Key, Decision] = {}
        self._last: dict[str, Decision | None] = {}  # resource -> the decision its last preferred call answered
        self._lock = threading.Lock()

    def preferred(self, resource: str, available: Sequence[str], must_include: Sequence[str], size: int) -> list[str]:
        """GetPreferredAllocation's answer for one container."""
        with self._lock:
            decision = self._decision(resource, available, size)
            self._last[resource] = decision
            chosen = decision.devices.get(resource) if decision is not None else None
            if chosen is None or not set(chosen) <= set(available) | set(must_include):
                return shares.preferred(available, must_include, size)
            return (list(dict.fromkeys(must_include)) + [d for d in chosen if d not in must_include])[:size]

    def allocating(self, resource: str, devices: Sequence[str]) -> Decision | None:
        """The decision behind an Allocate of `devices`: that of the preferred call just before (the
        kubelet makes the two back to back), if it refused the container or the kubelet took its
        devices; else None."""
        with self._lock:
            decision = self._last.pop(resource, None)
        if decision is None:
            return None
        if decision.refusal is not None or sorted(decision.devices.get(resource, ())) == sorted(devices):
            return decision
        return None

    def undelivered(self) -> set[str]:
        """The devices of the decisions made in the last UNDELIVERED_S that the kubelet has not yet
        recorded: its Allocate follows at once, and an older one is a pod deleted while admitted."""
        now = self.clock()
        with self._lock:
            return {d for decision in self.decisions.values() if now - decision.made < UNDELIVERED_S
                    for ds in decision.devices.values() for d in ds}

    def prune(self, listed: Sequence[ContainerDevices], pods: Pods | None) -> None:
        """Forget the decisions the kubelet has recorded (PodResources lists them), those of pods gone
        or ended, and any past DECISION_TTL_S."""
        now = self.clock()
        recorded = {(c.namespace, c.pod, c.container): set(c.devices) for c in listed}
        with self._lock:
            for key, decision in list(self.decisions.items()):
                done = decision.refusal is None and recorded.get(key, set()) >= set(decision.devices)
                info = (pods or {}).get(key[:2])
                gone = pods is not None and (info is None or info.finished)
                if done or gone or now - decision.made > DECISION_TTL_S:
                    del self.decisions[key]

    def _decision(self, resource: str, available: Sequence[str], size: int) -> Decision | None:
        if self.pods is None:
            return None
        try:
            pods, listed = self.pods(), self.listed()
        except Exception as e:  # ApiError, grpc.RpcError: the kubelet chooses without us
            log.warning("placement_unknown", resource=resource, error=str(e),
                        consequence="devices chosen for this resource alone")
            return None
        candidates = pending_containers(pods, listed, resource, size, self.decisions)
        if not candidates:
            log.info("placement_container_unknown", resource=resource, units=size)
            return None
        key, limits, annotations = candidates[0]
        decision = self.decisions.get(key)
        if decision is None:
            decision = self._decide(key, limits, annotations, resource, available, listed)
            self.decisions[key] = decision
        decision.answered.add(resource)
        return decision

    def _decide(self, key: Key, limits: dict[str, int], annotations: dict[str, str], resource: str,
                available: Sequence[str], listed: Sequence[ContainerDevices]) -> Decision:
        free = self._free(resource, available, listed, exclude=key)
        try:
            request = shares.request_of(limits, annotations)
            rooms = [Room(gpu, self.names.get(gpu, ""), len(free[shares.GPU_MEMORY].get(gpu, [])),
                          len(free[shares.GPU_UTIL].get(gpu, []))) for gpu in self.gpus]
            chosen = place(rooms, request.memory, request.util, request.gpus, request.model, self.packing)
        except (shares.RequestError, Unplaceable) as e:
            log.warning("placement_refused", namespace=key[0], pod=key[1], container=key[2], reason=str(e))
            return Decision(key, {}, str(e), self.clock())
        devices = {}
        for r in shares.RESOURCES:
            per_gpu = request.memory if r == shares.GPU_MEMORY else request.util
            if r in limits:
                devices[r] = tuple(d for room in chosen for d in free[r][room.uuid][:per_gpu])
        log.info("placed", namespace=key[0], pod=key[1], container=key[2], gpus=[r.uuid for r in chosen],
                 memory_gib=request.memory, util_percent=request.util)
        return Decision(key, devices, None, self.clock(), request.gpus)

    def _free(self, resource: str, available: Sequence[str], listed: Sequence[ContainerDevices],
              exclude: Key) -> dict[str, dict[str, list[str]]]:
        """resource -> GPU -> its free devices, in unit order: of the kubelet's `available` for the
        resource asked, and of all for the other, those that neither PodResources nor another
        container's decision holds."""
        decided = {d for k, dec in self.decisions.items() if k != exclude for ds in dec.devices.values() for d in ds}
        taken = decided | {d for c in listed for ds in c.devices.values() for d in ds}
        out: dict[str, dict[str, list[str]]] = {}
        for r in shares.RESOURCES:
            pool = ([d for d in available if d not in decided] if r == resource
                    else [d for d, _ in self.advertised(r) if d not in taken])
            per: dict[str, list[str]] = {}
            for d in sorted(pool, key=shares.unit_index):
                per.setdefault(shares.gpu_of(d), []).append(d)
            out[r] = per
        return out
