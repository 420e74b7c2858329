"""`gemtrace kube-extender`: a kube-scheduler extender that checks a pod's GPU shares against each
GPU's free room, so that a pod no GPU of a node can take whole stays Pending with the reason instead
of failing at the node's admission.

The scheduler counts `gemtrace.io/gpu-memory` and `gpu-util` per node, in all: a node of two GPUs with
3 GiB free on each has room for a pod of 4 GiB by its count, and the kubelet then fails the pod
(`UnexpectedAdmissionError`: the device plugin places a container whole on each of its GPUs). Here, for
each node the scheduler found feasible, the pod's containers are placed one after another on the rooms
its device plugin publishes (gemtrace.kube.rooms: the node's annotation), each placed container's
room taken out before the next (gemtrace.run.placement.place, as the plugin places them); init
containers, which run one at a time and whose devices the kubelet hands on, each alone. A node
without the annotation passes: the node's own check stays the fallback. A node whose annotation is
no room list fails with that reason, the others are still judged.

The HTTP extender API of Kubernetes 1.20 (k8s.io/kube-scheduler/extender/v1), JSON field names as Go
writes them: POST /filter takes ExtenderArgs {Pod, Nodes (a NodeList) or NodeNames} and answers
ExtenderFilterResult {Nodes, NodeNames, FailedNodes: {node: reason}, Error}; POST /prioritize takes
the same and answers a HostPriorityList [{Host, Score}], scores 0..MAX_PRIORITY. The scheduler must
send whole nodes (`nodeCacheCapable: false`): with names only there are no annotations to read, and
every node passes. Stateless: it reads the request and nothing else (no apiserver, no credentials).

Prioritize ranks the nodes the pod fits by the GPU its first container would take there, in the
order of `--placement` (binpack: the fullest first; spread: the emptiest), as the plugin orders a
node's GPUs; equal GPUs score alike, a node without the annotation 0.

Never trusts the body: at most LIMITS.body_bytes (the server refuses more before reading it), a body
that is no ExtenderArgs is answered 400 with what is wrong, and values from it reach the log and the
answers only as short strings.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import structlog

from gemtrace import httpd
from gemtrace.kube.rooms import ANNOTATION_GPU_ROOM, GpuRoom, parse_rooms
from gemtrace.kube.shapes import Json, ShapeError, mapping, object_list, share_limits
from gemtrace.kube.shares import Request, RequestError, request_of
from gemtrace.run.placement import Packing, Room, Unplaceable, model_matches, place
from gemtrace.signals import SignalInbox

log = structlog.get_logger("gemtrace.kube.extender")

FILTER_PATH = "/filter"
PRIORITIZE_PATH = "/prioritize"
HEALTH_PATH = "/healthz"
# extenderv1.MaxExtenderPriority in Kubernetes 1.20: the scheduler multiplies an extender's score by
# its weight and by MaxNodeScore / 10.
MAX_PRIORITY = 10
# The scheduler sends every feasible node whole (status.images and managedFields make one 10-40 KB):
# 16 MiB is some 400 GPU nodes at the most. It asks one pod at a time, so one worker and a few
# connections do; a flood of connections closes the oldest waiting one (gemtrace.httpd), and the
# scheduler, finding the extender unreachable, goes on without it (ignorable: true).
LIMITS = httpd.Limits(body_bytes=16 << 20, connections=8, workers=1)
GPUS_SHOWN = 16  # of a node's GPUs in a reason; more are counted


class BadArgs(ShapeError):
    """A body that is not ExtenderArgs: answered 400 with this message (as one whose Pod or Nodes
    are not shaped as they are: ShapeError)."""


@dataclass(frozen=True)
class Asked:
    """One container's request, and whether it is an init container (run alone, before the others)."""

    container: str
    request: Request
    init: bool


def _short(value: Any, limit: int = 80) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def pod_asks(pod: Json) -> list[Asked]:
    """What each container of `pod` asks of the two resources, init containers first; ShapeError for
    a pod not shaped as one, RequestError for a request no node could place."""
    annotations = mapping(mapping(pod.get("metadata"), "Pod.metadata").get("annotations"), "Pod.metadata.annotations")
    return [Asked(_short(name), request_of(limits, annotations), init)
            for init, name, limits in share_limits(mapping(pod.get("spec"), "Pod.spec"), "Pod.spec")]


