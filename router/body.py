"""Reading a client's request body: bounded in size and in time, so that neither a huge body
nor one sent a byte at a time can hold the router's memory or a connection for long."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from aiohttp import web

from fleetllm.router.errors import RouterError

if TYPE_CHECKING:
    from fleetllm.router.front import FastRequest


async def read_body(request: web.Request | FastRequest, max_bytes: int, timeout: float) -> bytes:
    """The whole body; 413 past `max_bytes`, 408 when it has not all come after `timeout`."""
    if (request.content_length or 0) > max_bytes:
        raise _too_large(max_bytes)
    if not isinstance(request, web.Request):
        return request.body  # the front read it whole, within the same timeout
    try:
        if request.content.is_eof():
            # All of it came with the headers (the common case): nothing to wait for, so no
            # timer to set on the way to the replica.
            return await request.read()
        async with asyncio.timeout(timeout):
            return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise _too_large(max_bytes) from None
    except TimeoutError:
        raise body_late(timeout) from None


def _too_large(max_bytes: int) -> RouterError:
    return RouterError(413, f"The body exceeds the limit of {max_bytes} bytes.")


def body_late(timeout: float) -> RouterError:
    return RouterError(408, f"The request body did not arrive within {timeout:g} seconds.")
