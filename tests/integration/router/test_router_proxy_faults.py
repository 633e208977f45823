"""The proxy's failure behaviour, against scripted replicas that fail on cue: failover only
before the first byte, stream errors after it, timeouts, bad input, holding, keys, admin."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web
from router_testkit import (
    async_wait_until,
    metric_sum,
    serve_router,
    serve_upstream,
)

from fleetllm.router.config import RouterSettings
from fleetllm.router.discovery import StaticDiscovery, parse_static_fleet
from fleetllm.router.server import Router

pytestmark = pytest.mark.asyncio

EVENTS = [b'data: {"choices":[{"text":"%d"}]}\n\n' % i for i in range(3)]
DONE = b"data: [DONE]\n\n"
FAST = RouterSettings(
    strategy="round-robin", backoff_base=0.05, backoff_max=0.2, scrape_interval=0.05
)


class Upstream:
    """One scripted replica; `seen` records the requests it got."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.seen: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.aborted = asyncio.Event()

    async def __call__(self, request: web.Request) -> web.StreamResponse:
        if request.path == "/health":
            return web.Response(status=503 if self.kind == "unhealthy" else 200)
        if request.path == "/metrics":
            return web.Response(text="vllm:num_requests_waiting 0\n")
        body = await request.json()
        self.seen.append(body)
        self.headers.append({k.lower(): v for k, v in request.headers.items()})
        if self.kind == "hangup":
            assert request.transport is not None
            request.transport.close()
            return web.Response()
        if self.kind == "503":
            return web.json_response({"error": {"message": "overloaded", "code": 503}}, status=503)
        if self.kind == "400":
            return web.json_response({"error": {"message": "bad", "code": 400}}, status=400)
        if self.kind == "stall":
            await asyncio.sleep(60)
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": "012"}], "usage": {"total_tokens": 50}})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        if self.kind == "die-before-first":
            assert request.transport is not None
            request.transport.close()
            return response
        if self.kind == "endless":
            try:
                while True:
                    await response.write(EVENTS[0])
                    await asyncio.sleep(0.02)
            except (asyncio.CancelledError, ConnectionResetError):
                self.aborted.set()
                raise
        # Events cut at awkward places, as TCP may deliver them.
        data = b"".join(EVENTS) + DONE
        if self.kind == "cut":
            await response.write(EVENTS[0] + EVENTS[1] + b'data: {"choi')
            await asyncio.sleep(0.05)
            assert request.transport is not None
            request.transport.close()
            return response
        for i in range(0, len(data), 7):
            await response.write(data[i : i + 7])
        await response.write_eof()
        return response


def fleet(models: dict[str, list[str]]) -> Any:
    return parse_static_fleet({"models": models})


async def _post(url: str, body: Any, **kwargs: Any) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as client:
        return await client.post(url, json=body, **kwargs)


def _sse_events(text: str) -> list[str]:
    return [line[6:] for line in text.split("\n\n") if line.startswith("data: ")]


@contextlib.asynccontextmanager
async def in_order(
    *upstreams: Upstream, settings: RouterSettings = FAST
) -> AsyncIterator[tuple[Router, str, list[str]]]:
    """Model "m" on these replicas behind a router whose next request tries them in this
    order: the router, its URL and the replicas' URLs."""
    async with contextlib.AsyncExitStack() as stack:
        urls = [await stack.enter_async_context(serve_upstream(u)) for u in upstreams]
        router, url = await stack.enter_async_context(serve_router(settings))
        router.apply_fleet(fleet({"m": urls}))
        router.models["m"].turn = 0
        yield router, url, urls


