"""Replica state: load gauges from /metrics, passive failures with backoff, health."""

from __future__ import annotations

from fleetllm.router.replicas import Replica, parse_engine_metrics

EXPOSITION = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="a b"} 3.0
vllm:num_requests_running{engine="0",model_name="alias"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 7.0 1700000000000
vllm:kv_cache_usage_perc{model_name="m"} 0.25
vllm:prefix_cache_hits_total{model_name="m"} 1234.0
vllm:time_to_first_token_seconds_bucket{le="0.001",model_name="m"} 0.0
vllm:num_requests_waiting_garbage 9
fleetllm:other 5
"""


def test_load_gauges_are_read_and_summed_over_label_sets() -> None:
    assert parse_engine_metrics(EXPOSITION) == {"running": 4.0, "waiting": 7.0, "kv_usage": 0.25}


def test_older_vllm_kv_gauge_and_unlabelled_samples() -> None:
    text = "vllm:gpu_cache_usage_perc 0.5\nvllm:num_requests_waiting NaN\n"
    assert parse_engine_metrics(text) == {"kv_usage": 0.5}
    assert parse_engine_metrics('vllm:num_requests_running{x="1"} notanumber\n') == {}


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
    r.record_scrape(True, {"waiting": 2.0, "kv_usage": 0.5})
    assert (r.waiting, r.kv_usage, r.running) == (2.0, 0.5, 0.0)
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
