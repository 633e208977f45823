"""/metrics: vLLM's names, types, labels and buckets, and counters that move by exactly what
known requests did."""

from __future__ import annotations

import json
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import (
    BLOCK_SIZE,
    NUM_KV_BLOCKS,
    SERVED_NAME,
    ServerProcess,
    parse_sse,
    post,
    wait_until,
)

from fleetllm.engine.metrics import INTER_TOKEN_BUCKETS, REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS

EXPECTED = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:num_preemptions": "counter",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:spec_decode_num_drafts": "counter",
    "vllm:spec_decode_num_draft_tokens": "counter",
    "vllm:spec_decode_num_accepted_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:cache_config_info": "gauge",
}
HISTOGRAMS = [name for name, kind in EXPECTED.items() if kind == "histogram"]

# vLLM's boundaries, written out here so a change on either side is caught.
VLLM_TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
             7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]  # fmt: skip
VLLM_ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
            10.0, 20.0, 40.0, 80.0]  # fmt: skip
VLLM_LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]  # fmt: skip


def test_metrics_names_types_labels_buckets(server: ServerProcess) -> None:
    # Make sure every histogram has data, whatever ran before.
    post(server, "/v1/completions", {"prompt": "warm", "max_tokens": 3, "ignore_eos": True})
    response = httpx.get(f"{server.base_url}/metrics", timeout=10)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    for name, kind in EXPECTED.items():
        assert name in families, name
        assert families[name].type == kind, name
    for name, family in families.items():
        if not name.startswith("vllm:") or name == "vllm:cache_config_info":
            continue
        for sample in family.samples:
            assert sample.labels.get("model_name") == SERVED_NAME, sample
        if family.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in family.samples)

    def bounds(name: str) -> list[float]:
        samples = families[name].samples
        return [float(s.labels["le"]) for s in samples if s.name.endswith("_bucket")][:-1]

    assert bounds("vllm:time_to_first_token_seconds") == VLLM_TTFT == list(TTFT_BUCKETS)
    assert bounds("vllm:inter_token_latency_seconds") == VLLM_ITL == list(INTER_TOKEN_BUCKETS)
    for name in HISTOGRAMS[2:]:
        assert bounds(name) == VLLM_LATENCY == list(REQUEST_LATENCY_BUCKETS), name

    reasons = {s.labels["finished_reason"] for s in families["vllm:request_success"].samples}
    assert {"stop", "length", "abort"} <= reasons
    (info,) = families["vllm:cache_config_info"].samples
    assert info.value == 1.0
    assert info.labels["block_size"] == str(BLOCK_SIZE)
    assert info.labels["num_gpu_blocks"] == str(NUM_KV_BLOCKS)
    kv = server.metric("vllm:kv_cache_usage_perc")
    assert 0.0 <= kv <= 1.0


def _first_new_token(ids: list[int]) -> int:
    """The index of the first generated token not seen before it (a clean stop point)."""
    return next(i for i, t in enumerate(ids) if t not in ids[:i] and i >= 2)


