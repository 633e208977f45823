"""A minimal Kubernetes API client for the router: JSON requests and watch streams.

Credentials are the pod's service account in a cluster, else the kubeconfig (through kopf's
login functions, which the operator uses too); a 401 logs in again, since service-account
tokens rotate.
"""

from __future__ import annotations

import json
import ssl
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


@dataclass(frozen=True)
class KubeConnection:
    server: str
    headers: Mapping[str, str] = field(default_factory=dict)
    ssl: ssl.SSLContext | bool = True


def login_from_environment() -> KubeConnection:
    import kopf

    settings = kopf.OperatorSettings()
    info = kopf.login_with_service_account(settings=settings) or kopf.login_with_kubeconfig(
        settings=settings
    )
    if info is None:
        raise ValueError("Kubernetes discovery: not in a cluster and no kubeconfig found")
    return KubeConnection(
        server=info.server.rstrip("/"),
        headers=info.as_http_headers(),
        ssl=info.as_ssl_context(),
    )


def default_namespace() -> str | None:
    """The pod's own namespace in a cluster; None (all namespaces) elsewhere."""
    try:
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or None
    except OSError:
        return None


class KubeError(Exception):
    def __init__(self, status: int, method: str, path: str, message: str) -> None:
        super().__init__(f"{method} {path}: HTTP {status}: {message[:300]}")
        self.status = status


class KubeClient:
    def __init__(self, login: Callable[[], KubeConnection]) -> None:
        self._login = login
        self._conn: KubeConnection | None = None
        self._session: aiohttp.ClientSession | None = None

    async def _connect(self, renew: bool = False) -> tuple[aiohttp.ClientSession, str]:
        if self._session is None or renew or self._conn is None:
            self._conn = self._login()
            if self._session is not None:
                # Watches on the old session end with an error and start again, re-listing.
                await self._session.close()
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=self._conn.ssl),
                headers={**self._conn.headers, "User-Agent": "fleetllm-router"},
            )
        return self._session, self._conn.server

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, str] | None = None,
        body: Any = None,
        content_type: str = "application/json",
        timeout: float = 30.0,
    ) -> dict[str, Any]:
        data = None if body is None else json.dumps(body)
        headers = {"Accept": "application/json", "Content-Type": content_type}
        for attempt in (1, 2):
            session, server = await self._connect(renew=attempt == 2)
            async with session.request(
                method,
                server + path,
                params=params,
                data=data,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=timeout),
            ) as response:
                text = await response.text()
                if response.status == 401 and attempt == 1:
                    continue
                if response.status >= 400:
                    raise KubeError(response.status, method, path, text)
                return json.loads(text) if text else {}
        raise AssertionError("unreachable")  # the loop returns or raises

    async def watch(
        self, path: str, params: Mapping[str, str], timeout_seconds: int = 300
    ) -> AsyncIterator[dict[str, Any]]:
        """The events of one watch request, until the server ends it."""
        query = {**params, "watch": "true", "timeoutSeconds": str(timeout_seconds)}
        for attempt in (1, 2):
            session, server = await self._connect(renew=attempt == 2)
            async with session.get(
                server + path,
                params=query,
                headers={"Accept": "application/json"},
                timeout=aiohttp.ClientTimeout(
                    total=None, sock_connect=30, sock_read=timeout_seconds + 30
                ),
            ) as response:
                if response.status == 401 and attempt == 1:
                    continue
                if response.status >= 400:
                    raise KubeError(response.status, "WATCH", path, await response.text())
                buffer = b""
                async for chunk in response.content.iter_any():
                    buffer += chunk
                    *lines, buffer = buffer.split(b"\n")
                    for line in lines:
                        if line.strip():
                            yield json.loads(line)
                return
