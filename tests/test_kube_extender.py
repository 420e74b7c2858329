"""The scheduler extender (gemtrace/kube/extender.py) and the rooms it reads (gemtrace/kube/rooms.py):
filter and prioritize as pure functions over ExtenderArgs documents, then the server through real HTTP
requests. The plugin's side, patching its node's annotation: tests/test_kube_plugin.py; the real
scheduler calling it: tests/test_kube_e2e.py."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from typing import Any

import pytest

from gemtrace.kube import extender
from gemtrace.kube.rooms import ANNOTATION_GPU_ROOM, GpuRoom, node_rooms, parse_rooms, room_text
from gemtrace.kube.shares import ANNOTATION_GPU_MODEL, ANNOTATION_GPUS, GPU_MEMORY, GPU_UTIL, GiB, device_ids
from gemtrace.run.placement import PACKINGS

pytestmark = pytest.mark.unit

BINPACK, SPREAD = PACKINGS["binpack"](), PACKINGS["spread"]()
SIM = "Simulated GPU"


def node(name: str, *free: tuple[int, int], memory: int = 8, model: str = SIM,
         annotation: str | None = None) -> dict[str, Any]:
    """A Node as the scheduler sends it, its GPUs' (GiB, percent) free in its annotation (none: no
    annotation, unless `annotation` gives the text)."""
    rooms = [GpuRoom(i, f"GPU-{name}-{i}", model, memory, m, u) for i, (m, u) in enumerate(free)]
    text = annotation if annotation is not None else room_text(rooms) if free else None
    metadata: dict[str, Any] = {"name": name, "labels": {"kubernetes.io/hostname": name}}
    if text is not None:
        metadata["annotations"] = {ANNOTATION_GPU_ROOM: text, "other": "kept"}
    return {"apiVersion": "v1", "kind": "Node", "metadata": metadata,
            "status": {"allocatable": {GPU_MEMORY: str(memory * len(free))}}}


def container(name: str, memory: int = 0, util: int = 0) -> dict[str, Any]:
    limits = {k: str(v) for k, v in ((GPU_MEMORY, memory), (GPU_UTIL, util)) if v}
    return {"name": name, "image": "busybox", "resources": {"limits": limits, "requests": dict(limits)}}


def pod(*containers: dict[str, Any], init: tuple[dict[str, Any], ...] = (), **annotations: str) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": list(containers)}
    if init:
        spec["initContainers"] = list(init)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "ml", "annotations": annotations},
            "spec": spec}


def args(the_pod: dict[str, Any], *nodes: dict[str, Any]) -> dict[str, Any]:
    return {"Pod": the_pod, "Nodes": {"apiVersion": "v1", "kind": "NodeList", "items": list(nodes)}, "NodeNames": None}


def filtered(the_pod: dict[str, Any], *nodes: dict[str, Any],
             packing: Any = BINPACK) -> tuple[list[str], dict[str, str]]:
    """(the names of the nodes passed, the failed ones' reasons)."""
    result = extender.filter_nodes(args(the_pod, *nodes), packing)
    assert result["Error"] == "" and result["NodeNames"] is None
    passed = result["Nodes"]["items"]
    # The nodes come back whole, as they were sent.
    assert all(n == next(m for m in nodes if m["metadata"]["name"] == n["metadata"]["name"]) for n in passed)
    return [n["metadata"]["name"] for n in passed], result["FailedNodes"]


def test_a_pod_passes_where_one_gpu_has_its_share_free_whole() -> None:
    passed, failed = filtered(pod(container("main", 4, 50)), node("roomy", (3, 100), (4, 50)))
    assert (passed, failed) == (["roomy"], {})


def test_a_node_with_room_in_all_but_not_on_one_gpu_fails_saying_each_gpus_room() -> None:
    passed, failed = filtered(pod(container("main", 4, 50)), node("gemtrace-node", (3, 50), (3, 50)),
                              node("other", (4, 49), (8, 100)))
    assert passed == ["other"]
    assert failed == {"gemtrace-node": "no GPU of gemtrace-node has 4 GiB and 50% free "
                                       "(free: GPU 0 3 GiB 50%, GPU 1 3 GiB 50%)"}
    # Time counts as memory does: 4 GiB beside 49% is no room for 50%.
    passed, failed = filtered(pod(container("main", 4, 50)), node("busy", (4, 49), (3, 100)))
    assert failed == {"busy": "no GPU of busy has 4 GiB and 50% free (free: GPU 0 4 GiB 49%, GPU 1 3 GiB 100%)"}


def test_a_model_no_gpu_of_a_node_is_fails_there_and_passes_where_one_is() -> None:
    asking = pod(container("main", 1, 10), **{ANNOTATION_GPU_MODEL: "H100"})
    passed, failed = filtered(asking, node("a100s", (8, 100), model="NVIDIA A100-SXM4-80GB"),
                              node("h100s", (8, 100), model="NVIDIA H100 80GB HBM3"))
    assert passed == ["h100s"]
    assert failed == {"a100s": "no GPU of a100s is a H100 (its GPUs: NVIDIA A100-SXM4-80GB)"}
    # The model's GPUs must have the room, not any GPU of the node.
    mixed = node("mixed", (8, 100), (0, 0))
    rooms = parse_rooms(mixed["metadata"]["annotations"][ANNOTATION_GPU_ROOM])
    rooms[1] = GpuRoom(1, "GPU-h", "NVIDIA H100 80GB HBM3", 80, 0, 0)
    mixed["metadata"]["annotations"][ANNOTATION_GPU_ROOM] = room_text(rooms)
    assert filtered(asking, mixed)[1] == {"mixed": "no H100 GPU of mixed has 1 GiB and 10% free "
                                                   "(free: GPU 0 8 GiB 100%, GPU 1 0 GiB 0%)"}


def test_a_two_gpu_container_needs_two_gpus_each_with_its_half() -> None:
    pair = pod(container("main", 8, 100), **{ANNOTATION_GPUS: "2"})  # 4 GiB and 50% on each
    passed, failed = filtered(pair, node("one-short", (4, 50), (3, 100)), node("both", (4, 50), (5, 60)))
    assert passed == ["both"]
    assert failed == {"one-short": "fewer than 2 GPUs of one-short have 4 GiB and 50% free each "
                                   "(free: GPU 0 4 GiB 50%, GPU 1 3 GiB 100%)"}
    # A request no node could place fails everywhere, with what to change.
    passed, failed = filtered(pod(container("main", 3), **{ANNOTATION_GPUS: "2"}), node("both", (4, 50), (5, 60)))
    assert passed == [] and "3 does not split evenly over gemtrace.io/gpus=2" in failed["both"]


def test_containers_are_placed_one_after_another_and_init_containers_each_alone() -> None:
    # GPU 0 has 5 GiB, GPU 1 3 GiB: a 4 GiB container takes GPU 0, and a second one finds room on neither.
    two = pod(container("a", 4), container("b", 4))
    passed, failed = filtered(two, node("n", (5, 100), (3, 100)))
    assert failed == {"n": "container b: no GPU of n has 4 GiB free (free: GPU 0 1 GiB 100%, GPU 1 3 GiB 100%)"}
    # 4 GiB and 3 GiB fit, one on each GPU.
    assert filtered(pod(container("a", 4), container("b", 3)), node("n", (5, 100), (3, 100)))[0] == ["n"]
    # An init container runs before the others, alone, and hands its devices on: 5 GiB then 4 GiB fit.
    assert filtered(pod(container("a", 4), init=(container("setup", 5),)), node("n", (5, 100), (3, 100)))[0] == ["n"]
    # but not an init container bigger than any GPU's room.
    failed = filtered(pod(container("a", 1), init=(container("setup", 6),)), node("n", (5, 100), (3, 100)))[1]
    assert failed["n"].startswith("container setup: no GPU of n has 6 GiB free (")
    # A share of time alone is said so.
    assert filtered(pod(container("a", util=80)), node("n", (5, 70)))[1] == {
        "n": "no GPU of n has 80% free (free: GPU 0 5 GiB 70%)"}
    # Containers asking nothing of gemtrace are not placed.
    assert filtered(pod(container("a", 5), container("sidecar")), node("n", (5, 100)))[0] == ["n"]
    assert extender.fit("n", [], [], BINPACK) == extender.Fit(None)


def test_a_node_without_the_annotation_passes_and_a_bad_one_fails_that_node_alone() -> None:
    passed, failed = filtered(pod(container("main", 4, 50)), node("no-plugin"), node("bad", annotation="{not json"),
                              node("fine", (4, 50)), node("full", (1, 0)))
    assert passed == ["no-plugin", "fine"]
    assert failed["bad"].startswith("node bad: annotation gemtrace.io/gpu-room is not JSON (")
    assert failed["full"].startswith("no GPU of full has 4 GiB and 50% free")
    for text, why in {'{"a": 1}': "is not a list of at most 1024 GPUs",
                      "[1]": "entry 0 is not an object",
                      '[{"index": 0, "uuid": "u", "name": "n", "memoryGiB": 8, "memoryFreeGiB": -1, '
                      '"utilFreePercent": 5}]': "entry 0's memoryFreeGiB is -1, not a whole number, 0 or more",
                      '[{"index": 0, "uuid": "u", "name": "n", "memoryGiB": 8, "memoryFreeGiB": 8}]':
                          "entry 0's utilFreePercent is None, not a whole number, 0 or more",
                      '[{"index": true, "uuid": "u", "name": "n", "memoryGiB": 8, "memoryFreeGiB": 8, '
                      '"utilFreePercent": 5}]': "entry 0's index is True, not a whole number",
                      '[{"index": 0, "uuid": "' + "x" * 5000 + '"}]': "entry 0's name is None",
                      "[" * 100_000: "nested too deeply"}.items():
        (reason,) = filtered(pod(container("main", 1)), node("bad", annotation=text))[1].values()
        assert reason.startswith("node bad: annotation gemtrace.io/gpu-room") and why in reason, reason
        assert len(reason) < 300


def test_node_names_alone_pass_there_being_no_annotations_to_read() -> None:
    result = extender.filter_nodes({"Pod": pod(container("main", 4)), "NodeNames": ["a", "b"]}, BINPACK)
    assert result == {"Nodes": None, "NodeNames": ["a", "b"], "FailedNodes": {}, "Error": ""}
    assert extender.prioritize({"Pod": pod(container("main", 4)), "NodeNames": ["a"]}, BINPACK) == [
        {"Host": "a", "Score": 0}]


def test_prioritize_ranks_the_nodes_that_fit_by_the_gpu_taken_binpacked_or_spread() -> None:
    nodes = [node("half", (4, 50), (8, 100)), node("empty", (8, 100)), node("nearly-full", (2, 20), (1, 100)),
             node("too-full", (1, 100)), node("no-plugin")]
    asking = pod(container("main", 2, 20))
    # binpack: the fullest GPU that fits (nearly-full's GPU 0, then half's GPU 0), spread the emptiest.
    assert extender.prioritize(args(asking, *nodes), BINPACK) == [
        {"Host": "half", "Score": 5}, {"Host": "empty", "Score": 0}, {"Host": "nearly-full", "Score": 10},
        {"Host": "too-full", "Score": 0}, {"Host": "no-plugin", "Score": 0}]
    # Spread takes half's empty GPU 1, as good as empty's.
    assert extender.prioritize(args(asking, *nodes), SPREAD) == [
        {"Host": "half", "Score": 10}, {"Host": "empty", "Score": 10}, {"Host": "nearly-full", "Score": 0},
        {"Host": "too-full", "Score": 0}, {"Host": "no-plugin", "Score": 0}]
    # Equal GPUs score alike; one node that fits gets the most.
    assert [h["Score"] for h in extender.prioritize(args(asking, node("a", (8, 100)), node("b", (8, 100))),
                                                    BINPACK)] == [10, 10]
    scores = extender.prioritize(args(asking, *(node(f"n{i}", (2 + i, 100)) for i in range(12))), BINPACK)
    assert [h["Score"] for h in scores] == sorted((h["Score"] for h in scores), reverse=True)
    assert (scores[0]["Score"], scores[-1]["Score"]) == (extender.MAX_PRIORITY, 0)


def test_a_gpus_room_is_what_no_container_holds_on_it_and_none_on_an_unhealthy_gpu() -> None:
    gpus = [("GPU-a", 8 * GiB), ("GPU-b", 8 * GiB + 5), ("GPU-c", 4 * GiB)]
    advertised = {GPU_MEMORY: device_ids(GPU_MEMORY, gpus), GPU_UTIL: device_ids(GPU_UTIL, gpus, {"GPU-b": 80})}
    held = {"GPU-a-m0", "GPU-a-m1", "GPU-a-u0", "GPU-b-m7", "GPU-b-u79", "GPU-b-u85"}  # u85: no longer advertised
    rooms = node_rooms(gpus, {"GPU-a": "NVIDIA H100 80GB HBM3"}, {"GPU-a", "GPU-b"}, advertised, held)
    assert rooms == [GpuRoom(0, "GPU-a", "NVIDIA H100 80GB HBM3", 8, 6, 99), GpuRoom(1, "GPU-b", "", 8, 7, 79),
                     GpuRoom(2, "GPU-c", "", 4, 0, 0)]
    text = room_text(rooms)
    assert parse_rooms(text) == rooms and room_text(parse_rooms(text)) == text
    assert json.loads(text)[0] == {"index": 0, "uuid": "GPU-a", "name": "NVIDIA H100 80GB HBM3", "memoryGiB": 8,
                                   "memoryFreeGiB": 6, "utilFreePercent": 99}


# -- the server ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    server = extender.server("127.0.0.1:0", BINPACK)
    server.start()
    yield server.server_address[1]
    server.stop()


def request(port: int, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
            ) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request(method, path, body=body or None,
                           headers={"Content-Type": "application/json", **(headers or {})})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def test_the_server_filters_and_prioritizes_over_http(port: int) -> None:
    body = json.dumps(args(pod(container("main", 4, 50)), node("tight", (3, 50), (3, 50)), node("ok", (4, 50))))
    status, answer = request(port, "POST", extender.FILTER_PATH, body.encode())
    assert status == 200, answer
    result = json.loads(answer)
    assert [n["metadata"]["name"] for n in result["Nodes"]["items"]] == ["ok"]
    assert result["FailedNodes"]["tight"].startswith("no GPU of tight has 4 GiB and 50% free")
    status, answer = request(port, "POST", extender.PRIORITIZE_PATH, body.encode())
    assert (status, json.loads(answer)) == (200, [{"Host": "tight", "Score": 0}, {"Host": "ok", "Score": 10}])
    assert request(port, "GET", extender.HEALTH_PATH) == (200, b"ok\n")


NOT_ARGS = {
    "not JSON": (b"{Pod:", "not JSON: "),
    "bad UTF-8": (b'{"Pod": "\xff\xfe"}', "not JSON: "),
    "a list": (b"[]", "the body is a JSON list, not an ExtenderArgs object"),
    "no pod": (b'{"Nodes": {"items": []}}', "ExtenderArgs has no Pod object"),
    "no nodes": (b'{"Pod": {}}', "neither Nodes (a NodeList) nor NodeNames"),
    "items a dict": (b'{"Pod": {}, "Nodes": {"items": {}}}', "Nodes.items is not a list of objects"),
    "a node without a name": (b'{"Pod": {}, "Nodes": {"items": [{"metadata": {}}]}}',
                              "Nodes.items[0].metadata.name is not a string"),
    "containers a string": (b'{"Pod": {"spec": {"containers": "x"}}, "Nodes": {"items": []}}',
                            "Pod.spec.containers is not a list of objects"),
    "deep nesting": (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
}


@pytest.mark.parametrize(("body", "why"), NOT_ARGS.values(), ids=NOT_ARGS.keys())
def test_a_body_that_is_no_extender_args_gets_400_saying_why(port: int, body: bytes, why: str) -> None:
    for path in (extender.FILTER_PATH, extender.PRIORITIZE_PATH):
        status, answer = request(port, "POST", path, body)
        assert status == 400 and answer.startswith(b"not an ExtenderArgs: ") and why.encode() in answer, answer[:300]


def test_a_body_too_big_wrong_type_or_path_is_refused_and_the_server_still_answers(port: int) -> None:
    # Refused from its Content-Length, before a byte of it is read.
    status, answer = request(port, "POST", extender.FILTER_PATH, b"{}",
                             headers={"Content-Length": str(extender.LIMITS.body_bytes + 1)})
    assert status == 413 and b"at most" in answer
    status, answer = request(port, "POST", extender.FILTER_PATH, b"{}", headers={"Content-Type": "text/plain"})
    assert status == 400 and b"Content-Type 'text/plain'" in answer
    assert request(port, "POST", "/bind", b"{}")[0] == 404
    assert request(port, "GET", "/")[0] == 404
    body = json.dumps(args(pod(container("main", 1)), node("ok", (4, 50)))).encode()
    assert request(port, "POST", extender.FILTER_PATH, body)[0] == 200
