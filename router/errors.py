"""The router's errors: the shared `APIError` (`fleetllm.errors`) with response headers (such as
`Retry-After`), raised anywhere on a request's path and answered by `answer_errors`, the one
place that turns errors into responses."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from aiohttp import web

from fleetllm.errors import APIError

log = logging.getLogger("fleetllm.router")
R = TypeVar("R")
FAILED = "The router failed to handle the request."
"""The message of a fault of the router's own (500)."""


class RouterError(APIError):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(status, message, param)
        self.headers = dict(headers or {})


def error_response(exc: APIError) -> web.Response:
    headers = exc.headers if isinstance(exc, RouterError) else None
    return web.Response(
        status=exc.status, body=exc.json(), content_type="application/json", headers=headers
    )


async def answer_errors(handler: Callable[[Any], Awaitable[R]], request: Any) -> R | web.Response:
    """The handler's answer; an error raised on the way, as the client's answer (the one
    place where errors become answers, for requests that aiohttp or the front read)."""
    try:
        return await handler(request)
    except APIError as exc:
        return error_response(exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(APIError(exc.status, exc.reason))
    except Exception:
        log.exception("request failed", extra={"path": request.path})
        return error_response(APIError(500, FAILED))


def first_byte_timeout_hint(timeout: float, payload: Mapping[str, Any]) -> str:
    """What a request cut by the first-byte timeout is told. A non-streamed answer's first byte
    comes when its whole generation is done, so a long one (no max_tokens, a model that does not
    stop) meets the timeout although its replica works: the message says what avoids it."""
    said = f"did not answer within the first-byte timeout ({timeout:g} s)."
    if payload.get("stream") is True:
        return said
    return (
        f"{said} A non-streamed answer comes whole when its generation ends: stream it, bound "
        "it with max_tokens, or raise the router's --first-byte-timeout."
    )
