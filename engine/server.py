"""The engine's OpenAI-compatible HTTP server: app factory, routes, and the process runner.

Routes stay thin: they read and validate the body, then hand over to the endpoint's serving
class (serving_completion, serving_chat, serving_tokenization), all over one `OpenAIServing`
(serving_base) and one `ServedModels` (serving_models). Every error is answered in OpenAI's
envelope (`fleetllm.errors`), from one handler per exception kind. /openapi.json describes each
route's request body with the protocol models' JSON schemas (the routes read the raw body
themselves, for the size limit and vLLM's error wording).

With `--enable-lora` the adapters are served by name (serving_lora), and vLLM's runtime routes
`/v1/load_lora_adapter` and `/v1/unload_lora_adapter` exist where the environment allows them.

/health answers 503 while the model loads, after the engine failed, while draining, and while
the engine thread has been in one step for longer than `step_timeout` (a watchdog for a step
that hangs; it answers 200 again if the step ends). The runner owns the process lifecycle: it
binds the port at once, and on SIGTERM or SIGINT it drains: new requests and /health get 503,
in-flight ones finish within the grace period (then they are aborted), and it exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException

from fleetllm.engine.async_engine import AsyncEngine
from fleetllm.engine.config import EngineConfig
from fleetllm.engine.engine import LLMEngine
from fleetllm.engine.kv_publisher import KVEventPublisher
from fleetllm.engine.metrics import EngineMetrics
from fleetllm.engine.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    parse_request,
    parse_tokenize_request,
)
from fleetllm.engine.serving_base import (
    DEFAULT_MAX_REQUEST_CHOICES,
    DEFAULT_MAX_REQUEST_TOKENS,
    OpenAIServing,
)
from fleetllm.engine.serving_chat import OpenAIServingChat
from fleetllm.engine.serving_completion import OpenAIServingCompletion
from fleetllm.engine.serving_lora import (
    LoadLoRAAdapterRequest,
    LoRAModule,
    LoRARegistry,
    UnloadLoRAAdapterRequest,
    runtime_updating_allowed,
)
from fleetllm.engine.serving_models import ServedModels
from fleetllm.engine.serving_tokenization import OpenAIServingTokenization
from fleetllm.engine.serving_tools import ToolSettings
from fleetllm.errors import APIError, error_body
from fleetllm.kv_events import KVEventsConfig
from fleetllm.logs import configure_logging
from fleetllm.version import __version__

log = logging.getLogger("fleetllm.engine.server")

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
ABORT_FLUSH_S = 5.0
# A step is one forward pass over at most max_num_batched_tokens tokens: seconds at worst on
# a CPU, never minutes.
DEFAULT_STEP_TIMEOUT_S = 120.0


@dataclass
class ServerSettings:
    model_names: list[str]
    model_root: str = ""
    api_key: str | None = None
    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    log_requests_text: bool = False
    shutdown_grace_period: float = 30.0
    max_request_choices: int = DEFAULT_MAX_REQUEST_CHOICES
    max_request_tokens: int = DEFAULT_MAX_REQUEST_TOKENS
    step_timeout: float = DEFAULT_STEP_TIMEOUT_S  # 0: no watchdog
    chat_template: str | None = None  # in place of the model's
    tools: ToolSettings = field(default_factory=ToolSettings)
    created: int = field(default_factory=lambda: int(time.time()))
    # LoRA (None: off): the adapters loaded at start-up, the CPU cache's size, and the folders
    # that runtime loads may read from (None: any).
    lora_modules: list[LoRAModule] | None = None
    max_cpu_loras: int = 1
    allowed_lora_paths: list[str] | None = None


class ServerState:
    """What the routes share: the engine, its metrics, and whether we are draining."""

    def __init__(
        self, settings: ServerSettings, engine: AsyncEngine, metrics: EngineMetrics
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.metrics = metrics
        loras = None
        if settings.lora_modules is not None:
            roots = settings.allowed_lora_paths
            loras = LoRARegistry(
                settings.model_names,
                settings.max_cpu_loras,
                None if roots is None else [Path(r) for r in roots],
            )
        models = ServedModels(settings.model_names, settings.model_root, settings.created, loras)
        self.serving = OpenAIServing(
            engine,
            models,
            log_requests_text=settings.log_requests_text,
            max_request_choices=settings.max_request_choices,
            max_request_tokens=settings.max_request_tokens,
            chat_template=settings.chat_template,
            tools=settings.tools,
        )
        self.completion = OpenAIServingCompletion(self.serving)
        self.chat = OpenAIServingChat(self.serving)
        self.tokenization = OpenAIServingTokenization(self.serving)
        self.draining = False
        self.step_hung = False  # the watchdog's last verdict, to log each change once

    def check_accepting(self) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down")
        if self.engine.dead:
            raise APIError(503, f"the engine has failed: {self.engine.error}")
        if not self.engine.is_ready:
            raise APIError(503, "the model is still loading")
        self.check_step_watchdog()

    def check_step_watchdog(self) -> None:
        limit = self.settings.step_timeout
        running_for = self.engine.step_running_for()
        hung = limit > 0 and running_for > limit
        if hung != self.step_hung:
            self.step_hung = hung
            if hung:
                log.error(
                    "the engine is stuck in a step",
                    extra={"step_s": round(running_for, 1), "step_timeout_s": limit},
                )
            else:
                log.warning("the engine's stuck step ended")
        if hung:
            raise APIError(
                503,
                f"the engine has been in one step for {running_for:.0f}s (the limit is {limit:g}s)",
            )


def create_app(
    settings: ServerSettings,
    factory: Callable[[], LLMEngine],
    *,
    max_waiting_requests: int | None = None,
    kv_events: KVEventsConfig | None = None,
) -> FastAPI:
    """The app over an engine that `factory` builds on the engine thread (then loads the
    `--lora-modules` adapters there, before the server is ready). The engine starts with the
    app's lifespan, or by `app.state.server.engine.start()` where none runs. With
    `kv_events`, its sockets are opened here (a taken address fails at once)."""
    registry: LoRARegistry | None = None

    def load() -> LLMEngine:
        loaded = factory()
        if registry is not None:
            registry.loader = loaded.load_lora
            try:
                for module in settings.lora_modules or ():
                    registry.add_static(module)
            except BaseException:
                loaded.shutdown()
                raise
        return loaded

    engine = AsyncEngine(load, max_waiting_requests=max_waiting_requests)
    metrics = EngineMetrics(settings.model_names[0], lambda: engine.stats)
    engine.on_step = metrics.observe_step
    engine.on_overload = metrics.rejected.inc
    if kv_events is not None and kv_events.enabled:
        engine.kv_events = KVEventPublisher(kv_events, on_drop=metrics.kv_events_dropped.inc)
    state = ServerState(settings, engine, metrics)
    registry = state.serving.models.loras

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not engine.started:
            engine.start()
        yield
        await asyncio.to_thread(engine.shutdown)
        if engine.kv_events is not None:
            await asyncio.to_thread(engine.kv_events.close)

    app = FastAPI(
        title="fleetllm engine",
        version=__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    app.state.server = state

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        path = request.url.path
        if path != "/health":  # probes poll it; its state changes are logged elsewhere
            level = logging.WARNING if exc.status >= 500 else logging.INFO
            extra = {"path": path, "status": exc.status, "error": exc.message}
            log.log(level, "request rejected", extra=extra)
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(
            error_body(exc.status_code, str(exc.detail)),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(400, str(exc)), status_code=400)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse(error_body(500, "internal server error"), status_code=500)

    async def require_api_key(request: Request) -> None:
        key = settings.api_key
        if not key:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), key.encode()
        ):
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'")

    async def read_body(request: Request) -> bytes:
        """The raw body, refused with 413 as soon as it is known to exceed the limit."""
        limit = settings.max_request_body_bytes
        declared = request.headers.get("content-length")
        too_large = APIError(413, f"the request body is larger than the limit of {limit} bytes")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    open_routes = APIRouter()
    api = APIRouter(dependencies=[Depends(require_api_key)])

    @open_routes.get("/health")
    async def health() -> Response:
        state.check_accepting()
        return Response(status_code=200)

    @open_routes.get("/version")
    async def version() -> dict[str, Any]:
        # The attention implementation in use: a Triton kernel that could not build or launch
        # shows here as torch with its "fallback" reason.
        stats = engine.stats
        return {"version": __version__, "attention": stats.attention if stats else {}}

    @open_routes.get("/metrics")
    async def metrics_route() -> Response:
        return Response(metrics.render(), media_type=PROMETHEUS_CONTENT_TYPE)

    @api.get("/v1/models")
    async def models() -> dict[str, Any]:
        loaded = engine.engine
        return state.serving.models.listing(loaded.max_model_len if loaded else None)

    @api.post("/v1/completions", openapi_extra=_body_schema(CompletionRequest))
    async def completions(request: Request) -> Response:
        state.check_accepting()
        req = parse_request(CompletionRequest, await read_body(request))
        return await state.completion.create_completion(req, request)

    @api.post("/v1/chat/completions", openapi_extra=_body_schema(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        state.check_accepting()
        req = parse_request(ChatCompletionRequest, await read_body(request))
        return await state.chat.create_chat_completion(req, request)

    @api.post(
        "/tokenize", openapi_extra=_body_schema(TokenizeCompletionRequest, TokenizeChatRequest)
    )
    async def tokenize(request: Request) -> dict[str, Any]:
        state.check_accepting()
        req = parse_tokenize_request(await read_body(request))
        return await state.tokenization.tokenize(req)

    @api.post("/detokenize", openapi_extra=_body_schema(DetokenizeRequest))
    async def detokenize(request: Request) -> dict[str, Any]:
        state.check_accepting()
        req = parse_request(DetokenizeRequest, await read_body(request))
        return state.tokenization.detokenize(req)

    if runtime_updating_allowed():

        @api.post("/v1/load_lora_adapter", openapi_extra=_body_schema(LoadLoRAAdapterRequest))
        async def load_lora_adapter(request: Request) -> Response:
            state.check_accepting()
            req = parse_request(LoadLoRAAdapterRequest, await read_body(request))
            if registry is None:
                raise APIError(400, "LoRA is not enabled: start the server with --enable-lora")
            return Response(await registry.load(req), media_type="text/plain")

        @api.post("/v1/unload_lora_adapter", openapi_extra=_body_schema(UnloadLoRAAdapterRequest))
        async def unload_lora_adapter(request: Request) -> Response:
            req = parse_request(UnloadLoRAAdapterRequest, await read_body(request))
            if registry is None:
                raise APIError(400, "LoRA is not enabled: start the server with --enable-lora")
            return Response(await registry.unload(req), media_type="text/plain")

    app.include_router(open_routes)
    app.include_router(api)
    _document_bodies(app)
    return app


_BODY_MODELS = (
    CompletionRequest,
    ChatCompletionRequest,
    TokenizeCompletionRequest,
    TokenizeChatRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
)


def _body_schema(*models: type[BaseModel]) -> dict[str, Any]:
    """A route's request body for /openapi.json, by reference to the models' schemas."""
    refs = [{"$ref": f"#/components/schemas/{m.__name__}"} for m in models]
    schema = refs[0] if len(refs) == 1 else {"anyOf": refs}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _document_bodies(app: FastAPI) -> None:
    """Add the request models (and the models they use) to the generated OpenAPI document."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = generate()
            _, defs = models_json_schema(
                [(m, "validation") for m in _BODY_MODELS],
                ref_template="#/components/schemas/{model}",
            )
            doc.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


