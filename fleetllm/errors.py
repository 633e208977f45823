"""The one OpenAI error envelope, shared by the engine and the router.

Every error either of them answers has the body `{"error": {"message", "type", "param",
"code"}}`, as OpenAI's and vLLM's servers send it: `type` names the class of error the way the
OpenAI clients name their exceptions, `param` the request field at fault (or null), `code` the
HTTP status. The helpers are framework-free: `error_body` gives the dict (FastAPI's
`JSONResponse`), `error_json` the encoded bytes (aiohttp, SSE error events). Code that finds a
problem raises `APIError`; one handler per server turns it into the response.
"""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any

ERROR_TYPES: dict[int, str] = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    409: "ConflictError",
    413: "RequestEntityTooLargeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


def default_type(status: int) -> str:
    """The `type` for a status: OpenAI's class names, else one made from the HTTP phrase."""
    known = ERROR_TYPES.get(status)
    if known is not None:
        return known
    try:
        words = HTTPStatus(status).phrase.replace("-", " ").split()
    except ValueError:  # not a registered status (e.g. 499)
        return "InternalServerError" if status >= 500 else "BadRequestError"
    name = "".join(w[:1].upper() + w[1:] for w in words)
    return "".join(c for c in name if c.isalnum()) + "Error"


def error_body(
    status: int,
    message: str,
    param: str | None = None,
    *,
    type_: str | None = None,
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": type_ or default_type(status),
            "param": param,
            "code": status,
        }
    }


def error_json(
    status: int,
    message: str,
    param: str | None = None,
    *,
    type_: str | None = None,
) -> bytes:
    body = error_body(status, message, param, type_=type_)
    try:
        return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
    except UnicodeEncodeError:
        # A message that quotes the client's input may hold lone surrogates (JSON allows
        # "\ud800"); UTF-8 cannot, so those answers are escaped to ASCII.
        return json.dumps(body, separators=(",", ":")).encode()


class APIError(Exception):
    """An error answered with `status` and the envelope; raise it wherever the problem is
    found, and let the server's one handler write the response."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        *,
        type_: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_ or default_type(status)

    @property
    def client_error(self) -> bool:
        """Whether the caller is at fault (4xx): a proxy must not hold it against a replica."""
        return 400 <= self.status < 500

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, type_=self.type)

    def json(self) -> bytes:
        return error_json(self.status, self.message, self.param, type_=self.type)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)
