"""The one Kubernetes access layer of fleetllm: login, reads, writes and watches.

The operator, the router and the autoscaler all talk to the API server through `KubeClient`:
async calls on one aiohttp session, errors as `ApiError`.

Login goes through the configuration loaders of the `kubernetes` package, so every way
kubectl logs in works here too: the pod's service account in a cluster, else a kubeconfig
(tokens, client certificates, exec credential plugins as on EKS and GKE, auth providers).
Credentials are loaded again when they are about to expire (the exec plugin's
`expirationTimestamp`), every minute in a cluster (the kubelet rotates the service-account
token file), and whenever the server answers 401. kopf gets the same credentials from
`Credentials.connection_info()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import logging
import os
import random
import socket
import ssl
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import aiohttp

if TYPE_CHECKING:
    import kopf

log = logging.getLogger("fleetllm.kube")

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
# client-go reads the service-account token file again after a minute; so do we.
TOKEN_FILE_RELOAD_SECONDS = 60.0
# Credentials with an expiry are renewed this long before it.
EXPIRY_MARGIN_SECONDS = 30.0
DEFAULT_FIELD_MANAGER = "fleetllm"
EVENT_MESSAGE_LIMIT = 1024

PatchType = Literal["merge", "json", "strategic"]
PATCH_CONTENT_TYPES: dict[str, str] = {
    "merge": "application/merge-patch+json",
    "json": "application/json-patch+json",
    "strategic": "application/strategic-merge-patch+json",
}


# -- login -----------------------------------------------------------------------------------


class LoginError(ValueError):
    """No usable credentials: not in a cluster and no kubeconfig, or a broken one."""


@dataclass(frozen=True)
class Credentials:
    """Where the API server is and how to authenticate to it, as loaded at one moment."""

    server: str
    scheme: str | None = None
    """Of the Authorization header: `Bearer` or `Basic`; None without one."""
    token: str | None = None
    ca_path: str | None = None
    client_cert_path: str | None = None
    client_key_path: str | None = None
    insecure: bool = False
    namespace: str | None = None
    """The service account's namespace in a cluster, else the kubeconfig context's."""
    in_cluster: bool = False
    expires_at: datetime.datetime | None = None
    """When the token stops working, where the login says so (exec plugins, auth providers)."""
    reload_at: float | None = None
    """Unix time after which the credentials are loaded again; None: only after a 401."""
    source: str = ""

    def authorization(self) -> str | None:
        if self.scheme and self.token:
            return f"{self.scheme} {self.token}"
        return None

    def stale(self, now: float | None = None) -> bool:
        return self.reload_at is not None and (now or time.time()) >= self.reload_at

    @cached_property
    def ssl_context(self) -> ssl.SSLContext | bool:
        """For aiohttp's `ssl=`: False skips verification (insecure-skip-tls-verify)."""
        if self.insecure:
            return False
        context = ssl.create_default_context(cafile=self.ca_path)
        if self.client_cert_path and self.client_key_path:
            context.load_cert_chain(self.client_cert_path, self.client_key_path)
        return context

    def connection_info(self) -> kopf.ConnectionInfo:
        """The same credentials for kopf (its `@kopf.on.login` handler returns this)."""
        import kopf

        return kopf.ConnectionInfo(
            server=self.server,
            ca_path=self.ca_path,
            insecure=self.insecure or None,
            scheme=self.scheme,
            token=self.token,
            certificate_path=self.client_cert_path,
            private_key_path=self.client_key_path,
            default_namespace=self.namespace,
            expiration=self.expires_at,
        )


