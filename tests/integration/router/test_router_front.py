"""The router's front (`router.front`): plain proxied requests are read there, everything else
is handed to aiohttp with the connection, and a client sees one HTTP/1.1 server either way:
keep-alive, pipelining in order, chunked and large bodies, streams, and a shutdown that lets
requests in flight finish."""

from __future__ import annotations

import asyncio
import json
import re
import socket

import h11
import httpx
import pytest
from aiohttp import web
from router_testkit import async_wait_until, serve_router, serve_upstream

from fleetllm.router.config import RouterSettings
from fleetllm.router.discovery import StaticDiscovery, parse_static_fleet
from fleetllm.router.front import FAST_BODY_BYTES
from fleetllm.router.server import Router, RouterServer

pytestmark = pytest.mark.asyncio

GUARD = 30.0  # hang guard only
Answer = tuple[int, dict[str, str], bytes]


async def _echo(request: web.Request) -> web.StreamResponse:
    """A replica that answers with what it got: the body's length and prompt, or a stream of
    `max_tokens` events."""
    if request.path in ("/health", "/metrics"):
        return web.Response(text="")
    raw = await request.read()
    body = json.loads(raw)
    if not body.get("stream"):
        return web.json_response({"bytes": len(raw), "prompt": body.get("prompt")})
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for i in range(body.get("max_tokens", 1)):
        await response.write(b'data: {"choices":[{"index":0,"text":"t%d"}]}\n\n' % i)
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def _post(path: str, body: dict[str, object], *extra: bytes) -> bytes:
    data = json.dumps(body).encode()
    head = [b"POST " + path.encode() + b" HTTP/1.1", b"Host: router", *extra]
    head.append(b"Content-Length: %d" % len(data))
    return b"\r\n".join(head) + b"\r\n\r\n" + data


def _answers(data: bytes, count: int) -> list[Answer]:
    """The first `count` answers in `data`, read by a strict parser (h11)."""
    conn = h11.Connection(h11.CLIENT)
    conn.receive_data(data)
    answers: list[Answer] = []
    for _ in range(count):
        conn.send(h11.Request(method="POST", target="/", headers=[("Host", "x")]))
        conn.send(h11.EndOfMessage())
        status, headers, body = 0, {}, b""
        while True:
            event = conn.next_event()
            assert event is not h11.NEED_DATA, f"answer {len(answers)} is incomplete"
            if isinstance(event, h11.Response):
                status = event.status_code
                headers = {n.decode(): v.decode() for n, v in event.headers}
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                break
        answers.append((status, headers, body))
        if len(answers) < count:
            conn.start_next_cycle()
    return answers


