"""The planned command line of each backend: `fleetllm engine serve` (the builtin engine) and
`vllm serve`, with the flags both share spelt the same (vLLM's)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

from fleetllm.api.catalog import GPUType
from fleetllm.api.contract import ENGINE_PORT, KV_EVENTS_PORT, KV_EVENTS_TOPIC, KV_REPLAY_PORT
from fleetllm.api.deployment import LLMDeploymentSpec
from fleetllm.api.quantity import parse_quantity
from fleetllm.planner.lora import lora_args
from fleetllm.planner.memory import MemoryEstimate
from fleetllm.planner.vllm_cpu import KV_FLAG, kv_cache_bytes

VLLM_QUANTIZATION_FLAG = {
    # Pre-quantized checkpoints: name the fast Marlin kernels (vLLM picks the slow ones when
    # the plain method is forced); fp8 quantizes a 16-bit checkpoint at load.
    "int8": "compressed-tensors",
    "fp8": "fp8",
    "awq": "awq_marlin",
    "gptq": "gptq_marlin",
}


def engine_command(
    spec: LLMDeploymentSpec,
    gpu: GPUType,
    model_path: str,
    *,
    dtype: str,
    max_model_len: int,
    est: MemoryEstimate,
    max_num_seqs: int,
    batched: int,
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(command, args) of one replica's engine, listening on every address at ENGINE_PORT."""
    drain = str(spec.engine.drain_seconds)
    common = (
        "--host",
        "0.0.0.0",
        "--port",
        str(ENGINE_PORT),
        "--served-model-name",
        spec.model.name,
        "--dtype",
        dtype,
        "--max-model-len",
        str(max_model_len),
        "--block-size",
        str(est.block_size),
    )
    quant = spec.quantization
    if spec.engine.backend == "builtin":
        # An explicit block count, not a memory fraction: the pool is exactly what was planned
        # and reported, whatever else shares the device or the pod's memory.
        builtin = [
            "--model",
            model_path,
            *common,
            "--device",
            "cuda" if gpu.is_gpu else "cpu",
            "--shutdown-grace-period",
            drain,
            "--num-kv-blocks",
            str(est.num_kv_blocks),
            "--max-num-seqs",
            str(max_num_seqs),
            "--max-num-batched-tokens",
            str(batched),
            # A bounded queue: past it the engine answers 503 (counted) and the router tries
            # another replica, instead of requests piling up in one engine's memory.
            "--max-waiting-requests",
            str(waiting_bound(max_num_seqs)),
        ]
        if spec.parallelism.tensor > 1:
            builtin += ["--tensor-parallel-size", str(spec.parallelism.tensor)]
        if not gpu.is_gpu and not sets_flag(spec.engine.extra_args, NUM_THREADS_FLAG):
            builtin += [NUM_THREADS_FLAG, str(cpu_threads_per_rank(spec))]
        if quant.weights != "none":
            builtin += ["--quantization", quant.weights]
        if quant.kv_cache != "auto":
            builtin += ["--kv-cache-dtype", quant.kv_cache]
        builtin += lora_args(spec.lora)
        builtin += [*_speculative_args(spec), *kv_events_args(spec)]
        return ("fleetllm", "engine", "serve"), tuple(builtin)
    # `vllm serve MODEL`: the positional form (vLLM deprecates --model there).
    args = [
        model_path,
        *common,
        # Drain on SIGTERM: running requests get this long before vLLM stops.
        "--shutdown-timeout",
        drain,
        *_vllm_memory_args(gpu, est),
        "--max-num-seqs",
        str(max_num_seqs),
        "--max-num-batched-tokens",
        str(batched),
        "--tensor-parallel-size",
        str(spec.parallelism.tensor),
        "--pipeline-parallel-size",
        str(spec.parallelism.pipeline),
        "--enable-prefix-caching",
    ]
    if quant.weights != "none":
        flag = VLLM_QUANTIZATION_FLAG[quant.weights]
        if not gpu.is_gpu or (
            gpu.compute_capability is not None and gpu.compute_capability < (8, 0)
        ):
            flag = flag.removesuffix("_marlin")  # Marlin kernels need CUDA, Ampere or later
        args += ["--quantization", flag]
    if quant.kv_cache != "auto":
        args += ["--kv-cache-dtype", quant.kv_cache]
    args += lora_args(spec.lora)
    args += [*_speculative_args(spec), *kv_events_args(spec)]
    return ("vllm", "serve"), tuple(args)


