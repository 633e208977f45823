"""spec.scaling: the autoscaler's bounds and targets, and what each scaling mode can do."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from fleetllm.api.base import SpecModel
from fleetllm.api.rules import Rule, cel_validations, check, ordered

DEFAULT_QUEUE_TIME_SECONDS = 1.0
MAX_HPA_DELAY_SECONDS = 3600
"""The longest scale-down stabilization window an HPA (and so KEDA) takes."""


_LABEL = r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?"
# A Service's in-cluster name: SERVICE, or SERVICE.NAMESPACE.svc[.cluster.local]; the first
# label starts with a letter, so no IP address matches. Not SERVICE.NAMESPACE: `attacker.com`
# has that form, and when no namespace `com` exists the cluster's DNS falls through to the
# internet's.
PROMETHEUS_ADDRESS_PATTERN = (
    rf"^https?://[a-z]([-a-z0-9]{{0,61}}[a-z0-9])?"
    rf"((\.{_LABEL})*\.svc(\.cluster\.local)?)?"
    r"(:[0-9]{1,5})?(/\S*)?$"
)


def _mode_is_not(mode: str) -> str:
    return f"!has(self.mode) || self.mode != '{mode}'"


SCALING_RULES: tuple[Rule[ScalingSpec], ...] = (
    ordered("bounds", "minReplicas", "maxReplicas"),
    Rule(
        "zero-needs-min-0",
        "!has(self.scaleToZeroAfterSeconds) || self.minReplicas == 0",
        lambda s: s.scale_to_zero_after_seconds is None or s.min_replicas == 0,
        "scaleToZeroAfterSeconds needs minReplicas: 0",
    ),
    Rule(
        "keda-needs-prometheus",
        f"{_mode_is_not('keda')} || has(self.prometheusAddress)",
        lambda s: s.mode != "keda" or s.prometheus_address is not None,
        "mode keda needs prometheusAddress",
    ),
    Rule(
        "hpa-not-to-zero",
        f"{_mode_is_not('hpa')} || self.minReplicas >= 1",
        lambda s: s.mode != "hpa" or s.min_replicas >= 1,
        "mode hpa needs minReplicas >= 1 (the HPA does not scale to zero)",
    ),
    Rule(
        "keda-zero-needs-cooldown",
        f"{_mode_is_not('keda')} || self.minReplicas >= 1 || has(self.scaleToZeroAfterSeconds)",
        lambda s: (
            s.mode != "keda" or s.min_replicas >= 1 or s.scale_to_zero_after_seconds is not None
        ),
        "mode keda with minReplicas 0 needs scaleToZeroAfterSeconds (KEDA scales an idle model "
        "to zero after that cooldown; the builtin mode never does without it)",
    ),
    Rule(
        "hpa-delay",
        "!has(self.mode) || self.mode == 'builtin' || !has(self.scaleDownDelaySeconds)"
        f" || self.scaleDownDelaySeconds <= {MAX_HPA_DELAY_SECONDS}",
        lambda s: s.mode == "builtin" or s.scale_down_delay_seconds <= MAX_HPA_DELAY_SECONDS,
        f"modes hpa and keda take scaleDownDelaySeconds up to {MAX_HPA_DELAY_SECONDS} (the HPA's "
        "longest stabilization window); use mode builtin for a longer delay",
    ),
    Rule(
        "hpa-queue-time",
        f"{_mode_is_not('hpa')} || !has(self.targetQueueTimeSeconds)"
        f" || self.targetQueueTimeSeconds == {DEFAULT_QUEUE_TIME_SECONDS}",
        lambda s: s.mode != "hpa" or s.target_queue_time_seconds == DEFAULT_QUEUE_TIME_SECONDS,
        "mode hpa scales on KV-cache usage only (a queue-time p90 needs PromQL): "
        f"targetQueueTimeSeconds other than {DEFAULT_QUEUE_TIME_SECONDS:g} takes effect with modes "
        "builtin and keda",
    ),
)
"""What the modes hpa and keda cannot do as the builtin autoscaler does is refused rather than
silently done otherwise."""


class ScalingSpec(SpecModel):
    """Bounds and targets for the autoscaler. spec.replicas is kept within the bounds; without
    scaling, nothing but the user (and the router's scale from zero) changes it."""

    model_config = ConfigDict(json_schema_extra=cel_validations(SCALING_RULES))

    min_replicas: int = Field(1, ge=0, le=1000, description="Fewest replicas (0 allows zero).")
    max_replicas: int = Field(ge=1, le=1000, description="Most replicas.")
    target_kv_cache_usage: float = Field(
        0.8,
        gt=0,
        le=1,
        alias="targetKVCacheUsage",
        description="Scale up above this mean KV-cache usage (0..1).",
    )
    target_queue_time_seconds: float = Field(
        DEFAULT_QUEUE_TIME_SECONDS,
        gt=0,
        le=3600,
        description="Scale up when requests queue longer than this.",
    )
    scale_down_delay_seconds: int = Field(
        300, ge=0, le=86400, description="Quiet time before removing a replica."
    )
    scale_to_zero_after_seconds: int | None = Field(
        None, ge=1, le=604800, description="Idle time before scaling to zero (minReplicas: 0)."
    )
    mode: Literal["builtin", "keda", "hpa"] = Field(
        "builtin",
        description="builtin: the operator scales from the engines' /metrics; keda: render a "
        "KEDA ScaledObject on Prometheus queries instead; hpa: render an autoscaling/v2 "
        "HorizontalPodAutoscaler on the engines' metrics through the custom metrics API.",
    )
    prometheus_address: str | None = Field(
        None,
        pattern=PROMETHEUS_ADDRESS_PATTERN,
        max_length=2048,
        description="mode keda: the in-cluster Prometheus server KEDA queries "
        "(http[s]://SERVICE[.NAMESPACE.svc[.cluster.local]][:PORT][/PATH]); never an IP "
        "address or an outside host, which KEDA would query with its own identity.",
    )

    @model_validator(mode="after")
    def _rules(self) -> ScalingSpec:
        return check(self, SCALING_RULES)
