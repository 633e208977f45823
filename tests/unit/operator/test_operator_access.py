"""Who may reach an LLMDeployment's engines: its NetworkPolicy lets in the fleet's router and
operator pods only (from the fleet's namespace, so cluster-wide too) and denies egress to cloud
metadata; its engines require the key of a Secret it owns, read from env, never from args."""

from __future__ import annotations

import base64
import json
from typing import Any

import kubeschemas
import pytest

from fleetllm.api.contract import ENGINE_KEY_FIELD, engine_key, engine_key_secret
from fleetllm.api.manifests import parse_llmdeployment
from fleetllm.operator.admission import new_key_secret
from fleetllm.operator.render import render
from fleetllm.planner.plan import plan
from fleetllm.planner.settings import OperatorConfig
from fleetllm.policy.model import Policy


def _cr(backend: str = "builtin") -> Any:
    return parse_llmdeployment(
        {
            "apiVersion": "fleetllm.io/v1alpha1",
            "kind": "LLMDeployment",
            "metadata": {"name": "smol", "namespace": "team-a", "uid": "u-1"},
            "spec": {
                "model": {"name": "smollm2-135m", "source": "hf://HuggingFaceTB/SmolLM2-135M"},
                "engine": {"backend": backend},
                "gpu": {"type": "cpu" if backend == "builtin" else "L4"},
                "maxModelLen": 2048,
            },
        }
    )


def _objects(config: OperatorConfig, backend: str = "builtin") -> dict[str, dict[str, Any]]:
    cr = _cr(backend)
    return {o["kind"]: o for o in render(cr, plan(cr.spec, config), config)}


def test_the_networkpolicy_lets_in_the_fleet_alone_and_keeps_engines_off_cloud_metadata() -> None:
    extra = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    config = OperatorConfig(
        fleet_namespace="fleet-system",
        fleet_instance="prod",
        policy=Policy(engineIngressFrom=[extra]),
    )
    policy = _objects(config)["NetworkPolicy"]
    for version in ("1.30", "1.37"):
        kubeschemas.validate(policy, version)
    spec = policy["spec"]
    assert spec["podSelector"]["matchLabels"]["app.kubernetes.io/instance"] == "smol"
    assert spec["policyTypes"] == ["Ingress", "Egress"]
    (rule,) = spec["ingress"]
    assert rule["ports"] == [{"port": "http", "protocol": "TCP"}]
    router, operator, monitoring = rule["from"]
    for peer, component in ((router, "router"), (operator, "operator")):
        # One peer with both selectors: these pods in the fleet's namespace, not pods a tenant
        # labels alike in its own.
        assert peer["namespaceSelector"] == {
            "matchLabels": {"kubernetes.io/metadata.name": "fleet-system"}
        }
        assert peer["podSelector"]["matchLabels"] == {
            "app.kubernetes.io/name": "fleetllm",
            "app.kubernetes.io/instance": "prod",
            "app.kubernetes.io/component": component,
        }
    assert monitoring == extra
    blocks = [peer["ipBlock"] for egress in spec["egress"] for peer in egress["to"]]
    assert {"cidr": "0.0.0.0/0", "except": ["169.254.169.254/32"]} in blocks
    assert all(b["except"] for b in blocks)  # no rule lets metadata back in


@pytest.mark.parametrize(
    ("backend", "variable"), [("builtin", "FLEETLLM_API_KEY"), ("vllm", "VLLM_API_KEY")]
)
def test_the_engine_reads_its_required_key_from_the_owned_secret(
    backend: str, variable: str
) -> None:
    objects = _objects(OperatorConfig(), backend)
    pod = objects["Deployment"]["spec"]["template"]["spec"]
    (engine,) = pod["containers"]
    env = {var["name"]: var for var in engine["env"]}
    assert env[variable]["valueFrom"] == {
        "secretKeyRef": {"name": "smol-engine-key", "key": ENGINE_KEY_FIELD}
    }
    # The pull container never gets the key; nothing else carries it.
    assert all(var["name"] != variable for var in pod["initContainers"][0]["env"])
    assert "--api-key" not in engine["args"]

    secret = new_key_secret(_cr(backend))
    kubeschemas.validate(secret, "1.30")
    assert secret["metadata"]["name"] == engine_key_secret("smol")
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    key = _key(secret)
    assert len(key) >= 40 and key != _key(new_key_secret(_cr(backend)))
    assert key not in json.dumps(objects)


def _key(secret: dict[str, Any]) -> str:
    return base64.b64decode(secret["data"][ENGINE_KEY_FIELD]).decode()


def test_with_a_root_the_key_is_the_derived_one() -> None:
    cr = _cr()
    secret = new_key_secret(cr, root="fleet-root")
    kubeschemas.validate(secret, "1.30")
    assert _key(secret) == engine_key("fleet-root", "team-a", "smol", "u-1")
    assert _key(new_key_secret(cr, root="fleet-root")) == _key(secret)  # stable
    assert _key(new_key_secret(cr, root="rotated")) != _key(secret)
    # Offline (`fleetllm render`), the API server has given no uid: a random key.
    offline = parse_llmdeployment(
        {**cr.model_dump(by_alias=True, exclude_none=True), "metadata": {"name": "smol"}}
    )
    assert _key(new_key_secret(offline, root="fleet-root")) != _key(
        new_key_secret(offline, root="fleet-root")
    )


def test_a_spec_cannot_replace_the_engine_key() -> None:
    cr = parse_llmdeployment(
        {
            **_cr().model_dump(by_alias=True, exclude_none=True),
            "spec": {
                **_cr().spec.model_dump(by_alias=True, exclude_none=True),
                "engine": {"env": [{"name": "FLEETLLM_API_KEY", "value": "known"}]},
            },
        }
    )
    deployment = next(o for o in render(cr, plan(cr.spec)) if o["kind"] == "Deployment")
    env = deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    assert [v for v in env if v["name"] == "FLEETLLM_API_KEY"] == [
        {
            "name": "FLEETLLM_API_KEY",
            "valueFrom": {"secretKeyRef": {"name": "smol-engine-key", "key": "api-key"}},
        }
    ]


def test_pdbs_let_a_never_ready_replica_be_evicted() -> None:
    pdb = _objects(OperatorConfig())["PodDisruptionBudget"]
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