def _vllm_memory_args(gpu: GPUType, est: MemoryEstimate) -> tuple[str, str]:
    """How vLLM sizes its KV cache: a share of the GPU, or on a CPU the planned bytes."""
    if gpu.is_gpu:
        return ("--gpu-memory-utilization", f"{float(est.tuning.memory_utilization):.2f}")
    return (KV_FLAG, str(kv_cache_bytes(est)))


NUM_THREADS_FLAG = "--num-threads"


def cpu_cores(spec: LLMDeploymentSpec) -> int:
    """The CPU cores a CPU replica's pod requests where pod.resources does not say: one per
    tensor-parallel rank (each rank's process computes its shard), at least two."""
    return max(2, spec.parallelism.tensor)


def cpu_threads_per_rank(spec: LLMDeploymentSpec) -> int:
    """The builtin engine's threads per rank on a CPU: the cores the pod requests, shared by
    its ranks. Planned, because a container sees every core of its node (its affinity, and
    no quota without a CPU limit), and threads for cores the pod was not given contend with
    the node's other pods at every parallel region (engine/cpu_threads.py)."""
    resources = spec.pod.resources
    requested = resources.requests.get("cpu") if resources is not None else None
    cores = parse_quantity(requested) if requested is not None else cpu_cores(spec)
    return max(1, math.floor(cores) // spec.parallelism.tensor)


def sets_flag(args: Sequence[str], flag: str) -> bool:
    """Whether `args` give `flag`, as `--flag value` or `--flag=value`."""
    return any(arg == flag or arg.startswith(flag + "=") for arg in args)


def waiting_bound(max_num_seqs: int) -> int:
    """Requests one builtin engine keeps waiting for a slot: a few batches' worth (vLLM has
    no such bound; its queue is limited by the router's caps alone)."""
    return max(16, 4 * max_num_seqs)


KV_EVENTS_FLAG = "--kv-events-config"


def kv_events_args(spec: LLMDeploymentSpec) -> list[str]:
    """A model routed kv-aware publishes its KV-cache events (vLLM's flag and format, both
    backends) on the pod's events and replay ports. vLLM hashes blocks with SHA-256 from a
    fixed seed, which the router reproduces: the algorithm is set here, whatever vLLM's
    default becomes (the seed is vLLM's own unless PYTHONHASHSEED is set, which the planner
    refuses for such a model); and vLLM reports the cached tokens of each answer, which the
    router compares with what it predicted (the builtin engine always does)."""
    if spec.routing.strategy != "kv-aware":
        return []
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{KV_EVENTS_PORT}",
        "replay_endpoint": f"tcp://*:{KV_REPLAY_PORT}",
        "topic": KV_EVENTS_TOPIC,
    }
    args = [KV_EVENTS_FLAG, json.dumps(config, separators=(",", ":"))]
    if spec.engine.backend == "vllm":
        args += ["--prefix-caching-hash-algo", "sha256", "--enable-prompt-tokens-details"]
    return args


def _speculative_args(spec: LLMDeploymentSpec) -> list[str]:
    """`--speculative-config` as JSON with vLLM's keys (both backends read the same)."""
    speculative = spec.speculative
    if speculative is None:
        return []
    config = {
        "method": speculative.method,
        "num_speculative_tokens": speculative.num_speculative_tokens,
        "prompt_lookup_max": speculative.prompt_lookup_max,
        "prompt_lookup_min": speculative.prompt_lookup_min,
    }
    return ["--speculative-config", json.dumps(config, separators=(",", ":"))]
