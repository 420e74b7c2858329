"""The GPU shares a pod can request, as Kubernetes extended resources, and the group a grant makes.

Two resources per node, each advertised by the device plugin as devices the kubelet counts:

    gemtrace.io/gpu-memory   1 unit = 1 GiB of one GPU's memory; device `<gpu uuid>-m<i>`
    gemtrace.io/gpu-util     1 unit = 1% of one GPU's time;        device `<gpu uuid>-u<i>`

A container's grant is the devices the kubelet gave it: its memory devices make its group's
MemoryLimit (GiB on the GPU it has most of: the limit is per GPU), its util devices its MinUtil, and
MaxUtil is the pod's annotation `gemtrace.io/max-util` (a ratio) or else the util request itself.
The group names its GPUs (`Gpus`: those of its devices, which CUDA_VISIBLE_DEVICES confines it to),
so that MinUtils add up per GPU: pods at 70% on each of two GPUs are fine. Its MinUtil is the fewest
util devices it holds on any of those GPUs: the agent reserves a group's MinUtil on every GPU it runs
on, so a grant whose devices the kubelet spread (10 + 50) or put its memory on another GPU than its
util gets no more on a GPU than the kubelet counted there, and no GPU's MinUtils pass 1. The
group is named after the memory devices (`k8s-` and a hash), so the same grant gets the same name
after any restart of the plugin or the kubelet: nothing is counted twice. Its Cgroup rule (the pod's
cgroup) binds (CgroupBinding): the pod's processes are in its group whatever GEMTRACE_GROUP says.
The pod's annotations `gemtrace.io/priority`, `gemtrace.io/isolation` and `gemtrace.io/oversubscribe`
give the group's Priority, Isolation and Oversubscribe, with the resource file's own rules
(`pod_settings`; the webhook refuses a pod that breaks them).

What one container asks (`Request`): the two resources are what it takes in all, split evenly over
the pod's annotation `gemtrace.io/gpus` (default 1) so that each GPU gets its memory and its time
whole, and `gemtrace.io/gpu-model` names the GPU models it accepts. The device plugin places it
(gemtrace.run.placement.place) and steers the kubelet to those devices. Pure functions only.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from gemtrace.config import GroupConfig, check_value, parse_size

GPU_MEMORY = "gemtrace.io/gpu-memory"
GPU_UTIL = "gemtrace.io/gpu-util"
ANNOTATION_MAX_UTIL = "gemtrace.io/max-util"
ANNOTATION_GPUS = "gemtrace.io/gpus"
ANNOTATION_GPU_MODEL = "gemtrace.io/gpu-model"
ANNOTATION_PRIORITY = "gemtrace.io/priority"
ANNOTATION_ISOLATION = "gemtrace.io/isolation"
ANNOTATION_OVERSUBSCRIBE = "gemtrace.io/oversubscribe"
# annotation -> the resource file's key it sets in the pod's groups
ANNOTATION_KEYS = {ANNOTATION_MAX_UTIL: "MaxUtil", ANNOTATION_PRIORITY: "Priority",
                   ANNOTATION_ISOLATION: "Isolation", ANNOTATION_OVERSUBSCRIBE: "Oversubscribe"}
LABEL_GROUP = "gemtrace.io/group"
GiB = 1 << 30
UTIL_UNITS = 100  # per GPU: 1 unit = 1%
GROUP_PREFIX = "k8s-"

_KIND = {GPU_MEMORY: "m", GPU_UTIL: "u"}
RESOURCES = tuple(_KIND)


def device_ids(resource: str, gpus: Sequence[tuple[str, int]],
               util_units: Mapping[str, int] | None = None) -> list[tuple[str, str]]:
    """(device ID, GPU UUID) of every unit of `resource` on the GPUs given as (uuid, memory bytes);
    `util_units`: a GPU's util devices where fewer than UTIL_UNITS (`util_left`)."""
    kind = _KIND[resource]
    out: list[tuple[str, str]] = []
    for uuid, memory in gpus:
        units = memory // GiB if resource == GPU_MEMORY else (util_units or {}).get(uuid, UTIL_UNITS)
        out.extend((f"{uuid}-{kind}{i}", uuid) for i in range(units))
    return out


def util_left(groups: Iterable[GroupConfig], uuids: Iterable[str]) -> dict[str, int]:
    """Each GPU's util devices: UTIL_UNITS less the MinUtil that the resource file's own groups (not
    the pods' grants) reserve there, one without Gpus on every GPU, rounded up to a whole unit. The
    kubelet then never hands out a share that would take a GPU's MinUtils past 1, which the agent
    refuses (the pod would run in no group of its own)."""
    own = [g for g in groups if not g.name.startswith(GROUP_PREFIX) and g.min_util > 0]
    out = {}
    for uuid in uuids:
        reserved = math.fsum(g.min_util for g in own if not g.gpus or uuid in g.gpus)
        out[uuid] = max(0, UTIL_UNITS - math.ceil(reserved * UTIL_UNITS - 1e-9))
    return out


