"""The LLMDeployment custom resource as pydantic models: the single source of truth.

The CRD in crds/ is generated from these models (`fleetllm crds`); field names are the
camelCase aliases Kubernetes users write, and every description here is what `kubectl explain`
prints. Models reject unknown fields, so a typo is an error, not a silently ignored setting.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from fleetllm.api.base import MODEL_NAME_PATTERN, SpecModel
from fleetllm.api.catalog import GPU_PROFILES, GPU_TYPES
from fleetllm.api.lora import MAX_ADAPTERS, AdapterSpec, LoraSpec
from fleetllm.api.quantity import QUANTITY_PATTERN, Quantity
from fleetllm.api.rules import Rule, cel_validations, check, ordered
from fleetllm.api.scaling import ScalingSpec
from fleetllm.api.source import SOURCE_PATTERN
from fleetllm.kube.resources import Resource

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


class ModelConfig(SpecModel):
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


class ModelSpec(SpecModel):
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


class EnvVar(SpecModel):
    """An environment variable of the engine container (as in a Pod spec)."""

    name: str = Field(min_length=1, pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
    value: str | None = None
    value_from: dict[str, Any] | None = Field(
        None, description="A Kubernetes EnvVarSource (secretKeyRef, configMapKeyRef, ...)."
    )


class EngineSpec(SpecModel):
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
        description="Extra engine flags, appended after the planned ones and read as the "
        "engine's own parser reads them (vLLM's: `--max_model_len`, `--flag=value`, unique "
        "prefixes); flags the planner sets are refused here, however spelt (use the matching "
        "spec field), and so is anything the engine's parser would refuse (an unknown flag, a "
        "missing value, a bad choice), with its message.",
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


class QuantizationSpec(SpecModel):
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


class ParallelismSpec(SpecModel):
    """How one replica spreads the model over its devices (tensor x pipeline GPUs)."""

    tensor: int = Field(1, ge=1, le=64, description="Tensor-parallel degree.")
    pipeline: int = Field(1, ge=1, le=64, description="Pipeline-parallel degree.")


SPECULATIVE_RULES: tuple[Rule[SpeculativeSpec], ...] = (
    ordered("lookup-bounds", "promptLookupMin", "promptLookupMax"),
)


class SpeculativeSpec(SpecModel):
    """Speculative decoding (vLLM's speculative_config): draft tokens proposed by matching
    n-grams in the context, verified in one forward pass; the output is unchanged."""

    model_config = ConfigDict(json_schema_extra=cel_validations(SPECULATIVE_RULES))

    method: Literal["ngram"] = Field("ngram", description="How drafts are proposed.")
    num_speculative_tokens: int = Field(ge=1, le=16, description="Draft tokens proposed per step.")
    prompt_lookup_max: int = Field(
        4, ge=1, le=64, description="Longest n-gram matched against the context."
    )
    prompt_lookup_min: int = Field(
        1, ge=1, le=64, description="Shortest n-gram matched against the context."
    )

    @model_validator(mode="after")
    def _rules(self) -> SpeculativeSpec:
        return check(self, SPECULATIVE_RULES)


class GPUSpec(SpecModel):
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
        "(karpenter.k8s.aws/instance-gpu-name), auto (no selector, but nodes labelled as "
        "another GPU type are avoided), or none (no GPU label; set pod.nodeSelector to choose "
        "nodes yourself). Defaults to the operator's --gpu-profile.",
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


class RoutingSpec(SpecModel):
    """How the router spreads this model's requests over its replicas."""

    strategy: Literal["prefix", "least-load", "round-robin", "session", "kv-aware"] = Field(
        "prefix",
        description="prefix: consistent hashing on the prompt prefix with bounded load; "
        "least-load; round-robin; session: sticky by a request header; kv-aware: the replica "
        "whose KV cache holds most of the prompt, as its KV-cache events tell, with bounded "
        "load (the engines publish their events; prefix where the router cannot know).",
    )
    load_factor: float = Field(
        1.25,
        ge=1,
        le=10,
        description="prefix, kv-aware: no replica takes more than this x mean load.",
    )
    session_header: str = Field(
        "x-session-id", min_length=1, description="session: the header that keys a session."
    )


class Toleration(SpecModel):
    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class ResourceRequirements(SpecModel):
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


class PodSpec(SpecModel):
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


def _duplicates(names: list[str]) -> list[str]:
    return sorted({name for name in names if names.count(name) > 1})


SPEC_RULES: tuple[Rule[LLMDeploymentSpec], ...] = (
    Rule(
        "adapters-need-lora",
        "!has(self.adapters) || size(self.adapters) == 0 || has(self.lora)",
        lambda s: not s.adapters or s.lora is not None,
        "adapters need lora (the engines' adapter slots)",
        detail=lambda s: (
            "adapters need lora (the engines' adapter slots; `lora: {}` for the "
            "defaults): set it once, since changing it restarts the replicas and adding adapters "
            "does not"
        ),
    ),
    Rule(
        "adapter-not-model",
        "!has(self.adapters) || self.adapters.all(a, a.name != self.model.name)",
        lambda s: all(a.name != s.model.name for a in s.adapters),
        "an adapter may not take the model's own name",
        detail=lambda s: f"adapter {s.model.name} takes the model's own name",
    ),
    Rule(
        "adapter-names-unique",
        "!has(self.adapters) || "
        "self.adapters.all(a, self.adapters.exists_one(b, b.name == a.name))",
        lambda s: not _duplicates([a.name for a in s.adapters]),
        "adapter names must be unique",
        detail=lambda s: (
            f"adapters name {', '.join(_duplicates([a.name for a in s.adapters]))} more than once"
        ),
    ),
)


class LLMDeploymentSpec(SpecModel):
    """One served model: what it is, what it runs on, and how many replicas."""

    model_config = ConfigDict(json_schema_extra=cel_validations(SPEC_RULES))

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
    lora: LoraSpec | None = Field(
        None,
        description="LoRA in the engines (their adapter slots); needed by adapters. Changing it "
        "restarts the replicas.",
    )
    adapters: list[AdapterSpec] = Field(
        default_factory=list,
        max_length=MAX_ADAPTERS,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
        description="LoRA adapters served on top of the model, each under its own name; added "
        "and removed while the replicas run (each replica loads them through its load API), "
        "never restarting them.",
    )

    @model_validator(mode="after")
    def _rules(self) -> LLMDeploymentSpec:
        return check(self, SPEC_RULES)

    @property
    def autoscaled_by_builtin(self) -> bool:
        """Whether the builtin autoscaler drives spec.replicas: scaling is given, in mode builtin
        (the default). Modes hpa and keda leave it to an HPA or a KEDA ScaledObject the
        operator renders; without scaling only users and the router's scale from zero change
        it."""
        return self.scaling is not None and self.scaling.mode == "builtin"

    def desired_replicas(self) -> int:
        if self.scaling is None:
            return self.replicas
        return min(max(self.replicas, self.scaling.min_replicas), self.scaling.max_replicas)


class ObjectMeta(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    name: str = Field(min_length=1, max_length=NAME_MAX_LENGTH, pattern=NAME_PATTERN)
    namespace: str | None = None
    uid: str | None = None
    generation: int | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


class LLMDeployment(SpecModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="ignore", frozen=True
    )

    api_version: Literal["fleetllm.io/v1alpha1"]
    kind: Literal["LLMDeployment"]
    metadata: ObjectMeta
    spec: LLMDeploymentSpec
