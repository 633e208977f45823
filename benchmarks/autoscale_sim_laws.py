"""The laws benchmarks/autoscale_sim.py compares: ours (the real `Autoscaler`, fed
`EngineSample`s exactly as the operator feeds it) and three baselines.

The baselines, each as its project documents it:
- KubeAI: every 10 s, the moving average of the last 60 samples (10 minutes; the history
  starts at zeros) of the requests in flight through its proxy, over targetRequests per replica,
  rounded up; scale down only after 3 consecutive lower results (scaleDownDelaySeconds 30).
  targetRequests is set to 0.8 x the requests a replica holds at once (the same utilisation
  target as ours).
- KEDA (the vLLM production stack's ScaledObject): Prometheus query vllm:num_requests_waiting
  (summed over pods), threshold 5, pollingInterval 15 s, cooldownPeriod 360 s; the HPA KEDA
  drives computes ceil(waiting / 5) with its 10 % tolerance, scales up by at most max(100 %,
  4 pods) a period, and takes the highest recommendation of the last 360 s when scaling down
  (the cooldown as the production stack describes it: the wait before scaling down).
- AIBrix KPA: the Knative algorithm on vllm:gpu_cache_usage_perc with target 0.8 per pod (ours),
  evaluated every 2 s: desired = ceil(mean total KV usage over the stable window (180 s) /
  target); panic when the panic-window (60 s) figure reaches 2x the ready pods, in which the
  count never goes down, until a stable window passes without panic; scale-up rate 1000x,
  scale-down rate at most halving a step.
"""

from __future__ import annotations

import math
from collections import deque

from autoscale_sim_fleet import FleetView, Law

from fleetllm.api.scaling import ScalingSpec
from fleetllm.autoscale.law import Autoscaler
from fleetllm.autoscale.step import Observation


class Ours(Law):
    name = "ours"

    def __init__(self, spec: ScalingSpec, period: float, capacity: int) -> None:
        self.spec = spec
        self.period = period
        self.capacity = capacity
        self.law = Autoscaler()

    def decide(self, view: FleetView) -> int:
        obs = Observation(
            time=view.time,
            replicas=view.replicas,
            ready_replicas=len(view.samples),
            samples=view.samples,
            replica_capacity=self.capacity,
            demand_time=view.demand_time,
        )
        return self.law.decide(self.spec, obs).replicas


class Baseline(Law):
    """A baseline law, with the bounds its project's autoscaler keeps the count within."""

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi

    def bounded(self, replicas: int, at_least: int = 0) -> int:
        return min(self.hi, max(self.lo, replicas, at_least))


class KubeAI(Baseline):
    name = "kubeai"
    period = 10.0

    def __init__(self, lo: int, hi: int, target_requests: float) -> None:
        super().__init__(lo, hi)
        self.target = target_requests
        self.history = deque([0.0] * 60, maxlen=60)  # 10 minutes of 10 s samples
        self.required_downs = math.ceil(30 / self.period)
        self.downs = 0

    def decide(self, view: FleetView) -> int:
        if not view.samples:
            return view.replicas  # no endpoints: KubeAI skips the model
        self.history.append(float(view.in_flight))
        desired = math.ceil(sum(self.history) / len(self.history) / self.target)
        desired = self.bounded(desired)
        if desired < view.replicas:
            if self.downs < self.required_downs:
                self.downs += 1
                return view.replicas
        else:
            self.downs = 0
        return desired


class Keda(Baseline):
    name = "keda"
    period = 15.0

    def __init__(self, lo: int, hi: int, threshold: float = 5.0, cooldown: float = 360.0) -> None:
        super().__init__(lo, hi)
        self.threshold = threshold
        self.cooldown = cooldown
        self.recommendations: deque[tuple[float, int]] = deque()
        self.last_active = -math.inf

    def decide(self, view: FleetView) -> int:
        current = view.replicas
        waiting = sum(s.waiting or 0.0 for s in view.samples.values())
        if waiting > 0 or (view.demand_time is not None and view.demand_time > self.last_active):
            self.last_active = view.time
        if current == 0:
            return 0  # activation comes through the router's scale from zero
        if self.lo == 0 and view.time - self.last_active >= self.cooldown:
            return 0
        if current and abs(waiting / (self.threshold * current) - 1) <= 0.1:
            raw = current
        else:
            raw = math.ceil(waiting / self.threshold)
        raw = self.bounded(raw, at_least=1)
        self.recommendations.append((view.time, raw))
        while self.recommendations[0][0] < view.time - self.cooldown:
            self.recommendations.popleft()
        if raw > current:
            return min(raw, max(2 * current, current + 4))
        return min(current, max(r for _, r in self.recommendations))


class Kpa(Baseline):
    name = "kpa"
    period = 2.0

    def __init__(self, lo: int, hi: int, target: float) -> None:
        super().__init__(lo, hi)
        self.target = target
        self.stable_window, self.panic_window = 180.0, 60.0
        self.samples: deque[tuple[float, float]] = deque()
        self.panic_time: float | None = None
        self.max_panic = 0
        self.last_traffic = -math.inf

    def decide(self, view: FleetView) -> int:
        ready = len(view.samples)
        total = sum(s.kv_cache_usage or 0.0 for s in view.samples.values())
        if total > 0 or view.in_flight > 0:
            self.last_traffic = view.time
        if ready == 0:
            return view.replicas
        self.samples.append((view.time, total))
        while self.samples[0][0] <= view.time - self.stable_window:
            self.samples.popleft()
        stable = [v for _, v in self.samples]
        panic = [v for t, v in self.samples if t > view.time - self.panic_window]
        want_stable = math.ceil(sum(stable) / len(stable) / self.target)
        want_panic = math.ceil(sum(panic) / len(panic) / self.target)
        if want_panic / ready >= 2.0:
            self.panic_time = view.time
        elif self.panic_time is not None and view.time - self.panic_time >= self.stable_window:
            self.panic_time, self.max_panic = None, 0
        if self.panic_time is not None:
            self.max_panic = max(self.max_panic, want_panic)
            desired = max(self.max_panic, view.replicas)
        else:
            desired = want_stable
        desired = min(desired, 1000 * ready)
        desired = max(desired, math.floor(ready / 2))
        if self.lo == 0 and view.time - self.last_traffic >= self.stable_window:
            return 0
        return self.bounded(desired, at_least=1)


class Static(Law):
    name = "static"
    period = 3600.0

    def __init__(self, n: int) -> None:
        self.n = n

    def decide(self, view: FleetView) -> int:
        return self.n
