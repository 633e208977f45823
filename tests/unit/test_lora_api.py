"""The one client of the engines' LoRA adapter API (fleetllm/lora_api.py), against a scripted
engine: what each answer means (loaded, already loaded, refused with the engine's reason, a
replica that serves no load API, one that is busy), idempotent unloads, and what an engine
sends back bounded and cleaned before it reaches a status, a log or a client."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st

from fleetllm.lora_api import (
    MESSAGE_MAX_CHARS,
    AdapterError,
    list_adapters,
    load_adapter,
    parse_adapters,
    unload_adapter,
)


class Engine:
    """Answers loads with `load_answer` (status, body); lists `held`."""

    def __init__(self) -> None:
        self.load_answer: tuple[int, Any] = (200, "Success")
        self.held: dict[str, str] = {}
        self.asked: list[dict[str, Any]] = []

    async def models(self, _: web.Request) -> web.Response:
        cards = [{"id": "base", "parent": None}]
        cards += [{"id": n, "parent": "base", "root": p} for n, p in self.held.items()]
        return web.json_response({"object": "list", "data": cards})

    async def load(self, request: web.Request) -> web.Response:
        self.asked.append(await request.json())
        status, body = self.load_answer
        if isinstance(body, str):
            return web.Response(status=status, text=body)
        return web.json_response(body, status=status)

    async def unload(self, request: web.Request) -> web.Response:
        name = (await request.json())["lora_name"]
        if self.held.pop(name, None) is None:
            return web.json_response({"error": {"message": "cannot be found"}}, status=404)
        return web.Response(text="Success")


@pytest_asyncio.fixture
async def engine() -> AsyncIterator[tuple[Engine, str]]:
    fake = Engine()
    app = web.Application()
    app.router.add_get("/v1/models", fake.models)
    app.router.add_post("/v1/load_lora_adapter", fake.load)
    app.router.add_post("/v1/unload_lora_adapter", fake.unload)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield fake, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def _envelope(message: str, code: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": "BadRequestError", "param": None, "code": code}}


async def _load_error(url: str) -> AdapterError:
    async with aiohttp.ClientSession() as session:
        with pytest.raises(AdapterError) as caught:
            await load_adapter(session, url, "sql", "/a/sql")
    return caught.value


@pytest.mark.asyncio
async def test_answers_mean_loaded_refused_or_not_the_adapters_business(
    engine: tuple[Engine, str],
) -> None:
    fake, url = engine
    async with aiohttp.ClientSession() as session:
        await load_adapter(session, url, "sql", "/a/sql", headers={"Authorization": "Bearer k"})
    assert fake.asked == [{"lora_name": "sql", "lora_path": "/a/sql"}]

    # Loaded already (by another loader): done, since the listing says so.
    fake.held["sql"] = "/a/sql"
    fake.load_answer = (400, _envelope("The lora adapter 'sql' has already been loaded.", 400))
    async with aiohttp.ClientSession() as session:
        await load_adapter(session, url, "sql", "/a/sql")
    fake.held.clear()

    cases = [
        # (the engine's answer, transient: says nothing of the adapter)
        ((400, _envelope("rank 64 is greater than max_lora_rank 16", 400)), False),
        ((404, _envelope("No adapter found for /a/sql", 404)), False),
        ((500, _envelope("size mismatch for lora_A", 500)), False),
        ((404, {"detail": "Not Found"}), True),  # no load API on this replica
        ((503, _envelope("overloaded", 503)), True),
    ]
    for answer, transient in cases:
        fake.load_answer = answer
        error = await _load_error(url)
        assert error.status == answer[0] and error.transient is transient, answer
        if isinstance(answer[1], dict) and "error" in answer[1]:
            assert error.message == answer[1]["error"]["message"]
    error = await _load_error("http://127.0.0.1:9")  # nothing listens there
    assert error.status is None and error.transient


@pytest.mark.asyncio
async def test_what_an_engine_says_is_cleaned_and_bounded(engine: tuple[Engine, str]) -> None:
    fake, url = engine
    fake.load_answer = (400, _envelope("bad\x1b[31m rank\n" + "x" * 5000, 400))
    error = await _load_error(url)
    assert error.message.isprintable() and len(error.message) == MESSAGE_MAX_CHARS
    assert error.message.startswith("bad [31m rank")
    fake.load_answer = (500, "Internal Server Error")
    assert (await _load_error(url)).message == "Internal Server Error"
    fake.load_answer = (413, "")
    assert (await _load_error(url)).message == "HTTP 413"
    fake.load_answer = (400, "y" * (1 << 20))  # over the cap: a replica that misbehaves
    assert (await _load_error(url)).transient


@pytest.mark.asyncio
async def test_listing_and_unloading(engine: tuple[Engine, str]) -> None:
    fake, url = engine
    fake.held = {"sql": "/a/sql", "chat": "/a/chat"}
    async with aiohttp.ClientSession() as session:
        assert await list_adapters(session, url) == {"sql": "base", "chat": "base"}
        await unload_adapter(session, url, "sql")
        await unload_adapter(session, url, "sql")  # not loaded: done too
        assert await list_adapters(session, url) == {"chat": "base"}


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=20,
)


@given(
    doc=JSON
    | st.fixed_dictionaries(
        {"data": st.lists(st.fixed_dictionaries({"id": JSON, "parent": JSON}), max_size=4)}
    )
)
def test_any_listing_gives_adapters_or_says_it_is_none(doc: Any) -> None:
    try:
        found = parse_adapters(json.dumps(doc).encode())
    except ValueError:
        assert not (isinstance(doc, dict) and isinstance(doc.get("data"), list))
        return
    assert all(isinstance(k, str) and k and isinstance(v, str) and v for k, v in found.items())
