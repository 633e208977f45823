"""The one reader of engine `/metrics`: for the router, the autoscaler and the local fleet.

It reads vLLM's metric names, which fleetllm's engine exposes too, so it works the same over
both: the load gauges `vllm:num_requests_running`, `vllm:num_requests_waiting`,
`vllm:kv_cache_usage_perc` (older vLLM: `vllm:gpu_cache_usage_perc`) and the cumulative
histogram `vllm:request_queue_time_seconds`.

`parse_metrics` is pure (text in, `EngineSample` out); `fetch_metrics` and `scrape_all` do the
HTTP, directly against each replica (no Prometheus), concurrently, with a timeout and a cap on
the size of an exposition (`MAX_METRICS_BYTES` by default: an engine's is a few KiB, and one
that sends more must not take the scraper's memory with it).
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import aiohttp

from fleetllm.httpread import MiB, TooLarge, read_bounded

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
KV_USAGE_OLD = "vllm:gpu_cache_usage_perc"
"""vLLM before v1 named the KV gauge after the GPU; pods of those versions still run."""
QUEUE_TIME = "vllm:request_queue_time_seconds"
MAX_METRICS_BYTES = 4 * MiB

_GAUGES = (RUNNING, WAITING, KV_USAGE, KV_USAGE_OLD)
_HISTOGRAM_PARTS = {f"{QUEUE_TIME}_bucket", f"{QUEUE_TIME}_sum", f"{QUEUE_TIME}_count"}
_LE = re.compile(r'(?:^|[{,\s])le="([^"]*)"')


class ScrapeError(Exception):
    """A replica's /metrics could not be read (unreachable, timeout, HTTP error)."""


class MetricsTooLarge(ScrapeError):
    """A replica's /metrics is larger than the cap: the replica misbehaves."""


@dataclass(frozen=True)
class Histogram:
    """A cumulative Prometheus histogram: `buckets` are (upper bound, count of observations at
    or below it), ascending, ending with +Inf; counts only grow until the process restarts."""

    buckets: tuple[tuple[float, float], ...]
    count: float
    sum: float

    def count_at(self, bound: float) -> float:
        """Observations at or below `bound` as far as the buckets tell: the count of the
        largest bucket bound that does not exceed it (so never an over-count)."""
        found = 0.0
        for le, count in self.buckets:
            if le > bound:
                break
            found = count
        return found


@dataclass(frozen=True)
class EngineSample:
    """One scrape of one replica. Gauges are None when the exposition lacks them: a missing
    gauge is unknown, never zero."""

    time: float
    """When it was taken (the caller's clock, seconds)."""
    running: float | None = None
    waiting: float | None = None
    kv_cache_usage: float | None = None
    """0..1, the mean over the engine's label sets (one per model name or data-parallel rank)."""
    queue_time: Histogram | None = None

    @property
    def complete(self) -> bool:
        """Whether it holds every load gauge (what the autoscaler needs to call it idle)."""
        return None not in (self.running, self.waiting, self.kv_cache_usage)


def _split_sample(line: str) -> tuple[str, str, str] | None:
    """(metric name, label text, value text) of one exposition line."""
    brace = line.find("{")
    space = line.find(" ")
    if brace >= 0 and (space < 0 or brace < space):
        close = line.rfind("}")
        if close < brace:
            return None
        # Label values may hold spaces; the sample follows the closing brace.
        name, labels, rest = line[:brace], line[brace + 1 : close], line[close + 1 :]
    else:
        name, _, rest = line.partition(" ")
        labels = ""
    fields = rest.split()
    if not fields:
        return None
    return name, labels, fields[0]


def parse_metrics(text: str, taken_at: float = 0.0) -> EngineSample:
    """The load gauges and the queue-time histogram of one Prometheus text exposition.

    A replica reports one series per label set (model name, engine rank): request counts
    and histograms are summed over them, KV usage is averaged. NaN samples and lines that do
    not parse are skipped: they say nothing about load.
    """
    sums: dict[str, float] = {}
    seen: dict[str, int] = {}
    buckets: dict[float, float] = {}
    hist_sum = hist_count = 0.0
    has_histogram = False
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        parts = _split_sample(line)
        if parts is None:
            continue
        name, labels, value_text = parts
        if name not in _GAUGES and name not in _HISTOGRAM_PARTS:
            continue
        try:
            value = float(value_text)
        except ValueError:
            continue
        if math.isnan(value):
            continue
        if name in _GAUGES:
            sums[name] = sums.get(name, 0.0) + value
            seen[name] = seen.get(name, 0) + 1
        elif name.endswith("_bucket"):
            match = _LE.search(labels)
            if match is None:
                continue
            try:
                le = float(match.group(1))
            except ValueError:
                continue
            buckets[le] = buckets.get(le, 0.0) + value
            has_histogram = True
        elif name.endswith("_sum"):
            hist_sum += value
        else:
            hist_count += value
            has_histogram = True

    kv_name = KV_USAGE if KV_USAGE in seen else KV_USAGE_OLD if KV_USAGE_OLD in seen else None
    histogram = None
    if has_histogram:
        ordered = tuple(sorted(buckets.items()))
        if not ordered or not math.isinf(ordered[-1][0]):
            ordered = (*ordered, (math.inf, hist_count))
        histogram = Histogram(ordered, count=max(hist_count, ordered[-1][1]), sum=hist_sum)
    return EngineSample(
        time=taken_at,
        running=sums.get(RUNNING),
        waiting=sums.get(WAITING),
        kv_cache_usage=None if kv_name is None else sums[kv_name] / seen[kv_name],
        queue_time=histogram,
    )


async def fetch_metrics(
    session: aiohttp.ClientSession,
    base_url: str,
    timeout: float,
    headers: Mapping[str, str] | None = None,
    max_bytes: int = MAX_METRICS_BYTES,
) -> EngineSample:
    """GET `base_url`/metrics and parse it; ScrapeError when it cannot be read in time,
    MetricsTooLarge past `max_bytes` (the connection is dropped, not read to its end)."""
    try:
        async with session.get(
            base_url.rstrip("/") + "/metrics",
            timeout=aiohttp.ClientTimeout(total=timeout),
            headers=headers,
        ) as response:
            if response.status != 200:
                raise ScrapeError(f"{base_url}/metrics: HTTP {response.status}")
            text = (await read_bounded(response, max_bytes)).decode("utf-8")
    except TooLarge as exc:
        raise MetricsTooLarge(f"{base_url}/metrics: {exc}") from None
    except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError, ValueError) as exc:
        raise ScrapeError(f"{base_url}/metrics: {type(exc).__name__}: {exc}") from None
    return parse_metrics(text, time.monotonic())


async def scrape_all(
    session: aiohttp.ClientSession,
    base_urls: Iterable[str],
    timeout: float,
    headers: Mapping[str, str] | None = None,
    max_bytes: int = MAX_METRICS_BYTES,
) -> dict[str, EngineSample | None]:
    """Every replica at once; None for one that could not be read within `timeout` (or
    sent more than `max_bytes`)."""
    urls = list(dict.fromkeys(base_urls))

    async def one(url: str) -> EngineSample | None:
        try:
            return await fetch_metrics(session, url, timeout, headers, max_bytes)
        except ScrapeError:
            return None

    results = await asyncio.gather(*(one(url) for url in urls))
    return dict(zip(urls, results, strict=True))
