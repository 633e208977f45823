"""The generated CRD: current in crds/, valid for Kubernetes, and it accepts the examples and
rejects invalid LLMDeployments, like the pydantic models it is generated from."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import celpy
import kubeschemas
import pytest
import yaml
from openapi_schema_validator import OAS30Validator

from fleetllm.api.catalog import GPU_TYPES
from fleetllm.api.manifests import parse_llmdeployment
from fleetllm.operator.crd import crd, crd_yaml, reference_markdown
from fleetllm.planner.errors import PlanError
from fleetllm.planner.plan import plan

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = sorted((ROOT / "manifests" / "examples").glob("*.yaml"))
CRD_FILE = ROOT / "crds" / "fleetllm.io_llmdeployments.yaml"


def _schema() -> dict[str, Any]:
    return crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def cel_violations(schema: dict[str, Any], value: Any, path: str = "self") -> list[str]:
    """Evaluate the x-kubernetes-validations rules of `schema` on `value`, as the API server
    does: each rule at its own node, with `self` bound to the value there."""
    found: list[str] = []
    env = celpy.Environment()
    for rule in schema.get("x-kubernetes-validations", []):
        program = env.program(env.compile(rule["rule"]))
        if not program.evaluate({"self": celpy.json_to_cel(value)}):
            found.append(f"{path}: {rule['message']}")
    if isinstance(value, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key in value:
                found += cel_violations(sub, value[key], f"{path}.{key}")
    if isinstance(value, list) and "items" in schema:
        for index, item in enumerate(value):
            found += cel_violations(schema["items"], item, f"{path}[{index}]")
    return found


def _with_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Apply the schema's defaults, as the API server does before validating."""
    if isinstance(value, dict):
        result = dict(value)
        for key, sub in (schema.get("properties") or {}).items():
            if key not in result and "default" in sub:
                result[key] = copy.deepcopy(sub["default"])
            if key in result:
                result[key] = _with_defaults(sub, result[key])
        return result
    if isinstance(value, list) and "items" in schema:
        return [_with_defaults(schema["items"], item) for item in value]
    return value


def schema_errors(obj: dict[str, Any]) -> list[str]:
    schema = _schema()
    defaulted = _with_defaults(schema, obj)
    errors = [f"{e.json_path}: {e.message}" for e in OAS30Validator(schema).iter_errors(defaulted)]
    return errors + (cel_violations(schema, defaulted) if not errors else [])


def _examples() -> list[dict[str, Any]]:
    return [doc for path in EXAMPLES for doc in yaml.safe_load_all(path.read_text()) if doc]


def test_crds_folder_holds_the_current_generated_crd() -> None:
    assert CRD_FILE.read_text() == crd_yaml(), "regenerate with scripts/generate.sh: " + str(
        CRD_FILE.relative_to(ROOT)
    )


def test_the_field_reference_is_current() -> None:
    reference = ROOT / "docs" / "crd-reference.md"
    assert reference.read_text() == reference_markdown(), "regenerate with scripts/generate.sh"
    assert "| `spec.scaling.targetKVCacheUsage` | number |" in reference.read_text()


@pytest.mark.parametrize("version", ["1.30", "1.37"])
def test_the_crd_is_a_valid_custom_resource_definition(version: str) -> None:
    kubeschemas.validate(yaml.safe_load(CRD_FILE.read_text()), version)


def test_the_crd_has_status_scale_and_printer_columns() -> None:
    version = crd()["spec"]["versions"][0]
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    assert "status" in version["subresources"]
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns[:5] == ["Model", "GPU", "TP", "Ready", "Desired"]
    assert columns[-1] == "Age"
    spec = _schema()["properties"]["spec"]
    gpu = spec["properties"]["gpu"]["properties"]
    assert gpu["type"]["enum"] == list(GPU_TYPES)
    assert {"L40S", "T4", "H100-NVL", "GH200", "B200", "H200", "cpu"} <= set(GPU_TYPES)
    assert gpu["nodeSelectorProfile"]["enum"] == ["none", "gfd", "gke", "karpenter", "auto"]
    assert spec["properties"]["engine"]["properties"]["backend"]["enum"] == ["builtin", "vllm"]
    assert "description" in spec["properties"]["maxModelLen"]


def _structural_problems(node: dict[str, Any], path: str = "") -> list[str]:
    """What the API server refuses in a CRD schema: untyped nodes, refs, anyOf types, nulls."""
    problems = []
    if "$ref" in node or "anyOf" in node or "title" in node:
        problems.append(path)
    free = node.get("x-kubernetes-preserve-unknown-fields") or node.get(
        "x-kubernetes-int-or-string"
    )
    if "type" not in node and not free:
        problems.append(f"{path}: untyped")
    for key, sub in (node.get("properties") or {}).items():
        problems += _structural_problems(sub, f"{path}.{key}")
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            problems += _structural_problems(node[key], f"{path}.{key}")
    return problems


def test_the_schema_is_structural() -> None:
    assert _structural_problems(_schema()) == []


