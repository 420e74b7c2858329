"""The apiserver: the pods of this node, for what PodResources does not say of them, and events on them.

PodResources names a container's pod but not its UID (the pod's cgroup path is made of it) nor its
annotations (`gemtrace.io/max-util`), nor whether it has ended. One GET of the node's pods per
reconciliation gives all three. The credentials: a kubeconfig (its current context; certificate and
key files or data, or a token), or inside a pod its service account. Optional: without it the plugin
writes no Cgroup rule, takes MaxUtil from the util request alone and tells the pods nothing. The
writes: an Event on a pod whose grant the agent refused, and its node's annotation of each GPU's room
(gemtrace.kube.rooms); deploy/rbac.yaml allows events create and nodes patch.
"""

from __future__ import annotations

import base64
import datetime
import json
import os
import ssl
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gemtrace.kube.grants import PodInfo

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
TIMEOUT_S = 10.0


class ApiError(Exception):
    """The apiserver could not be asked or refused; str() says which and what to do."""


class Conflict(ApiError):
    """409: the object changed since it was read."""


class NotFound(ApiError):
    """404: no such object."""


@dataclass
class Apiserver:
    server: str
    context: ssl.SSLContext
    token: str | None = None

    @classmethod
    def in_cluster(cls) -> Apiserver:
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT")
        if not host or not port:
            raise ApiError("not in a pod (no KUBERNETES_SERVICE_HOST): give --kubeconfig")
        context = ssl.create_default_context(cafile=str(SERVICE_ACCOUNT / "ca.crt"))
        return cls(f"https://{host}:{port}", context, (SERVICE_ACCOUNT / "token").read_text().strip())

    @classmethod
    def from_kubeconfig(cls, path: Path) -> Apiserver:
        import yaml

        try:
            config: dict[str, Any] = yaml.safe_load(path.read_text())
            current = config.get("current-context")
            context = next(c["context"] for c in config["contexts"] if c["name"] == current)
            cluster = next(c["cluster"] for c in config["clusters"] if c["name"] == context["cluster"])
            user = next(u["user"] for u in config["users"] if u["name"] == context["user"])
        except (OSError, yaml.YAMLError, KeyError, StopIteration, TypeError) as e:
            raise ApiError(f"{path}: not a usable kubeconfig ({e}); give the node's kubeconfig") from None
        base = path.parent
        ssl_context = ssl.create_default_context()
        if "certificate-authority-data" in cluster:
            ssl_context.load_verify_locations(cadata=base64.b64decode(cluster["certificate-authority-data"]).decode())
        elif "certificate-authority" in cluster:
            ssl_context.load_verify_locations(cafile=str(base / cluster["certificate-authority"]))
        cert, key = _pem(base, user, "client-certificate"), _pem(base, user, "client-key")
        if cert and key:
            ssl_context.load_cert_chain(cert, key)
        return cls(cluster["server"].rstrip("/"), ssl_context, user.get("token"))

    def get(self, path: str, **query: str) -> dict[str, Any]:
        return self.call("GET", path + ("?" + urllib.parse.urlencode(query) if query else ""))

    def call(self, method: str, path: str, body: Any = None,
             content_type: str = "application/json") -> dict[str, Any]:
        """One request; ApiError says what failed (Conflict for 409, NotFound for 404)."""
        url = self.server + path
        request = urllib.request.Request(url, method=method, headers={"Accept": "application/json"},
                                         data=None if body is None else json.dumps(body).encode())
        if body is not None:
            request.add_header("Content-Type", content_type)
        if self.token:
            request.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_S, context=self.context) as response:
                result: dict[str, Any] = json.load(response)
                return result
        except urllib.error.HTTPError as e:
            detail = e.read(2000).decode(errors="replace")
            error = {409: Conflict, 404: NotFound}.get(e.code, ApiError)
            raise error(f"{method} {url}: {e.code} {detail}") from None
        except OSError as e:
            raise ApiError(f"{method} {url}: {e}") from None

    def pods_of_node(self, node: str) -> dict[tuple[str, str], PodInfo]:
        """(namespace, name) -> PodInfo of every pod bound to `node`."""
        items = self.get("/api/v1/pods", fieldSelector=f"spec.nodeName={node}")["items"]
        return {(p["metadata"]["namespace"], p["metadata"]["name"]):
                PodInfo(p["metadata"]["uid"], dict(p["metadata"].get("annotations") or {}), _containers(p),
                        (p.get("status") or {}).get("phase", ""), p["metadata"].get("creationTimestamp", ""),
                        _requests(p), _stopped(p))
                for p in items}

    def annotate_node(self, node: str, key: str, value: str | None) -> None:
        """Set one annotation of the node, or remove it given None (a JSON merge patch: its other
        annotations stay); raises ApiError."""
        self.call("PATCH", f"/api/v1/nodes/{urllib.parse.quote(node)}", {"metadata": {"annotations": {key: value}}},
                  content_type="application/merge-patch+json")

    def pod_event(self, namespace: str, pod: str, uid: str, reason: str, message: str, node: str) -> None:
        """A Warning event on the pod (`kubectl describe pod` shows it); raises ApiError."""
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        self.call("POST", f"/api/v1/namespaces/{urllib.parse.quote(namespace)}/events", event_body(
            namespace, pod, uid, reason, message, node, now))