async def test_failover_past_a_dropped_connection_and_a_503() -> None:
    hangup, busy, good = Upstream("hangup"), Upstream("503"), Upstream("ok")
    async with in_order(hangup, busy, good) as (router, url, _):
        for stream in (False, True):
            # Round robin starts each request one replica further, and failures pause a
            # replica: start each request at the first one, with no pauses, so that both
            # failures come first.
            router.models["m"].turn = 0
            for tracked in router.models["m"].replicas.values():
                tracked.replica.down_until = 0.0
            r = await _post(
                f"{url}/v1/completions", {"model": "m", "prompt": "x", "stream": stream}
            )
            assert r.status_code == 200
            if stream:
                assert _sse_events(r.text) == [e[6:-2].decode() for e in EVENTS] + ["[DONE]"]
            else:
                assert r.json()["choices"][0]["text"] == "012"
        assert (len(hangup.seen), len(busy.seen), len(good.seen)) == (2, 2, 2)
        metrics = router.metrics.render().decode()
        assert metric_sum(metrics, "fleetllm:router_upstream_retries_total", model="m") == 4
        assert metric_sum(metrics, "fleetllm:router_upstream_requests_total", code="503") == 2
        assert metric_sum(metrics, "fleetllm:router_upstream_requests_total", code="error") == 2


async def test_when_every_attempt_fails_the_last_answer_is_passed_on() -> None:
    busy = Upstream("503")
    async with serve_upstream(busy) as busy_url, serve_router(FAST) as (router, url):
        router.apply_fleet(fleet({"m": [busy_url]}))
        r = await _post(f"{url}/v1/completions", {"model": "m", "prompt": "x"})
        assert r.status_code == 503
        assert r.json()["error"]["message"] == "overloaded"


async def test_client_errors_are_answers_not_retried() -> None:
    bad, good = Upstream("400"), Upstream("ok")
    async with in_order(bad, good) as (_, url, _):
        r = await _post(f"{url}/v1/completions", {"model": "m", "prompt": "x"})
        assert r.status_code == 400 and len(good.seen) == 0


async def test_a_stream_cut_mid_event_ends_with_an_error_event_and_is_not_retried() -> None:
    cut, good = Upstream("cut"), Upstream("ok")
    async with in_order(cut, good) as (_, url, _):
        r = await _post(f"{url}/v1/completions", {"model": "m", "prompt": "x", "stream": True})
        assert r.status_code == 200
        events = _sse_events(r.text)
        # The two whole events, not the half one, then the error event and [DONE].
        assert events[:2] == [EVENTS[0][6:-2].decode(), EVENTS[1][6:-2].decode()]
        assert json.loads(events[2])["error"]["code"] == 502
        assert events[3:] == ["[DONE]"]
        assert r.text.endswith("data: [DONE]\n\n")
        assert len(good.seen) == 0


async def test_a_stream_that_dies_before_its_first_event_moves_to_another_replica() -> None:
    dying, good = Upstream("die-before-first"), Upstream("ok")
    async with in_order(dying, good) as (_, url, _):
        r = await _post(f"{url}/v1/completions", {"model": "m", "prompt": "x", "stream": True})
        assert r.status_code == 200
        assert _sse_events(r.text)[-1] == "[DONE]" and "error" not in r.text
        assert len(dying.seen) == 1 and len(good.seen) == 1


async def test_first_byte_timeout_moves_a_stream_on() -> None:
    stalled, good = Upstream("stall"), Upstream("ok")
    settings = RouterSettings(strategy="round-robin", first_byte_timeout=0.3)
    async with in_order(stalled, good, settings=settings) as (router, url, [stalled_url, _]):
        r = await _post(f"{url}/v1/completions", {"model": "m", "prompt": "x", "stream": True})
        assert r.status_code == 200 and len(good.seen) == 1
        router.apply_fleet(fleet({"m": [stalled_url]}))
        r = await _post(f"{url}/v1/completions", {"model": "m", "prompt": "x", "stream": True})
        assert r.status_code == 504 and r.json()["error"]["code"] == 504


async def test_a_request_cut_by_the_first_byte_timeout_is_told_what_avoids_it() -> None:
    # Its answer comes whole when the generation ends, so a long one meets the timeout.
    stalled = Upstream("stall")
    settings = RouterSettings(strategy="round-robin", first_byte_timeout=0.3, retry_window=0)
    async with in_order(stalled, settings=settings) as (_, url, _):
        r = await _post(f"{url}/v1/completions", {"model": "m", "prompt": "x"})
        assert r.status_code == 504
        message = r.json()["error"]["message"]
        assert "first-byte timeout (0.3 s)" in message
        assert all(hint in message for hint in ("stream it", "max_tokens", "--first-byte-timeout"))
        r = await _post(f"{url}/v1/completions", {"model": "m", "prompt": "x", "stream": True})
        assert r.status_code == 504
        assert "max_tokens" not in r.json()["error"]["message"]


