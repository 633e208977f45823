"""The router's HTTP server: one OpenAI endpoint in front of every model of the fleet.

The proxy path reads the body once, parses it once (for `model` and the prompt prefix), and
relays the replica's answer as bytes: a stream is forwarded event by event as it arrives,
never re-encoded. A request may move to another replica only while nothing has reached the
client; after that, a broken stream ends with an SSE error event and `[DONE]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from aiohttp import web

from fleetllm.router.auth import ApiKey, KeyStore, RateLimiter, bearer_token, parse_keys
from fleetllm.router.config import RouterSettings
from fleetllm.router.discovery import (
    Discovery,
    Fleet,
    ModelRoute,
    discovery_summary,
    file_signature,
    parse_static_fleet,
)
from fleetllm.router.holding import HoldQueue, HoldRejected
from fleetllm.router.metrics import CONTENT_TYPE, RouterMetrics
from fleetllm.router.replicas import Replica, parse_engine_metrics
from fleetllm.router.strategies import (
    HashRing,
    bounded_prefix,
    least_load,
    prefix_text,
    rendezvous,
    round_robin,
    stable_hash,
)
from fleetllm.version import __version__

log = logging.getLogger("fleetllm.router")

PROXIED_PATHS = ("/v1/completions", "/v1/chat/completions")
# Statuses after which another replica may do better; anything else is the answer.
RETRY_STATUSES = frozenset({502, 503, 504})
RETRY_AFTER_SECONDS = 5
CLIENT_CLOSED = "499"
SSE_END = b"\n\n"
DONE_EVENT = b"data: [DONE]\n\n"


def error_body(status: int, message: str, type_: str, param: str | None = None) -> bytes:
    return json.dumps(
        {"error": {"message": message, "type": type_, "param": param, "code": status}}
    ).encode()


ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestEntityTooLargeError",
    429: "RateLimitError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> web.Response:
    return web.Response(
        status=status,
        body=error_body(status, message, ERROR_TYPES.get(status, "InternalServerError"), param),
        content_type="application/json",
        headers=headers,
    )


def stream_error_event(message: str) -> bytes:
    return (
        b"data: "
        + json.dumps(
            {"error": {"message": message, "type": "BadGatewayError", "param": None, "code": 502}}
        ).encode()
        + SSE_END
        + DONE_EVENT
    )


class _ClientGone(Exception):
    """The client closed its connection while the answer was being relayed."""


@dataclass
class _Failure:
    """An attempt that may be retried elsewhere; what the client gets if none is left."""

    status: int
    body: bytes
    content_type: str


@dataclass
class _Tracked:
    replica: Replica
    inflight: Any
    up: Any
    scraper: asyncio.Task[None] | None = None


class ModelState:
    """One model's replicas and routing, rebuilt in place when discovery changes it."""

    def __init__(self, route: ModelRoute, settings: RouterSettings) -> None:
        self.name = route.name
        self.replicas: dict[str, _Tracked] = {}
        self.hold = HoldQueue(settings.hold_queue_size)
        self.turn = 0
        self.last_demand = -math.inf
        self.removed = False
        self.ring = HashRing([])
        self.route = route
        self.strategy = settings.strategy
        self.load_factor = settings.load_factor
        self.session_header = settings.session_header
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

    def has_available(self) -> bool:
        now = time.monotonic()
        return any(t.replica.available(now) for t in self.replicas.values())


