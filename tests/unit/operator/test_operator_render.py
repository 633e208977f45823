"""Rendering: every example's objects are valid Kubernetes objects, shaped as the contracts say."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import kubeschemas
import pytest
import yaml
from examples import ALL_EXAMPLES

from fleetllm.api.contract import ANNOTATION_APPLIED
from fleetllm.api.deployment import LLMDeployment
from fleetllm.api.manifests import load_llmdeployments
from fleetllm.operator.pod_env import CACHE_FOLDERS
from fleetllm.operator.reconciler import is_subset, needs_apply
from fleetllm.operator.render import render
from fleetllm.planner.plan import plan

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = ALL_EXAMPLES
KUBERNETES_VERSIONS = ("1.30", "1.37")


def _owned(cr: LLMDeployment) -> LLMDeployment:
    meta = cr.metadata.model_copy(
        update={
            "uid": "0b7c6f5e-1d2a-4c3b-9e8f-7a6b5c4d3e2f",
            "namespace": cr.metadata.namespace or "default",
        }
    )
    return cr.model_copy(update={"metadata": meta})


def _rendered(path: Path) -> list[tuple[LLMDeployment, list[dict[str, Any]]]]:
    return [(cr, render(_owned(cr), plan(cr.spec))) for cr in load_llmdeployments(path)]


def test_there_are_examples_of_every_kind_users_start_from() -> None:
    specs = [cr.spec for path in EXAMPLES for cr in load_llmdeployments(path)]
    assert len(specs) >= 5
    assert any(s.gpu.type == "cpu" and s.model.source.startswith("builtin://") for s in specs)
    assert any(s.gpu.type == "L4" and s.quantization.weights == "awq" for s in specs)
    assert any(s.gpu.type == "H100-80GB" and s.parallelism.tensor == 1 for s in specs)
    assert any(
        s.gpu.type == "H100-80GB" and s.parallelism.tensor == 4 and s.quantization.kv_cache == "fp8"
        for s in specs
    )
    assert any(s.engine.backend == "vllm" for s in specs)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_rendered_object_is_valid_kubernetes(path: Path, version: str) -> None:
    for _, objects in _rendered(path):
        assert [o["kind"] for o in objects] == [
            "ConfigMap",
            "Service",
            "Deployment",
            "PodDisruptionBudget",
            "NetworkPolicy",
        ]
        for obj in objects:
            kubeschemas.validate(obj, version)


def test_an_invalid_object_fails_the_schema_check() -> None:
    ((_, objects),) = _rendered(EXAMPLES[0])
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "http"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubeschemas.validate(deployment, "1.30")
    deployment["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = 8000
    deployment["spec"]["template"]["spec"]["containers"][0]["probe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubeschemas.validate(deployment, "1.37")


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_children_carry_labels_owner_and_router_contract(path: Path) -> None:
    for cr, objects in _rendered(path):
        name, model = cr.metadata.name, cr.spec.model.name
        for obj in objects:
            labels = obj["metadata"]["labels"]
            assert labels == {
                "app.kubernetes.io/name": "fleetllm",
                "app.kubernetes.io/instance": name,
                "app.kubernetes.io/component": "engine",
                "app.kubernetes.io/managed-by": "fleetllm",
                "fleetllm.io/model": model,
            }
            (owner,) = obj["metadata"]["ownerReferences"]
            assert (owner["kind"], owner["name"], owner["controller"]) == (
                "LLMDeployment",
                name,
                True,
            )
        by_kind = {o["kind"]: o for o in objects}
        service, deployment = by_kind["Service"], by_kind["Deployment"]
        assert service["spec"]["clusterIP"] == "None"
        assert service["spec"]["ports"] == [
            {
                "name": "http",
                "port": 8000,
                "targetPort": "http",
                "protocol": "TCP",
                "appProtocol": "http",
            }
        ]
        pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert is_subset(service["spec"]["selector"], pod_labels)
        assert is_subset(
            by_kind["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"], pod_labels
        )
        assert deployment["spec"]["replicas"] == cr.spec.desired_replicas()


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_engine_pods_are_hardened_probed_and_drained(path: Path) -> None:
    for cr, objects in _rendered(path):
        deployment = next(o for o in objects if o["kind"] == "Deployment")
        pod = deployment["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert container["securityContext"] == {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
        }
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
        pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
        # The drain hook, inline (vLLM's image has python3 but not fleetllm): settle, cap, port.
        assert pre_stop[:2] == ["python3", "-c"]
        settle, cap, port = (int(v) for v in pre_stop[3:])
        assert (cap, port) == (cr.spec.engine.drain_seconds, 8000)
        grace = pod["terminationGracePeriodSeconds"]
        assert grace > settle + cap
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert {"/var/cache/fleetllm", "/tmp"} <= mounts


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_engines_run_as_a_named_user_with_every_cache_on_a_writable_volume(path: Path) -> None:
    """vLLM's image has no passwd entry for uid 1000 and a read-only root: the user is named,
    and HOME and every cache folder are on a writable emptyDir (tests/integration/vllm starts
    the real vLLM so)."""
    for _, objects in _rendered(path):
        pod = next(o for o in objects if o["kind"] == "Deployment")["spec"]["template"]["spec"]
        for container in [*pod["containers"], *pod.get("initContainers", [])]:
            env = {var["name"]: var.get("value") for var in container["env"]}
            assert env["USER"] == env["LOGNAME"] == "fleetllm"
            writable = [
                m["mountPath"]
                for m in container["volumeMounts"]
                if not m.get("readOnly")
                and "emptyDir" in next(v for v in pod["volumes"] if v["name"] == m["name"])
            ]
            for name in ("HOME", *CACHE_FOLDERS):
                assert any(
                    env[name] == root or env[name].startswith(root + "/") for root in writable
                ), (name, env[name], writable)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_engine_pods_carry_no_service_account_token(path: Path) -> None:
    """An engine never calls the Kubernetes API: its pod mounts no token, whatever
    ServiceAccount the admin's policy lets it run as (a token there would hand the API to
    whatever code the model's files bring)."""
    for _, objects in _rendered(path):
        pod = next(o for o in objects if o["kind"] == "Deployment")["spec"]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is False
        assert pod["enableServiceLinks"] is False


