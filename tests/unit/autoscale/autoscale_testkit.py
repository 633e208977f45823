"""Helpers of the control law's tests: specs, histograms, samples and observations as the
operator builds them, and a fleet whose counters grow step by step."""

from __future__ import annotations

import math

from fleetllm.api.scaling import ScalingSpec
from fleetllm.autoscale.law import Autoscaler
from fleetllm.autoscale.step import Decision, Observation
from fleetllm.scrape import EngineSample, Histogram

BOUNDS = (0.5, 1.0, 2.0, 5.0, math.inf)


def spec(**kw: object) -> ScalingSpec:
    base: dict[str, object] = {
        "min_replicas": 1,
        "max_replicas": 20,
        "scale_down_delay_seconds": 60,
        "target_kv_cache_usage": 0.8,
        "target_queue_time_seconds": 1.0,
    }
    base.update(kw)
    return ScalingSpec.model_validate(base)


def hist(counts: dict[float, float]) -> Histogram:
    """A cumulative histogram from per-bucket (not cumulative) counts."""
    total, buckets = 0.0, []
    for le in BOUNDS:
        total += counts.get(le, 0.0)
        buckets.append((le, total))
    return Histogram(tuple(buckets), count=total, sum=0.0)


def sample(t: float, kv: float, running: float = 0.0, waiting: float = 0.0, **kw: object):
    return EngineSample(time=t, running=running, waiting=waiting, kv_cache_usage=kv, **kw)  # type: ignore[arg-type]


def observe(
    t: float,
    replicas: int,
    kvs: list[float],
    *,
    running: float = 0.0,
    waiting: float = 0.0,
    ready: int | None = None,
    capacity: int | None = None,
    demand: float | None = None,
    queue: list[Histogram] | None = None,
) -> Observation:
    samples = {
        f"r{i}": sample(t, kv, running, waiting, queue_time=None if queue is None else queue[i])
        for i, kv in enumerate(kvs)
    }
    return Observation(
        time=t,
        replicas=replicas,
        ready_replicas=len(kvs) if ready is None else ready,
        samples=samples,
        replica_capacity=capacity,
        demand_time=demand,
    )


class Fleet:
    """Counters of a fleet step by step: each replica's cumulative queue-time histogram
    grows by the requests it finished (all queued under 0.5 s, so queue time never drives)."""

    def __init__(self) -> None:
        self.t = 0.0
        self.finished: dict[str, float] = {}

    def step(
        self,
        law: Autoscaler,
        s: ScalingSpec,
        replicas: int,
        loads: list[tuple[float, float, float, float]],
        dt: float = 5.0,
    ) -> Decision:
        """loads: per ready replica (kv, running, waiting, finished in this step)."""
        self.t += dt
        samples: dict[str, EngineSample | None] = {}
        for i, (kv, running, waiting, done) in enumerate(loads):
            key = f"r{i}"
            self.finished[key] = self.finished.get(key, 0.0) + done
            samples[key] = sample(
                self.t, kv, running, waiting, queue_time=hist({0.5: self.finished[key]})
            )
        return law.decide(s, Observation(self.t, replicas, len(loads), samples))
