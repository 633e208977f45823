"""The LLMDeployment's status as the operator writes it: each field has one writer. The
reconciler writes `ReconciledStatus` (what it observes and plans, conditions included); the
builtin autoscaler writes `ScaleRecord` when it changes spec.replicas; the adapter loader
writes `AdapterRecord` (each LoRA adapter's state). The CRD's status is all three,
`LLMDeploymentStatus`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fleetllm.api.base import StatusModel


class Condition(StatusModel):
    """A Kubernetes-style condition."""

    type: Literal["Planned", "Progressing", "Ready", "Degraded", "ScaledToZero"]
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$", max_length=1024)
    message: str = Field("", max_length=32768)
    last_transition_time: str = Field(
        json_schema_extra={"format": "date-time"}, description="When status last changed."
    )
    observed_generation: int | None = Field(None, ge=0)


class PlanStatus(StatusModel):
    """What the planner decided; memory figures are per device."""

    backend: str
    device: str = Field(description="Where the engine runs: cuda (the GPUs) or cpu.")
    gpu_type: str
    gpu_count: int = Field(description="Devices per replica (tensor x pipeline).")
    device_memory_gib: float = Field(alias="deviceMemoryGiB")
    weights_gib: float = Field(alias="weightsGiB", description="Weights per device.")
    kv_cache_gib: float = Field(alias="kvCacheGiB", description="KV cache per device.")
    overhead_gib: float = Field(
        alias="overheadGiB", description="Activations and runtime per device."
    )
    lora_gib: float | None = Field(
        None,
        alias="loraGiB",
        description="LoRA adapter slots per device (on a CPU, with the adapters kept loaded).",
    )
    kv_bytes_per_token: int = Field(description="KV bytes one token takes on one device.")
    max_concurrent_tokens: int = Field(description="KV capacity of a replica, in tokens.")
    max_concurrent_sequences: int = Field(description="Full maxModelLen sequences that fit.")
    max_model_len: int
    dtype: str
    kv_cache_dtype: str
    weights: str
    gpu_memory_utilization: float
    block_size: int
    num_kv_blocks: int = Field(alias="numKVBlocks")
    max_num_seqs: int
    max_num_batched_tokens: int
    image: str
    engine_args: list[str]


ScaleChange = Literal["up", "down", "to-zero", "from-zero", "bounds"]
"""How the builtin autoscaler changed spec.replicas."""


class ReconciledStatus(StatusModel):
    """The status fields the reconciler writes, and nothing else does."""

    observed_generation: int | None = Field(None, description="Generation last reconciled.")
    conditions: list[Condition] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    replicas: int = Field(0, description="Engine pods that exist.")
    ready_replicas: int = Field(0, description="Engine pods that serve.")
    desired_replicas: int = Field(0, description="spec.replicas within the scaling bounds.")
    selector: str | None = Field(None, description="Label selector of the engine pods (scale).")
    plan: PlanStatus | None = None
    endpoint: str | None = Field(None, description="In-cluster URL of the replicas' Service.")


class ScaleRecord(StatusModel):
    """The status fields the builtin autoscaler writes when it changes spec.replicas (and
    removes once it no longer drives the LLMDeployment), and nothing else does."""

    last_scale_time: str | None = Field(
        None,
        json_schema_extra={"format": "date-time"},
        description="When the autoscaler (spec.scaling.mode builtin) last changed spec.replicas.",
    )
    last_scale_reason: str | None = Field(
        None, max_length=4096, description="Why, as `FROM -> TO: what the autoscaler saw`."
    )
    last_scale_change: ScaleChange | None = Field(
        None,
        description="What that change was: up, down, to-zero (idle), from-zero (the router's "
        "demand) or bounds (into minReplicas..maxReplicas).",
    )


AdapterState = Literal["Pending", "Ready", "Failed"]


class AdapterStatus(StatusModel):
    """One adapter of spec.adapters as the replicas hold it."""

    name: str
    state: AdapterState = Field(
        description="Ready: loaded on every ready replica; Failed: its files cannot be had or "
        "a replica refused it (message says why); Pending: on its way."
    )
    reason: str = Field(pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$", max_length=1024)
    message: str = Field("", max_length=32768)
    path: str | None = Field(
        None, description="Where the replicas read its files, once they are in place."
    )
    loaded_replicas: int = Field(0, description="Ready replicas that hold it.")


class AdapterRecord(StatusModel):
    """The status fields the operator's adapter loader writes, and nothing else does."""

    adapters: list[AdapterStatus] | None = Field(
        None,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
        description="Each adapter of spec.adapters: whether the replicas serve it, or why not.",
    )


def field_names(model: type[StatusModel]) -> frozenset[str]:
    """The status keys (camelCase, as the API stores them) of a part of the status."""
    return frozenset(info.alias or name for name, info in model.model_fields.items())


SCALE_RECORD_FIELDS = field_names(ScaleRecord)
"""The status keys the builtin autoscaler writes."""
ADAPTER_RECORD_FIELDS = field_names(AdapterRecord)
"""The status keys the adapter loader writes."""


class LLMDeploymentStatus(AdapterRecord, ScaleRecord, ReconciledStatus):
    """Observed state, written by the operator."""
