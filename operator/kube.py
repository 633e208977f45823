"""A small async Kubernetes API client for the reconciler: read, server-side apply, status.

kopf watches and dispatches; this client does the reconciler's own reads and writes with the
same credentials (a `kopf.ConnectionInfo` from the login function), so that children are
written with server-side apply as field manager `fleetllm`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import kopf

from fleetllm.operator.api import GROUP, PLURAL, VERSION

FIELD_MANAGER = "fleetllm"


@dataclass(frozen=True)
class Resource:
    api_version: str
    plural: str

    def path(self, namespace: str, name: str | None = None, subresource: str | None = None) -> str:
        prefix = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        path = f"{prefix}/namespaces/{namespace}/{self.plural}"
        if name is not None:
            path += f"/{name}"
        if subresource is not None:
            path += f"/{subresource}"
        return path


RESOURCES: dict[str, Resource] = {
    "LLMDeployment": Resource(f"{GROUP}/{VERSION}", PLURAL),
    "ConfigMap": Resource("v1", "configmaps"),
    "Service": Resource("v1", "services"),
    "Deployment": Resource("apps/v1", "deployments"),
    "PodDisruptionBudget": Resource("policy/v1", "poddisruptionbudgets"),
    # Read only: whether the replicas can share a model's claim.
    "PersistentVolumeClaim": Resource("v1", "persistentvolumeclaims"),
}
READ_ONLY_KINDS = frozenset({"PersistentVolumeClaim"})


class ApiError(Exception):
    def __init__(self, status: int, method: str, path: str, message: str) -> None:
        super().__init__(f"{method} {path}: HTTP {status}: {message}")
        self.status = status

    @property
    def conflict(self) -> bool:
        return self.status == 409

    @property
    def retryable(self) -> bool:
        return self.status in (409, 429) or self.status >= 500


class KubeClient:
    """Requests with the operator's credentials; a 401 logs in again once."""

    def __init__(self, login: Callable[[], kopf.ConnectionInfo], timeout: float = 30.0) -> None:
        self._login = login
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None
        self._server = ""
        self._lock = asyncio.Lock()

    async def _connect(self, renew: bool = False) -> aiohttp.ClientSession:
        async with self._lock:
            if self._session is not None and not renew:
                return self._session
            if self._session is not None:
                await self._session.close()
            info = self._login()
            self._server = info.server.rstrip("/")
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=info.as_ssl_context()),
                headers={**info.as_http_headers(), "User-Agent": f"{FIELD_MANAGER}-operator"},
                timeout=self._timeout,
            )
            return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, str] | None = None,
        body: Any = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type, "Accept": "application/json"}
        for attempt in (1, 2):
            session = await self._connect(renew=attempt == 2)
            async with session.request(
                method, self._server + path, params=params, data=data, headers=headers
            ) as response:
                if response.status == 401 and attempt == 1:
                    continue
                text = await response.text()
                if response.status >= 400:
                    raise ApiError(response.status, method, path, _error_message(text))
                return json.loads(text) if text else {}
        raise AssertionError("unreachable")

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await self.request("GET", RESOURCES[kind].path(namespace, name))
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply: create or update the fields fleetllm owns, drop those it no
        longer sets, leave other managers' fields alone."""
        meta = obj["metadata"]
        path = RESOURCES[obj["kind"]].path(meta["namespace"], meta["name"])
        return await self.request(
            "PATCH",
            path,
            params={"fieldManager": FIELD_MANAGER, "force": "true"},
            body=obj,
            content_type="application/apply-patch+yaml",
        )

    async def patch_status(
        self,
        kind: str,
        namespace: str,
        name: str,
        status: dict[str, Any],
        resource_version: str | None,
    ) -> dict[str, Any]:
        """Merge-patch the status subresource; with a resourceVersion, fail with 409 if the
        object changed since it was read (so a stale plan never overwrites a newer one)."""
        body: dict[str, Any] = {"status": status}
        if resource_version is not None:
            body["metadata"] = {"resourceVersion": resource_version}
        return await self.request(
            "PATCH",
            RESOURCES[kind].path(namespace, name, "status"),
            body=body,
            content_type="application/merge-patch+json",
        )


def _error_message(text: str) -> str:
    try:
        payload = json.loads(text)
    except ValueError:
        return text[:500]
    if isinstance(payload, dict):
        return str(payload.get("message") or payload.get("reason") or payload)[:500]
    return text[:500]