def _free(rooms: Sequence[GpuRoom]) -> str:
    shown = ", ".join(f"GPU {r.index} {r.memory_free} GiB {r.util_free}%" for r in rooms[:GPUS_SHOWN])
    more = f" and {len(rooms) - GPUS_SHOWN} more" if len(rooms) > GPUS_SHOWN else ""
    return f"free: {shown or 'no GPU'}{more}"


def _why(node: str, request: Request, rooms: Sequence[GpuRoom]) -> str:
    """Why no `request.gpus` GPUs of `rooms` take the request, in a sentence naming the node."""
    if request.model is not None and not any(model_matches(request.model, r.name) for r in rooms):
        names = _short(", ".join(sorted({r.name for r in rooms})) or "none", 200)
        return f"no GPU of {node} is a {_short(request.model)} (its GPUs: {names})"
    model = f"{_short(request.model)} " if request.model is not None else ""
    share = " and ".join([f"{request.memory} GiB"] * bool(request.memory) + [f"{request.util}%"] * bool(request.util))
    if request.gpus == 1:
        return f"no {model}GPU of {node} has {share} free ({_free(rooms)})"
    return f"fewer than {request.gpus} {model}GPUs of {node} have {share} free each ({_free(rooms)})"


@dataclass(frozen=True)
class Fit:
    """Where a pod goes on a node: the room of the GPU its first container takes, before it does
    (None: it asks no share)."""

    first: Room | None


def fit(node: str, rooms: Sequence[GpuRoom], asks: Sequence[Asked], packing: Packing) -> Fit | str:
    """The pod's place on the node's `rooms`, or why there is none (a sentence naming the node)."""
    by_uuid = {r.uuid: r for r in rooms}
    several = len(asks) > 1
    firsts: dict[bool, Room] = {}  # init or not -> the first GPU chosen
    for ask in sorted(asks, key=lambda a: not a.init):  # init containers first, each on the full rooms
        current = list(rooms) if ask.init else list(by_uuid.values())
        try:
            chosen = place([r.room for r in current], ask.request.memory, ask.request.util, ask.request.gpus,
                           ask.request.model, packing)
        except Unplaceable:
            why = _why(node, ask.request, current)
            return f"container {ask.container}: {why}" if several else why
        firsts.setdefault(ask.init, chosen[0])
        if not ask.init:
            for room in chosen:
                left = by_uuid[room.uuid]
                by_uuid[room.uuid] = replace(left, memory_free=left.memory_free - ask.request.memory,
                                             util_free=left.util_free - ask.request.util)
    return Fit(firsts.get(False) or firsts.get(True))


def _nodes(args: Json) -> tuple[list[Json] | None, list[str] | None]:
    """The candidate nodes, whole (Nodes) or by name (NodeNames)."""
    nodes = args.get("Nodes")
    if nodes is not None:
        items = object_list(mapping(nodes, "Nodes").get("items"), "Nodes.items")
        for i, node in enumerate(items):
            if not isinstance(mapping(node.get("metadata"), f"Nodes.items[{i}].metadata").get("name"), str):
                raise BadArgs(f"Nodes.items[{i}].metadata.name is not a string")
        return items, None
    names = args.get("NodeNames")
    if isinstance(names, list) and all(isinstance(n, str) for n in names):
        return None, names
    raise BadArgs("ExtenderArgs has neither Nodes (a NodeList) nor NodeNames (a list of strings)")


def _args(document: Any) -> tuple[Json, list[Json] | None, list[str] | None]:
    if not isinstance(document, dict):
        raise BadArgs(f"the body is a JSON {type(document).__name__}, not an ExtenderArgs object")
    pod = document.get("Pod")
    if not isinstance(pod, dict):
        raise BadArgs("ExtenderArgs has no Pod object")
    nodes, names = _nodes(document)
    return pod, nodes, names


def _judge(pod: Json, nodes: list[Json], packing: Packing) -> dict[str, Fit | str | None]:
    """Node name -> its Fit, the reason it has none, or None where it says no room (it passes)."""
    try:
        asks = pod_asks(pod)
    except RequestError as e:
        return {node["metadata"]["name"]: str(e) for node in nodes}
    out: dict[str, Fit | str | None] = {}
    for node in nodes:
        name = node["metadata"]["name"]
        annotations = node["metadata"].get("annotations")
        text = annotations.get(ANNOTATION_GPU_ROOM) if isinstance(annotations, dict) else None
        if text is None or not asks:
            out[name] = None
            continue
        try:
            rooms = parse_rooms(text)
        except ValueError as e:
            out[name] = f"node {name}: {e}"
            continue
        out[name] = fit(name, rooms, asks, packing)
    return out


