"""LoRA adapters in the router: which a model has (from its discovery source), which replica
holds which (from each replica's /v1/models), and loading one where none does.

A request whose `model` names an adapter goes to a replica of the adapter's model that holds
it. When none does, the router loads it on the least loaded replica first (vLLM's
`/v1/load_lora_adapter`, which both backends serve), at most `MAX_LOADS` loads at a time over
all models and one at a time per adapter; requests for it wait on that one load. A load the
engine refuses is not retried at once: the adapter is backed off (doubling, up to
`FAILED_BACKOFF_MAX_S`) and its requests get 404 with the engine's reason until then, so a
broken adapter is never hammered into every replica. An adapter that its source reports as
failed (the operator could not pull or load it) gets 404 with that reason, and one whose files
are not in place yet gets 503 with Retry-After.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from fleetllm.lora_api import AdapterError, load_adapter
from fleetllm.router.errors import RouterError

MAX_LOADS = 4
"""Adapter loads in flight from one router, over all models and replicas."""
FAILED_BACKOFF_S = 5.0
FAILED_BACKOFF_MAX_S = 300.0
PENDING_RETRY_AFTER_S = 10


@dataclass(frozen=True)
class AdapterRoute:
    """An adapter of a model as its discovery source publishes it."""

    name: str
    """Its served name: what the engines and clients call it."""
    path: str | None = None
    """Where the replicas read its files; None while they are not in place."""
    error: str | None = None
    """Why it cannot be served (its files could not be had, or its replicas refused it)."""


def parse_static_adapters(doc: Any, where: str) -> tuple[AdapterRoute, ...]:
    """A static fleet's `adapters: {NAME: PATH}` of one model."""
    if doc is None:
        return ()
    if not isinstance(doc, dict):
        raise ValueError(f"{where}: expected a mapping of adapter names to paths")
    routes = []
    for name, path in doc.items():
        if not isinstance(name, str) or not name or "/" in name:
            raise ValueError(f"{where}: adapter names must be non-empty, without a slash")
        if not isinstance(path, str) or not path:
            raise ValueError(f"{where}.{name}: expected the adapter's path on the replicas")
        routes.append(AdapterRoute(name, path))
    return tuple(routes)


def adapters_of(obj: Mapping[str, Any]) -> tuple[AdapterRoute, ...]:
    """The adapters of an LLMDeployment: those its spec lists, each with where the operator
    put its files or why it could not (status.adapters)."""
    spec = obj.get("spec") or {}
    status = obj.get("status") or {}
    reported = {
        entry.get("name"): entry
        for entry in status.get("adapters") or []
        if isinstance(entry, Mapping)
    }
    routes = []
    for adapter in spec.get("adapters") or []:
        name = adapter.get("name") if isinstance(adapter, Mapping) else None
        if not isinstance(name, str) or not name:
            continue
        entry = reported.get(name) or {}
        path = entry.get("path")
        failed = entry.get("state") == "Failed"
        message = str(entry.get("message") or entry.get("reason") or "it failed")
        routes.append(
            AdapterRoute(
                name,
                path if isinstance(path, str) and path and not failed else None,
                message if failed else None,
            )
        )
    return tuple(routes)


@dataclass
class _Failures:
    count: int = 0
    until: float = -math.inf
    reason: str = ""


@dataclass
class AdapterLoads:
    """Loads of adapters onto replicas: bounded, one per adapter at a time, backed off when
    refused."""

    max_loads: int = MAX_LOADS
    backoff: float = FAILED_BACKOFF_S
    backoff_max: float = FAILED_BACKOFF_MAX_S
    _slots: asyncio.Semaphore | None = None
    _running: dict[tuple[str, str], asyncio.Future[None]] = field(default_factory=dict)
    _failures: dict[tuple[str, str], _Failures] = field(default_factory=dict)

    def refused(self, model: str, adapter: AdapterRoute) -> RouterError | None:
        """The answer for an adapter that cannot be served now, or None when a load may try."""
        if adapter.error is not None:
            return RouterError(
                404, f"The adapter `{adapter.name}` of `{model}` failed: {adapter.error}", "model"
            )
        failed = self._failures.get((model, adapter.name))
        if failed is not None and time.monotonic() < failed.until:
            return RouterError(
                404,
                f"The adapter `{adapter.name}` of `{model}` failed to load: {failed.reason}",
                "model",
            )
        if adapter.path is None:
            return RouterError(
                503,
                f"The adapter `{adapter.name}` of `{model}` is not ready yet.",
                headers={"Retry-After": str(PENDING_RETRY_AFTER_S)},
            )
        return None

    def forget(self, model: str, names: set[str]) -> None:
        """Drop the record of adapters a model no longer has."""
        for key in [k for k in self._failures if k[0] == model and k[1] not in names]:
            del self._failures[key]

    async def load(
        self,
        session: aiohttp.ClientSession,
        model: str,
        adapter: AdapterRoute,
        url: str,
        headers: Mapping[str, str],
        timeout: float,
    ) -> None:
        """Load `adapter` on the replica at `url`, or join the load of it already running;
        RouterError when it is refused (404, and backed off) or the replica is unavailable
        (503)."""
        key = (model, adapter.name)
        running = self._running.get(key)
        if running is None:
            running = asyncio.ensure_future(
                self._load(session, key, adapter, url, headers, timeout)
            )
            self._running[key] = running
            running.add_done_callback(lambda done: self._finished(key, done))
        await asyncio.shield(running)

    def _finished(self, key: tuple[str, str], done: asyncio.Future[None]) -> None:
        self._running.pop(key, None)
        if not done.cancelled():
            done.exception()  # retrieved: every request that waited on it has its answer

    async def _load(
        self,
        session: aiohttp.ClientSession,
        key: tuple[str, str],
        adapter: AdapterRoute,
        url: str,
        headers: Mapping[str, str],
        timeout: float,
    ) -> None:
        assert adapter.path is not None
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_loads)
        async with self._slots:
            try:
                await load_adapter(
                    session, url, adapter.name, adapter.path, headers=headers, timeout=timeout
                )
            except AdapterError as exc:
                if exc.transient:
                    raise RouterError(
                        503,
                        f"No replica of `{key[0]}` could load the adapter `{adapter.name}` "
                        f"now: {exc.message}",
                        headers={"Retry-After": str(PENDING_RETRY_AFTER_S)},
                    ) from None
                failed = self._failures.setdefault(key, _Failures())
                failed.count += 1
                wait = min(self.backoff_max, self.backoff * 2 ** min(failed.count - 1, 30))
                failed.until = time.monotonic() + wait
                failed.reason = exc.message
                raise RouterError(
                    404,
                    f"The adapter `{adapter.name}` of `{key[0]}` failed to load: {exc.message}",
                    "model",
                ) from None
        self._failures.pop(key, None)
