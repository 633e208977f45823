"""Reading an HTTP answer whole, bounded in size: the router's and the scrapers' one way to
read what a replica sends, so that no replica can make them hold more than a cap in memory.

Chunks are kept in a list and joined once (linear time, whatever the chunk sizes), and a
`Content-Length` over the cap is refused before a byte of the body is read.
"""

from __future__ import annotations

from typing import Protocol

MiB = 1 << 20


class TooLarge(Exception):
    """The answer is larger than the cap; what was read of it is dropped."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the answer exceeds the limit of {limit} bytes")
        self.limit = limit


class _Content(Protocol):
    async def readany(self) -> bytes: ...


class Answer(Protocol):
    """What is read of an answer: aiohttp's ClientResponse, or the router's own
    `UpstreamResponse`."""

    @property
    def content_length(self) -> int | None: ...

    @property
    def content(self) -> _Content: ...


async def read_bounded(response: Answer, limit: int) -> bytes:
    """The whole body of `response`, or TooLarge once it passes `limit` bytes."""
    declared = response.content_length
    if declared is not None and declared > limit:
        raise TooLarge(limit)
    chunks: list[bytes] = []
    size = 0
    while chunk := await response.content.readany():
        size += len(chunk)
        if size > limit:
            raise TooLarge(limit)
        chunks.append(chunk)
    return b"".join(chunks)