def event_body(namespace: str, pod: str, uid: str, reason: str, message: str, node: str, now: str) -> dict[str, Any]:
    """A core/v1 Event on a pod, as the kubelet's own are made (pure)."""
    return {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"generateName": f"{pod}.", "namespace": namespace},
        "involvedObject": {"apiVersion": "v1", "kind": "Pod", "namespace": namespace, "name": pod, "uid": uid},
        "reason": reason, "message": message, "type": "Warning", "count": 1,
        "firstTimestamp": now, "lastTimestamp": now,
        "source": {"component": "gemtrace-kube-plugin", "host": node},
    }


def _stopped(pod: dict[str, Any]) -> bool:
    """Deleted with every container stopped (its phase may still say Running): nothing of it runs any more."""
    containers = (pod.get("status") or {}).get("containerStatuses") or []
    return bool(pod["metadata"].get("deletionTimestamp")) and bool(containers) and all(
        "terminated" in (c.get("state") or {}) for c in containers)


def _requests(pod: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Container name -> its gemtrace.io resources' limits (an extended resource's request is its
    limit), init containers first, as the kubelet allocates them."""
    spec = pod.get("spec") or {}
    out = {}
    for c in (spec.get("initContainers") or []) + (spec.get("containers") or []):
        resources = c.get("resources") or {}
        asked = {**(resources.get("requests") or {}), **(resources.get("limits") or {})}
        ours = {k: int(v) for k, v in asked.items() if k.startswith("gemtrace.io/") and str(v).isdigit()}
        if ours:
            out[c["name"]] = ours
    return out


def _containers(pod: dict[str, Any]) -> dict[str, str]:
    """Container ID (without its runtime's `containerd://`) -> name, of the containers started so far."""
    status = pod.get("status") or {}
    return {c["containerID"].split("://", 1)[-1]: c["name"]
            for c in (status.get("containerStatuses") or []) + (status.get("initContainerStatuses") or [])
            if c.get("containerID")}


def _pem(base: Path, user: dict[str, Any], key: str) -> str | None:
    """A kubeconfig's certificate or key as a file path (its -data written to a private file)."""
    if key in user:
        return str(base / user[key])
    data = user.get(key + "-data")
    if not data:
        return None
    fd, name = tempfile.mkstemp(prefix="gemtrace-kube-", suffix=".pem")
    with os.fdopen(fd, "wb") as f:
        f.write(base64.b64decode(data))
    return name
