"""The LLMDeployment custom resource as pydantic models: the single source of truth.

The CRD in crds/ is generated from these models (`fleetllm crds`); field names are the
camelCase aliases Kubernetes users write, and every description here is what `kubectl explain`
prints. Models reject unknown fields, so a typo is an error, not a silently ignored setting.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

from fleetllm.kube import Resource
from fleetllm.operator.catalog import GPU_PROFILES, GPU_TYPES

GROUP = "fleetllm.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "LLMDeployment"
PLURAL = "llmdeployments"
SINGULAR = "llmdeployment"
SHORT_NAMES = ["llmd"]
LLMDEPLOYMENTS = Resource(API_VERSION, PLURAL, KIND)

# A Service is named after its LLMDeployment, so the name must be a DNS-1035 label; the longest
# child suffix ("-engine") must still fit in 63 characters.
NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
NAME_MAX_LENGTH = 56
# The served model name becomes the `fleetllm.io/model` label value of every child.
MODEL_NAME_PATTERN = r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
SOURCE_PATTERN = r"^(hf://[^/@\s]+/[^/@\s]+(@[^@\s]+)?|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/\S*)?|s3://[^/\s]+(/\S*)?|builtin://[-a-z0-9.]+|file://\S+)$"
QUANTITY_PATTERN = r"^[+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][-+]?[0-9]+|[KMGTPE]i?|[mkunM])?$"

Quantity = Annotated[
    str | int,
    Field(json_schema_extra={"x-kubernetes-int-or-string": True}),
]


class _Model(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )


class ModelConfig(_Model):
    """Architecture of a model that is not in the built-in catalog; the planner sizes weights
    and KV cache from it. Give intermediateSize (exact) or parameters (total count)."""

    num_layers: int = Field(ge=1, le=1024, description="Number of transformer layers.")
    hidden_size: int = Field(ge=1, le=1 << 17, description="Hidden (model) dimension.")
    num_heads: int = Field(ge=1, le=1024, description="Number of attention (query) heads.")
    num_kv_heads: int | None = Field(
        None,
        ge=1,
        le=1024,
        alias="numKVHeads",
        description="Key/value heads (GQA); defaults to numHeads.",
    )
    head_dim: int | None = Field(
        None, ge=1, le=1024, description="Dimension of one head; defaults to hiddenSize/numHeads."
    )
    vocab_size: int = Field(ge=1, le=1 << 22, description="Vocabulary size.")
    max_position_embeddings: int = Field(
        ge=16, le=1 << 24, description="Longest context the model supports, in tokens."
    )
    intermediate_size: int | None = Field(
        None, ge=1, le=1 << 20, description="MLP inner dimension (SwiGLU)."
    )
    parameters: int | None = Field(
        None, ge=1, description="Total parameter count, when intermediateSize is not given."
    )
    tied_embeddings: bool = Field(
        False, description="Whether the output head shares the input embedding matrix."
    )

    @model_validator(mode="after")
    def _sizable(self) -> ModelConfig:
        if self.intermediate_size is None and self.parameters is None:
            raise ValueError("give intermediateSize or parameters, so that weights can be sized")
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(
                f"hiddenSize {self.hidden_size} is not divisible by numHeads {self.num_heads}; "
                "give headDim"
            )
        if self.num_kv_heads is not None and self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"numHeads {self.num_heads} is not a multiple of numKVHeads {self.num_kv_heads}"
            )
        return self


class ModelSpec(_Model):
    """Which model to serve and under which name."""

    name: str = Field(
        min_length=1,
        max_length=63,
        pattern=MODEL_NAME_PATTERN,
        description="Served model name: the `model` field of OpenAI requests, also the "
        "fleetllm.io/model label of every child object.",
    )
    source: str = Field(
        pattern=SOURCE_PATTERN,
        description="Where the weights come from: hf://org/name[@revision], "
        "pvc://claim[/path], s3://bucket/path, builtin://smollm2-135m (in the image), or "
        "file://path (a local folder or .gguf file; `fleetllm up` only, relative paths are "
        "read from the manifest's folder).",
    )
    architecture: str | None = Field(
        None,
        description="Catalog entry to size the model by (e.g. Llama-3.1-8B); inferred from "
        "the source when omitted.",
    )
    config: ModelConfig | None = Field(
        None, description="Inline architecture for models outside the catalog."
    )


class EnvVar(_Model):
    """An environment variable of the engine container (as in a Pod spec)."""

    name: str = Field(min_length=1, pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
    value: str | None = None
    value_from: dict[str, Any] | None = Field(
        None, description="A Kubernetes EnvVarSource (secretKeyRef, configMapKeyRef, ...)."
    )


class EngineSpec(_Model):
    """The inference engine that runs in each replica."""

    backend: Literal["builtin", "vllm"] = Field(
        "builtin", description="builtin: fleetllm's own engine; vllm: the vLLM OpenAI server."
    )
    image: str | None = Field(
        None, min_length=1, description="Container image; a pinned default per backend."
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Activation and unquantized weight dtype; auto is bfloat16 on GPUs that "
        "have it (float16 on others), and on CPUs bfloat16 only where they compute it natively "
        "(the operator's --cpu-bf16; `fleetllm up` reads its own CPU), else float32.",
    )
    max_num_seqs: int | None = Field(
        None,
        ge=1,
        le=4096,
        description="At most this many sequences run at once (the planned value is the lesser; "
        "lower it when preemptions rise). Default: planned from the KV-cache capacity.",
    )
    extra_args: list[str] = Field(
        default_factory=list,
        description="Extra engine flags, appended after the planned ones; flags the planner "
        "sets are refused here (use the matching spec field), and with the builtin engine so "
        "is anything `fleetllm engine serve` would refuse.",
    )
    env: list[EnvVar] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
        description="Extra environment variables of the engine (and of the container that "
        "pulls the weights); one per name, and a name the operator also sets takes this value.",
    )
    drain_seconds: int = Field(
        60,
        ge=0,
        le=3600,
        description="How long in-flight requests may finish after a replica is told to stop.",
    )

    @model_validator(mode="after")
    def _env_names_once(self) -> EngineSpec:
        names = [var.name for var in self.env]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(f"env sets {', '.join(twice)} more than once")
        return self


class QuantizationSpec(_Model):
    """Quantization of the weights and of the KV cache."""

    weights: Literal["none", "int8", "fp8", "awq", "gptq"] = Field(
        "none",
        description="none: unquantized weights; fp8: quantized at load (Ada/Hopper); int8: "
        "quantized at load by the builtin engine, an int8 checkpoint for vLLM; awq, gptq "
        "(vLLM only): the source must be a checkpoint quantized that way.",
    )
    kv_cache: Literal["auto", "fp8", "int8"] = Field(
        "auto",
        description="KV cache element type: auto follows the model dtype; fp8 needs "
        "Ada/Hopper; int8 is served by the builtin engine only.",
    )


class ParallelismSpec(_Model):
    """How one replica spreads the model over its devices (tensor x pipeline GPUs)."""

    tensor: int = Field(1, ge=1, le=64, description="Tensor-parallel degree.")
    pipeline: int = Field(1, ge=1, le=64, description="Pipeline-parallel degree.")


class SpeculativeSpec(_Model):
    """Speculative decoding (vLLM's speculative_config): draft tokens proposed by matching
    n-grams in the context, verified in one forward pass; the output is unchanged."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "self.promptLookupMin <= self.promptLookupMax",
                    "message": "promptLookupMin must not exceed promptLookupMax",
                }
            ]
        }
    )

    method: Literal["ngram"] = Field("ngram", description="How drafts are proposed.")
    num_speculative_tokens: int = Field(ge=1, le=16, description="Draft tokens proposed per step.")
    prompt_lookup_max: int = Field(
        4, ge=1, le=64, description="Longest n-gram matched against the context."
    )
    prompt_lookup_min: int = Field(
        1, ge=1, le=64, description="Shortest n-gram matched against the context."
    )

    @model_validator(mode="after")
    def _lookup_bounds(self) -> SpeculativeSpec:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"promptLookupMin {self.prompt_lookup_min} exceeds promptLookupMax "
                f"{self.prompt_lookup_max}"
            )
        return self