def load_credentials(
    *,
    kubeconfig: str | os.PathLike[str] | None = None,
    context: str | None = None,
    service_account_dir: Path = SERVICE_ACCOUNT_DIR,
    environ: Mapping[str, str] = os.environ,
) -> Credentials:
    """Credentials, looked for as controller-runtime does: the `kubeconfig` given, else
    $KUBECONFIG, else the pod's service account in a cluster, else ~/.kube/config.
    Blocking: an exec plugin may run."""
    from kubernetes.config import ConfigException

    try:
        path = kubeconfig or environ.get("KUBECONFIG")
        if not path and environ.get("KUBERNETES_SERVICE_HOST"):
            return _load_in_cluster(service_account_dir, environ)
        return _load_kubeconfig(os.fspath(path or "~/.kube/config"), context)
    except ConfigException as exc:
        raise LoginError(f"cannot log in to Kubernetes: {exc}") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        if isinstance(exc, LoginError):
            raise
        raise LoginError(f"cannot log in to Kubernetes: {type(exc).__name__}: {exc}") from None


def _load_in_cluster(directory: Path, environ: Mapping[str, str]) -> Credentials:
    from kubernetes.client import Configuration
    from kubernetes.config.incluster_config import InClusterConfigLoader

    config = Configuration()
    InClusterConfigLoader(
        token_filename=str(directory / "token"),
        cert_filename=str(directory / "ca.crt"),
        try_refresh_token=False,  # we load again ourselves, on our one session
        environ=dict(environ),
    ).load_and_set(config)
    try:
        namespace = (directory / "namespace").read_text().strip() or None
    except OSError:
        namespace = None
    return _from_configuration(
        config,
        namespace=namespace,
        in_cluster=True,
        expires_at=None,
        reload_at=time.time() + TOKEN_FILE_RELOAD_SECONDS,
        source=f"service account {directory}",
    )


def _load_kubeconfig(path: str, context: str | None) -> Credentials:
    from kubernetes.client import Configuration
    from kubernetes.config.kube_config import KubeConfigLoader, KubeConfigMerger

    merged = KubeConfigMerger(path)
    if merged.config is None:
        raise LoginError(
            f"cannot log in to Kubernetes: not in a cluster and no kubeconfig at {path} "
            "(set KUBECONFIG or run in a pod with a service account)"
        )
    loader = KubeConfigLoader(config_dict=merged.config, active_context=context)
    config = Configuration()
    loader.load_and_set(config)
    current = loader.current_context
    user = _kubeconfig_user(merged.config.value, current["context"].get("user"))
    if "exec" in user and not (config.api_key.get("BearerToken") or config.cert_file):
        # The loader logs the plugin's failure and carries on without credentials.
        raise LoginError(
            f"the exec credential plugin of kubeconfig user {current['context'].get('user')!r} "
            f"({user['exec'].get('command')}) gave no credentials; its error is logged above"
        )
    expiry: datetime.datetime | None = getattr(loader, "expiry", None)
    reload_at = None
    if expiry is not None:
        if expiry.tzinfo is None:
            expiry = expiry.replace(tzinfo=datetime.UTC)
        reload_at = expiry.timestamp() - EXPIRY_MARGIN_SECONDS
    return _from_configuration(
        config,
        namespace=current["context"].get("namespace"),
        in_cluster=False,
        expires_at=expiry,
        reload_at=reload_at,
        source=f"kubeconfig {path} context {current.get('name')!r}",
    )


def _kubeconfig_user(config: Mapping[str, Any], name: str | None) -> Mapping[str, Any]:
    for entry in config.get("users") or []:
        value = getattr(entry, "value", entry)  # the merger wraps entries in ConfigNodes
        if value.get("name") == name:
            return value.get("user") or {}
    return {}


def _from_configuration(
    config: Any,
    *,
    namespace: str | None,
    in_cluster: bool,
    expires_at: datetime.datetime | None,
    reload_at: float | None,
    source: str,
) -> Credentials:
    header = config.api_key.get("BearerToken") or ""
    scheme, _, token = header.partition(" ")
    if scheme.lower() == "bearer":
        scheme = "Bearer"
    return Credentials(
        server=str(config.host).rstrip("/"),
        scheme=scheme or None,
        token=token.strip() or None,
        ca_path=config.ssl_ca_cert or None,
        client_cert_path=config.cert_file or None,
        client_key_path=config.key_file or None,
        insecure=not config.verify_ssl,
        namespace=namespace,
        in_cluster=in_cluster,
        expires_at=expires_at,
        reload_at=reload_at,
        source=source,
    )