def gpu_of(device_id: str) -> str:
    """The GPU UUID of a device ID that device_ids made."""
    return device_id.rsplit("-", 1)[0]


def group_name(device_ids: Iterable[str]) -> str:
    """The group of a grant, named by its devices: the same devices, the same name (region names are
    at most 63 bytes; 16 hex digits make a collision between live grants negligible)."""
    digest = hashlib.sha256(",".join(sorted(device_ids)).encode()).hexdigest()
    return GROUP_PREFIX + digest[:16]


def preferred(available: Sequence[str], must_include: Sequence[str], size: int) -> list[str]:
    """The devices to give a container asking for `size` units: those it must have, then from the GPU
    they are on, then from the GPUs with the most free units, so that a grant stays on one GPU when it
    can (a MemoryLimit is per GPU: spread over two it would give twice the memory)."""
    chosen = list(dict.fromkeys(must_include))[:size]
    free: dict[str, list[str]] = {}
    for device in available:
        if device not in chosen:
            free.setdefault(gpu_of(device), []).append(device)
    first = {gpu_of(d) for d in chosen}
    for gpu in sorted(free, key=lambda g: (g not in first, -len(free[g]), g)):
        chosen.extend(free[gpu][: size - len(chosen)])
    return chosen[:size]


class RequestError(ValueError):
    """A container's request that no node could place; str() says what to change."""


@dataclass(frozen=True)
class Request:
    """What one container asks on each of its GPUs: `memory` GiB and `util` percent, on `gpus`
    distinct GPUs, of `model` (NVML name words, comma-separated alternatives) if given."""

    memory: int
    util: int
    gpus: int = 1
    model: str | None = None

    def units(self, resource: str) -> int:
        """The devices of `resource` it takes in all, on all its GPUs."""
        return (self.memory if resource == GPU_MEMORY else self.util) * self.gpus


