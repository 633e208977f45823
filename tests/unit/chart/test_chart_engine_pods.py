"""The admin's engine pod settings (the chart's engine.pod values): each one reaches the pods
the operator renders, valid for Kubernetes 1.30 and 1.37; a bad one is refused by the chart's
schema and by the operator's flag with a message naming it; the router's PodDisruptionBudget
never blocks a node drain; every value of the schema has a description."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubeschemas
import pytest
from chart_operator import operator_config
from examples import ALL_EXAMPLES
from helmchart import CHART, by_kind, one, render, run, tool, validate
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from fleetllm.api.manifests import load_llmdeployments
from fleetllm.operator.render import render as render_children
from fleetllm.planner.plan import plan
from fleetllm.planner.pod_settings import (
    MAX_FAILURES,
    MAX_PROBE_TIMEOUT_SECONDS,
    MAX_ROLLOUT,
    MAX_STARTUP_EXTRA,
    RESERVED_MOUNTS,
    RESERVED_VOLUMES,
    PodSettingsError,
    parse_pod_settings,
)
from fleetllm.planner.settings import ModelCache, OperatorConfig

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "scripts"))
import schema_descriptions  # noqa: E402

GPU_EXAMPLE = ROOT / "manifests" / "examples" / "llama-3.1-8b-l4-awq.yaml"
SETTINGS = [
    "engine.pod.runtimeClassName=nvidia",
    "engine.pod.shmSize=16Gi",
    "engine.pod.rollout.maxSurge=0",
    "engine.pod.rollout.maxUnavailable=1",
    "engine.pod.probes.timeoutSeconds=9",
    "engine.pod.probes.livenessFailureThreshold=12",
    "engine.pod.probes.readinessFailureThreshold=4",
    "engine.pod.probes.startupExtraSeconds=600",
    "engine.pod.extraEnv[0].name=HTTPS_PROXY",
    "engine.pod.extraEnv[0].value=http://proxy.internal:3128",
    "engine.pod.extraVolumes[0].name=ca-bundle",
    "engine.pod.extraVolumes[0].configMap.name=corporate-ca",
    "engine.pod.extraVolumeMounts[0].name=ca-bundle",
    "engine.pod.extraVolumeMounts[0].mountPath=/etc/ssl/corporate",
    "engine.pod.extraVolumeMounts[0].readOnly=true",
]


def _config(*sets: str) -> OperatorConfig:
    return operator_config(render(None, *sets))


def _engine_deployment(config: OperatorConfig) -> dict[str, Any]:
    (cr,) = load_llmdeployments(GPU_EXAMPLE)
    (deployment,) = by_kind(render_children(cr, plan(cr.spec, config), config), "Deployment")
    return deployment


def test_every_engine_pod_setting_reaches_the_pods() -> None:
    default = _engine_deployment(OperatorConfig())
    deployment = _engine_deployment(_config(*SETTINGS))
    for version in ("1.30", "1.37"):
        kubeschemas.validate(deployment, version)
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    pod = deployment["spec"]["template"]["spec"]
    assert pod["runtimeClassName"] == "nvidia"
    (shm,) = [v for v in pod["volumes"] if v["name"] == "dshm"]
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    assert {"name": "ca-bundle", "configMap": {"name": "corporate-ca"}} in pod["volumes"]
    engine = pod["containers"][0]
    before = default["spec"]["template"]["spec"]["containers"][0]
    assert engine["livenessProbe"]["failureThreshold"] == 12
    assert engine["readinessProbe"]["failureThreshold"] == 4
    assert {engine[p]["timeoutSeconds"] for p in ("startupProbe", "livenessProbe")} == {9}
    assert (
        engine["startupProbe"]["failureThreshold"]
        == before["startupProbe"]["failureThreshold"] + 60
    )
    # The proxy and the CA bundle reach the download too.
    for container in [*pod["initContainers"], engine]:
        assert {"name": "HTTPS_PROXY", "value": "http://proxy.internal:3128"} in container["env"]
        assert {
            "name": "ca-bundle",
            "mountPath": "/etc/ssl/corporate",
            "readOnly": True,
        } in container["volumeMounts"]


def test_the_default_settings_change_nothing() -> None:
    deployment = _engine_deployment(_config())
    pod = deployment["spec"]["template"]["spec"]
    assert "runtimeClassName" not in pod and "imagePullSecrets" not in pod
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    (shm,) = [v for v in pod["volumes"] if v["name"] == "dshm"]
    assert shm["emptyDir"]["sizeLimit"] == "8Gi"


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"rollout": {"maxSurge": 0, "maxUnavailable": 0}}, "rollout.maxSurge 0"),
        ({"shmSize": "0Gi"}, "shmSize"),
        ({"probes": {"timeoutSecond": 3}}, "probes.timeoutSecond"),
        ({"extraVolumes": [{"name": "dshm", "emptyDir": {}}]}, "'dshm' is taken"),
        ({"extraVolumeMounts": [{"name": "x", "mountPath": "/x"}]}, "names no volume"),
        ({"extraEnv": [{"value": "1"}]}, "extraEnv"),
        ({"extraEnv": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]}, "twice"),
        (
            {
                "extraVolumes": [{"name": "x", "emptyDir": {}}],
                "extraVolumeMounts": [{"name": "x", "mountPath": "/tmp"}],
            },
            "the engine's own",
        ),
        ({"runtimeClass": "nvidia"}, "unknown field runtimeClass"),
        ({"probes": {"startupExtraSeconds": 86401}}, "probes.startupExtraSeconds must be 0 to"),
        ({"rollout": {"maxSurge": 1001}}, "rollout.maxSurge must be 0 to 1000"),
        (
            {
                "extraVolumes": [{"name": "x", "emptyDir": {}}],
                "extraVolumeMounts": [
                    {"name": "x", "mountPath": "/data"},
                    {"name": "x", "mountPath": "/data/"},
                ],
            },
            "'/data/' twice",
        ),
    ],
)
def test_bad_engine_pod_settings_are_refused_by_the_operator(
    settings: dict[str, Any], message: str
) -> None:
    with pytest.raises(PodSettingsError, match=message.replace(".", r"\.")):
        parse_pod_settings(json.dumps(settings))
    result = subprocess.run(
        [sys.executable, "-m", "fleetllm", "render", "-f", str(GPU_EXAMPLE),
         "--engine-pod-settings", json.dumps(settings)],
        capture_output=True, text=True, check=False, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    assert "--engine-pod-settings" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize(("replicas", "min_available"), [(1, 1), (2, 2), (3, 1)])
def test_the_router_budget_never_blocks_a_drain(replicas: int, min_available: int) -> None:
    objects = render(
        None,
        f"router.replicas={replicas}",
        f"router.podDisruptionBudget.minAvailable={min_available}",
    )
    assert validate(objects) == []
    (pdb,) = by_kind(objects, "PodDisruptionBudget")
    spec = pdb["spec"]
    assert spec["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    allowed = replicas - spec["minAvailable"] if "minAvailable" in spec else spec["maxUnavailable"]
    assert allowed >= 1
    if min_available < replicas:
        assert spec["minAvailable"] == min_available


def test_every_value_has_a_description_from_its_comment() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema_descriptions.undescribed(schema) == []
    comments = schema_descriptions.value_comments((CHART / "values.yaml").read_text())
    current = schema_descriptions.described(json.loads(json.dumps(schema)), comments)
    assert current == schema, "run scripts/generate.sh"
    assert comments[("engine", "pod", "rollout", "maxSurge")].startswith("Replicas started")


def test_the_router_pdb_name_is_the_releases() -> None:
    objects = render(None, "router.replicas=1")
    assert one(objects, "PodDisruptionBudget", "fleetllm-router")["spec"]["maxUnavailable"] == 1


def test_the_chart_makes_the_model_cache_claim_of_a_storage_class() -> None:
    sets = [
        "watchNamespaces={team-a,team-b}",
        "operator.modelCache.claimName=model-cache",
        "operator.modelCache.create.enabled=true",
        "operator.modelCache.create.storageClassName=efs-sc",
        "operator.modelCache.create.size=2Ti",
    ]
    objects = render(None, *sets)
    assert validate(objects) == []
    claims = by_kind(objects, "PersistentVolumeClaim")
    assert sorted(c["metadata"]["namespace"] for c in claims) == ["team-a", "team-b"]
    for claim in claims:
        assert claim["metadata"]["name"] == "model-cache"
        assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
        assert claim["spec"] == {
            "accessModes": ["ReadWriteMany"],
            "storageClassName": "efs-sc",
            "resources": {"requests": {"storage": "2Ti"}},
        }
    config = _config(*sets)
    assert config.model_cache is not None and config.model_cache.claim_name == "model-cache"
    assert by_kind(render(), "PersistentVolumeClaim") == []


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["operator.modelCache.create.enabled=true"], "needs operator.modelCache.claimName"),
        (
            ["operator.modelCache.create.enabled=true", "operator.modelCache.claimName=c"],
            "needs watchNamespaces",
        ),
        (
            [
                "operator.modelCache.create.enabled=true",
                "operator.modelCache.claimName=c",
                "operator.modelCache.readOnly=true",
                "watchNamespaces={a}",
            ],
            "cannot be readOnly",
        ),
        (["operator.modelCache.create.size=lots"], "size"),
    ],
)
def test_a_model_cache_claim_that_cannot_be_made_is_refused(sets: list[str], message: str) -> None:
    args = [tool("helm"), "template", "x", str(CHART)]
    for item in sets:
        args += ["--set", item]
    result = run(*args, check=False)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr


def test_install_notes_name_the_engine_pull_secrets_and_the_download_disk() -> None:
    def notes(values: str) -> str:
        return run(
            tool("helm"), "install", "fleetllm", str(CHART), "--dry-run=client",
            "--values", str(CHART / "ci" / values),
        ).stdout.split("NOTES:", 1)[1]  # fmt: skip

    gpu = notes("gpu-cluster-values.yaml")
    assert "Secrets ecr-pull: create them in each model's namespace" in gpu
    assert "ephemeral storage" not in gpu  # it has a model cache
    plain = notes("ingress-values.yaml")
    assert "Secrets" not in plain and "ephemeral storage" in plain


def test_the_schemas_bounds_are_the_operators() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    pod = schema["properties"]["engine"]["properties"]["pod"]["properties"]
    rollout, probes = pod["rollout"]["properties"], pod["probes"]["properties"]
    assert {rollout[k]["maximum"] for k in ("maxSurge", "maxUnavailable")} == {MAX_ROLLOUT}
    assert probes["timeoutSeconds"]["maximum"] == MAX_PROBE_TIMEOUT_SECONDS
    for key in ("livenessFailureThreshold", "readinessFailureThreshold"):
        assert probes[key]["maximum"] == MAX_FAILURES
    assert probes["startupExtraSeconds"]["maximum"] == MAX_STARTUP_EXTRA


# Mostly valid values, so that fuzzed settings often pass every check but one: names from a
# small pool (so that mounts find their volumes), numbers small or far out of bounds.
_NAMES = st.sampled_from(["a", "b", "a", "b", "dshm", "Bad_Name"])
_NUMBERS = st.one_of(st.integers(1, 9), st.integers(-2, 2**40), st.booleans())
_PROBES = ("timeoutSeconds", "livenessFailureThreshold", "readinessFailureThreshold")
_SETTINGS = st.fixed_dictionaries(
    {},
    optional={
        "runtimeClassName": st.one_of(st.sampled_from(["", "nvidia", "NVIDIA"]), st.text()),
        "shmSize": st.one_of(
            st.from_regex(r"[0-9]{1,5}(\.[0-9])?(Mi|Gi|Ti)?", fullmatch=True), st.text(max_size=6)
        ),
        "rollout": st.fixed_dictionaries(
            {}, optional={"maxSurge": _NUMBERS, "maxUnavailable": _NUMBERS}
        ),
        "probes": st.fixed_dictionaries(
            {}, optional={key: _NUMBERS for key in (*_PROBES, "startupExtraSeconds")}
        ),
        "extraEnv": st.lists(
            st.fixed_dictionaries(
                {
                    "name": st.sampled_from(["HTTPS_PROXY", "HOME", "HF_TOKEN", "1X"]),
                    "value": st.text(max_size=5),
                }
            ),
            max_size=3,
        ),
        "extraVolumes": st.lists(
            st.fixed_dictionaries({"name": _NAMES, "emptyDir": st.just({})}), max_size=3
        ),
        "extraVolumeMounts": st.lists(
            st.fixed_dictionaries(
                {
                    "name": _NAMES,
                    "mountPath": st.sampled_from(["/data", "/data/", "/x", "/tmp", "relative"]),
                }
            ),
            max_size=3,
        ),
    },
)


def _unique(items: list[dict[str, Any]], key: str) -> bool:
    values = [str(item[key]).rstrip("/") for item in items]
    return len(values) == len(set(values))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_SETTINGS)
@example({"probes": {"startupExtraSeconds": 2**40, "timeoutSeconds": 10**6}})
@example(
    {
        "extraVolumes": [{"name": "a", "emptyDir": {}}],
        "extraVolumeMounts": [{"name": "a", "mountPath": "/x"}, {"name": "a", "mountPath": "/x/"}],
    }
)
def test_any_engine_pod_settings_are_refused_by_name_or_render_a_valid_pod(
    given_settings: dict[str, Any],
) -> None:
    """Fuzzed: settings the operator takes render a Deployment the API server takes (schema,
    and the uniqueness the schema cannot say); others are refused with a PodSettingsError."""
    try:
        pod_settings = parse_pod_settings(json.dumps(given_settings))
    except PodSettingsError:
        return
    deployment = _engine_deployment(OperatorConfig(pod=pod_settings))
    for version in ("1.30", "1.37"):
        kubeschemas.validate(deployment, version)
    pod = deployment["spec"]["template"]["spec"]
    assert _unique(pod["volumes"], "name")
    for container in [*pod.get("initContainers", []), *pod["containers"]]:
        assert _unique(container["volumeMounts"], "mountPath")
        assert _unique(container["env"], "name")
    probe = pod["containers"][0]["startupProbe"]
    assert probe["failureThreshold"] < 2**31 and probe["timeoutSeconds"] <= 3600


def test_every_volume_and_path_the_renderer_uses_is_reserved_from_the_admins_extras() -> None:
    """An extra volume or mount may not take a name or a path of the engine's own: the
    reserved sets must hold every one the renderer makes, under every configuration."""
    configs = [OperatorConfig(), OperatorConfig(model_cache=ModelCache("cache-claim"))]
    seen_volumes, seen_paths = set(), set()
    for config in configs:
        for path in ALL_EXAMPLES:
            for cr in load_llmdeployments(path):
                for obj in render_children(cr, plan(cr.spec, config), config):
                    if obj["kind"] != "Deployment":
                        continue
                    pod = obj["spec"]["template"]["spec"]
                    seen_volumes |= {v["name"] for v in pod["volumes"]}
                    for container in [*pod.get("initContainers", []), *pod["containers"]]:
                        seen_paths |= {m["mountPath"] for m in container["volumeMounts"]}
    assert seen_volumes <= RESERVED_VOLUMES, seen_volumes - RESERVED_VOLUMES
    assert seen_paths <= RESERVED_MOUNTS, seen_paths - RESERVED_MOUNTS
