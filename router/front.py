"""The router's listening socket, and the short path of the proxy's requests through it.

Every connection starts in the front. A request for one of the proxied endpoints in the
plainest HTTP/1.1 (see `http_head.parse_fast_head`) with a body of at most FAST_BODY_BYTES is
read here and goes to the proxy at once; a stream's head and events are written straight to
the socket. So is a plain GET of the router's own read-only endpoints (`/v1/models`,
`/health`, ...), which clients send on the connections they then use for completions. Any
other request (another endpoint or method, a chunked or larger body, HTTP/1.0, a head that is
malformed or too long) hands the connection, with every byte of it not yet answered, to the
aiohttp application, which reads it by the full rules and keeps the connection from then on.

Why: on the way to a stream's first token, aiohttp's server spends about 0.2 ms before a
handler starts (a task wakes per connection, then one more per request) and 0.14 ms on the
answer's head and first write, at 64 streams on a 2-core CPU: most of what the router adds
to a replica's time to first token (docs/benchmarks.md). The front reads the head and starts
the proxy in one turn of the event loop.

The front keeps aiohttp's rules where they apply: a connection with no complete head within
the header timeout (from its opening, and from each answer's end) is closed; a body that has
not all come within the body timeout is answered 408; when the client goes, its request's
handler is cancelled; pipelined requests are answered in order, and reading pauses while more
than PIPELINE_BYTES wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import cast

from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from fleetllm.errors import APIError
from fleetllm.router.body import body_late
from fleetllm.router.errors import FAILED, error_response
from fleetllm.router.http_head import MAX_HEAD, FastHead, parse_fast_head, response_head

FAST_BODY_BYTES = 64 * 1024
"""A larger body is read by aiohttp, streamed and bounded by the router's limits."""
PIPELINE_BYTES = 64 * 1024

Handler = Callable[["FastRequest"], Awaitable["web.StreamResponse | FrontStream"]]


class FastRequest:
    """A request read by the front: the part of aiohttp's `web.Request` the proxy uses."""

    __slots__ = ("body", "close", "connection", "content_length", "headers", "method", "path")

    def __init__(self, head: FastHead, body: bytes, connection: _FrontConnection) -> None:
        self.method = head.method
        self.path = head.path
        self.headers = CIMultiDictProxy(CIMultiDict(head.headers))
        self.content_length = head.content_length
        self.close = head.close
        self.body = body
        self.connection = connection


class FrontStream:
    """A streamed answer written to the client's socket, chunked: the part of aiohttp's
    `StreamResponse` the proxy uses. The head leaves with the first event (one write and
    one wake-up of the client instead of two)."""

    def __init__(self, connection: _FrontConnection, status: int, headers: dict[str, str]) -> None:
        self.status = status
        self.headers = CIMultiDict(headers)
        self.prepared = False
        self.eof_sent = False
        self._connection = connection
        self._head = b""

    async def prepare(self, _request: object = None) -> None:
        """Fix the head (a header that would break it raises ValueError)."""
        if not self.prepared:
            headers = [*self.headers.items(), ("Transfer-Encoding", "chunked")]
            self._head = response_head(self.status, _reason(self.status), headers)
            self.prepared = True

    async def write(self, data: bytes) -> None:
        if data:
            await self._send(b"%x\r\n%b\r\n" % (len(data), data))

    async def write_eof(self) -> None:
        if not self.eof_sent:
            await self._send(b"0\r\n\r\n")
            self.eof_sent = True

    async def _send(self, frame: bytes) -> None:
        if not self.prepared:
            await self.prepare()
        head, self._head = self._head, b""
        await self._connection.send(head + frame if head else frame)


class Front:
    """The listening socket and its connections."""

    def __init__(
        self,
        handle: Handler,
        fallback: Callable[[], asyncio.Protocol],
        posts: frozenset[bytes],
        gets: frozenset[bytes],
        header_timeout: float,
        body_timeout: float,
    ) -> None:
        self.handle = handle
        self.fallback = fallback
        """Makes aiohttp's protocol for a connection handed over."""
        self.posts = posts
        self.gets = gets
        """The paths whose plain POSTs and GETs the front reads."""
        self.header_timeout = header_timeout
        self.body_timeout = body_timeout
        self.connections: set[_FrontConnection] = set()
        self.closing = False
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int, backlog: int = 1024) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _FrontConnection(self), host, port, backlog=backlog
        )

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    async def shutdown(self, timeout: float) -> None:
        """Stop listening, close idle connections, let requests in flight finish (up to
        `timeout`), then cancel what is left. Connections handed to aiohttp are its own."""
        self.closing = True
        if self._server is not None:
            self._server.close()
        busy = [c.task for c in self.connections if c.task is not None]
        for connection in list(self.connections):
            if connection.task is None:
                connection.close()
        if busy:
            _, pending = await asyncio.wait(busy, timeout=timeout)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        for connection in list(self.connections):
            connection.close()