async def test_a_client_that_goes_away_mid_stream_aborts_the_upstream_request() -> None:
    endless = Upstream("endless")
    async with serve_upstream(endless) as up_url, serve_router(FAST) as (router, url):
        router.apply_fleet(fleet({"m": [up_url]}))
        async with (
            httpx.AsyncClient(timeout=30) as client,
            client.stream(
                "POST", f"{url}/v1/completions", json={"model": "m", "prompt": "x", "stream": True}
            ) as r,
        ):
            async for _ in r.aiter_bytes():
                break
        await asyncio.wait_for(endless.aborted.wait(), 30)
        replica = router.models["m"].replicas[up_url].replica
        await async_wait_until(lambda: replica.in_flight == 0, "in-flight count released")


BAD_REQUESTS: list[tuple[str, str, Any, int]] = [
    ("POST", "/v1/completions", b"{not json", 400),
    ("POST", "/v1/completions", b"\xff\xfe", 400),
    ("POST", "/v1/completions", b"[1, 2]", 400),
    ("POST", "/v1/completions", b'"text"', 400),
    ("POST", "/v1/completions", b"{}", 400),
    ("POST", "/v1/completions", b'{"model": 5}', 400),
    ("POST", "/v1/completions", b'{"model": ""}', 400),
    ("POST", "/v1/chat/completions", b'{"model": ["m"]}', 400),
    ("POST", "/v1/completions", b'{"model": "unknown"}', 404),
    ("POST", "/v1/completions", b"", 400),
    ("GET", "/v1/completions", None, 405),
    ("DELETE", "/v1/models", None, 405),
    ("GET", "/v1/nothing", None, 404),
    ("POST", "/admin/fleet", b"{}", 404),
    ("POST", "/v1/completions", b'{"model": "m", "prompt": "' + b"x" * 70_000 + b'"}', 413),
]


@pytest.mark.parametrize(("method", "path", "body", "status"), BAD_REQUESTS)
async def test_bad_requests_get_openai_shaped_errors(
    method: str, path: str, body: bytes | None, status: int
) -> None:
    good = Upstream("ok")
    settings = RouterSettings(max_body_bytes=64 * 1024)
    async with serve_upstream(good) as good_url, serve_router(settings) as (router, url):
        router.apply_fleet(fleet({"m": [good_url]}))
        async with httpx.AsyncClient(timeout=30) as client:
            r = await client.request(method, f"{url}{path}", content=body)
            assert r.status_code == status, r.text
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["code"] == status and error["message"]
            assert (await client.get(f"{url}/health")).status_code == 200
        assert good.seen == []


async def test_held_requests_time_out_with_retry_after_and_overflow_is_refused() -> None:
    asked: list[str] = []
    settings = RouterSettings(hold_queue_size=2, hold_timeout=0.5)
    discovery = StaticDiscovery(None, on_demand=asked.append)
    async with serve_router(settings, discovery) as (router, url):
        router.apply_fleet(fleet({"cold": []}))
        body = {"model": "cold", "prompt": "x"}
        results = await asyncio.gather(*(_post(f"{url}/v1/completions", body) for _ in range(3)))
        statuses = sorted(r.status_code for r in results)
        assert statuses == [503, 503, 503]
        assert all(r.headers["Retry-After"] == "5" for r in results)
        messages = sorted(r.json()["error"]["message"] for r in results)
        assert "is full" in messages[0] and "timed out" in messages[2]
        assert asked == ["cold"]
        metrics = router.metrics.render().decode()
        assert metric_sum(metrics, "fleetllm:router_queue_time_seconds_count", model="cold") == 3
        assert metric_sum(metrics, "fleetllm:router_demand_signals_total", model="cold") == 1


