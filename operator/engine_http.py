"""The operator's one HTTP session to engine replicas (the autoscaler's scrapes of /metrics,
the adapter loader's calls to the LoRA adapter API), made on first use and closed with the
operator."""

from __future__ import annotations

import aiohttp


class EngineHttp:
    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession()
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
