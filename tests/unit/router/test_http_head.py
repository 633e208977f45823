"""The front's HTTP heads: it takes only plain requests, and whatever it takes, a strict
HTTP/1.1 parser (h11) reads the same way; the heads it writes are well-formed."""

from __future__ import annotations

import h11
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetllm.router.http_head import MAX_HEADERS, parse_fast_head, response_head

POSTS = frozenset({b"/v1/completions", b"/v1/chat/completions"})
GETS = frozenset({b"/v1/models", b"/health"})
PLAIN = [
    b"POST /v1/completions HTTP/1.1",
    b"Host: router:8000",
    b"Content-Type: application/json",
    b"Authorization: Bearer sk-1",
    b"Content-Length: 17",
]


def _head(lines: list[bytes]) -> bytes:
    return b"\r\n".join(lines)


def _h11(head: bytes) -> h11.Request:
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(head + b"\r\n\r\n")
    event = conn.next_event()
    assert isinstance(event, h11.Request)
    return event


def test_a_plain_request_is_taken_with_its_headers() -> None:
    head = parse_fast_head(_head(PLAIN), POSTS, GETS)
    assert head is not None
    assert head.method == "POST" and head.path == "/v1/completions"
    assert head.content_length == 17 and not head.close
    assert ("Authorization", "Bearer sk-1") in head.headers and len(head.headers) == 4
    query = parse_fast_head(_head([b"POST /v1/completions?a=1 HTTP/1.1", *PLAIN[1:]]), POSTS, GETS)
    assert query is not None and query.path == "/v1/completions"
    get = parse_fast_head(b"GET /v1/models?x=1 HTTP/1.1\r\nHost: r\r\nAccept: */*", POSTS, GETS)
    assert get is not None and (get.method, get.path, get.content_length) == (
        "GET",
        "/v1/models",
        0,
    )
    closing = parse_fast_head(_head([*PLAIN, b"Connection: keep-alive, Close"]), POSTS, GETS)
    assert closing is not None and closing.close


@pytest.mark.parametrize(
    "lines",
    [
        [b"GET /v1/completions HTTP/1.1", *PLAIN[1:]],
        [b"POST /v1/completions HTTP/1.0", *PLAIN[1:]],
        [b"POST /v1/models HTTP/1.1", *PLAIN[1:]],
        [b"GET /v1/models HTTP/1.1", *PLAIN[1:]],  # a GET with a body
        [b"GET /v1/completions HTTP/1.1", PLAIN[1]],
        [b"HEAD /v1/models HTTP/1.1", PLAIN[1]],
        [b"DELETE /health HTTP/1.1", PLAIN[1]],
        [b"POST /v1/%63ompletions HTTP/1.1", *PLAIN[1:]],
        [b"POST /v1/completions?a b HTTP/1.1", *PLAIN[1:]],
        [b"POST  /v1/completions HTTP/1.1", *PLAIN[1:]],
        [b"POST http://x/v1/completions HTTP/1.1", *PLAIN[1:]],
        [*PLAIN[:-1]],  # no Content-Length
        [PLAIN[0], *PLAIN[2:]],  # no Host
        [*PLAIN, b"Host: other"],
        [*PLAIN, b"Content-Length: 17"],  # two
        [*PLAIN[:-1], b"Content-Length: +17"],
        [*PLAIN[:-1], b"Content-Length: 0x11"],
        [*PLAIN, b"Transfer-Encoding: chunked"],
        [*PLAIN, b"transfer-encoding: identity"],
        [*PLAIN, b"Expect: 100-continue"],
        [*PLAIN, b"Upgrade: websocket"],
        [*PLAIN, b"Connection: Upgrade"],
        [*PLAIN, b"X-Folded: a", b" b"],  # obs-fold
        [*PLAIN, b"X-Space : a"],
        [*PLAIN, b"X-Ctl: a\x01b"],
        [*PLAIN, b"X-Utf8: \xc3\xa9"],
        [*PLAIN, b"X-Cr: a\rb"],
        [*PLAIN, b"NoColon"],
        [*PLAIN, b": empty name"],
        [b"", *PLAIN],
        [*PLAIN, *[b"X-Many: 1"] * MAX_HEADERS],
    ],
)
def test_anything_but_a_plain_request_is_left_to_aiohttp(lines: list[bytes]) -> None:
    assert parse_fast_head(_head(lines), POSTS, GETS) is None


