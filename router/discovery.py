"""Where the fleet is: which models exist, their replicas, and how each is routed.

Two sources publish the same `Fleet` value:
- `static`: a YAML/JSON file of model -> replica URLs (and optional routing), reloaded when it
  changes; the local fleet writes it. A bad edit is logged and the last good fleet stays.
- `kubernetes`: a watch of LLMDeployments (served model name, routing, spec.replicas) and of
  the EndpointSlices of their Services (the operator names each Service after its
  LLMDeployment and labels it `fleetllm.io/model`; slices carry the Service's labels and
  `kubernetes.io/service-name`). Ready endpoints take requests; terminating ones are draining.

A model with no ready replica is still part of the fleet: its requests are held, and its
source is asked for capacity (`signal_demand`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

import aiohttp
import yaml
from pydantic import ValidationError

from fleetllm.operator.api import GROUP, PLURAL, VERSION, RoutingSpec, format_validation_error
from fleetllm.operator.render import LABEL_MODEL
from fleetllm.router.kube import KubeClient, KubeError

log = logging.getLogger("fleetllm.router")

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
REPLICA_PORT_NAME = "http"


@dataclass(frozen=True)
class ReplicaRef:
    url: str
    draining: bool = False


@dataclass(frozen=True)
class ModelRoute:
    name: str
    replicas: tuple[ReplicaRef, ...] = ()
    routing: RoutingSpec | None = None
    """None: the router's defaults."""
    owner: tuple[str, str] | None = None
    """(namespace, name) of the LLMDeployment behind the model, where there is one."""
    desired_replicas: int | None = None


Fleet = Mapping[str, ModelRoute]
Publish = Callable[[Fleet], None]


class Discovery(Protocol):
    async def run(self, publish: Publish) -> None:
        """Publish the fleet now and whenever it changes; runs until cancelled."""

    async def signal_demand(self, route: ModelRoute) -> None:
        """Ask for at least one replica of a model whose requests are being held."""


# -- static ----------------------------------------------------------------------------------


def has_credentials(url: str) -> bool:
    """Whether a URL carries a user or password (`http://user:secret@host`): replica URLs
    never may, since they appear in metric labels, logs and the admin endpoint."""
    return "@" in urlsplit(url).netloc


def normalize_url(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{where}: a replica URL must be a string, got {value!r}")
    parts = urlsplit(value.strip())
    if has_credentials(value.strip()):
        # Not echoed: the message reaches logs and HTTP answers.
        raise ValueError(f"{where}: a replica URL must not carry credentials (user@ or :password@)")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{where}: {value!r} is not an http(s)://host:port URL")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"{where}: {value!r} must not have a path or query")
    try:
        parts.port  # noqa: B018 - a bad port raises on access
    except ValueError:
        raise ValueError(f"{where}: {value!r} has an invalid port") from None
    return f"{parts.scheme}://{parts.netloc}"


def parse_static_fleet(doc: Any, where: str = "fleet") -> dict[str, ModelRoute]:
    """`models: {NAME: [URL, ...]}` or `models: {NAME: {replicas: [URL | {url, draining}],
    routing: {strategy, loadFactor, sessionHeader}}}`; an empty list is a model at zero."""
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise ValueError(f"{where}: expected a mapping with `models`")
    models = doc.get("models") or {}
    if not isinstance(models, dict):
        raise ValueError(f"{where}: `models` must map model names to replicas")
    fleet: dict[str, ModelRoute] = {}
    for name, entry in models.items():
        at = f"{where}: models.{name}"
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}: model names must be non-empty strings")
        routing = None
        if isinstance(entry, list) or entry is None:
            replicas_doc = entry or []
        elif isinstance(entry, dict):
            unknown = set(entry) - {"replicas", "routing"}
            if unknown:
                raise ValueError(f"{at}: unknown fields {sorted(unknown)}")
            replicas_doc = entry.get("replicas") or []
            if entry.get("routing") is not None:
                try:
                    routing = RoutingSpec.model_validate(entry["routing"])
                except ValidationError as exc:
                    raise ValueError(f"{at}.routing: {format_validation_error(exc)}") from None
        else:
            raise ValueError(f"{at}: expected a list of URLs or a mapping")
        if not isinstance(replicas_doc, list):
            raise ValueError(f"{at}.replicas: expected a list")
        refs: dict[str, ReplicaRef] = {}
        for index, item in enumerate(replicas_doc):
            item_at = f"{at}.replicas[{index}]"
            if isinstance(item, dict):
                url = normalize_url(item.get("url"), item_at)
                draining = item.get("draining", False)
                if not isinstance(draining, bool):
                    raise ValueError(f"{item_at}.draining: expected true or false")
            else:
                url, draining = normalize_url(item, item_at), False
            refs[url] = ReplicaRef(url, draining)
        fleet[name] = ModelRoute(name, tuple(refs.values()), routing)
    return fleet


