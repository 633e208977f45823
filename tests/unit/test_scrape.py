"""The engine /metrics scraper: our engine's exposition, vLLM's (current and older names),
bad input, and the HTTP side (concurrency, timeouts, errors) against real servers."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web
from engine_stats import load_stats
from hypothesis import given
from hypothesis import strategies as st

from fleetllm.engine.metrics import REQUEST_LATENCY_BUCKETS, EngineMetrics
from fleetllm.scrape import (
    EngineSample,
    Histogram,
    ScrapeError,
    fetch_metrics,
    parse_metrics,
    scrape_all,
)


def test_our_engine_exposition() -> None:
    metrics = EngineMetrics("smol", lambda: load_stats(3, 2, 0.4375))
    for seconds in (0.1, 0.2, 0.9, 3.0, 1e6):
        metrics.queue.observe(seconds)
    sample = parse_metrics(metrics.render().decode(), taken_at=12.5)
    assert (sample.time, sample.running, sample.waiting) == (12.5, 3.0, 2.0)
    assert sample.kv_cache_usage == pytest.approx(0.4375)
    assert sample.complete
    hist = sample.queue_time
    assert hist is not None
    assert [le for le, _ in hist.buckets] == [*REQUEST_LATENCY_BUCKETS, math.inf]
    assert hist.count == 5 and hist.sum == pytest.approx(1e6 + 4.2)
    assert hist.count_at(0.3) == 2 and hist.count_at(1.0) == 3 and hist.count_at(5.0) == 4
    assert hist.count_at(math.inf) == 5 and hist.count_at(0.01) == 0


VLLM = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B"} 3.0
vllm:num_requests_running{engine="1",model_name="meta-llama/Llama-3.1-8B"} 5.0
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B"} 1.0
vllm:num_requests_waiting{engine="1",model_name="meta-llama/Llama-3.1-8B"} 0.0
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="meta-llama/Llama-3.1-8B"} 0.7
vllm:gpu_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B"} 0.5
vllm:request_queue_time_seconds_bucket{engine="0",le="0.3",model_name="m"} 4.0
vllm:request_queue_time_seconds_bucket{engine="0",le="1.0",model_name="m"} 6.0
vllm:request_queue_time_seconds_bucket{engine="0",le="+Inf",model_name="m"} 7.0
vllm:request_queue_time_seconds_bucket{engine="1",le="0.3",model_name="m"} 1.0
vllm:request_queue_time_seconds_bucket{engine="1",le="1.0",model_name="m"} 1.0
vllm:request_queue_time_seconds_bucket{engine="1",le="+Inf",model_name="m"} 2.0
vllm:request_queue_time_seconds_count{engine="0",model_name="m"} 7.0
vllm:request_queue_time_seconds_count{engine="1",model_name="m"} 2.0
vllm:request_queue_time_seconds_sum{engine="0",model_name="m"} 9.5
vllm:request_queue_time_seconds_sum{engine="1",model_name="m"} 30.0
vllm:request_queue_time_seconds_created{engine="0",model_name="m"} 1.7e9
vllm:time_to_first_token_seconds_bucket{le="0.001",model_name="m"} 99.0
"""


def test_vllm_exposition_sums_ranks_and_prefers_the_current_kv_name() -> None:
    sample = parse_metrics(VLLM)
    assert (sample.running, sample.waiting) == (8.0, 1.0)
    # KV usage is averaged over ranks (one cache each); the old name is ignored when the
    # current one is there.
    assert sample.kv_cache_usage == pytest.approx(0.6)
    assert sample.queue_time == Histogram(
        ((0.3, 5.0), (1.0, 7.0), (math.inf, 9.0)), count=9.0, sum=39.5
    )


def test_older_vllm_kv_name_timestamps_and_unlabelled_samples() -> None:
    text = (
        "vllm:gpu_cache_usage_perc 0.25 1700000000000\n"
        'vllm:num_requests_running{model_name="a b } c"} 2\n'
        "vllm:num_requests_waiting 0\n"
    )
    sample = parse_metrics(text)
    assert (sample.kv_cache_usage, sample.running, sample.waiting) == (0.25, 2.0, 0.0)
    assert sample.queue_time is None


