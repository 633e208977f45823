"""Failover until the first token, and what each kind of upstream answer does to a replica,
against scripted replicas: events that carry no token are held back so that a replica failing
before its first token is replaced; only an unavailable or broken replica is backed off."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
from aiohttp import web
from router_testkit import metric_sum, serve_router, serve_upstream

from fleetllm.router.config import RouterSettings
from fleetllm.router.discovery import parse_static_fleet
from fleetllm.router.server import Router

pytestmark = pytest.mark.asyncio

SETTINGS = RouterSettings(
    strategy="round-robin", backoff_base=5.0, backoff_max=5.0, scrape_interval=30.0
)
ROLE = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
TOKEN = b'data: {"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}]}\n\n'
FINISH = b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
DONE = b"data: [DONE]\n\n"
GOOD_STREAM = ROLE + TOKEN + FINISH + DONE
BODY = {"model": "m", "messages": [{"role": "user", "content": "x"}]}

Answer = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Replica:
    """A scripted replica: `answer` serves the completions; /health says `healthy`."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.healthy = True
        self.requests = 0

    async def __call__(self, request: web.Request) -> web.StreamResponse:
        if request.path == "/health":
            return web.Response(status=200 if self.healthy else 503)
        if request.path == "/metrics":
            return web.Response(text="")
        await request.read()
        self.requests += 1
        return await self.answer(request)


async def _stream(request: web.Request, data: bytes, hang_up: bool) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(data)
    if hang_up:
        await asyncio.sleep(0.05)
        assert request.transport is not None
        request.transport.close()
    else:
        await response.write_eof()
    return response


def streams(data: bytes, hang_up: bool = False) -> Answer:
    return lambda request: _stream(request, data, hang_up)


def answers(status: int, doc: dict[str, Any]) -> Answer:
    async def answer(_: web.Request) -> web.StreamResponse:
        return web.json_response(doc, status=status)

    return answer


async def _half_body(request: web.Request) -> web.StreamResponse:
    """Headers and part of a JSON body, then the connection drops (a replica killed while it
    sends a non-streamed answer)."""
    response = web.StreamResponse(headers={"Content-Type": "application/json"})
    response.content_length = 1000
    await response.prepare(request)
    await response.write(b'{"choices": [')
    await asyncio.sleep(0.05)
    assert request.transport is not None
    request.transport.close()
    return response


GOOD = streams(GOOD_STREAM)
OK_JSON = answers(200, {"choices": [{"message": {"content": "hi"}}]})


def _backed_off(router: Router, url: str) -> bool:
    return router.models["m"].replicas[url].replica.down_until > 0


async def _run(
    first: Replica, second: Replica, body: dict[str, Any]
) -> tuple[httpx.Response, Router, list[str]]:
    async with (
        serve_upstream(first) as first_url,
        serve_upstream(second) as second_url,
        serve_router(SETTINGS) as (router, url),
    ):
        router.apply_fleet(parse_static_fleet({"models": {"m": [first_url, second_url]}}))
        router.models["m"].turn = 0
        async with httpx.AsyncClient(timeout=30) as client:
            response = await client.post(f"{url}/v1/chat/completions", json=body)
        return response, router, [first_url, second_url]


def _events(text: str) -> list[str]:
    return [b[6:] for b in text.split("\n\n") if b.startswith("data: ")]


@pytest.mark.parametrize(
    "dying",
    [
        pytest.param(streams(b"", hang_up=True), id="before-any-event"),
        pytest.param(streams(ROLE, hang_up=True), id="after-the-role-event"),
        pytest.param(streams(b": ping\n\n" + ROLE + b'data: {"choi', hang_up=True), id="mid-event"),
        pytest.param(streams(ROLE + b'data: {"error": {"code": 503}}\n\n' + DONE), id="503-event"),
    ],
)
async def test_a_stream_moves_to_another_replica_until_its_first_token(dying: Answer) -> None:
    first, second = Replica(dying), Replica(GOOD)
    r, router, (first_url, second_url) = await _run(first, second, {**BODY, "stream": True})
    assert r.status_code == 200 and (first.requests, second.requests) == (1, 1)
    # The client sees one clean stream: the held-back role event of the dead replica is gone.
    assert r.text == GOOD_STREAM.decode()
    assert _backed_off(router, first_url) and not _backed_off(router, second_url)


async def test_a_stream_cut_after_its_first_token_ends_with_an_error_event() -> None:
    first, second = Replica(streams(ROLE + TOKEN, hang_up=True)), Replica(GOOD)
    r, router, (first_url, _) = await _run(first, second, {**BODY, "stream": True})
    events = _events(r.text)
    assert events[:2] == [ROLE[6:-2].decode(), TOKEN[6:-2].decode()]
    assert json.loads(events[2])["error"]["code"] == 502 and events[3:] == ["[DONE]"]
    assert second.requests == 0 and _backed_off(router, first_url)


async def test_a_non_streamed_answer_cut_midway_moves_to_another_replica() -> None:
    first, second = Replica(_half_body), Replica(OK_JSON)
    r, router, (first_url, _) = await _run(first, second, BODY)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "hi"
    assert (first.requests, second.requests) == (1, 1) and _backed_off(router, first_url)


@pytest.mark.parametrize("status", [400, 404, 413, 422, 429])
async def test_client_errors_are_answers_and_never_back_a_replica_off(status: int) -> None:
    first = Replica(answers(status, {"error": {"message": "no", "code": status}}))
    second = Replica(OK_JSON)
    r, router, (first_url, _) = await _run(first, second, BODY)
    assert r.status_code == status and second.requests == 0
    assert not _backed_off(router, first_url)
    metrics = router.metrics.render().decode()
    assert metric_sum(metrics, "fleetllm:router_replica_up", replica=first_url) == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_a_500_from_a_healthy_replica_is_the_requests_own_answer(stream: bool) -> None:
    envelope = {"error": {"message": "this request failed", "code": 500}}
    if stream:
        answer = streams(ROLE + b"data: " + json.dumps(envelope).encode() + b"\n\n" + DONE)
    else:
        answer = answers(500, envelope)
    first, second = Replica(answer), Replica(GOOD if stream else OK_JSON)
    r, router, (first_url, _) = await _run(first, second, {**BODY, "stream": stream})
    # Passed on, not retried (it might break the next replica too), the replica not held
    # responsible: its /health still passes.
    assert second.requests == 0 and not _backed_off(router, first_url)
    if stream:
        assert r.status_code == 200 and json.loads(_events(r.text)[1]) == envelope
    else:
        assert r.status_code == 500 and r.json() == envelope


async def test_a_500_from_a_replica_whose_health_fails_backs_it_off() -> None:
    dead = answers(500, {"error": {"message": "the engine has failed", "code": 500}})

    async def dies(request: web.Request) -> web.StreamResponse:
        first.healthy = False
        return await dead(request)

    first = Replica(dies)
    second = Replica(OK_JSON)
    r, router, (first_url, _) = await _run(first, second, BODY)
    assert r.status_code == 500 and second.requests == 0
    assert _backed_off(router, first_url)
    assert router.models["m"].replicas[first_url].replica.healthy is False
