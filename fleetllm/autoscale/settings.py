"""The control law's settings."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LawSettings:
    """Constants of the law that are the same for every LLMDeployment (the CRD holds the
    per-model targets and delays)."""

    tolerance: float = 0.1
    """No change while need is within this fraction of the current count (as the HPA)."""
    max_scale_up_factor: float = 2.0
    """Outside panic a step at most multiplies the count by this (and adds at least one)."""
    panic_factor: float = 2.0
    """Panic when p90 queue time reaches this x its target, or need this x the ready count."""
    queue_window_seconds: float = 60.0
    """The span the queue-time p90 is taken over."""
    min_queue_requests: int = 10
    """Fewer requests than this in the window make no p90 (one slow request is not a trend)."""
    stale_after_seconds: float = 30.0
    """A sample older than this is missing."""

    def __post_init__(self) -> None:
        if not (
            0 <= self.tolerance < 1
            and self.max_scale_up_factor > 1
            and self.panic_factor > 1
            and self.queue_window_seconds > 0
            and self.min_queue_requests >= 1
            and self.stale_after_seconds > 0
        ):
            raise ValueError(f"invalid autoscaler settings: {self}")
