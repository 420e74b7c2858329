"""The pure parts of the Kubernetes integration: shares and their groups, cgroup paths, the webhook's
patch."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from re import escape as re_escape

import pytest
from testkit import GiB

from gemtrace.config import parse_text
from gemtrace.kube import pods, shares, webhook
from gemtrace.kube.grants import PodInfo
from gemtrace.kube.injection import Injection
from gemtrace.kube.kubelet import ContainerDevices
from gemtrace.kube.placer import Decision, pending_containers

pytestmark = pytest.mark.unit

UID = "0d6f6c2e-3c1a-4c3e-9a51-7b1c2d3e4f50"
CID = "a" * 64


def known_groups() -> set[str]:
    """The nodes' resource file's groups, as the webhook reads them."""
    return {"train", "default"}


def test_devices_are_one_per_gib_and_per_percent_of_each_gpu() -> None:
    gpus = [("GPU-a", 16 * GiB + 5), ("GPU-b", 8 * GiB)]
    memory = shares.device_ids(shares.GPU_MEMORY, gpus)
    assert len(memory) == 24 and memory[0] == ("GPU-a-m0", "GPU-a") and memory[-1] == ("GPU-b-m7", "GPU-b")
    assert len(shares.device_ids(shares.GPU_UTIL, gpus)) == 200
    assert shares.gpu_of("GPU-4f53b7f6-3179-49a9-8abd-91f3eeca7a00-u42") == "GPU-4f53b7f6-3179-49a9-8abd-91f3eeca7a00"


def test_the_util_devices_leave_out_what_the_resource_files_own_groups_reserve() -> None:
    groups = parse_text("[train]\nMinUtil = 0.2\n\n[ops]\nMinUtil = 0.345\nGpus = GPU-b\n\n"
                        "[k8s-0123456789abcdef]\nMinUtil = 0.5\nGpus = GPU-a\n\n[idle]\nMaxUtil = 0.5\n").groups
    # [train] on every GPU, [ops] on GPU-b only (rounded up: 35 units), a pod's own grant not at all
    assert shares.util_left(groups.values(), ["GPU-a", "GPU-b"]) == {"GPU-a": 80, "GPU-b": 45}
    full = parse_text("[a]\nMinUtil = 0.6\n\n[b]\nMinUtil = 0.4\n").groups
    assert shares.util_left(full.values(), ["GPU-a"]) == {"GPU-a": 0}
    gpus = [("GPU-a", 8 * GiB), ("GPU-b", 8 * GiB)]
    util = shares.device_ids(shares.GPU_UTIL, gpus, {"GPU-b": 45})
    assert (len(util), util[-1]) == (145, ("GPU-b-u44", "GPU-b"))


def test_a_grant_names_its_group_by_its_devices_whatever_their_order() -> None:
    a = shares.Grant(memory=("GPU-a-m1", "GPU-a-m0"))
    b = shares.Grant(memory=("GPU-a-m0", "GPU-a-m1"), util=("GPU-a-u0",), pod="p")
    assert a.group == b.group and a.group.startswith("k8s-") and len(a.group) <= 63
    assert shares.Grant(memory=("GPU-a-m2",)).group != a.group


def test_the_dropin_of_a_grant_is_a_valid_resource_file() -> None:
    grant = shares.Grant(memory=("GPU-a-m0", "GPU-a-m1"), util=tuple(f"GPU-a-u{i}" for i in range(30)),
                         namespace="ml", pod="trainer", container="main", max_util=0.5,
                         cgroup=f"/kubepods/besteffort/pod{UID}")
    settings = parse_text(shares.dropin_text(grant)).groups[grant.group]
    assert (settings.memory_limit, settings.min_util, settings.max_util) == (2 * GiB, 0.3, 0.5)
    # The pod's cgroup binds: its processes cannot leave its group by what they set in GEMTRACE_GROUP.
    assert (settings.cgroups, settings.cgroup_binding) == ((f"/kubepods/besteffort/pod{UID}",), True)
    # No annotation: MaxUtil is the util request; an annotation below it is raised to it.
    assert shares.Grant(util=("GPU-a-u0",) * 20).max_util_ratio() == 0.2
    assert shares.Grant(util=("GPU-a-u0",) * 20, max_util=0.1).max_util_ratio() == 0.2
    assert shares.Grant(memory=("GPU-a-m0",)).max_util_ratio() == 1.0


def test_a_grants_minutil_is_what_it_holds_on_each_gpu_it_may_run_on() -> None:
    def units(gpu: str, n: int, start: int = 0) -> tuple[str, ...]:
        return tuple(f"{gpu}-u{i}" for i in range(start, start + n))

    on_a = shares.Grant(memory=("GPU-a-m0",), util=units("GPU-a", 60))
    assert (on_a.min_util(), on_a.gpus, on_a.split) == (0.6, ["GPU-a"], False)
    # Spread 50 + 10 by the kubelet: 0.1 on each GPU, never 0.5 or 0.6 on one where it holds 10.
    spread = shares.Grant(util=units("GPU-a", 50) + units("GPU-b", 10))
    assert (spread.min_util(), spread.max_util_ratio(), spread.split) == (0.1, 0.6, True)
    # Its memory on one GPU, its util on the other: it may run on either, and holds nothing on one.
    apart = shares.Grant(memory=("GPU-a-m0",), util=units("GPU-b", 30))
    assert (apart.min_util(), apart.max_util_ratio(), apart.gpus) == (0.0, 0.3, ["GPU-a", "GPU-b"])
    # More than a GPU's worth, 100 + 50: 0.5 of each, and its cap is a whole GPU.
    wide = shares.Grant(util=units("GPU-a", 100) + units("GPU-b", 50))
    assert (wide.min_util(), wide.max_util_ratio()) == (0.5, 1.0)
    assert "Gpus = GPU-a; GPU-b\n" in shares.dropin_text(wide)
    # Asked for 2 GPUs (gemtrace.io/gpus), 50 on each: its cap is 0.5 of each, not the 100 in all.
    pair = shares.Grant(util=units("GPU-a", 50) + units("GPU-b", 50), gpus_asked=2)
    assert (pair.min_util(), pair.max_util_ratio(), pair.split) == (0.5, 0.5, False)
    asked = ({}, {shares.ANNOTATION_GPUS: "2"}, {shares.ANNOTATION_GPUS: "x"})
    assert [shares.gpus_asked(a) for a in asked] == [1, 2, 1]


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        (f"/kubepods/besteffort/pod{UID}/{CID}", pods.PodRef(UID, CID, f"/kubepods/besteffort/pod{UID}")),
        (f"/kubepods/pod{UID}/{CID}", pods.PodRef(UID, CID, f"/kubepods/pod{UID}")),
        (f"/kubepods/burstable/pod{UID}", pods.PodRef(UID, "", f"/kubepods/burstable/pod{UID}")),
        (f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID.replace('-', '_')}.slice/"
         f"cri-containerd-{CID}.scope",
         pods.PodRef(UID, CID, f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod"
                               f"{UID.replace('-', '_')}.slice")),
        ("/user.slice/user-0.slice/session-1.scope", None),
        ("/kubepods/besteffort", None),
    ],
)
def test_a_cgroup_path_names_its_pod_and_container(path: str, expected: pods.PodRef | None) -> None:
    assert pods.parse_cgroup_path(path) == expected


def test_a_pods_cgroup_is_found_under_either_hierarchy(tmp_path: Path) -> None:
    assert pods.pod_cgroup(UID, tmp_path) is None
    (tmp_path / "pids" / "kubepods" / "besteffort" / f"pod{UID}").mkdir(parents=True)
    assert pods.pod_cgroup(UID, tmp_path) == f"/kubepods/besteffort/pod{UID}"


def test_process_labels_come_from_the_cgroup_and_the_names_file(tmp_path: Path) -> None:
    names = tmp_path / "pods.json"
    pods.write_names(names, pods.Names({UID: ("ml", "trainer", {CID: "main"})}, {"k8s-x": ("ml", "trainer", "main")}))
    proc = tmp_path / "proc"
    for pid, cgroup in ((10, f"/kubepods/besteffort/pod{UID}/{CID}"), (11, "/user.slice")):
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "cgroup").write_text(f"0::{cgroup}\n")
    labels = pods.PodLabels(names, proc)
    labels.refresh([10, 11, 12])
    assert labels.process(10, "default") == ("ml", "trainer", "main")
    assert labels.process(11, "default") == ("", "", "")
    assert labels.process(11, "k8s-x") == ("ml", "trainer", "main")  # its group's pod
    assert labels.group("train") == ("", "", "")


def test_the_webhook_patches_a_labelled_pod_and_only_it() -> None:
    injection = Injection(gate=Path("/usr/lib/gemtrace/libgemgate.so"), state_dir=Path("/run/gemtrace"),
                          preload_file=Path("/var/lib/gemtrace/kube/ld.so.preload"))
    pod = {"metadata": {"labels": {shares.LABEL_GROUP: "train"}},
           "spec": {"containers": [{"name": "a", "env": [{"name": "GEMTRACE_STATE_DIR", "value": "/x"}]},
                                   {"name": "b", "volumeMounts": []}]}}
    answer = webhook.review({"request": {"uid": "u1", "object": pod}}, injection, known_groups)["response"]
    assert answer["allowed"] and answer["uid"] == "u1"
    patch = json.loads(base64.b64decode(answer["patch"]))
    assert patch[0]["path"] == "/spec/volumes" and {v["name"] for v in patch[0]["value"]} == {
        "gemtrace-gate", "gemtrace-state", "gemtrace-preload"}
    env_a = [p["value"] for p in patch if p["path"] == "/spec/containers/0/env/-"]
    assert env_a == [{"name": "GEMTRACE_GROUP", "value": "train"}]  # the pod's own GEMTRACE_STATE_DIR stays
    mounts_b = [p["value"]["mountPath"] for p in patch if p["path"] == "/spec/containers/1/volumeMounts/-"]
    assert mounts_b == ["/usr/lib/gemtrace/libgemgate.so", "/run/gemtrace", "/etc/ld.so.preload"]

    unlabelled = webhook.review({"request": {"uid": "u2", "object": {"metadata": {}, "spec": {}}}}, injection,
                                known_groups)
    assert unlabelled["response"] == {"uid": "u2", "allowed": True}
    bad = {"metadata": {"labels": {shares.LABEL_GROUP: "no/slash"}}, "spec": {}}
    refused = webhook.review({"request": {"uid": "u3", "object": bad}}, injection, known_groups)["response"]
    assert not refused["allowed"] and "is not a group name" in refused["status"]["message"]


def test_a_containers_util_only_grant_goes_once_its_whole_grant_is_known(tmp_path: Path) -> None:
    """PodResources may list a container with its util devices before its memory's: the grant named
    after the util goes as soon as the whole one is written, not after the grace (its MinUtil, counted
    twice, took a GPU's MinUtils past 1 and got the drop-ins refused in the 30/70 e2e test)."""
    from gemtrace.kube.grants import Grants
    from gemtrace.kube.kubelet import ContainerDevices

    uuid = "GPU-0"
    util = tuple(f"{uuid}-u{i}" for i in range(30))
    memory = (f"{uuid}-m0",)
    grants = Grants(tmp_path, cgroup_root=tmp_path / "cgroup")
    early = grants.reconcile([ContainerDevices("default", "p", "main", {shares.GPU_UTIL: util})])
    whole = grants.reconcile([ContainerDevices("default", "p", "main",
                                               {shares.GPU_UTIL: util, shares.GPU_MEMORY: memory})])
    (util_group,), (group,) = early, whole
    assert util_group != group
    assert sorted(p.name for p in tmp_path.glob("*.conf")) == [f"{group}.conf"]
    # Another container's fresh file (Allocate's, not yet listed) keeps its grace.
    grants.write(shares.Grant(memory=(f"{uuid}-m1",)))
    grants.reconcile([ContainerDevices("default", "p", "main", {shares.GPU_UTIL: util, shares.GPU_MEMORY: memory})])
    assert len(list(tmp_path.glob("*.conf"))) == 2


def test_a_pod_is_finished_once_nothing_of_it_can_run_any_more() -> None:
    from gemtrace.kube.apiserver import Apiserver

    class Listing(Apiserver):
        def __init__(self, pod: dict[str, object]) -> None:
            self.pod = pod

        def get(self, path: str, **query: str) -> dict[str, object]:
            return {"items": [self.pod]}

    def finished(phase: str, deleted: bool, *states: str) -> bool:
        metadata = {"namespace": "ml", "name": "p", "uid": UID}
        if deleted:
            metadata["deletionTimestamp"] = "2026-11-26T20:00:00Z"
        pod = {"metadata": metadata, "status": {"phase": phase,
                                                "containerStatuses": [{"state": {s: {}}} for s in states]}}
        return Listing(pod).pods_of_node("node")[("ml", "p")].finished

    assert finished("Succeeded", False, "terminated") and finished("Failed", False)
    assert finished("Running", True, "terminated", "terminated")
    # Deleted but a container still stopping (its grace period): its processes still hold the GPU.
    assert not finished("Running", True, "terminated", "running")
    assert not finished("Running", False, "terminated") and not finished("Pending", True)


def test_a_dropin_says_whose_it_is_once_the_kubelet_has_named_the_pod() -> None:
    listed = shares.Grant(memory=("GPU-0-m0",), namespace="ml", pod="trainer", container="main")
    assert shares.dropin_container(shares.dropin_text(listed)) == ("ml", "trainer", "main")
    assert shares.dropin_container(shares.dropin_text(shares.Grant(memory=("GPU-0-m0",)))) is None


def test_a_request_is_split_evenly_over_its_gpus_or_refused_saying_what_to_ask() -> None:
    mem, util = shares.GPU_MEMORY, shares.GPU_UTIL
    assert shares.request_of({mem: 4, util: 50}, {}) == shares.Request(4, 50, 1, None)
    assert shares.request_of({mem: 8, util: 100}, {shares.ANNOTATION_GPUS: "2", shares.ANNOTATION_GPU_MODEL: " H100 "}
                             ) == shares.Request(4, 50, 2, "H100")
    assert shares.request_of({util: 30}, {}).units(mem) == 0
    for limits, asked, message in [
        ({mem: 3}, {shares.ANNOTATION_GPUS: "2"}, "gemtrace.io/gpu-memory: 3 does not split evenly over "
                                                  "gemtrace.io/gpus=2; ask for a multiple of 2"),
        ({util: 150}, {}, "gemtrace.io/gpu-util: 150 over 1 GPU(s) is more than 100% of each; ask for at most 100"),
        ({mem: 1}, {shares.ANNOTATION_GPUS: "two"}, "annotation gemtrace.io/gpus='two' is not a number of GPUs"),
        ({mem: 1}, {shares.ANNOTATION_GPUS: "0"}, "annotation gemtrace.io/gpus='0' is not a number of GPUs"),
    ]:
        with pytest.raises(shares.RequestError) as e:
            shares.request_of(limits, asked)
        assert str(e.value).startswith(message)


def test_the_container_being_admitted_is_the_oldest_pending_one_asking_as_many_units() -> None:
    mem, util = shares.GPU_MEMORY, shares.GPU_UTIL

    def pod(created: str, phase: str = "Pending", **containers: dict[str, int]) -> PodInfo:
        return PodInfo(UID, phase=phase, created=created, requests=dict(containers))

    node = {
        ("ml", "running"): pod("2026-11-26T10:00:00Z", "Running", main={mem: 2}),
        ("ml", "young"): pod("2026-11-26T10:05:00Z", main={mem: 2, util: 10}),
        ("ml", "old"): pod("2026-11-26T10:01:00Z", init={mem: 2}, main={mem: 2, util: 20}),
        ("ml", "other"): pod("2026-11-26T10:00:30Z", main={mem: 3}),
    }

    def keys(resource: str, units: int, listed: list[ContainerDevices] = [],  # noqa: B006
             decisions: dict[tuple[str, str, str], Decision] | None = None) -> list[tuple[str, str, str]]:
        return [key for key, _, _ in pending_containers(node, listed, resource, units, decisions or {})]

    assert keys(mem, 2) == [("ml", "old", "init"), ("ml", "old", "main"), ("ml", "young", "main")]
    assert keys(mem, 3) == [("ml", "other", "main")]
    # The init container holds its memory: the next one asking 2 is the old pod's main.
    held = [ContainerDevices("ml", "old", "init", {mem: ("GPU-a-m0", "GPU-a-m1")})]
    assert keys(mem, 2, held) == [("ml", "old", "main"), ("ml", "young", "main")]
    # The young pod's memory was decided first: its util call is its own, before older pods'.
    young = Decision(("ml", "young", "main"), {mem: ("GPU-a-m2", "GPU-a-m3"), util: ("GPU-a-u0",)}, None, 0.0,
                     answered={mem})
    assert keys(util, 10, decisions={young.key: young}) == [("ml", "young", "main")]
    assert keys(mem, 2, decisions={young.key: young}) == [("ml", "old", "init"), ("ml", "old", "main")]


def test_a_pods_annotations_set_its_groups_priority_isolation_and_oversubscribe() -> None:
    annotations = {shares.ANNOTATION_PRIORITY: "10", shares.ANNOTATION_ISOLATION: "mps",
                   shares.ANNOTATION_OVERSUBSCRIBE: "8GiB", shares.ANNOTATION_MAX_UTIL: "0.5", "other.io/x": "y"}
    pod = shares.pod_settings(annotations, memory_gib=2)
    assert pod == shares.PodSettings(0.5, (("Priority", "10"), ("Isolation", "mps"), ("Oversubscribe", "8GiB")))
    grant = shares.Grant(memory=("GPU-a-m0", "GPU-a-m1"), max_util=pod.max_util, settings=pod.lines,
                         cgroup=f"/kubepods/pod{UID}")
    settings = parse_text(shares.dropin_text(grant)).groups[grant.group]
    assert (settings.priority, settings.isolation, settings.oversubscribe_limit, settings.max_util) == (
        10, "mps", 8 * GiB, 0.5)


@pytest.mark.parametrize(("annotation", "value", "message"), [
    (shares.ANNOTATION_PRIORITY, "high", "annotation gemtrace.io/priority: Priority 'high' is not a whole number"),
    (shares.ANNOTATION_PRIORITY, "5000", "annotation gemtrace.io/priority: Priority 5000 is out of range"),
    (shares.ANNOTATION_ISOLATION, "mig", "annotation gemtrace.io/isolation: Isolation 'mig' is neither time nor mps"),
    (shares.ANNOTATION_MAX_UTIL, "1.5", "annotation gemtrace.io/max-util: MaxUtil 1.5 is above 1"),
    (shares.ANNOTATION_OVERSUBSCRIBE, "lots", "annotation gemtrace.io/oversubscribe: Oversubscribe 'lots' is neither"),
    (shares.ANNOTATION_OVERSUBSCRIBE, "2GiB",
     "annotation gemtrace.io/oversubscribe: 2GiB is not above the pod's 2 GiB"),
    # A value must never reach the drop-in as a line of its own.
    (shares.ANNOTATION_PRIORITY, "1\nMemoryLimit = 1TiB", "annotation gemtrace.io/priority: Priority"),
    (shares.ANNOTATION_OVERSUBSCRIBE, "true\nCgroup = /", "annotation gemtrace.io/oversubscribe: Oversubscribe"),
    (shares.ANNOTATION_ISOLATION, "mps\n[other]", "annotation gemtrace.io/isolation: Isolation"),
])
def test_the_webhook_refuses_annotations_the_resource_file_would(annotation: str, value: str, message: str) -> None:
    with pytest.raises(ValueError, match="^" + re_escape(message)):
        shares.pod_settings({annotation: value}, memory_gib=2)
    pod = {"metadata": {"annotations": {annotation: value}},
           "spec": {"containers": [{"name": "a", "resources": {"limits": {shares.GPU_MEMORY: "2"}}}]}}
    review = {"request": {"uid": "u9", "object": pod}}
    answer = webhook.review(review, Injection(), known_groups, mutate=False)["response"]
    assert not answer["allowed"] and answer["status"]["message"].startswith(message)
    assert "\n" not in answer["status"]["message"].rstrip()  # one line, whatever the value held


def test_a_label_naming_a_group_the_resource_file_lacks_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "resource.conf"
    config.write_text("[train]\nMemoryLimit = 1GiB\n")
    (tmp_path / "resource.d").mkdir()
    (tmp_path / "resource.d" / "k8s-0123456789abcdef.conf").write_text("[k8s-0123456789abcdef]\nMaxUtil = 0.5\n")
    groups = webhook.resource_groups(config)

    def answer(group: str, groups: webhook.Groups = groups) -> dict[str, object]:
        pod = {"metadata": {"labels": {shares.LABEL_GROUP: group}}, "spec": {"containers": [{"name": "a"}]}}
        response: dict[str, object] = webhook.review({"request": {"uid": "u", "object": pod}}, Injection(),
                                                     groups)["response"]
        return response

    assert answer("train")["allowed"] and answer("default")["allowed"]
    refused = answer("nosuch")
    assert not refused["allowed"] and refused["status"] == {"code": 400, "message": (
        "label gemtrace.io/group=nosuch names no group of the nodes' resource file; name one it defines, or have "
        "the operator add [nosuch]")}
    # A pod's own group (a drop-in of the device plugin) is no group to join by label: its quota is the pod's.
    assert "names a pod's own group" in answer("k8s-0123456789abcdef")["status"]["message"]  # type: ignore[index]
    unreadable = answer("train", webhook.resource_groups(tmp_path / "missing.conf"))
    assert not unreadable["allowed"] and "cannot read its resource file" in unreadable["status"]["message"]  # type: ignore[index]


def test_the_webhook_refuses_gpus_and_models_no_node_could_place() -> None:
    def answer(annotations: dict[str, str], memory: str = "8", util: str = "100") -> dict[str, object]:
        pod = {"metadata": {"annotations": annotations}, "spec": {"containers": [{"name": "a", "resources": {
            "limits": {shares.GPU_MEMORY: memory, shares.GPU_UTIL: util}}}]}}
        response: dict[str, object] = webhook.review({"request": {"uid": "u", "object": pod}}, Injection(),
                                                     known_groups, mutate=False)["response"]
        return response

    def refusal(annotations: dict[str, str], memory: str = "8", util: str = "100") -> str:
        response = answer(annotations, memory, util)
        assert not response["allowed"]
        message: str = response["status"]["message"]  # type: ignore[index]
        assert "\n" not in message
        return message

    assert answer({shares.ANNOTATION_GPUS: "2", shares.ANNOTATION_GPU_MODEL: "H100, A100"})["allowed"]
    assert refusal({shares.ANNOTATION_GPUS: "two"}).startswith("annotation gemtrace.io/gpus='two' is not a number")
    assert refusal({shares.ANNOTATION_GPUS: "3"}).startswith(
        "gemtrace.io/gpu-memory: 8 does not split evenly over gemtrace.io/gpus=3")
    assert refusal({}, util="150").startswith("gemtrace.io/gpu-util: 150 over 1 GPU(s) is more than 100% of each")
    assert refusal({shares.ANNOTATION_GPU_MODEL: "H100\n[x]"}).startswith(
        "annotation gemtrace.io/gpu-model='H100\\n[x]' is not a GPU model name")
    # A pod asking none of the shares has its annotations read all the same.
    pod = {"metadata": {"annotations": {shares.ANNOTATION_GPUS: "0"}}, "spec": {"containers": [{"name": "a"}]}}
    review = webhook.review({"request": {"uid": "u", "object": pod}}, Injection(), known_groups)
    assert not review["response"]["allowed"]
    # Oversubscribe is above the memory of each GPU: 8 GiB over 2 GPUs is 4 GiB on each.
    assert answer({shares.ANNOTATION_GPUS: "2", shares.ANNOTATION_OVERSUBSCRIBE: "6GiB"})["allowed"]
    assert "is not above the pod's 8 GiB" in refusal({shares.ANNOTATION_OVERSUBSCRIBE: "6GiB"})
