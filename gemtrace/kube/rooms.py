"""Each GPU's free room on a node, as the node's annotation `gemtrace.io/gpu-room`: what the device
plugin publishes and the scheduler extender reads, so that the scheduler checks a pod's fit on each
GPU before it binds the pod (the kubelet counts only the node's totals).

The annotation is a JSON list, one object a GPU, in the terms the plugin's placement uses
(gemtrace.run.placement.Room): whole GiB and whole percent of the GPU's time, as the two resources
count them.

    [{"index": 0, "uuid": "GPU-...", "name": "NVIDIA H100 80GB HBM3",
      "memoryGiB": 80, "memoryFreeGiB": 72, "utilFreePercent": 50}, ...]

`memoryFreeGiB` and `utilFreePercent` are the devices advertised on that GPU that no container holds
(the util devices already leave out what the resource file's own groups reserve: shares.util_left);
an unhealthy GPU has none free, as the kubelet gives none of its devices. Pure: the plugin computes
and patches, the extender parses; neither is done here. A text that is not such a list is refused
with a sentence saying what is wrong, never half read.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gemtrace.kube.shares import GPU_MEMORY, GPU_UTIL, GiB
from gemtrace.run.placement import Room

ANNOTATION_GPU_ROOM = "gemtrace.io/gpu-room"
# The most GPUs a node's annotation may list: more is no node's but a mistake or a forgery, and would
# cost the extender time on every pod.
MAX_GPUS = 1024

_FIELDS = {"index": "index", "uuid": "uuid", "name": "name", "memory": "memoryGiB", "memory_free": "memoryFreeGiB",
           "util_free": "utilFreePercent"}


@dataclass(frozen=True)
class GpuRoom:
    """One GPU of a node: its NVML index and name, its memory in GiB, and the GiB and percent free."""

    index: int
    uuid: str
    name: str
    memory: int
    memory_free: int
    util_free: int

    @property
    def room(self) -> Room:
        return Room(self.uuid, self.name, self.memory_free, self.util_free)


def node_rooms(gpus: Sequence[tuple[str, int]], names: Mapping[str, str], healthy: Collection[str],
               advertised: Mapping[str, Sequence[tuple[str, str]]], held: Collection[str]) -> list[GpuRoom]:
    """Each GPU's room: `gpus` (uuid, memory bytes) in index order, `names` their NVML names,
    `advertised` each resource's (device, GPU) advertised now, `held` the devices containers hold
    or are being given."""
    free: dict[str, dict[str, int]] = {resource: {} for resource in (GPU_MEMORY, GPU_UTIL)}
    for resource, devices in advertised.items():
        for device, gpu in devices:
            if device not in held:
                free[resource][gpu] = free[resource].get(gpu, 0) + 1
    return [GpuRoom(index, uuid, names.get(uuid, ""), memory // GiB,
                    free[GPU_MEMORY].get(uuid, 0) if uuid in healthy else 0,
                    free[GPU_UTIL].get(uuid, 0) if uuid in healthy else 0)
            for index, (uuid, memory) in enumerate(gpus)]


def room_text(rooms: Sequence[GpuRoom]) -> str:
    """The annotation's value: compact JSON, the same text for the same rooms."""
    return json.dumps([{key: getattr(r, attr) for attr, key in _FIELDS.items()} for r in rooms],
                      separators=(",", ":"))


def parse_rooms(text: Any) -> list[GpuRoom]:
    """The rooms an annotation's value says; ValueError, a sentence, for anything else."""
    if not isinstance(text, str):
        raise ValueError(f"annotation {ANNOTATION_GPU_ROOM} is a {type(text).__name__}, not a string")
    try:
        document = json.loads(text)
    except RecursionError:
        raise ValueError(f"annotation {ANNOTATION_GPU_ROOM} is nested too deeply") from None
    except ValueError as e:
        raise ValueError(f"annotation {ANNOTATION_GPU_ROOM} is not JSON ({e})") from None
    if not isinstance(document, list) or len(document) > MAX_GPUS:
        raise ValueError(f"annotation {ANNOTATION_GPU_ROOM} is not a list of at most {MAX_GPUS} GPUs")
    rooms = []
    for i, entry in enumerate(document):
        if not isinstance(entry, dict):
            raise ValueError(f"annotation {ANNOTATION_GPU_ROOM}: entry {i} is not an object")
        values: dict[str, Any] = {}
        for attr, key in _FIELDS.items():
            value = entry.get(key)
            text = attr in ("uuid", "name")
            # bool is an int to Python, not a count to anyone
            if not (isinstance(value, str) if text else
                    isinstance(value, int) and not isinstance(value, bool) and value >= 0):
                kind = "a string" if text else "a whole number, 0 or more"
                shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
                raise ValueError(f"annotation {ANNOTATION_GPU_ROOM}: entry {i}'s {key} is {shown}, not {kind}")
            values[attr] = value
        rooms.append(GpuRoom(**values))
    return rooms