_token = st.from_regex(rb"\A[!#$%&'*+\-.^_`|~0-9A-Za-z]{1,12}\Z")
_value = st.from_regex(rb"\A[\t\x20-\x7e]{0,20}\Z")
_line = st.one_of(
    # well-formed header lines, most of them
    st.builds(lambda n, v: n + b":" + v, _token, _value),
    st.builds(lambda n, v: n + b": " + v, _token, _value),
    st.builds(lambda n, v: n + b":\t" + v + b" ", _token, _value),
    st.sampled_from(
        [
            b"Content-Length: 3",
            b"Host: other",
            b"Transfer-Encoding: chunked",
            b"Connection: close",
            b"Connection: upgrade",
            b"Expect: 100-continue",
            b" folded",
            b"X-Tab:\ta\tb\t",
        ]
    ),
    st.binary(max_size=30),  # anything at all
)
_request_line = st.one_of(
    st.just(b"POST /v1/completions HTTP/1.1"),
    st.just(b"POST /v1/chat/completions?x=%20 HTTP/1.1"),
    st.sampled_from(
        [
            b"POST /v1/completions HTTP/1.0",
            b"PUT /v1/completions HTTP/1.1",
            b"GET /v1/models HTTP/1.1",
            b"GET /health?probe HTTP/1.1",
        ]
    ),
    st.binary(max_size=40),
)
_lines = st.builds(
    lambda extra, at, length: [
        *extra[:at],
        b"Host: h",
        *extra[at:],
        *([b"Content-Length: " + length] if length is not None else []),
    ],
    st.lists(_line, max_size=6),
    st.integers(0, 6),
    st.sampled_from([b"0", b"17", b"007", b" 5 ", b"-1", b"1e3", None]),
)


@settings(max_examples=400, deadline=None)
@given(_request_line, _lines)
def test_what_the_front_takes_a_strict_parser_reads_alike(first: bytes, lines: list[bytes]) -> None:
    raw = _head([first, *lines])
    if b"\r\n\r\n" in raw:
        return  # the front only ever sees a head cut at its first blank line
    head = parse_fast_head(raw, POSTS, GETS)
    if head is None:
        return
    request = _h11(raw)
    assert request.method == head.method.encode() and request.http_version == b"1.1"
    assert request.target.split(b"?")[0].decode() == head.path
    ours = [(n.lower().encode(), v.encode()) for n, v in head.headers]
    assert ours == [(n, v) for n, v in request.headers]
    lengths = [v for n, v in request.headers if n == b"content-length"]
    assert [int(n) for n in lengths] == ([head.content_length] if head.method == "POST" else [])
    assert not any(n in (b"transfer-encoding", b"expect") for n, _ in request.headers)


_TOKEN_CHARS = set("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


def _safe(text: str) -> bool:
    return all(c == "\t" or " " <= c <= "~" or "\x80" <= c <= "\xff" for c in text)


@settings(max_examples=300, deadline=None)
@given(
    st.integers(200, 599),
    st.text(max_size=20),
    st.lists(st.tuples(st.text(max_size=12), st.text(max_size=30)), max_size=6),
)
def test_an_answer_head_is_well_formed_or_refused(
    status: int, reason: str, headers: list[tuple[str, str]]
) -> None:
    headers = [
        (n, v) for n, v in headers if n.lower() not in ("content-length", "transfer-encoding")
    ]
    safe = _safe(reason) and all(n and set(n) <= _TOKEN_CHARS and _safe(v) for n, v in headers)
    if not safe:
        with pytest.raises(ValueError):
            response_head(status, reason, headers)
        return
    head = response_head(status, reason, [*headers, ("Content-Length", "0")])
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="GET", target="/", headers=[("Host", "x")]))
    conn.receive_data(head)
    event = conn.next_event()
    assert isinstance(event, h11.Response) and event.status_code == status
    assert [(n.decode(), v.decode("latin-1")) for n, v in event.headers][1:] == [
        (n.lower(), v.strip(" \t")) for n, v in [*headers, ("Content-Length", "0")]
    ]
