"""What a spec leaves to the planner to find out: its GPU type, its model's architecture, the
dtype `auto` means, the memory of a device and the node labels that pick one."""

from __future__ import annotations

from fleetllm.api.catalog import BUILTIN_MODELS, GPU_TYPES, MODELS, GPUType, ModelArch, find_model
from fleetllm.api.deployment import LLMDeploymentSpec
from fleetllm.api.quantity import parse_quantity
from fleetllm.api.source import ModelSource
from fleetllm.planner.errors import PlanError
from fleetllm.planner.settings import OperatorConfig


def resolve_gpu(name: str) -> GPUType:
    gpu = GPU_TYPES.get(name)
    if gpu is None:
        raise PlanError(
            "UnknownGPUType", f"gpu.type {name!r} is not in the catalog ({', '.join(GPU_TYPES)})"
        )
    return gpu


def resolve_arch(spec: LLMDeploymentSpec, source: ModelSource) -> ModelArch:
    """model.config, else model.architecture, else the catalog entry the source names."""
    model = spec.model
    if model.config is not None:
        cfg = model.config
        heads = cfg.num_heads
        return ModelArch(
            name=model.architecture or model.name,
            num_layers=cfg.num_layers,
            hidden_size=cfg.hidden_size,
            num_heads=heads,
            num_kv_heads=cfg.num_kv_heads or heads,
            head_dim=cfg.head_dim or cfg.hidden_size // heads,
            vocab_size=cfg.vocab_size,
            max_position=cfg.max_position_embeddings,
            intermediate_size=cfg.intermediate_size,
            tied_embeddings=cfg.tied_embeddings,
            parameters=cfg.parameters,
        )
    if model.architecture is not None:
        arch = MODELS.get(model.architecture)
        if arch is None:
            raise PlanError(
                "UnknownModel",
                f"model.architecture {model.architecture!r} is not in the catalog "
                f"({', '.join(MODELS)}); give model.config instead",
            )
        return arch
    if source.scheme == "builtin":
        if source.location not in BUILTIN_MODELS:
            raise PlanError(
                "UnknownModel",
                f"builtin://{source.location} is not a built-in model "
                f"({', '.join(f'builtin://{n}' for n in BUILTIN_MODELS)})",
            )
        return MODELS[BUILTIN_MODELS[source.location]]
    arch = find_model(f"{source.location}/{source.path}")
    if arch is None:
        raise PlanError(
            "UnknownModel",
            f"cannot tell the architecture of {model.source!r}: set model.architecture to one "
            f"of {', '.join(MODELS)}, or give model.config",
        )
    return arch


def resolve_dtype(spec: LLMDeploymentSpec, gpu: GPUType, cpu_bf16: bool) -> str:
    if spec.engine.dtype == "bfloat16" and gpu.is_gpu and not gpu.supports_bf16:
        raise PlanError(
            "UnsupportedDtype",
            f"{gpu.name} ({gpu.architecture}) has no bfloat16; use engine.dtype: float16 (or auto)",
        )
    if spec.engine.dtype != "auto":
        return spec.engine.dtype
    # bf16 matmuls are slow on CPUs without bf16 instructions, and Turing GPUs lack them.
    if not gpu.is_gpu:
        return "bfloat16" if cpu_bf16 else "float32"
    return "bfloat16" if gpu.supports_bf16 else "float16"


def memory_bytes(spec: LLMDeploymentSpec, gpu: GPUType) -> int:
    """Per-device memory; for cpu replicas the pod memory limit when one is given."""
    if not gpu.is_gpu and spec.pod.resources is not None:
        limit = spec.pod.resources.limits.get("memory")
        if limit is not None:
            return int(parse_quantity(limit))
    return gpu.memory_bytes


def node_selector(spec: LLMDeploymentSpec, gpu: GPUType, config: OperatorConfig) -> dict[str, str]:
    """The node labels of the spec's (else the operator's) node-selector profile for `gpu`."""
    profile = spec.gpu.node_selector_profile or config.gpu_profile
    labels = gpu.node_labels(profile)
    if labels is None:
        raise PlanError(
            "NoNodeLabelForGPU",
            f"the {profile} node-selector profile has no label for gpu.type {gpu.name} (that "
            "cluster kind does not offer it); set gpu.nodeSelectorProfile: none and choose "
            "nodes with pod.nodeSelector",
        )
    return labels


def resolve_max_model_len(spec: LLMDeploymentSpec, arch: ModelArch) -> int:
    """maxModelLen, else the model's whole context; never more than the model supports."""
    max_model_len = spec.max_model_len or arch.max_position
    if max_model_len > arch.max_position:
        raise PlanError(
            "MaxModelLenTooLong",
            f"maxModelLen {max_model_len} exceeds what {arch.name} supports "
            f"({arch.max_position} tokens)",
        )
    return max_model_len
