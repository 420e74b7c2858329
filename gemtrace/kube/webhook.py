"""`gemtrace kube-webhook`: a mutating admission webhook that gates the pods labelled with a group.

For clusters that keep another device plugin (`nvidia.com/gpu`): a pod labelled
`gemtrace.io/group=NAME` gets the gate (gemtrace.kube.injection: hostPath volumes for the gate, the
state dir and /etc/ld.so.preload, mounted in every container) and GEMTRACE_GROUP=NAME, so its
processes join group NAME of the node's resource file. Any other pod gets no patch at all. A label
that is no group name is refused with a message saying so (admitted ungated, the pod would run
without the quotas its owner asked for).

`review` is pure (AdmissionReview in, AdmissionReview out); `serve` is the HTTPS server around it.
"""

from __future__ import annotations

import base64
import json
import ssl
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import structlog

from gemtrace.config import _GROUP_NAME
from gemtrace.kube.injection import Injection
from gemtrace.kube.shares import LABEL_GROUP

log = structlog.get_logger("gemtrace.kube.webhook")

Json = dict[str, Any]


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def patch_for(pod: Json, injection: Injection) -> list[Json] | None:
    """The JSON patch that gates `pod`, None for a pod without the label. ValueError: a bad label."""
    group = (pod.get("metadata", {}).get("labels") or {}).get(LABEL_GROUP)
    if group is None:
        return None
    if not _GROUP_NAME.fullmatch(group):
        raise ValueError(f"label {LABEL_GROUP}={group!r} is not a group name (1 to 63 letters, digits or _.:@+-); "
                         "name a group of the nodes' resource file")
    spec = pod.get("spec", {})
    patch: list[Json] = []
    mounts = injection.mounts()
    volumes = [{"name": m.name, "hostPath": {"path": str(m.host_path),
                                             "type": "Directory" if m.name == "gemtrace-state" else "File"}}
               for m in mounts]
    if "volumes" in spec:
        patch += [{"op": "add", "path": "/spec/volumes/-", "value": v} for v in volumes]
    else:
        patch.append({"op": "add", "path": "/spec/volumes", "value": volumes})
    env = [{"name": k, "value": v} for k, v in injection.env(group).items()]
    for kind in ("initContainers", "containers"):
        for i, container in enumerate(spec.get(kind) or []):
            base = f"/spec/{kind}/{i}"
            volume_mounts = [{"name": m.name, "mountPath": str(m.container_path), "readOnly": m.read_only}
                             for m in mounts]
            if "volumeMounts" in container:
                patch += [{"op": "add", "path": f"{base}/volumeMounts/-", "value": v} for v in volume_mounts]
            else:
                patch.append({"op": "add", "path": f"{base}/volumeMounts", "value": volume_mounts})
            names = {e.get("name") for e in container.get("env") or []}
            ours = [e for e in env if e["name"] not in names]  # the pod's own settings win
            if "env" in container:
                patch += [{"op": "add", "path": f"{base}/env/-", "value": e} for e in ours]
            elif ours:
                patch.append({"op": "add", "path": f"{base}/env", "value": ours})
    return patch


def review(request_review: Json, injection: Injection) -> Json:
    """The AdmissionReview response to an AdmissionReview request (admission.k8s.io/v1)."""
    request = request_review.get("request", {})
    response: Json = {"uid": request.get("uid", ""), "allowed": True}
    pod = request.get("object") or {}
    try:
        patch = patch_for(pod, injection)
    except ValueError as e:
        response.update(allowed=False, status={"code": 400, "message": str(e)})
        patch = None
    if patch:
        response.update(patchType="JSONPatch", patch=base64.b64encode(json.dumps(patch).encode()).decode())
        log.info("pod_gated", namespace=request.get("namespace"), name=pod.get("metadata", {}).get("name")
                 or pod.get("metadata", {}).get("generateName"), group=pod["metadata"]["labels"][LABEL_GROUP])
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response}


def server(listen: str, cert: Path, key: Path, injection: Injection) -> ThreadingHTTPServer:
    """The HTTPS server, bound and not yet serving (serve_forever it)."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
                answer = json.dumps(review(body, injection)).encode()
                status = 200
            except (ValueError, KeyError, TypeError) as e:
                answer, status = f"not an AdmissionReview: {e}".encode(), 400
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, format: str, *args: object) -> None:
            pass

    host, _, port = listen.rpartition(":")
    httpd = ThreadingHTTPServer((host or "0.0.0.0", int(port)), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
    return httpd


def serve(listen: str, cert: Path, key: Path, injection: Injection) -> None:
    httpd = server(listen, cert, key, injection)
    log.info("webhook_listening", listen=listen)
    httpd.serve_forever()
