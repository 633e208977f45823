"""`plan()`: one replica of an LLMDeployment sized on its device, with the engine's tuned
command line, or a PlanError that says why it cannot run and what would fit."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from fleetllm.api.catalog import GPUType, ModelArch
from fleetllm.api.deployment import LLMDeploymentSpec
from fleetllm.api.lora import LoraSpec
from fleetllm.api.source import ModelSource
from fleetllm.api.status import PlanStatus
from fleetllm.planner.checks import (
    check_backend,
    check_claims,
    check_gpu_resources,
    check_placement,
    check_source,
)
from fleetllm.planner.engine_argv import engine_command
from fleetllm.planner.errors import PlanError
from fleetllm.planner.extra_args import check_extra_args
from fleetllm.planner.lora_fit import check_lora_fits
from fleetllm.planner.memory import MemoryEstimate, estimate, gib, weight_bytes
from fleetllm.planner.parallelism import check_builtin_parallelism, check_parallelism
from fleetllm.planner.placement import IN_CLUSTER, LocalPlacement, Placement, fills_cache
from fleetllm.planner.resolve import (
    memory_bytes,
    node_selector,
    resolve_arch,
    resolve_dtype,
    resolve_gpu,
    resolve_max_model_len,
)
from fleetllm.planner.settings import DEFAULT_CONFIG, OperatorConfig
from fleetllm.planner.suggest import suggestions
from fleetllm.planner.vllm_cpu import cpu_notes


@dataclass(frozen=True)
class Plan:
    """Everything render needs, plus the figures reported in status.plan."""

    status: PlanStatus
    gpu: GPUType
    arch: ModelArch
    source: ModelSource
    estimate: MemoryEstimate
    command: tuple[str, ...]
    args: tuple[str, ...]
    total_weights_bytes: int
    node_selector: dict[str, str]
    """The GPU node labels of the chosen profile (empty when it asks for none)."""
    model_path: str
    """Where the engine loads the model from (the placement's folder, or a built-in name)."""
    drain_seconds: int
    notes: tuple[str, ...] = ()
    """What of the plan the engine does not apply on this device, and what it does instead
    (shown by `fleetllm plan` and `fleetllm up`, never dropped in silence)."""

    @property
    def devices(self) -> int:
        return self.status.gpu_count

    @property
    def fills_cache(self) -> bool:
        """Whether a pod's init container fills the model cache (`placement.fills_cache`)."""
        return fills_cache(self.source, self.status.backend)


def plan(
    spec: LLMDeploymentSpec,
    config: OperatorConfig = DEFAULT_CONFIG,
    claim_access_modes: Mapping[str, Sequence[str]] | None = None,
    *,
    placement: Placement = IN_CLUSTER,
) -> Plan:
    """Plan one replica of `spec`, or raise PlanError with the reason and what would fit.
    `claim_access_modes`: the access modes of the claims in `claims_to_check` that exist.
    `placement`: where the replica runs, which decides where its engine loads the weights
    from; a local replica (`fleetllm up`) also loads file:// sources (in a cluster they name
    nothing and are refused) and gets no node labels."""
    local = isinstance(placement, LocalPlacement)
    gpu = resolve_gpu(spec.gpu.type)
    check_backend(spec, gpu)
    source = ModelSource.parse(spec.model.source)
    check_placement(spec, source, placement)
    arch = resolve_arch(spec, source)
    check_source(spec, source, placement)
    # Node labels pick cluster nodes; a local replica runs on this machine.
    labels = {} if local else node_selector(spec, gpu, config)
    check_claims(spec, source, config, claim_access_modes or {})
    check_gpu_resources(spec, gpu)
    tp, pp = spec.parallelism.tensor, spec.parallelism.pipeline
    if spec.engine.backend == "builtin":
        check_builtin_parallelism(arch, tp)
    else:
        check_parallelism(arch, tp, pp)
    max_model_len = resolve_max_model_len(spec, arch)

    dtype = resolve_dtype(spec, gpu, config.cpu_bf16)
    quant = spec.quantization
    memory = memory_bytes(spec, gpu)

    def sized(lora: LoraSpec | None) -> MemoryEstimate:
        return estimate(
            arch,
            gpu,
            tensor=tp,
            pipeline=pp,
            dtype=dtype,
            weights=quant.weights,
            kv_cache=quant.kv_cache,
            memory_bytes=memory,
            backend=spec.engine.backend,
            lora=lora,
        )

    est = sized(spec.lora)
    where = f"{tp * pp} x {gpu.name}" if gpu.is_gpu else f"cpu ({gib(memory)} GiB)"
    check_lora_fits(spec.lora, arch, max_model_len, est, where, sized)
    if est.kv_budget_bytes <= 0:
        raise PlanError(
            "WeightsDoNotFit",
            f"{arch.name} weights ({gib(est.weights_bytes)} GiB per device) and overhead "
            f"({gib(est.overhead_bytes)} GiB) exceed the {gib(est.budget_bytes)} GiB budget "
            f"of {where}",
            suggestions(spec, arch, gpu, dtype, max_model_len, est),
        )
    if not est.fits(max_model_len):
        raise PlanError(
            "KVCacheTooSmall",
            f"{arch.name} on {where}: after weights ({gib(est.weights_bytes)} GiB per device) "
            f"and overhead ({gib(est.overhead_bytes)} GiB) the KV cache "
            f"({gib(est.kv_budget_bytes)} GiB) holds {est.capacity_tokens} tokens, less than "
            f"one maxModelLen sequence of {max_model_len}",
            suggestions(spec, arch, gpu, dtype, max_model_len, est),
        )

    tuning = est.tuning
    max_num_seqs = _max_num_seqs(est.capacity_tokens, max_model_len, tuning.max_num_seqs)
    if spec.engine.max_num_seqs is not None:
        max_num_seqs = min(max_num_seqs, spec.engine.max_num_seqs)
    batched = max(max_num_seqs, min(tuning.max_num_batched_tokens, est.capacity_tokens))
    kv_dtype = dtype if quant.kv_cache == "auto" else quant.kv_cache
    model_path = placement.model_path(source, spec.engine.backend)
    command, args = engine_command(
        spec,
        gpu,
        model_path,
        dtype=dtype,
        max_model_len=max_model_len,
        est=est,
        max_num_seqs=max_num_seqs,
        batched=batched,
    )
    check_extra_args(spec, args)
    image = spec.engine.image or _default_image(spec, gpu, config)
    status = PlanStatus(
        backend=spec.engine.backend,
        device="cuda" if gpu.is_gpu else "cpu",
        gpu_type=gpu.name,
        gpu_count=tp * pp if gpu.is_gpu else 0,
        device_memory_gib=gib(est.memory_bytes),
        weights_gib=gib(est.weights_bytes),
        kv_cache_gib=gib(est.capacity_tokens * est.kv_bytes_per_token),
        overhead_gib=gib(est.overhead_bytes),
        lora_gib=gib(est.lora_bytes) if spec.lora is not None else None,
        kv_bytes_per_token=est.kv_bytes_per_token,
        max_concurrent_tokens=est.capacity_tokens,
        max_concurrent_sequences=est.sequences(max_model_len),
        max_model_len=max_model_len,
        dtype=dtype,
        kv_cache_dtype=kv_dtype,
        weights=quant.weights,
        gpu_memory_utilization=float(tuning.memory_utilization),
        block_size=est.block_size,
        num_kv_blocks=est.num_kv_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=batched,
        image=image,
        engine_args=[*args, *spec.engine.extra_args],
    )
    return Plan(
        status=status,
        gpu=gpu,
        arch=arch,
        source=source,
        estimate=est,
        command=command,
        args=(*args, *spec.engine.extra_args),
        total_weights_bytes=weight_bytes(arch, quant.weights, dtype),
        node_selector=labels,
        model_path=model_path,
        drain_seconds=spec.engine.drain_seconds,
        notes=cpu_notes(est) if spec.engine.backend == "vllm" and not gpu.is_gpu else (),
    )


def _default_image(spec: LLMDeploymentSpec, gpu: GPUType, config: OperatorConfig) -> str:
    if spec.engine.backend == "vllm":
        return config.images.vllm if gpu.is_gpu else config.images.vllm_cpu
    return config.images.engine_cuda if gpu.is_gpu else config.images.engine


def _max_num_seqs(capacity: int, max_model_len: int, cap: int) -> int:
    """As many sequences as the KV cache holds at a typical working length (2048 tokens, or
    the whole context when shorter; few requests fill a long context), within the class cap,
    in multiples of 8 (the batch sizes CUDA graphs are captured for)."""
    typical = min(max_model_len, 2048)
    seqs = min(cap, max(1, capacity // typical))
    return seqs - seqs % 8 if seqs >= 8 else seqs
