"""The proxy's own HTTP/1.1 client against scripted replicas: what it reads of well-formed
answers (Content-Length, chunked, to the close), when it keeps a connection and when not,
and that any bytes at all give an answer or an aiohttp.ClientError, never another error and
never a hang."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleetllm.httpread import read_bounded
from fleetllm.router.upstream import MAX_HEAD, MAX_HEADERS, UpstreamError, UpstreamPool

GUARD_S = 10.0
Script = Callable[[int], bytes]
"""The bytes a replica answers its n-th request (counted over all connections) with."""


class Replica:
    """A TCP server that reads each request (head and Content-Length body) and answers it
    with scripted bytes; after an answer marked to close, it closes the connection."""

    def __init__(self, script: Script, close_after: Callable[[int], bool]) -> None:
        self.script = script
        self.close_after = close_after
        self.connections = 0
        self.closed = 0
        self.requests: list[bytes] = []
        self.server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}/v1/completions"

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                body = await reader.readexactly(length)
                n = len(self.requests)
                self.requests.append(head + body)
                writer.write(self.script(n))
                await writer.drain()
                if self.close_after(n):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.closed += 1
            writer.close()


@asynccontextmanager
async def replica(
    script: Script, close_after: Callable[[int], bool] = lambda n: False
) -> AsyncIterator[Replica]:
    r = Replica(script, close_after)
    r.server = await asyncio.start_server(r.serve, "127.0.0.1", 0)
    try:
        yield r
    finally:
        r.server.close()


def chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)
EVENTS = [b'data: {"choices":[{"text":"a"}]}\n\n', b"data: [DONE]\n\n"]


async def read_all(pool: UpstreamPool, url: str, body: bytes = b"{}") -> tuple[int, bytes]:
    answer = await pool.post(url, body, {"Content-Type": "application/json"})
    try:
        data = await read_bounded(answer, 1 << 20)
    except BaseException:
        answer.close()
        raise
    answer.release()
    return answer.status, data


@pytest.mark.asyncio
async def test_a_chunked_stream_is_read_whole_and_its_connection_kept() -> None:
    async with replica(lambda n: SSE_HEAD + chunked(*EVENTS)) as r:
        pool = UpstreamPool(connect_timeout=GUARD_S)
        for _ in range(3):
            assert await read_all(pool, r.url, b'{"prompt": "x"}') == (200, b"".join(EVENTS))
        await pool.close()
    assert r.connections == 1
    first = r.requests[0]
    assert first.startswith(b"POST /v1/completions HTTP/1.1\r\n")
    assert b"\r\nContent-Length: 15\r\n" in first and first.endswith(b'{"prompt": "x"}')


@pytest.mark.asyncio
async def test_a_sized_answer_is_read_to_its_length_and_a_closing_one_is_not_kept() -> None:
    def answer(n: int) -> bytes:
        close = b"Connection: close\r\n" if n == 1 else b""
        return b"HTTP/1.1 404 Not Found\r\n" + close + b"Content-Length: 5\r\n\r\nnope!"

    async with replica(answer, close_after=lambda n: n == 1) as r:
        pool = UpstreamPool(connect_timeout=GUARD_S)
        for _ in range(3):
            assert await read_all(pool, r.url) == (404, b"nope!")
        await pool.close()
    assert r.connections == 2


@pytest.mark.asyncio
async def test_an_answer_without_a_length_is_read_to_the_close() -> None:
    async with replica(lambda n: b"HTTP/1.0 200 OK\r\n\r\nall of it", lambda n: True) as r:
        pool = UpstreamPool(connect_timeout=GUARD_S)
        assert await read_all(pool, r.url) == (200, b"all of it")
        assert await read_all(pool, r.url) == (200, b"all of it")
        await pool.close()
    assert r.connections == 2


@pytest.mark.asyncio
async def test_a_connection_the_replica_closed_while_idle_is_replaced_without_an_error() -> None:
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    # The replica closes after each answer without saying so: the kept connection is dead.
    async with replica(lambda n: ok, close_after=lambda n: True) as r:
        pool = UpstreamPool(connect_timeout=GUARD_S)
        for _ in range(3):
            assert await read_all(pool, r.url) == (200, b"ok")
            await asyncio.sleep(0.05)  # the close reaches the kept connection
        await pool.close()
    assert r.connections == 3


@pytest.mark.asyncio
async def test_idle_connections_to_a_replica_no_longer_asked_are_closed() -> None:
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    async with replica(lambda n: ok) as gone, replica(lambda n: ok) as staying:
        pool = UpstreamPool(connect_timeout=GUARD_S, keepalive_s=0.1)
        assert await read_all(pool, gone.url) == (200, b"ok")
        await asyncio.sleep(0.2)
        assert await read_all(pool, staying.url) == (200, b"ok")
        async with asyncio.timeout(GUARD_S):
            while gone.closed < 1:
                await asyncio.sleep(0.01)
        assert staying.closed == 0
        await pool.close()


@pytest.mark.asyncio
async def test_interim_answers_are_skipped() -> None:
    answer = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nx"
    async with replica(lambda n: answer) as r:
        pool = UpstreamPool(connect_timeout=GUARD_S)
        assert await read_all(pool, r.url) == (200, b"x")
        await pool.close()


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (b"SSH-2.0-OpenSSH\r\n\r\n", UpstreamError),
        (b"HTTP/1.1 2000 OK\r\n\r\n", UpstreamError),
        (b"HTTP/1.1 200 OK\r\n" + b"X: y\r\n" * (MAX_HEADERS + 1) + b"\r\n", UpstreamError),
        (b"HTTP/1.1 200 OK\r\nX: " + b"y" * MAX_HEAD + b"\r\n\r\n", UpstreamError),
        (b"HTTP/1.1 200 OK\r\nno colon\r\n\r\n", UpstreamError),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", UpstreamError),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", UpstreamError),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabcXY", UpstreamError),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n9\r\nabc", aiohttp.ClientError),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nabc", aiohttp.ClientError),
        (b"HTTP/1.1 200 OK\r\nContent", aiohttp.ServerDisconnectedError),
        (b"", aiohttp.ServerDisconnectedError),
    ],
)
async def test_malformed_answers_are_client_errors(answer: bytes, error: type) -> None:
    async with replica(lambda n: answer, close_after=lambda n: True) as r:
        pool = UpstreamPool(connect_timeout=GUARD_S)
        with pytest.raises(error):
            async with asyncio.timeout(GUARD_S):
                await read_all(pool, r.url)
        await pool.close()


@pytest.mark.asyncio
async def test_a_replica_that_is_not_there_is_a_connection_error() -> None:
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    pool = UpstreamPool(connect_timeout=GUARD_S)
    with pytest.raises(aiohttp.ClientConnectionError):
        await pool.post(f"http://127.0.0.1:{port}/v1/completions", b"{}", {})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=400), st.sampled_from([b"", SSE_HEAD, b"HTTP/1.1 200 OK\r\n"]))
def test_any_bytes_give_an_answer_or_a_client_error(noise: bytes, prefix: bytes) -> None:
    async def run() -> None:
        async with replica(lambda n: prefix + noise, close_after=lambda n: True) as r:
            pool = UpstreamPool(connect_timeout=GUARD_S)
            try:
                async with asyncio.timeout(GUARD_S):
                    status, _ = await read_all(pool, r.url)
                assert 100 <= status <= 999
            except aiohttp.ClientError:
                pass
            finally:
                await pool.close()

    asyncio.run(run())
