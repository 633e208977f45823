"""The autoscaling control law: engine samples over time -> desired replicas and a reason.

Pure: no I/O and no clock of its own. Whoever runs it (the operator's timer, the local
fleet's supervisor, the simulator in benchmarks/) scrapes the replicas, hands one
`Observation` per step to `Autoscaler.decide`, and applies the `Decision`. An `Autoscaler`
keeps the history the law needs for one LLMDeployment. docs/autoscaling.md explains the law;
in short, per step:

- Need, in replicas, from the ready replicas' fresh samples: KV-cache usage over its target;
  sequences running and waiting over the sequence slots at the same target (when the replica
  capacity is known); the windowed p90 queue time over its target while requests wait on
  every replica. When that need exceeds the count, the request rate (from the replicas'
  counters) sizes the step: over what a full replica was seen to finish, or by how fast it
  rises; but not while the fleet finishes requests faster than they come (draining a backlog).
- Scale up at once beyond the tolerance, by at most `max_scale_up_factor` a step; in panic
  (queue time far above target, or a need of `panic_factor` x the ready replicas) straight to
  the need, and no scale-down.
- Scale down only to the highest recommendation of the last `scaleDownDelaySeconds`, once all
  were lower; never back to a count the fleet had to grow from while requests come as fast.
- Scale to zero after `scaleToZeroAfterSeconds` of observed idleness and as long since the
  router last asked for capacity; from zero, one replica on the router's demand.
- A ready replica without a fresh, complete sample is never read as idle: it blocks every
  scale-down and the idle clock. Replicas not ready yet count as fully loaded for scaling down
  and as absent for scaling up.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from fleetllm.api.scaling import ScalingSpec
from fleetllm.autoscale.histograms import histogram_delta, merge_histograms
from fleetllm.autoscale.settings import LawSettings
from fleetllm.autoscale.step import Change, Decision, Load, Observation
from fleetllm.autoscale.window import RequestWindow
from fleetllm.scrape import EngineSample, Histogram


@dataclass(frozen=True)
class _Step:
    replicas: int
    change: Change
    reason: str


class Autoscaler:
    """The law with its history, for one LLMDeployment. Call `decide` once per step with
    time moving forward; a fresh Autoscaler (after a restart or leader change) knows no
    history, so it scales down or to zero only after a full delay of its own observations."""

    def __init__(self, settings: LawSettings | None = None) -> None:
        self.settings = settings or LawSettings()
        self._histograms: dict[str, tuple[float, Histogram | None]] = {}
        """Per replica: the time and queue-time histogram of its last sample."""
        self._in_flight: tuple[float, float] | None = None
        """(time, requests the sampled replicas held) at the last step."""
        self._window = RequestWindow()
        self._recommendations: deque[tuple[float, int]] = deque()
        self._first_time: float | None = None
        self._panic_until = -math.inf
        self._idle_since: float | None = None
        self._ready_count = -1
        self._ready_changed = -math.inf
        self._zeroed_at: float | None = None
        self._capacity: float | None = None
        """Requests per second a full replica was seen to finish."""
        self._saturated: deque[tuple[float, float, float]] = deque()
        """(time, requests finished, replica-seconds) of the recent saturated steps."""
        self._last_time: float | None = None
        self._too_few: dict[int, float] = {}
        """Counts scaled up from -> the request rate then."""

    # -- the signals -----------------------------------------------------------------------

    def _fresh(self, obs: Observation) -> dict[str, EngineSample]:
        limit = self.settings.stale_after_seconds
        return {
            key: s
            for key, s in obs.samples.items()
            if s is not None and s.complete and obs.time - s.time <= limit
        }

    def _observe_counters(self, obs: Observation, fresh: Mapping[str, EngineSample]) -> float:
        """Fold this step's counter deltas into the window; the requests that finished since
        the last step (-1 when some replica's count is unknown)."""
        deltas: list[Histogram] = []
        known = True
        for key, sample in fresh.items():
            previous = self._histograms.get(key)
            if previous is not None and sample.time <= previous[0]:
                known = False  # the same scrape again: nothing new
                continue
            self._histograms[key] = (sample.time, sample.queue_time)
            if sample.queue_time is None or previous is None or previous[1] is None:
                known = False  # no histogram, or a first sight (its counts span an unknown past)
                continue
            delta = histogram_delta(sample.queue_time, previous[1])
            assert delta is not None
            deltas.append(delta)
        for key in list(self._histograms):
            if key not in obs.samples:
                del self._histograms[key]  # the replica is gone
        merged = merge_histograms(deltas)
        finished = merged.count if merged is not None else 0.0

        # Arrivals: what finished plus the growth of what the fleet holds (a new replica's
        # requests count as they reach it; a removed replica's leave the sum: clamped at 0).
        in_flight = sum((x.running or 0.0) + (x.waiting or 0.0) for x in fresh.values())
        arrivals, interval = None, 0.0
        if self._in_flight is not None:
            interval = obs.time - self._in_flight[0]
            arrivals = max(0.0, finished + in_flight - self._in_flight[1])
        self._in_flight = (obs.time, in_flight) if fresh else None
        self._window.add(obs.time, interval, merged, arrivals, self.settings.queue_window_seconds)
        return finished if known else -1.0

    def _learn_capacity(
        self, obs: Observation, saturated: bool, finished: float, sampled: int
    ) -> None:
        """While every replica has requests waiting, what they finish is what replicas can
        finish: requests per second per replica, over the saturated steps of the window."""
        interval = obs.time - self._last_time if self._last_time is not None else 0.0
        self._last_time = obs.time
        if saturated and finished >= 0 and interval > 0:
            self._saturated.append((obs.time, finished, sampled * interval))
        while (
            self._saturated
            and self._saturated[0][0] <= obs.time - self.settings.queue_window_seconds
        ):
            self._saturated.popleft()
        done = sum(f for _, f, _ in self._saturated)
        seconds = sum(r for _, _, r in self._saturated)
        if saturated and done >= self.settings.min_queue_requests and seconds > 0:
            self._capacity = done / seconds

    def _load(
        self,
        spec: ScalingSpec,
        obs: Observation,
        fresh: Mapping[str, EngineSample],
        finished: float,
    ) -> Load:
        ready = max(obs.ready_replicas, len(obs.samples))
        if ready != self._ready_count:
            self._ready_count, self._ready_changed = ready, obs.time
        kv = [s.kv_cache_usage or 0.0 for s in fresh.values()]
        running = sum(s.running or 0.0 for s in fresh.values())
        waiting = sum(s.waiting or 0.0 for s in fresh.values())
        # The router sends new requests to a replica with room: they queue only once every
        # replica has requests waiting.
        saturated = bool(fresh) and all((s.waiting or 0.0) > 0 for s in fresh.values())
        self._learn_capacity(obs, saturated, finished, len(fresh))
        # Queue times from before the ready count last changed describe another fleet size.
        p90 = self._window.p90(self._ready_changed, self.settings.min_queue_requests)

        need = sum(kv) / spec.target_kv_cache_usage
        if obs.replica_capacity:
            slots = obs.replica_capacity * spec.target_kv_cache_usage
            need = max(need, (running + waiting) / slots)
        if (
            p90 is not None
            and p90 > spec.target_queue_time_seconds
            and saturated
            and obs.replicas <= ready
        ):
            ratio = min(p90 / spec.target_queue_time_seconds, self.settings.max_scale_up_factor)
            need = max(need, ready * ratio)
        assert self._first_time is not None
        tolerance = self.settings.tolerance
        start = max(self._first_time, obs.time - self.settings.queue_window_seconds)
        rates = self._window.rates(start, obs.time)
        rate = None if rates is None else rates[0]
        if need > obs.replicas * (1 + tolerance) and rates is not None:
            arriving, finishing = rates
            if arriving < finishing * (1 - tolerance):
                # The fleet finishes requests faster than they come: what holds its KV cache
                # is a backlog it is already draining, and a new replica would only take new
                # requests, which the fleet keeps up with.
                need = min(need, float(ready))
            else:
                # KV usage tops out at 100 % and queues take time to build, so neither shows
                # the size of a burst while it starts: size the step by the request rate of
                # the last quarter of the window, over what a full replica was seen to finish
                # (or, before the fleet was ever full, by how fast the rate rises).
                recent = obs.time - self.settings.queue_window_seconds / 4
                before = self._window.rates(start, recent)
                now = self._window.rates(recent, obs.time)
                if now and self._capacity:
                    need = max(need, now[0] / (self._capacity * spec.target_kv_cache_usage))
                elif saturated and before and now and before[0] > 0:
                    need = max(need, ready * now[0] / before[0])
        return Load(
            ready=ready,
            sampled=len(fresh),
            kv_cache_usage=sum(kv) / len(kv) if kv else None,
            running=running,
            waiting=waiting,
            saturated=saturated,
            queue_time_p90=p90,
            request_rate=rate,
            need=need,
        )

    # -- the decision ----------------------------------------------------------------------

    def decide(self, spec: ScalingSpec, obs: Observation) -> Decision:
        s = self.settings
        if self._first_time is None:
            self._first_time = obs.time
        fresh = self._fresh(obs)
        finished = self._observe_counters(obs, fresh)
        load = self._load(spec, obs, fresh, finished)
        current = obs.replicas
        missing = load.ready - load.sampled

        p90, target_q = load.queue_time_p90, spec.target_queue_time_seconds
        queue_panic = p90 is not None and p90 >= s.panic_factor * target_q and load.saturated
        need_panic = load.ready > 0 and load.need >= s.panic_factor * load.ready
        if queue_panic or need_panic:
            self._panic_until = obs.time + s.queue_window_seconds
        panic = obs.time < self._panic_until

        idle = (
            current > 0
            and load.ready >= current
            and missing == 0
            and load.running == 0
            and load.waiting == 0
            and finished == 0
        )
        if not idle:
            self._idle_since = None
        elif self._idle_since is None:
            self._idle_since = obs.time

        decision = self._bounds(spec, obs)
        if decision is None:
            decision = self._scale(spec, obs, load, missing, panic)
        if decision.change == "to-zero":
            self._zeroed_at = obs.time
        return Decision(current, decision.replicas, decision.change, decision.reason, panic, load)

    def _bounds(self, spec: ScalingSpec, obs: Observation) -> _Step | None:
        """Zero, and counts outside minReplicas..maxReplicas: no load to weigh."""
        current, lo, hi = obs.replicas, spec.min_replicas, spec.max_replicas
        if current == 0:
            demanded = obs.demand_time is not None and (
                self._zeroed_at is None or obs.demand_time >= self._zeroed_at
            )
            if demanded:
                return _Step(max(lo, 1), "from-zero", "the router holds requests for it")
            if lo > 0:
                return _Step(lo, "bounds", f"below minReplicas {lo}")
            return _Step(0, "none", "scaled to zero; no demand")
        if current < lo:
            return _Step(lo, "bounds", f"below minReplicas {lo}")
        if current > hi:
            return _Step(hi, "bounds", f"above maxReplicas {hi}")
        return None

    def _scale(
        self, spec: ScalingSpec, obs: Observation, load: Load, missing: int, panic: bool
    ) -> _Step:
        s = self.settings
        current, lo, hi = obs.replicas, spec.min_replicas, spec.max_replicas
        signals = self._describe(spec, obs, load)

        up = current
        if load.need > current * (1 + s.tolerance):
            up = min(hi, math.ceil(load.need))
            if not panic:
                up = min(up, max(current + 1, math.ceil(current * s.max_scale_up_factor)))

        # This step's recommendation for scaling down: replicas not ready yet count as one
        # replica of need each; an unread ready replica or panic holds the count.
        starting = max(0, current - load.ready)
        need_down = load.need + starting
        if up > current or missing > 0 or panic or need_down >= current * (1 - s.tolerance):
            recommendation = up
        else:
            floor = self._too_few_floor(load)
            recommendation = min(current, max(1, lo, math.ceil(need_down), floor))
        self._recommendations.append((obs.time, recommendation))
        delay = spec.scale_down_delay_seconds
        # Keep the recommendation in force at the start of the span too (the last one made at or
        # before it), so a run of lower ones counts only once it has lasted the whole delay.
        recs = self._recommendations
        while len(recs) > 1 and recs[1][0] <= obs.time - delay:
            recs.popleft()

        if up > current:
            if load.request_rate:  # a count too few at no measured rate says nothing
                self._too_few[current] = load.request_rate
            return _Step(up, "up", f"panic: {signals}" if panic else signals)
        zero = self._to_zero(spec, obs)
        if zero is not None:
            return _Step(0, "to-zero", zero)
        if missing > 0:
            return _Step(current, "none", f"{missing} ready replica(s) unread; {signals}")
        highest = max(r for _, r in self._recommendations)
        covered = self._first_time is not None and obs.time - self._first_time >= delay
        if highest < current and covered:
            return _Step(
                highest,
                "down",
                f"{signals}; every recommendation of the last {delay}s was at most {highest}",
            )
        return _Step(current, "none", signals)

    def _too_few_floor(self, load: Load) -> int:
        """The fewest replicas scale-down may go to by what the fleet learnt: not back to a
        count it had to grow from while requests come as fast as they did then. (An engine's
        latency, so its KV use, grows faster than its load: removing a replica from two may
        overload the last one although each was under half full.)"""
        rate = load.request_rate
        if rate is None:
            return 0
        # Twice the tolerance: a minute's request rate is noisier than the gauges.
        margin = 2 * self.settings.tolerance
        return max(
            (count + 1 for count, then in self._too_few.items() if rate >= then * (1 - margin)),
            default=0,
        )

    def _to_zero(self, spec: ScalingSpec, obs: Observation) -> str | None:
        after = spec.scale_to_zero_after_seconds
        if after is None or spec.min_replicas > 0 or self._idle_since is None:
            return None
        idle_for = obs.time - self._idle_since
        if idle_for < after:
            return None
        if obs.demand_time is not None and obs.time - obs.demand_time < after:
            return None
        return f"no requests for {idle_for:.0f}s (scaleToZeroAfterSeconds {after})"

    def _describe(self, spec: ScalingSpec, obs: Observation, load: Load) -> str:
        parts = []
        if load.kv_cache_usage is not None:
            parts.append(
                f"KV cache {load.kv_cache_usage:.2f} (target {spec.target_kv_cache_usage:.2f})"
            )
        parts.append(f"{load.running:.0f} running, {load.waiting:.0f} waiting")
        if load.request_rate is not None:
            parts.append(f"{load.request_rate:.2f} requests/s")
        if load.queue_time_p90 is not None:
            parts.append(
                f"p90 queue time {load.queue_time_p90:.2f}s "
                f"(target {spec.target_queue_time_seconds:g}s)"
            )
        if self._capacity is not None:
            parts.append(f"a full replica finishes {self._capacity:.2f}/s")
        return (
            f"{', '.join(parts)} on {load.sampled}/{load.ready} ready replicas: "
            f"need {load.need:.2f} for {obs.replicas}"
        )
