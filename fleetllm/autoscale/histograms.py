"""Prometheus histogram arithmetic over scraped cumulative histograms: what arrived between two
scrapes, the sum over replicas, and histogram_quantile."""

from __future__ import annotations

import math

from fleetllm.scrape import Histogram


def histogram_delta(current: Histogram, previous: Histogram | None) -> Histogram | None:
    """Observations between two scrapes of one replica; a counter that went down means the
    process restarted, so everything it holds now is new. None for a first sight (its counts
    span an unknown past)."""
    if previous is None:
        return None
    if current.count < previous.count or any(
        current.count_at(le) < count for le, count in previous.buckets
    ):
        return current
    return Histogram(
        tuple((le, count - previous.count_at(le)) for le, count in current.buckets),
        count=current.count - previous.count,
        sum=current.sum - previous.sum,
    )


def merge_histograms(histograms: list[Histogram]) -> Histogram | None:
    """The sum of several histograms, over the union of their bucket bounds."""
    if not histograms:
        return None
    bounds = sorted({le for h in histograms for le, _ in h.buckets})
    return Histogram(
        tuple((le, sum(h.count_at(le) for h in histograms)) for le in bounds),
        count=sum(h.count for h in histograms),
        sum=sum(h.sum for h in histograms),
    )


def histogram_quantile(q: float, histogram: Histogram) -> float | None:
    """Prometheus' histogram_quantile: linear within the bucket the rank falls in; in the
    +Inf bucket, the largest finite bound. None without observations."""
    total = histogram.buckets[-1][1] if histogram.buckets else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for le, count in histogram.buckets:
        if count >= rank:
            if math.isinf(le):
                return lower_bound
            if count == lower_count:
                return le
            return lower_bound + (le - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = le, count
    return lower_bound