def filter_nodes(document: Any, packing: Packing) -> Json:
    """ExtenderFilterResult for an ExtenderArgs document; BadArgs for anything else."""
    pod, nodes, names = _args(document)
    if nodes is None:
        try:
            pod_asks(pod)
        except RequestError as e:
            return {"Nodes": None, "NodeNames": [], "FailedNodes": dict.fromkeys(names or [], str(e)), "Error": ""}
        return {"Nodes": None, "NodeNames": names, "FailedNodes": {}, "Error": ""}
    judged = _judge(pod, nodes, packing)
    failed = {name: why for name, why in judged.items() if isinstance(why, str)}
    passed = [node for node in nodes if node["metadata"]["name"] not in failed]
    metadata = mapping(pod.get("metadata"), "Pod.metadata")
    log.info("pod_filtered", namespace=_short(metadata.get("namespace", "")), pod=_short(metadata.get("name", "")),
             passed=len(passed), failed={_short(n): _short(w, 400) for n, w in list(failed.items())[:8]})
    return {"Nodes": {"apiVersion": "v1", "kind": "NodeList", "metadata": {}, "items": passed},
            "NodeNames": None, "FailedNodes": failed, "Error": ""}


def prioritize(document: Any, packing: Packing) -> list[Json]:
    """HostPriorityList for an ExtenderArgs document: the nodes the pod fits ranked by the GPU it
    would take there, in the packing's order, MAX_PRIORITY down to 0; every other node 0."""
    pod, nodes, names = _args(document)
    if nodes is None:
        return [{"Host": name, "Score": 0} for name in names or []]
    judged = _judge(pod, nodes, packing)
    fits = {name: f.first for name, f in judged.items() if isinstance(f, Fit) and f.first is not None}
    # Equal GPUs rank alike: by what the packing orders on, their free memory and time.
    ranked = list(dict.fromkeys((r.memory, r.util) for r in packing.order(list(fits.values()))))
    step = MAX_PRIORITY / max(len(ranked) - 1, 1)
    scores = {name: round(MAX_PRIORITY - step * ranked.index((room.memory, room.util))) for name, room in fits.items()}
    return [{"Host": node["metadata"]["name"], "Score": scores.get(node["metadata"]["name"], 0)} for node in nodes]


def answer(path: str, content_type: str | None, body: bytes, packing: Packing) -> tuple[int, Any]:
    """(HTTP status, JSON answer or a text) for a POST to `path`."""
    verbs = {FILTER_PATH: filter_nodes, PRIORITIZE_PATH: prioritize}
    if path not in verbs:
        return 404, f"no such verb: POST {FILTER_PATH} or {PRIORITIZE_PATH}"
    try:
        return 200, verbs[path](httpd.json_body(content_type, body, "ExtenderArgs"), packing)
    except (ShapeError, httpd.NotJson) as e:  # BadArgs too
        return 400, f"not an ExtenderArgs: {e}"


def _handler(packing: Packing) -> type[httpd.Handler]:
    class ExtenderHandler(httpd.Handler):
        def do_GET(self) -> None:
            if self.path.partition("?")[0] == HEALTH_PATH:
                self._send(200, "ok")
            else:
                self._send(404, f"GET {HEALTH_PATH}; the verbs are POST {FILTER_PATH} and {PRIORITIZE_PATH}")

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self._send(*answer(self.path.partition("?")[0], self.headers.get("Content-Type"), body, packing))

        def _send(self, status: int, result: Any) -> None:
            if isinstance(result, str):
                data, content_type = (result + "\n").encode(), "text/plain; charset=utf-8"
            else:
                data, content_type = json.dumps(result).encode(), "application/json"
            self.reply(status, data, content_type)

    return ExtenderHandler


def server(listen: str, packing: Packing) -> httpd.Server:
    """The HTTP server on `listen` (HOST:PORT), bound and not yet serving (start it)."""
    host, _, port = listen.rpartition(":")
    sock = httpd.listening_socket(host.strip("[]") or "127.0.0.1", int(port))
    return httpd.Server(sock, _handler(packing), None, LIMITS, name="gemtrace-extender")


def serve(listen: str, packing: Packing, placement: str) -> None:
    """Serve until SIGTERM or SIGINT."""
    signals = SignalInbox((signal.SIGTERM, signal.SIGINT))
    extender = server(listen, packing)
    extender.start()
    log.info("extender_listening", listen=listen, placement=placement)
    try:
        while not signals.wait(60.0):
            pass
    finally:
        extender.stop()

