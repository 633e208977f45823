"""The server-sent events side of streaming: frames, the response, and a choice's held tokens."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from fleetllm.engine.request import CompletionOutput, Logprob

SSE_DONE = "data: [DONE]\n\n"


def sse(obj: dict[str, Any]) -> str:
    """One event: a chunk, or an error envelope that ends the stream."""
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class SSEResponse(StreamingResponse):
    """A streaming response that runs `on_close` however it ends: completed, failed, or
    cancelled by a client disconnect, even before the body iterator was first entered."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream")
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class HeldTokens:
    """A streamed choice's tokens not yet sent: a delta without text (held back, or an
    unfinished character) waits for the next chunk, unless it carries logprobs."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, Logprob]] = []

    def take(
        self, c: CompletionOutput, emit: bool
    ) -> tuple[list[int] | None, list[dict[int, Logprob]] | None]:
        """The tokens (and logprobs) the next chunk carries, held ones first; (None, None)
        when this delta is held instead."""
        self.token_ids += c.token_ids
        if c.logprobs is not None:
            self.logprobs += c.logprobs
        if not (emit or (c.logprobs and c.token_ids)):
            return None, None
        ids, self.token_ids = self.token_ids, []
        logprobs: list[dict[int, Logprob]] | None = None
        if c.logprobs is not None:
            logprobs, self.logprobs = self.logprobs, []
        return ids, logprobs
