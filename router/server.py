"""The router's application: one OpenAI endpoint in front of every model of the fleet.

`Router` wires the parts together: the replica pool (`pool`), which discovery keeps current;
the proxy (`proxy`); API keys and limits (`access`); the admin endpoints (`admin`); and the
few endpoints of its own (`/v1/models`, `/health`, `/metrics`, `/version`). Errors raised on
any path are answered in OpenAI's shape by `errors.answer_errors`. The OpenAPI document of
these endpoints is served at /openapi.json.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from fleetllm.router.access import Access, KeysLoader
from fleetllm.router.admin import AdminApi
from fleetllm.router.config import RouterSettings
from fleetllm.router.discovery import Discovery, Fleet
from fleetllm.router.endpoints import ENDPOINTS
from fleetllm.router.errors import RouterError, answer_errors
from fleetllm.router.front import FastRequest, Front, FrontStream
from fleetllm.router.metrics import CONTENT_TYPE, RouterMetrics
from fleetllm.router.openapi import openapi_schema
from fleetllm.router.pool import ModelPool, ReplicaPool
from fleetllm.router.proxy import Proxy
from fleetllm.router.scopes import EVERYTHING, visible
from fleetllm.version import __version__

log = logging.getLogger("fleetllm.router")

FAST_POSTS = frozenset(endpoint.path.encode() for endpoint in ENDPOINTS)
Request = web.Request | FastRequest


class Router:
    """The routing state and its HTTP endpoints. `app()` wraps them in an aiohttp application;
    `RouterServer` serves them, started and stopped with the router."""

    def __init__(
        self,
        settings: RouterSettings,
        discovery: Discovery,
        *,
        keys_file: Path | None = None,
        keys_loader: KeysLoader | None = None,
        default_rpm: int | None = None,
        default_tpm: int | None = None,
        default_concurrency: int | None = None,
        admin_key: str | None = None,
        log_requests: bool = True,
        public_metrics: bool = False,
    ) -> None:
        self.settings = settings
        self.discovery = discovery
        self.public_metrics = public_metrics
        """/metrics without a key even when keys are on (for a scraper that sends none)."""
        self.metrics = RouterMetrics()
        self.pool = ReplicaPool(settings, self.metrics, discovery)
        self.access = Access(
            keys_file=keys_file,
            keys_loader=keys_loader,
            default_rpm=default_rpm,
            default_tpm=default_tpm,
            default_concurrency=default_concurrency,
        )
        self.proxy = Proxy(settings, self.pool, self.access, self.metrics, log_requests)
        self.admin = AdminApi(admin_key, self.pool, settings) if admin_key else None
        self._openapi = openapi_schema(admin=self.admin is not None)
        self.reads: dict[str, Callable[[Request], Awaitable[web.Response]]] = {
            "/v1/models": self.handle_models,
            "/health": self.handle_health,
            "/metrics": self.handle_metrics,
            "/version": self.handle_version,
            "/openapi.json": self.handle_openapi,
        }
        """The router's own GET endpoints; they read nothing of a request but its headers."""
        self.stopping = False
        self.created = int(time.time())
        self._session: aiohttp.ClientSession | None = None
        self._discovery_task: asyncio.Task[None] | None = None

    @property
    def models(self) -> dict[str, ModelPool]:
        return self.pool.models

    def apply_fleet(self, fleet: Fleet) -> None:
        self.pool.apply_fleet(fleet)

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60),
            auto_decompress=False,
            skip_auto_headers=("Accept-Encoding", "User-Agent"),
        )
        self.pool.start(self._session)
        self.access.start()
        self._discovery_task = asyncio.create_task(self._run_discovery())

    async def stop(self) -> None:
        self.stopping = True
        if self._discovery_task is not None:
            self._discovery_task.cancel()
            await asyncio.gather(self._discovery_task, return_exceptions=True)
        await self.access.stop()
        await self.pool.stop()
        await self.proxy.stop()
        if self._session is not None:
            await self._session.close()

    async def _run_discovery(self) -> None:
        try:
            await self.discovery.run(self.pool.apply_fleet)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("discovery stopped")
            raise

    # -- HTTP ----------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=self.settings.max_body_bytes, middlewares=[_errors_middleware]
        )
        self.proxy.add_routes(app)
        for path, handler in self.reads.items():
            app.router.add_get(path, handler)
        if self.admin is not None:
            self.admin.add_routes(app)
        app.router.add_route("*", "/{tail:.*}", self.handle_unknown)

        return app

    async def handle_fast(self, request: FastRequest) -> web.StreamResponse | FrontStream:
        """A request the front read (see `RouterServer`): a proxied POST, or a GET of `reads`."""
        if request.method == "GET":
            return await answer_errors(self.reads[request.path], request)
        return await answer_errors(self.proxy.handle, request)

    def runner(self, shutdown_timeout: float = 30.0) -> web.AppRunner:
        """The application's runner: a client is cut off when its headers are late (aiohttp
        closes a connection that has no complete request when its keep-alive time passes,
        which starts at the connection's opening and at each answer's end). After an answer
        given before its request's body was read (503 and 429 at the caps, 413, 408), the rest
        of the body is read and dropped for as long as a body may take to arrive, then the
        connection is closed: a client still sending a big body sees the answer, not a reset,
        and the router holds none of it."""
        return web.AppRunner(
            self.app(),
            handler_cancellation=True,
            access_log=None,
            keepalive_timeout=self.settings.client_header_timeout,
            lingering_time=self.settings.client_body_timeout,
            shutdown_timeout=shutdown_timeout,
        )

    async def handle_unknown(self, request: web.Request) -> web.Response:
        for route in request.app.router.routes():
            info = route.resource.get_info() if route.resource is not None else {}
            if info.get("path") == request.path and route.method != request.method:
                raise RouterError(405, f"Method {request.method} not allowed.")
        raise RouterError(404, f"No route for {request.method} {request.path}.")

    async def handle_health(self, _: Request) -> web.Response:
        if self.stopping or not self.pool.synced:
            return web.json_response(
                {"status": "starting" if not self.stopping else "stopping"}, status=503
            )
        return web.json_response({"status": "ok"})

    async def handle_metrics(self, request: Request) -> web.Response:
        if not self.public_metrics:
            # The series name every model, namespace and replica address: only a key that
            # reaches every model may read them.
            key = self.access.authenticate(request.headers.get("Authorization"))
            if key is not None and not key.scope.unrestricted:
                raise RouterError(403, f"API key {key.name} may not read the router's metrics.")
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def handle_version(self, request: Request) -> web.Response:
        self.access.authenticate(request.headers.get("Authorization"))
        return web.json_response({"version": __version__})

    async def handle_openapi(self, request: Request) -> web.Response:
        self.access.authenticate(request.headers.get("Authorization"))
        return web.json_response(self._openapi)

    async def handle_models(self, request: Request) -> web.Response:
        key = self.access.authenticate(request.headers.get("Authorization"))
        scope = key.scope if key is not None else EVERYTHING
        models = visible((m.route for m in self.pool.models.values()), scope)
        # Adapters as vLLM lists them: each a model of its own, with its model as `parent`
        # (and its model's context length).
        adapters = visible(self.pool.adapter_routes.values(), scope)
        entries = [
            *((name, None) for name in models),
            *((name, self.pool.adapter_of[name][0]) for name in adapters),
        ]
        lengths = await asyncio.gather(
            *(self.pool.max_model_len(self.pool.models[parent or name]) for name, parent in entries)
        )
        data = [
            {
                "id": name,
                "object": "model",
                "created": self.created,
                "owned_by": "fleetllm",
                "root": name,
                "parent": parent,
                "max_model_len": length,
            }
            for (name, parent), length in zip(entries, lengths, strict=True)
        ]
        return web.json_response({"object": "list", "data": data})


