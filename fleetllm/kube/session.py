"""The one HTTP session to the API server, logged in: a request answers with a success status
or raises `ApiError`; an answer of 401 logs in again and tries once more."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Mapping
from typing import Any, Self

import aiohttp

from fleetllm.kube.errors import error_from_answer
from fleetllm.kube.login import Credentials, load_credentials

log = logging.getLogger("fleetllm.kube")


class ApiSession:
    """Calls to the API server on one aiohttp session (made on first use, in the running event
    loop), with the credentials of the moment."""

    def __init__(
        self,
        load: Callable[[], Credentials] = load_credentials,
        *,
        user_agent: str = "fleetllm",
        timeout: float = 30.0,
    ) -> None:
        self._load = load
        self.user_agent = user_agent
        self._timeout = aiohttp.ClientTimeout(total=timeout, sock_connect=min(timeout, 10.0))
        self._credentials: Credentials | None = None
        self._login_lock = asyncio.Lock()
        self._session: aiohttp.ClientSession | None = None

    # -- login -------------------------------------------------------------------------------

    async def credentials(self, *, refresh: bool = False) -> Credentials:
        """The current credentials, loaded again when stale or when `refresh` is asked."""
        current = self._credentials
        if current is not None and not refresh and not current.stale():
            return current
        async with self._login_lock:
            if self._credentials is not current and self._credentials is not None:
                return self._credentials  # another task logged in meanwhile
            self._credentials = await asyncio.to_thread(self._load)
            if current is not None:
                log.info("logged in to Kubernetes again (%s)", self._credentials.source)
            return self._credentials

    async def _rejected(self, used: Credentials) -> None:
        """The server answered 401 to `used`: log in again, once for all concurrent callers."""
        async with self._login_lock:
            if self._credentials is used:
                self._credentials = await asyncio.to_thread(self._load)
                log.info(
                    "credentials rejected (HTTP 401), logged in again (%s)",
                    self._credentials.source,
                )

    # -- transport ---------------------------------------------------------------------------

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0), timeout=self._timeout
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def _open(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, str] | None,
        data: bytes | None,
        content_type: str,
        timeout: aiohttp.ClientTimeout | None,
    ) -> aiohttp.ClientResponse:
        """A response with a success status (the caller releases it); a 401 logs in again and
        tries once more."""
        for attempt in (1, 2):
            credentials = await self.credentials()
            headers = {"Accept": "application/json", "User-Agent": self.user_agent}
            if data is not None:
                headers["Content-Type"] = content_type
            if authorization := credentials.authorization():
                headers["Authorization"] = authorization
            response = await self._http().request(
                method,
                credentials.server + path,
                params=params,
                data=data,
                headers=headers,
                ssl=credentials.ssl_context,
                timeout=timeout or self._timeout,
            )
            if response.status == 401 and attempt == 1:
                response.release()
                await self._rejected(credentials)
                continue
            if response.status >= 400:
                try:
                    text = await response.text()
                finally:
                    response.release()
                raise error_from_answer(response.status, text, method, path)
            return response
        raise AssertionError("unreachable")  # the loop returns or raises

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, str] | None = None,
        body: Any = None,
        content_type: str = "application/json",
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """One API call; the decoded JSON answer. Raises ApiError for error statuses."""
        data = None if body is None else json.dumps(body).encode()
        response = await self._open(
            method,
            path,
            params=params,
            data=data,
            content_type=content_type,
            timeout=None if timeout is None else aiohttp.ClientTimeout(total=timeout),
        )
        async with response:
            text = await response.text()
        return json.loads(text) if text else {}
