"""Prometheus histogram arithmetic of the control law: quantiles, deltas between scrapes,
sums over replicas."""

from __future__ import annotations

import math

import pytest
from autoscale_testkit import hist

from fleetllm.autoscale.histograms import histogram_delta, histogram_quantile, merge_histograms
from fleetllm.scrape import Histogram


def test_quantile_follows_prometheus() -> None:
    h = hist({0.5: 50, 1.0: 40, 2.0: 10})
    # rank 90 falls at the top of the (0.5, 1.0] bucket
    assert histogram_quantile(0.9, h) == pytest.approx(1.0)
    assert histogram_quantile(0.5, h) == pytest.approx(0.5)
    assert histogram_quantile(0.95, h) == pytest.approx(1.5)
    # In the +Inf bucket: the largest finite bound.
    assert histogram_quantile(0.9, hist({math.inf: 10})) == 5.0
    assert histogram_quantile(0.9, hist({})) is None


def test_deltas_restart_and_merge() -> None:
    before = hist({0.5: 3, 2.0: 1})
    after = hist({0.5: 5, 2.0: 1, math.inf: 2})
    assert histogram_delta(after, None) is None
    delta = histogram_delta(after, before)
    assert delta is not None and delta.count == 4
    assert [c for _, c in delta.buckets] == [2, 2, 2, 2, 4]
    # The process restarted: its counts went down, so all it holds now is new.
    assert histogram_delta(hist({0.5: 1}), before) == hist({0.5: 1})
    # Different bucket layouts merge over the union of bounds without over-counting.
    other = Histogram(((1.5, 1.0), (math.inf, 2.0)), count=2.0, sum=0.0)
    merged = merge_histograms([delta, other])
    assert merged is not None and merged.count == 6
    assert dict(merged.buckets)[1.5] == 2 + 1 and dict(merged.buckets)[math.inf] == 6
