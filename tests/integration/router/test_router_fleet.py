"""The router over real engines: two models on three + one replicas (acceptance 1), and the
prefix strategy keeping each shared system prompt on one replica (acceptance 2)."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

import httpx
import pytest
from router_testkit import EngineFleet, Process, metric_sum, wait_until, write_fleet

TIMEOUT = 120.0


@pytest.fixture()
def router(engines: EngineFleet, start_router: Any, tmp_path: Path) -> Process:
    fleet_file = tmp_path / "fleet.json"
    write_fleet(
        fleet_file,
        {"alpha": [p.url for p in engines.alpha], "beta": [engines.beta.url]},
    )
    return start_router("--fleet-file", str(fleet_file))


def _strip_volatile(event: dict[str, Any]) -> dict[str, Any]:
    """Without what differs between two equal requests: ids, times, and how much of the
    prompt the second found in the prefix cache the first filled."""
    kept = {k: v for k, v in event.items() if k not in ("id", "created")}
    if isinstance(kept.get("usage"), dict):
        kept["usage"] = {k: v for k, v in kept["usage"].items() if k != "prompt_tokens_details"}
    return kept


def _stream(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """A stream's content: what it says, not how the replica happened to split it into
    events (an engine that runs ahead of its client sends several tokens in one event)."""
    with httpx.stream("POST", url, json=body, timeout=TIMEOUT) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    assert text.endswith("data: [DONE]\n\n")
    blocks = [block[6:] for block in text.split("\n\n") if block.startswith("data: ")]
    assert blocks[-1] == "[DONE]" and "[DONE]" not in blocks[:-1]
    events = [json.loads(e) for e in blocks[:-1]]
    content, finish, roles = "", None, []
    for event in events:
        choice = event["choices"][0]
        delta = choice.get("delta", {})
        content += choice.get("text") or delta.get("content") or ""
        roles += [delta["role"]] if "role" in delta else []
        finish = choice.get("finish_reason") or finish
    return {
        "kinds": {(e["object"], e["model"]) for e in events},
        "content": content,
        "finish_reason": finish,
        "roles": roles,
    }


REQUESTS = [
    ("/v1/completions", {"prompt": "The fleet router sends", "max_tokens": 12}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 9}),
]


def test_each_model_reaches_its_own_replicas_and_answers_equal_direct(
    router: Process, engines: EngineFleet
) -> None:
    models = httpx.get(f"{router.url}/v1/models", timeout=TIMEOUT).json()
    assert models["object"] == "list"
    assert sorted(m["id"] for m in models["data"]) == ["alpha", "beta"]

    before = {
        p.url: metric_sum(p.metrics_text(), "vllm:request_success_total") for p in engines.all()
    }
    sent = {"alpha": 0, "beta": 0}
    for model, direct in (("alpha", engines.alpha[0]), ("beta", engines.beta)):
        for path, base in REQUESTS:
            body = {**base, "model": model, "temperature": 0}
            via = httpx.post(f"{router.url}{path}", json=body, timeout=TIMEOUT)
            ref = httpx.post(f"{direct.url}{path}", json=body, timeout=TIMEOUT)
            assert via.status_code == ref.status_code == 200
            assert via.json()["model"] == model
            assert _strip_volatile(via.json()) == _strip_volatile(ref.json())
            streamed = _stream(f"{router.url}{path}", {**body, "stream": True})
            assert streamed == _stream(f"{direct.url}{path}", {**body, "stream": True})
            sent[model] += 2
    # The answers differ between models (different weights), so matching the direct answer
    # shows the model; the engines' own counters show no request strayed.
    after = {
        p.url: metric_sum(p.metrics_text(), "vllm:request_success_total") for p in engines.all()
    }
    alpha_via_router = sum(after[p.url] - before[p.url] for p in engines.alpha) - len(REQUESTS) * 2
    assert alpha_via_router == sent["alpha"]
    assert after[engines.beta.url] - before[engines.beta.url] == sent["beta"] * 2
    metrics = router.metrics_text()
    for p in engines.alpha:
        assert (
            metric_sum(
                metrics, "fleetllm:router_upstream_requests_total", replica=p.url, model="beta"
            )
            == 0
        )
    assert (
        metric_sum(
            metrics,
            "fleetllm:router_upstream_requests_total",
            model="beta",
            replica=engines.beta.url,
            code="200",
        )
        == sent["beta"]
    )


def test_tokenizer_endpoints_and_model_cards_through_the_router_equal_direct(
    router: Process, engines: EngineFleet
) -> None:
    """vLLM's other model-addressed endpoints reach the engines too: /tokenize and
    /detokenize answer as the engine does, an endpoint the engine does not serve is its own
    404, and /v1/models says the context length the replicas serve."""
    messages = [{"role": "user", "content": "Where is my parcel?"}]
    for path, body in (
        ("/tokenize", {"prompt": "The fleet router sends"}),
        ("/tokenize", {"messages": messages, "return_token_strs": True}),
        ("/detokenize", {"tokens": [5, 6, 7]}),
        ("/v1/embeddings", {"input": "The fleet"}),
        ("/v1/messages", {"messages": messages, "max_tokens": 4}),
    ):
        for model, direct in (("alpha", engines.alpha[0]), ("beta", engines.beta)):
            via = httpx.post(f"{router.url}{path}", json={**body, "model": model}, timeout=TIMEOUT)
            ref = httpx.post(f"{direct.url}{path}", json={**body, "model": model}, timeout=TIMEOUT)
            assert (via.status_code, via.json()) == (ref.status_code, ref.json()), path
            assert via.status_code == (404 if path.startswith("/v1/") else 200)
    alpha = httpx.post(f"{router.url}/tokenize", json={"model": "alpha", "prompt": "x y z"})
    beta = httpx.post(f"{router.url}/tokenize", json={"model": "beta", "prompt": "x y z"})
    assert alpha.json()["max_model_len"] == beta.json()["max_model_len"] == 1024

    def cards() -> dict[str, Any]:
        listing = httpx.get(f"{router.url}/v1/models", timeout=TIMEOUT).json()
        return {m["id"]: m["max_model_len"] for m in listing["data"]}

    wait_until(lambda: None not in cards().values(), "every replica's card read")
    assert cards() == {"alpha": 1024, "beta": 1024}


def test_unknown_model_is_a_404_in_openai_shape(router: Process) -> None:
    r = httpx.post(
        f"{router.url}/v1/chat/completions",
        json={"model": "nope", "messages": [{"role": "user", "content": "x"}]},
        timeout=TIMEOUT,
    )
    assert r.status_code == 404
    error = r.json()["error"]
    assert error["code"] == 404 and error["param"] == "model" and "nope" in error["message"]
    assert error["type"] == "NotFoundError"


TOPICS = ("maritime logistics", "tax law", "orbital mechanics", "medieval poetry")


def _system_prompt(topic: str) -> str:
    rules = " ".join(
        f"Rule {i}: answer questions on {topic} precisely and briefly." for i in range(14)
    )
    return f"You are an expert assistant on {topic}. {rules}"


def _upstream_counts(router: Process, engines: EngineFleet) -> dict[str, float]:
    text = router.metrics_text()
    return {
        p.url: metric_sum(text, "fleetllm:router_upstream_requests_total", replica=p.url)
        for p in engines.alpha
    }


def _prefix_hits(engines: EngineFleet) -> dict[str, float]:
    return {
        p.url: metric_sum(p.metrics_text(), "vllm:prefix_cache_hits_total") for p in engines.alpha
    }


def test_prefix_strategy_keeps_each_system_prompt_on_one_replica(
    router: Process, engines: EngineFleet
) -> None:
    for topic in TOPICS:
        system = {"role": "system", "content": _system_prompt(topic)}
        shared = httpx.post(
            f"{engines.alpha[0].url}/tokenize",
            json={"model": "alpha", "messages": [system], "add_generation_prompt": False},
            timeout=TIMEOUT,
        ).json()["count"]
        counts, hits = _upstream_counts(router, engines), _prefix_hits(engines)
        for i in range(10):
            body = {
                "model": "alpha",
                "messages": [system, {"role": "user", "content": f"Question {i} on {topic}?"}],
                "max_tokens": 1,
            }
            r = httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=TIMEOUT)
            assert r.status_code == 200
        new_counts, new_hits = _upstream_counts(router, engines), _prefix_hits(engines)
        used = {
            url: new_counts[url] - counts[url] for url in counts if new_counts[url] > counts[url]
        }
        assert len(used) == 1 and next(iter(used.values())) == 10, used
        home = next(iter(used))
        # The nine requests after the first found the system prompt's full blocks cached on
        # that replica; the other replicas looked nothing up.
        block = 16
        assert new_hits[home] - hits[home] >= 9 * (shared // block) * block
        assert all(new_hits[u] == hits[u] for u in hits if u != home)


def test_prefix_strategy_bounds_load_under_a_burst_of_one_prompt(
    router: Process, engines: EngineFleet
) -> None:
    """40 concurrent requests that share one system prompt: the home replica takes no more
    than load_factor x the mean; the rest spill to the next replicas on the ring. (Each asks
    for enough tokens that all 40 are in flight together: placement happens in the first
    milliseconds, completion takes seconds.)"""
    system = {"role": "system", "content": _system_prompt("maritime logistics")}
    body = {"model": "alpha", "max_tokens": 48, "ignore_eos": True}

    async def burst() -> list[int]:
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            responses = await asyncio.gather(
                *(
                    client.post(
                        f"{router.url}/v1/chat/completions",
                        json={**body, "messages": [system, {"role": "user", "content": f"Q{i}"}]},
                    )
                    for i in range(40)
                )
            )
        return [r.status_code for r in responses]

    counts = _upstream_counts(router, engines)
    assert asyncio.run(burst()) == [200] * 40
    new_counts = _upstream_counts(router, engines)
    placed = sorted(new_counts[u] - counts[u] for u in counts)
    assert sum(placed) == 40
    capacity = math.ceil(1.25 * 40 / 3)
    assert placed[-1] <= capacity, placed
    assert placed[0] > 0, placed
