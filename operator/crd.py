"""The LLMDeployment CustomResourceDefinition, generated from the pydantic models.

Pydantic emits JSON Schema (2020-12, with $refs and anyOf-null for optional fields); Kubernetes
wants a structural OpenAPI v3 schema: every node typed and inlined, `nullable` instead of null
branches, boolean exclusive bounds, and `x-kubernetes-*` markers for free-form objects and
int-or-string quantities. `structural()` does that translation.
"""

from __future__ import annotations

import json
from typing import Any

import yaml

from fleetllm.api.deployment import (
    API_VERSION,
    GROUP,
    KIND,
    NAME_MAX_LENGTH,
    NAME_PATTERN,
    PLURAL,
    SHORT_NAMES,
    SINGULAR,
    VERSION,
    LLMDeploymentSpec,
)
from fleetllm.api.status import LLMDeploymentStatus

# JSON Schema keywords that carry over unchanged into a Kubernetes OpenAPI v3 schema.
_KEPT = {
    "type",
    "description",
    "enum",
    "default",
    "format",
    "pattern",
    "minimum",
    "maximum",
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "required",
}


def _resolve(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return _resolve(merged, defs)
    return node


def structural(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """Translate one pydantic JSON Schema node into a structural Kubernetes schema node."""
    node = _resolve(node, defs)
    if "anyOf" in node:
        branches = [_resolve(b, defs) for b in node["anyOf"]]
        non_null = [b for b in branches if b.get("type") != "null"]
        outer = {k: v for k, v in node.items() if k != "anyOf"}
        if outer.get("default", 0) is None:
            del outer["default"]
        if len(non_null) == 1:
            return structural({**non_null[0], **outer}, defs)
        types = {b.get("type") for b in non_null}
        if types == {"integer", "string"}:
            return structural({**outer, "x-kubernetes-int-or-string": True}, defs)
        raise ValueError(f"cannot express anyOf {types} in a structural schema")

    out: dict[str, Any] = {k: v for k, v in node.items() if k in _KEPT}
    out.update({k: v for k, v in node.items() if k.startswith("x-kubernetes-")})
    if "const" in node:
        out["enum"] = [node["const"]]
    if "exclusiveMinimum" in node:
        out["minimum"] = node["exclusiveMinimum"]
        out["exclusiveMinimum"] = True
    if "exclusiveMaximum" in node:
        out["maximum"] = node["exclusiveMaximum"]
        out["exclusiveMaximum"] = True
    if out.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        return out

    kind = out.get("type")
    if kind == "object":
        if "properties" in node:
            out["properties"] = {
                key: structural(value, defs) for key, value in node["properties"].items()
            }
        extra = node.get("additionalProperties")
        if isinstance(extra, dict) and extra:
            out["additionalProperties"] = structural(extra, defs)
        elif extra is True or extra == {} or ("properties" not in node and extra is None):
            out["x-kubernetes-preserve-unknown-fields"] = True
    elif kind == "array":
        out["items"] = structural(node["items"], defs)
    return out


def _schema_of(model: Any) -> dict[str, Any]:
    schema = model.model_json_schema(by_alias=True, mode="validation")
    return structural(schema, schema.get("$defs", {}))


def openapi_schema() -> dict[str, Any]:
    spec = _schema_of(LLMDeploymentSpec)
    status = _schema_of(LLMDeploymentStatus)
    status["description"] = LLMDeploymentStatus.__doc__
    return {
        "type": "object",
        "description": "An LLM served by a fleet of engine replicas, planned to fit its GPUs.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": status,
        },
        "x-kubernetes-validations": [
            {
                "rule": f"self.metadata.name.size() <= {NAME_MAX_LENGTH} && "
                f"self.metadata.name.matches('{NAME_PATTERN}')",
                "message": f"name must be a DNS-1035 label of at most {NAME_MAX_LENGTH} "
                "characters (it names the model's Service)",
            }
        ],
    }


def crd() -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{PLURAL}.{GROUP}",
            "labels": {"app.kubernetes.io/name": "fleetllm"},
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": SHORT_NAMES,
                "categories": ["fleetllm"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": openapi_schema()},
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": [
                        {"name": "Model", "type": "string", "jsonPath": ".spec.model.name"},
                        {"name": "GPU", "type": "string", "jsonPath": ".spec.gpu.type"},
                        {"name": "TP", "type": "integer", "jsonPath": ".spec.parallelism.tensor"},
                        {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas"},
                        {
                            "name": "Desired",
                            "type": "integer",
                            "jsonPath": ".status.desiredReplicas",
                        },
                        {
                            "name": "Planned",
                            "type": "string",
                            "priority": 1,
                            "jsonPath": '.status.conditions[?(@.type=="Planned")].status',
                        },
                        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                    ],
                }
            ],
        },
    }


HEADER = "# Generated by `fleetllm crds` from fleetllm/api/; do not edit by hand.\n"


def crd_yaml() -> str:
    return HEADER + yaml.safe_dump(crd(), sort_keys=False, width=100)


def _reference_rows(node: dict[str, Any], path: str, required: bool) -> list[str]:
    kind = node.get("type") or (
        "int or string" if node.get("x-kubernetes-int-or-string") else "object"
    )
    if "enum" in node:
        kind = " \\| ".join(f"`{value}`" for value in node["enum"])
    bounds = [
        f"{label} {node[key]}"
        for key, label in (("minimum", ">="), ("maximum", "<="))
        if key in node
    ]
    notes = [node.get("description", "").replace("\n", " ").replace("|", "\\|")]
    if "default" in node and node["default"] != {}:
        notes.append(f"Default `{json.dumps(node['default'])}`.")
    if bounds:
        notes.append(f"({', '.join(bounds)})")
    if required:
        notes.append("Required.")
    rows = [f"| `{path}` | {kind} | {' '.join(n for n in notes if n)} |"]
    children = node.get("properties") or {}
    if node.get("type") == "array" and "properties" in node.get("items", {}):
        children = node["items"]["properties"]
        node = node["items"]
        path += "[]"
    for key, sub in children.items():
        rows += _reference_rows(sub, f"{path}.{key}", key in node.get("required", []))
    return rows


def reference_markdown() -> str:
    """docs/crd-reference.md: every field of spec and status, from the same schema."""
    schema = openapi_schema()
    lines = [
        "# LLMDeployment reference",
        "",
        f"`{API_VERSION}`, kind `{KIND}`, namespaced, short name `{SHORT_NAMES[0]}`. Generated by",
        "`fleetllm crds --reference` from the models the CRD is generated from.",
        "",
        "| field | type | description |",
        "| --- | --- | --- |",
    ]
    for part in ("spec", "status"):
        lines += _reference_rows(schema["properties"][part], part, part == "spec")
    return "\n".join(lines) + "\n"
