"""Reading a client's request body: bounded in size and in time, so that neither a huge body
nor one sent a byte at a time can hold the router's memory or a connection for long."""

from __future__ import annotations

import asyncio

from aiohttp import web

from fleetllm.router.errors import RouterError


async def read_body(request: web.Request, max_bytes: int, timeout: float) -> bytes:
    """The whole body; 413 past `max_bytes`, 408 when it has not all come after `timeout`."""
    too_large = RouterError(413, f"The body exceeds the limit of {max_bytes} bytes.")
    if (request.content_length or 0) > max_bytes:
        raise too_large
    try:
        async with asyncio.timeout(timeout):
            return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise too_large from None
    except TimeoutError:
        raise RouterError(
            408, f"The request body did not arrive within {timeout:g} seconds."
        ) from None
