"""A process's pod and container, read from its cgroup path, and a pod's cgroup path from its UID.

The kubelet puts every container in a cgroup under its pod's, both named after their IDs:

    cgroupfs driver   /kubepods[/burstable|/besteffort]/pod<uid>/<container id>
    systemd driver    /kubepods.slice[/kubepods-<qos>.slice]/kubepods[-<qos>]-pod<uid, _ for ->.slice/
                          cri-containerd-<container id>.scope (or docker-, crio-)

Pure parsers over the path, plus `pod_cgroup`, which looks for a pod's directory under a cgroup
root (its only reads). Never talks to the kubelet: names for the UIDs come from the device plugin.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

_UID = r"[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}"
_POD = re.compile(rf"(?:^|/|-)pod({_UID})(?:\.slice)?$")
_CONTAINER = re.compile(r"^(?:(?:cri-containerd|docker|crio)-)?([0-9a-f]{64})(?:\.scope)?$")
QOS_PARENTS = ("", "burstable", "besteffort")


@dataclass(frozen=True)
class PodRef:
    pod_uid: str
    container_id: str  # "" for a process in the pod's cgroup itself (the sandbox)
    pod_cgroup: str  # the pod's cgroup path, as /proc/PID/cgroup shows it


def parse_cgroup_path(path: str) -> PodRef | None:
    """The pod of a cgroup path under kubepods, or None for any other path."""
    if "kubepods" not in path:
        return None
    parts = path.rstrip("/").split("/")
    for i, part in enumerate(parts):
        pod = _POD.search(part)
        if pod:
            container = _CONTAINER.match(parts[i + 1]) if i + 1 < len(parts) else None
            return PodRef(pod.group(1).replace("_", "-"), container.group(1) if container else "",
                          "/".join(parts[: i + 1]))
    return None


def pod_of(cgroups: Sequence[str]) -> PodRef | None:
    """The pod of a process given its cgroup paths (gemtrace.groups_of.parse_cgroup's)."""
    for path in cgroups:
        ref = parse_cgroup_path(path)
        if ref:
            return ref
    return None


def pod_cgroup(uid: str, root: Path = Path("/sys/fs/cgroup")) -> str | None:
    """The pod's cgroup path (as /proc/PID/cgroup shows it) if its directory exists under `root`
    (cgroup v2), or under one of v1's hierarchies there; None until the kubelet has made it."""
    underscored = uid.replace("-", "_")
    candidates = []
    for qos in QOS_PARENTS:
        candidates.append(f"/kubepods/{qos}/pod{uid}" if qos else f"/kubepods/pod{uid}")
        candidates.append(f"/kubepods.slice/kubepods-{qos}.slice/kubepods-{qos}-pod{underscored}.slice" if qos
                          else f"/kubepods.slice/kubepods-pod{underscored}.slice")
    hierarchies = [root] + [root / name for name in ("pids", "memory", "cpu,cpuacct", "systemd")]
    for path in candidates:
        if any((h / path.lstrip("/")).is_dir() for h in hierarchies):
            return path
    return None
