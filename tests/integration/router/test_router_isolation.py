"""No client's bad request harms other requests: every class of bad request, sent through the
router to two engine replicas, gets a 4xx; the engines stay healthy and idle and keep answering
normal requests, and the router backs neither replica off."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from router_testkit import EngineFleet, metric_sum, wait_until, write_fleet

GUARD = 120.0  # hang guard only
VOCAB = 49152  # the tiny chat model's vocabulary (SmolLM2's tokenizer)
CHAT = [{"role": "user", "content": "Hello there"}]


def _nan(text: str, field: str) -> dict[str, Any]:
    """A body with a non-finite number literal, as a careless client's encoder writes it."""
    return {"prompt": "hi", "max_tokens": 2, field: f"<raw:{text}>"}


def _deep(depth: int) -> bytes:
    return b'{"model": "alpha", "messages": ' + b"[" * depth + b"]" * depth + b"}"


# (name, path, body): each a class of request that must be refused without harm.
C = "/v1/completions"
CC = "/v1/chat/completions"
BAD: list[tuple[str, str, Any]] = [
    # Token ids outside the vocabulary, wherever a parameter names one.
    ("prompt-ids-past-vocab", C, {"prompt": [1, VOCAB + 5]}),
    ("prompt-ids-negative", C, {"prompt": [1, -3]}),
    ("prompt-ids-huge", C, {"prompt": [2**40]}),
    ("batch-ids-past-vocab", C, {"prompt": [[1, 2], [VOCAB]]}),
    ("stop-token-ids-past-vocab", C, {"prompt": "hi", "stop_token_ids": [VOCAB + 1]}),
    ("stop-token-ids-negative", CC, {"messages": CHAT, "stop_token_ids": [-1]}),
    ("logit-bias-past-vocab", CC, {"messages": CHAT, "logit_bias": {str(VOCAB + 9): 5}}),
    ("logit-bias-not-an-id", CC, {"messages": CHAT, "logit_bias": {"abc": 1}}),
    # Numbers that are not finite, or out of every range.
    ("temperature-nan", C, _nan("NaN", "temperature")),
    ("top-p-infinity", C, _nan("Infinity", "top_p")),
    ("presence-penalty-minus-infinity", C, _nan("-Infinity", "presence_penalty")),
    ("repetition-penalty-nan", C, _nan("NaN", "repetition_penalty")),
    ("min-p-infinity", C, _nan("Infinity", "min_p")),
    ("temperature-negative", CC, {"messages": CHAT, "temperature": -1}),
    ("seed-70-bits", C, {"prompt": "hi", "seed": 2**70}),
    ("max-tokens-70-bits", C, {"prompt": "hi", "max_tokens": 2**70}),
    ("max-tokens-zero", C, {"prompt": "hi", "max_tokens": 0}),
    ("n-huge", C, {"prompt": "hi", "n": 2**40}),
    ("logprobs-huge", C, {"prompt": "hi", "logprobs": 10**6}),
    ("top-logprobs-huge", CC, {"messages": CHAT, "logprobs": True, "top_logprobs": 10**6}),
    # Unbounded work in one request.
    ("prompts-times-n", C, {"prompt": ["hi"] * 2000, "n": 64, "max_tokens": 4}),
    ("prompt-too-long", C, {"prompt": "word " * 5000, "max_tokens": 2}),
    ("max-tokens-past-context", CC, {"messages": CHAT, "max_tokens": 10**6}),
    # Conflicting bounds.
    ("min-tokens-over-max", C, {"prompt": "hi", "min_tokens": 50, "max_tokens": 5}),
    ("min-tokens-negative", C, {"prompt": "hi", "min_tokens": -1}),
    # Shapes and types.
    ("deep-nesting", CC, _deep(20_000)),
    ("messages-empty", CC, {"messages": []}),
    ("messages-not-a-list", CC, {"messages": "hi"}),
    ("message-without-role", CC, {"messages": [{"content": "hi"}]}),
    ("content-image", CC, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
    ("prompt-empty", C, {"prompt": ""}),
    ("prompt-mixed-list", C, {"prompt": ["hi", 5]}),
    ("temperature-a-string", C, {"prompt": "hi", "temperature": "hot"}),
    ("n-a-float", C, {"prompt": "hi", "n": 1.5}),
    ("stop-a-number", C, {"prompt": "hi", "stop": 7}),
    ("stream-options-wrong", C, {"prompt": "hi", "stream": True, "stream_options": []}),
    ("prompt-logprobs-huge", C, {"prompt": "hi", "prompt_logprobs": 10**6}),
    ("response-format-xml", CC, {"messages": CHAT, "response_format": {"type": "xml"}}),
    ("chat-template-kwargs-list", CC, {"messages": CHAT, "chat_template_kwargs": []}),
]


def _body(body: Any, stream: bool) -> bytes:
    if isinstance(body, bytes):
        return body
    text = json.dumps({"model": "alpha", **body, **({"stream": True} if stream else {})})
    for raw in ("NaN", "Infinity", "-Infinity"):
        text = text.replace(f'"<raw:{raw}>"', raw)
    return text.encode()


def _normal_requests_answered(url: str) -> None:
    for path, body in ((C, {"prompt": "Once upon a time"}), (CC, {"messages": CHAT})):
        for stream in (False, True):
            r = httpx.post(
                f"{url}{path}",
                json={
                    "model": "alpha",
                    "max_tokens": 3,
                    "ignore_eos": True,
                    **body,
                    "stream": stream,
                },
                timeout=GUARD,
            )
            assert r.status_code == 200, r.text
            if stream:
                assert r.text.endswith("data: [DONE]\n\n") and '"error"' not in r.text


def test_bad_requests_harm_no_replica(
    engines: EngineFleet, start_router: Any, tmp_path: Path
) -> None:
    replicas = [engines.alpha[0], engines.alpha[2]]
    fleet_file = tmp_path / "fleet.json"
    write_fleet(fleet_file, {"alpha": [p.url for p in replicas]})
    router = start_router(
        "--fleet-file", str(fleet_file), "--strategy", "round-robin", "--admin-key", "admin"
    )
    answers: dict[str, int] = {}
    with httpx.Client(timeout=GUARD) as client:
        for name, path, body in BAD:
            # Twice each way, so that round robin sends every class to both replicas.
            for stream in (False, False, True, True):
                r = client.post(
                    f"{router.url}{path}",
                    content=_body(body, stream),
                    headers={"Content-Type": "application/json"},
                )
                key = f"{name}{' (stream)' if stream else ''}"
                answers[key] = r.status_code
                if r.status_code < 400:
                    continue
                error = r.json()["error"]
                assert error["code"] == r.status_code and error["message"], (key, r.text)
    refused = {k: s for k, s in answers.items() if not 400 <= s < 500}
    assert refused == {}, f"not answered with a 4xx: {refused}"

    metrics = router.metrics_text()
    for p in replicas:
        # The router holds none of it against a replica.
        assert metric_sum(metrics, "fleetllm:router_replica_up", replica=p.url) == 1
        assert (
            metric_sum(
                metrics, "fleetllm:router_upstream_requests_total", replica=p.url, code="error"
            )
            == 0
        )
        # The engine is alive, healthy, and idle: nothing running, waiting or holding blocks.
        assert p.proc.poll() is None
        assert httpx.get(f"{p.url}/health", timeout=10).status_code == 200

        def idle(p: Any = p) -> bool:
            text = p.metrics_text()
            return (
                metric_sum(text, "vllm:num_requests_running") == 0
                and metric_sum(text, "vllm:num_requests_waiting") == 0
                and metric_sum(text, "vllm:kv_cache_usage_perc") == 0
            )

        wait_until(idle, f"{p.url} idle", GUARD)
        _normal_requests_answered(p.url)
    state = httpx.get(
        f"{router.url}/admin/fleet", headers={"Authorization": "Bearer admin"}, timeout=10
    ).json()
    assert [r["up"] for r in state["models"]["alpha"]["replicas"]] == [True, True]
    _normal_requests_answered(router.url)


@pytest.fixture(autouse=True)
def _replicas_are_back(engines: EngineFleet) -> Any:
    """Later tests share these engines: one that a bad request took down is started again."""
    yield
    for p in engines.alpha:
        if p.proc.poll() is not None:
            p.restart()
        p.wait_healthy()
