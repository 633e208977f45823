"""Fuzzing the router: nothing a client sends gets a 5xx from the router or harms it.

The router runs in this process on a thread of its own, in front of a stub replica that
answers every request like an engine would a valid one (so that any 5xx is the router's own).
Two generators, both seeded and bounded: schemathesis derives requests for every route from
the router's own /openapi.json (valid ones and ones that break the schema), and hypothesis
builds hostile bodies and headers for the proxied endpoints. Afterwards the router must be
healthy, hold nothing, have nothing in flight, and answer a normal request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from aiohttp import web
from fuzzing import fuzz_settings
from hypothesis import given, settings
from hypothesis import strategies as st
from router_testkit import serve_router, serve_upstream
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from fleetllm.router.config import RouterSettings
from fleetllm.router.discovery import parse_static_fleet
from fleetllm.router.openapi import openapi_schema
from fleetllm.router.server import Router

ADMIN_KEY = "fuzz-admin"
MODEL = "m"
FUZZ_SETTINGS = fuzz_settings(max_examples=30)
ROUTER_SETTINGS = RouterSettings(
    max_body_bytes=64 * 1024,
    hold_timeout=0.2,
    request_timeout=20.0,
    client_body_timeout=5.0,
    scrape_interval=0.5,
)


async def _stub_replica(request: web.Request) -> web.StreamResponse:
    """A replica that takes every request as valid and answers it like an engine."""
    if request.path in ("/health", "/metrics"):
        return web.Response(text="")
    body = json.loads(await request.read())
    usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    if body.get("stream") is not True:
        return web.json_response({"object": "text_completion", "choices": [], "usage": usage})
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(b'data: {"choices":[{"index":0,"delta":{"role":"assistant"}}]}\n\n')
    await response.write(b'data: {"choices":[{"index":0,"text":"x","finish_reason":"length"}]}\n\n')
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


class BackgroundRouter:
    """The router and its stub replica on an event loop in a thread, so that blocking clients
    (schemathesis, hypothesis) can call it from the test's thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.stack = contextlib.AsyncExitStack()
        self.router: Router
        self.url = self.replica_url = ""

    async def _start(self) -> None:
        self.replica_url = await self.stack.enter_async_context(serve_upstream(_stub_replica))
        self.router, self.url = await self.stack.enter_async_context(
            serve_router(ROUTER_SETTINGS, admin_key=ADMIN_KEY)
        )
        self.reset_fleet()

    def reset_fleet(self) -> None:
        """The fleet of one model on the stub (a fuzzed PUT /admin/fleet may replace it)."""
        self.router.apply_fleet(parse_static_fleet({"models": {MODEL: [self.replica_url]}}))

    def call(self, fn: Any) -> Any:
        """Run `fn()` on the router's loop and return its result."""

        async def run() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(30)

    def __enter__(self) -> BackgroundRouter:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(60)
        return self

    def __exit__(self, *_: object) -> None:
        asyncio.run_coroutine_threadsafe(self.stack.aclose(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()


@pytest.fixture(scope="module")
def fuzz_router() -> Iterator[BackgroundRouter]:
    with BackgroundRouter() as background:
        yield background


def assert_sound(background: BackgroundRouter) -> None:
    """Healthy, holding nothing, nothing in flight, and answering a normal request."""
    background.call(background.reset_fleet)
    assert httpx.get(f"{background.url}/health", timeout=10).status_code == 200
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
    response = httpx.post(f"{background.url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 200 and response.json()["usage"]["total_tokens"] == 2

    def state() -> tuple[int, int, int]:
        model = background.router.models[MODEL]
        replica = model.replicas[background.replica_url].replica
        return len(model.hold), replica.in_flight, len(background.router.access.open)

    assert background.call(state) == (0, 0, 0)
    metrics = httpx.get(f"{background.url}/metrics", timeout=10).text
    assert 'code="500"' not in metrics and 'code="502"' not in metrics


def _assert_error_envelope(response: Any) -> None:
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["code"] == response.status_code and error["message"]


# -- schemathesis, from the router's OpenAPI document ------------------------------------------


# The document the router serves (a test below checks that it serves this one).
schema = schemathesis.openapi.from_dict(openapi_schema(admin=True))


def test_the_router_serves_its_openapi_document(fuzz_router: BackgroundRouter) -> None:
    served = httpx.get(f"{fuzz_router.url}/openapi.json", timeout=10).json()
    assert served == openapi_schema(admin=True)
    # Every route of the application is in the document, and nothing else.
    routes = {
        (route.method.lower(), route.resource.canonical)
        for route in fuzz_router.router.app().router.routes()
        if route.resource is not None and route.method not in ("HEAD", "*")
    }
    documented = {(method, path) for path, ops in served["paths"].items() for method in ops}
    assert routes == documented


@schema.parametrize()
@FUZZ_SETTINGS
def test_openapi_routes_never_answer_5xx(case: schemathesis.Case, fuzz_router: Any) -> None:
    # Generated model names hardly ever name the one model: send half of the valid-looking
    # bodies to it, so that they reach the routing and relaying code too.
    body = case.body
    if isinstance(body, dict) and isinstance(body.get("model"), str) and len(body["model"]) % 2:
        body["model"] = MODEL
    try:
        response = case.call_and_validate(
            base_url=fuzz_router.url,
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
            checks=[
                not_a_server_error,
                status_code_conformance,
                content_type_conformance,
                response_schema_conformance,
            ],
            timeout=30,
        )
        _assert_error_envelope(response)
    finally:
        fuzz_router.call(fuzz_router.reset_fleet)


def test_sound_after_openapi_fuzzing(fuzz_router: BackgroundRouter) -> None:
    assert_sound(fuzz_router)


# -- hypothesis: hostile bodies and headers for the proxied endpoints ---------------------------

huge_int = st.integers(min_value=-(2**70), max_value=2**70)
json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    huge_int,
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
)
json_value = st.recursive(
    json_leaf,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
model_name = st.one_of(st.just(MODEL), st.just(MODEL), json_value, st.text(max_size=300))
message = st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["user", "system"]), json_value)},
    optional={"content": st.one_of(st.text(max_size=30), json_value)},
)
fields = {
    "prompt": st.one_of(
        st.text(max_size=50), st.lists(huge_int, max_size=5), st.lists(json_value, max_size=3)
    ),
    "messages": st.one_of(st.lists(message, max_size=3), json_value),
    "stream": st.one_of(st.booleans(), json_value),
    "max_tokens": st.one_of(huge_int, json_value),
    "stream_options": json_value,
}
objects = st.fixed_dictionaries({"model": model_name}, optional=fields)
# Shallow, and past the parser's recursion limit (which hypothesis raises while it runs).
nested = st.one_of(st.integers(1, 50), st.integers(900, 30_000)).map(
    lambda depth: b'{"model": "m", "messages": ' + b"[" * depth + b"]" * depth + b"}"
)
bodies = st.one_of(
    objects.map(lambda body: json.dumps(body).encode()),  # NaN and Infinity literals too
    objects.map(lambda body: json.dumps(body).encode()),
    nested,
    st.binary(max_size=64),
    st.text(max_size=64).map(str.encode),
)
header_text = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=200).map(
    str.strip  # what a client library will send
)
headers = st.fixed_dictionaries(
    {},
    optional={
        "Authorization": header_text,
        "X-Request-Id": header_text,
        "Content-Type": st.sampled_from(["application/json", "text/plain", "x/y; charset=zz"]),
        "x-session-id": header_text,
    },
)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_hostile_bodies_and_headers_never_answer_5xx(
    fuzz_router: BackgroundRouter, path: str
) -> None:
    with httpx.Client(timeout=30) as client:

        @given(body=bodies, extra=headers)
        @settings(FUZZ_SETTINGS, max_examples=150)
        def run(body: bytes, extra: dict[str, str]) -> None:
            response = client.post(f"{fuzz_router.url}{path}", content=body, headers=extra)
            assert response.status_code < 500, response.text
            _assert_error_envelope(response)
            if response.headers["content-type"].startswith("text/event-stream"):
                assert response.text.endswith("data: [DONE]\n\n")

        run()
    assert_sound(fuzz_router)


