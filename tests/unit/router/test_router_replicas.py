"""Replica state: load from /metrics scrapes (fleetllm.scrape), passive failures with backoff,
health."""

from __future__ import annotations

from fleetllm.router.replicas import Replica
from fleetllm.scrape import EngineSample


def test_failures_back_off_exponentially_up_to_a_cap() -> None:
    r = Replica("http://a:1", "m")
    assert r.available(0.0)
    downs = []
    for _ in range(6):
        r.record_failure(100.0, base=0.5, cap=4.0)
        downs.append(r.down_until - 100.0)
    assert downs == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert not r.available(103.9) and r.available(104.0)
    r.record_success()
    r.record_failure(200.0, base=0.5, cap=4.0)
    assert r.down_until == 200.5


def test_health_draining_and_a_replica_that_comes_back() -> None:
    r = Replica("http://a:1", "m")
    r.record_scrape(True, EngineSample(time=0.0, waiting=2.0, kv_cache_usage=0.5))
    assert (r.waiting, r.kv_usage, r.running) == (2.0, 0.5, 0.0)
    # A gauge missing from a later scrape keeps its last value.
    r.record_scrape(True, EngineSample(time=1.0, running=3.0))
    assert (r.waiting, r.kv_usage, r.running) == (2.0, 0.5, 3.0)
    r.record_failure(0.0, base=1.0, cap=60.0)
    r.record_failure(0.0, base=1.0, cap=60.0)
    r.record_scrape(False, None)
    assert not r.available(1000.0)
    # Healthy again after being seen down: the failure history no longer counts.
    r.record_scrape(True, None)
    assert r.available(0.0) and r.failures == 0
    r.draining = True
    assert not r.available(0.0)
    c = Replica("http://b:1", "m").candidate()
    assert (c.id, c.in_flight, c.waiting, c.kv_usage) == ("http://b:1", 0, 0.0, 0.0)