@pytest.mark.parametrize("doc", _examples(), ids=lambda d: d["metadata"]["name"])
def test_every_example_validates_against_the_crd_schema(doc: dict[str, Any]) -> None:
    assert schema_errors(doc) == []
    parse_llmdeployment(doc)


def _set(doc: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    *parents, last = dotted.split(".")
    node = doc
    for key in parents:
        node = node.setdefault(key, {})
    if value is _DELETE:
        del node[last]
    else:
        node[last] = value
    return doc


_DELETE = object()
BASE = next(d for d in _examples() if d["metadata"]["name"] == "llama-8b-l4")

INVALID = {
    "unknown backend": ("spec.engine.backend", "tgi"),
    "int4 is not a weight quantization": ("spec.quantization.weights", "int4"),
    "no model": ("spec.model", _DELETE),
    "no gpu": ("spec.gpu", _DELETE),
    "source scheme": ("spec.model.source", "http://example.com/model"),
    "model name with a slash": ("spec.model.name", "meta-llama/Llama-3.1-8B"),
    "negative replicas": ("spec.replicas", -1),
    "replicas as text": ("spec.replicas", "two"),
    "tensor 0": ("spec.parallelism.tensor", 0),
    "context too short": ("spec.maxModelLen", 8),
    "usage above 1": ("spec.scaling.targetKVCacheUsage", 1.5),
    "min above max": ("spec.scaling.minReplicas", 9),
    "scale to zero needs min 0": ("spec.scaling.scaleToZeroAfterSeconds", 600),
    "keda needs a Prometheus address": ("spec.scaling.mode", "keda"),
    "hpa cannot scale to zero": (
        "spec.scaling",
        {"minReplicas": 0, "maxReplicas": 2, "mode": "hpa"},
    ),
    "unknown scaling mode": ("spec.scaling.mode", "vpa"),
    "keda to zero needs a cooldown": (
        "spec.scaling",
        {"minReplicas": 0, "maxReplicas": 2, "mode": "keda", "prometheusAddress": "http://p:9"},
    ),
    "hpa delay beyond an hour": (
        "spec.scaling",
        {"maxReplicas": 2, "mode": "hpa", "scaleDownDelaySeconds": 3601},
    ),
    "keda delay beyond an hour": (
        "spec.scaling",
        {
            "maxReplicas": 2,
            "mode": "keda",
            "prometheusAddress": "http://p:9",
            "scaleDownDelaySeconds": 86400,
        },
    ),
    "hpa queue time target": (
        "spec.scaling",
        {"maxReplicas": 2, "mode": "hpa", "targetQueueTimeSeconds": 0.25},
    ),
    "routing strategy": ("spec.routing.strategy", "random"),
    "name not a DNS label": ("metadata.name", "Llama_8B"),
}


@pytest.mark.parametrize("case", sorted(INVALID))
def test_invalid_llmdeployments_fail_both_the_crd_schema_and_the_models(case: str) -> None:
    field, value = INVALID[case]
    doc = _set(BASE, field, value)
    assert schema_errors(doc), f"the CRD schema accepts: {case}"
    with pytest.raises(ValueError):
        parse_llmdeployment(doc)


def test_an_unknown_gpu_type_is_refused_by_the_schema_and_by_the_planner() -> None:
    doc = _set(BASE, "spec.gpu.type", "V100")
    assert schema_errors(doc)
    # The model takes any name so that the planner can refuse it with the catalog in the message.
    with pytest.raises(PlanError, match="'V100' is not in the catalog"):
        plan(parse_llmdeployment(doc).spec)


def test_model_errors_name_the_field() -> None:
    doc = _set(BASE, "spec.maxModelLength", 4096)
    with pytest.raises(ValueError, match=r"spec\.maxModelLength: Extra inputs are not permitted"):
        parse_llmdeployment(doc, "llama.yaml")
    doc = _set(BASE, "spec.scaling.minReplicas", 9)
    with pytest.raises(ValueError, match="minReplicas 9 exceeds maxReplicas 4"):
        parse_llmdeployment(doc, "llama.yaml")


@pytest.mark.parametrize(
    "scaling",
    [
        {"minReplicas": 0, "maxReplicas": 2, "scaleDownDelaySeconds": 86400},
        {"maxReplicas": 2, "mode": "hpa", "scaleDownDelaySeconds": 3600},
        {"maxReplicas": 2, "mode": "hpa", "targetQueueTimeSeconds": 1.0},
        {
            "minReplicas": 0,
            "maxReplicas": 2,
            "mode": "keda",
            "prometheusAddress": "http://p:9",
            "scaleToZeroAfterSeconds": 600,
            "targetQueueTimeSeconds": 0.25,
        },
    ],
)
def test_the_autoscaler_rules_accept_what_each_mode_does(scaling: dict[str, Any]) -> None:
    doc = _set(BASE, "spec.scaling", scaling)
    assert schema_errors(doc) == []
    parse_llmdeployment(doc)