class GPUSpec(_Model):
    """The accelerator each replica runs on; the count is tensor x pipeline."""

    type: str = Field(
        json_schema_extra={"enum": list(GPU_TYPES)},
        description="Accelerator type from the catalog; cpu runs without one.",
    )
    node_selector_profile: str | None = Field(
        None,
        json_schema_extra={"enum": list(GPU_PROFILES)},
        description="Which node labels select this GPU type: gfd (nvidia.com/gpu.product), "
        "gke (cloud.google.com/gke-accelerator), karpenter "
        "(karpenter.k8s.aws/instance-gpu-name), or none (no GPU label; set pod.nodeSelector "
        "to choose nodes yourself). Defaults to the operator's --gpu-profile.",
    )

    @model_validator(mode="after")
    def _known(self) -> GPUSpec:
        if self.node_selector_profile is not None and self.node_selector_profile not in (
            GPU_PROFILES
        ):
            raise ValueError(
                f"nodeSelectorProfile {self.node_selector_profile!r} is not one of "
                f"{', '.join(GPU_PROFILES)}"
            )
        return self


DEFAULT_QUEUE_TIME_SECONDS = 1.0
MAX_HPA_DELAY_SECONDS = 3600
"""The longest scale-down stabilization window an HPA (and so KEDA) takes."""
# What the modes hpa and keda cannot do as the builtin autoscaler does: refused rather than
# silently done otherwise.
KEDA_ZERO_MESSAGE = (
    "mode keda with minReplicas 0 needs scaleToZeroAfterSeconds (KEDA scales an idle model to "
    "zero after that cooldown; the builtin mode never does without it)"
)
HPA_DELAY_MESSAGE = (
    f"modes hpa and keda take scaleDownDelaySeconds up to {MAX_HPA_DELAY_SECONDS} (the HPA's "
    "longest stabilization window); use mode builtin for a longer delay"
)
HPA_QUEUE_MESSAGE = (
    "mode hpa scales on KV-cache usage only (a queue-time p90 needs PromQL): "
    f"targetQueueTimeSeconds other than {DEFAULT_QUEUE_TIME_SECONDS:g} takes effect with modes "
    "builtin and keda"
)


