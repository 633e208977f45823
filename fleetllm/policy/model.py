"""The policy document (chart values `policy:` -> the operator's ConfigMap -> `--policy FILE`).

Every default is the safe one: an LLMDeployment that sets nothing the policy names passes, and
one that reaches for another identity, image, Secret or scheduling privilege is refused.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, field_validator

from fleetllm.api.base import SpecModel
from fleetllm.api.manifests import format_validation_error
from fleetllm.api.quantity import QUANTITY_PATTERN
from fleetllm.images import BUILT_IMAGES, UPSTREAM_IMAGES

# Repositories, not tags: an upgrade of the pinned images stays allowed. The project's own
# images by their organisation (ghcr.io/fleetllm/), never the whole registry.
DEFAULT_REGISTRIES = [
    *sorted({f"{b.image.registry}/{b.image.repository.rpartition('/')[0]}/" for b in BUILT_IMAGES}),
    *sorted({i.rpartition(":")[0] for i in UPSTREAM_IMAGES}),
]
# Names that change what code runs (the loader, the interpreter; vLLM's logging config, which
# logging.config.dictConfig reads and whose "()" entries it calls, the libraries it dlopens and
# the binary it starts: any file the pull fetched, `*.json` included, would do) or where
# weights and credentials go (endpoint and proxy overrides).
DEFAULT_DENIED_ENV = [
    "LD_*",
    "PYTHON*",
    "VLLM_LOGGING_CONFIG_PATH",
    "*_SO_PATH",
    "VLLM_RUST_FRONTEND_PATH",
    "*_ENDPOINT",
    "*_ENDPOINT_URL",
    "*_ENDPOINT_URL_*",
    "HF_HUB_*",
    "*_PROXY",
    "SSL_CERT_*",
    "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE",
    "FLEETLLM_API_KEY",
    "VLLM_API_KEY",
]
# What the weights' pull container gets of spec.engine.env: its credentials only.
DEFAULT_PULL_ENV = [
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
]
# Annotations that loosen the pod's confinement or add containers to it.
DEFAULT_DENIED_ANNOTATIONS = [
    "container.apparmor.security.beta.kubernetes.io/*",
    "seccomp.security.alpha.kubernetes.io/*",
    "*.security.alpha.kubernetes.io/*",
    "*.security.beta.kubernetes.io/*",
    "security.*",
    "sidecar.istio.io/*",
    "linkerd.io/inject",
    "*.linkerd.io/*",
    "vault.hashicorp.com/*",
    "kubectl.kubernetes.io/default-container",
]
# Engine flags that run code or read files the author picks: vLLM imports a repository's
# Python with --trust-remote-code, a file's with --tool-parser-plugin and
# --reasoning-parser-plugin, and gives --log-config-file's JSON to logging.config.dictConfig
# (which calls what its "()" entries name).
DEFAULT_DENIED_ARGS = [
    "--trust-remote-code",
    "--allowed-local-media-path",
    "--log-config-file",
    "--tool-parser-plugin",
    "--reasoning-parser-plugin",
]
DEFAULT_SECRET_LABEL = "fleetllm.io/engine-env"


class NamePolicy(SpecModel):
    """Glob patterns: a name matching `denied` is refused unless it also matches `allowed`.
    For an allowlist, deny `*` and list what is allowed."""

    denied: list[str] = Field(default_factory=list)
    allowed: list[str] = Field(default_factory=list)


class Policy(SpecModel):
    allowed_image_registries: list[str] = Field(
        default_factory=lambda: list(DEFAULT_REGISTRIES),
        description="Prefixes an engine image must start with; `*` allows every image.",
    )
    allowed_service_accounts: list[str] = Field(
        default_factory=list,
        description="spec.pod.serviceAccountName values allowed (globs); none by default: "
        "engines run as their namespace's default ServiceAccount, with no token mounted.",
    )
    env: NamePolicy = Field(
        default_factory=lambda: NamePolicy(denied=list(DEFAULT_DENIED_ENV)),
        description="spec.engine.env names (matched case-insensitively).",
    )
    extra_args: NamePolicy = Field(
        default_factory=lambda: NamePolicy(denied=list(DEFAULT_DENIED_ARGS)),
        description="spec.engine.extraArgs flags (the part before any `=`).",
    )
    pull_env: list[str] = Field(
        default_factory=lambda: list(DEFAULT_PULL_ENV),
        description="spec.engine.env names (globs) the weights' pull container also gets.",
    )
    secret_label: str = Field(
        DEFAULT_SECRET_LABEL,
        min_length=1,
        description="A secretKeyRef in spec.engine.env may only name a Secret carrying this "
        "label (`key` or `key=value`).",
    )
    annotations: NamePolicy = Field(
        default_factory=lambda: NamePolicy(denied=list(DEFAULT_DENIED_ANNOTATIONS)),
        description="spec.pod.annotations keys.",
    )
    allowed_priority_classes: list[str] = Field(
        default_factory=list, description="spec.pod.priorityClassName values allowed (globs)."
    )
    allowed_toleration_keys: list[str] = Field(
        default_factory=lambda: ["nvidia.com/gpu"],
        description="Taint keys spec.pod.tolerations may tolerate (globs); a toleration "
        "without a key tolerates every taint and needs `*` listed.",
    )
    max_resources: dict[str, str] = Field(
        default_factory=dict,
        description="Resource name -> the most one engine container may request or limit "
        "(Kubernetes quantities), planned values included.",
    )
    max_replicas: int | None = Field(None, ge=0, description="Most replicas (spec and scaling).")
    engine_ingress_from: list[dict[str, Any]] = Field(
        default_factory=list,
        description="More NetworkPolicyPeers allowed to reach the engines (Prometheus, say); "
        "the fleet's router and operator always are.",
    )
    allowed_model_claims: list[str] = Field(
        default_factory=lambda: ["*"],
        description="Claims a pvc:// model source may name (globs).",
    )

    @field_validator("max_resources")
    @classmethod
    def _quantities(cls, caps: dict[str, str]) -> dict[str, str]:
        for name, value in caps.items():
            if not re.match(QUANTITY_PATTERN, str(value)):
                raise ValueError(f"{name}: {value!r} is not a Kubernetes quantity")
        return caps

    @property
    def secret_label_pair(self) -> tuple[str, str | None]:
        key, sep, value = self.secret_label.partition("=")
        return key, value if sep else None


DEFAULT_POLICY = Policy()


class PolicyFileError(ValueError):
    pass


def load_policy(path: str | Path) -> Policy:
    """A policy file (YAML or JSON); an empty file is the default policy."""
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise PolicyFileError(f"{path}: {exc}") from None
    if not isinstance(data, dict):
        raise PolicyFileError(f"{path}: a policy is a mapping of fields")
    try:
        return Policy.model_validate(data)
    except ValidationError as exc:
        raise PolicyFileError(f"{path}: {format_validation_error(exc)}") from None