class Router:
    """The routing state and the proxy. `app()` wraps it in an aiohttp application."""

    def __init__(
        self,
        settings: RouterSettings,
        discovery: Discovery,
        *,
        keys_file: Path | None = None,
        keys_loader: Any = None,
        default_rpm: int | None = None,
        default_tpm: int | None = None,
        admin_key: str | None = None,
        log_requests: bool = True,
    ) -> None:
        self.settings = settings
        self.discovery = discovery
        self.metrics = RouterMetrics()
        self.models: dict[str, ModelState] = {}
        self.keys = KeyStore()
        self.limiter = RateLimiter()
        self.keys_file = keys_file
        self.keys_loader = keys_loader
        self.default_rpm = default_rpm
        self.default_tpm = default_tpm
        self.admin_key = admin_key
        self.log_requests = log_requests
        self.synced = False
        self.stopping = False
        self.created = int(time.time())
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[Any]] = set()
        self._upstream_headers = {"Content-Type": "application/json"}
        # Timeouts past the connect are enforced per phase (first byte, whole request).
        self._upstream_timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=settings.connect_timeout
        )
        if settings.upstream_api_key:
            self._upstream_headers["Authorization"] = f"Bearer {settings.upstream_api_key}"
        if keys_file is not None:
            self._load_keys_file()

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "the router is not started"
        return self._session

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60),
            auto_decompress=False,
            skip_auto_headers=("Accept-Encoding", "User-Agent"),
        )
        self._tasks.append(asyncio.create_task(self._run_discovery()))
        if self.keys_file is not None:
            self._tasks.append(asyncio.create_task(self._watch_keys_file()))
        if self.keys_loader is not None:
            self._tasks.append(asyncio.create_task(self._poll_keys_loader()))

    async def stop(self) -> None:
        self.stopping = True
        tasks = [*self._tasks, *self._background]
        for model in self.models.values():
            tasks += [t.scraper for t in model.replicas.values() if t.scraper is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _run_discovery(self) -> None:
        try:
            await self.discovery.run(self.apply_fleet)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("discovery stopped")
            raise

    # -- keys --------------------------------------------------------------------------------

    def _load_keys_file(self) -> None:
        assert self.keys_file is not None
        try:
            text = self.keys_file.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.keys_file}: no such file") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{self.keys_file}: cannot read: {exc}") from None
        keys = parse_keys(text, self.default_rpm, self.default_tpm, str(self.keys_file))
        self.keys.replace(keys)

    async def _watch_keys_file(self) -> None:
        assert self.keys_file is not None
        signature = file_signature(self.keys_file)
        while True:
            await asyncio.sleep(1.0)
            current = file_signature(self.keys_file)
            if current == signature:
                continue
            signature = current
            try:
                await asyncio.to_thread(self._load_keys_file)
                log.info("API keys reloaded: %d keys", len(self.keys))
            except (ValueError, FileNotFoundError) as exc:
                log.error("API keys file rejected, keeping the last good keys: %s", exc)

    async def _poll_keys_loader(self) -> None:
        """Keys from a Kubernetes Secret, read again every 30 s; until the first read
        succeeds, no key is accepted."""
        self.keys.replace([])
        while True:
            try:
                self.keys.replace(await self.keys_loader())
            except Exception as exc:
                log.error("API keys could not be read, keeping the last good keys: %s", exc)
            await asyncio.sleep(30.0)

    # -- fleet -------------------------------------------------------------------------------

    def apply_fleet(self, fleet: Fleet) -> None:
        """Adopt what discovery reports: models and replicas come and go; a replica that
        stays keeps its state (health, load, in-flight count)."""
        for name in list(self.models):
            if name not in fleet:
                state = self.models.pop(name)
                state.removed = True
                for url in list(state.replicas):
                    self._drop_replica(state, url)
                state.hold.notify()
        for name, route in fleet.items():
            state = self.models.get(name)
            if state is None:
                state = self.models[name] = ModelState(route, self.settings)
            else:
                state.configure(route, self.settings)
            wanted = {ref.url: ref for ref in route.replicas}
            for url in list(state.replicas):
                if url not in wanted:
                    self._drop_replica(state, url)
            for url, ref in wanted.items():
                tracked = state.replicas.get(url)
                if tracked is None:
                    replica = Replica(url, name, ref.draining)
                    tracked = state.replicas[url] = _Tracked(
                        replica,
                        self.metrics.child(self.metrics.inflight, name, url),
                        self.metrics.child(self.metrics.replica_up, name, url),
                    )
                    if self._session is not None:
                        tracked.scraper = asyncio.create_task(self._scrape_loop(state, tracked))
                else:
                    tracked.replica.draining = ref.draining
                self._refresh_up(state, tracked)
            state.rebuild_ring()
            if state.has_available():
                state.hold.notify()
        if not self.synced or log.isEnabledFor(logging.DEBUG):
            log.info("fleet: %s", discovery_summary(fleet))
        self.synced = True

    def _drop_replica(self, state: ModelState, url: str) -> None:
        tracked = state.replicas.pop(url)
        if tracked.scraper is not None:
            tracked.scraper.cancel()
        self.metrics.forget_replica(state.name, url)

    def _refresh_up(self, state: ModelState, tracked: _Tracked) -> None:
        up = tracked.replica.available(time.monotonic())
        tracked.up.set(1 if up else 0)
        if up and len(state.hold):
            state.hold.notify()

    async def _scrape_loop(self, state: ModelState, tracked: _Tracked) -> None:
        replica = tracked.replica
        timeout = aiohttp.ClientTimeout(total=self.settings.scrape_timeout)
        while True:
            healthy, gauges = False, None
            try:
                async with self.session.get(replica.url + "/health", timeout=timeout) as r:
                    healthy = r.status == 200
                    await r.read()
                if healthy:
                    async with self.session.get(replica.url + "/metrics", timeout=timeout) as r:
                        if r.status == 200:
                            gauges = parse_engine_metrics(await r.text())
            except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
                pass
            was_up = replica.available(time.monotonic())
            replica.record_scrape(healthy, gauges)
            self._refresh_up(state, tracked)
            if was_up != replica.available(time.monotonic()):
                log.info(
                    "replica %s of %s is %s",
                    replica.url,
                    replica.model,
                    "up" if not was_up else "down",
                )
            await asyncio.sleep(self.settings.scrape_interval)

    def _order(
        self, state: ModelState, payload: Mapping[str, Any], headers: Mapping[str, str]
    ) -> list[Replica]:
        available = state.available(time.monotonic())
        if len(available) <= 1:
            return available
        candidates = [r.candidate() for r in available]
        strategy = state.strategy
        if strategy == "prefix":
            key = stable_hash(prefix_text(payload, self.settings.prefix_chars))
            ordered = bounded_prefix(state.ring, key, candidates, state.load_factor)
        elif strategy == "round-robin":
            ordered = round_robin(candidates, state.turn)
            state.turn += 1
        elif strategy == "session" and (session := headers.get(state.session_header)):
            ordered = rendezvous(candidates, session)
        else:
            ordered = least_load(candidates, state.turn)
            state.turn += 1
        by_url = {r.url: r for r in available}
        return [by_url[c.id] for c in ordered]

    def _signal_demand(self, state: ModelState) -> None:
        now = time.monotonic()
        if now - state.last_demand < self.settings.demand_interval:
            return
        state.last_demand = now
        self.metrics.demand.labels(state.name).inc()

        async def signal() -> None:
            try:
                await self.discovery.signal_demand(state.route)
            except Exception as exc:
                log.error("demand signal for %s failed: %s", state.name, exc)

        self._spawn(signal())

    async def _hold(self, state: ModelState, deadline: float) -> None:
        """Wait for a ready replica of the model (raises HoldRejected)."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        self._signal_demand(state)
        held = self.metrics.held.labels(state.name)
        held.inc()
        try:
            await state.hold.hold(
                lambda: state.removed or state.has_available(),
                min(self.settings.hold_timeout, max(0.0, deadline - start)),
            )
        finally:
            held.dec()
            self.metrics.queue_time.labels(state.name).observe(loop.time() - start)

    # -- HTTP handlers -------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.settings.max_body_bytes)
        for path in PROXIED_PATHS:
            app.router.add_post(path, self.handle_proxy)
        app.router.add_get("/v1/models", self.handle_models)
        app.router.add_get("/health", self.handle_health)
        app.router.add_get("/metrics", self.handle_metrics)
        app.router.add_get("/version", self.handle_version)
        if self.admin_key:
            app.router.add_get("/admin/fleet", self.handle_admin_get)
            app.router.add_put("/admin/fleet", self.handle_admin_put)
        app.router.add_route("*", "/{tail:.*}", self.handle_unknown)

        async def on_startup(_: web.Application) -> None:
            await self.start()

        async def on_cleanup(_: web.Application) -> None:
            await self.stop()

        app.on_startup.append(on_startup)
        app.on_cleanup.append(on_cleanup)
        return app

    async def handle_unknown(self, request: web.Request) -> web.Response:
        for route in request.app.router.routes():
            info = route.resource.get_info() if route.resource is not None else {}
            if info.get("path") == request.path and route.method != request.method:
                return error_response(405, f"Method {request.method} not allowed.")
        return error_response(404, f"No route for {request.method} {request.path}.")

    async def handle_health(self, _: web.Request) -> web.Response:
        if self.stopping or not self.synced:
            return web.json_response(
                {"status": "starting" if not self.stopping else "stopping"}, status=503
            )
        return web.json_response({"status": "ok"})

    async def handle_metrics(self, _: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def handle_version(self, _: web.Request) -> web.Response:
        return web.json_response({"version": __version__})

    def _authenticate(self, request: web.Request) -> tuple[ApiKey | None, web.Response | None]:
        if not self.keys.enabled:
            return None, None
        key = self.keys.authenticate(bearer_token(request.headers.get("Authorization")))
        if key is None:
            return None, error_response(401, "Incorrect or missing API key.")
        return key, None

    async def handle_models(self, request: web.Request) -> web.Response:
        _, denied = self._authenticate(request)
        if denied is not None:
            return denied
        data = [
            {
                "id": name,
                "object": "model",
                "created": self.created,
                "owned_by": "fleetllm",
                "root": name,
                "parent": None,
            }
            for name in sorted(self.models)
        ]
        return web.json_response({"object": "list", "data": data})

    def _admin_denied(self, request: web.Request) -> web.Response | None:
        presented = bearer_token(request.headers.get("Authorization")) or ""
        assert self.admin_key is not None
        if not presented or not _same(presented, self.admin_key):
            return error_response(401, "Incorrect or missing admin key.")
        return None

    async def handle_admin_get(self, request: web.Request) -> web.Response:
        if (denied := self._admin_denied(request)) is not None:
            return denied
        now = time.monotonic()
        models = {
            name: {
                "strategy": state.strategy,
                "held": len(state.hold),
                "replicas": [
                    {
                        "url": url,
                        "draining": t.replica.draining,
                        "up": t.replica.available(now),
                        "inFlight": t.replica.in_flight,
                        "waiting": t.replica.waiting,
                        "kvCacheUsage": t.replica.kv_usage,
                    }
                    for url, t in state.replicas.items()
                ],
            }
            for name, state in sorted(self.models.items())
        }
        return web.json_response({"models": models})

    async def handle_admin_put(self, request: web.Request) -> web.Response:
        if (denied := self._admin_denied(request)) is not None:
            return denied
        try:
            doc = yaml.safe_load(await request.text())
            fleet = parse_static_fleet(doc, "request body")
        except (yaml.YAMLError, UnicodeDecodeError) as exc:
            return error_response(400, f"The body is not YAML or JSON: {exc}")
        except ValueError as exc:
            return error_response(400, str(exc))
        self.apply_fleet(fleet)
        return web.json_response({"models": sorted(fleet)})

    # -- the proxy -----------------------------------------------------------------------------

    async def handle_proxy(self, request: web.Request) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        arrival = loop.time()
        request_id = _request_id(request.headers.get("X-Request-Id"))
        key, denied = self._authenticate(request)
        if denied is not None:
            return self._finish(denied, "", arrival, request_id)
        if (request.content_length or 0) > self.settings.max_body_bytes:
            return self._finish(self._too_large(), "", arrival, request_id)
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return self._finish(self._too_large(), "", arrival, request_id)
        try:
            payload = json.loads(body)
        except (ValueError, UnicodeDecodeError) as exc:
            return self._finish(
                error_response(400, f"The body is not valid JSON: {exc}"),
                "",
                arrival,
                request_id,
            )
        if not isinstance(payload, dict):
            return self._finish(
                error_response(400, "The body must be a JSON object."), "", arrival, request_id
            )
        model = payload.get("model")
        if not isinstance(model, str) or not model:
            return self._finish(
                error_response(400, "`model` is required and must be a string.", "model"),
                "",
                arrival,
                request_id,
            )
        state = self.models.get(model)
        if state is None:
            return self._finish(
                error_response(404, f"The model `{model}` does not exist.", "model"),
                "",
                arrival,
                request_id,
            )
        if key is not None:
            wait = self.limiter.admit(key, time.monotonic())
            if wait is not None:
                return self._finish(
                    error_response(
                        429,
                        f"Rate limit reached for API key {key.name}; try again later.",
                        headers={"Retry-After": str(max(1, math.ceil(wait)))},
                    ),
                    model,
                    arrival,
                    request_id,
                )
        context = _Context(request, request_id, model, arrival, body, payload, key)
        try:
            response = await self._route(state, context)
        except asyncio.CancelledError:
            # The client went away before its answer was complete (nginx's 499).
            self.metrics.child(self.metrics.requests, model, CLIENT_CLOSED).inc()
            raise
        return self._finish(response, model, arrival, request_id, context)

    def _too_large(self) -> web.Response:
        return error_response(
            413, f"The body exceeds the limit of {self.settings.max_body_bytes} bytes."
        )

    def _finish(
        self,
        response: web.StreamResponse,
        model: str,
        arrival: float,
        request_id: str,
        context: _Context | None = None,
    ) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        elapsed = loop.time() - arrival
        m = self.metrics
        m.child(m.requests, model, str(response.status)).inc()
        if model:
            m.child(m.duration, model).observe(elapsed)
            if context is not None and context.first_byte is None:
                m.child(m.first_byte, model).observe(elapsed)
        if not response.prepared:
            response.headers["X-Request-Id"] = request_id
        if context is not None and context.key is not None and context.tokens:
            self.limiter.charge_tokens(context.key, context.tokens, time.monotonic())
        if self.log_requests and log.isEnabledFor(logging.INFO):
            fields: dict[str, Any] = {
                "id": request_id,
                "model": model or None,
                "status": response.status,
                "duration_s": round(elapsed, 4),
            }
            if context is not None:
                fields.update(
                    replica=context.replica,
                    attempts=context.attempts,
                    held_s=round(context.held, 4),
                    stream_error=context.stream_error,
                    key=context.key.name if context.key else None,
                )
            log.info("request", extra={"fields": fields})
        return response

    async def _route(self, state: ModelState, ctx: _Context) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        settings = self.settings
        deadline = ctx.arrival + settings.request_timeout
        retry_until = ctx.arrival + settings.retry_window
        tried: set[str] = set()
        failure: _Failure | None = None
        # The strategy orders the replicas once; failover walks that order, and only asks
        # again once it is used up (so round robin does not skip a turn per retry).
        plan: list[Replica] = []
        while True:
            now = time.monotonic()
            plan = [r for r in plan if r.url not in tried and r.available(now)]
            if plan:
                replica = plan.pop(0)
            elif ordered := self._order(state, ctx.payload, ctx.request.headers):
                plan = [r for r in ordered if r.url not in tried] or ordered
                replica = plan.pop(0)
            else:
                held_from = loop.time()
                try:
                    await self._hold(state, deadline)
                except HoldRejected as exc:
                    ctx.held += loop.time() - held_from
                    if failure is not None and exc.reason == "timeout":
                        return self._failure_response(failure)
                    why = "is full" if exc.reason == "full" else "timed out"
                    return error_response(
                        503,
                        f"No replica of `{state.name}` is ready and the wait for one {why}.",
                        headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
                    )
                ctx.held += loop.time() - held_from
                if state.removed:
                    return error_response(404, f"The model `{state.name}` does not exist.", "model")
                continue
            if ctx.attempts:
                self.metrics.child(self.metrics.retries, state.name).inc()
            ctx.attempts += 1
            tried.add(replica.url)
            ctx.replica = replica.url
            result = await self._attempt(state, replica, ctx, deadline)
            if not isinstance(result, _Failure):
                return result
            failure = result
            now = loop.time()
            if ctx.attempts >= settings.max_attempts or now >= min(retry_until, deadline):
                return self._failure_response(failure)

    @staticmethod
    def _failure_response(failure: _Failure) -> web.Response:
        return web.Response(
            status=failure.status,
            body=failure.body,
            headers={"Content-Type": failure.content_type},
        )

    async def _attempt(
        self, state: ModelState, replica: Replica, ctx: _Context, deadline: float
    ) -> web.StreamResponse | _Failure:
        """One try on one replica. A _Failure means nothing reached the client."""
        loop = asyncio.get_running_loop()
        settings = self.settings
        tracked = state.replicas.get(replica.url)
        stream = ctx.payload.get("stream") is True
        headers = {**self._upstream_headers, "X-Request-Id": ctx.request_id}
        replica.in_flight += 1
        if tracked is not None:
            tracked.inflight.inc()
        upstream: aiohttp.ClientResponse | None = None
        outcome = "error"
        try:
            first_deadline = deadline
            if stream:
                first_deadline = min(deadline, loop.time() + settings.first_byte_timeout)
            try:
                async with asyncio.timeout_at(first_deadline):
                    upstream = await self.session.post(
                        replica.url + ctx.request.path,
                        data=ctx.body,
                        headers=headers,
                        timeout=self._upstream_timeout,
                    )
                    outcome = str(upstream.status)
                    content_type = upstream.headers.get("Content-Type", "application/json")
                    if upstream.status in RETRY_STATUSES:
                        detail = await upstream.read()
                        self._failed(replica, state, tracked)
                        return _Failure(upstream.status, detail, content_type)
                    if not content_type.startswith("text/event-stream"):
                        data = await upstream.read()
                        if upstream.status >= 500:
                            self._failed(replica, state, tracked)
                        else:
                            replica.record_success()
                        if ctx.key is not None and ctx.key.tokens_per_minute is not None:
                            ctx.tokens = _usage_tokens(data) or len(ctx.body) // 4
                        return web.Response(
                            status=upstream.status,
                            body=data,
                            headers={"Content-Type": content_type},
                        )
                    first = await upstream.content.readany()
                    if not first:
                        raise aiohttp.ServerDisconnectedError("the stream ended before its start")
            except (aiohttp.ClientError, TimeoutError) as exc:
                outcome = "error"
                self._failed(replica, state, tracked)
                timed_out = isinstance(exc, TimeoutError)
                status = 504 if timed_out else 502
                what = "did not answer in time" if timed_out else f"failed: {_describe(exc)}"
                return _Failure(
                    status,
                    error_body(status, f"The replica {what}.", ERROR_TYPES[status]),
                    "application/json",
                )
            return await self._relay(state, replica, tracked, ctx, upstream, first, deadline)
        finally:
            self.metrics.child(self.metrics.upstream, state.name, replica.url, outcome).inc()
            replica.in_flight -= 1
            if tracked is not None:
                tracked.inflight.dec()
            if upstream is not None:
                # A fully read answer returns its connection to the pool; anything else drops
                # it, which is how the replica learns that the request was abandoned.
                if upstream.content.at_eof():
                    upstream.release()
                else:
                    upstream.close()

    async def _relay(
        self,
        state: ModelState,
        replica: Replica,
        tracked: _Tracked | None,
        ctx: _Context,
        upstream: aiohttp.ClientResponse,
        first: bytes,
        deadline: float,
    ) -> web.StreamResponse:
        """Forward a stream event by event: only whole events go out, so that an error event
        after a broken upstream is never glued to half of another."""
        loop = asyncio.get_running_loop()
        out = web.StreamResponse(
            status=upstream.status,
            headers={
                "Content-Type": upstream.headers.get("Content-Type", "text/event-stream"),
                "Cache-Control": "no-cache",
                "X-Request-Id": ctx.request_id,
            },
        )
        try:
            await out.prepare(ctx.request)
        except ConnectionResetError:
            return out
        ctx.first_byte = loop.time()
        self.metrics.child(self.metrics.first_byte, state.name).observe(
            ctx.first_byte - ctx.arrival
        )
        count_tokens = ctx.key is not None and ctx.key.tokens_per_minute is not None
        events = 0
        tail = b""
        pending = first
        try:
            async with asyncio.timeout_at(deadline):
                while True:
                    cut = pending.rfind(SSE_END)
                    if cut >= 0:
                        block = pending[: cut + 2]
                        if count_tokens:
                            events += block.count(b"data: ")
                            tail = (tail + block)[-8192:]
                        await _write(out, block)
                        pending = pending[cut + 2 :]
                    chunk = await upstream.content.readany()
                    if not chunk:
                        break
                    pending = pending + chunk if pending else chunk
            if pending:
                await _write(out, pending)
            replica.record_success()
        except (aiohttp.ClientError, TimeoutError) as exc:
            self._failed(replica, state, tracked)
            ctx.stream_error = True
            message = (
                "The replica did not finish in time."
                if isinstance(exc, TimeoutError)
                else f"The replica failed mid-stream: {_describe(exc)}"
            )
            with contextlib.suppress(_ClientGone):
                await _write(out, stream_error_event(message))
        except _ClientGone:
            return out
        if count_tokens:
            ctx.tokens = _usage_tokens_sse(tail) or len(ctx.body) // 4 + events
        with contextlib.suppress(ConnectionResetError):
            await out.write_eof()
        return out

    def _failed(self, replica: Replica, state: ModelState, tracked: _Tracked | None) -> None:
        replica.record_failure(
            time.monotonic(), self.settings.backoff_base, self.settings.backoff_max
        )
        if tracked is not None:
            self._refresh_up(state, tracked)


class _Context:
    __slots__ = (
        "arrival",
        "attempts",
        "body",
        "first_byte",
        "held",
        "key",
        "model",
        "payload",
        "replica",
        "request",
        "request_id",
        "stream_error",
        "tokens",
    )

    def __init__(
        self,
        request: web.Request,
        request_id: str,
        model: str,
        arrival: float,
        body: bytes,
        payload: dict[str, Any],
        key: ApiKey | None,
    ) -> None:
        self.request = request
        self.request_id = request_id
        self.model = model
        self.arrival = arrival
        self.body = body
        self.payload = payload
        self.key = key
        self.attempts = 0
        self.replica: str | None = None
        self.held = 0.0
        self.first_byte: float | None = None
        self.stream_error = False
        self.tokens = 0


async def _write(out: web.StreamResponse, data: bytes) -> None:
    try:
        await out.write(data)
    except ConnectionResetError:
        raise _ClientGone from None


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _same(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


def _request_id(given: str | None) -> str:
    if given and len(given) <= 128 and given.isprintable():
        return given
    return uuid.uuid4().hex


def _usage_tokens(data: bytes) -> int:
    try:
        usage = json.loads(data).get("usage")
    except (ValueError, AttributeError):
        return 0
    return _total(usage)


def _usage_tokens_sse(block: bytes) -> int:
    """The usage of a stream, from its closing events (present with include_usage)."""
    if b'"usage"' not in block:
        return 0
    for event in reversed(block.split(SSE_END)):
        if event.startswith(b"data: {") and b'"usage"' in event:
            try:
                total = _total(json.loads(event[6:]).get("usage"))
            except ValueError:
                continue
            if total:
                return total
    return 0


def _total(usage: Any) -> int:
    if not isinstance(usage, dict):
        return 0
    total = usage.get("total_tokens")
    if isinstance(total, int):
        return total
    parts = [usage.get("prompt_tokens"), usage.get("completion_tokens")]
    return sum(p for p in parts if isinstance(p, int))
