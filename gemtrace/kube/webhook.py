"""`gemtrace kube-webhook`: the admission webhook that gates the pods labelled with a group and
checks the settings pods give gemtrace.

For clusters that keep another device plugin (`nvidia.com/gpu`): a pod labelled
`gemtrace.io/group=NAME` gets the gate (gemtrace.kube.injection: hostPath volumes for the gate, the
state dir and /etc/ld.so.preload, mounted in every container) and GEMTRACE_GROUP=NAME, so its
processes join group NAME of the node's resource file. Any other pod gets no patch at all. A label
that is no group name, or names no group of the resource file the webhook reads (--config, the
nodes'), or names a pod's own group (`k8s-`), is refused with a message saying so (admitted, the pod
would run without the quotas its owner asked for). So is a pod whose annotations
(`gemtrace.io/max-util`, `priority`, `isolation`, `oversubscribe`: gemtrace.kube.shares) the resource
file would refuse, or whose `gemtrace.io/gpus` and `gpu-model` no node could place
(shares.request_of): refused at admission rather than by the kubelet of the node it lands on. On
/validate it only checks (a validating webhook for every pod, labelled or not); on any other path it
also patches.

`review` is pure (AdmissionReview in, AdmissionReview out); `serve` is the HTTPS server around it
(gemtrace.httpd: slow and idle connections hold no worker, every step has a deadline). Every request
gets an HTTP answer: a review whose pod cannot be read is refused (`allowed: false`, the reason, its
uid kept); a body that is no review at all (not JSON, not an object, no request with a uid, the wrong
Content-Type) gets 400.
"""

from __future__ import annotations

import base64
import json
import signal
import ssl
import threading
from collections.abc import Callable, Container
from pathlib import Path
from typing import Any

import structlog

from gemtrace import httpd
from gemtrace.config import _GROUP_NAME, ConfigError, load
from gemtrace.kube.apiserver import ApiError
from gemtrace.kube.injection import Injection
from gemtrace.kube.servingcert import Keeper
from gemtrace.kube.shapes import Json, ShapeError, mapping, object_list, share_limits
from gemtrace.kube.shares import GROUP_PREFIX, LABEL_GROUP, pod_settings, request_of
from gemtrace.signals import SignalInbox

log = structlog.get_logger("gemtrace.kube.webhook")

Groups = Callable[[], Container[str]]  # the groups a label may name; BadPod when they cannot be known

API_VERSION = "admission.k8s.io/v1"
# The API server sends a pod's review in one JSON document; its objects are at most 1.5 MiB in etcd,
# and the review carries the pod twice at most (object, oldObject).
LIMITS = httpd.Limits(body_bytes=4 << 20, workers=4)
RETRY_S = 2.0  # between first tries to get the certificate from the apiserver


class NotAReview(ValueError):
    """A body that is not an AdmissionReview at all: answered 400, as there is no uid to answer."""


class BadPod(ShapeError):
    """A review whose pod cannot be read or admitted: refused (allowed: false) with this message (as a
    pod whose fields are not of their types: ShapeError)."""


def resource_groups(path: Path) -> Groups:
    """The groups of the resource file at `path` (with its drop-ins, less the pods' own), read at
    each review: a file changed on the nodes is followed at once."""
    def groups() -> Container[str]:
        try:
            config = load(path)
        except (OSError, ConfigError) as e:
            raise BadPod(f"the webhook cannot read its resource file to check the label {LABEL_GROUP} ({e}); "
                         "mount the nodes' resource file at its --config") from None
        return {name for name in config.groups if not name.startswith(GROUP_PREFIX)}
    return groups


def check_pod(pod: Json) -> None:
    """BadPod for annotations that the resource file would refuse in the pod's groups, or a request
    that no node could place (gemtrace.io/gpus that its shares do not split over, a model that is no
    name)."""
    metadata = mapping(pod.get("metadata"), "metadata")
    annotations = mapping(metadata.get("annotations"), "metadata.annotations")
    try:
        # A pod that asks none of the shares still has its gemtrace.io/gpus and gpu-model read.
        requests = [request_of(limits, annotations)
                    for _, _, limits in share_limits(mapping(pod.get("spec"), "spec")) or [(False, "", {})]]
        # Oversubscribe is per GPU, as the group's MemoryLimit is: a container's memory on each of its GPUs.
        pod_settings(annotations, max(r.memory for r in requests))
    except ValueError as e:
        raise BadPod(str(e)) from None


