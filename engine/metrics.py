"""Prometheus metrics with vLLM's names, types, meanings and histogram buckets.

Gauges and counters are read from the engine's latest stats snapshot at scrape time (the
engine keeps cumulative counters); histograms are observed on the engine thread after each
step, from the per-request timestamps the engine records. Everything lives in a per-app
registry, so several servers in one process (tests) do not collide.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from fleetllm.engine.engine_stats import EngineStats
from fleetllm.engine.request import RequestOutput

TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
INTER_TOKEN_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip

FINISH_REASONS = ("stop", "length", "abort", "error")
LABEL = "model_name"


class EngineMetrics:
    def __init__(self, model_name: str, stats: Callable[[], EngineStats | None]) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(_StatsCollector(model_name, stats))

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            metric = Histogram(name, doc, [LABEL], buckets=buckets, registry=self.registry)
            return metric.labels(model_name)

        self.ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        )
        self.inter_token = histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            INTER_TOKEN_BUCKETS,
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.queue = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prefill = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.decode = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.rejected = Counter(
            "fleetllm:engine_rejected_requests",
            "Requests refused (503) because the waiting queue was at its bound.",
            [LABEL],
            registry=self.registry,
        ).labels(model_name)
        self.kv_events_dropped = Counter(
            "fleetllm:kv_events_dropped",
            "KV-event batches dropped because the publisher's queue was full (subscribers see "
            "a gap in the sequence numbers that no replay fills).",
            [LABEL],
            registry=self.registry,
        ).labels(model_name)
        self._last_token_time: dict[str, float] = {}  # engine thread only

    def observe_step(self, outputs: list[RequestOutput], stats: EngineStats) -> None:
        """Record one step's new tokens and finished requests (on the engine thread).

        Aborted requests come through here too, with finish_reason "abort", and requests that
        failed in the engine, with "error": they only drop their bookkeeping, as vLLM records
        no latencies for them.
        """
        for out in outputs:
            m = out.metrics
            rid = out.request_id
            if out.finished:
                previous = self._last_token_time.pop(rid, None)
            else:
                previous = self._last_token_time.get(rid)
            if out.outputs[0].finish_reason in ("abort", "error") or m is None:
                continue
            if m.first_token_time is None or m.last_token_time is None:
                continue
            if previous is None:
                self.ttft.observe(m.first_token_time - m.arrival_time)
            elif m.last_token_time != previous:
                self.inter_token.observe(m.last_token_time - previous)
            if out.finished:
                self._observe_finished(out)
            else:
                self._last_token_time[rid] = m.last_token_time

    def _observe_finished(self, out: RequestOutput) -> None:
        m = out.metrics
        assert m is not None and m.first_token_time is not None
        finished = m.finished_time or time.monotonic()
        scheduled = m.first_scheduled_time or m.arrival_time
        self.e2e.observe(finished - m.arrival_time)
        self.queue.observe(scheduled - m.arrival_time)
        self.prefill.observe(m.first_token_time - scheduled)
        self.decode.observe((m.last_token_time or finished) - m.first_token_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _StatsCollector(Collector):
    def __init__(self, model_name: str, stats: Callable[[], EngineStats | None]) -> None:
        self.model_name = model_name
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        labels = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=[LABEL])
            family.add_metric(labels, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=[LABEL])
            family.add_metric(labels, value)
            return family

        yield gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            s.num_running if s else 0,
        )
        yield gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            s.num_waiting if s else 0,
        )
        yield gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            s.kv_cache_usage if s else 0.0,
        )
        yield counter(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            s.num_preemptions if s else 0,
        )
        yield counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            s.prefix_cache_queries if s else 0,
        )
        yield counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            s.prefix_cache_hits if s else 0,
        )
        yield counter(
            "vllm:prompt_tokens",
            "Number of prefill tokens processed.",
            s.prompt_tokens if s else 0,
        )
        yield counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            s.generation_tokens if s else 0,
        )
        # Speculative decoding (zero without it), as vLLM's V1 engine counts it.
        yield counter(
            "vllm:spec_decode_num_drafts",
            "Number of spec decoding drafts.",
            s.spec_decode_num_drafts if s else 0,
        )
        yield counter(
            "vllm:spec_decode_num_draft_tokens",
            "Number of draft tokens.",
            s.spec_decode_num_draft_tokens if s else 0,
        )
        yield counter(
            "vllm:spec_decode_num_accepted_tokens",
            "Number of accepted tokens.",
            s.spec_decode_num_accepted_tokens if s else 0,
        )
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[LABEL, "finished_reason"],
        )
        finished = s.finished if s else {}
        for reason in (*FINISH_REASONS, *sorted(set(finished) - set(FINISH_REASONS))):
            success.add_metric([self.model_name, reason], finished.get(reason, 0))
        yield success
        if s is not None:
            info = GaugeMetricFamily(
                "vllm:cache_config_info",
                "Information of the LLMEngine CacheConfig",
                labels=["block_size", "num_gpu_blocks"],
            )
            info.add_metric([str(s.block_size), str(s.num_kv_blocks)], 1.0)
            yield info
            # Which attention each phase runs; fallback="true" where a Triton kernel could not
            # build or launch and the phase runs on torch instead (the reason is in /version).
            attention = GaugeMetricFamily(
                "fleetllm:attention_backend_info",
                "The attention implementation of each phase (1)",
                labels=[LABEL, "phase", "backend", "fallback"],
            )
            fell_back = "true" if "fallback" in s.attention else "false"
            for phase in ("decode", "prefill"):
                if phase in s.attention:
                    labels = [self.model_name, phase, s.attention[phase], fell_back]
                    attention.add_metric(labels, 1.0)
            yield attention
        if s is not None and s.max_loras:
            yield _lora_info(s)


def _lora_info(s: EngineStats) -> GaugeMetricFamily:
    """vLLM's `vllm:lora_requests_info`: the adapters of running and of waiting requests as
    comma-separated names, and the slots; the value is when it was read (Unix seconds), so a
    reader takes the newest series. vLLM keeps every label set it ever exported; here only the
    current one is, which is also the newest, and the series stay bounded."""
    info = GaugeMetricFamily(
        "vllm:lora_requests_info",
        "Running stats on lora requests.",
        labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
    )
    labels = [str(s.max_loras), ",".join(s.lora_waiting), ",".join(s.lora_running)]
    info.add_metric(labels, time.time())
    return info