class ScalingSpec(_Model):
    """Bounds and targets for the autoscaler. spec.replicas is kept within the bounds; without
    scaling, nothing but the user (and the router's scale from zero) changes it."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "self.minReplicas <= self.maxReplicas",
                    "message": "minReplicas must not exceed maxReplicas",
                },
                {
                    "rule": "!has(self.scaleToZeroAfterSeconds) || self.minReplicas == 0",
                    "message": "scaleToZeroAfterSeconds needs minReplicas: 0",
                },
                {
                    "rule": "!has(self.mode) || self.mode != 'keda' || has(self.prometheusAddress)",
                    "message": "mode keda needs prometheusAddress",
                },
                {
                    "rule": "!has(self.mode) || self.mode != 'hpa' || self.minReplicas >= 1",
                    "message": "mode hpa needs minReplicas >= 1 (the HPA does not scale to zero)",
                },
                {
                    "rule": "!has(self.mode) || self.mode != 'keda' || self.minReplicas >= 1"
                    " || has(self.scaleToZeroAfterSeconds)",
                    "message": KEDA_ZERO_MESSAGE,
                },
                {
                    "rule": "!has(self.mode) || self.mode == 'builtin'"
                    " || !has(self.scaleDownDelaySeconds)"
                    f" || self.scaleDownDelaySeconds <= {MAX_HPA_DELAY_SECONDS}",
                    "message": HPA_DELAY_MESSAGE,
                },
                {
                    "rule": "!has(self.mode) || self.mode != 'hpa'"
                    " || !has(self.targetQueueTimeSeconds)"
                    f" || self.targetQueueTimeSeconds == {DEFAULT_QUEUE_TIME_SECONDS}",
                    "message": HPA_QUEUE_MESSAGE,
                },
            ]
        }
    )

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
        pattern=r"^https?://[^\s/]+(/\S*)?$",
        max_length=2048,
        description="mode keda: the Prometheus server KEDA queries (http://host:port).",
    )

    @model_validator(mode="after")
    def _bounds(self) -> ScalingSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"minReplicas {self.min_replicas} exceeds maxReplicas {self.max_replicas}"
            )
        if self.scale_to_zero_after_seconds is not None and self.min_replicas != 0:
            raise ValueError("scaleToZeroAfterSeconds needs minReplicas: 0")
        if self.mode == "keda" and self.prometheus_address is None:
            raise ValueError("mode keda needs prometheusAddress")
        if self.mode == "hpa" and self.min_replicas < 1:
            raise ValueError("mode hpa needs minReplicas >= 1 (the HPA does not scale to zero)")
        if (
            self.mode == "keda"
            and self.min_replicas == 0
            and self.scale_to_zero_after_seconds is None
        ):
            raise ValueError(KEDA_ZERO_MESSAGE)
        if self.mode != "builtin" and self.scale_down_delay_seconds > MAX_HPA_DELAY_SECONDS:
            raise ValueError(HPA_DELAY_MESSAGE)
        if self.mode == "hpa" and self.target_queue_time_seconds != DEFAULT_QUEUE_TIME_SECONDS:
            raise ValueError(HPA_QUEUE_MESSAGE)
        return self


class RoutingSpec(_Model):
    """How the router spreads this model's requests over its replicas."""

    strategy: Literal["prefix", "least-load", "round-robin", "session"] = Field(
        "prefix",
        description="prefix: consistent hashing on the prompt prefix with bounded load; "
        "least-load; round-robin; session: sticky by a request header.",
    )
    load_factor: float = Field(
        1.25, ge=1, le=10, description="prefix: no replica takes more than this x mean load."
    )
    session_header: str = Field(
        "x-session-id", min_length=1, description="session: the header that keys a session."
    )