def load_static_fleet(path: Path) -> dict[str, ModelRoute]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read: {exc}") from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML or JSON: {exc}") from None
    return parse_static_fleet(doc, str(path))


def file_signature(path: Path) -> tuple[int, int, int] | None:
    """Changes when the file is rewritten or replaced (editors and atomic renames both)."""
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


DemandCallback = Callable[[str], Awaitable[None] | None]


class StaticDiscovery:
    """The fleet from a file. Demand goes to an in-process callback and/or a webhook that
    receives `{"model": NAME}` (the local fleet's supervisor starts a replica)."""

    def __init__(
        self,
        path: Path | None,
        poll_interval: float = 0.5,
        on_demand: DemandCallback | None = None,
        demand_webhook: str | None = None,
    ) -> None:
        self.path = path
        self.poll_interval = poll_interval
        self.on_demand = on_demand
        self.demand_webhook = demand_webhook
        self._session: aiohttp.ClientSession | None = None

    def load(self) -> dict[str, ModelRoute]:
        return {} if self.path is None else load_static_fleet(self.path)

    async def run(self, publish: Publish) -> None:
        signature = None if self.path is None else file_signature(self.path)
        publish(self.load())
        if self.path is None:
            return
        try:
            while True:
                await asyncio.sleep(self.poll_interval)
                current = file_signature(self.path)
                if current == signature:
                    continue
                signature = current
                try:
                    fleet = await asyncio.to_thread(self.load)
                except (ValueError, FileNotFoundError) as exc:
                    log.error("fleet file rejected, keeping the last good fleet: %s", exc)
                    continue
                publish(fleet)
        finally:
            if self._session is not None:
                await self._session.close()

    async def signal_demand(self, route: ModelRoute) -> None:
        if self.on_demand is not None:
            result = self.on_demand(route.name)
            if result is not None:
                await result
        if self.demand_webhook:
            if self._session is None:
                self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
            async with self._session.post(self.demand_webhook, json={"model": route.name}) as r:
                if r.status >= 400:
                    log.warning("demand webhook answered %s for model %s", r.status, route.name)


# -- kubernetes ------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeploymentInfo:
    namespace: str
    name: str
    model: str
    routing: RoutingSpec
    replicas: int | None


@dataclass(frozen=True)
class SliceInfo:
    namespace: str
    service: str
    replicas: tuple[ReplicaRef, ...]


def parse_deployment(obj: Mapping[str, Any]) -> DeploymentInfo | None:
    """The routing facts of an LLMDeployment; None for one without a served model name."""
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    model = (spec.get("model") or {}).get("name")
    if not isinstance(model, str) or not model or not meta.get("name"):
        return None
    try:
        routing = RoutingSpec.model_validate(spec.get("routing") or {})
    except ValidationError as exc:
        # The CRD schema forbids this; an object written around it still gets routed.
        log.warning(
            "LLMDeployment %s/%s: routing ignored: %s",
            meta.get("namespace"),
            meta["name"],
            format_validation_error(exc),
        )
        routing = RoutingSpec()
    replicas = spec.get("replicas")
    return DeploymentInfo(
        namespace=meta.get("namespace") or "default",
        name=meta["name"],
        model=model,
        routing=routing,
        replicas=replicas if isinstance(replicas, int) else None,
    )


def _endpoint_url(address: str, port: int) -> str:
    host = f"[{address}]" if ":" in address else address
    return f"http://{host}:{port}"


def parse_endpoint_slice(obj: Mapping[str, Any]) -> SliceInfo | None:
    """The replicas of one EndpointSlice of a model's Service: ready endpoints, plus
    terminating ones as draining; endpoints not ready yet are left out."""
    meta = obj.get("metadata") or {}
    labels = meta.get("labels") or {}
    service = labels.get(SERVICE_NAME_LABEL)
    if not service or LABEL_MODEL not in labels:
        return None
    ports = [p for p in obj.get("ports") or [] if isinstance(p, dict) and p.get("port")]
    named = [p for p in ports if p.get("name") == REPLICA_PORT_NAME]
    port = (named or ports or [{}])[0].get("port")
    refs: dict[str, ReplicaRef] = {}
    if isinstance(port, int):
        for endpoint in obj.get("endpoints") or []:
            addresses = endpoint.get("addresses") or []
            if not addresses:
                continue
            conditions = endpoint.get("conditions") or {}
            # Per the API, an unset `ready` means ready.
            ready = conditions.get("ready") is not False
            terminating = conditions.get("terminating") is True
            if not ready and not terminating:
                continue
            url = _endpoint_url(addresses[0], port)
            refs[url] = ReplicaRef(url, draining=terminating or not ready)
    return SliceInfo(meta.get("namespace") or "default", service, tuple(refs.values()))