async def _exchange(url: str, data: bytes) -> bytes:
    """Send `data` on one connection and read until the router closes it."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(data)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(), GUARD)
    finally:
        writer.close()


async def test_pipelined_requests_are_answered_in_order_on_one_connection() -> None:
    async with serve_upstream(_echo) as up, serve_router() as (router, url):
        router.apply_fleet(parse_static_fleet({"models": {"m": [up]}}))
        data = b"".join(
            [
                _post("/v1/completions", {"model": "m", "prompt": "one"}),
                _post("/v1/completions", {"model": "m", "prompt": "two", "stream": True}),
                _post("/v1/completions", {"model": "nope", "prompt": "three"}),
                b"GET /v1/models HTTP/1.1\r\nHost: router\r\n\r\n",
                # aiohttp's from here: a chunked body
                b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nTransfer-Encoding: chunked"
                b'\r\n\r\n5\r\n{"mod\r\n1b\r\nel": "m", "prompt": "four"}\r\n0\r\n\r\n',
                _post("/v1/completions", {"model": "m", "prompt": "five"}, b"Connection: close"),
            ]
        )
        answers = _answers(await _exchange(url, data), 6)
    assert [status for status, _, _ in answers] == [200, 200, 404, 200, 200, 200]
    # Which server read each: aiohttp names itself in `Server`, the front does not.
    assert [("server" in headers) for _, headers, _ in answers] == [False] * 4 + [True] * 2
    assert json.loads(answers[0][2])["prompt"] == "one"
    stream = answers[1]
    assert stream[1]["transfer-encoding"] == "chunked"
    assert stream[1]["content-type"] == "text/event-stream"
    assert stream[2] == b'data: {"choices":[{"index":0,"text":"t0"}]}\n\ndata: [DONE]\n\n'
    assert json.loads(answers[2][2])["error"]["code"] == 404
    assert answers[2][1]["x-request-id"]
    assert [m["id"] for m in json.loads(answers[3][2])["data"]] == ["m"]
    assert json.loads(answers[4][2])["prompt"] == "four"
    assert json.loads(answers[5][2])["prompt"] == "five"


async def test_a_body_too_big_for_the_front_is_read_by_aiohttp_within_the_limit() -> None:
    settings = RouterSettings(max_body_bytes=4 * FAST_BODY_BYTES)
    async with (
        serve_upstream(_echo) as up,
        serve_router(settings) as (router, url),
        httpx.AsyncClient(timeout=GUARD) as client,
    ):
        router.apply_fleet(parse_static_fleet({"models": {"m": [up]}}))
        prompt = "x" * (2 * FAST_BODY_BYTES)
        ok = await client.post(f"{url}/v1/completions", json={"model": "m", "prompt": prompt})
        assert ok.status_code == 200 and ok.json()["prompt"] == prompt
        huge = {"model": "m", "prompt": "x" * (4 * FAST_BODY_BYTES)}
        refused = await client.post(f"{url}/v1/completions", json=huge)
        assert refused.status_code == 413
        # Within the front's size but over a smaller limit: the same answer.
        small = RouterSettings(max_body_bytes=2048)
        async with serve_router(small) as (other, other_url):
            other.apply_fleet(parse_static_fleet({"models": {"m": [up]}}))
            body = {"model": "m", "prompt": "x" * 4096}
            assert (await client.post(f"{other_url}/v1/completions", json=body)).status_code == 413


async def test_a_stream_keeps_its_connection_and_a_head_split_across_reads_is_taken() -> None:
    async with serve_upstream(_echo) as up, serve_router() as (router, url):
        router.apply_fleet(parse_static_fleet({"models": {"m": [up]}}))
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        request = _post("/v1/completions", {"model": "m", "prompt": "p", "stream": True})
        for piece in (request[:7], request[7:40], request[40:-3], request[-3:]):
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.02)
        writer.write(_post("/v1/completions", {"model": "m", "prompt": "q"}, b"Connection: close"))
        data = await asyncio.wait_for(reader.read(), GUARD)
        writer.close()
    stream, plain = _answers(data, 2)
    assert stream[0] == 200 and stream[2].endswith(b"data: [DONE]\n\n")
    assert plain[0] == 200 and json.loads(plain[2])["prompt"] == "q"


async def test_shutdown_lets_a_stream_in_flight_finish_and_refuses_new_connections() -> None:
    release = asyncio.Event()

    async def slow(request: web.Request) -> web.StreamResponse:
        if request.path in ("/health", "/metrics"):
            return web.Response(text="")
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"choices":[{"index":0,"text":"a"}]}\n\n')
        await release.wait()
        await response.write(b'data: {"choices":[{"index":0,"text":"b"}]}\n\n')
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async with serve_upstream(slow) as up, httpx.AsyncClient(timeout=GUARD) as client:
        router = Router(RouterSettings(), StaticDiscovery(None))
        server = RouterServer(router, shutdown_timeout=GUARD)
        await server.start("127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.port}"
        router.apply_fleet(parse_static_fleet({"models": {"m": [up]}}))
        body = {"model": "m", "prompt": "p", "stream": True}
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            lines = response.aiter_lines()
            assert "text" in await anext(lines)
            stopping = asyncio.create_task(server.stop())
            await async_wait_until(lambda: _refused(url), "the router stops listening")
            assert not stopping.done()
            release.set()
            rest = [line async for line in lines if line]
        await asyncio.wait_for(stopping, GUARD)
    assert rest[-1] == "data: [DONE]" and '"b"' in rest[0]


def _refused(url: str) -> bool:
    host, port = url.removeprefix("http://").split(":")
    with socket.socket() as s:
        return s.connect_ex((host, int(port))) != 0


async def test_a_request_sent_a_byte_at_a_time_is_served_and_a_late_bare_lf_refused() -> None:
    async with serve_upstream(_echo) as up, serve_router() as (router, url):
        router.apply_fleet(parse_static_fleet({"models": {"m": [up]}}))
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        request = _post("/v1/completions", {"model": "m", "prompt": "drip"}, b"Connection: close")
        for i in range(len(request)):
            writer.write(request[i : i + 1])
            await writer.drain()
            await asyncio.sleep(0.001)
        ((status, _, body),) = _answers(await asyncio.wait_for(reader.read(), GUARD), 1)
        writer.close()
        assert status == 200 and json.loads(body)["prompt"] == "drip"
        # A bare LF after a plain start: refused at once, not left to the header timeout.
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: router\r\n")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"X-Bare: lf\n")
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), GUARD)
        writer.close()
        assert re.match(rb"HTTP/1\.[01] 400 ", answer)


async def test_the_routers_own_gets_are_read_by_the_front_and_other_methods_by_aiohttp() -> None:
    async with serve_upstream(_echo) as up, serve_router() as (router, url):
        router.apply_fleet(parse_static_fleet({"models": {"m": [up]}}))
        plain = b"GET /health?probe=1 HTTP/1.1\r\nHost: router\r\n\r\n"
        metrics = b"GET /metrics HTTP/1.1\r\nHost: router\r\n\r\n"
        answers = _answers(
            await _exchange(
                url,
                plain
                + metrics
                + _post("/v1/completions", {"model": "m", "prompt": "x"}, b"Connection: close"),
            ),
            3,
        )
        assert [a[0] for a in answers] == [200, 200, 200]
        assert json.loads(answers[0][2]) == {"status": "ok"}
        assert b"fleetllm:router_requests_total" in answers[1][2]
        assert answers[1][1]["content-type"].startswith("text/plain")
        assert not any("server" in headers for _, headers, _ in answers)
        # A GET with a body, and a HEAD: aiohttp's, answered by its rules.
        odd = b"GET /v1/models HTTP/1.1\r\nHost: router\r\nContent-Length: 2\r\n\r\n{}"
        head = b"HEAD /health HTTP/1.1\r\nHost: router\r\nConnection: close\r\n\r\n"
        data = await _exchange(url, odd + head)
        models, rest = data.split(b"\r\n\r\n", 1)
        assert models.startswith(b"HTTP/1.1 200 ") and b"Server: " in models
        assert b"HTTP/1.1 200 " in rest
