"""A process's pod and container, read from its cgroup path, and a pod's cgroup path from its UID.

The kubelet puts every container in a cgroup under its pod's, both named after their IDs:

    cgroupfs driver   /kubepods[/burstable|/besteffort]/pod<uid>/<container id>
    systemd driver    /kubepods.slice[/kubepods-<qos>.slice]/kubepods[-<qos>]-pod<uid, _ for ->.slice/
                          cri-containerd-<container id>.scope (or docker-, crio-)

Pure parsers over the path, plus `pod_cgroup`, which looks for a pod's directory under a cgroup
root. Never talks to the kubelet: names for the UIDs come from the device plugin, which writes them
(from the apiserver) to NAMES_FILE; the agent's `PodLabels` reads that file and /proc/PID/cgroup.
The other way, the agent writes the drop-ins it left out, and why, to REFUSED_FILE beside it, so
that the plugin can tell each pod (an event) and stop waiting for a group that will not come.
"""

from __future__ import annotations

import json
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


# --- names: what the device plugin knows of the pods, for the agent's labels -----------------------

NAMES_FILE = Path("/var/lib/gemtrace/kube/pods.json")  # host-only: containers cannot write it
Labels = tuple[str, str, str]  # (namespace, pod, container); empty strings outside any pod
NO_POD: Labels = ("", "", "")


@dataclass(frozen=True)
class Names:
    """pod UID -> (namespace, pod, {container ID: container name}); group -> its pod's labels."""

    pods: dict[str, tuple[str, str, dict[str, str]]]
    groups: dict[str, Labels]

    def to_json(self) -> str:
        return json.dumps({"pods": {uid: {"namespace": ns, "pod": pod, "containers": containers}
                                    for uid, (ns, pod, containers) in sorted(self.pods.items())},
                           "groups": {g: list(labels) for g, labels in sorted(self.groups.items())}}, indent=1)

    @classmethod
    def parse(cls, text: str) -> Names:
        data = json.loads(text)
        pods = {uid: (p["namespace"], p["pod"], dict(p["containers"])) for uid, p in data.get("pods", {}).items()}
        groups: dict[str, Labels] = {g: (v[0], v[1], v[2]) for g, v in data.get("groups", {}).items()}
        return cls(pods, groups)

    def of(self, ref: PodRef | None) -> Labels:
        if ref is None or ref.pod_uid not in self.pods:
            return NO_POD
        namespace, pod, containers = self.pods[ref.pod_uid]
        return (namespace, pod, containers.get(ref.container_id, ""))


def write_names(path: Path, names: Names) -> bool:
    """The names file, if its text changed (atomically); True when written."""
    return _write_if_changed(path, names.to_json())


# --- refusals: the drop-ins the agent left out, for the plugin -------------------------------------

REFUSED_FILE = NAMES_FILE.with_name("refused.json")  # host-only, as the names file


def refused_file(names_file: Path) -> Path:
    """Where the refusals are, beside the names file (both follow --pod-names)."""
    return names_file.with_name(REFUSED_FILE.name)


def write_refusals(path: Path, refused: dict[str, str]) -> bool:
    """drop-in file name -> reason (gemtrace.config.Refusal), if changed; True when written. Nothing is
    written while there is nothing to say and no file yet: a host without pods gets no file."""
    if not refused and not path.exists():
        return False
    return _write_if_changed(path, json.dumps({"refused": dict(sorted(refused.items()))}, indent=1))


def read_refusals(path: Path) -> dict[str, str]:
    """What write_refusals wrote; {} without a file or with one that cannot be read."""
    try:
        data = json.loads(path.read_text())
        return {str(k): str(v) for k, v in data["refused"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def _write_if_changed(path: Path, text: str) -> bool:
    try:
        if path.read_text() == text:
            return False
    except (FileNotFoundError, UnicodeDecodeError):
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text)
    temporary.replace(path)
    return True


class PodLabels:
    """The agent's side: namespace, pod and container of each process (by its cgroup) and group (by
    the plugin's names file). `refresh` reads /proc for pids not seen before; the lookups only read
    what refresh left. Without the file (no Kubernetes) every label is empty."""

    def __init__(self, names_file: Path = NAMES_FILE, proc_root: Path = Path("/proc")) -> None:
        self.names_file = names_file
        self.proc_root = proc_root
        self._refs: dict[int, PodRef | None] = {}
        self._names = Names({}, {})
        self._stamp: tuple[int, int] | None = None

    def refresh(self, pids: Sequence[int]) -> None:
        try:
            st = self.names_file.stat()
            stamp: tuple[int, int] | None = (st.st_ino, st.st_mtime_ns)
        except OSError:
            stamp = None
        if stamp != self._stamp:
            self._stamp = stamp
            try:
                self._names = Names.parse(self.names_file.read_text()) if stamp else Names({}, {})
            except (OSError, ValueError, KeyError, TypeError, IndexError):
                self._names = Names({}, {})
        refs = {}
        for pid in pids:
            if pid in self._refs:
                refs[pid] = self._refs[pid]
                continue
            try:
                text = (self.proc_root / str(pid) / "cgroup").read_text()
            except OSError:
                refs[pid] = None
                continue
            paths = [line.split(":", 2)[2] for line in text.splitlines() if line.count(":") >= 2]
            refs[pid] = pod_of(paths)
        self._refs = refs

    def process(self, pid: int, group: str) -> Labels:
        """By the process's cgroup; else its group's pod (a process that a pod's group holds is that
        pod's, wherever its cgroup is)."""
        labels, of_group = self._names.of(self._refs.get(pid)), self.group(group)
        if labels == NO_POD:
            return of_group
        if not labels[2] and labels[:2] == of_group[:2]:  # the container not named yet: its group's
            return of_group
        return labels

    def group(self, group: str) -> Labels:
        return self._names.groups.get(group, NO_POD)
