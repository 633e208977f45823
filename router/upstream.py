"""The proxy's HTTP/1.1 client to the replicas: one POST with its body in hand, the answer's
status and headers, then its body as it comes, over kept-alive connections.

aiohttp's client does far more per request than this needs (URL objects, header merging,
cookie jars, trace hooks, timers), and on the way to a stream's first token that cost is
most of what the router adds to a replica's time to first token: with it replaced, a bare
relay adds about half as much (benchmarks/router.py --part latency; docs/benchmarks.md).

Everything a replica sends is bounded: the head (status line and headers) by MAX_HEAD bytes
and MAX_HEADERS lines, a chunk-size line by MAX_LINE; what is not HTTP/1.x as it should be is
an UpstreamError. Errors are aiohttp's classes, so the proxy treats this client's failures
as it treats any broken replica.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Mapping
from urllib.parse import urlsplit

import aiohttp
from multidict import CIMultiDict

MAX_HEAD = 64 << 10
MAX_HEADERS = 100
MAX_LINE = 8 << 10
READ_SIZE = 64 << 10
KEEPALIVE_S = 60.0
"""An idle connection is closed after this long. A replica may close one sooner (uvicorn
does after 5 s): `post` then sends the request again on a new connection."""

Origin = tuple[str, str, int]


class UpstreamError(aiohttp.ClientPayloadError):
    """The replica's answer is not HTTP/1.x as it should be."""