def _deployment(path: str) -> tuple[LLMDeployment, dict[str, Any]]:
    ((cr, objects),) = _rendered(ROOT / "manifests" / "examples" / path)
    return cr, next(o for o in objects if o["kind"] == "Deployment")


def test_gpu_pods_request_tensor_x_pipeline_gpus_on_the_right_nodes() -> None:
    _, deployment = _deployment("llama-3.1-70b-h100-tp4.yaml")
    pod = deployment["spec"]["template"]["spec"]
    resources = pod["containers"][0]["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == "4"
    assert resources["requests"]["nvidia.com/gpu"] == "4"
    assert pod["nodeSelector"]["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"  # gfd
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    assert {
        "key": "dedicated",
        "operator": "Equal",
        "value": "inference",
        "effect": "NoSchedule",
    } in pod["tolerations"]
    assert any(v["name"] == "dshm" and v["emptyDir"]["medium"] == "Memory" for v in pod["volumes"])
    container = pod["containers"][0]
    assert container["image"].startswith("vllm/vllm-openai:")
    assert container["command"] == ["vllm", "serve"]


def test_cpu_pods_have_no_gpu_and_use_the_builtin_engine() -> None:
    cr, deployment = _deployment("smollm2-cpu.yaml")
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert "nvidia.com/gpu" not in container["resources"]["limits"]
    assert "nvidia.com/gpu.product" not in pod["nodeSelector"]
    assert container["resources"]["limits"]["memory"] == "4Gi"
    assert container["resources"]["requests"]["cpu"] == "2"
    assert container["command"] == ["fleetllm", "engine", "serve"]
    args = container["args"]
    assert args[args.index("--model") + 1] == "smollm2-135m"
    assert args[args.index("--served-model-name") + 1] == cr.spec.model.name


def test_pvc_models_are_mounted_read_only() -> None:
    _, deployment = _deployment("llama-3.1-8b-h100.yaml")
    pod = deployment["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "model"]
    assert volume["persistentVolumeClaim"] == {"claimName": "model-store", "readOnly": True}
    container = pod["containers"][0]
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in container["volumeMounts"]
    args = container["args"]
    assert args[args.index("--model") + 1] == "/models/meta-llama/Llama-3.1-8B-Instruct"


def test_secrets_reach_the_engine_through_env_references() -> None:
    _, deployment = _deployment("llama-3.1-8b-l4-awq.yaml")
    env = deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {
        "name": "HF_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "huggingface", "key": "token"}},
    } in env


def test_apply_is_needed_only_when_the_rendering_or_the_live_object_differs() -> None:
    ((_, objects),) = _rendered(EXAMPLES[0])
    desired = next(o for o in objects if o["kind"] == "Deployment")
    live: dict[str, Any] = yaml.safe_load(yaml.safe_dump(desired))
    # What an API server adds: defaults, status, bookkeeping.
    live["metadata"] |= {"uid": "x", "resourceVersion": "7", "generation": 3}
    live["spec"]["template"]["spec"]["dnsPolicy"] = "ClusterFirst"
    live["spec"]["template"]["spec"]["containers"][0]["terminationMessagePath"] = "/dev/x"
    live["status"] = {"replicas": 1}
    assert not needs_apply(desired, live)
    assert needs_apply(desired, None)

    drifted = yaml.safe_load(yaml.safe_dump(live))
    drifted["spec"]["replicas"] = 7
    assert needs_apply(desired, drifted)

    stale = yaml.safe_load(yaml.safe_dump(live))
    stale["metadata"]["annotations"][ANNOTATION_APPLIED] = "another-rendering"
    assert needs_apply(desired, stale)

    orphaned = yaml.safe_load(yaml.safe_dump(live))
    orphaned["metadata"]["ownerReferences"] = []
    assert needs_apply(desired, orphaned)