def patch_for(pod: Json, injection: Injection, groups: Groups) -> list[Json] | None:
    """The JSON patch that gates `pod`, None for a pod without the label. ValueError (BadPod): a bad
    label, or a pod whose shape is not a pod's."""
    metadata = mapping(pod.get("metadata"), "metadata")
    group = mapping(metadata.get("labels"), "metadata.labels").get(LABEL_GROUP)
    if group is None:
        return None
    if not isinstance(group, str) or not _GROUP_NAME.fullmatch(group):
        raise BadPod(f"label {LABEL_GROUP}={group!r} is not a group name (1 to 63 letters, digits or _.:@+-); "
                     "name a group of the nodes' resource file")
    if group.startswith(GROUP_PREFIX):
        raise BadPod(f"label {LABEL_GROUP}={group} names a pod's own group ({GROUP_PREFIX}...); name a group of "
                     "the nodes' resource file")
    if group not in groups():
        raise BadPod(f"label {LABEL_GROUP}={group} names no group of the nodes' resource file; name one it "
                     "defines, or have the operator add [" + group + "]")
    spec = mapping(pod.get("spec"), "spec")
    patch: list[Json] = []
    mounts = injection.mounts()
    volumes = [{"name": m.name, "hostPath": {"path": str(m.host_path),
                                             "type": "Directory" if m.name == "gemtrace-state" else "File"}}
               for m in mounts]
    if "volumes" in spec:
        object_list(spec["volumes"], "spec.volumes")
        patch += [{"op": "add", "path": "/spec/volumes/-", "value": v} for v in volumes]
    else:
        patch.append({"op": "add", "path": "/spec/volumes", "value": volumes})
    env = [{"name": k, "value": v} for k, v in injection.env(group).items()]
    for kind in ("initContainers", "containers"):
        for i, container in enumerate(object_list(spec.get(kind), f"spec.{kind}")):
            base = f"/spec/{kind}/{i}"
            volume_mounts = [{"name": m.name, "mountPath": str(m.container_path), "readOnly": m.read_only}
                             for m in mounts]
            if "volumeMounts" in container:
                object_list(container["volumeMounts"], f"spec.{kind}[{i}].volumeMounts")
                patch += [{"op": "add", "path": f"{base}/volumeMounts/-", "value": v} for v in volume_mounts]
            else:
                patch.append({"op": "add", "path": f"{base}/volumeMounts", "value": volume_mounts})
            names = {e.get("name") for e in object_list(container.get("env"), f"spec.{kind}[{i}].env")}
            ours = [e for e in env if e["name"] not in names]  # the pod's own settings win
            if "env" in container:
                patch += [{"op": "add", "path": f"{base}/env/-", "value": e} for e in ours]
            elif ours:
                patch.append({"op": "add", "path": f"{base}/env", "value": ours})
    return patch


def review(request_review: Any, injection: Injection, groups: Groups, mutate: bool = True) -> Json:
    """The AdmissionReview response to an AdmissionReview request (admission.k8s.io/v1): the pod
    checked and, with `mutate`, patched. NotAReview for a document that is none: not an object, or
    without a request that has a uid to answer."""
    if not isinstance(request_review, dict):
        raise NotAReview(f"the body is a JSON {type(request_review).__name__}, not an AdmissionReview object")
    if request_review.get("kind", "AdmissionReview") != "AdmissionReview":
        raise NotAReview(f"kind {request_review.get('kind')!r} is not AdmissionReview")
    request = request_review.get("request")
    if not isinstance(request, dict) or not isinstance(request.get("uid"), str):
        raise NotAReview("an AdmissionReview's request must be an object with a uid")
    response: Json = {"uid": request["uid"], "allowed": True}
    try:
        pod = mapping(request.get("object"), "request.object")
        check_pod(pod)
        patch = patch_for(pod, injection, groups) if mutate else None
    except ShapeError as e:  # BadPod too
        response.update(allowed=False, status={"code": 400, "message": str(e)})
        patch = None
    if patch:
        response.update(patchType="JSONPatch", patch=base64.b64encode(json.dumps(patch).encode()).decode())
        metadata = pod.get("metadata") or {}
        name = metadata.get("name") or metadata.get("generateName")
        namespace = request.get("namespace")
        # Only strings reach the log: a review's other values are the sender's, of any size or shape.
        log.info("pod_gated", namespace=namespace if isinstance(namespace, str) else None,
                 name=name if isinstance(name, str) else None, group=metadata["labels"][LABEL_GROUP])
    return {"apiVersion": API_VERSION, "kind": "AdmissionReview", "response": response}


def _handler(injection: Injection, groups: Groups) -> type[httpd.Handler]:
    class ReviewHandler(httpd.Handler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            try:
                document = httpd.json_body(self.headers.get("Content-Type"), body, "an AdmissionReview")
                mutate = self.path.partition("?")[0] != "/validate"
                answer, status = json.dumps(review(document, injection, groups, mutate)).encode(), 200
                content_type = "application/json"
            except (NotAReview, httpd.NotJson) as e:
                answer, status = f"not an AdmissionReview: {e}\n".encode(), 400
                content_type = "text/plain; charset=utf-8"
            self.reply(status, answer, content_type)

    return ReviewHandler


def server(listen: str, cert: Path, key: Path, injection: Injection, groups: Groups) -> httpd.Server:
    """The HTTPS server, bound and not yet serving (start it)."""
    host, _, port = listen.rpartition(":")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    sock = httpd.listening_socket(host.strip("[]") or "0.0.0.0", int(port))
    return httpd.Server(sock, _handler(injection, groups), context, LIMITS, name="gemtrace-webhook")


def serve(listen: str, cert: Path, key: Path, injection: Injection, groups: Groups,
          keeper: Keeper | None = None) -> None:
    """Serve until SIGTERM or SIGINT. With a `keeper`, the certificate is its Secret's, written to
    `cert` and `key` before serving and loaded again whenever it renews it."""
    signals = SignalInbox((signal.SIGTERM, signal.SIGINT))
    stop = threading.Event()
    if keeper is not None:
        # Not serving before the certificate is there: the Deployment's other replica may serve meanwhile.
        while True:
            try:
                keeper.check()
                break
            except (ApiError, ValueError, OSError) as e:
                log.warning("webhook_certificate_check_failed", error=str(e))
            if signals.wait(RETRY_S):
                return
    httpd_server = server(listen, cert, key, injection, groups)
    if keeper is not None:
        context = httpd_server.tls
        assert context is not None
        keeper.on_change = lambda: context.load_cert_chain(cert, key)  # new connections get the new one
        threading.Thread(target=keeper.run, args=(stop,), name="gemtrace-webhook-cert", daemon=True).start()
    httpd_server.start()
    log.info("webhook_listening", listen=listen)
    try:
        while not signals.wait(60.0):
            pass
    finally:
        stop.set()
        httpd_server.stop()
