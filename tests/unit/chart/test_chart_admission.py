"""The chart's admission policies, their CEL evaluated (cel-python) on the requests they judge:
the LLMDeployment policy refuses what the operator's policy check refuses (the rules CEL can
check), and the operator-scope policy keeps the operator's writes to its own objects and, on
pods, to the pod-deletion-cost annotation. The chart's policy values are the code's defaults."""

from __future__ import annotations

import copy
import functools
from typing import Any

import celpy
import pytest
import yaml
from deployment_manifests import smollm2
from helmchart import CHART, NAMESPACE, by_kind, render
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleetllm.api.manifests import parse_llmdeployment
from fleetllm.operator.admission import review
from fleetllm.planner.plan import plan
from fleetllm.planner.settings import OperatorConfig
from fleetllm.policy.model import DEFAULT_POLICY, Policy

VALUES = yaml.safe_load((CHART / "values.yaml").read_text())
OPERATOR = f"system:serviceaccount:{NAMESPACE}:fleetllm-operator"
COST = "controller.kubernetes.io/pod-deletion-cost"
MANAGED = {"app.kubernetes.io/managed-by": "fleetllm"}
# Rules the operator applies that CEL cannot (planned resources, Secret labels, claims).
OPERATOR_ONLY = {"maxResources", "secretLabel", "allowedModelClaims"}


def _policy(objects: list[dict[str, Any]], suffix: str) -> dict[str, Any]:
    (found,) = [
        p
        for p in by_kind(objects, "ValidatingAdmissionPolicy")
        if p["metadata"]["name"].endswith(suffix)
    ]
    return found


@functools.cache
def _program(expression: str) -> Any:
    env = celpy.Environment()
    return env.program(env.compile(expression))


def _denials(policy: dict[str, Any], request: dict[str, Any]) -> list[str]:
    """The messages of the validations that fail, for a request its match conditions select
    (an empty list: admitted)."""
    activation = {k: celpy.json_to_cel(v) for k, v in request.items()}

    def holds(expression: str) -> bool:
        return bool(_program(expression).evaluate(activation))

    if not all(holds(c["expression"]) for c in policy["spec"].get("matchConditions", [])):
        return []
    return [v["message"] for v in policy["spec"]["validations"] if not holds(v["expression"])]


def test_the_charts_policy_values_are_the_codes_defaults() -> None:
    assert Policy.model_validate(VALUES["policy"]) == DEFAULT_POLICY


def _llmd(**spec: Any) -> dict[str, Any]:
    return smollm2("m", "team-a", **({"maxModelLen": 2048, "replicas": 1} | spec))