# -- resources and errors --------------------------------------------------------------------


@dataclass(frozen=True)
class Resource:
    """One kind of object: where its URLs live."""

    api_version: str
    plural: str
    kind: str
    namespaced: bool = True

    def path(
        self, namespace: str | None = None, name: str | None = None, subresource: str | None = None
    ) -> str:
        """Without a namespace, a namespaced resource's path spans all namespaces (lists and
        watches only)."""
        prefix = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        if self.namespaced and namespace:
            prefix += f"/namespaces/{namespace}"
        elif self.namespaced and name is not None:
            raise ValueError(f"{self.kind} {name}: a namespace is needed")
        path = f"{prefix}/{self.plural}"
        if name is not None:
            path += f"/{name}"
        if subresource is not None:
            path += f"/{subresource}"
        return path


CONFIGMAPS = Resource("v1", "configmaps", "ConfigMap")
SECRETS = Resource("v1", "secrets", "Secret")
SERVICES = Resource("v1", "services", "Service")
PODS = Resource("v1", "pods", "Pod")
PERSISTENTVOLUMECLAIMS = Resource("v1", "persistentvolumeclaims", "PersistentVolumeClaim")
EVENTS = Resource("v1", "events", "Event")
DEPLOYMENTS = Resource("apps/v1", "deployments", "Deployment")
PODDISRUPTIONBUDGETS = Resource("policy/v1", "poddisruptionbudgets", "PodDisruptionBudget")
ENDPOINTSLICES = Resource("discovery.k8s.io/v1", "endpointslices", "EndpointSlice")
HORIZONTALPODAUTOSCALERS = Resource(
    "autoscaling/v2", "horizontalpodautoscalers", "HorizontalPodAutoscaler"
)


