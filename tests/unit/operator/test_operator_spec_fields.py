"""Every engine and pod field of an LLMDeployment reaches the engine pod as written, in objects
Kubernetes accepts (strict schemas), and the combinations a pod cannot run as planned are
refused with the reason."""

from __future__ import annotations

from typing import Any

import kubeschemas
import pytest

from fleetllm.api.deployment import LLMDeployment
from fleetllm.api.manifests import parse_llmdeployment
from fleetllm.operator.crd import crd
from fleetllm.operator.pod_env import base_env
from fleetllm.operator.render import render
from fleetllm.planner.errors import PlanError
from fleetllm.planner.plan import plan

KUBERNETES_VERSIONS = ("1.30", "1.37")
UID = "0b7c6f5e-1d2a-4c3b-9e8f-7a6b5c4d3e2f"


def llmdeployment(**spec: Any) -> LLMDeployment:
    return parse_llmdeployment(
        {
            "apiVersion": "fleetllm.io/v1alpha1",
            "kind": "LLMDeployment",
            "metadata": {"name": "llama", "namespace": "models", "uid": UID},
            "spec": {
                "model": {"name": "llama", "source": "hf://meta-llama/Llama-3.1-8B-Instruct"},
                "gpu": {"type": "H100-80GB"},
                "maxModelLen": 16384,
                **spec,
            },
        }
    )


def deployment(cr: LLMDeployment) -> dict[str, Any]:
    objects = render(cr, plan(cr.spec))
    for obj in objects:
        for version in KUBERNETES_VERSIONS:
            kubeschemas.validate(obj, version)
    (found,) = [o for o in objects if o["kind"] == "Deployment"]
    return found


def _env(container: dict[str, Any]) -> dict[str, Any]:
    names = [var["name"] for var in container["env"]]
    assert len(names) == len(set(names)), names  # server-side apply refuses a name twice
    return {var["name"]: var.get("value", var.get("valueFrom")) for var in container["env"]}


@pytest.mark.parametrize("backend", ["builtin", "vllm"])
def test_spec_env_reaches_the_engine_and_wins_over_ours_the_pull_gets_credentials_only(
    backend: str,
) -> None:
    secret = {"secretKeyRef": {"name": "hf", "key": "token"}}
    cr = llmdeployment(
        engine={
            "backend": backend,
            "env": [
                {"name": "HF_TOKEN", "valueFrom": secret},
                {"name": "HF_HOME", "value": "/var/cache/fleetllm/hub"},
                {"name": "HF_ENDPOINT", "value": "https://hub.attacker.example"},
                {"name": "VLLM_NO_USAGE_STATS", "value": "0"},
            ],
        }
    )
    pod = deployment(cr)["spec"]["template"]["spec"]
    (engine,) = pod["containers"]
    (pull,) = pod["initContainers"]
    env = _env(engine)
    assert env["HF_TOKEN"] == secret
    assert env["HF_HOME"] == "/var/cache/fleetllm/hub"
    assert env["HOME"] == "/var/cache/fleetllm"  # ours, where the spec is silent
    assert env["VLLM_NO_USAGE_STATS"] == "0"
    # The pull fills a cache other LLMDeployments may share: the credentials reach it, an
    # endpoint override (or anything else the policy's pullEnv does not name) never does.
    assert _env(pull) == {**{v["name"]: v["value"] for v in base_env()}, "HF_TOKEN": secret}
    assert "HF_ENDPOINT" not in _env(pull)


def test_an_env_name_given_twice_is_refused_by_the_model_and_the_crd() -> None:
    with pytest.raises(ValueError, match="env sets A more than once"):
        llmdeployment(engine={"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]})
    schema = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    env = schema["properties"]["spec"]["properties"]["engine"]["properties"]["env"]
    # The API server keeps env a map keyed by name: a duplicate is refused at apply.
    assert (env["x-kubernetes-list-type"], env["x-kubernetes-list-map-keys"]) == ("map", ["name"])


def test_every_pod_and_engine_field_reaches_the_pod() -> None:
    cr = llmdeployment(
        engine={"image": "registry.example/vllm:custom", "imagePullPolicy": "Always"},
        pod={
            "resources": {"requests": {"cpu": "6"}, "limits": {"memory": "64Gi"}},
            "nodeSelector": {"pool": "inference"},
            "tolerations": [
                {"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"},
                {
                    "key": "spot",
                    "operator": "Exists",
                    "effect": "NoExecute",
                    "tolerationSeconds": 30,
                },
            ],
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {
                                "matchExpressions": [
                                    {"key": "zone", "operator": "In", "values": ["a"]}
                                ]
                            }
                        ]
                    }
                }
            },
            "priorityClassName": "inference",
            "serviceAccountName": "engine",
            "annotations": {"example.com/team": "search"},
        },
    )
    template = deployment(cr)["spec"]["template"]
    pod = template["spec"]
    (engine,) = pod["containers"]
    assert engine["image"] == "registry.example/vllm:custom"
    assert engine["imagePullPolicy"] == "Always"
    assert engine["resources"]["requests"]["cpu"] == "6"
    assert engine["resources"]["limits"]["memory"] == "64Gi"
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == "1"  # planned, kept
    assert pod["nodeSelector"]["pool"] == "inference"
    assert {
        "key": "spot",
        "operator": "Exists",
        "effect": "NoExecute",
        "tolerationSeconds": 30,
    } in (pod["tolerations"])
    assert pod["affinity"] == cr.spec.pod.affinity
    assert pod["priorityClassName"] == "inference"
    assert pod["serviceAccountName"] == "engine"
    assert template["metadata"]["annotations"]["example.com/team"] == "search"


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ({"pod": {"resources": {"limits": {"nvidia.com/gpu": 2}}}}, "runs on 1"),
        (
            {
                "engine": {"backend": "vllm"},
                "parallelism": {"tensor": 2},
                "pod": {"resources": {"requests": {"nvidia.com/gpu": "1"}}},
            },
            "parallelism 2 x 1 runs on 2",
        ),
        (
            {
                "model": {"name": "smol", "source": "builtin://smollm2-135m"},
                "gpu": {"type": "cpu"},
                "maxModelLen": 2048,
                "pod": {"resources": {"limits": {"nvidia.com/gpu": "1"}}},
            },
            "gpu.type cpu",
        ),
    ],
)
def test_a_gpu_count_other_than_the_planned_one_is_refused(
    spec: dict[str, Any], words: str
) -> None:
    with pytest.raises(PlanError) as info:
        plan(llmdeployment(**spec).spec)
    assert info.value.reason == "InvalidResources"
    assert words in info.value.message


def test_the_planned_gpu_count_may_be_written_out() -> None:
    cr = llmdeployment(pod={"resources": {"limits": {"nvidia.com/gpu": "1"}}})
    (engine,) = deployment(cr)["spec"]["template"]["spec"]["containers"]
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == "1"
