"""`KubeClient`: the verbs fleetllm uses on the API server, over one logged-in session.

Paths are of `Resource`s; objects are plain dicts as the API serves them.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import socket
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp

from fleetllm.kube.errors import ApiError
from fleetllm.kube.events import EventType, event_about
from fleetllm.kube.login import Credentials, load_credentials
from fleetllm.kube.resources import EVENTS, Resource
from fleetllm.kube.session import ApiSession
from fleetllm.kube.watch import Backoff, Resync, WatchDecoder, WatchEvent

log = logging.getLogger("fleetllm.kube")

DEFAULT_FIELD_MANAGER = "fleetllm"

PatchType = Literal["merge", "json", "strategic"]
PATCH_CONTENT_TYPES: dict[str, str] = {
    "merge": "application/merge-patch+json",
    "json": "application/json-patch+json",
    "strategic": "application/strategic-merge-patch+json",
}


@dataclass(frozen=True)
class Listing:
    items: list[dict[str, Any]]
    resource_version: str


def _selectors(label_selector: str | None, field_selector: str | None) -> dict[str, str]:
    params = {}
    if label_selector:
        params["labelSelector"] = label_selector
    if field_selector:
        params["fieldSelector"] = field_selector
    return params


class KubeClient(ApiSession):
    """Reads, writes and watches; writes are made as `field_manager` unless a call names
    another."""

    def __init__(
        self,
        load: Callable[[], Credentials] = load_credentials,
        *,
        user_agent: str = "fleetllm",
        field_manager: str = DEFAULT_FIELD_MANAGER,
        timeout: float = 30.0,
    ) -> None:
        super().__init__(load, user_agent=user_agent, timeout=timeout)
        self.field_manager = field_manager

    # -- reads -------------------------------------------------------------------------------

    async def get(
        self, resource: Resource, name: str, namespace: str | None = None
    ) -> dict[str, Any] | None:
        """The object, or None if there is none."""
        return await self._get_or_none(resource.path(namespace, name))

    async def list(
        self,
        resource: Resource,
        namespace: str | None = None,
        *,
        label_selector: str | None = None,
        field_selector: str | None = None,
        page_size: int = 500,
    ) -> Listing:
        """Every matching object, fetched in pages of `page_size` (limit/continue), and the
        resourceVersion to watch from. A continue token that expired starts the list again."""
        base = {**_selectors(label_selector, field_selector), "limit": str(page_size)}
        path = resource.path(namespace)
        for _ in range(3):
            items: list[dict[str, Any]] = []
            params, version = base, ""
            try:
                while True:
                    page = await self.request("GET", path, params=params)
                    items += page.get("items") or []
                    meta = page.get("metadata") or {}
                    version = version or str(meta.get("resourceVersion") or "")
                    token = meta.get("continue")
                    if not token:
                        return Listing(items, version)
                    params = {**base, "continue": token}
            except ApiError as exc:
                if not (exc.gone and params is not base):
                    raise
                log.info("list of %s expired between pages, listing again", path)
        raise ApiError(410, "Expired", "the list kept expiring between pages", "GET", path)

    async def get_scale(
        self, resource: Resource, name: str, namespace: str | None = None
    ) -> dict[str, Any] | None:
        """The scale subresource (an autoscaling/v1 Scale), or None if there is no object."""
        return await self._get_or_none(resource.path(namespace, name, "scale"))

    async def _get_or_none(self, path: str) -> dict[str, Any] | None:
        try:
            return await self.request("GET", path)
        except ApiError as exc:
            if exc.not_found:
                return None
            raise

    # -- writes ------------------------------------------------------------------------------

    def _manager(self, field_manager: str | None) -> dict[str, str]:
        return {"fieldManager": field_manager or self.field_manager}

    async def create(
        self,
        resource: Resource,
        obj: Mapping[str, Any],
        namespace: str | None = None,
        *,
        field_manager: str | None = None,
    ) -> dict[str, Any]:
        namespace = namespace or (obj.get("metadata") or {}).get("namespace")
        return await self.request(
            "POST", resource.path(namespace), params=self._manager(field_manager), body=obj
        )

    async def apply(
        self,
        resource: Resource,
        obj: Mapping[str, Any],
        *,
        field_manager: str | None = None,
        force: bool = True,
    ) -> dict[str, Any]:
        """Server-side apply: create the object or set the fields this manager owns, drop
        those it no longer sets, leave other managers' fields alone."""
        meta = obj["metadata"]
        params = self._manager(field_manager)
        if force:
            params["force"] = "true"
        return await self.request(
            "PATCH",
            resource.path(meta.get("namespace"), meta["name"]),
            params=params,
            body=obj,
            content_type="application/apply-patch+yaml",
        )

    async def patch(
        self,
        resource: Resource,
        name: str,
        patch: Any,
        namespace: str | None = None,
        *,
        patch_type: PatchType = "merge",
        subresource: str | None = None,
        field_manager: str | None = None,
    ) -> dict[str, Any]:
        """A merge patch (a dict), a JSON patch (a list of operations) or a strategic merge
        patch (built-in kinds only)."""
        return await self.request(
            "PATCH",
            resource.path(namespace, name, subresource),
            params=self._manager(field_manager),
            body=patch,
            content_type=PATCH_CONTENT_TYPES[patch_type],
        )

    async def patch_status(
        self,
        resource: Resource,
        name: str,
        status: Mapping[str, Any],
        namespace: str | None = None,
        *,
        resource_version: str | None = None,
        field_manager: str | None = None,
    ) -> dict[str, Any]:
        """Merge-patch the status subresource (None values delete keys)."""
        return await self._patch_subresource(
            resource, name, "status", {"status": status}, namespace, resource_version, field_manager
        )

    async def patch_scale(
        self,
        resource: Resource,
        name: str,
        replicas: int,
        namespace: str | None = None,
        *,
        resource_version: str | None = None,
        field_manager: str | None = None,
    ) -> dict[str, Any]:
        """Set spec.replicas through the scale subresource (as `kubectl scale` does)."""
        body = {"spec": {"replicas": replicas}}
        return await self._patch_subresource(
            resource, name, "scale", body, namespace, resource_version, field_manager
        )

    async def _patch_subresource(
        self,
        resource: Resource,
        name: str,
        subresource: str,
        body: dict[str, Any],
        namespace: str | None,
        resource_version: str | None,
        field_manager: str | None,
    ) -> dict[str, Any]:
        """A merge patch of a subresource; with a resourceVersion, a 409 ApiError if the
        object changed since it was read."""
        if resource_version is not None:
            body = {**body, "metadata": {"resourceVersion": resource_version}}
        return await self.patch(
            resource, name, body, namespace, subresource=subresource, field_manager=field_manager
        )

    async def delete(self, resource: Resource, name: str, namespace: str | None = None) -> bool:
        """Delete the object, its dependents after it (background propagation); False if
        there was none."""
        try:
            await self.request(
                "DELETE",
                resource.path(namespace, name),
                params={"propagationPolicy": "Background"},
            )
        except ApiError as exc:
            if exc.not_found:
                return False
            raise
        return True

    async def create_event(
        self,
        involved: Mapping[str, Any],
        *,
        type: EventType,
        reason: str,
        message: str,
        component: str,
        action: str | None = None,
    ) -> dict[str, Any]:
        """A core/v1 Event about `involved` (an object as read from the API), in its
        namespace, as `kubectl describe` shows them."""
        event = event_about(
            involved,
            type=type,
            reason=reason,
            message=message,
            component=component,
            instance=socket.gethostname(),
            now=datetime.datetime.now(datetime.UTC),
            action=action,
        )
        return await self.create(EVENTS, event, event["metadata"]["namespace"])

    # -- watches -----------------------------------------------------------------------------

    async def watch(
        self,
        resource: Resource,
        namespace: str | None = None,
        *,
        resource_version: str | None = None,
        label_selector: str | None = None,
        field_selector: str | None = None,
        timeout_seconds: int = 300,
    ) -> AsyncIterator[WatchEvent]:
        """The events of one watch request, from `resource_version` (None: the current
        objects as ADDED, then changes), with bookmarks, until the server ends it after
        about `timeout_seconds`. An ERROR event raises ApiError (410 Gone: list again)."""
        params = {
            **_selectors(label_selector, field_selector),
            "watch": "true",
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(timeout_seconds),
        }
        if resource_version:
            params["resourceVersion"] = resource_version
        path = resource.path(namespace)
        response = await self._open(
            "GET",
            path,
            params=params,
            data=None,
            content_type="",
            timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=10.0, sock_read=timeout_seconds + 30.0
            ),
        )
        decoder = WatchDecoder(path)
        async with response:
            async for chunk in response.content.iter_any():
                for event in decoder.feed(chunk):
                    yield event

    async def follow(
        self,
        resource: Resource,
        namespace: str | None = None,
        *,
        label_selector: str | None = None,
        field_selector: str | None = None,
        page_size: int = 500,
        timeout_seconds: int = 300,
        backoff: Backoff | None = None,
    ) -> AsyncIterator[Resync | WatchEvent]:
        """List, then watch, forever: a `Resync` with every object after each (re)list, then
        ADDED/MODIFIED/DELETED events. Watches resume from the last resourceVersion seen
        (bookmarks included); 410 Gone lists again; other failures are retried after an
        exponential backoff. Never raises but on cancellation."""
        backoff = backoff or Backoff()
        path = resource.path(namespace)
        selectors = {"label_selector": label_selector, "field_selector": field_selector}
        version: str | None = None
        while True:
            started, seen = time.monotonic(), 0
            try:
                if version is None:
                    listing = await self.list(resource, namespace, page_size=page_size, **selectors)
                    version = listing.resource_version
                    backoff.reset()
                    yield Resync(listing.items, version)
                events = self.watch(
                    resource,
                    namespace,
                    resource_version=version,
                    timeout_seconds=timeout_seconds,
                    **selectors,
                )
                async with contextlib.aclosing(events):
                    async for event in events:
                        seen += 1
                        version = event.resource_version or version
                        backoff.reset()
                        if event.type != "BOOKMARK":
                            yield event
                if seen or time.monotonic() - started >= 1.0:
                    continue  # the server ended the watch at its timeout: resume
                failure = "the watch ended at once"
            except ApiError as exc:
                if exc.gone:
                    log.info("watch of %s expired (410), listing again", path)
                    version = None
                    continue
                failure = str(exc)
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                failure = f"{type(exc).__name__}: {exc}"
            delay = backoff.next()
            log.warning("watch of %s failed, retrying in %.1f s: %s", path, delay, failure)
            await asyncio.sleep(delay)