def request_of(limits: Mapping[str, int], annotations: Mapping[str, str]) -> Request:
    """A container's request from its limits of the two resources (what the kubelet counts: the
    totals) and its pod's annotations; RequestError when it cannot be split evenly over its GPUs."""
    text = annotations.get(ANNOTATION_GPUS, "1")
    try:
        gpus = int(text) if isinstance(text, str) else 0
    except ValueError:
        gpus = 0
    if gpus < 1:
        raise RequestError(f"annotation {ANNOTATION_GPUS}={text!r} is not a number of GPUs; "
                           "write a whole number, 1 or more")
    memory, util = limits.get(GPU_MEMORY, 0), limits.get(GPU_UTIL, 0)
    for resource, total in ((GPU_MEMORY, memory), (GPU_UTIL, util)):
        if total % gpus:
            raise RequestError(f"{resource}: {total} does not split evenly over {ANNOTATION_GPUS}={gpus}; ask for a "
                               f"multiple of {gpus} (the total over all its GPUs)")
    if util // gpus > UTIL_UNITS:
        raise RequestError(f"{GPU_UTIL}: {util} over {gpus} GPU(s) is more than {UTIL_UNITS}% of each; ask for at most "
                           f"{UTIL_UNITS * gpus}, or for more GPUs ({ANNOTATION_GPUS})")
    model = annotations.get(ANNOTATION_GPU_MODEL)
    if model is not None and (not isinstance(model, str) or not model.isprintable()):
        raise RequestError(f"annotation {ANNOTATION_GPU_MODEL}={model!r} is not a GPU model name; write words of "
                           "the GPUs' names, comma-separated alternatives (H100, A100)")
    return Request(memory // gpus, util // gpus, gpus, (model or "").strip() or None)


def gpus_asked(annotations: Mapping[str, str]) -> int:
    """The pod's gemtrace.io/gpus, or 1 where it is absent or no count (request_of says why)."""
    try:
        return max(int(annotations.get(ANNOTATION_GPUS, "1")), 1)
    except ValueError:
        return 1


def unit_index(device_id: str) -> int:
    """The unit's number in a device ID that device_ids made (`...-m12` -> 12)."""
    return int(device_id.rsplit("-", 1)[1][1:])


@dataclass(frozen=True)
class Grant:
    """What a container holds: its devices of each resource, and what is known of its pod."""

    memory: tuple[str, ...] = ()
    util: tuple[str, ...] = ()
    namespace: str = ""
    pod: str = ""
    container: str = ""
    max_util: float | None = None  # the pod's annotation, if any
    cgroup: str = ""  # the pod's cgroup path, if known
    gpus_asked: int = 1  # the pod's gemtrace.io/gpus: its util devices are that many GPUs' worth
    settings: tuple[tuple[str, str], ...] = ()  # (key, value) from the pod's other annotations: PodSettings

    @property
    def group(self) -> str:
        return group_name(self.memory or self.util)

    @property
    def gpus(self) -> list[str]:
        """The GPUs its container may run on: those of all its devices (each resource's Allocate
        names its own in CUDA_VISIBLE_DEVICES; the kubelet keeps whichever came first)."""
        return list(dict.fromkeys(gpu_of(d) for d in self.memory + self.util))

    @property
    def split(self) -> bool:
        """Its util devices are not all on each GPU it may run on: it gets less MinUtil than it asked."""
        return bool(self.util) and self.min_util() * UTIL_UNITS < min(len(self.util) // self.gpus_asked, UTIL_UNITS)

    def memory_limit(self) -> int:
        per_gpu: dict[str, int] = {}
        for device in self.memory:
            per_gpu[gpu_of(device)] = per_gpu.get(gpu_of(device), 0) + 1
        return max(per_gpu.values(), default=0) * GiB

    def min_util(self) -> float:
        per_gpu = dict.fromkeys(self.gpus, 0)
        for device in self.util:
            per_gpu[gpu_of(device)] += 1
        return min(per_gpu.values(), default=0) / UTIL_UNITS if self.util else 0.0

    def max_util_ratio(self) -> float:
        """The annotation (never below the MinUtil), else its util request on one GPU."""
        if self.max_util is not None:
            return max(self.max_util, self.min_util())
        return min(len(self.util) // self.gpus_asked, UTIL_UNITS) / UTIL_UNITS or 1.0


@dataclass(frozen=True)
class PodSettings:
    """What a pod's annotations set in its groups: MaxUtil, and (key, value) lines of the resource file."""

    max_util: float | None = None
    lines: tuple[tuple[str, str], ...] = ()


def pod_settings(annotations: Mapping[str, str], memory_gib: int = 0) -> PodSettings:
    """The pod's settings from its annotations; ValueError, one sentence naming the annotation, for a
    value the resource file would refuse (or an Oversubscribe size not above the `memory_gib` the pod
    asks for per container, which would never allow managed memory)."""
    max_util = None
    lines: list[tuple[str, str]] = []
    for annotation, key in ANNOTATION_KEYS.items():
        value = annotations.get(annotation)
        if value is None:
            continue
        if not isinstance(value, str):
            raise ValueError(f"annotation {annotation} must be a string")
        try:
            check_value(key, value)
        except ValueError as e:
            raise ValueError(f"annotation {annotation}: {e}") from None
        value = value.strip()
        if key == "MaxUtil":
            max_util = float(value)
            continue
        if key == "Oversubscribe" and memory_gib and value.lower() not in ("true", "yes", "on", "false", "no", "off"):
            if parse_size(value) <= memory_gib * GiB:
                raise ValueError(f"annotation {annotation}: {value} is not above the pod's {memory_gib} GiB of "
                                 f"{GPU_MEMORY}, so it would never allow managed memory; give more, or true")
        lines.append((key, value))
    return PodSettings(max_util, tuple(lines))


_HEADER = "# Written by gemtrace kube-plugin for "
_HEADER_POD = re.compile(re.escape(_HEADER) + r"([^/ ]+)/([^/ ]+) container ([^ ;]+);")


def dropin_text(grant: Grant) -> str:
    """The drop-in resource file of a grant (gemtrace.config reads it after the main file)."""
    who = f"{grant.namespace}/{grant.pod} container {grant.container}" if grant.pod else "a pod not yet known"
    lines = [
        f"{_HEADER}{who}; removed when the pod is gone. Do not edit.",
        f"[{grant.group}]",
    ]
    if grant.memory:
        lines.append(f"MemoryLimit = {grant.memory_limit() // GiB}GiB")
    if grant.util:
        lines.append(f"MinUtil = {grant.min_util():g}")
    lines.append(f"MaxUtil = {grant.max_util_ratio():g}")
    lines += [f"{key} = {value}" for key, value in grant.settings]
    if grant.cgroup:
        # Binding: a process of the pod that clears or changes GEMTRACE_GROUP stays in its pod's group.
        lines += [f"Cgroup = {grant.cgroup}", "CgroupBinding = true"]
    if grant.gpus:
        lines.append(f"Gpus = {'; '.join(grant.gpus)}")
    return "\n".join(lines) + "\n"


def dropin_container(text: str) -> tuple[str, str, str] | None:
    """The (namespace, pod, container) a drop-in was written for, once PodResources had named them;
    None for Allocate's file, written before anyone knew whose it was."""
    match = _HEADER_POD.match(text)
    return (match.group(1), match.group(2), match.group(3)) if match else None
