"""The router's errors: the shared `APIError` (`fleetllm.errors`) with response headers (such as
`Retry-After`), raised anywhere on a request's path and answered by the application's error
middleware (`fleetllm.router.server`), the one place that turns errors into responses."""

from __future__ import annotations

from collections.abc import Mapping

from aiohttp import web

from fleetllm.errors import APIError


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