async def test_draining_and_unhealthy_replicas_get_no_new_requests() -> None:
    draining, sick, good = Upstream("ok"), Upstream("unhealthy"), Upstream("ok")
    async with in_order(draining, sick, good) as (router, url, [d_url, s_url, g_url]):
        router.apply_fleet(
            parse_static_fleet({"models": {"m": [{"url": d_url, "draining": True}, s_url, g_url]}})
        )
        sick_replica = router.models["m"].replicas[s_url].replica
        await async_wait_until(lambda: sick_replica.healthy is False, "sick replica seen")
        for _ in range(6):
            r = await _post(f"{url}/v1/completions", {"model": "m", "prompt": "x"})
            assert r.status_code == 200
        assert (len(draining.seen), len(sick.seen), len(good.seen)) == (0, 0, 6)
        metrics = router.metrics.render().decode()
        assert metric_sum(metrics, "fleetllm:router_replica_up", replica=g_url) == 1
        assert metric_sum(metrics, "fleetllm:router_replica_up", replica=d_url) == 0
        assert metric_sum(metrics, "fleetllm:router_replica_up", replica=s_url) == 0


async def test_token_rate_limit_counts_the_usage_of_answers(tmp_path: Path) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text("keys:\n  - {name: small, key: sk-small, tokensPerMinute: 40}\n")
    good = Upstream("ok")
    async with serve_upstream(good) as good_url, serve_router(FAST, keys_file=keys) as (r_, url):
        r_.apply_fleet(fleet({"m": [good_url]}))
        auth = {"Authorization": "Bearer sk-small"}
        body = {"model": "m", "prompt": "x"}
        first = await _post(f"{url}/v1/completions", body, headers=auth)
        assert first.status_code == 200  # its usage says 50 tokens: over the 40 a minute
        second = await _post(f"{url}/v1/completions", body, headers=auth)
        assert second.status_code == 429
        assert second.json()["error"]["type"] == "RateLimitError"
        assert int(second.headers["Retry-After"]) >= 1
        assert len(good.seen) == 1


async def test_request_ids_are_passed_to_the_replica_and_back() -> None:
    good = Upstream("ok")
    async with serve_upstream(good) as good_url, serve_router(FAST) as (router, url):
        router.apply_fleet(fleet({"m": [good_url]}))
        r = await _post(
            f"{url}/v1/completions", {"model": "m", "prompt": "x"}, headers={"X-Request-Id": "abc"}
        )
        assert r.headers["X-Request-Id"] == "abc"
        assert good.headers[0]["x-request-id"] == "abc"
        r = await _post(f"{url}/v1/completions", {"model": "m", "prompt": "x"})
        assert len(r.headers["X-Request-Id"]) == 32


async def test_admin_endpoint_replaces_the_fleet_with_the_admin_key_only() -> None:
    good = Upstream("ok")
    async with (
        serve_upstream(good) as good_url,
        serve_router(FAST, admin_key="admin-secret") as (_router, url),
        httpx.AsyncClient(timeout=30) as client,
    ):
        doc = {"models": {"m": [good_url]}}
        assert (await client.put(f"{url}/admin/fleet", json=doc)).status_code == 401
        wrong = {"Authorization": "Bearer nope"}
        assert (await client.put(f"{url}/admin/fleet", json=doc, headers=wrong)).status_code == 401
        admin = {"Authorization": "Bearer admin-secret"}
        bad = await client.put(f"{url}/admin/fleet", json={"models": {"m": ["x"]}}, headers=admin)
        assert bad.status_code == 400 and "not an http" in bad.json()["error"]["message"]
        ok = await client.put(f"{url}/admin/fleet", json=doc, headers=admin)
        assert ok.status_code == 200
        models = (await client.get(f"{url}/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["m"]
        state = (await client.get(f"{url}/admin/fleet", headers=admin)).json()
        assert state["models"]["m"]["replicas"][0]["url"] == good_url
        r = await client.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x"})
        assert r.status_code == 200
