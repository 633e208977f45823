"""The install manifests (manifests/base): valid objects, a runnable command, enough RBAC."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from openapi_schema_validator import OAS30Validator

from fleetllm.cli import build_parser, main
from fleetllm.operator.api import LLMDEPLOYMENTS
from fleetllm.operator.cli import config_from_args
from fleetllm.operator.config import ModelCache, OperatorConfig
from fleetllm.operator.install import monitoring_objects, operator_objects
from fleetllm.operator.reconciler import (
    AUTOSCALER_RESOURCES,
    CHILD_RESOURCES,
    READ_RESOURCES,
    is_subset,
)
from fleetllm.operator.render import selector_labels

ROOT = Path(__file__).resolve().parents[3]
BASE = ROOT / "manifests" / "base"


def _objects() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    objects: list[dict[str, Any]] = []
    for entry in kustomization["resources"]:
        path = (BASE / entry).resolve()
        files = (
            [
                path / r
                for r in yaml.safe_load((path / "kustomization.yaml").read_text())["resources"]
            ]
            if path.is_dir()
            else [path]
        )
        for file in files:
            objects += [doc for doc in yaml.safe_load_all(file.read_text()) if doc]
    return objects


def _by_kind(kind: str) -> list[dict[str, Any]]:
    return [o for o in _objects() if o["kind"] == kind]


@pytest.mark.parametrize("version", ["1.30", "1.37"])
def test_built_in_objects_are_valid(version: str) -> None:
    builtin = [
        o
        for o in _objects()
        if "." not in o["apiVersion"].split("/")[0]
        or o["apiVersion"].startswith(("apiextensions.k8s.io", "rbac."))
    ]
    assert {o["kind"] for o in builtin} >= {
        "CustomResourceDefinition",
        "Namespace",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
        "Deployment",
        "Service",
        "PodDisruptionBudget",
    }
    for obj in builtin:
        kubernetes_validate.validate(obj, version, strict=True)


def test_the_peering_object_matches_its_crd() -> None:
    (peering,) = _by_kind("ClusterKopfPeering")
    crd = next(
        c
        for c in _by_kind("CustomResourceDefinition")
        if c["spec"]["names"]["kind"] == "ClusterKopfPeering"
    )
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert list(OAS30Validator(schema).iter_errors(peering)) == []


def _deployment(component: str) -> dict[str, Any]:
    (deployment,) = [
        d
        for d in _by_kind("Deployment")
        if d["metadata"]["labels"]["app.kubernetes.io/component"] == component
    ]
    return deployment


def _granted(role: dict[str, Any]) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def _role(kind: str, name: str) -> dict[str, Any]:
    (role,) = [r for r in _by_kind(kind) if r["metadata"]["name"] == name]
    return role


def test_the_checked_in_manifests_are_what_the_builders_make(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for part, path in (
        ("base", BASE / "fleetllm.yaml"),
        ("monitoring", ROOT / "manifests" / "monitoring" / "monitoring.yaml"),
    ):
        assert main(["manifests", part]) == 0
        assert capsys.readouterr().out == path.read_text(), (
            f"regenerate: fleetllm manifests {part} > {path.relative_to(ROOT)}"
        )


def test_the_operator_command_parses_and_uses_the_peering_object() -> None:
    deployment = _deployment("operator")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    args = build_parser().parse_args([*container["command"][1:], *container["args"]])
    assert args.all_namespaces
    assert not args.standalone
    (peering,) = _by_kind("ClusterKopfPeering")
    assert args.peering == peering["metadata"]["name"]
    assert deployment["spec"]["replicas"] >= 2


def test_operator_configuration_reaches_its_command() -> None:
    config = OperatorConfig(gpu_profile="gke", model_cache=ModelCache("models", read_only=True))
    (deployment,) = [o for o in operator_objects(config=config) if o["kind"] == "Deployment"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    args = build_parser().parse_args([*container["command"][1:], *container["args"]])
    assert config_from_args(args) == config


def test_rbac_covers_every_resource_the_operator_touches() -> None:
    granted = _granted(_role("ClusterRole", "fleetllm-operator"))
    resources = {**CHILD_RESOURCES, **READ_RESOURCES, "LLMDeployment": LLMDEPLOYMENTS}
    for kind, ref in resources.items():
        group = ref.api_version.rpartition("/")[0]
        verbs = {"get"} if kind in READ_RESOURCES else {"get", "list", "watch", "patch"}
        if kind in CHILD_RESOURCES:
            verbs.add("create")  # server-side apply creates missing children
        for verb in verbs:
            assert (group, ref.plural, verb) in granted, (kind, verb)
    assert ("fleetllm.io", "llmdeployments/status", "patch") in granted
    # The autoscaler: the scale subresource, the engine pods (pod-deletion-cost), and the
    # HPA or ScaledObject of spec.scaling.mode (and their removal when the mode changes).
    assert ("fleetllm.io", "llmdeployments/scale", "patch") in granted
    assert {("", "pods", v) for v in ("get", "list", "patch")} <= granted
    for ref in AUTOSCALER_RESOURCES.values():
        group = ref.api_version.rpartition("/")[0]
        for verb in ("get", "create", "patch", "delete"):
            assert (group, ref.plural, verb) in granted, (ref.kind, verb)
    assert ("", "events", "create") in granted
    assert ("kopf.dev", "clusterkopfpeerings", "patch") in granted
    assert ("", "persistentvolumeclaims", "create") not in granted
    assert not any(resource == "secrets" for _, resource, _ in granted)


def test_the_router_runs_in_the_cluster_with_kubernetes_discovery_and_keys_from_a_secret() -> None:
    deployment = _deployment("router")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert deployment["spec"]["replicas"] == 2
    args = build_parser().parse_args([*container["command"][1:], *container["args"]])
    assert args.func.__module__ == "fleetllm.router.cli"
    assert args.discovery == "kubernetes" and args.all_namespaces
    assert container["ports"][0]["containerPort"] == args.port
    secret_namespace, _, secret = args.api_keys_secret.partition("/")
    assert secret_namespace == deployment["metadata"]["namespace"]
    assert pod["serviceAccountName"] == "fleetllm-router"
    assert pod["terminationGracePeriodSeconds"] > args.shutdown_timeout

    (service,) = [s for s in _by_kind("Service") if s["metadata"]["name"] == "fleetllm-router"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"] == pod_labels
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    (pdb,) = _by_kind("PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"] == pod_labels
    assert pdb["spec"]["minAvailable"] == 1

    # Least privilege: discovery reads, scale-from-zero patches the scale subresource, and
    # the one Secret by name in the router's own namespace.
    granted = _granted(_role("ClusterRole", "fleetllm-router"))
    assert granted == {
        ("fleetllm.io", "llmdeployments", "get"),
        ("fleetllm.io", "llmdeployments", "list"),
        ("fleetllm.io", "llmdeployments", "watch"),
        ("fleetllm.io", "llmdeployments/scale", "get"),
        ("fleetllm.io", "llmdeployments/scale", "patch"),
        ("", "services", "get"),
        ("", "services", "list"),
        ("", "services", "watch"),
        ("discovery.k8s.io", "endpointslices", "get"),
        ("discovery.k8s.io", "endpointslices", "list"),
        ("discovery.k8s.io", "endpointslices", "watch"),
    }
    keys = _role("Role", "fleetllm-router")
    assert keys["metadata"]["namespace"] == secret_namespace
    assert keys["rules"] == [
        {"apiGroups": [""], "resources": ["secrets"], "resourceNames": [secret], "verbs": ["get"]}
    ]
    for kind, role_kind in (("ClusterRoleBinding", "ClusterRole"), ("RoleBinding", "Role")):
        binding = _role(kind, "fleetllm-router")
        assert binding["roleRef"]["kind"] == role_kind
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "fleetllm-router", "namespace": secret_namespace}
        ]


def test_monitors_scrape_the_engines_and_the_router_on_their_http_ports() -> None:
    pod_monitor, service_monitor = monitoring_objects()
    assert pod_monitor["kind"] == "PodMonitor" and service_monitor["kind"] == "ServiceMonitor"
    assert pod_monitor["spec"]["namespaceSelector"] == {"any": True}
    engine_labels = selector_labels("any-name")
    assert is_subset(pod_monitor["spec"]["selector"]["matchLabels"], engine_labels)
    (endpoint,) = pod_monitor["spec"]["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("http", "/metrics")
    router = _deployment("router")
    assert (
        service_monitor["spec"]["selector"]["matchLabels"]
        == router["spec"]["template"]["metadata"]["labels"]
    )
    (endpoint,) = service_monitor["spec"]["endpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("http", "/metrics")
