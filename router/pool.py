"""The replica pool: every model's replicas, their state, and the choice among them.

Discovery publishes the fleet into the pool (`apply_fleet`); a scrape loop per replica feeds
its health and load; the proxy asks for an order of replicas to try (`order`), waits for one
while a model has none (`wait_for_replica`), and holds a replica for one attempt through a
`Lease`, which counts the attempt in flight until it is released and records how it went.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import zmq.asyncio

from fleetllm.httpread import TooLarge, read_bounded
from fleetllm.lora_api import AdapterError, list_adapters
from fleetllm.router.config import RouterSettings
from fleetllm.router.discovery import (
    Discovery,
    Fleet,
    KVEventsEndpoint,
    ModelRoute,
    discovery_summary,
    has_credentials,
)
from fleetllm.router.errors import RouterError
from fleetllm.router.holding import HoldQueue
from fleetllm.router.kv_feed import FeedSettings
from fleetllm.router.kv_routing import KVRouting
from fleetllm.router.lora import AdapterLoads, AdapterRoute
from fleetllm.router.metrics import RouterMetrics
from fleetllm.router.model_card import fetch_max_model_len
from fleetllm.router.replicas import Replica
from fleetllm.router.scopes import (
    EVERYTHING,
    Scope,
    ambiguous_message,
    missing_message,
    resolve,
)
from fleetllm.router.strategies import (
    HashRing,
    bounded_prefix,
    least_load,
    most_cached,
    prefix_text,
    rendezvous,
    round_robin,
    stable_hash,
)
from fleetllm.router.upstream_auth import auth_headers, replica_headers
from fleetllm.scrape import EngineSample, MetricsTooLarge, ScrapeError, fetch_metrics

log = logging.getLogger("fleetllm.router")

HEALTH_MAX_BYTES = 64 * 1024
"""An engine's /health answer is a few bytes; one far larger is a failed check."""


@dataclass
class PooledReplica:
    """A replica in the pool, with its metric series and its scrape task."""

    replica: Replica
    inflight: Any
    up: Any
    scraper: asyncio.Task[None] | None = None
    card_read: bool = False
    """Its model card was asked for since it last turned healthy (once: a replica without
    one is not asked again and again)."""
    kv_events: KVEventsEndpoint | None = None
    removed: bool = False
    """Out of the pool: its series are gone and nothing may create them again."""


class ModelPool:
    """One model's replicas and routing, rebuilt in place when discovery changes it."""

    def __init__(self, route: ModelRoute, settings: RouterSettings) -> None:
        self.name = route.name
        self.replicas: dict[str, PooledReplica] = {}
        self.hold = HoldQueue(settings.hold_queue_size, settings.hold_queue_bytes)
        self.turn = 0
        self.last_demand = -math.inf
        self.removed = False
        self.ring = HashRing([])
        self.route = route
        self.strategy = settings.strategy
        self.load_factor = settings.load_factor
        self.session_header = settings.session_header
        self.kv: KVRouting | None = None
        """The kv-aware strategy's feeds, index and tokenizer, while the model uses it."""
        self.configure(route, settings)

    def configure(self, route: ModelRoute, settings: RouterSettings) -> None:
        self.route = route
        routing = route.routing
        self.strategy = routing.strategy if routing else settings.strategy
        self.load_factor = routing.load_factor if routing else settings.load_factor
        self.session_header = routing.session_header if routing else settings.session_header

    def rebuild_ring(self) -> None:
        ids = [url for url, t in self.replicas.items() if not t.replica.draining]
        if frozenset(ids) != self.ring.ids:
            self.ring = HashRing(ids)

    def available(self, now: float) -> list[Replica]:
        return [t.replica for t in self.replicas.values() if t.replica.available(now)]

    def max_model_len(self) -> int | None:
        """The context length its replicas serve (the shortest, where they differ, so that
        a request within it fits any of them); None while no replica has said."""
        known = [t.replica.max_model_len for t in self.replicas.values()]
        return min((n for n in known if n is not None), default=None)

    def has_available(self) -> bool:
        now = time.monotonic()
        return any(t.replica.available(now) for t in self.replicas.values())


