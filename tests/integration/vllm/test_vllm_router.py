"""The router over two real vLLM replicas (vLLM's CPU build): the official openai client,
least-load and prefix routing on vLLM's own /metrics, and failover when a replica is
SIGKILLed before its first token. The last test kills a replica: keep it last."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from vllm_testkit import MODEL, Replica, Router, metric_sum, wait_until

SYSTEM = "You are a terse assistant for a shipping company. " + " ".join(
    f"Rule {i}: answer in one short sentence and never guess." for i in range(20)
)


def _router(replicas: list[Replica], tmp_path: Path, strategy: str) -> Router:
    fleet = tmp_path / f"fleet-{strategy}.json"
    fleet.write_text(json.dumps({"models": {MODEL: [r.url for r in replicas]}}))
    return Router(fleet, tmp_path / f"router-{strategy}.log", "--strategy", strategy)


@pytest.fixture()
def least_load(vllm_replicas: list[Replica], tmp_path: Path) -> Iterator[Router]:
    router = _router(vllm_replicas, tmp_path, "least-load")
    yield router
    router.close()


@pytest.fixture()
def prefix(vllm_replicas: list[Replica], tmp_path: Path) -> Iterator[Router]:
    router = _router(vllm_replicas, tmp_path, "prefix")
    yield router
    router.close()


def _served(replicas: list[Replica]) -> list[float]:
    return [metric_sum(r.metrics(), "vllm:request_success_total") for r in replicas]


class Fill:
    """`count` long streamed requests straight to `replica` (not through the router), until
    `stop`: their connections close, and vLLM aborts them."""

    def __init__(self, replica: Replica, count: int) -> None:
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._one, args=(replica,), daemon=True) for _ in range(count)
        ]
        for thread in self._threads:
            thread.start()

    def _one(self, replica: Replica) -> None:
        body = {"model": MODEL, "prompt": "Count on:", "max_tokens": 900, "stream": True}
        body["ignore_eos"] = True
        # The failover test kills the replica under them.
        with (
            contextlib.suppress(httpx.TransportError),
            httpx.stream("POST", f"{replica.url}/v1/completions", json=body, timeout=600) as r,
        ):
            for _ in r.iter_lines():
                if self._stop.is_set():
                    break

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)


def _running(replica: Replica) -> float:
    return metric_sum(replica.metrics(), "vllm:num_requests_running")


def _waiting(replica: Replica) -> float:
    return metric_sum(replica.metrics(), "vllm:num_requests_waiting")


def test_the_openai_client_chats_completes_and_streams_through_the_router(
    least_load: Router, vllm_replicas: list[Replica]
) -> None:
    client = least_load.client()
    before = _served(vllm_replicas)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=8
    )
    assert chat.model == MODEL and chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content and chat.usage.completion_tokens <= 8
    completion = client.completions.create(
        model=MODEL, prompt="One, two,", max_tokens=6, extra_body={"ignore_eos": True}
    )
    assert completion.object == "text_completion" and completion.usage.completion_tokens == 6

    # Streams, several at once: the router spreads them over both replicas.
    def stream(out: list[object]) -> None:
        chunks = list(
            client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Say hello."}],
                max_tokens=24,
                stream=True,
                extra_body={"ignore_eos": True},
            )
        )
        out.append(chunks)

    results: list[object] = []
    threads = [threading.Thread(target=stream, args=(results,)) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert len(results) == 4
    for chunks in results:
        assert isinstance(chunks, list)
        assert chunks[0].choices[0].delta.role == "assistant"
        finished = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert finished[-1] == "length"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text
    after = _served(vllm_replicas)
    assert sum(after) - sum(before) == 6
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)

    # Errors keep the OpenAI shape: the router's own, and vLLM's passed through.
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "x"}]
        )
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt="x", max_tokens=5000)
    assert refused.value.status_code == 400


def test_least_load_reads_vllms_metrics_and_avoids_the_busy_replica(
    least_load: Router, vllm_replicas: list[Replica]
) -> None:
    busy, idle = vllm_replicas
    fill = Fill(busy, 6)
    # vLLM's own gauges show the queue (engine="0" samples, summed per replica) ...
    wait_until(lambda: _running(busy) == 4 and _waiting(busy) == 2, "busy replica full")
    # ... which the router scrapes every second: give it two scrapes to see them.
    time.sleep(2 * 1.0 + 0.5)
    sent = {r.url: least_load.upstream(r.url) for r in vllm_replicas}
    for _ in range(5):
        least_load.client().completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert least_load.upstream(idle.url) - sent[idle.url] == 5
    assert least_load.upstream(busy.url) == sent[busy.url]
    fill.stop()


def test_prefix_routing_keeps_a_shared_system_prompt_on_one_replica_and_hits_its_cache(
    prefix: Router, vllm_replicas: list[Replica]
) -> None:
    client = prefix.client()
    hits = [metric_sum(r.metrics(), "vllm:prefix_cache_hits_total") for r in vllm_replicas]
    for i in range(6):
        client.chat.completions.create(
            model=MODEL,
            messages=[
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Question {i}: where is parcel {i}?"},
            ],
            max_tokens=1,
        )
    used = [r for r in vllm_replicas if prefix.upstream(r.url) > 0]
    assert len(used) == 1 and prefix.upstream(used[0].url) == 6
    home = vllm_replicas.index(used[0])
    after = [metric_sum(r.metrics(), "vllm:prefix_cache_hits_total") for r in vllm_replicas]
    # The five after the first found the system prompt in the home replica's cache.
    assert after[home] - hits[home] >= 5 * 16
    assert after[1 - home] == hits[1 - home]


def test_a_replica_killed_before_its_first_token_fails_over_to_the_other(
    least_load: Router, vllm_replicas: list[Replica]
) -> None:
    # Both replicas full: a new request waits in a queue, before its first token.
    fills = [Fill(r, 4) for r in vllm_replicas]
    wait_until(lambda: all(_running(r) == 4 for r in vllm_replicas), "both replicas full")
    answer: list[object] = []

    def request() -> None:
        stream = least_load.client().completions.create(
            model=MODEL, prompt="The end:", max_tokens=8, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        answer.append([c.choices[0].text for c in stream if c.choices])

    thread = threading.Thread(target=request)
    thread.start()
    wait_until(
        lambda: any(_waiting(r) > 0 for r in vllm_replicas), "the request queued on a replica"
    )
    victim = next(r for r in vllm_replicas if _waiting(r) > 0)
    retries = metric_sum(least_load.metrics(), "fleetllm:router_upstream_retries_total")
    victim.kill()
    for fill in fills:  # the survivor's slots free up for the request tried there again
        fill.stop()
    thread.join(600)
    (tokens,) = answer
    assert isinstance(tokens, list) and "".join(tokens)
    assert metric_sum(least_load.metrics(), "fleetllm:router_upstream_retries_total") > retries
    survivor = next(r for r in vllm_replicas if r is not victim)
    assert least_load.upstream(survivor.url) >= 1
