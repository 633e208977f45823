"""HTTP/1.1 heads as the router's front reads and writes them, as pure functions over bytes.

`parse_fast_head` accepts only the plainest requests: `POST <endpoint> HTTP/1.1` with exactly
one Content-Length, or `GET <path> HTTP/1.1` with none; token header names, printable ASCII
values, exactly one Host, and no Transfer-Encoding, Expect or Upgrade. Anything else gives
None, and the front hands the request, from its first byte, to aiohttp's parser, which
answers it by the full rules (so every request is read by exactly one parser, and the two can
never disagree on where one ends). `response_head` refuses a status reason or header that
would break the head.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from email.utils import formatdate

MAX_HEAD = 16 * 1024
"""A longer head goes to aiohttp, whose own limits answer it."""
MAX_HEADERS = 100

_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_VALUE = re.compile(rb"[\t\x20-\x7e]*")
_QUERY = re.compile(rb"[\x21-\x7e]*")
_SAFE_TEXT = re.compile(r"[\t\x20-\x7e\x80-\xff]*")
_STRIP = b" \t"
_REFUSED = frozenset((b"transfer-encoding", b"expect", b"upgrade"))


@dataclass(frozen=True, slots=True)
class FastHead:
    method: str
    path: str
    headers: list[tuple[str, str]]
    content_length: int
    close: bool
    """The client asked for the connection to close after the answer."""


def parse_fast_head(
    head: bytes, posts: frozenset[bytes], gets: frozenset[bytes]
) -> FastHead | None:
    """The head (without its blank line) of a plain POST to one of `posts`, or GET of one of
    `gets`; None for any other request, well-formed or not."""
    lines = head.split(b"\r\n")
    request_line = lines[0].split(b" ")
    if len(request_line) != 3 or request_line[2] != b"HTTP/1.1":
        return None
    method = request_line[0]
    path, _, query = request_line[1].partition(b"?")
    if path not in (posts if method == b"POST" else gets if method == b"GET" else ()):
        return None
    if not _QUERY.fullmatch(query):
        return None
    if len(lines) - 1 > MAX_HEADERS:
        return None
    headers: list[tuple[str, str]] = []
    content_length: int | None = None
    hosts = 0
    close = False
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        # A name with whitespace around it, or a folded line, is not a token: not ours.
        if not sep or not _TOKEN.fullmatch(name):
            return None
        value = value.strip(_STRIP)
        if not _VALUE.fullmatch(value):
            return None
        lower = name.lower()
        if lower == b"content-length":
            if content_length is not None or not value.isdigit() or len(value) > 15:
                return None
            content_length = int(value)
        elif lower == b"host":
            hosts += 1
        elif lower in _REFUSED:
            return None
        elif lower == b"connection":
            tokens = {t.strip(_STRIP).lower() for t in value.split(b",")}
            if b"upgrade" in tokens:
                return None
            close = close or b"close" in tokens
        headers.append((name.decode("ascii"), value.decode("ascii")))
    if hosts != 1 or (content_length is None) != (method == b"GET"):
        return None
    return FastHead(
        method.decode("ascii"), path.decode("ascii"), headers, content_length or 0, close
    )


def response_head(status: int, reason: str, headers: Iterable[tuple[str, str]]) -> bytes:
    """The status line and headers of an answer, with the blank line that ends them. A
    reason or header with a line break or control character raises ValueError: it would
    split the head (a replica's header is relayed, so this is a boundary)."""
    if not 100 <= status <= 999 or not _SAFE_TEXT.fullmatch(reason):
        raise ValueError(f"an unsafe status line: {status} {reason[:40]!r}")
    lines = [f"HTTP/1.1 {status} {reason}", f"Date: {http_date()}"]
    for name, value in headers:
        if not _TOKEN.fullmatch(name.encode("latin-1", "replace")) or not _SAFE_TEXT.fullmatch(
            value
        ):
            raise ValueError(f"an unsafe header: {name[:40]!r}")
        lines.append(f"{name}: {value}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def http_date() -> str:
    """The Date header's value (formatted once a second)."""
    return _date_of(int(time.time()))


@functools.lru_cache(maxsize=1)
def _date_of(second: int) -> str:
    return formatdate(second, usegmt=True)
