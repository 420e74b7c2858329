"""deploy/'s manifests against what the code and the image say of themselves (no cluster: the k8s
tier applies them, tests/test_kube_e2e.py)."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml
from simgpu_env import REPO

import gemtrace
from gemtrace import cli, defaults
from gemtrace.kube import extender, shares

pytestmark = pytest.mark.unit

DEPLOY = REPO / "deploy"


def objects() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    found = []
    for name in kustomization["resources"]:
        found += [o for o in yaml.safe_load_all((DEPLOY / name).read_text()) if o]
    return found


def one(kind: str, name: str) -> dict[str, Any]:
    (found,) = [o for o in objects() if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def test_the_image_tag_is_the_version_that_make_image_builds() -> None:
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    (image,) = kustomization["images"]
    assert image == {"name": "gemtrace/gemtrace", "newTag": gemtrace.__version__}
    for kind, name in (("DaemonSet", "gemtrace-device-plugin"), ("Deployment", "gemtrace-webhook"),
                       ("DaemonSet", "gemtrace-scheduler-extender")):
        (container,) = one(kind, name)["spec"]["template"]["spec"]["containers"]
        # A tag-less image in the manifest takes the kustomization's tag; IfNotPresent: the image is
        # imported into each node, there is no registry to pull it from.
        assert container["image"] == "gemtrace/gemtrace" and container["imagePullPolicy"] == "IfNotPresent"
    build = (REPO / "packaging" / "image" / "build.sh").read_text()
    assert 'ref="gemtrace/gemtrace:$version"' in build


def test_the_webhook_runs_with_the_options_that_make_its_certificate_and_the_rbac_they_need() -> None:
    (container,) = one("Deployment", "gemtrace-webhook")["spec"]["template"]["spec"]["containers"]
    args = cli.parser().parse_args(container["command"][1:])
    secret_ns, secret = args.tls_secret.split("/")
    service_ns, service = args.service.split("/")
    assert one("Secret", secret)["metadata"]["namespace"] == secret_ns
    assert one("Service", service)["metadata"]["namespace"] == service_ns
    configurations = {"MutatingWebhookConfiguration": (args.webhook_configuration, "/mutate"),
                      "ValidatingWebhookConfiguration": (args.validating_webhook_configuration, "/validate")}
    for kind, (name, path) in configurations.items():
        # No caBundle in the manifests: the webhook owns it, and a re-apply must not clear it.
        for hook in one(kind, name)["webhooks"]:
            assert "caBundle" not in hook["clientConfig"]
            assert hook["clientConfig"]["service"] == {"name": service, "namespace": service_ns, "path": path}
    # The certificate is written where the container may write (an emptyDir), not the read-only root.
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in one("Deployment", "gemtrace-webhook")["spec"]["template"]["spec"]["volumes"]}
    assert "emptyDir" in volumes[mounts[str(Path(args.cert).parent)]] and "emptyDir" in volumes[mounts["/tmp"]]
    # Its RBAC: that Secret and that configuration, nothing else.
    role, cluster_role = one("Role", "gemtrace-webhook"), one("ClusterRole", "gemtrace-webhook")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["secrets"], "resourceNames": [secret],
                              "verbs": ["get", "update"]}]
    assert cluster_role["rules"] == [
        {"apiGroups": ["admissionregistration.k8s.io"], "resources": ["mutatingwebhookconfigurations"],
         "resourceNames": [args.webhook_configuration], "verbs": ["get", "patch"]},
        {"apiGroups": ["admissionregistration.k8s.io"], "resources": ["validatingwebhookconfigurations"],
         "resourceNames": [args.validating_webhook_configuration], "verbs": ["get", "patch"]}]
    # The node's resource file, for the labels' groups, read-only where --config looks.
    config_mount = next(m for m in container["volumeMounts"] if m["mountPath"] == str(Path(args.config).parent))
    assert config_mount.get("readOnly") is True
    assert volumes[config_mount["name"]]["hostPath"]["path"] == str(Path(args.config).parent)


def test_the_device_plugins_service_account_may_do_what_the_plugin_asks_of_the_apiserver() -> None:
    # gemtrace.kube.apiserver for the plugin: a list of its node's pods every second (pods_of_node), an
    # event on a pod whose grant the agent refused (pod_event), in any namespace, and its node's room
    # (annotate_node); in its pod, each verb missing here is a 403 (no Cgroup rule, a refusal told to
    # the log only, or no room for the scheduler extender to read).
    daemonset = one("DaemonSet", "gemtrace-device-plugin")
    account = daemonset["spec"]["template"]["spec"]["serviceAccountName"]
    namespace = daemonset["metadata"]["namespace"]
    assert one("ServiceAccount", account)["metadata"]["namespace"] == namespace
    binding = one("ClusterRoleBinding", "gemtrace-device-plugin")
    assert {"kind": "ServiceAccount", "name": account, "namespace": namespace} in binding["subjects"]
    role = one(binding["roleRef"]["kind"], binding["roleRef"]["name"])
    allowed = {(resource, verb) for rule in role["rules"] if rule["apiGroups"] == [""]
               for resource in rule["resources"] for verb in rule["verbs"]}
    assert {("pods", "get"), ("pods", "list"), ("events", "create"), ("nodes", "patch")} <= allowed


def test_the_scheduler_extender_serves_where_the_schedulers_configuration_calls_it() -> None:
    """deploy/kube-scheduler/config.yaml (the operator's kube-scheduler --config) calls the extender on
    loopback, the verbs it serves, for pods asking gemtrace's resources, with whole nodes; the
    DaemonSet serves it there on every control-plane host, with the host's network."""
    config = yaml.safe_load((DEPLOY / "kube-scheduler" / "config.yaml").read_text())
    assert (config["apiVersion"], config["kind"]) == ("kubescheduler.config.k8s.io/v1beta1",
                                                      "KubeSchedulerConfiguration")
    (hook,) = config["extenders"]
    assert {k: hook[k] for k in ("nodeCacheCapable", "ignorable", "enableHTTPS")} == {
        "nodeCacheCapable": False, "ignorable": True, "enableHTTPS": False}
    assert (f"/{hook['filterVerb']}", f"/{hook['prioritizeVerb']}") == (extender.FILTER_PATH, extender.PRIORITIZE_PATH)
    assert hook["weight"] >= 1
    assert hook["managedResources"] == [{"name": r, "ignoredByScheduler": False} for r in shares.RESOURCES]
    assert hook["urlPrefix"] == f"http://{defaults.EXTENDER_LISTEN}"
    # With --config, 1.20's --port=0 no longer turns its unauthenticated healthz and metrics off.
    assert all(config[k].startswith("127.0.0.1:") for k in ("healthzBindAddress", "metricsBindAddress"))
    # The operator's copy in the docs is the file's.
    extenders = "extenders:\n" + (DEPLOY / "kube-scheduler" / "config.yaml").read_text().split("\nextenders:\n", 1)[1]
    assert textwrap.indent(extenders, "    ") in (REPO / "docs" / "kubernetes.md").read_text()

    daemonset = one("DaemonSet", "gemtrace-scheduler-extender")
    spec = daemonset["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert container["image"] == "gemtrace/gemtrace" and container["imagePullPolicy"] == "IfNotPresent"
    args = cli.parser().parse_args(container["command"][1:])
    assert args.func is cli.cmd_kube_extender and args.listen == defaults.EXTENDER_LISTEN
    host, port = defaults.EXTENDER_LISTEN.split(":")
    probe = container["readinessProbe"]["httpGet"]
    assert (probe["host"], str(probe["port"]), probe["path"]) == (host, port, extender.HEALTH_PATH)
    # On loopback, where kube-scheduler is: the host's network, on the control-plane hosts, their taints
    # tolerated. It reads nothing of the apiserver: no token.
    assert spec["hostNetwork"] is True and spec["automountServiceAccountToken"] is False
    assert spec["nodeSelector"] == {"node-role.kubernetes.io/control-plane": ""}
    tolerated = {(t["key"], t["effect"]) for t in spec["tolerations"] if t["operator"] == "Exists"}
    assert {("node-role.kubernetes.io/control-plane", "NoSchedule"),
            ("node-role.kubernetes.io/master", "NoSchedule")} <= tolerated
    assert container["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
