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


def startup_seconds(plan: Plan) -> int:
    """How long the engine may take to load the weights from the pod's disk (the startup
    probe's budget; a download happens before, in the pull init container)."""
    return 300 + LOAD_SECONDS_PER_GIB * math.ceil(plan.total_weights_bytes / GIB)


def download_seconds(plan: Plan) -> int:
    """How long the pull init container may take (0 when there is none)."""
    if not plan.fills_cache:
        return 0
    return 120 + DOWNLOAD_SECONDS_PER_GIB * math.ceil(plan.total_weights_bytes / GIB)
