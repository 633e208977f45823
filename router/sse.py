"""What the proxy reads in the answers it relays, as pure functions over bytes: server-sent
event framing, the error event that ends a broken stream, and token usage (for rate limits,
and the cached tokens kv-aware routing predicted)."""

from __future__ import annotations

import enum
import json
from typing import Any

from fleetllm.errors import error_json

SSE_END = b"\n\n"
DONE_EVENT = b"data: [DONE]\n\n"


def error_event(message: str, status: int = 502) -> bytes:
    """The end of a stream that broke after it had started: an error event, then [DONE]."""
    return b"data: " + error_json(status, message) + SSE_END + DONE_EVENT


def answer_usage(data: bytes) -> dict[str, Any] | None:
    """The `usage` of a JSON answer; None where it has none."""
    try:
        usage = json.loads(data).get("usage")
    except (ValueError, AttributeError):
        return None
    return usage if isinstance(usage, dict) else None


def stream_usage(block: bytes) -> dict[str, Any] | None:
    """The usage of a stream, from its closing events (present with include_usage)."""
    if b'"usage"' not in block:
        return None
    for event in reversed(block.split(SSE_END)):
        if event.startswith(b"data: {") and b'"usage"' in event:
            try:
                usage = json.loads(event[6:]).get("usage")
            except ValueError:
                continue
            if isinstance(usage, dict) and total_tokens(usage):
                return usage
    return None


def total_tokens(usage: dict[str, Any] | None) -> int:
    """OpenAI's `total_tokens`, else the sum of the parts: OpenAI's prompt and completion
    tokens, or the input and output tokens of the Responses and Anthropic APIs; 0 where it
    counts none. A count that is not one (negative, a bool, absurdly large: a replica's
    nonsense) is no credit to the key."""
    if usage is None:
        return 0
    total = usage.get("total_tokens")
    if _count(total):
        return total
    names = ("prompt_tokens", "completion_tokens", "input_tokens", "output_tokens")
    return sum(p for p in map(usage.get, names) if _count(p))


def cached_tokens(usage: dict[str, Any] | None) -> int | None:
    """`usage.prompt_tokens_details.cached_tokens`; None where it is not given."""
    details = usage.get("prompt_tokens_details") if usage is not None else None
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if _count(cached) else None


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 53


class First(enum.Enum):
    """What one event of a stream is, for failover: a stream is committed to its replica by
    its first event that carries a token, a finish or an error; events before it carry nothing
    a client would miss (a chat stream's role-only opening, empty deltas, comments) and are
    held back, so that a replica that fails before its first token can be replaced."""

    PREAMBLE = "preamble"
    CONTENT = "content"
    ERROR = "error"


def first_kind(event: bytes) -> tuple[First, int]:
    """The kind of one event (its bytes without the blank line that ends it), and for an
    error event its `code` (502 where it names none)."""
    data = [line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
    if not data:
        return First.PREAMBLE, 0  # a comment or a bare field: nothing for the client yet
    try:
        doc = json.loads(b"\n".join(data))
    except ValueError:
        return First.CONTENT, 0  # [DONE], or something only the client can make sense of
    if not isinstance(doc, dict):
        return First.CONTENT, 0
    error = doc.get("error")
    if error is not None:
        code = error.get("code") if isinstance(error, dict) else None
        valid = isinstance(code, int) and not isinstance(code, bool) and 400 <= code <= 599
        return First.ERROR, code if valid else 502
    choices = doc.get("choices")
    if not isinstance(choices, list) or not choices:
        return First.CONTENT, 0  # e.g. a usage-only event
    return (First.CONTENT if any(_carries(c) for c in choices) else First.PREAMBLE), 0


def _carries(choice: Any) -> bool:
    if not isinstance(choice, dict):
        return True
    if choice.get("finish_reason") is not None or choice.get("logprobs") is not None:
        return True
    if choice.get("text") or choice.get("token_ids"):
        return True
    delta = choice.get("delta")
    if delta is None:
        return False
    if not isinstance(delta, dict):
        return True
    return any(value not in (None, "", [], {}) for key, value in delta.items() if key != "role")


class EventTooLarge(Exception):
    """One event of a stream is longer than the cap (its blank line has not come)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"a stream event exceeds the limit of {limit} bytes")
        self.limit = limit


class EventSplitter:
    """Cuts a stream's bytes into whole events, in linear time: each chunk is scanned once
    (from one byte before it, for a blank line split across two chunks), the partial event
    grows in place, and no event may pass `limit` bytes."""

    __slots__ = ("_pending", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._pending = bytearray()

    def feed(self, chunk: bytes) -> bytes:
        """The whole events completed by `chunk` (possibly none: b""), blank lines included."""
        start = max(0, len(self._pending) - 1)
        self._pending += chunk
        cut = self._pending.rfind(SSE_END, start)
        if cut < 0:
            if len(self._pending) > self.limit:
                raise EventTooLarge(self.limit)
            return b""
        end = cut + len(SSE_END)
        # Events between the previous cut and this one may each be checked by their length:
        # the longest lies between two blank lines of the completed block.
        block = bytes(self._pending[:end])
        del self._pending[:end]
        if len(self._pending) > self.limit or _longest_event(block) > self.limit:
            raise EventTooLarge(self.limit)
        return block

    def rest(self) -> bytes:
        """What came after the last whole event (a stream that ended mid-event)."""
        return bytes(self._pending)


def _longest_event(block: bytes) -> int:
    longest = 0
    at = 0
    while (cut := block.find(SSE_END, at)) >= 0:
        longest = max(longest, cut - at)
        at = cut + len(SSE_END)
    return longest