def build_fleet(
    deployments: Mapping[Any, DeploymentInfo], slices: Mapping[Any, SliceInfo]
) -> dict[str, ModelRoute]:
    """Join slices to LLMDeployments by (namespace, Service name == LLMDeployment name).
    Two LLMDeployments serving one model name share its replicas; the first by namespace/name
    decides routing and receives demand."""
    by_service: dict[tuple[str, str], dict[str, ReplicaRef]] = {}
    for info in slices.values():
        refs = by_service.setdefault((info.namespace, info.service), {})
        for ref in info.replicas:
            if ref.url not in refs or refs[ref.url].draining:
                refs[ref.url] = ref
    fleet: dict[str, ModelRoute] = {}
    for d in sorted(deployments.values(), key=lambda d: (d.namespace, d.name)):
        refs = by_service.get((d.namespace, d.name), {})
        route = fleet.get(d.model)
        if route is None:
            fleet[d.model] = ModelRoute(
                d.model, tuple(refs.values()), d.routing, (d.namespace, d.name), d.replicas
            )
        else:
            merged = {r.url: r for r in route.replicas} | refs
            fleet[d.model] = ModelRoute(
                d.model,
                tuple(merged.values()),
                route.routing,
                route.owner,
                route.desired_replicas,
            )
    return fleet


class KubernetesDiscovery:
    """Watches LLMDeployments and EndpointSlices in one namespace (or all)."""

    def __init__(self, client: KubeClient, namespace: str | None, retry_delay: float = 2.0) -> None:
        self.client = client
        self.namespace = namespace
        self.retry_delay = retry_delay
        self._deployments: dict[Any, DeploymentInfo] = {}
        self._slices: dict[Any, SliceInfo] = {}
        self._synced: set[str] = set()
        self._publish: Publish | None = None

    def _path(self, api: str, plural: str) -> str:
        where = f"/namespaces/{self.namespace}" if self.namespace else ""
        return f"/apis/{api}{where}/{plural}"

    def _changed(self) -> None:
        if self._publish is not None and len(self._synced) == 2:
            self._publish(build_fleet(self._deployments, self._slices))

    async def run(self, publish: Publish) -> None:
        self._publish = publish
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(
                    self._follow(
                        self._path(f"{GROUP}/{VERSION}", PLURAL),
                        {},
                        self._deployments,
                        parse_deployment,
                    )
                )
                group.create_task(
                    self._follow(
                        self._path("discovery.k8s.io/v1", "endpointslices"),
                        {"labelSelector": LABEL_MODEL},
                        self._slices,
                        parse_endpoint_slice,
                    )
                )
        finally:
            await self.client.close()

    async def _follow(
        self,
        path: str,
        params: dict[str, str],
        store: dict[Any, Any],
        parse: Callable[[Mapping[str, Any]], Any],
    ) -> None:
        """List, then watch from the list's version; on any break, list again (a re-list
        replaces the whole store, so missed or repeated events cannot leave stale entries)."""

        def key(obj: Mapping[str, Any]) -> tuple[str, str]:
            meta = obj.get("metadata") or {}
            return (meta.get("namespace") or "", meta.get("name") or "")

        while True:
            try:
                listing = await self.client.request("GET", path, params=params)
                store.clear()
                for obj in listing.get("items") or []:
                    if (parsed := parse(obj)) is not None:
                        store[key(obj)] = parsed
                self._synced.add(path)
                self._changed()
                version = (listing.get("metadata") or {}).get("resourceVersion")
                watch_params = {**params, "allowWatchBookmarks": "true"}
                if version:
                    watch_params["resourceVersion"] = version
                async for event in self.client.watch(path, watch_params):
                    kind, obj = event.get("type"), event.get("object") or {}
                    if kind == "ERROR":
                        break  # e.g. 410 Gone: the version is too old; list again
                    if kind not in ("ADDED", "MODIFIED", "DELETED"):
                        continue
                    parsed = parse(obj) if kind != "DELETED" else None
                    if parsed is None:
                        store.pop(key(obj), None)
                    else:
                        store[key(obj)] = parsed
                    self._changed()
            except (aiohttp.ClientError, TimeoutError, KubeError, ValueError) as exc:
                log.warning("kubernetes watch of %s broke, listing again: %s", path, exc)
                await asyncio.sleep(self.retry_delay)
            except Exception:
                # Whatever the cause, a router that stops following its fleet is worse than
                # one that keeps trying.
                log.exception("kubernetes watch of %s failed, listing again", path)
                await asyncio.sleep(self.retry_delay)

    async def signal_demand(self, route: ModelRoute) -> None:
        if route.owner is None or (route.desired_replicas or 0) >= 1:
            return
        namespace, name = route.owner
        await self.client.request(
            "PATCH",
            f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}/{name}/scale",
            body={"spec": {"replicas": 1}},
            content_type="application/merge-patch+json",
        )
        log.info(
            "asked for a replica of %s: scaled LLMDeployment %s/%s to 1",
            route.name,
            namespace,
            name,
        )


def discovery_summary(fleet: Fleet) -> str:
    return (
        ", ".join(
            f"{name}={sum(not r.draining for r in route.replicas)}"
            for name, route in sorted(fleet.items())
        )
        or "(no models)"
    )