def test_counters_move_by_known_requests(server: ServerProcess) -> None:
    wait_until(lambda: server.metric("vllm:num_requests_running") == 0, what="idle server")
    # Learn a greedy continuation to stop on a known token.
    probe = post(
        server,
        "/v1/completions",
        {"prompt": [5, 6, 7, 8, 9], "max_tokens": 12, "temperature": 0.0, "ignore_eos": True,
         "return_token_ids": True},
    ).json()  # fmt: skip
    ids = probe["choices"][0]["token_ids"]
    assert probe["choices"][0]["prompt_token_ids"] == [5, 6, 7, 8, 9] and len(ids) == 12
    before = server.metrics()

    # A: plain completion that runs to its length.
    a = post(
        server,
        "/v1/completions",
        {"prompt": [11, 12, 13, 14, 15, 16, 17], "max_tokens": 5, "ignore_eos": True},
    ).json()
    assert a["choices"][0]["finish_reason"] == "length"
    # B: streamed, stopped by a stop token after k+1 tokens.
    k = _first_new_token(ids)
    raw = httpx.post(
        f"{server.base_url}/v1/completions",
        json={"prompt": [5, 6, 7, 8, 9], "max_tokens": 12, "temperature": 0.0,
              "ignore_eos": True, "stop_token_ids": [ids[k]], "stream": True,
              "stream_options": {"include_usage": True}},
        timeout=60,
    ).text  # fmt: skip
    events = parse_sse(raw)
    b_usage = events[-1]["usage"]
    assert [c["finish_reason"] for e in events for c in e["choices"]][-1] == "stop"
    assert b_usage["completion_tokens"] == k + 1
    # C: chat with n=2: two engine requests over one prompt.
    c = post(
        server,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "count"}], "n": 2, "max_tokens": 3,
         "ignore_eos": True},
    ).json()  # fmt: skip
    assert [ch["finish_reason"] for ch in c["choices"]] == ["length", "length"]

    after = server.metrics()

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before[key]

    prompt_tokens = (
        a["usage"]["prompt_tokens"] + b_usage["prompt_tokens"] + 2 * c["usage"]["prompt_tokens"]
    )
    generated = [5, k + 1, 3, 3]
    assert delta("vllm:prompt_tokens_total") == prompt_tokens
    assert delta("vllm:generation_tokens_total") == sum(generated)
    assert (
        a["usage"]["completion_tokens"] + b_usage["completion_tokens"]
        == 5 + k + 1
        == sum(generated) - c["usage"]["completion_tokens"]
    )
    assert delta("vllm:request_success_total", finished_reason="length") == 3
    assert delta("vllm:request_success_total", finished_reason="stop") == 1
    assert delta("vllm:request_success_total", finished_reason="abort") == 0
    for name in HISTOGRAMS:
        if name == "vllm:inter_token_latency_seconds":
            assert delta(f"{name}_count") == sum(g - 1 for g in generated)
        else:
            assert delta(f"{name}_count") == 4, name
        assert delta(f"{name}_sum") >= 0
    assert delta("vllm:num_preemptions_total") == 0
    assert after[("vllm:num_requests_running", ())] == 0


def test_prefix_cache_counters(server: ServerProcess) -> None:
    prompt = list(range(300, 340))  # 40 tokens: two full blocks of 16
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": 2, "ignore_eos": True}
    post(server, "/v1/completions", body)
    before = server.metrics()
    post(server, "/v1/completions", body)
    after = server.metrics()
    queries = ("vllm:prefix_cache_queries_total", ())
    hits = ("vllm:prefix_cache_hits_total", ())
    assert after[queries] - before[queries] == len(prompt)
    assert after[hits] - before[hits] == 2 * BLOCK_SIZE


def test_request_log_lines(server: ServerProcess) -> None:
    """One JSON line per finished request, without the text unless asked for."""
    secret = "a prompt that must not reach the logs"
    body = post(
        server,
        "/v1/completions",
        {"prompt": secret, "max_tokens": 2},
        headers={"x-request-id": "trace-42"},
    ).json()

    def logged() -> dict[str, Any] | None:
        for line in server.log_text().splitlines():
            entry = json.loads(line)
            if entry.get("request_id") == body["id"]:
                return entry
        return None

    wait_until(lambda: logged() is not None, what="the request's log line")
    entry = logged()
    assert entry is not None
    assert entry["status"] == 200 and entry["model"] == SERVED_NAME
    assert entry["client_request_id"] == "trace-42"
    assert entry["prompt_tokens"] == body["usage"]["prompt_tokens"]
    assert entry["completion_tokens"] == body["usage"]["completion_tokens"]
    assert entry["ttft_s"] >= entry["queue_time_s"] >= 0 and entry["e2e_s"] >= entry["ttft_s"]
    assert secret not in server.log_text()
