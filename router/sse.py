"""What the proxy reads in the answers it relays, as pure functions over bytes: server-sent
event framing, the error event that ends a broken stream, and token usage for rate limits."""

from __future__ import annotations

import json
from typing import Any

from fleetllm.errors import error_json

SSE_END = b"\n\n"
DONE_EVENT = b"data: [DONE]\n\n"


def error_event(message: str, status: int = 502) -> bytes:
    """The end of a stream that broke after it had started: an error event, then [DONE]."""
    return b"data: " + error_json(status, message) + SSE_END + DONE_EVENT


def usage_tokens(data: bytes) -> int:
    """Total tokens of a JSON answer, from its `usage`; 0 where it has none."""
    try:
        usage = json.loads(data).get("usage")
    except (ValueError, AttributeError):
        return 0
    return _total(usage)


def usage_tokens_sse(block: bytes) -> int:
    """The usage of a stream, from its closing events (present with include_usage)."""
    if b'"usage"' not in block:
        return 0
    for event in reversed(block.split(SSE_END)):
        if event.startswith(b"data: {") and b'"usage"' in event:
            try:
                total = _total(json.loads(event[6:]).get("usage"))
            except ValueError:
                continue
            if total:
                return total
    return 0


def _total(usage: Any) -> int:
    if not isinstance(usage, dict):
        return 0
    total = usage.get("total_tokens")
    if isinstance(total, int):
        return total
    parts = [usage.get("prompt_tokens"), usage.get("completion_tokens")]
    return sum(p for p in parts if isinstance(p, int))