# -- the process ---------------------------------------------------------------------------


class _Server(uvicorn.Server):
    """uvicorn's server with our signal handling: the first SIGTERM/SIGINT drains, a second
    one exits at once. (uvicorn's own handling would stop at once and re-raise the signal,
    so the process would not exit 0.)"""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self._drain_task: asyncio.Task[None] | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        signals = (signal.SIGTERM, signal.SIGINT)
        for sig in signals:
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            yield
        finally:
            for sig in signals:
                loop.remove_signal_handler(sig)

    def _on_signal(self, sig: int) -> None:
        if self._drain_task is None:
            log.info("draining", extra={"signal": signal.Signals(sig).name})
            self._drain_task = asyncio.get_running_loop().create_task(self._drain())
        else:
            self.should_exit = True
            self.force_exit = True

    async def _drain(self) -> None:
        state = self.state
        state.draining = True
        serving = state.serving
        deadline = time.monotonic() + state.settings.shutdown_grace_period
        while serving.num_active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if serving.num_active:
            log.warning(
                "grace period over: aborting requests", extra={"requests": serving.num_active}
            )
            state.engine.abort_all()
            # Aborted requests still end their responses (finish_reason "abort").
            while serving.num_active and time.monotonic() < deadline + ABORT_FLUSH_S:
                await asyncio.sleep(0.05)
        self.should_exit = True


