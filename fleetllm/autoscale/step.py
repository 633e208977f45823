"""What one step of the law sees (`Observation`) and what it gives (`Load`, `Decision`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from fleetllm.api.status import ScaleChange
from fleetllm.scrape import EngineSample

Change = ScaleChange | Literal["none"]


@dataclass(frozen=True)
class Observation:
    """What one step sees."""

    time: float
    """Seconds on the caller's clock (the one the samples' `time` is on)."""
    replicas: int
    """Replicas wanted now (spec.replicas)."""
    ready_replicas: int
    samples: Mapping[str, EngineSample | None]
    """One entry per ready replica, keyed by a stable id (pod name, URL); None: unreadable."""
    replica_capacity: int | None = None
    """Sequences one replica runs at once (the plan's maxNumSeqs); None: unknown."""
    demand_time: float | None = None
    """When the router last asked for capacity for requests it holds; None: never."""


@dataclass(frozen=True)
class Load:
    """The signals one step computed, for the reason, status and logs."""

    ready: int
    sampled: int
    kv_cache_usage: float | None
    """Mean over the sampled replicas."""
    running: float
    waiting: float
    saturated: bool
    """Requests wait on every sampled replica."""
    queue_time_p90: float | None
    request_rate: float | None
    """Requests arriving per second over the queue window (None: unknown), from the
    replicas' counters: those that finished plus the growth of those they hold."""
    need: float
    """Replicas the load needs (fractional)."""


def scale_summary(previous: int, replicas: int, reason: str) -> str:
    """A change of replicas as users read it (status.lastScaleReason, Events, the local
    fleet's status view): `FROM -> TO: why`."""
    return f"{previous} -> {replicas}: {reason}"


@dataclass(frozen=True)
class Decision:
    previous: int
    """The replicas the step saw (Observation.replicas)."""
    replicas: int
    """The replicas it wants."""
    change: Change
    reason: str
    """What the law saw, in words."""
    panic: bool
    load: Load

    @property
    def summary(self) -> str:
        return scale_summary(self.previous, self.replicas, self.reason)
