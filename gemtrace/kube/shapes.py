"""Kubernetes objects' JSON read without trusting its shape: the pods that admission reviews carry
(gemtrace.kube.webhook) and the pods and nodes that kube-scheduler sends its extender
(gemtrace.kube.extender), any field of which may be of another type than Kubernetes gives it.

Pure. A field of the wrong type raises ShapeError naming it (`spec.containers[0].resources is a list,
not an object`), never a KeyError or TypeError; an absent field reads as empty.
"""

from __future__ import annotations

from typing import Any

from gemtrace.kube.shares import GPU_MEMORY, GPU_UTIL

Json = dict[str, Any]


class ShapeError(ValueError):
    """A field that is not of the type Kubernetes gives it; str() names it."""


def mapping(value: Any, where: str) -> Json:
    """`value`, an object (None: empty)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ShapeError(f"{where} is a {type(value).__name__}, not an object")
    return value


def object_list(value: Any, where: str) -> list[Json]:
    """`value`, a list of objects (None: empty)."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise ShapeError(f"{where} is not a list of objects")
    return value


def share_limits(spec: Json, where: str = "spec") -> list[tuple[bool, Any, dict[str, int]]]:
    """(whether an init container, its name, its whole numbers of gemtrace.io/gpu-memory and gpu-util)
    for each container of the pod `spec` (at `where`) that asks either, init containers first: its
    limits, else its requests (an extended resource's are equal)."""
    out = []
    for kind in ("initContainers", "containers"):
        for i, container in enumerate(object_list(spec.get(kind), f"{where}.{kind}")):
            resources = mapping(container.get("resources"), f"{where}.{kind}[{i}].resources")
            asked = {**mapping(resources.get("requests"), f"{where}.{kind}[{i}].resources.requests"),
                     **mapping(resources.get("limits"), f"{where}.{kind}[{i}].resources.limits")}
            ours = {k: int(v) for k, v in asked.items()
                    if k in (GPU_MEMORY, GPU_UTIL) and isinstance(v, (str, int)) and str(v).isdigit()}
            if ours:
                out.append((kind == "initContainers", container.get("name", f"#{i}"), ours))
    return out