def run_server(
    config: EngineConfig,
    settings: ServerSettings,
    *,
    host: str,
    port: int,
    max_waiting_requests: int | None = None,
    log_level: str = "info",
) -> int:
    """Serve until drained by a signal; the exit code (0 after a drain, 1 if loading failed)."""
    configure_logging(log_level, include_text=settings.log_requests_text)
    app = create_app(
        settings,
        lambda: LLMEngine(config),
        max_waiting_requests=max_waiting_requests,
        kv_events=config.kv_events_config if config.publishes_kv_events else None,
    )
    state: ServerState = app.state.server
    engine = state.engine
    uv_config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=5,
        lifespan="on",
    )
    server = _Server(uv_config, state)
    exit_code = 0

    async def main() -> None:
        nonlocal exit_code
        serve = asyncio.create_task(server.serve())
        loaded = asyncio.create_task(engine.wait_loaded())
        # The port is bound at once and the model loads beside it: /health says 503 until
        # it is ready. A signal while loading ends the serve task first.
        await asyncio.wait({serve, loaded}, return_when=asyncio.FIRST_COMPLETED)
        if loaded.done():
            if loaded.exception() is None:
                log.info(
                    "serving",
                    extra={"host": host, "port": port, "models": settings.model_names},
                )
            else:
                exit_code = 1
                server.should_exit = True
        else:
            loaded.cancel()
        await serve
        if not server.started:
            exit_code = 1

    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        runner.run(main())
    if engine.thread_alive:
        # Still loading (or stuck in a step): interpreter teardown would kill the thread
        # inside torch and abort the process, so leave without it.
        logging.shutdown()
        os._exit(exit_code)
    return exit_code


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's faster event loop where it is installed, else asyncio's own."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop
