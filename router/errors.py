"""The router's errors: raised anywhere on a request's path, answered in OpenAI's shape by the
application's error middleware (`fleetllm.router.server`), the one place that turns them into
responses."""

from __future__ import annotations

import json
from collections.abc import Mapping

from aiohttp import web

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "RequestEntityTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")


def error_body(status: int, message: str, param: str | None = None) -> bytes:
    return json.dumps(
        {"error": {"message": message, "type": error_type(status), "param": param, "code": status}}
    ).encode()


class RouterError(Exception):
    """An answer the router gives itself: `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = dict(headers or {})

    def response(self) -> web.Response:
        return web.Response(
            status=self.status,
            body=error_body(self.status, self.message, self.param),
            content_type="application/json",
            headers=self.headers,
        )
