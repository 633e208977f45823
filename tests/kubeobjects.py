"""What the emulated API server does to objects, apart from serving them: timestamps,
Status answers, label selectors, merge patches, and validation against the real schemas."""

from __future__ import annotations

import copy
import datetime
from typing import Any

import kubernetes_validate
import kubeschemas
from openapi_schema_validator import OAS30Validator

from fleetllm.operator.crd import openapi_schema

KUBERNETES_VERSIONS = ("1.30", "1.37")
VALIDATED_GROUPS = {"", "apps", "policy", "autoscaling"}


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def status_object(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Status",
        "metadata": {},
        "status": "Failure",
        "code": code,
        "reason": reason,
        "message": message,
    }


def parse_selector(text: str) -> list[tuple[str, str, str | None]]:
    """(operator, key, value) terms of an equality-based label selector."""
    terms: list[tuple[str, str, str | None]] = []
    for raw in filter(None, (t.strip() for t in text.split(","))):
        if "!=" in raw:
            key, value = raw.split("!=", 1)
            terms.append(("!=", key.strip(), value.strip()))
        elif "=" in raw:
            key, value = raw.replace("==", "=").split("=", 1)
            terms.append(("=", key.strip(), value.strip()))
        elif raw.startswith("!"):
            terms.append(("!", raw[1:].strip(), None))
        else:
            terms.append(("exists", raw, None))
    return terms


def selected(terms: list[tuple[str, str, str | None]], obj: dict[str, Any]) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    for op, key, value in terms:
        if (
            (op == "=" and labels.get(key) != value)
            or (op == "!=" and labels.get(key) == value)
            or (op == "!" and key in labels)
            or (op == "exists" and key not in labels)
        ):
            return False
    return True


def merge(old: Any, patch: Any) -> Any:
    """A JSON merge patch (RFC 7386): None deletes a key."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(old) if isinstance(old, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge(result.get(key), value)
    return result


class Schemas:
    """Built-in kinds against the Kubernetes JSON schemas (strict), in every version we
    support; the LLMDeployment kind (`cr_resource`) against the generated CRD schema."""

    def __init__(self, cr_resource: Any) -> None:
        self.cr_resource = cr_resource
        self._cr_validator = OAS30Validator(openapi_schema())

    def problems(self, resource: Any, obj: dict[str, Any]) -> list[str]:
        found: list[str] = []
        if resource == self.cr_resource:
            found += [f"{e.json_path}: {e.message}" for e in self._cr_validator.iter_errors(obj)]
        elif resource.group in VALIDATED_GROUPS:
            for version in KUBERNETES_VERSIONS:
                try:
                    kubeschemas.validate(obj, version)
                except kubernetes_validate.ValidationError as exc:
                    found.append(f"{version}: {'.'.join(map(str, exc.path))}: {exc.message}")
        return found