class Toleration(_Model):
    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class ResourceRequirements(_Model):
    """Requests and limits that override the planned ones key by key."""

    requests: dict[str, Quantity] = Field(default_factory=dict)
    limits: dict[str, Quantity] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _quantities(self) -> ResourceRequirements:
        for part, values in (("requests", self.requests), ("limits", self.limits)):
            for key, value in values.items():
                if not re.match(QUANTITY_PATTERN, str(value)):
                    raise ValueError(f"{part}.{key}: {value!r} is not a Kubernetes quantity")
        return self


class PodSpec(_Model):
    """Settings passed through to the engine pods."""

    resources: ResourceRequirements | None = None
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)
    affinity: dict[str, Any] | None = Field(
        None, description="A Kubernetes Affinity; replaces the default spreading over nodes."
    )
    priority_class_name: str | None = None
    service_account_name: str | None = None
    annotations: dict[str, str] = Field(default_factory=dict, description="Pod annotations.")


def _default(model: type[BaseModel]) -> Any:
    return Field(default_factory=model, json_schema_extra={"default": {}})


class LLMDeploymentSpec(_Model):
    """One served model: what it is, what it runs on, and how many replicas."""

    model: ModelSpec
    engine: EngineSpec = _default(EngineSpec)
    quantization: QuantizationSpec = _default(QuantizationSpec)
    parallelism: ParallelismSpec = _default(ParallelismSpec)
    speculative: SpeculativeSpec | None = None
    gpu: GPUSpec
    max_model_len: int | None = Field(
        None,
        ge=16,
        le=1 << 24,
        description="Longest prompt + completion, in tokens; defaults to the model's limit.",
    )
    replicas: int = Field(
        1,
        ge=0,
        le=1000,
        description="Desired replicas (kubectl scale, the router and the autoscaler set it); "
        "kept within scaling.minReplicas..maxReplicas when scaling is given.",
    )
    scaling: ScalingSpec | None = None
    routing: RoutingSpec = _default(RoutingSpec)
    pod: PodSpec = _default(PodSpec)

    def desired_replicas(self) -> int:
        if self.scaling is None:
            return self.replicas
        return min(max(self.replicas, self.scaling.min_replicas), self.scaling.max_replicas)


