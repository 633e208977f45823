"""The fleet's counter deltas over the queue-time window, step by step."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from fleetllm.autoscale.histograms import histogram_quantile, merge_histograms
from fleetllm.scrape import Histogram


@dataclass
class RequestWindow:
    """Per-step counter deltas of the whole fleet over a time window: the queue-time
    observations, and the requests that arrived (those that finished plus the growth of those
    the replicas hold), each over the step's interval."""

    steps: deque[tuple[float, float, Histogram | None, float | None]] = field(default_factory=deque)
    """(time, seconds since the previous step, queue-time delta, arrivals)."""

    def add(
        self,
        time: float,
        interval: float,
        delta: Histogram | None,
        arrivals: float | None,
        window: float,
    ) -> None:
        self.steps.append((time, interval, delta, arrivals))
        while self.steps and self.steps[0][0] <= time - window:
            self.steps.popleft()

    def p90(self, since: float, min_requests: int) -> float | None:
        recent = [h for t, _, h, _ in self.steps if t > since and h is not None]
        merged = merge_histograms(recent)
        if merged is None or merged.count < min_requests:
            return None
        return histogram_quantile(0.9, merged)

    def rates(self, start: float, end: float) -> tuple[float, float] | None:
        """(arrived, finished) requests per second over the steps in (start, end] that know
        their arrivals; None without any."""
        known = [(dt, h, a) for t, dt, h, a in self.steps if start < t <= end and a is not None]
        seconds = sum(dt for dt, _, _ in known)
        if seconds <= 0:
            return None
        arrived = sum(a for _, _, a in known)
        finished = sum(h.count for _, h, _ in known if h is not None)
        return arrived / seconds, finished / seconds