def test_missing_and_unreadable_values_are_unknown_not_zero() -> None:
    text = (
        "vllm:num_requests_waiting NaN\n"
        'vllm:num_requests_running{x="1"} notanumber\n'
        "vllm:num_requests_running_garbage 9\n"
        "vllm:kv_cache_usage_perc\n"
        "vllm:num_requests_running{broken 3\n"
        'vllm:request_queue_time_seconds_bucket{le="x"} 3\n'
        "fleetllm:router_requests_total 5\n"
    )
    sample = parse_metrics(text)
    assert sample == EngineSample(time=0.0)
    assert not sample.complete
    assert parse_metrics("") == EngineSample(time=0.0)


def test_a_histogram_without_an_inf_bucket_gets_one_from_its_count() -> None:
    text = (
        'vllm:request_queue_time_seconds_bucket{le="1.0"} 2\n'
        "vllm:request_queue_time_seconds_count 3\n"
        "vllm:request_queue_time_seconds_sum 7.5\n"
    )
    assert parse_metrics(text).queue_time == Histogram(
        ((1.0, 2.0), (math.inf, 3.0)), count=3.0, sum=7.5
    )


@given(st.text(max_size=400))
def test_any_text_parses_without_raising(text: str) -> None:
    sample = parse_metrics("vllm:" + text)
    for value in (sample.running, sample.waiting, sample.kv_cache_usage):
        assert value is None or not math.isnan(value)


# -- HTTP --------------------------------------------------------------------------------


@pytest_asyncio.fixture()
async def replicas() -> AsyncIterator[dict[str, str]]:
    """Replicas on real sockets: three that answer only once all three were asked (so only
    a concurrent scraper reads them), one that never answers in time, one failing."""
    asked = 0
    all_asked = asyncio.Event()
    done = asyncio.Event()

    async def together(_: web.Request) -> web.Response:
        nonlocal asked
        asked += 1
        if asked == 3:
            all_asked.set()
        await asyncio.wait_for(all_asked.wait(), 10)
        return web.Response(text="vllm:num_requests_running 2\nvllm:num_requests_waiting 1\n")

    async def slow(_: web.Request) -> web.Response:
        # Answers only once the test is over: never within a scrape's timeout.
        await done.wait()
        return web.Response(text="vllm:num_requests_running 9\n")

    async def failing(_: web.Request) -> web.Response:
        return web.Response(status=500, text="boom")

    runners = []
    urls = {}
    handlers = {"a": together, "b": together, "c": together, "slow": slow, "failing": failing}
    for name, handler in handlers.items():
        app = web.Application()
        app.router.add_get("/metrics", handler)
        runner = web.AppRunner(app, shutdown_timeout=0.1)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        urls[name] = f"http://127.0.0.1:{port}"
        runners.append(runner)
    yield urls
    done.set()
    for runner in runners:
        await runner.cleanup()


@pytest.mark.asyncio
async def test_scrape_all_reads_replicas_concurrently_with_a_timeout(
    replicas: dict[str, str], unused_tcp_port: int
) -> None:
    closed = f"http://127.0.0.1:{unused_tcp_port}"
    wanted = [replicas[k] for k in ("a", "b", "c", "slow", "failing")] + [closed]
    async with aiohttp.ClientSession() as session:
        started = time.monotonic()
        found = await scrape_all(session, [*wanted, replicas["a"]], 2.0)
        assert list(found) == wanted  # one entry per replica, in order, duplicates folded
        for key in ("a", "b", "c"):
            sample = found[replicas[key]]
            assert sample is not None and (sample.running, sample.waiting) == (2.0, 1.0)
            assert sample.time >= started
        assert found[replicas["slow"]] is None
        assert found[replicas["failing"]] is None and found[closed] is None

        with pytest.raises(ScrapeError, match="HTTP 500"):
            await fetch_metrics(session, replicas["failing"], 1.0)
        with pytest.raises(ScrapeError, match="TimeoutError"):
            await fetch_metrics(session, replicas["slow"], 0.2)
        with pytest.raises(ScrapeError):
            await fetch_metrics(session, "http://", 0.2)
