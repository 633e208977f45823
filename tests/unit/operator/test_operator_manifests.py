"""The install manifests (manifests/base): valid objects, a runnable command, enough RBAC."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from openapi_schema_validator import OAS30Validator

from fleetllm.cli import build_parser
from fleetllm.operator.kube import RESOURCES

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
        "Deployment",
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


def test_the_operator_command_parses_and_uses_the_peering_object() -> None:
    (deployment,) = _by_kind("Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    args = build_parser().parse_args([*container["command"][1:], *container["args"]])
    assert args.all_namespaces
    assert not args.standalone
    (peering,) = _by_kind("ClusterKopfPeering")
    assert args.peering == peering["metadata"]["name"]
    assert deployment["spec"]["replicas"] >= 2


def test_rbac_covers_every_resource_the_operator_touches() -> None:
    (role,) = _by_kind("ClusterRole")
    granted = {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    for kind, ref in RESOURCES.items():
        group = ref.api_version.rpartition("/")[0]
        verbs = {"get", "list", "watch", "patch"}
        if kind != "LLMDeployment":
            verbs.add("create")  # server-side apply creates missing children
        for verb in verbs:
            assert (group, ref.plural, verb) in granted, (kind, verb)
    assert ("fleetllm.io", "llmdeployments/status", "patch") in granted
    assert ("", "events", "create") in granted
    assert ("kopf.dev", "clusterkopfpeerings", "patch") in granted
