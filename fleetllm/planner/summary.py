"""A plan, or its refusal, as `fleetllm plan` prints it (and `fleetllm up` before it starts)."""

from __future__ import annotations

from fleetllm.api.catalog import GIB
from fleetllm.api.deployment import LLMDeployment
from fleetllm.planner.errors import PlanError
from fleetllm.planner.plan import Plan


def plan_summary(cr: LLMDeployment, result: Plan | PlanError) -> str:
    """What `fleetllm plan` prints for one LLMDeployment: its plan, or why it is refused."""
    title = f"{cr.metadata.name} (model {cr.spec.model.name})"
    if isinstance(result, PlanError):
        return f"{title}: REFUSED ({result.reason})\n  {result.message}\n"
    s = result.status
    est = result.estimate
    where = f"{s.gpu_count} x {s.gpu_type}" if s.gpu_count else "cpu"
    budget = est.budget_bytes / GIB
    rows = [
        ("model", f"{result.arch.name}, {s.weights} weights, {s.dtype}"),
        ("hardware", f"{where}, backend {s.backend} on {s.device}"),
        (
            "device memory",
            f"{s.device_memory_gib:.2f} GiB, budget {budget:.2f} GiB "
            f"({s.gpu_memory_utilization:.0%})",
        ),
        ("weights", f"{s.weights_gib:.2f} GiB per device"),
        ("overhead", f"{s.overhead_gib:.2f} GiB per device (activations, runtime)"),
        *_lora_rows(cr, result),
        (
            "KV cache",
            f"{s.kv_cache_gib:.2f} GiB per device, {s.kv_cache_dtype}, "
            f"{s.kv_bytes_per_token} bytes/token",
        ),
        (
            "capacity",
            f"{s.max_concurrent_tokens:,} tokens = {s.max_concurrent_sequences} "
            f"x {s.max_model_len:,}-token sequences",
        ),
        (
            "engine",
            f"max_num_seqs {s.max_num_seqs}, max_num_batched_tokens "
            f"{s.max_num_batched_tokens}, block {s.block_size}, {s.num_kv_blocks:,} blocks",
        ),
        ("image", s.image),
        ("command", " ".join([*result.command, *s.engine_args])),
        *(("note", note) for note in result.notes),
    ]
    width = max(len(label) for label, _ in rows)
    lines = "".join(f"  {label:<{width}}  {value}\n" for label, value in rows)
    return f"{title}: planned\n{lines}"


def _lora_rows(cr: LLMDeployment, result: Plan) -> list[tuple[str, str]]:
    lora = cr.spec.lora
    if lora is None:
        return []
    kept = "" if result.gpu.is_gpu else f", {lora.cpu_loras} more kept loaded"
    slots = f"{lora.max_loras} slots of rank {lora.max_lora_rank}{kept}"
    adapters = len(cr.spec.adapters)
    return [("LoRA", f"{result.status.lora_gib:.2f} GiB per device ({slots}; {adapters} adapters)")]