# -- hypothesis: raw HTTP/1.1, for the front and for aiohttp behind it ------------------------

header_bytes = header_text.map(str.encode)
plain_post = st.sampled_from(
    [b"POST /v1/completions HTTP/1.1", b"POST /v1/chat/completions HTTP/1.1"]
)
raw_request_line = st.one_of(
    plain_post,
    plain_post,
    st.sampled_from(
        [
            b"POST /v1/completions?a=b HTTP/1.1",
            b"POST /v1/completions HTTP/1.0",
            b"GET /v1/models HTTP/1.1",
            b"GET /health HTTP/1.1",
            b"POST /v1/models HTTP/1.1",
        ]
    ),
    st.binary(max_size=40),
)
raw_header = st.one_of(
    st.sampled_from(
        [
            b"Content-Type: application/json",
            b"Host: other",
            b"Transfer-Encoding: chunked",
            b"Expect: 100-continue",
            b"Connection: close",
            b"Connection: upgrade",
            b"Upgrade: websocket",
            b"Content-Length: 0",
            b"Content-Length: 99999999999",
            b" folded",
        ]
    ),
    st.builds(lambda n, v: n + b": " + v, st.from_regex(rb"\A[A-Za-z-]{1,10}\Z"), header_bytes),
    st.builds(
        lambda n, v: n + b": " + v, st.binary(min_size=1, max_size=8), st.binary(max_size=20)
    ),
)


@st.composite
def raw_requests(draw: st.DrawFn) -> bytes:
    body = draw(st.one_of(bodies, st.just(json.dumps({"model": MODEL, "stream": True}).encode())))
    host = [b"Host: router"] if draw(st.sampled_from([True, True, True, False])) else []
    lines = [draw(raw_request_line), *host, *draw(st.lists(raw_header, max_size=3))]
    length = draw(st.sampled_from([len(body), len(body), max(0, len(body) - 3), None]))
    if length is not None:
        lines.append(b"Content-Length: %d" % length)
    ending = draw(st.sampled_from([b"\r\n"] * 5 + [b"\n"]))
    return ending.join(lines) + ending + ending + body


def _read_for(sock: socket.socket, quiet_s: float) -> bytes:
    """What the router sends until it closes or goes quiet for `quiet_s`."""
    sock.settimeout(quiet_s)
    data = b""
    with contextlib.suppress(TimeoutError, ConnectionError):
        while chunk := sock.recv(65536):
            data += chunk
    return data


def test_raw_http_never_gets_a_5xx_or_harms_the_router(fuzz_router: BackgroundRouter) -> None:
    host, port = fuzz_router.url.removeprefix("http://").split(":")

    @given(st.lists(raw_requests(), min_size=1, max_size=3), st.integers(0, 2))
    @settings(FUZZ_SETTINGS, max_examples=120)
    def run(requests: list[bytes], split: int) -> None:
        data = b"".join(requests)
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            cut = len(data) * split // 3
            sock.sendall(data[:cut])
            sock.sendall(data[cut:])
            answer = _read_for(sock, 0.3)
        statuses = [int(s) for s in re.findall(rb"HTTP/1\.[01] (\d{3}) ", answer)]
        assert all(status < 500 for status in statuses), answer[:300]

    run()
    assert_sound(fuzz_router)
