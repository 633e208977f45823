"""A replica that attacks whoever reads it: `python hostile_engine.py PORT MODE`, on loopback.

Modes (each healthy on /health, so that the router sends it traffic):
- `metrics`: a 400 MiB /metrics, streamed in 1 MiB chunks;
- `answer`: a 300 MiB non-streamed answer;
- `event`: a stream whose first event is 100 MiB with no blank line;
- `late-event`: a stream with one token, then a 100 MiB event with no blank line;
- `hang`: answers nothing to a completion, ever;
- `dribble`: sends a non-streamed answer's headers, then its body a byte every 0.1 s, forever.
Every other path and mode answers like a tiny engine.
"""

from __future__ import annotations

import asyncio
import sys

from aiohttp import web

MiB = 1 << 20
FILLER = b"x" * MiB
TOKEN = b'data: {"choices":[{"index":0,"text":"hi","finish_reason":null}]}\n\n'


async def _stream_filler(request: web.Request, mib: int, content_type: str) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": content_type})
    await response.prepare(request)
    try:
        for _ in range(mib):
            await response.write(FILLER)
    except (ConnectionResetError, ConnectionError):
        pass  # the reader gave up, as it should
    return response


def app(mode: str) -> web.Application:
    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def metrics(request: web.Request) -> web.StreamResponse:
        if mode == "metrics":
            return await _stream_filler(request, 400, "text/plain")
        return web.Response(text="vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n")

    async def completions(request: web.Request) -> web.StreamResponse:
        await request.read()
        if mode == "answer":
            return await _stream_filler(request, 300, "application/json")
        if mode == "hang":
            await asyncio.Event().wait()
        if mode == "dribble":
            response = web.StreamResponse(headers={"Content-Type": "application/json"})
            await response.prepare(request)
            try:
                while True:
                    await response.write(b" ")
                    await asyncio.sleep(0.1)
            except (ConnectionResetError, ConnectionError):
                return response
        if mode in ("event", "late-event"):
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            try:
                if mode == "late-event":
                    await response.write(TOKEN)
                await response.write(b"data: ")
                for _ in range(100):
                    await response.write(FILLER)
            except (ConnectionResetError, ConnectionError):
                pass
            return response
        return web.json_response(
            {"object": "text_completion", "choices": [{"index": 0, "text": "ok"}]}
        )

    # Bodies as large as the router lets through (aiohttp's default is 1 MiB).
    application = web.Application(client_max_size=64 * MiB)
    application.router.add_get("/health", health)
    application.router.add_get("/metrics", metrics)
    application.router.add_post("/v1/completions", completions)
    application.router.add_post("/v1/chat/completions", completions)
    return application


if __name__ == "__main__":
    web.run_app(app(sys.argv[2]), host="127.0.0.1", port=int(sys.argv[1]), print=None)
