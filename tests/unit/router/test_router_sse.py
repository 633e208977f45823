"""Reading relayed answers: which stream event commits a stream to its replica, what an answer
says of the replica, token usage."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetllm.router.outcomes import Verdict, classify
from fleetllm.router.sse import (
    EventSplitter,
    EventTooLarge,
    First,
    answer_usage,
    cached_tokens,
    error_event,
    first_kind,
    stream_usage,
    total_tokens,
)


def _event(doc: object) -> bytes:
    return b"data: " + json.dumps(doc).encode()


ROLE = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}


@pytest.mark.parametrize(
    ("event", "kind"),
    [
        # Nothing a client would miss: held back.
        (_event(ROLE), First.PREAMBLE),
        (_event({"choices": [{"index": 0, "delta": {}, "finish_reason": None}]}), First.PREAMBLE),
        (_event({"choices": [{"index": 0, "text": "", "logprobs": None}]}), First.PREAMBLE),
        (_event({"choices": [{"delta": {"role": "assistant", "tool_calls": []}}]}), First.PREAMBLE),
        (b": keep-alive", First.PREAMBLE),
        (b"event: ping", First.PREAMBLE),
        # A token, a finish, anything else: the stream is committed.
        (_event({"choices": [{"index": 0, "text": "Hi"}]}), First.CONTENT),
        (_event({"choices": [{"delta": {"content": "Hi"}}]}), First.CONTENT),
        (_event({"choices": [{"delta": {"reasoning_content": "hm"}}]}), First.CONTENT),
        (_event({"choices": [{"delta": {"tool_calls": [{"id": "1"}]}}]}), First.CONTENT),
        (_event({"choices": [{"delta": {}, "finish_reason": "length"}]}), First.CONTENT),
        (_event({"choices": [{"text": "", "token_ids": [5]}]}), First.CONTENT),
        (_event({"choices": [], "usage": {"total_tokens": 3}}), First.CONTENT),
        (_event({"choices": [ROLE["choices"][0], {"index": 1, "text": "x"}]}), First.CONTENT),
        (b"data: [DONE]", First.CONTENT),
        (b"data: {not json", First.CONTENT),
        (b"data: [1, 2]", First.CONTENT),
        (_event({"choices": ["odd"]}), First.CONTENT),
        # Split over several data lines, as SSE allows.
        (b'data: {"choices": [{"text":\ndata: "Hi"}]}', First.CONTENT),
    ],
)
def test_first_kind(event: bytes, kind: First) -> None:
    assert first_kind(event) == (kind, 0)


@pytest.mark.parametrize(
    ("error", "code"),
    [
        ({"message": "x", "code": 500}, 500),
        ({"message": "x", "code": 400}, 400),
        ({"message": "x", "code": 503}, 503),
        ({"message": "x"}, 502),
        ({"message": "x", "code": "boom"}, 502),
        ({"message": "x", "code": True}, 502),
        ({"message": "x", "code": 200}, 502),
        ("plain text", 502),
    ],
)
def test_error_events_commit_with_their_code(error: object, code: int) -> None:
    assert first_kind(_event({"error": error})) == (First.ERROR, code)


def test_the_routers_error_event_is_an_envelope_then_done() -> None:
    data = error_event("gone", 502)
    first, done, rest = data.split(b"\n\n")
    assert first_kind(first) == (First.ERROR, 502)
    assert json.loads(first[6:])["error"] == {
        "message": "gone",
        "type": "BadGatewayError",
        "param": None,
        "code": 502,
    }
    assert (done, rest) == (b"data: [DONE]", b"")


@pytest.mark.parametrize(
    ("status", "verdict"),
    [
        (200, Verdict.ANSWER),
        (400, Verdict.ANSWER),
        (404, Verdict.ANSWER),
        (413, Verdict.ANSWER),
        (422, Verdict.ANSWER),
        (429, Verdict.ANSWER),
        (500, Verdict.SUSPECT),
        (501, Verdict.SUSPECT),
        (502, Verdict.UNAVAILABLE),
        (503, Verdict.UNAVAILABLE),
        (504, Verdict.UNAVAILABLE),
        (505, Verdict.SUSPECT),
    ],
)
def test_what_a_status_says_about_the_replica(status: int, verdict: Verdict) -> None:
    assert classify(status) is verdict


def test_usage() -> None:
    assert total_tokens(answer_usage(b'{"usage": {"total_tokens": 7}}')) == 7
    usage = answer_usage(b'{"usage": {"prompt_tokens": 3, "completion_tokens": 4}}')
    assert total_tokens(usage) == 7
    assert answer_usage(b"[]") is None and answer_usage(b"nope") is None
    assert total_tokens(None) == 0
    # The Responses and Anthropic APIs count input and output tokens.
    assert total_tokens({"input_tokens": 5, "output_tokens": 6}) == 11
    # A replica's negative count is no credit.
    assert total_tokens({"total_tokens": -50}) == 0
    assert total_tokens({"input_tokens": -50, "output_tokens": 2}) == 2
    tail = b'data: {"choices": []}\n\ndata: {"choices": [], "usage": {"total_tokens": 9}}\n\n'
    assert total_tokens(stream_usage(tail + b"data: [DONE]\n\n")) == 9
    assert stream_usage(b'data: {"choices": []}\n\n') is None


def test_cached_tokens_are_read_only_where_given_as_a_count() -> None:
    def usage(details: object) -> dict[str, object]:
        return {"total_tokens": 5, "prompt_tokens_details": details}

    assert cached_tokens(usage({"cached_tokens": 32})) == 32
    assert cached_tokens(usage({"cached_tokens": 0})) == 0
    for bad in (None, {}, {"cached_tokens": -1}, {"cached_tokens": True}, {"cached_tokens": 1.5}):
        assert cached_tokens(usage(bad)) is None
    assert cached_tokens(None) is None
    # A replica's absurd count is not believed either.
    assert cached_tokens(usage({"cached_tokens": 1 << 60})) is None


def test_the_event_splitter_cuts_whole_events_across_any_chunking() -> None:
    stream = b'data: {"a":1}\n\n: comment\n\ndata: {"b":2}\n\ndata: tail'
    for size in (1, 2, 3, 7, len(stream)):
        splitter = EventSplitter(1024)
        out = b"".join(splitter.feed(stream[i : i + size]) for i in range(0, len(stream), size))
        assert out == stream[: stream.rfind(b"\n\n") + 2]
        assert splitter.rest() == b"data: tail"


def test_the_event_splitter_refuses_an_event_over_the_cap() -> None:
    splitter = EventSplitter(1024)
    assert splitter.feed(b"data: " + b"x" * 1000) == b""
    with pytest.raises(EventTooLarge):
        splitter.feed(b"x" * 100)
    # An oversized event that arrives whole in one chunk is refused too.
    with pytest.raises(EventTooLarge):
        EventSplitter(1024).feed(b"data: ok\n\ndata: " + b"y" * 2000 + b"\n\ndata: z\n\n")
    # Many small events in one chunk are fine, whatever their total.
    events = b"data: ok\n\n" * 500
    assert EventSplitter(1024).feed(events) == events


class _CountingBuffer(bytearray):
    """The splitter's buffer, counting the bytes its searches for a blank line go over."""

    scanned = 0

    def rfind(self, sub: Any, start: Any = None, *args: Any) -> int:
        _CountingBuffer.scanned += len(self) - (start or 0)
        return super().rfind(sub, start, *args)


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 5000), min_size=1, max_size=200),
    events=st.lists(st.integers(0, 3000), min_size=1, max_size=20),
)
def test_the_event_splitter_reads_each_byte_a_bounded_number_of_times(
    sizes: list[int], events: list[int]
) -> None:
    # Events of any length (one long one with no blank line yet, the hostile case, among them)
    # cut into chunks of any size: the searches go over each byte at most twice (once as it
    # arrives, once more as the byte before a chunk), never over the whole pending event again.
    stream = b"".join(b"data: " + b"x" * n + b"\n\n" for n in events) + b"data: " + b"y" * 4000
    splitter = EventSplitter(1 << 20)
    splitter._pending = _CountingBuffer()
    _CountingBuffer.scanned = 0
    out, at, chunk = [], 0, 0
    while at < len(stream):
        size = sizes[chunk % len(sizes)]
        out.append(splitter.feed(stream[at : at + size]))
        at, chunk = at + size, chunk + 1
    assert b"".join(out) + splitter.rest() == stream
    assert _CountingBuffer.scanned <= len(stream) + chunk
