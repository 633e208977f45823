"""Where the fleet is: which models exist, their replicas, and how each is routed.

Two sources publish the same `Fleet` value:
- `static`: a YAML/JSON file of model -> replica URLs (and optional routing), reloaded when it
  changes; the local fleet writes it. A bad edit is logged and the last good fleet stays.
- `kubernetes`: watches of LLMDeployments (served model name, routing, spec.replicas), of the
  Services the operator rendered for them (named after the LLMDeployment, controlled by it)
  and of those Services' EndpointSlices (controlled by the Service), in one namespace, several
  (one watch each: a namespace-scoped install has no cluster-wide access) or all. Ready
  endpoints take requests; terminating ones are draining. With all namespaces or several,
  model ids are `NAMESPACE/MODEL` (see `build_fleet`).

A model with no ready replica is still part of the fleet: its requests are held, and its
source is asked for capacity (`signal_demand`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

import aiohttp
import yaml
from pydantic import ValidationError

from fleetllm.api.contract import (
    KV_EVENTS_PORT_NAME,
    KV_REPLAY_PORT_NAME,
    LABEL_MANAGED_BY,
    MANAGER,
    PORT_NAME,
    child_names,
)
from fleetllm.api.deployment import GROUP, KIND, LLMDEPLOYMENTS, RoutingSpec
from fleetllm.api.manifests import format_validation_error
from fleetllm.kube.client import KubeClient
from fleetllm.kube.resources import ENDPOINTSLICES, SERVICES, Resource
from fleetllm.kube.watch import Backoff, Resync
from fleetllm.router.lora import AdapterRoute, adapters_of, parse_static_adapters
from fleetllm.textfile import read_text

log = logging.getLogger("fleetllm.router")

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
# The operator labels its Services so; the EndpointSlice controller copies a Service's labels
# onto its slices.
CHILD_SELECTOR = f"{LABEL_MANAGED_BY}={MANAGER}"


@dataclass(frozen=True)
class KVEventsEndpoint:
    """Where a replica publishes its KV-cache events (ZeroMQ addresses, vLLM's transport)."""

    events: str
    replay: str


@dataclass(frozen=True)
class ReplicaRef:
    url: str
    draining: bool = False
    engine: tuple[str, str, str] | None = None
    """(namespace, name, uid) of the LLMDeployment whose engine this is, where discovery knows
    it: the router sends it the key derived from these (see `contract.engine_key`)."""
    kv_events: KVEventsEndpoint | None = None


@dataclass(frozen=True)
class ModelRoute:
    name: str
    replicas: tuple[ReplicaRef, ...] = ()
    routing: RoutingSpec | None = None
    """None: the router's defaults."""
    owner: tuple[str, str] | None = None
    """(namespace, name) of the LLMDeployment behind the model, where there is one."""
    desired_replicas: int | None = None
    max_replicas: int | None = None
    """spec.scaling.maxReplicas of that LLMDeployment, where it scales."""
    served_name: str | None = None
    """The engines' name for the model, where it differs from `name` (the id clients use)."""
    aliases: tuple[str, ...] = ()
    """Other ids clients may use for this model."""
    tokenizer: str | None = None
    """A directory with the model's tokenizer files, where the router can read one (the
    kv-aware strategy tokenizes prompts as the engines do)."""
    adapters: tuple[AdapterRoute, ...] = ()
    """Its LoRA adapters, each served under its own name."""


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


def parse_kv_events_endpoint(doc: Any, where: str) -> KVEventsEndpoint:
    if (
        not isinstance(doc, dict)
        or set(doc) != {"endpoint", "replayEndpoint"}
        or not all(isinstance(a, str) and a.startswith(("tcp://", "ipc://")) for a in doc.values())
    ):
        raise ValueError(f"{where}: expected {{endpoint, replayEndpoint}}, tcp:// or ipc://")
    return KVEventsEndpoint(doc["endpoint"], doc["replayEndpoint"])


def parse_static_fleet(doc: Any, where: str = "fleet") -> dict[str, ModelRoute]:
    """`models: {NAME: [URL, ...]}` or `models: {NAME: {replicas: [URL | {url, draining,
    kvEvents: {endpoint, replayEndpoint}}], routing: {strategy, loadFactor, sessionHeader},
    tokenizer: DIR, adapters: {ADAPTER: PATH}}}`; an empty list is a model at zero."""
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
        tokenizer = None
        adapters: tuple[AdapterRoute, ...] = ()
        if isinstance(entry, list) or entry is None:
            replicas_doc = entry or []
        elif isinstance(entry, dict):
            unknown = set(entry) - {"replicas", "routing", "tokenizer", "adapters"}
            if unknown:
                raise ValueError(f"{at}: unknown fields {sorted(unknown)}")
            replicas_doc = entry.get("replicas") or []
            tokenizer = entry.get("tokenizer")
            if tokenizer is not None and (not isinstance(tokenizer, str) or not tokenizer):
                raise ValueError(f"{at}.tokenizer: expected a directory")
            adapters = parse_static_adapters(entry.get("adapters"), f"{at}.adapters")
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
            events = None
            if isinstance(item, dict):
                unknown = set(item) - {"url", "draining", "kvEvents"}
                if unknown:
                    raise ValueError(f"{item_at}: unknown fields {sorted(unknown)}")
                url = normalize_url(item.get("url"), item_at)
                draining = item.get("draining", False)
                if not isinstance(draining, bool):
                    raise ValueError(f"{item_at}.draining: expected true or false")
                if item.get("kvEvents") is not None:
                    events = parse_kv_events_endpoint(item["kvEvents"], f"{item_at}.kvEvents")
            else:
                url, draining = normalize_url(item, item_at), False
            refs[url] = ReplicaRef(url, draining, kv_events=events)
        fleet[name] = ModelRoute(
            name, tuple(refs.values()), routing, tokenizer=tokenizer, adapters=adapters
        )
    return fleet


def load_static_fleet(path: Path) -> dict[str, ModelRoute]:
    text = read_text(path)
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


@dataclass(eq=False)
class StaticDiscovery:
    """The fleet from a file. Demand goes to an in-process callback and/or a webhook that
    receives `{"model": NAME}` (the local fleet's supervisor starts a replica)."""

    path: Path | None
    poll_interval: float = 0.5
    on_demand: DemandCallback | None = None
    demand_webhook: str | None = None
    _session: aiohttp.ClientSession | None = field(default=None, init=False)

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
    uid: str
    model: str
    routing: RoutingSpec
    replicas: int | None
    max_replicas: int | None = None
    adapters: tuple[AdapterRoute, ...] = ()


@dataclass(frozen=True)
class ServiceInfo:
    namespace: str
    name: str
    uid: str
    owner_uid: str | None
    """uid of the LLMDeployment that controls the Service (the operator rendered it)."""


@dataclass(frozen=True)
class SliceInfo:
    namespace: str
    service: str
    owner_uid: str | None
    """uid of the Service that controls the slice (the EndpointSlice controller made it)."""
    replicas: tuple[ReplicaRef, ...]


def _controller_uid(meta: Mapping[str, Any], kind: str, api_group: str) -> str | None:
    for ref in meta.get("ownerReferences") or []:
        api_version = str(ref.get("apiVersion") or "")
        group = api_version.rpartition("/")[0] if "/" in api_version else ""
        if ref.get("controller") is True and ref.get("kind") == kind and group == api_group:
            uid = ref.get("uid")
            return uid if isinstance(uid, str) and uid else None
    return None


def parse_deployment(obj: Mapping[str, Any]) -> DeploymentInfo | None:
    """The routing facts of an LLMDeployment; None for one without a served model name."""
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    model = (spec.get("model") or {}).get("name")
    if not isinstance(model, str) or not model or not meta.get("name") or not meta.get("uid"):
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
    scaling = spec.get("scaling")
    max_replicas = scaling.get("maxReplicas") if isinstance(scaling, Mapping) else None
    return DeploymentInfo(
        namespace=meta.get("namespace") or "default",
        name=meta["name"],
        uid=str(meta["uid"]),
        model=model,
        routing=routing,
        replicas=replicas if isinstance(replicas, int) else None,
        max_replicas=max_replicas if isinstance(max_replicas, int) else None,
        adapters=adapters_of(obj),
    )


def parse_service(obj: Mapping[str, Any]) -> ServiceInfo | None:
    meta = obj.get("metadata") or {}
    if not meta.get("name") or not meta.get("uid"):
        return None
    return ServiceInfo(
        namespace=meta.get("namespace") or "default",
        name=meta["name"],
        uid=str(meta["uid"]),
        owner_uid=_controller_uid(meta, KIND, GROUP),
    )


def _endpoint_url(address: str, port: int, scheme: str = "http") -> str:
    host = f"[{address}]" if ":" in address else address
    return f"{scheme}://{host}:{port}"


def parse_endpoint_slice(obj: Mapping[str, Any]) -> SliceInfo | None:
    """The replicas of one EndpointSlice of a Service: ready endpoints, plus terminating ones
    as draining; endpoints not ready yet are left out."""
    meta = obj.get("metadata") or {}
    service = (meta.get("labels") or {}).get(SERVICE_NAME_LABEL)
    if not service:
        return None
    ports = [p for p in obj.get("ports") or [] if isinstance(p, dict) and p.get("port")]
    by_name = {p.get("name"): p["port"] for p in ports if isinstance(p["port"], int)}
    named = [p for p in ports if p.get("name") == PORT_NAME]
    port = (named or ports or [{}])[0].get("port")
    events_port = by_name.get(KV_EVENTS_PORT_NAME)
    replay_port = by_name.get(KV_REPLAY_PORT_NAME)
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
            events = None
            if events_port is not None and replay_port is not None:
                events = KVEventsEndpoint(
                    _endpoint_url(addresses[0], events_port, "tcp"),
                    _endpoint_url(addresses[0], replay_port, "tcp"),
                )
            refs[url] = ReplicaRef(url, draining=terminating or not ready, kv_events=events)
    return SliceInfo(
        namespace=meta.get("namespace") or "default",
        service=service,
        owner_uid=_controller_uid(meta, "Service", ""),
        replicas=tuple(refs.values()),
    )


def build_fleet(
    deployments: Mapping[Any, DeploymentInfo],
    services: Mapping[Any, ServiceInfo],
    slices: Mapping[Any, SliceInfo],
    *,
    qualified: bool,
) -> dict[str, ModelRoute]:
    """The fleet by model id. A model's replicas are the endpoints of the Service the
    operator rendered for its LLMDeployment, and only those: the Service named after the
    LLMDeployment in its namespace, controlled by it (same uid), and the EndpointSlices
    controlled by that Service. Two LLMDeployments of one namespace serving one model name
    share its replicas; the first by name decides routing and receives demand.

    Ids are `NAMESPACE/MODEL` when `qualified` (all namespaces, or several), so no namespace
    can take another's traffic (a plain name reaches a model only where it is unambiguous in
    the caller's scope: see `scopes.resolve`). Unqualified (one namespace), ids are plain
    model names and `NAMESPACE/MODEL` is the alias."""
    ours = {(s.namespace, s.name): s for s in services.values() if s.owner_uid is not None}
    endpoints: dict[tuple[str, str, str], dict[str, ReplicaRef]] = {}
    for info in slices.values():
        if info.owner_uid is None:
            continue
        refs = endpoints.setdefault((info.namespace, info.service, info.owner_uid), {})
        for ref in info.replicas:
            if ref.url not in refs or refs[ref.url].draining:
                refs[ref.url] = ref

    fleet: dict[str, ModelRoute] = {}
    for d in sorted(deployments.values(), key=lambda d: (d.namespace, d.name)):
        service = ours.get((d.namespace, child_names(d.name)["Service"]))
        refs: dict[str, ReplicaRef] = {}
        if service is not None and service.owner_uid == d.uid:
            engine = (d.namespace, d.name, d.uid)
            refs = {
                url: dataclasses.replace(ref, engine=engine)
                for url, ref in endpoints.get((d.namespace, service.name, service.uid), {}).items()
            }
        model_id = f"{d.namespace}/{d.model}" if qualified else d.model
        route = fleet.get(model_id)
        if route is None:
            fleet[model_id] = ModelRoute(
                model_id,
                tuple(refs.values()),
                d.routing,
                (d.namespace, d.name),
                d.replicas,
                d.max_replicas,
                served_name=d.model,
                aliases=() if qualified else (f"{d.namespace}/{d.model}",),
                adapters=d.adapters,
            )
        else:
            merged = {r.url: r for r in route.replicas} | refs
            fleet[model_id] = dataclasses.replace(route, replicas=tuple(merged.values()))

    return fleet


def _safely(parse: Callable[[Mapping[str, Any]], Any]) -> Callable[[Mapping[str, Any]], Any]:
    def wrapped(obj: Mapping[str, Any]) -> Any:
        try:
            return parse(obj)
        except (AttributeError, TypeError, ValueError) as exc:
            # A malformed object is skipped; a router that stops following its fleet is
            # worse than one that misses one object.
            log.warning("ignored a malformed object: %s: %s", type(exc).__name__, exc)
            return None

    return wrapped


class KubernetesDiscovery:
    """Follows LLMDeployments, the operator's Services and their EndpointSlices in the given
    namespaces (or all, `namespaces=None`); children by a server-side label selector. Model
    ids are `NAMESPACE/MODEL` unless exactly one namespace is followed (see `build_fleet`)."""

    def __init__(
        self,
        client: KubeClient,
        namespaces: str | Sequence[str] | None,
        backoff: Backoff | None = None,
    ) -> None:
        """`namespaces`: one, several, or None for all."""
        if isinstance(namespaces, str):
            namespaces = [namespaces]
        if namespaces is not None and not namespaces:
            raise ValueError("Kubernetes discovery needs at least one namespace, or None for all")
        self.client = client
        self.namespaces = list(dict.fromkeys(namespaces)) if namespaces is not None else None
        self.backoff = backoff
        self._stores: dict[str, dict[Any, Any]] = {"deployments": {}, "services": {}, "slices": {}}
        self._synced: set[tuple[str, str | None]] = set()
        self._publish: Publish | None = None

    @property
    def _scopes(self) -> list[str | None]:
        """What each store follows: one list/watch per namespace, or one for all of them."""
        return list(self.namespaces) if self.namespaces is not None else [None]

    def _changed(self) -> None:
        if self._publish is not None and len(self._synced) == len(self._stores) * len(self._scopes):
            self._publish(
                build_fleet(
                    self._stores["deployments"],
                    self._stores["services"],
                    self._stores["slices"],
                    qualified=self.namespaces is None or len(self.namespaces) > 1,
                )
            )

    async def run(self, publish: Publish) -> None:
        self._publish = publish
        follows = (
            ("deployments", LLMDEPLOYMENTS, parse_deployment),
            ("services", SERVICES, parse_service),
            ("slices", ENDPOINTSLICES, parse_endpoint_slice),
        )
        try:
            async with asyncio.TaskGroup() as group:
                for scope in self._scopes:
                    for store_name, resource, parse in follows:
                        group.create_task(self._follow(store_name, resource, parse, scope))
        finally:
            await self.client.close()

    async def _follow(
        self,
        store_name: str,
        resource: Resource,
        parse: Callable[[Mapping[str, Any]], Any],
        namespace: str | None,
    ) -> None:
        """Keep one store in line with the API in one namespace (or all): a resync replaces
        that namespace's entries whole, so missed or repeated events cannot leave stale ones."""
        store = self._stores[store_name]
        parse = _safely(parse)
        selector = None if resource is LLMDEPLOYMENTS else CHILD_SELECTOR
        backoff = dataclasses.replace(self.backoff) if self.backoff else None

        def key(obj: Mapping[str, Any]) -> tuple[str, str]:
            meta = obj.get("metadata") or {}
            return (meta.get("namespace") or "", meta.get("name") or "")

        async for item in self.client.follow(
            resource, namespace, label_selector=selector, backoff=backoff
        ):
            if isinstance(item, Resync):
                for stale in [k for k in store if namespace is None or k[0] == namespace]:
                    del store[stale]
                for obj in item.items:
                    if (parsed := parse(obj)) is not None:
                        store[key(obj)] = parsed
                self._synced.add((store_name, namespace))
            else:
                parsed = parse(item.object) if item.type != "DELETED" else None
                if parsed is None:
                    store.pop(key(item.object), None)
                else:
                    store[key(item.object)] = parsed
            self._changed()

    async def signal_demand(self, route: ModelRoute) -> None:
        if route.owner is None or (route.desired_replicas or 0) >= 1:
            return
        namespace, name = route.owner
        await self.client.patch_scale(LLMDEPLOYMENTS, name, 1, namespace)
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
