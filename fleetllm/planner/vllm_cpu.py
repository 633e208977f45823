"""vLLM's CPU build, as the planner runs it: what differs from vLLM on a GPU.

On a CPU vLLM has no device memory to take a share of: `--gpu-memory-utilization` does
nothing there, and its KV cache is as large as `--kv-cache-memory-bytes` says (vLLM 0.32 reads
the older VLLM_CPU_KVCACHE_SPACE, whole GiB, into that same setting, and it wins over the
flag). So the planner passes the planned KV cache in bytes, exactly what the plan reports,
refuses a spec that would size it some other way, and says what of the plan does not apply.
"""

from __future__ import annotations

from fleetllm.api.deployment import LLMDeploymentSpec
from fleetllm.planner.errors import PlanError
from fleetllm.planner.memory import MemoryEstimate, gib

KV_FLAG = "--kv-cache-memory-bytes"
KV_ENV = "VLLM_CPU_KVCACHE_SPACE"
# vLLM's parser reads `_` and `-` alike in long flags.
_KV_SPELLINGS = (KV_FLAG, KV_FLAG.replace("-", "_").replace("__", "--", 1))


def check_vllm_cpu(spec: LLMDeploymentSpec) -> None:
    """Refuse what would size the KV cache behind the planner's back."""
    for arg in spec.engine.extra_args:
        if arg.split("=", 1)[0] in _KV_SPELLINGS:
            raise PlanError(
                "InvalidEngineArgs",
                f"engine.extraArgs sets {KV_FLAG}, which the planner owns on a CPU (the KV "
                "cache it plans from pod.resources.limits.memory); size the memory instead",
            )
    for var in spec.engine.env:
        if var.name == KV_ENV:
            raise PlanError(
                "InvalidEngineEnv",
                f"engine.env sets {KV_ENV}, which would override the planned {KV_FLAG} (the "
                "KV cache planned from pod.resources.limits.memory); size the memory instead",
            )


def kv_cache_bytes(est: MemoryEstimate) -> int:
    """The planned KV cache: whole blocks of the planned capacity."""
    return est.capacity_tokens * est.kv_bytes_per_token


def cpu_notes(est: MemoryEstimate) -> tuple[str, ...]:
    """What of the plan vLLM does not apply on a CPU, and what it does instead."""
    share = float(est.tuning.memory_utilization)
    return (
        f"gpu-memory-utilization {share:.2f} is not passed: vLLM on a CPU has no device "
        f"memory to take a share of; the planner gives it {KV_FLAG} {kv_cache_bytes(est)} "
        f"({gib(kv_cache_bytes(est))} GiB), the KV cache planned within {share:.0%} of "
        f"{gib(est.memory_bytes)} GiB",
    )