VLLM: dict[str, Any] = {
    "model": {"name": "smol", "source": "hf://HuggingFaceTB/SmolLM2-135M"},
    "gpu": {"type": "L4"},
}
CASES = {
    "plain": _llmd(),
    "fleet-image": _llmd(engine={"image": "ghcr.io/fleetllm/engine:9"}),
    "foreign-image": _llmd(engine={"image": "docker.io/attacker/engine:1"}),
    "account": _llmd(pod={"serviceAccountName": "cloud-admin"}),
    "preload": _llmd(engine={"env": [{"name": "ld_preload", "value": "/x.so"}]}),
    "endpoint": _llmd(engine={"env": [{"name": "HF_ENDPOINT", "value": "https://x"}]}),
    "fine-env": _llmd(engine={"env": [{"name": "LOG_LEVEL", "value": "debug"}]}),
    "apparmor": _llmd(
        pod={"annotations": {"container.apparmor.security.beta.kubernetes.io/engine": "unconfined"}}
    ),
    "fine-annotation": _llmd(pod={"annotations": {"team": "a"}}),
    "priority": _llmd(pod={"priorityClassName": "system-node-critical"}),
    "tolerate-all": _llmd(pod={"tolerations": [{"operator": "Exists"}]}),
    "gpu-toleration": _llmd(pod={"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}]}),
    "many": _llmd(replicas=50),
    "remote-code": _llmd(**VLLM, engine={"backend": "vllm", "extraArgs": ["--trust-remote-code"]}),
    "fine-arg": _llmd(engine={"extraArgs": ["--seed", "7"]}),
}


@pytest.mark.parametrize(
    "sets",
    [(), ("policy.maxReplicas=8", "policy.allowedServiceAccounts={cloud-*}")],
    ids=["defaults", "admin-values"],
)
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_llmdeployment_policy_refuses_what_the_operator_refuses(
    case: str, sets: tuple[str, ...]
) -> None:
    objects = render(None, *sets)
    vap = _policy(objects, "-llmdeployments")
    (config_map,) = [
        c for c in by_kind(objects, "ConfigMap") if c["metadata"]["name"].endswith("-policy")
    ]
    policy = Policy.model_validate(yaml.safe_load(config_map["data"]["policy.yaml"]))
    body = CASES[case]
    cr = parse_llmdeployment(copy.deepcopy(body))
    report = review(cr, plan(cr.spec), OperatorConfig(policy=policy))
    operator_rules = {v.rule.split(".")[0] for v in report.violations} - OPERATOR_ONLY
    denials = _denials(vap, {"object": body, "request": {"operation": "CREATE"}})
    assert bool(denials) == bool(operator_rules), (denials, report.message)
    # Each denial names the field and the rule, as the operator's condition does.
    for message in denials:
        assert message.startswith("spec.") and "policy." in message


# Value sets the fuzz below runs on: the defaults, and an admin's exceptions to them.
ADMIN_SETS = (
    "policy.maxReplicas=8",
    "policy.allowedServiceAccounts={engine-*}",
    "policy.allowedPriorityClasses={inference}",
    "policy.allowedTolerationKeys={nvidia.com/gpu,dedicated}",
    "policy.env.allowed={HF_ENDPOINT}",
    "policy.annotations.allowed={sidecar.istio.io/inject}",
    "policy.allowedImageRegistries={registry.corp.example/engines/}",
)


@functools.cache
def _rendered_policies(admin: bool) -> tuple[dict[str, Any], Policy]:
    objects = render(None, *(ADMIN_SETS if admin else ()))
    (config_map,) = [
        c for c in by_kind(objects, "ConfigMap") if c["metadata"]["name"].endswith("-policy")
    ]
    policy = Policy.model_validate(yaml.safe_load(config_map["data"]["policy.yaml"]))
    return _policy(objects, "-llmdeployments"), policy


def _rule(name: str) -> str:
    """A policy rule's top-level field (`env.denied` -> `env`)."""
    return name.removeprefix("policy.").split(".")[0]


NAMES = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,10}", fullmatch=True)
ENV_NAMES = st.one_of(
    NAMES,
    st.sampled_from(
        ["LD_PRELOAD", "ld_library_path", "PYTHONPATH", "PythonHome", "HF_ENDPOINT",
         "AWS_ENDPOINT_URL", "aws_endpoint_url_s3", "HTTPS_PROXY", "no_proxy", "SSL_CERT_FILE",
         "REQUESTS_CA_BUNDLE", "FLEETLLM_API_KEY", "VLLM_API_KEY", "HF_HUB_OFFLINE", "HF_TOKEN",
         "LOG_LEVEL", "MY_ENDPOINT", "ENDPOINT", "VLLM_LOGGING_CONFIG_PATH", "VLLM_NCCL_SO_PATH",
         "vllm_cudart_so_path", "VLLM_RUST_FRONTEND_PATH", "VLLM_NO_USAGE_STATS"]
    ),
)  # fmt: skip
ANNOTATIONS = st.one_of(
    st.from_regex(r"[a-z]{1,8}(\.[a-z]{1,5})?(/[a-z]{1,8})?", fullmatch=True),
    st.sampled_from(
        ["container.apparmor.security.beta.kubernetes.io/engine",
         "seccomp.security.alpha.kubernetes.io/pod", "security.alpha.kubernetes.io/sysctls",
         "sidecar.istio.io/inject", "linkerd.io/inject", "config.linkerd.io/proxy-cpu",
         "vault.hashicorp.com/agent-inject", "kubectl.kubernetes.io/default-container",
         "prometheus.io/scrape", "team"]
    ),
)  # fmt: skip
TOLERATIONS = st.lists(
    st.fixed_dictionaries(
        {"operator": st.just("Exists")},
        optional={
            "key": st.sampled_from(
                ["", "nvidia.com/gpu", "dedicated", "node-role.kubernetes.io/control-plane"]
            )
        },
    ),
    max_size=3,
)


@st.composite
def llmdeployments(draw: st.DrawFn) -> dict[str, Any]:
    vllm = draw(st.booleans())
    engine: dict[str, Any] = {"backend": "vllm"} if vllm else {}
    if image := draw(
        st.sampled_from(
            [None, "ghcr.io/fleetllm/engine:9", "ghcr.io/fleetllmx/engine:9",
             "docker.io/attacker/engine:1", "vllm/vllm-openai:v0.32.0",
             "registry.corp.example/engines/fleetllm:1", "registry.corp.example/other:1"]
        )
    ):  # fmt: skip
        engine["image"] = image
    names = draw(st.lists(ENV_NAMES, max_size=4, unique_by=str.upper))
    engine["env"] = [{"name": n, "value": "x"} for n in names]
    if vllm:
        # Flags as written (vLLM's abbreviations are the operator's alone to read).
        flags = ["--trust-remote-code", "--seed=7", "--enforce-eager", "--log-config-file=/x"]
        flags += ["--allowed-local-media-path=/x", "--tool-parser-plugin=/x.py"]
        engine["extraArgs"] = draw(st.lists(st.sampled_from(flags), max_size=2, unique=True))
    pod: dict[str, Any] = {
        "annotations": {k: "v" for k in draw(st.lists(ANNOTATIONS, max_size=3))},
        "tolerations": draw(TOLERATIONS),
    }
    for field, values in (
        ("serviceAccountName", ["default", "cloud-admin", "engine-reader"]),
        ("priorityClassName", ["system-node-critical", "inference", "low"]),
    ):
        if value := draw(st.sampled_from([None, *values])):
            pod[field] = value
    spec: dict[str, Any] = {"engine": engine, "pod": pod, "replicas": draw(st.integers(0, 12))}
    if vllm:
        spec |= VLLM
    if draw(st.booleans()):
        spec["scaling"] = {"minReplicas": 0, "maxReplicas": draw(st.integers(1, 12))}
    return _llmd(**spec)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=llmdeployments(), admin=st.booleans())