class _Status(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")


class Condition(_Status):
    """A Kubernetes-style condition."""

    type: Literal["Planned", "Progressing", "Ready", "Degraded", "ScaledToZero"]
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$", max_length=1024)
    message: str = Field("", max_length=32768)
    last_transition_time: str = Field(
        json_schema_extra={"format": "date-time"}, description="When status last changed."
    )
    observed_generation: int | None = Field(None, ge=0)


class PlanStatus(_Status):
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


class LLMDeploymentStatus(_Status):
    """Observed state, written by the operator."""

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
    last_scale_time: str | None = Field(
        None,
        json_schema_extra={"format": "date-time"},
        description="When the autoscaler (spec.scaling.mode builtin) last changed spec.replicas.",
    )
    last_scale_reason: str | None = Field(
        None, max_length=4096, description="Why, as `FROM -> TO: what the autoscaler saw`."
    )


class ObjectMeta(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    name: str = Field(min_length=1, max_length=NAME_MAX_LENGTH, pattern=NAME_PATTERN)
    namespace: str | None = None
    uid: str | None = None
    generation: int | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


class LLMDeployment(_Model):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="ignore", frozen=True
    )

    api_version: Literal["fleetllm.io/v1alpha1"]
    kind: Literal["LLMDeployment"]
    metadata: ObjectMeta
    spec: LLMDeploymentSpec


class ModelSource(BaseModel):
    """A parsed `spec.model.source`."""

    model_config = ConfigDict(frozen=True)

    scheme: Literal["hf", "pvc", "s3", "builtin", "file"]
    location: str
    """hf: org/name; pvc: the claim; s3: bucket/path; builtin: the model's name; file: a
    local path."""
    revision: str | None = None
    path: str = ""
    """pvc: the model's folder inside the claim."""

    @classmethod
    def parse(cls, source: str) -> ModelSource:
        if not re.match(SOURCE_PATTERN, source):
            raise ValueError(
                f"model source {source!r} is not hf://, pvc://, s3://, builtin:// or file://"
            )
        scheme, rest = source.split("://", 1)
        if scheme == "hf":
            repo, _, revision = rest.partition("@")
            return cls(scheme="hf", location=repo, revision=revision or None)
        if scheme == "pvc":
            claim, _, path = rest.partition("/")
            return cls(scheme="pvc", location=claim, path=path.strip("/"))
        return cls(scheme=scheme, location=rest)  # type: ignore[arg-type]

    @property
    def downloaded(self) -> bool:
        """Whether the weights must be fetched into the pod (hf://, s3://) before loading."""
        return self.scheme in ("hf", "s3")

    def cache_key(self) -> str:
        """This source's folder in a model cache: readable, and distinct per repository and
        revision (`hf/Qwen/Qwen2.5-7B-Instruct/main`)."""
        parts = [self.scheme, *self.location.split("/")]
        if self.scheme == "hf":
            parts.append(self.revision or "main")
        return "/".join(_path_part(part) for part in parts if part)


def _path_part(part: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", part)
    return "_" if safe in (".", "..") else safe


def format_validation_error(exc: ValidationError) -> str:
    """One line per problem, each naming the field path as users write it."""
    lines = []
    for err in exc.errors():
        path = ".".join(str(part) for part in err["loc"]) or "(document)"
        lines.append(f"{path}: {err['msg']}")
    return "; ".join(lines)


def parse_llmdeployment(doc: Any, where: str = "document") -> LLMDeployment:
    """Validate one object as an LLMDeployment; errors say where and which field."""
    if not isinstance(doc, dict):
        raise ValueError(f"{where}: expected a mapping, got {type(doc).__name__}")
    if doc.get("apiVersion") != API_VERSION or doc.get("kind") != KIND:
        raise ValueError(
            f"{where}: not an LLMDeployment (apiVersion {doc.get('apiVersion')!r}, "
            f"kind {doc.get('kind')!r}; expected {API_VERSION!r}, {KIND!r})"
        )
    try:
        return LLMDeployment.model_validate(doc)
    except ValidationError as exc:
        name = (doc.get("metadata") or {}).get("name", "?")
        raise ValueError(f"{where}: LLMDeployment {name}: {format_validation_error(exc)}") from None


def load_llmdeployments(path: str | Path) -> list[LLMDeployment]:
    """Every LLMDeployment in a (multi-document) YAML file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file") from None
    except (IsADirectoryError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read: {exc}") from None
    try:
        docs = [doc for doc in yaml.safe_load_all(text) if doc is not None]
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML: {exc}") from None
    if not docs:
        raise ValueError(f"{path}: no LLMDeployment in the file")
    return [
        parse_llmdeployment(doc, f"{path} (document {index})" if len(docs) > 1 else str(path))
        for index, doc in enumerate(docs, start=1)
    ]


_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
}


def parse_quantity(value: str | int) -> Decimal:
    """A Kubernetes quantity ("24Gi", "500m", "1e3", 4) as a number."""
    text = str(value).strip()
    match = re.match(r"^([+]?[0-9.]+(?:[eE][-+]?[0-9]+)?)([a-zA-Z]*)$", text)
    if not match or not re.match(QUANTITY_PATTERN, text):
        raise ValueError(f"{value!r} is not a Kubernetes quantity")
    number, suffix = match.groups()
    try:
        amount = Decimal(number)
    except InvalidOperation:
        raise ValueError(f"{value!r} is not a Kubernetes quantity") from None
    if suffix in _BINARY:
        return amount * _BINARY[suffix]
    if suffix in _DECIMAL:
        return amount * Decimal(_DECIMAL[suffix])
    if suffix:
        raise ValueError(f"{value!r} has an unknown suffix {suffix!r}")
    return amount
