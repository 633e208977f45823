"""The API server's error answers, as one exception."""

from __future__ import annotations

import json
from typing import Any

# An answer's message is cut to this many characters (a body may be an HTML error page).
MESSAGE_LIMIT = 500


class ApiError(Exception):
    """An answer of the API server with an error status (also an ERROR event in a watch)."""

    def __init__(self, status: int, reason: str, message: str, method: str, path: str) -> None:
        super().__init__(f"{method} {path}: HTTP {status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message

    @property
    def not_found(self) -> bool:
        return self.status == 404

    @property
    def conflict(self) -> bool:
        return self.status == 409

    @property
    def gone(self) -> bool:
        """410: a resourceVersion or continue token too old to resume from; list again."""
        return self.status == 410

    @property
    def retryable(self) -> bool:
        return self.status in (409, 429) or self.status >= 500


def error_from_answer(status: int, text: str, method: str, path: str) -> ApiError:
    """An error answer's body: a Status object, or whatever a proxy in between sent."""
    reason, message = "", text[:MESSAGE_LIMIT]
    try:
        payload = json.loads(text)
    except ValueError:
        payload = None
    if isinstance(payload, dict):
        reason = str(payload.get("reason") or "")
        message = str(payload.get("message") or reason or payload)[:MESSAGE_LIMIT]
    return ApiError(status, reason, message, method, path)


def error_from_watch(status: dict[str, Any], path: str) -> ApiError:
    """The Status object of a watch's ERROR event."""
    return ApiError(
        int(status.get("code") or 500),
        str(status.get("reason") or ""),
        str(status.get("message") or ""),
        "WATCH",
        path,
    )