class _FrontConnection(asyncio.Protocol):
    def __init__(self, front: Front) -> None:
        self.front = front
        self.task: asyncio.Task[None] | None = None
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._head: FastHead | None = None
        self._body_at = 0
        """Where the body of the request whose head is read (`_head`) starts in the buffer."""
        self._scanned = 0
        """How much of the buffer has been looked through for the end of a head."""
        self._timer: asyncio.TimerHandle | None = None
        self._reading_paused = False
        self._drained: asyncio.Future[None] | None = None
        self._writing_paused = False

    # -- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        sock = self._transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.front.connections.add(self)
        self._wait_for_head()

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        if self.task is None:
            self._next()
        elif len(self._buffer) > PIPELINE_BYTES and not self._reading_paused:
            self._pause_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.front.connections.discard(self)
        self._cancel_timer()
        if self.task is not None:
            self.task.cancel()  # the client left: its request ends here (499)
        if self._drained is not None and not self._drained.done():
            self._drained.set_exception(ConnectionResetError("the client closed the connection"))

    def pause_writing(self) -> None:
        self._writing_paused = True

    def resume_writing(self) -> None:
        self._writing_paused = False
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    # -- requests ------------------------------------------------------------------------------

    def _next(self) -> None:
        """Start the request whose head and body are in the buffer; hand the connection over
        at the first request the front does not take. Bytes are scanned once each, however
        finely a client cuts its head."""
        buffer = self._buffer
        if self._head is None:
            seen = self._scanned
            end = buffer.find(b"\r\n\r\n", max(0, seen - 3), MAX_HEAD + 4)
            if end < 0:
                # Too long, or a bare LF (never in a plain head): aiohttp answers it now.
                bare_lf = buffer.count(b"\n", seen) != buffer.count(b"\r\n", max(0, seen - 1))
                if len(buffer) > MAX_HEAD or bare_lf:
                    self._hand_over()
                else:
                    self._scanned = len(buffer)
                return
            head = parse_fast_head(bytes(buffer[:end]), self.front.posts, self.front.gets)
            if head is None or head.content_length > FAST_BODY_BYTES:
                self._hand_over()
                return
            self._head, self._body_at = head, end + 4
            self._set_timer(self.front.body_timeout, self._body_late)
        size = self._body_at + self._head.content_length
        if len(buffer) < size:
            if self._reading_paused:
                self._resume_reading()
            return
        head, self._head = self._head, None
        body = bytes(buffer[self._body_at : size])
        del buffer[:size]
        self._scanned = 0
        self._cancel_timer()
        request = FastRequest(head, body, self)
        self.task = asyncio.get_running_loop().create_task(self._serve(request))

    async def _serve(self, request: FastRequest) -> None:
        answer = await self.front.handle(request)
        keep = not request.close and not self.front.closing
        if isinstance(answer, FrontStream):
            keep = keep and answer.eof_sent
        elif self._transport is not None and not self._transport.is_closing():
            if not isinstance(answer, web.Response):
                # Only whole answers and the front's streams are written here.
                answer, keep = error_response(APIError(500, FAILED)), False
            self._transport.write(_plain_answer(answer, close=not keep))
        self.task = None
        if not keep or self._transport is None or self._transport.is_closing():
            self.close()
            return
        self._wait_for_head()
        if self._reading_paused:
            self._resume_reading()
        if self._buffer:
            self._next()

    async def send(self, data: bytes) -> None:
        """Write to the client, waiting while its socket's buffer is full; ConnectionResetError
        once it has gone (as aiohttp's writer raises)."""
        transport = self._transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client closed the connection")
        transport.write(data)
        if self._writing_paused:
            self._drained = asyncio.get_running_loop().create_future()
            await self._drained

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def _hand_over(self) -> None:
        """From here on the connection is aiohttp's, from the first byte not yet answered."""
        transport = self._transport
        assert transport is not None and self.task is None
        self._cancel_timer()
        self.front.connections.discard(self)
        data = bytes(self._buffer)
        self._buffer.clear()
        protocol = self.front.fallback()
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        if self._reading_paused:
            transport.resume_reading()
        if data:
            protocol.data_received(data)

    # -- timers and flow -----------------------------------------------------------------------

    def _wait_for_head(self) -> None:
        self._set_timer(self.front.header_timeout, self._head_late)

    def _head_late(self) -> None:
        if self.task is None:
            self.close()

    def _body_late(self) -> None:
        if self.task is None and self._transport is not None:
            late = error_response(body_late(self.front.body_timeout))
            self._transport.write(_plain_answer(late, close=True))
            self.close()

    def _set_timer(self, delay: float, callback: Callable[[], None]) -> None:
        self._cancel_timer()
        self._timer = asyncio.get_running_loop().call_later(delay, callback)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _pause_reading(self) -> None:
        if self._transport is not None:
            self._transport.pause_reading()
            self._reading_paused = True

    def _resume_reading(self) -> None:
        if self._transport is not None:
            self._transport.resume_reading()
            self._reading_paused = False


def _plain_answer(answer: web.Response, close: bool) -> bytes:
    """A whole answer's bytes. One whose head would be unsafe (a replica's header relayed)
    becomes the router's 500, as aiohttp's server would answer it."""
    body = answer.body
    if not isinstance(body, bytes):
        body = b""
    headers = [
        (name, value)
        for name, value in answer.headers.items()
        if name.lower() not in ("content-length", "transfer-encoding", "connection")
    ]
    if body and "Content-Type" not in answer.headers:
        headers.append(("Content-Type", "application/octet-stream"))
    headers.append(("Content-Length", str(len(body))))
    if close:
        headers.append(("Connection", "close"))
    try:
        return response_head(answer.status, _reason(answer.status), headers) + body
    except ValueError:
        failed = error_response(APIError(500, FAILED))
        return _plain_answer(failed, close)


def _reason(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return ""