class Lease:
    """One attempt's hold on one replica: in flight from `acquire` until `release`."""

    __slots__ = ("_pool", "model", "pooled", "replica")

    def __init__(self, pool: ReplicaPool, model: ModelPool, replica: Replica) -> None:
        self._pool = pool
        self.model = model
        self.replica = replica
        # None when the replica left the pool between the choice and now.
        self.pooled = model.replicas.get(replica.url)
        replica.in_flight += 1
        if self.pooled is not None:
            self.pooled.inflight.inc()

    def succeeded(self) -> None:
        self.replica.record_success()

    def failed(self) -> None:
        """The replica could not serve: no new requests until its backoff passes."""
        settings = self._pool.settings
        self.replica.record_failure(time.monotonic(), settings.backoff_base, settings.backoff_max)
        if self.pooled is not None:
            self._pool.refresh_up(self.model, self.pooled)

    async def check_broken(self) -> None:
        """After a suspect answer (a 500): a replica whose /health fails now is backed off
        (and out until a scrape sees it healthy again)."""
        if not await self._pool.check_health(self.replica.url):
            self.replica.record_scrape(False, None)
            self.failed()

    def release(self, outcome: str) -> None:
        """The attempt is over; `outcome` is the replica's HTTP status, or `error`."""
        self.replica.in_flight -= 1
        if self.pooled is None or self.pooled.removed:
            return
        self.pooled.inflight.dec()
        metrics = self._pool.metrics
        metrics.child(metrics.upstream, self.model.name, self.replica.url, outcome).inc()