def test_the_admission_policy_and_the_operator_refuse_the_same_rules(
    body: dict[str, Any], admin: bool
) -> None:
    vap, policy = _rendered_policies(admin)
    cr = parse_llmdeployment(copy.deepcopy(body))
    report = review(cr, plan(cr.spec), OperatorConfig(policy=policy))
    operator_rules = {_rule(v.rule) for v in report.violations} - OPERATOR_ONLY
    denials = _denials(vap, {"object": body, "request": {"operation": "CREATE"}})
    cel_rules = {_rule(m.split("policy.")[1]) for m in denials}
    assert cel_rules == operator_rules, (denials, report.message)


def test_the_binding_covers_the_watched_namespaces_only() -> None:
    (everywhere,) = by_kind(render(), "ValidatingAdmissionPolicyBinding")[:1]
    assert "matchResources" not in everywhere["spec"]
    namespaced = render("namespaced-values.yaml")
    binding = next(
        b
        for b in by_kind(namespaced, "ValidatingAdmissionPolicyBinding")
        if b["metadata"]["name"].endswith("-llmdeployments")
    )
    (expression,) = binding["spec"]["matchResources"]["namespaceSelector"]["matchExpressions"]
    assert expression["values"] == ["team-a", "team-b"]
    assert (
        by_kind(render(None, "admissionPolicies.enabled=false"), "ValidatingAdmissionPolicy") == []
    )


def _write(
    operation: str,
    resource: str,
    new: dict[str, Any] | None,
    old: dict[str, Any] | None,
    user: str = OPERATOR,
) -> dict[str, Any]:
    return {
        "request": {
            "operation": operation,
            "resource": {"resource": resource},
            "userInfo": {"username": user},
        },
        "object": new,
        "oldObject": old,
    }


def _pod(annotations: dict[str, str], image: str = "engine:1") -> dict[str, Any]:
    return {
        "metadata": {"labels": {**MANAGED, "app": "x"}, "annotations": annotations},
        "spec": {"containers": [{"name": "engine", "image": image}]},
    }


def test_the_operator_writes_only_its_own_objects_and_only_pod_deletion_costs() -> None:
    vap = _policy(render(), "-operator-scope")
    ours = {"metadata": {"name": "x", "labels": MANAGED}, "spec": {}}
    foreign = {"metadata": {"name": "coredns", "labels": {"k8s-app": "kube-dns"}}, "spec": {}}
    allowed = [
        _write("CREATE", "deployments", ours, None),
        _write("UPDATE", "deployments", ours, ours),
        _write("DELETE", "horizontalpodautoscalers", None, ours),
        _write("CREATE", "jobs", ours, None),
        _write("DELETE", "jobs", None, ours),
        _write("UPDATE", "pods", _pod({COST: "-5"}), _pod({})),
        _write("UPDATE", "pods", _pod({COST: "3", "a": "1"}), _pod({COST: "1", "a": "1"})),
        # Anyone else is not this policy's business.
        _write("UPDATE", "deployments", foreign, foreign, user="system:admin"),
    ]
    for request in allowed:
        assert _denials(vap, request) == [], request
    denied = [
        _write("CREATE", "configmaps", foreign, None),
        _write("UPDATE", "deployments", foreign, foreign),
        _write("UPDATE", "deployments", ours, foreign),  # taking one over by labelling it
        _write("DELETE", "scaledobjects", None, foreign),
        _write("CREATE", "jobs", foreign, None),
        _write("DELETE", "jobs", None, foreign),
        _write("UPDATE", "pods", _pod({COST: "1"}, image="evil:1"), _pod({})),
        _write("UPDATE", "pods", _pod({"sidecar.istio.io/inject": "true"}), _pod({})),
        _write("UPDATE", "pods", _pod({}), _pod({"a": "1"})),
        _write("CREATE", "pods", _pod({}), None),
    ]
    for request in denied:
        assert _denials(vap, request), request
