"""How long a replica's weights may take to arrive and to load, from their size: the budgets
of the pod's pull init container and startup probe, and of a local replica's first answer."""

from __future__ import annotations

import math

from fleetllm.api.catalog import GIB
from fleetllm.planner.plan import Plan

# Assumed floors for sizing timeouts: a download of at least 50 MiB/s, a load from the pod's
# disk of at least 100 MiB/s.
DOWNLOAD_SECONDS_PER_GIB = 20
LOAD_SECONDS_PER_GIB = 10


# vLLM's CPU build compiles its model with torch.compile before it answers: 150-210 s for
# SmolLM2-135M on two idle cores, more than 300 s beside a busy neighbour (a CPU limit, another
# replica). Its startup budget leaves room for that, so a slow start is not killed and
# restarted into the same slow start.
VLLM_CPU_COMPILE_SECONDS = 600


def startup_seconds(plan: Plan) -> int:
    """How long the engine may take to load the weights from the pod's disk (the startup
    probe's budget; a download happens before, in the pull init container)."""
    base = 300
    if plan.status.backend == "vllm" and not plan.gpu.is_gpu:
        base = VLLM_CPU_COMPILE_SECONDS
    return base + LOAD_SECONDS_PER_GIB * math.ceil(plan.total_weights_bytes / GIB)


def download_seconds(plan: Plan) -> int:
    """How long the pull init container may take (0 when there is none)."""
    if not plan.fills_cache:
        return 0
    return 120 + DOWNLOAD_SECONDS_PER_GIB * math.ceil(plan.total_weights_bytes / GIB)