class ApiError(Exception):
    """An answer of the API server with an error status (also an ERROR event in a watch)."""

    def __init__(self, status: int, reason: str, message: str, method: str, path: str) -> None:
        super().__init__(f"{method} {path}: HTTP {status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message

    @property
    def not_found(self) -> bool:
        return self.status == 404

    @property
    def conflict(self) -> bool:
        return self.status == 409

    @property
    def gone(self) -> bool:
        """410: a resourceVersion or continue token too old to resume from; list again."""
        return self.status == 410

    @property
    def retryable(self) -> bool:
        return self.status in (409, 429) or self.status >= 500


def _api_error(status: int, text: str, method: str, path: str) -> ApiError:
    reason, message = "", text[:500]
    try:
        payload = json.loads(text)
    except ValueError:
        payload = None
    if isinstance(payload, dict):
        reason = str(payload.get("reason") or "")
        message = str(payload.get("message") or reason or payload)[:500]
    return ApiError(status, reason, message, method, path)


# -- reads, writes, watches ------------------------------------------------------------------


@dataclass(frozen=True)
class Listing:
    items: list[dict[str, Any]]
    resource_version: str


@dataclass(frozen=True)
class WatchEvent:
    type: str
    """ADDED, MODIFIED, DELETED or BOOKMARK."""
    object: dict[str, Any]

    @property
    def resource_version(self) -> str | None:
        return (self.object.get("metadata") or {}).get("resourceVersion")


@dataclass(frozen=True)
class Resync:
    """`follow` listed the resource again: these are all the objects there are now; anything
    not among them is gone."""

    items: list[dict[str, Any]]
    resource_version: str


@dataclass
class Backoff:
    """Exponential delays with jitter, reset after a success."""

    initial: float = 0.5
    maximum: float = 30.0
    failures: int = field(default=0, init=False)

    def next(self) -> float:
        delay = min(self.maximum, self.initial * 2.0**self.failures)
        self.failures += 1
        return delay * random.uniform(0.5, 1.0)

    def reset(self) -> None:
        self.failures = 0


def _selectors(label_selector: str | None, field_selector: str | None) -> dict[str, str]:
    params = {}
    if label_selector:
        params["labelSelector"] = label_selector
    if field_selector:
        params["fieldSelector"] = field_selector
    return params


class KubeClient:
    """Async calls to the API server on one aiohttp session (made on first use, in the running
    event loop). Paths are of `Resource`s; objects are plain dicts as the API serves them."""

    def __init__(
        self,
        load: Callable[[], Credentials] = load_credentials,
        *,
        user_agent: str = "fleetllm",
        field_manager: str = DEFAULT_FIELD_MANAGER,
        timeout: float = 30.0,
    ) -> None:
        self._load = load
        self.user_agent = user_agent
        self.field_manager = field_manager
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

    async def __aenter__(self) -> KubeClient:
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
                raise _api_error(response.status, text, method, path)
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

    # -- reads -------------------------------------------------------------------------------

    async def get(
        self, resource: Resource, name: str, namespace: str | None = None
    ) -> dict[str, Any] | None:
        """The object, or None if there is none."""
        try:
            return await self.request("GET", resource.path(namespace, name))
        except ApiError as exc:
            if exc.not_found:
                return None
            raise

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
        try:
            return await self.request("GET", resource.path(namespace, name, "scale"))
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
        """Merge-patch the status subresource (None values delete keys). With a
        resourceVersion, a 409 ApiError if the object changed since it was read."""
        body: dict[str, Any] = {"status": status}
        if resource_version is not None:
            body["metadata"] = {"resourceVersion": resource_version}
        return await self.patch(
            resource, name, body, namespace, subresource="status", field_manager=field_manager
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
        body: dict[str, Any] = {"spec": {"replicas": replicas}}
        if resource_version is not None:
            body["metadata"] = {"resourceVersion": resource_version}
        return await self.patch(
            resource, name, body, namespace, subresource="scale", field_manager=field_manager
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
        type: Literal["Normal", "Warning"],
        reason: str,
        message: str,
        component: str,
        action: str | None = None,
    ) -> dict[str, Any]:
        """A core/v1 Event about `involved` (an object as read from the API), in its
        namespace, as `kubectl describe` shows them."""
        meta = involved.get("metadata") or {}
        namespace = meta.get("namespace") or "default"
        now = datetime.datetime.now(datetime.UTC)
        stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
        event: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta.get('name', 'object')}.", "namespace": namespace},
            "involvedObject": {
                key: value
                for key, value in {
                    "apiVersion": involved.get("apiVersion"),
                    "kind": involved.get("kind"),
                    "name": meta.get("name"),
                    "namespace": meta.get("namespace"),
                    "uid": meta.get("uid"),
                    "resourceVersion": meta.get("resourceVersion"),
                }.items()
                if value
            },
            "type": type,
            "reason": reason,
            "message": message[:EVENT_MESSAGE_LIMIT],
            "source": {"component": component},
            "reportingComponent": component,
            "reportingInstance": socket.gethostname(),
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "eventTime": now.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
            "count": 1,
        }
        if action:
            event["action"] = action
        return await self.create(EVENTS, event, namespace)

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
        async with response:
            buffer = b""
            async for chunk in response.content.iter_any():
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    obj = event.get("object") or {}
                    if event.get("type") == "ERROR":
                        raise ApiError(
                            int(obj.get("code") or 500),
                            str(obj.get("reason") or ""),
                            str(obj.get("message") or ""),
                            "WATCH",
                            path,
                        )
                    yield WatchEvent(str(event.get("type")), obj)

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
