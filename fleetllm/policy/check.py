"""An LLMDeployment against the admin's policy: each refused field with the rule it breaks.

Pure: the one fact that needs the cluster (the labels of a Secret that engine.env names) is
returned as a SecretRef for the caller to look up; `fleetllm render`, offline, warns about it.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fleetllm.api.deployment import LLMDeployment
from fleetllm.api.quantity import parse_quantity
from fleetllm.api.source import ModelSource
from fleetllm.planner.vllm_args import option_spellings
from fleetllm.policy.model import NamePolicy, Policy


@dataclass(frozen=True)
class Violation:
    field: str
    """The refused field, as written in the LLMDeployment (spec.engine.env[0].name)."""
    rule: str
    """The policy field that refuses it (env.denied)."""
    detail: str

    def __str__(self) -> str:
        return f"{self.field}: {self.detail} (policy {self.rule})"


@dataclass(frozen=True)
class SecretRef:
    """A Secret that spec.engine.env reads, which must carry the policy's secretLabel."""

    field: str
    name: str


@dataclass
class PolicyReport:
    violations: list[Violation] = field(default_factory=list)
    secrets: list[SecretRef] = field(default_factory=list)

    @property
    def message(self) -> str:
        return "; ".join(str(v) for v in self.violations)


def _matches(name: str, patterns: Iterable[str], fold_case: bool = False) -> bool:
    if fold_case:
        return any(fnmatch.fnmatchcase(name.upper(), p.upper()) for p in patterns)
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def refused_name(name: str, rules: NamePolicy, fold_case: bool = False) -> str | None:
    """The denied pattern that refuses `name`, or None when it passes."""
    if _matches(name, rules.allowed, fold_case):
        return None
    return next((p for p in rules.denied if _matches(name, [p], fold_case)), None)


def image_allowed(image: str, registries: Iterable[str]) -> bool:
    return any(prefix == "*" or image.startswith(prefix) for prefix in registries)


def _env(cr: LLMDeployment, policy: Policy, report: PolicyReport) -> None:
    for i, var in enumerate(cr.spec.engine.env):
        where = f"spec.engine.env[{i}]"
        pattern = refused_name(var.name, policy.env, fold_case=True)
        if pattern is not None:
            report.violations.append(
                Violation(f"{where}.name", "env.denied", f"{var.name} matches {pattern!r}")
            )
        secret = (var.value_from or {}).get("secretKeyRef")
        if isinstance(secret, Mapping):
            report.secrets.append(
                SecretRef(f"{where}.valueFrom.secretKeyRef", secret.get("name", ""))
            )


def _resources(
    resources: Mapping[str, Mapping[str, Any]], policy: Policy, report: PolicyReport
) -> None:
    for part in ("requests", "limits"):
        for name, value in (resources.get(part) or {}).items():
            cap = policy.max_resources.get(name)
            if cap is not None and parse_quantity(value) > parse_quantity(cap):
                report.violations.append(
                    Violation(
                        f"spec.pod.resources.{part}.{name}",
                        f"maxResources.{name}",
                        f"{value} (planned or set) is more than {cap}",
                    )
                )


def check(
    cr: LLMDeployment,
    policy: Policy,
    image: str,
    resources: Mapping[str, Mapping[str, Any]],
    own_images: Iterable[str] = (),
) -> PolicyReport:
    """`image` and `resources` are the engine container's as rendered: the planned defaults
    count against the caps as much as what the spec sets."""
    report = PolicyReport()
    pod = cr.spec.pod
    add = report.violations.append
    if image not in own_images and not image_allowed(image, policy.allowed_image_registries):
        add(Violation("spec.engine.image", "allowedImageRegistries", f"{image} is not allowed"))
    if pod.service_account_name and not _matches(
        pod.service_account_name, policy.allowed_service_accounts
    ):
        add(
            Violation(
                "spec.pod.serviceAccountName",
                "allowedServiceAccounts",
                f"{pod.service_account_name} is not allowed",
            )
        )
    _env(cr, policy, report)
    for i, arg in enumerate(cr.spec.engine.extra_args):
        if not arg.startswith("-"):
            continue
        # vLLM reads abbreviations and underscores as the flag they name.
        spellings = (
            option_spellings(arg) if cr.spec.engine.backend == "vllm" else (arg.partition("=")[0],)
        )
        # The option is what is allowed or denied, whichever of its spellings a rule names.
        allowed = any(_matches(f, policy.extra_args.allowed) for f in spellings)
        denied = [(f, p) for f in spellings if (p := refused_name(f, policy.extra_args))]
        if denied and not allowed:
            flag, pattern = denied[0]
            add(
                Violation(
                    f"spec.engine.extraArgs[{i}]", "extraArgs.denied", f"{flag} matches {pattern!r}"
                )
            )
    for key in pod.annotations:
        pattern = refused_name(key, policy.annotations)
        if pattern is not None:
            add(
                Violation(
                    f"spec.pod.annotations[{key}]",
                    "annotations.denied",
                    f"{key} matches {pattern!r}",
                )
            )
    if pod.priority_class_name and not _matches(
        pod.priority_class_name, policy.allowed_priority_classes
    ):
        add(
            Violation(
                "spec.pod.priorityClassName",
                "allowedPriorityClasses",
                f"{pod.priority_class_name} is not allowed",
            )
        )
    for i, toleration in enumerate(pod.tolerations):
        key = toleration.key or ""
        # A key-less toleration matches every taint: only an explicit `*` allows it.
        allowed = (
            "*" in policy.allowed_toleration_keys
            if not key
            else _matches(key, policy.allowed_toleration_keys)
        )
        if not allowed:
            add(
                Violation(
                    f"spec.pod.tolerations[{i}].key",
                    "allowedTolerationKeys",
                    f"{key or 'every taint'} may not be tolerated",
                )
            )
    _resources(resources, policy, report)
    if policy.max_replicas is not None:
        most = max(cr.spec.replicas, cr.spec.scaling.max_replicas if cr.spec.scaling else 0)
        if most > policy.max_replicas:
            add(
                Violation(
                    "spec.scaling.maxReplicas" if cr.spec.scaling else "spec.replicas",
                    "maxReplicas",
                    f"{most} is more than {policy.max_replicas}",
                )
            )
    source = ModelSource.parse(cr.spec.model.source)
    if source.scheme == "pvc" and not _matches(source.location, policy.allowed_model_claims):
        add(
            Violation(
                "spec.model.source", "allowedModelClaims", f"claim {source.location} is not allowed"
            )
        )
    return report


def secret_refusal(
    ref: SecretRef, labels: Mapping[str, str] | None, policy: Policy
) -> Violation | None:
    """Whether a Secret with these labels (None: it does not exist) may be read by the engine."""
    key, value = policy.secret_label_pair
    wanted = key if value is None else f"{key}={value}"
    if labels is not None and key in labels and (value is None or labels[key] == value):
        return None
    missing = "does not exist" if labels is None else f"lacks the label {wanted}"
    return Violation(ref.field, "secretLabel", f"Secret {ref.name} {missing}")


def pull_env(env: list[dict[str, Any]], policy: Policy) -> list[dict[str, Any]]:
    """The variables of spec.engine.env the weights' pull container gets: its credentials,
    never what redirects it (HF_ENDPOINT) or changes what it runs."""
    return [var for var in env if _matches(var["name"], policy.pull_env, fold_case=True)]