class ReplicaPool:
    def __init__(
        self, settings: RouterSettings, metrics: RouterMetrics, discovery: Discovery
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.discovery = discovery
        self.models: dict[str, ModelPool] = {}
        self.aliases: dict[str, str] = {}
        """Other ids clients may use -> the model's id (see ModelRoute.aliases)."""
        self.adapter_routes: dict[str, ModelRoute] = {}
        """Each adapter as a client names it, resolved as models are (scopes, namespaces)."""
        self.adapter_aliases: dict[str, str] = {}
        self.adapter_of: dict[str, tuple[str, AdapterRoute]] = {}
        """Adapter id -> (its model's id, the adapter)."""
        self.loads = AdapterLoads()
        self.synced = False
        self._session: aiohttp.ClientSession | None = None
        self._zmq: zmq.asyncio.Context | None = None
        self._background: set[asyncio.Task[Any]] = set()

    # -- lifecycle -------------------------------------------------------------------------

    def start(self, session: aiohttp.ClientSession) -> None:
        self._session = session
        for model in self.models.values():
            for pooled in model.replicas.values():
                if pooled.scraper is None:
                    pooled.scraper = asyncio.create_task(self._scrape_loop(model, pooled))
            self._sync_kv(model)

    async def stop(self) -> None:
        tasks = list(self._background)
        for model in self.models.values():
            tasks += [t.scraper for t in model.replicas.values() if t.scraper is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for model in self.models.values():
            if model.kv is not None:
                await model.kv.stop()
        if self._zmq is not None:
            self._zmq.destroy(linger=0)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- the fleet ---------------------------------------------------------------------------

    def resolve(
        self, requested: str, scope: Scope = EVERYTHING
    ) -> tuple[ModelPool, AdapterRoute | None]:
        """The model a client's `model` names within its key's scope (see `scopes`), and the
        adapter when it names one of a model's adapters; 404, the same for a model out of
        scope as for one that does not exist, otherwise. A model's name wins over an
        adapter's."""
        routes = {name: model.route for name, model in self.models.items()}
        found = resolve(requested, routes, self.aliases, scope)
        if found is None:
            found = resolve(requested, self.adapter_routes, self.adapter_aliases, scope)
            if isinstance(found, str):
                model, adapter = self.adapter_of[found]
                return self.models[model], adapter
        if isinstance(found, list):
            raise RouterError(404, ambiguous_message(requested, found), "model")
        if found is None:
            raise RouterError(404, missing_message(requested), "model")
        return self.models[found], None

    def _index_adapters(self, fleet: Fleet) -> None:
        """Adapter ids as model ids are made (`build_fleet`): `NAMESPACE/ADAPTER` beside a
        qualified model id, else the plain name with that as its alias."""
        self.adapter_routes, self.adapter_aliases, self.adapter_of = {}, {}, {}
        for model_id, route in fleet.items():
            namespace = model_id.rpartition("/")[0] if "/" in model_id else None
            for adapter in route.adapters:
                adapter_id = f"{namespace}/{adapter.name}" if namespace else adapter.name
                if adapter_id in self.adapter_of:
                    continue  # two models of one namespace: the first by id keeps the name
                aliases = ()
                if namespace is None and route.owner is not None:
                    aliases = (f"{route.owner[0]}/{adapter.name}",)
                self.adapter_routes[adapter_id] = ModelRoute(
                    adapter_id, owner=route.owner, served_name=adapter.name, aliases=aliases
                )
                self.adapter_aliases.update(dict.fromkeys(aliases, adapter_id))
                self.adapter_of[adapter_id] = (model_id, adapter)
            self.loads.forget(model_id, {a.name for a in route.adapters})

    def apply_fleet(self, fleet: Fleet) -> None:
        """Adopt what discovery reports: models and replicas come and go; a replica that
        stays keeps its state (health, load, in-flight count)."""
        for name in list(self.models):
            if name not in fleet:
                model = self.models.pop(name)
                model.removed = True
                for url in list(model.replicas):
                    self._drop_replica(model, url)
                if model.kv is not None:
                    self._spawn(model.kv.stop())
                self.metrics.forget_model(name)
                model.hold.notify()
        self.aliases = {alias: name for name, route in fleet.items() for alias in route.aliases}
        self._index_adapters(fleet)
        for name, route in fleet.items():
            model = self.models.get(name)
            if model is None:
                model = self.models[name] = ModelPool(route, self.settings)
            else:
                model.configure(route, self.settings)
            self.metrics.set_model_replicas(name, route.desired_replicas, route.max_replicas)
            if any(has_credentials(ref.url) for ref in route.replicas):
                log.error("model %s: replica URLs with credentials are ignored", name)
            wanted = {ref.url: ref for ref in route.replicas if not has_credentials(ref.url)}
            for url in list(model.replicas):
                if url not in wanted:
                    self._drop_replica(model, url)
            for url, ref in wanted.items():
                pooled = model.replicas.get(url)
                if pooled is None:
                    pooled = model.replicas[url] = PooledReplica(
                        Replica(url, name, ref.draining, ref.engine),
                        self.metrics.child(self.metrics.inflight, name, url),
                        self.metrics.child(self.metrics.replica_up, name, url),
                    )
                    if self._session is not None:
                        pooled.scraper = asyncio.create_task(self._scrape_loop(model, pooled))
                else:
                    pooled.replica.draining = ref.draining
                    # A pod's address taken over by another LLMDeployment's pod.
                    pooled.replica.engine = ref.engine
                pooled.kv_events = ref.kv_events
                self.refresh_up(model, pooled)
            model.rebuild_ring()
            self._sync_kv(model)
            if model.has_available():
                model.hold.notify()
        if not self.synced or log.isEnabledFor(logging.DEBUG):
            log.info("fleet: %s", discovery_summary(fleet))
        self.synced = True

    def in_flight(self, model: str, url: str) -> int:
        """Requests open to one replica (0 for a replica the pool does not know)."""
        pool = self.models.get(model)
        pooled = pool.replicas.get(url) if pool is not None else None
        return pooled.replica.in_flight if pooled is not None else 0

    def _sync_kv(self, model: ModelPool) -> None:
        """Start, follow or stop the model's kv-aware state as its strategy and replicas
        change (feeds run on the event loop: only once the pool is started)."""
        if model.strategy != "kv-aware" or model.removed:
            if model.kv is not None:
                self._spawn(model.kv.stop())
                model.kv = None
            return
        if self._session is None:
            return
        settings = self.settings
        if model.kv is None:
            metrics = self.metrics

            def resynced(replica: str, reason: str, name: str = model.name) -> None:
                metrics.child(metrics.kv_resyncs, name, replica, reason).inc()

            model.kv = KVRouting(
                model.name,
                settings.kv_index_max_blocks,
                settings.kv_max_prompt_tokens,
                FeedSettings(
                    probe_interval=settings.kv_events_probe_interval,
                    stale_after=settings.kv_events_stale_after,
                ),
                on_resync=resynced,
            )
        if self._zmq is None:
            self._zmq = zmq.asyncio.Context()
        route = model.route
        names = {route.name, route.served_name}
        given = [d for m, d in settings.tokenizers if m in names]
        model.kv.update(
            self._zmq,
            {url: pooled.kv_events for url, pooled in model.replicas.items()},
            route.tokenizer or (given[0] if given else None),
        )

    def _drop_replica(self, model: ModelPool, url: str) -> None:
        pooled = model.replicas.pop(url)
        pooled.removed = True
        if pooled.scraper is not None:
            pooled.scraper.cancel()
        self.metrics.forget_replica(model.name, url)

    def refresh_up(self, model: ModelPool, pooled: PooledReplica) -> None:
        if pooled.removed:
            return
        up = pooled.replica.available(time.monotonic())
        pooled.up.set(1 if up else 0)
        if up and len(model.hold):
            model.hold.notify()

    async def check_health(self, url: str) -> bool:
        assert self._session is not None
        timeout = aiohttp.ClientTimeout(total=self.settings.scrape_timeout)
        return await check_health(self._session, url, timeout)

    async def _scrape_loop(self, model: ModelPool, pooled: PooledReplica) -> None:
        assert self._session is not None
        replica = pooled.replica
        while True:
            was_up = replica.available(time.monotonic())
            try:
                healthy, sample = await scrape_replica(
                    self._session,
                    replica.url,
                    self.settings.scrape_timeout,
                    self.settings.max_metrics_bytes,
                )
                replica.record_scrape(healthy, sample)
                if not healthy:
                    pooled.card_read = False  # it may come back with other settings
                if healthy and model.route.adapters:
                    await self._list_adapters(replica)
            except MetricsTooLarge as exc:
                # A replica that answers /metrics with more than the cap misbehaves: it is
                # backed off (longer at each scrape in a row) rather than trusted with traffic.
                if was_up:
                    log.warning("replica %s of %s backed off: %s", replica.url, replica.model, exc)
                replica.record_failure(
                    time.monotonic(), self.settings.backoff_base, self.settings.backoff_max
                )
            self.refresh_up(model, pooled)
            if was_up != replica.available(time.monotonic()):
                log.info(
                    "replica %s of %s is %s",
                    replica.url,
                    replica.model,
                    "up" if not was_up else "down",
                )
            await asyncio.sleep(self.settings.scrape_interval)

    async def _list_adapters(self, replica: Replica) -> None:
        """What the replica holds now (a restarted replica holds nothing); the last known
        when it does not say."""
        assert self._session is not None
        try:
            listed = await list_adapters(
                self._session,
                replica.url,
                headers=auth_headers(self.settings, replica),
                timeout=self.settings.scrape_timeout,
            )
        except AdapterError as exc:
            log.debug("replica %s: no adapter listing: %s", replica.url, exc.message)
            return
        replica.adapters = frozenset(listed)

    async def load_adapter(self, model: ModelPool, adapter: AdapterRoute) -> None:
        """Load `adapter` on the least loaded available replica of `model` (or join the load
        of it already running); RouterError when it cannot be served."""
        refused = self.loads.refused(model.name, adapter)
        if refused is not None:
            raise refused
        available = model.available(time.monotonic())
        if not available:
            return  # the caller holds the request until a replica is ready
        target = least_load([r.candidate() for r in available], model.turn)[0]
        replica = next(r for r in available if r.url == target.id)
        assert self._session is not None
        await self.loads.load(
            self._session,
            model.name,
            adapter,
            replica.url,
            auth_headers(self.settings, replica),
            self.settings.first_byte_timeout,
        )
        replica.adapters = replica.adapters | {adapter.name}
        log.info("loaded adapter %s of %s on %s", adapter.name, model.name, replica.url)

    # -- choosing ----------------------------------------------------------------------------

    def order(
        self,
        model: ModelPool,
        payload: Mapping[str, Any],
        headers: Mapping[str, str],
        predicted: dict[str, int] | None = None,
        adapter: AdapterRoute | None = None,
    ) -> list[Replica]:
        """The available replicas, best first by the model's strategy; for an adapter, those
        that hold it. kv-aware fills `predicted` with the prompt tokens each replica will find
        cached, where it knows."""
        available = model.available(time.monotonic())
        if adapter is not None:
            available = [r for r in available if adapter.name in r.adapters]
        prediction = None
        # The engines never share KV across adapters: the base model's view says nothing of
        # an adapter's cache.
        if model.kv is not None and available and adapter is None:
            prediction = model.kv.predict(payload, [r.url for r in available])
            if prediction is not None and predicted is not None:
                predicted.update(prediction.cached)
        if len(available) <= 1:
            return available
        candidates = [r.candidate() for r in available]
        strategy = model.strategy
        if strategy in ("prefix", "kv-aware"):
            if prediction is not None and prediction.new_block is not None:
                key = prediction.new_block
            else:
                # Keyed by adapter too: the engines never share KV across adapters.
                text = prefix_text(payload, self.settings.prefix_chars)
                key = stable_hash(f"{adapter.name}\x00{text}" if adapter is not None else text)
            ordered = bounded_prefix(model.ring, key, candidates, model.load_factor)
            if prediction is not None:
                ordered = most_cached(
                    ordered, prediction.cached, prediction.tokens, model.load_factor
                )
        elif strategy == "round-robin":
            ordered = round_robin(candidates, model.turn)
            model.turn += 1
        elif strategy == "session" and (session := headers.get(model.session_header)):
            ordered = rendezvous(candidates, session)
        else:
            ordered = least_load(candidates, model.turn)
            model.turn += 1
        by_url = {r.url: r for r in available}
        return [by_url[c.id] for c in ordered]

    async def max_model_len(self, model: ModelPool) -> int | None:
        """The context length the model's replicas serve, asking each healthy replica whose
        card has not been read since it turned healthy (only when a client wants to know:
        no traffic to replicas for it otherwise)."""
        assert self._session is not None
        unread = [p for p in model.replicas.values() if p.replica.healthy and not p.card_read]
        for pooled in unread:
            pooled.card_read = True  # one read at a time, whoever else asks meanwhile

        async def read(replica: Replica) -> None:
            assert self._session is not None
            replica.max_model_len = await fetch_max_model_len(
                self._session,
                replica.url,
                model.route.served_name or model.name,
                replica_headers(self.settings, replica),
                self.settings.scrape_timeout,
            )

        await asyncio.gather(*(read(p.replica) for p in unread))
        return model.max_model_len()

    def acquire(self, model: ModelPool, replica: Replica) -> Lease:
        return Lease(self, model, replica)

    async def wait_for_replica(self, model: ModelPool, deadline: float, size: int) -> None:
        """Hold a request of `size` bytes until the model has a ready replica (raises
        HoldRejected), asking its discovery source for capacity meanwhile."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        self._signal_demand(model)
        held = self.metrics.held.labels(model.name)
        held.inc()
        try:
            await model.hold.hold(
                lambda: model.removed or model.has_available(),
                min(self.settings.hold_timeout, max(0.0, deadline - start)),
                size,
            )
        finally:
            held.dec()
            self.metrics.queue_time.labels(model.name).observe(loop.time() - start)

    def _signal_demand(self, model: ModelPool) -> None:
        now = time.monotonic()
        if now - model.last_demand < self.settings.demand_interval:
            return
        model.last_demand = now
        self.metrics.demand.labels(model.name).inc()

        async def signal() -> None:
            try:
                await self.discovery.signal_demand(model.route)
            except Exception as exc:
                log.error("demand signal for %s failed: %s", model.name, exc)

        self._spawn(signal())


async def scrape_replica(
    session: aiohttp.ClientSession, url: str, timeout: float, max_bytes: int
) -> tuple[bool, EngineSample | None]:
    """One look at a replica: whether /health answers 200, and if so its load. Raises
    MetricsTooLarge for a /metrics over `max_bytes`."""
    if not await check_health(session, url, aiohttp.ClientTimeout(total=timeout)):
        return False, None
    try:
        return True, await fetch_metrics(session, url, timeout, max_bytes=max_bytes)
    except MetricsTooLarge:
        raise
    except ScrapeError:
        return True, None


async def check_health(
    session: aiohttp.ClientSession, url: str, timeout: aiohttp.ClientTimeout
) -> bool:
    try:
        async with session.get(url + "/health", timeout=timeout) as r:
            await read_bounded(r, HEALTH_MAX_BYTES)
            return r.status == 200
    except (aiohttp.ClientError, TimeoutError, TooLarge):
        return False
