"""The admin's policy: each rule refuses the field it names (and says which rule), its
exceptions let a field through, `fleetllm render --policy` exits non-zero naming each refused
field, and what only the cluster can tell (a Secret's labels) is a warning offline."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from deployment_manifests import smollm2
from examples import ALL_EXAMPLES

from fleetllm.api.deployment import LLMDeployment
from fleetllm.api.manifests import parse_llmdeployment
from fleetllm.cli import main
from fleetllm.operator.admission import review
from fleetllm.planner.plan import plan
from fleetllm.planner.settings import OperatorConfig
from fleetllm.policy.check import SecretRef, secret_refusal
from fleetllm.policy.model import DEFAULT_POLICY, Policy, load_policy

EXAMPLES = Path(__file__).resolve().parents[3] / "manifests" / "examples"


def cpu_deployment(**spec: Any) -> LLMDeployment:
    return parse_llmdeployment(smollm2("smol", "team-a", **({"maxModelLen": 2048} | spec)))


def refused(cr: LLMDeployment, policy: Policy = DEFAULT_POLICY) -> dict[str, str]:
    """Refused field -> the policy rule that refuses it."""
    report = review(cr, plan(cr.spec), OperatorConfig(policy=policy))
    return {v.field: v.rule for v in report.violations}


# What the examples' cluster admin allows beyond the defaults: their scheduling choices.
EXAMPLES_POLICY = Policy.model_validate(
    {
        "allowedPriorityClasses": ["inference"],
        "allowedTolerationKeys": ["nvidia.com/gpu", "dedicated"],
    }
)


@pytest.mark.parametrize("path", ALL_EXAMPLES, ids=lambda p: p.stem)
def test_the_examples_pass_a_policy_that_allows_their_scheduling(path: Path) -> None:
    for doc in yaml.safe_load_all(path.read_text()):
        cr = parse_llmdeployment(doc)
        assert refused(cr, EXAMPLES_POLICY) == {}


def test_each_default_rule_refuses_the_field_it_names() -> None:
    cr = cpu_deployment(
        engine={
            "image": "docker.io/attacker/engine:1",
            "env": [
                {"name": "LD_PRELOAD", "value": "/models/x/evil.json"},
                {"name": "PYTHONPATH", "value": "/models/x"},
                {"name": "HF_ENDPOINT", "value": "https://hub.attacker.example"},
                {"name": "aws_endpoint_url_s3", "value": "https://s3.attacker.example"},
                {"name": "https_proxy", "value": "http://proxy.attacker.example"},
                {"name": "LOG_LEVEL", "value": "debug"},
            ],
        },
        pod={
            "serviceAccountName": "cloud-admin",
            "annotations": {
                "container.apparmor.security.beta.kubernetes.io/engine": "unconfined",
                "sidecar.istio.io/inject": "true",
                "team": "a",
            },
            "priorityClassName": "system-node-critical",
            "tolerations": [
                {"operator": "Exists"},
                {"key": "node-role.kubernetes.io/control-plane", "operator": "Exists"},
                {"key": "nvidia.com/gpu", "operator": "Exists"},
            ],
        },
    )
    assert refused(cr) == {
        "spec.engine.image": "allowedImageRegistries",
        "spec.engine.env[0].name": "env.denied",
        "spec.engine.env[1].name": "env.denied",
        "spec.engine.env[2].name": "env.denied",
        "spec.engine.env[3].name": "env.denied",
        "spec.engine.env[4].name": "env.denied",
        "spec.pod.serviceAccountName": "allowedServiceAccounts",
        "spec.pod.annotations[container.apparmor.security.beta.kubernetes.io/engine]": (
            "annotations.denied"
        ),
        "spec.pod.annotations[sidecar.istio.io/inject]": "annotations.denied",
        "spec.pod.priorityClassName": "allowedPriorityClasses",
        "spec.pod.tolerations[0].key": "allowedTolerationKeys",
        "spec.pod.tolerations[1].key": "allowedTolerationKeys",
    }


def test_flags_that_run_the_authors_code_are_refused() -> None:
    cr = cpu_deployment(
        model={"name": "smol", "source": "hf://HuggingFaceTB/SmolLM2-135M"},
        engine={"backend": "vllm", "extraArgs": ["--trust-remote-code"]},
        gpu={"type": "L4"},
    )
    assert refused(cr) == {"spec.engine.extraArgs[0]": "extraArgs.denied"}
    allowing = Policy.model_validate(
        {"extraArgs": {"denied": ["*"], "allowed": ["--trust-remote-code"]}}
    )
    assert refused(cr, allowing) == {}


def test_what_makes_vllm_run_a_pulled_file_is_refused() -> None:
    # Any file of the author's own repository lands in the pod (a `*.json` may hold anything):
    # vLLM hands a logging config to logging.config.dictConfig, which calls what its "()"
    # entries name, dlopens the libraries named by *_SO_PATH, imports a plugin file.
    planted = "/var/cache/fleetllm/models/hf/attacker/repo/main/config.json"
    cr = cpu_deployment(
        model={"name": "smol", "source": "hf://attacker/repo", "architecture": "SmolLM2-135M"},
        engine={
            "backend": "vllm",
            "env": [
                {"name": "VLLM_LOGGING_CONFIG_PATH", "value": planted},
                {"name": "VLLM_NCCL_SO_PATH", "value": planted},
                {"name": "vllm_cudart_so_path", "value": planted},
                {"name": "VLLM_RUST_FRONTEND_PATH", "value": planted},
                {"name": "VLLM_NO_USAGE_STATS", "value": "1"},
            ],
            "extraArgs": [
                f"--log-config-file={planted}",
                "--tool-parser-plugin", planted,
                f"--reasoning-parser-plugin={planted}",
                "--tool-call-parser=hermes",
            ],
        },
        gpu={"type": "L4"},
    )  # fmt: skip
    assert refused(cr) == {
        "spec.engine.env[0].name": "env.denied",
        "spec.engine.env[1].name": "env.denied",
        "spec.engine.env[2].name": "env.denied",
        "spec.engine.env[3].name": "env.denied",
        "spec.engine.extraArgs[0]": "extraArgs.denied",
        "spec.engine.extraArgs[1]": "extraArgs.denied",
        "spec.engine.extraArgs[3]": "extraArgs.denied",
    }


@pytest.mark.parametrize("arg", ["--trust_remote_code", "--trust-remote", "--trust-remote-c"])
def test_a_denied_flag_is_refused_under_every_spelling_vllm_reads(arg: str) -> None:
    # vLLM's parser takes underscores and unique prefixes for the flag they name.
    cr = cpu_deployment(
        model={"name": "smol", "source": "hf://HuggingFaceTB/SmolLM2-135M"},
        engine={"backend": "vllm", "extraArgs": [arg]},
        gpu={"type": "L4"},
    )
    assert refused(cr) == {"spec.engine.extraArgs[0]": "extraArgs.denied"}


def test_the_admin_allows_what_the_defaults_refuse() -> None:
    cr = cpu_deployment(
        engine={
            "image": "registry.corp.example/engines/fleetllm:1",
            "env": [{"name": "HF_ENDPOINT", "value": "https://hub-mirror.corp.example"}],
        },
        pod={
            "serviceAccountName": "engine-reader",
            "priorityClassName": "inference-high",
            "tolerations": [{"key": "dedicated", "value": "llm", "effect": "NoSchedule"}],
        },
    )
    policy = Policy.model_validate(
        {
            "allowedImageRegistries": ["registry.corp.example/engines/"],
            "allowedServiceAccounts": ["engine-*"],
            "env": {"denied": ["*_ENDPOINT"], "allowed": ["HF_ENDPOINT"]},
            "allowedPriorityClasses": ["inference-*"],
            "allowedTolerationKeys": ["dedicated"],
        }
    )
    assert refused(cr) != {}
    assert refused(cr, policy) == {}


def test_an_annotation_allowlist_is_a_denial_of_everything_with_exceptions() -> None:
    cr = cpu_deployment(pod={"annotations": {"team": "a", "cost-center": "42"}})
    policy = Policy.model_validate({"annotations": {"denied": ["*"], "allowed": ["team"]}})
    assert refused(cr, policy) == {"spec.pod.annotations[cost-center]": "annotations.denied"}


def test_resource_caps_count_planned_values_and_overrides() -> None:
    policy = Policy.model_validate(
        {"maxResources": {"memory": "8Gi", "cpu": "8"}, "maxReplicas": 4}
    )
    # The planned memory of a 135M model on CPU fits; a 64Gi override does not, nor 10 replicas.
    assert refused(cpu_deployment(), policy) == {}
    cr = cpu_deployment(pod={"resources": {"limits": {"memory": "64Gi"}}}, replicas=10)
    # (The planner sizes the replica's memory request from the limit it is given.)
    assert refused(cr, policy) == {
        "spec.pod.resources.requests.memory": "maxResources.memory",
        "spec.pod.resources.limits.memory": "maxResources.memory",
        "spec.replicas": "maxReplicas",
    }
    tight = Policy.model_validate({"maxResources": {"cpu": "1"}})
    assert refused(cpu_deployment(), tight) == {
        "spec.pod.resources.requests.cpu": "maxResources.cpu"
    }


def test_model_claims_can_be_limited() -> None:
    cr = cpu_deployment(
        model={
            "name": "m",
            "source": "pvc://other-team-models/smol",
            "architecture": "SmolLM2-135M",
        }
    )
    assert refused(cr) == {}
    policy = Policy.model_validate({"allowedModelClaims": ["team-a-*"]})
    assert refused(cr, policy) == {"spec.model.source": "allowedModelClaims"}


def test_a_secret_needs_the_admins_label() -> None:
    ref = SecretRef("spec.engine.env[0].valueFrom.secretKeyRef", "hf")
    assert secret_refusal(ref, {"fleetllm.io/engine-env": "true"}, DEFAULT_POLICY) is None
    unlabelled = secret_refusal(ref, {"app": "x"}, DEFAULT_POLICY)
    assert unlabelled is not None and unlabelled.rule == "secretLabel"
    assert "lacks the label fleetllm.io/engine-env" in str(unlabelled)
    missing = secret_refusal(ref, None, DEFAULT_POLICY)
    assert missing is not None and "does not exist" in str(missing)
    valued = Policy(secretLabel="fleetllm.io/tenant=a")
    assert secret_refusal(ref, {"fleetllm.io/tenant": "b"}, valued) is not None
    assert secret_refusal(ref, {"fleetllm.io/tenant": "a"}, valued) is None


def test_render_with_a_policy_names_each_refused_field_and_warns_about_secrets(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    manifest = tmp_path / "llmd.yaml"
    cr = cpu_deployment(
        engine={
            "env": [
                {"name": "LD_PRELOAD", "value": "/x.so"},
                {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "t"}}},
            ]
        },
        pod={"serviceAccountName": "cloud-admin"},
    )
    manifest.write_text(yaml.safe_dump(cr.model_dump(by_alias=True, exclude_none=True)))
    assert main(["render", "-f", str(manifest)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""  # nothing refused is printed for kubectl apply
    assert "smol: refused by policy: spec.engine.env[0].name: LD_PRELOAD" in captured.err
    assert "(policy env.denied)" in captured.err
    assert "spec.pod.serviceAccountName: cloud-admin is not allowed" in captured.err
    assert "warning: spec.engine.env[1].valueFrom.secretKeyRef: Secret hf must carry" in (
        captured.err
    )

    policy = tmp_path / "policy.yaml"
    policy.write_text(
        yaml.safe_dump(
            {
                "env": {"denied": ["LD_*"], "allowed": ["LD_PRELOAD"]},
                "allowedServiceAccounts": ["cloud-admin"],
            }
        )
    )
    assert main(["render", "-f", str(manifest), "--policy", str(policy)]) == 0
    captured = capsys.readouterr()
    kinds = [d["kind"] for d in yaml.safe_load_all(captured.out)]
    assert "Deployment" in kinds and "Secret" in kinds
    assert "Secret hf must carry the label fleetllm.io/engine-env" in captured.err


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("allowedImageRegistrys: []\n", "allowedImageRegistrys"),
        ("maxResources: {memory: lots}\n", "'lots' is not a Kubernetes quantity"),
        ("- a list\n", "a policy is a mapping"),
    ],
)
def test_a_bad_policy_file_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str
) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(text)
    assert main(["render", "-f", str(EXAMPLES / "smollm2-cpu.yaml"), "--policy", str(policy)]) == 2
    assert message in capsys.readouterr().err


def test_an_empty_policy_file_is_the_default_policy(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text("")
    assert load_policy(policy) == DEFAULT_POLICY
