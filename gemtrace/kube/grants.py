"""The pods' groups: one drop-in resource file per container that holds GPU shares.

Owns the files `k8s-*.conf` in the resource file's drop-in directory (gemtrace.config.dropin_dir),
and nothing else there. Allocate writes a container's file at once, before its processes start
(named by its devices: the kubelet does not say whose they are yet); `reconcile` then completes and
prunes the files from the kubelet's PodResources list, which names the pod and the container behind
each device: its util share, its MaxUtil annotation, its cgroup. The list is the one truth: on start,
after a kubelet restart, or after a re-registration the plugin rebuilds every file from it, and a
grant always gets the same file and group name, so nothing is counted twice and nothing is lost. A
file is written only when its text changes (each write makes the agent reload).

A grant lives exactly as long as its pod: its file goes at the first reconciliation that no longer
finds it, because the kubelet no longer lists the container or the apiserver says its pod is gone
or finished (a pod that ended stays listed until it is deleted; its MinUtil must not keep counting).
Only a file that PodResources has never listed, Allocate's before the kubelet records the container,
is given ALLOCATE_GRACE_S: no one can tell yet whose it is.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import structlog

from gemtrace.kube.kubelet import ContainerDevices
from gemtrace.kube.pods import pod_cgroup
from gemtrace.kube.shares import (
    GPU_MEMORY,
    GPU_UTIL,
    GROUP_PREFIX,
    GiB,
    Grant,
    PodSettings,
    dropin_container,
    dropin_text,
    gpus_asked,
    pod_settings,
)

log = structlog.get_logger("gemtrace.kube.grants")

# A file Allocate wrote may wait this long to show up in PodResources before it is pruned: the
# kubelet lists a container's devices as soon as Allocate returns, but its list is read once a second,
# and a plugin just restarted cannot tell an Allocate of a moment ago from a pod gone while it was down.
# Such a file holds memory only (Allocate knows no util), so no MinUtil waits with it.
ALLOCATE_GRACE_S = 60.0


@dataclass(frozen=True)
class PodInfo:
    """What the apiserver says of a pod that PodResources does not."""

    uid: str
    annotations: dict[str, str] = field(default_factory=dict)
    containers: dict[str, str] = field(default_factory=dict)  # container ID -> name
    phase: str = ""
    created: str = ""  # metadata.creationTimestamp, RFC 3339 in UTC: sorts as the times do
    # container name -> gemtrace.io resource -> units, init containers first: the kubelet's order
    requests: dict[str, dict[str, int]] = field(default_factory=dict)
    stopped: bool = False  # deleted with every container stopped

    @property
    def finished(self) -> bool:
        """Ended (Succeeded, Failed), or deleted with every container stopped: nothing of it runs
        any more, and its grants go."""
        return self.phase in ("Succeeded", "Failed") or self.stopped


Pods = dict[tuple[str, str], PodInfo]  # (namespace, name) -> info


class Grants:
    def __init__(self, dropin_dir: Path, cgroup_root: Path = Path("/sys/fs/cgroup"),
                 clock: Callable[[], float] = time.time) -> None:
        self.dir = dropin_dir
        self.cgroup_root = cgroup_root
        self.clock = clock
        self.writes = 0  # files written or removed so far: the agent has something to reload
        # group -> the container (namespace, pod, name) whose grant PodResources listed there: a group
        # here that the list no longer has is a pod gone
        self._container_of: dict[str, tuple[str, str, str]] = {}
        self._bad_annotations: set[str] = set()  # pod UIDs whose annotations were refused, logged once

    def path(self, group: str) -> Path:
        return self.dir / f"{group}.conf"

    def write(self, grant: Grant, keep_existing: bool = False) -> bool:
        """The grant's file, if its text changed (or, with `keep_existing`, if there is none: Allocate
        knows less of a grant than reconcile wrote); True when written."""
        path, text = self.path(grant.group), dropin_text(grant)
        try:
            current: str | None = path.read_text()
        except FileNotFoundError:
            current = None
        if current is not None and (keep_existing or current == text):
            return False
        self.dir.mkdir(parents=True, exist_ok=True)
        temporary = self.dir / f".{grant.group}.conf.tmp"  # a dot: gemtrace.config skips it
        temporary.write_text(text)
        temporary.replace(path)
        self.writes += 1
        log.info("grant_written", group=grant.group, namespace=grant.namespace, pod=grant.pod,
                 container=grant.container, path=str(path))
        if grant.split:
            log.warning("grant_split", group=grant.group, namespace=grant.namespace, pod=grant.pod,
                        util_devices=len(grant.util), gpus=grant.gpus, min_util=grant.min_util(),
                        consequence="the kubelet put its util devices on several GPUs, or on another GPU than its "
                                    "memory: its MinUtil is what it holds on each GPU it may run on")
        return True

    def owned(self) -> dict[str, Path]:
        """group -> file, for every file of ours in the directory."""
        try:
            return {p.name.removesuffix(".conf"): p for p in self.dir.iterdir()
                    if p.name.startswith(GROUP_PREFIX) and p.name.endswith(".conf")}
        except FileNotFoundError:
            return {}

    def grant_of(self, container: ContainerDevices, pods: Pods | None = None) -> Grant:
        grant = Grant(memory=container.devices.get(GPU_MEMORY, ()), util=container.devices.get(GPU_UTIL, ()),
                      namespace=container.namespace, pod=container.pod, container=container.container)
        info = (pods or {}).get((container.namespace, container.pod))
        if info is not None:
            cgroup = pod_cgroup(info.uid, self.cgroup_root) or ""
            try:
                settings = pod_settings(info.annotations, grant.memory_limit() // GiB)
            except ValueError as e:
                # The webhook refuses such a pod; one created without it gets none of its annotations
                # rather than a drop-in the agent would refuse, with every other pod's.
                settings = PodSettings()
                if info.uid not in self._bad_annotations:
                    self._bad_annotations.add(info.uid)
                    log.warning("pod_annotations_ignored", namespace=container.namespace, pod=container.pod,
                                error=str(e), consequence="its groups take the resource file's defaults; correct "
                                "the annotation and create the pod again")
            grant = replace(grant, max_util=settings.max_util, settings=settings.lines, cgroup=cgroup,
                            gpus_asked=gpus_asked(info.annotations))
        return grant

    def reconcile(self, containers: list[ContainerDevices], pods: Pods | None = None) -> dict[str, Grant]:
        """Make the files say exactly the grants of `containers` (PodResources'), completed with
        `pods` (the apiserver's) where given, less those whose pod the apiserver no longer has or
        has seen end; keeps a file never listed for ALLOCATE_GRACE_S. Returns the grants by group."""
        grants = {}
        for container in containers:
            if GPU_MEMORY not in container.devices and GPU_UTIL not in container.devices:
                continue
            if pods is not None:
                info = pods.get((container.namespace, container.pod))
                if info is None or info.finished:
                    continue  # the kubelet lists a pod a little past its end: the apiserver says it first
            grant = self.grant_of(container, pods)
            grants[grant.group] = grant
        for grant in grants.values():
            self.write(grant)
            self._container_of[grant.group] = (grant.namespace, grant.pod, grant.container)
        now = self.clock()
        # A container PodResources first listed with its util devices only (its memory's allocation
        # not yet recorded) got a grant named after them; listed whole, its grant is the memory's. The
        # first one goes at once: its MinUtil, counted twice, could take the GPU's MinUtils past 1.
        granted = {(g.namespace, g.pod, g.container): group for group, g in grants.items() if g.pod}
        owned = self.owned()
        for group, path in owned.items():
            if group in grants:
                continue
            # Listed before, by this plugin or (its file says so) by one before a restart: gone now.
            listed = self._container_of.get(group) or _listed_for(path)
            moved_to = granted.get(listed) if listed is not None else None
            if listed is None:
                try:
                    if now - os.stat(path).st_mtime < ALLOCATE_GRACE_S:
                        continue  # Allocate's, not yet listed
                except FileNotFoundError:
                    continue
            path.unlink(missing_ok=True)
            self._container_of.pop(group, None)
            self.writes += 1
            log.info("grant_removed", group=group, namespace=listed[0] if listed else "",
                     pod=listed[1] if listed else "",
                     reason=f"its container's grant is now {moved_to}" if moved_to is not None
                     else "its pod is gone" if listed is not None else "never listed by the kubelet")
        for group in self._container_of.keys() - grants.keys() - owned.keys():
            del self._container_of[group]  # its file removed by hand: nothing left to prune
        return grants


def _listed_for(path: Path) -> tuple[str, str, str] | None:
    try:
        return dropin_container(path.read_text())
    except (OSError, UnicodeDecodeError):
        return None
