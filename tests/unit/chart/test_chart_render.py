"""The Helm chart charts/fleetllm: lint, valid objects for Kubernetes 1.30 and 1.37 under every
value set, CRDs identical to crds/, documented and checked values, commands that parse, scoped
RBAC, restricted pods, and the optional objects wired to what they serve."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from helmchart import (
    CHART,
    CRDS,
    NAMESPACE,
    ROOT,
    VALUE_SETS,
    by_kind,
    documents,
    one,
    render,
    run,
    tool,
    validate,
)
from rbac import wildcards

from fleetllm.api.catalog import GPU_PROFILES
from fleetllm.api.contract import selector_labels
from fleetllm.cli import build_parser
from fleetllm.images import CONTROL_PLANE_IMAGE
from fleetllm.operator.cli import config_from_args
from fleetllm.operator.reconciler import is_subset
from fleetllm.planner.settings import ModelCache, OperatorConfig
from fleetllm.policy.model import Policy
from fleetllm.router.config import STRATEGIES
from fleetllm.version import __version__

VALUES = yaml.safe_load((CHART / "values.yaml").read_text())
SCHEMA = json.loads((CHART / "values.schema.json").read_text())


def _values(value_set: str | None) -> dict[str, Any]:
    """The defaults with a value set of ci/ merged in, as helm merges them."""

    def merge(base: Any, over: Any) -> Any:
        if isinstance(base, dict) and isinstance(over, dict):
            return {k: merge(base.get(k), over[k]) if k in base else over[k] for k in over} | {
                k: v for k, v in base.items() if k not in over
            }
        return over

    if value_set is None:
        return VALUES
    return merge(VALUES, yaml.safe_load((CHART / "ci" / value_set).read_text()))


def _deployment(objects: list[dict[str, Any]], component: str) -> dict[str, Any]:
    (deployment,) = [
        d
        for d in by_kind(objects, "Deployment")
        if d["metadata"]["labels"]["app.kubernetes.io/component"] == component
    ]
    return deployment


def _parsed_command(deployment: dict[str, Any]) -> Any:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return build_parser().parse_args([*container["command"][1:], *container["args"]])


def test_the_charts_crds_are_the_repositorys() -> None:
    ours = {p.name: p.read_bytes() for p in CRDS.glob("*.yaml") if p.name != "kustomization.yaml"}
    chart = {p.name: p.read_bytes() for p in (CHART / "crds").glob("*")}
    assert chart == ours, "regenerate with scripts/generate.sh"
    assert set(yaml.safe_load((CRDS / "kustomization.yaml").read_text())["resources"]) == set(ours)


def test_the_chart_follows_the_version_constant() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["version"] == chart["appVersion"] == __version__
    for component in ("operator", "router"):
        (container,) = _deployment(render(), component)["spec"]["template"]["spec"]["containers"]
        assert container["image"] == CONTROL_PLANE_IMAGE


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_helm_lint_strict_passes(value_set: str | None) -> None:
    args = [tool("helm"), "lint", "--strict", str(CHART)]
    if value_set is not None:
        args += ["--values", str(CHART / "ci" / value_set)]
    result = run(*args)
    assert "0 chart(s) failed" in result.stdout


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_every_rendered_object_is_valid_for_kubernetes_and_our_crds(value_set: str | None) -> None:
    objects = render(value_set)
    assert validate(objects) == []
    # helm install also applies the CRDs; they are valid for both Kubernetes versions too.
    crds = documents(
        run(tool("helm"), "template", "x", str(CHART), "--include-crds").stdout
    )  # the CRDs come first, the same for every value set
    assert validate(by_kind(crds, "CustomResourceDefinition")) == []
    assert len(by_kind(crds, "CustomResourceDefinition")) == 3


def test_validation_fails_on_a_kind_nobody_can_check() -> None:
    strange = {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}}
    assert validate([strange]) == [
        f"Widget /w: no schema for this kind in Kubernetes {v}" for v in ("1.30", "1.37")
    ]
    peering = one(render(), "ClusterKopfPeering", "fleetllm")
    assert validate([{**peering, "status": "not an object"}]) != []


def _schema_keys(schema: dict[str, Any], prefix: str = "") -> list[str]:
    keys = []
    for name, sub in schema.get("properties", {}).items():
        keys.append(prefix + name)
        keys += _schema_keys(sub, f"{prefix}{name}.")
    return keys


def test_values_are_documented_line_by_line_and_match_the_schema() -> None:
    """Every setting of the schema is in values.yaml with a comment right above it (or on a
    line of comments that leads to it), and values.yaml has no setting the schema lacks."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    keys = [k for k in _schema_keys(SCHEMA) if k != "global"]
    stack: list[tuple[int, str]] = []
    documented: dict[str, bool] = {}
    for i, line in enumerate(lines):
        match = re.match(r"^( *)([A-Za-z][\w-]*):", line)
        if not match:
            continue
        indent = len(match.group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = ".".join([*(s for _, s in stack), match.group(2)])
        stack.append((indent, match.group(2)))
        documented[path] = lines[i - 1].strip().startswith("#")
    missing = [k for k in keys if k not in documented]
    assert missing == [], f"settings of the schema missing from values.yaml: {missing}"
    silent = [k for k in keys if not documented[k]]
    assert silent == [], f"settings without a comment above them: {silent}"


def test_the_schemas_choices_are_the_codes() -> None:
    props = SCHEMA["properties"]
    assert props["operator"]["properties"]["gpuProfile"]["enum"] == list(GPU_PROFILES)
    assert props["router"]["properties"]["strategy"]["enum"] == list(STRATEGIES)


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("operator.gpuProfile=tpu", "gpuProfile"),
        ("operator.replicas=0", "replicas"),
        ("router.strategy=random", "strategy"),
        ("watchNamespaces[0]=Not_A_Name", "watchNamespaces"),
        ("operatr.replicas=2", "operatr"),
        ("router.port=70000", "port"),
        ("monitoring.prometheusRule.kvCacheUsage=1.5", "kvCacheUsage"),
        ("httpRoute.enabled=true", "parentRefs"),
        ("router.apiKeys.create=true", "keys"),
        ("networkPolicy.enabled=true", "networkPolicy.enabled needs watchNamespaces"),
        ("engine.pod.rollout.maxSurge=0", "rollout"),
        ("engine.pod.shmSize=lots", "shmSize"),
        ("engine.pod.runtimeClassName=NVIDIA", "runtimeClassName"),
        ("engine.pod.probes.timeoutSeconds=0", "timeoutSeconds"),
        ("engine.pod.probes.startupExtraSeconds=86401", "startupExtraSeconds"),
        ("engine.pod.rollout.maxUnavailable=1001", "maxUnavailable"),
        ("engine.pod.extraVolumes[0].name=cache", "extraVolumes"),
        ("engine.pod.unknown=1", "unknown"),
        ("global.imageRegistry=https://mirror", "imageRegistry"),
        ("engine.images.vllm.digest=sha256:short", "digest"),
        ("engine.images.cpu.tag=bad tag", "tag"),
        ("image.registry=Mirror/", "registry"),
    ],
)
def test_bad_values_are_refused_with_a_clear_error(setting: str, message: str) -> None:
    result = run(tool("helm"), "template", "x", str(CHART), "--set", setting, check=False)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_the_commands_parse_and_carry_the_values(value_set: str | None, tmp_path: Path) -> None:
    values = _values(value_set)
    objects = render(value_set)
    operator = _parsed_command(_deployment(objects, "operator"))
    assert operator.func.__module__ == "fleetllm.operator.cli"
    watched = values["watchNamespaces"]
    assert (operator.namespaces or []) == watched
    assert operator.all_namespaces == (not watched)
    assert not operator.standalone
    peerings = by_kind(objects, "KopfPeering" if watched else "ClusterKopfPeering")
    assert {p["metadata"]["name"] for p in peerings} == {operator.peering}
    assert sorted(p["metadata"].get("namespace") for p in peerings) == (watched or [None])
    cache = values["operator"]["modelCache"]
    # The policy file is the operator's ConfigMap, mounted where --policy reads it.
    policy = one(objects, "ConfigMap", "fleetllm-operator-policy")
    pod = _deployment(objects, "operator")["spec"]["template"]["spec"]
    (mount,) = pod["containers"][0]["volumeMounts"]
    assert operator.policy == f"{mount['mountPath']}/policy.yaml"
    assert {"name": mount["name"], "configMap": {"name": "fleetllm-operator-policy"}} in (
        pod["volumes"]
    )
    operator.policy = str(tmp_path / "policy.yaml")
    Path(operator.policy).write_text(policy["data"]["policy.yaml"])
    config = config_from_args(operator)
    assert config == OperatorConfig(
        gpu_profile=values["operator"]["gpuProfile"],
        cpu_bf16=values["operator"]["cpuBf16"],
        model_cache=ModelCache(cache["claimName"], cache["readOnly"])
        if cache["claimName"]
        else None,
        policy=Policy.model_validate(values["policy"]),
        fleet_namespace=NAMESPACE,
        fleet_instance="fleetllm",
        # Images, pull secrets and engine pod settings: test_chart_images.py and
        # test_chart_engine_pods.py check what they carry.
        images=config.images,
        image_pull_secrets=tuple(s["name"] for s in values["imagePullSecrets"]),
        pod=config.pod,
    )

    deployment = _deployment(objects, "router")
    router = _parsed_command(deployment)
    assert router.func.__module__ == "fleetllm.router.cli"
    assert router.discovery == "kubernetes"
    assert (router.namespace or []) == watched and router.all_namespaces == (not watched)
    assert router.api_keys_secret == f"{NAMESPACE}/{values['router']['apiKeys']['secretName']}"
    pod = deployment["spec"]["template"]["spec"]
    assert pod["containers"][0]["ports"][0]["containerPort"] == router.port
    assert pod["terminationGracePeriodSeconds"] > router.shutdown_timeout
    if values["router"]["apiKeys"]["create"]:
        secret = one(objects, "Secret", values["router"]["apiKeys"]["secretName"])
        assert secret["stringData"] == values["router"]["apiKeys"]["keys"]
    else:
        # The engine keys' root only (test_chart_engine_keys.py).
        assert [s["metadata"]["name"] for s in by_kind(objects, "Secret")] == [
            "fleetllm-engine-keys"
        ]


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_rbac_is_scoped_as_asked_without_wildcards_or_listing_secrets(
    value_set: str | None,
) -> None:
    objects = render(value_set)
    watched = _values(value_set)["watchNamespaces"]
    roles = by_kind(objects, "Role") + by_kind(objects, "ClusterRole")
    assert wildcards(roles) == []
    for role in roles:
        for rule in role["rules"]:
            if "secrets" in rule["resources"] and role["metadata"]["name"] == "fleetllm-operator":
                # The engines' key Secrets, made and read one by one: never listed or watched
                # (the operator-scope admission policy keeps its writes to its own objects).
                assert rule == {
                    "apiGroups": [""],
                    "resources": ["secrets"],
                    "verbs": ["get", "create", "patch"],
                }
            elif "secrets" in rule["resources"]:
                # The router's key Secret only: by name, in the release's namespace.
                assert role["kind"] == "Role" and role["metadata"]["namespace"] == NAMESPACE
                assert rule == {
                    "apiGroups": [""],
                    "resources": ["secrets"],
                    "resourceNames": ["fleetllm-router-keys"],
                    "verbs": ["get"],
                }
    role_namespaces = {r["metadata"]["namespace"] for r in by_kind(objects, "Role")}
    if watched:
        assert by_kind(objects, "ClusterRole") == [] == by_kind(objects, "ClusterRoleBinding")
        assert role_namespaces == {NAMESPACE, *watched}
        for namespace in watched:
            names = {
                r["metadata"]["name"]
                for r in by_kind(objects, "Role")
                if r["metadata"]["namespace"] == namespace
            }
            assert names == {"fleetllm-operator", "fleetllm-router-discovery"}
    else:
        assert {r["metadata"]["name"] for r in by_kind(objects, "ClusterRole")} == {
            "fleetllm-operator",
            "fleetllm-router",
        }
        assert role_namespaces == {NAMESPACE}
    for binding in by_kind(objects, "RoleBinding") + by_kind(objects, "ClusterRoleBinding"):
        (subject,) = binding["subjects"]
        assert subject["kind"] == "ServiceAccount" and subject["namespace"] == NAMESPACE
        accounts = {s["metadata"]["name"] for s in by_kind(objects, "ServiceAccount")}
        assert subject["name"] in accounts


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_pods_meet_the_restricted_profile_with_resources_and_probes(
    value_set: str | None,
) -> None:
    for deployment in by_kind(render(value_set), "Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert not pod.get("hostNetwork") and not pod.get("hostPID")
        for container in pod["containers"]:
            security = container["securityContext"]
            assert security["allowPrivilegeEscalation"] is False
            assert security["capabilities"] == {"drop": ["ALL"]}
            assert security["readOnlyRootFilesystem"] is True
            assert container["resources"]["requests"]["cpu"]
            assert container["resources"]["limits"]["memory"]
            assert container["livenessProbe"]


def test_network_policy_lets_only_the_router_and_the_operator_reach_engines() -> None:
    objects = render("namespaced-values.yaml")
    policies = by_kind(objects, "NetworkPolicy")
    assert sorted(p["metadata"]["namespace"] for p in policies) == ["team-a", "team-b"]
    router = _deployment(objects, "router")["spec"]["template"]["metadata"]["labels"]
    operator = _deployment(objects, "operator")["spec"]["template"]["metadata"]["labels"]
    for policy in policies:
        spec = policy["spec"]
        assert is_subset(spec["podSelector"]["matchLabels"], selector_labels("any-model"))
        assert spec["policyTypes"] == ["Ingress"]
        (rule,) = spec["ingress"]
        peers = rule["from"]
        ours = [p for p in peers if "podSelector" in p]
        for labels, peer in zip((router, operator), ours, strict=True):
            assert is_subset(peer["podSelector"]["matchLabels"], labels)
            assert peer["namespaceSelector"]["matchLabels"] == {
                "kubernetes.io/metadata.name": NAMESPACE
            }
        assert [p for p in peers if "podSelector" not in p] == [
            {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
        ]
        assert rule["ports"] == [{"port": "http", "protocol": "TCP"}]
    # Rendered engine pods expose that port name.
    assert by_kind(render(), "NetworkPolicy") == []


def test_monitors_select_the_engines_and_the_router() -> None:
    objects = render("monitoring-values.yaml")
    pod_monitor = one(objects, "PodMonitor", "fleetllm-engines")
    assert pod_monitor["spec"]["namespaceSelector"] == {"any": True}
    assert is_subset(pod_monitor["spec"]["selector"]["matchLabels"], selector_labels("m"))
    (endpoint,) = pod_monitor["spec"]["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("http", "/metrics")
    service = one(objects, "Service", "fleetllm-router")
    service_monitor = one(objects, "ServiceMonitor", "fleetllm-router")
    selector = service_monitor["spec"]["selector"]["matchLabels"]
    assert is_subset(selector, service["metadata"]["labels"])
    (endpoint,) = service_monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    for obj in (pod_monitor, service_monitor, one(objects, "PrometheusRule", "fleetllm")):
        assert obj["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    dashboard = one(objects, "ConfigMap", "fleetllm-dashboard")
    assert dashboard["metadata"]["namespace"] == "monitoring"
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["fleetllm.json"]) == json.loads(
        (CHART / "files" / "dashboard.json").read_text()
    )
    scoped = one(render("namespaced-values.yaml"), "PodMonitor", "fleetllm-engines")
    assert scoped["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}


def test_ingress_and_http_route_lead_to_the_routers_service() -> None:
    objects = render("ingress-values.yaml")
    service = one(objects, "Service", "fleetllm-router")
    assert service["spec"]["type"] == "LoadBalancer"
    ingress = one(objects, "Ingress", "fleetllm-router")
    (rule,) = ingress["spec"]["rules"]
    (path,) = rule["http"]["paths"]
    assert path["backend"]["service"] == {"name": "fleetllm-router", "port": {"name": "http"}}
    assert ingress["spec"]["tls"][0]["hosts"] == [rule["host"]]
    route = one(objects, "HTTPRoute", "fleetllm-router")
    (backend,) = route["spec"]["rules"][0]["backendRefs"]
    assert backend == {"name": "fleetllm-router", "port": service["spec"]["ports"][0]["port"]}
    assert route["spec"]["parentRefs"] == [{"name": "public", "namespace": "gateways"}]
    assert by_kind(render(), "Ingress") == [] == by_kind(render(), "HTTPRoute")


def test_install_notes_tell_how_to_apply_a_model_and_reach_the_router() -> None:
    notes = run(
        tool("helm"), "install", "fleetllm", str(CHART), "--dry-run=client",
        "--namespace", NAMESPACE, "--values", str(CHART / "ci" / "namespaced-values.yaml"),
    ).stdout.split("NOTES:", 1)[1]  # fmt: skip
    assert "kubectl apply -n team-a -f" in notes
    assert "manifests/examples/smollm2-cpu.yaml" in notes
    assert f"kubectl -n {NAMESPACE} port-forward svc/fleetllm-router 8080:80" in notes
    assert "Model ids are NAMESPACE/MODEL" in notes
    assert (ROOT / "manifests" / "examples" / "smollm2-cpu.yaml").is_file()


def test_install_notes_recommend_namespaced_mode_for_production_when_cluster_wide() -> None:
    def notes(*args: str) -> str:
        return run(
            tool("helm"), "install", "fleetllm", str(CHART), "--dry-run=client",
            "--namespace", NAMESPACE, *args,
        ).stdout.split("NOTES:", 1)[1]  # fmt: skip

    clusterwide = notes()
    assert "For production, prefer namespaced mode (watchNamespaces)" in clusterwide
    assert "operator-scope admission policy" in clusterwide
    namespaced = notes("--values", str(CHART / "ci" / "namespaced-values.yaml"))
    assert "prefer namespaced mode" not in namespaced


def test_helm_and_kubectl_come_from_the_virtual_environment() -> None:
    assert Path(tool("helm")).parent == Path(tool("kubectl")).parent
    assert "v4." in run(tool("helm"), "version", "--short").stdout
    assert "v1.33" in run(tool("kubectl"), "version", "--client").stdout