class _Connection:
    __slots__ = ("idle_since", "reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.idle_since = 0.0

    def usable(self, now: float, keepalive_s: float) -> bool:
        return (
            now - self.idle_since < keepalive_s
            and not self.reader.at_eof()
            and not self.writer.is_closing()
        )

    def close(self) -> None:
        self.writer.close()


class UpstreamPool:
    """Kept-alive connections per replica origin, and the requests made over them."""

    def __init__(
        self,
        connect_timeout: float,
        max_idle_per_origin: int = 256,
        keepalive_s: float = KEEPALIVE_S,
    ) -> None:
        self.connect_timeout = connect_timeout
        self.max_idle_per_origin = max_idle_per_origin
        self.keepalive_s = keepalive_s
        self._idle: dict[Origin, list[_Connection]] = {}
        self._tls: ssl.SSLContext | None = None
        self._next_sweep = 0.0

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> UpstreamResponse:
        """The answer's head; its body is read from `content`. The caller must `release` or
        `close` the answer."""
        parts = urlsplit(url)
        scheme = parts.scheme
        host = parts.hostname or ""
        port = parts.port or (443 if scheme == "https" else 80)
        origin = (scheme, host, port)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        authority = host if parts.port is None else f"{host}:{parts.port}"
        lines = [f"POST {target} HTTP/1.1", f"Host: {authority}", f"Content-Length: {len(body)}"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        request = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
        while True:
            connection, reused = await self._connection(origin)
            try:
                connection.writer.write(request)
                status, answer_headers = await _read_head(connection.reader)
            except (OSError, asyncio.IncompleteReadError) as exc:
                connection.close()
                if reused:
                    # A kept-alive connection the replica had closed meanwhile: nothing of
                    # the answer came, so the request goes again on a new connection.
                    continue
                raise aiohttp.ServerDisconnectedError(f"the replica closed: {exc}") from None
            except BaseException:
                connection.close()
                raise
            return UpstreamResponse(self, origin, connection, status, answer_headers)

    async def _connection(self, origin: Origin) -> tuple[_Connection, bool]:
        idle = self._idle.get(origin)
        now = time.monotonic()
        while idle:
            connection = idle.pop()
            if connection.usable(now, self.keepalive_s):
                return connection, True
            connection.close()
        scheme, host, port = origin
        tls = self._tls_context() if scheme == "https" else None
        try:
            async with asyncio.timeout(self.connect_timeout):
                reader, writer = await asyncio.open_connection(host, port, ssl=tls, limit=MAX_HEAD)
        except TimeoutError:
            raise aiohttp.ServerTimeoutError(f"connecting to {host}:{port} timed out") from None
        except OSError as exc:
            raise aiohttp.ClientConnectionError(f"cannot connect to {host}:{port}: {exc}") from None
        return _Connection(reader, writer), False

    def _tls_context(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls

    def keep(self, origin: Origin, connection: _Connection) -> None:
        now = time.monotonic()
        if now >= self._next_sweep:
            self._sweep(now)
        idle = self._idle.setdefault(origin, [])
        if len(idle) >= self.max_idle_per_origin:
            connection.close()
            return
        connection.idle_since = now
        idle.append(connection)

    def _sweep(self, now: float) -> None:
        """Close the idle connections past their time, every origin's: a replica that left
        the fleet is never asked again, and its connections would stay open otherwise."""
        self._next_sweep = now + self.keepalive_s / 2
        for origin, idle in list(self._idle.items()):
            kept = [c for c in idle if c.usable(now, self.keepalive_s)]
            for connection in idle:
                if connection not in kept:
                    connection.close()
            if kept:
                self._idle[origin] = kept
            else:
                del self._idle[origin]

    async def close(self) -> None:
        for idle in self._idle.values():
            for connection in idle:
                connection.close()
        self._idle.clear()


class UpstreamResponse:
    """An answer's status and headers, and its body (`content`)."""

    def __init__(
        self,
        pool: UpstreamPool,
        origin: Origin,
        connection: _Connection,
        status: int,
        headers: CIMultiDict[str],
    ) -> None:
        self.status = status
        self.headers = headers
        self._pool = pool
        self._origin = origin
        self._connection: _Connection | None = connection
        self.content = _Body(connection.reader, status, headers)
        self._reusable = (
            self.content.framed and "close" not in headers.get("Connection", "").lower()
        )

    @property
    def content_length(self) -> int | None:
        return self.content.length

    def release(self) -> None:
        """Done with a body read to its end: the connection serves the next request."""
        connection, self._connection = self._connection, None
        if connection is not None:
            if self._reusable and self.content.at_eof():
                self._pool.keep(self._origin, connection)
            else:
                connection.close()

    def close(self) -> None:
        """Done before the end: the connection is dropped (the replica sees the request
        abandoned)."""
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.close()


class _Body:
    """An answer's body as it comes: by Content-Length, chunked, or until the connection
    closes."""

    def __init__(
        self, reader: asyncio.StreamReader, status: int, headers: CIMultiDict[str]
    ) -> None:
        self._reader = reader
        self.length: int | None = None
        self._chunked = "chunked" in headers.get("Transfer-Encoding", "").lower()
        self._left = 0  # of the body (Content-Length) or of the current chunk
        self._eof = False
        if status in (204, 304):
            self._eof = True
        elif not self._chunked and (declared := headers.get("Content-Length")) is not None:
            if not declared.isdigit():
                raise UpstreamError(f"a Content-Length of {declared[:40]!r}")
            self.length = self._left = int(declared)
            self._eof = self._left == 0
        self.framed = self._eof or self._chunked or self.length is not None
        """Whether the body's end is known without the connection closing."""

    def at_eof(self) -> bool:
        return self._eof

    async def readany(self) -> bytes:
        """Some of the body, b"" at its end."""
        if self._eof:
            return b""
        try:
            if self._chunked:
                return await self._read_chunked()
            if self.length is None:
                data = await self._reader.read(READ_SIZE)
                self._eof = not data
                return data
            data = await self._reader.read(min(self._left, READ_SIZE))
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
            raise aiohttp.ClientPayloadError(f"the answer broke off: {exc}") from None
        if not data:
            raise aiohttp.ClientPayloadError("the answer ended before its Content-Length")
        self._left -= len(data)
        self._eof = self._left == 0
        return data

    async def _read_chunked(self) -> bytes:
        reader = self._reader
        if self._left == 0:
            line = await reader.readuntil(b"\r\n")
            size = line[:-2].split(b";", 1)[0].strip()
            if len(line) > MAX_LINE or not size or len(size) > 16:
                raise UpstreamError("a malformed chunk size")
            try:
                self._left = int(size, 16)
            except ValueError:
                raise UpstreamError("a malformed chunk size") from None
            if self._left == 0:
                await _read_trailers(reader)
                self._eof = True
                return b""
        data = await reader.read(min(self._left, READ_SIZE))
        if not data:
            raise aiohttp.ClientPayloadError("the answer ended inside a chunk")
        self._left -= len(data)
        if self._left == 0 and await reader.readexactly(2) != b"\r\n":
            raise UpstreamError("a chunk not ended by CRLF")
        return data


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, CIMultiDict[str]]:
    """The status and headers of the next final answer (interim 1xx answers skipped)."""
    while True:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError:
            raise UpstreamError(f"an answer's head over {MAX_HEAD} bytes") from None
        lines = head[:-4].split(b"\r\n")
        status_line = lines[0].split(b" ", 2)
        if (
            len(status_line) < 2
            or not status_line[0].startswith(b"HTTP/1.")
            or len(status_line[1]) != 3
            or not status_line[1].isdigit()
        ):
            raise UpstreamError("an answer that is not HTTP/1.x")
        status = int(status_line[1])
        if len(lines) - 1 > MAX_HEADERS:
            raise UpstreamError(f"an answer with over {MAX_HEADERS} headers")
        headers: CIMultiDict[str] = CIMultiDict()
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep or not name or name != name.strip():
                raise UpstreamError("a malformed header line")
            headers.add(name.decode("latin-1"), value.strip().decode("latin-1"))
        if status >= 200:
            if status_line[0] == b"HTTP/1.0":
                headers["Connection"] = "close"
            return status, headers
        if status < 100:
            raise UpstreamError(f"a status of {status}")


async def _read_trailers(reader: asyncio.StreamReader) -> None:
    for _ in range(MAX_HEADERS + 1):
        line = await reader.readuntil(b"\r\n")
        if line == b"\r\n":
            return
    raise UpstreamError(f"an answer with over {MAX_HEADERS} trailer lines")