@web.middleware
async def _errors_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """Errors on the paths aiohttp reads become answers (in `answer_errors`)."""
    return await answer_errors(handler, request)


class RouterServer:
    """The router on its socket: the front (`front`), which reads the proxied endpoints'
    plain requests itself, and behind it the aiohttp application for everything else."""

    def __init__(self, router: Router, shutdown_timeout: float = 30.0) -> None:
        self.router = router
        self.shutdown_timeout = shutdown_timeout
        self._runner: web.AppRunner | None = None
        self._front: Front | None = None

    async def start(self, host: str, port: int, backlog: int = 1024) -> None:
        """Listen; OSError when the address cannot be had (nothing is left running)."""
        settings = self.router.settings
        self._runner = self.router.runner(self.shutdown_timeout)
        await self._runner.setup()
        assert self._runner.server is not None
        await self.router.start()
        self._front = Front(
            self.router.handle_fast,
            self._runner.server,
            FAST_POSTS,
            frozenset(path.encode() for path in self.router.reads),
            header_timeout=settings.client_header_timeout,
            body_timeout=settings.client_body_timeout,
        )
        try:
            await self._front.start(host, port, backlog)
        except BaseException:
            await self.stop()
            raise

    @property
    def port(self) -> int:
        assert self._front is not None
        return self._front.port

    async def stop(self) -> None:
        """Stop listening; requests in flight finish (up to the shutdown timeout, whichever
        server read them), then the router stops."""
        waits = []
        if self._front is not None:
            waits.append(self._front.shutdown(self.shutdown_timeout))
        if self._runner is not None:
            waits.append(self._runner.cleanup())
        await asyncio.gather(*waits)
        await self.router.stop()
