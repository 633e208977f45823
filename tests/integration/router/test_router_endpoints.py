"""Every model-addressed endpoint of vLLM's through the router, against scripted replicas: the
same path and body reach a replica of the named model (the engines' name for it, the tenant's
cache salt where the endpoint takes one), keys and scopes and the body limit hold, a replica
that cannot serve is left for another before the first byte, a replica's own error passes
through as it came, streams of the Anthropic API are relayed, the usage they report is charged
to the key, and /v1/models says the context length the replicas serve."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web
from router_testkit import async_wait_until, serve_router, serve_upstream

from fleetllm.router.config import RouterSettings
from fleetllm.router.discovery import ModelRoute, ReplicaRef
from fleetllm.router.endpoints import ENDPOINTS
from fleetllm.router.server import Router

pytestmark = pytest.mark.asyncio

GUARD = 30.0  # hang guard only
PATHS = [e.path for e in ENDPOINTS]
SALTED = {e.path for e in ENDPOINTS if e.salted}
SERVED = "m-served"
KEYS = """\
keys:
  - {name: all, key: sk-all}
  - {name: only-other, key: sk-other, models: [other]}
  - {name: thrifty, key: sk-t, tokensPerMinute: 100}
"""
# Input and output tokens as the Anthropic API counts them: 30 in, then 25 out.
ANTHROPIC_STREAM = (
    b'event: message_start\ndata: {"type":"message_start","message":{"usage":'
    b'{"input_tokens":30,"output_tokens":0}}}\n\n'
    b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
    b'"delta":{"type":"text_delta","text":"hi"}}\n\n'
    b'event: message_delta\ndata: {"type":"message_delta","usage":'
    b'{"input_tokens":30,"output_tokens":25}}\n\n'
    b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
)


class Replica:
    """A scripted replica: it answers each request with the path and body it got (so that the
    client sees what arrived), or with an error envelope of `status`; its card says
    `max_model_len`."""

    def __init__(self, status: int = 200, max_model_len: int = 2048) -> None:
        self.status = status
        self.max_model_len = max_model_len
        self.seen: list[tuple[str, dict[str, Any]]] = []
        self.card_auth: list[str | None] = []

    async def __call__(self, request: web.Request) -> web.StreamResponse:
        if request.path in ("/health", "/metrics"):
            return web.Response(text="")
        if request.path == "/v1/models":
            self.card_auth.append(request.headers.get("Authorization"))
            card = {"id": SERVED, "object": "model", "max_model_len": self.max_model_len}
            return web.json_response({"object": "list", "data": [card]})
        body = await request.json()
        self.seen.append((request.path, body))
        if self.status != 200:
            error = {"message": f"this replica has no {request.path}", "type": "NotFoundError"}
            return web.json_response(
                {"error": {**error, "param": None, "code": self.status}}, status=self.status
            )
        if body.get("stream"):
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            await response.write(ANTHROPIC_STREAM)
            await response.write_eof()
            return response
        usage = {"input_tokens": 30, "output_tokens": 25}
        return web.json_response({"path": request.path, "got": body, "usage": usage})


@contextlib.asynccontextmanager
async def fleet(
    *replicas: Replica, keys: Path | None = None, **settings: Any
) -> AsyncIterator[tuple[Router, str]]:
    """The router in front of `replicas` as model `m` (the engines call it `m-served`), and a
    model `other` with no replica."""
    async with contextlib.AsyncExitStack() as stack:
        urls = [await stack.enter_async_context(serve_upstream(r)) for r in replicas]
        router, url = await stack.enter_async_context(
            serve_router(
                RouterSettings(strategy="round-robin", scrape_interval=0.05, **settings),
                keys_file=keys,
            )
        )
        refs = tuple(ReplicaRef(u) for u in urls)
        router.apply_fleet(
            {
                "m": ModelRoute("m", refs, served_name=SERVED),
                "other": ModelRoute("other", ()),
            }
        )
        yield router, url


def _keys(tmp_path: Path) -> Path:
    path = tmp_path / "keys.yaml"
    path.write_text(KEYS)
    return path


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize("path", PATHS)
async def test_each_endpoint_reaches_the_models_replica_with_its_body(
    path: str, tmp_path: Path
) -> None:
    replica = Replica()
    body = {"model": "m", "input": "where is my parcel", "n": None, "extra": {"a": [1]}}
    async with (
        fleet(replica, keys=_keys(tmp_path)) as (_, url),
        httpx.AsyncClient(timeout=GUARD) as client,
    ):
        r = await client.post(url + path, json=body, headers=_auth("sk-all"))
        assert r.status_code == 200, r.text
        got = r.json()["got"]
        assert r.json()["path"] == path
        # The engines' name for the model; a salt for the tenant where the endpoint takes one.
        assert got.pop("model") == SERVED
        assert ("cache_salt" in got) == (path in SALTED)
        got.pop("cache_salt", None)
        assert got == {k: v for k, v in body.items() if k != "model"}

        # A salt the client chose is kept.
        r = await client.post(
            url + path, json={**body, "cache_salt": "mine"}, headers=_auth("sk-all")
        )
        assert r.json()["got"]["cache_salt"] == "mine"


@pytest.mark.parametrize("path", PATHS)
async def test_each_endpoint_checks_keys_scopes_the_model_and_the_body_limit(
    path: str, tmp_path: Path
) -> None:
    replica = Replica()
    async with (
        fleet(replica, keys=_keys(tmp_path), max_body_bytes=4096) as (_, url),
        httpx.AsyncClient(timeout=GUARD) as client,
    ):
        body = {"model": "m", "prompt": "x"}
        cases = [
            (await client.post(url + path, json=body), 401, None),
            (await client.post(url + path, json=body, headers=_auth("sk-wrong")), 401, None),
            # A model outside the key's scope is answered as one that does not exist.
            (await client.post(url + path, json=body, headers=_auth("sk-other")), 404, "model"),
            (
                await client.post(url + path, json={"prompt": "x"}, headers=_auth("sk-all")),
                400,
                "model",
            ),
            (
                await client.post(url + path, content=b"{not json", headers=_auth("sk-all")),
                400,
                None,
            ),
            (
                await client.post(
                    url + path, json={**body, "prompt": "x" * 5000}, headers=_auth("sk-all")
                ),
                413,
                None,
            ),
        ]
        for response, status, param in cases:
            assert response.status_code == status, (path, status, response.text)
            error = response.json()["error"]
            assert error["code"] == status and error["param"] == param
    assert replica.seen == []


@pytest.mark.parametrize("path", PATHS)
async def test_a_replica_that_cannot_serve_is_left_for_another(path: str) -> None:
    down, up = Replica(status=503), Replica()
    async with fleet(down, up) as (router, url), httpx.AsyncClient(timeout=GUARD) as client:
        r = await client.post(url + path, json={"model": "m", "input": "x"})
        assert r.status_code == 200 and r.json()["path"] == path
        assert [p for p, _ in down.seen + up.seen] == [path, path]
        model = router.models["m"]
        assert all(t.replica.in_flight == 0 for t in model.replicas.values())


@pytest.mark.parametrize("path", PATHS)
async def test_a_replica_without_the_endpoint_answers_with_its_own_envelope(path: str) -> None:
    """A builtin engine has no /v1/embeddings: its 404 reaches the client as it came, and
    the replica is not held against (the next request goes to it again)."""
    only = Replica(status=404)
    async with fleet(only) as (router, url), httpx.AsyncClient(timeout=GUARD) as client:
        for _ in range(2):
            r = await client.post(url + path, json={"model": "m", "input": "x"})
            assert r.status_code == 404
            assert r.json()["error"] == {
                "message": f"this replica has no {path}",
                "type": "NotFoundError",
                "param": None,
                "code": 404,
            }
        assert len(only.seen) == 2
        (pooled,) = router.models["m"].replicas.values()
        assert pooled.replica.failures == 0


async def test_an_anthropic_stream_is_relayed_and_its_usage_charged(tmp_path: Path) -> None:
    replica = Replica()
    async with (
        fleet(replica, keys=_keys(tmp_path)) as (_, url),
        httpx.AsyncClient(timeout=GUARD) as client,
    ):
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        r = await client.post(url + "/v1/messages", json=body, headers=_auth("sk-t"))
        assert r.status_code == 200 and r.content == ANTHROPIC_STREAM
        # 55 of the key's 100 tokens a minute: one more such answer passes, then it is spent.
        r = await client.post(
            url + "/v1/messages", json={**body, "stream": False}, headers=_auth("sk-t")
        )
        assert r.status_code == 200
        r = await client.post(
            url + "/v1/embeddings", json={"model": "m", "input": "x"}, headers=_auth("sk-t")
        )
        assert r.status_code == 429, r.text
        assert len(replica.seen) == 2


async def test_models_lists_the_context_length_its_replicas_serve(tmp_path: Path) -> None:
    short, long = Replica(max_model_len=1024), Replica(max_model_len=4096)
    async with (
        fleet(short, long, keys=_keys(tmp_path), upstream_api_key="sk-upstream") as (_, url),
        httpx.AsyncClient(timeout=GUARD) as client,
    ):

        async def cards() -> dict[str, Any]:
            r = await client.get(url + "/v1/models", headers=_auth("sk-all"))
            return {m["id"]: m["max_model_len"] for m in r.json()["data"]}

        async def both_read() -> bool:
            return (await cards())["m"] is not None and len(short.card_auth + long.card_auth) == 2

        await async_wait_until(both_read, "the replicas' cards read")
        # The shortest, so that a request within it fits any replica; none known: null.
        assert await cards() == {"m": 1024, "other": None}
        # The router reads a card with the key it sends that replica.
        assert short.card_auth == long.card_auth == ["Bearer sk-upstream"]
