"""The proxy: each of vLLM's model-addressed endpoints (`endpoints`) relayed to a replica of
the body's `model`.

The body is read once and parsed once (for `model` and the prompt prefix); the replica's answer
is relayed as bytes: a stream is forwarded event by event as it arrives, never re-encoded. A
request may move to another replica only while nothing has reached the client, and a stream's
events are held back until its first token (see `sse.First`), so that a replica failing
before then is replaced; after that, a broken stream ends with an SSE error event and
`[DONE]`. What an answer says of the replica is decided in `outcomes`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from fleetllm.errors import error_json
from fleetllm.httpread import TooLarge, read_bounded
from fleetllm.router.access import Access
from fleetllm.router.auth import ApiKey, tenant_of
from fleetllm.router.body import read_body
from fleetllm.router.config import RouterSettings
from fleetllm.router.endpoints import BY_PATH, ENDPOINTS
from fleetllm.router.errors import RouterError, first_byte_timeout_hint
from fleetllm.router.front import FastRequest, FrontStream
from fleetllm.router.holding import HoldRejected
from fleetllm.router.inflight import InFlight
from fleetllm.router.lora import AdapterRoute
from fleetllm.router.metrics import RouterMetrics
from fleetllm.router.outcomes import Verdict, classify
from fleetllm.router.pool import Lease, ModelPool, ReplicaPool
from fleetllm.router.replicas import Replica
from fleetllm.router.scopes import EVERYTHING
from fleetllm.router.sse import (
    SSE_END,
    EventSplitter,
    EventTooLarge,
    First,
    answer_usage,
    cached_tokens,
    error_event,
    first_kind,
    stream_usage,
    total_tokens,
)
from fleetllm.router.upstream import UpstreamPool, UpstreamResponse
from fleetllm.router.upstream_auth import replica_headers

log = logging.getLogger("fleetllm.router")

# A stream that sends this much before its first token is relayed as it is.
MAX_PREAMBLE_BYTES = 1 << 20
RETRY_AFTER_SECONDS = 5
CLIENT_CLOSED = 499
"""The status of a request whose client went away before its answer was complete (nginx's)."""


Answer = web.StreamResponse | FrontStream
"""A proxied request's answer: aiohttp's for a request aiohttp read, else the front's stream
(a whole answer is a `web.Response` either way)."""


class _ClientGone(Exception):
    """The client closed its connection while the answer was being relayed."""


@dataclass
class _Failure:
    """An attempt that may be retried elsewhere; what the client gets if none is left."""

    status: int
    body: bytes
    content_type: str

    def response(self) -> web.Response:
        return web.Response(
            status=self.status, body=self.body, headers={"Content-Type": self.content_type}
        )


class _Context:
    """One request on its way through the proxy."""

    __slots__ = (
        "adapter",
        "arrival",
        "attempts",
        "body",
        "client_gone",
        "first_byte",
        "held",
        "key",
        "model",
        "payload",
        "predicted",
        "replica",
        "request",
        "request_id",
        "routed",
        "stream_error",
        "tokens",
    )

    def __init__(self, request: web.Request | FastRequest, request_id: str, arrival: float) -> None:
        self.request = request
        self.request_id = request_id
        self.arrival = arrival
        self.model = ""
        """The model's name once it is known to exist (metric labels never hold others)."""
        self.adapter: AdapterRoute | None = None
        """The LoRA adapter of the model the request names, if it names one."""
        self.body = b""
        self.payload: dict[str, Any] = {}
        self.key: ApiKey | None = None
        self.routed = False
        self.attempts = 0
        self.replica: str | None = None
        self.held = 0.0
        self.first_byte: float | None = None
        self.stream_error = False
        self.client_gone = False
        self.tokens = 0
        """Tokens to charge to the key's budget (usage, else an estimate), once known."""
        self.predicted: dict[str, int] = {}
        """kv-aware: replica -> prompt tokens it was predicted to hold cached."""

    def wants_usage(self) -> bool:
        """Whether the answer's usage is read: for the key's token budget, or to check the
        prediction of cached tokens."""
        budget = self.key is not None and self.key.tokens_per_minute is not None
        return budget or self.replica in self.predicted


@dataclass(eq=False)
class Proxy:
    settings: RouterSettings
    pool: ReplicaPool
    access: Access
    metrics: RouterMetrics
    log_requests: bool = True
    inflight: InFlight = field(init=False)
    upstream: UpstreamPool = field(init=False)

    def __post_init__(self) -> None:
        settings = self.settings
        self.inflight = InFlight(settings.max_inflight_requests, settings.max_inflight_bytes)
        self._salt_secret = _salt_secret(settings)
        # Timeouts past the connect are enforced per phase (first byte, whole request).
        self.upstream = UpstreamPool(settings.connect_timeout)

    async def stop(self) -> None:
        await self.upstream.close()

    def add_routes(self, app: web.Application) -> None:
        for endpoint in ENDPOINTS:
            app.router.add_post(endpoint.path, self.handle)

    # -- one request -------------------------------------------------------------------------

    async def handle(self, request: web.Request | FastRequest) -> Answer:
        loop = asyncio.get_running_loop()
        ctx = _Context(request, _request_id(request.headers.get("X-Request-Id")), loop.time())
        try:
            response = await self._serve(ctx)
        except RouterError as exc:
            exc.headers["X-Request-Id"] = ctx.request_id
            self._finish(ctx, exc.status)
            raise
        except asyncio.CancelledError:
            ctx.client_gone = True
            self._finish(ctx, CLIENT_CLOSED)
            raise
        except Exception:
            self._finish(ctx, 500)  # a fault of the router's own; the middleware answers it
            raise
        if not response.prepared:
            response.headers["X-Request-Id"] = ctx.request_id
        self._finish(ctx, CLIENT_CLOSED if ctx.client_gone else response.status)
        return response

    async def _serve(self, ctx: _Context) -> Answer:
        request = ctx.request
        settings = self.settings
        ctx.key = self.access.authenticate(request.headers.get("Authorization"))
        # Everyone's caps, then the key's own, before a byte of the body is read: a body
        # refused costs the router nothing (and one refused for all costs the key nothing).
        admitted = self.access.admitted(ctx.key) if ctx.key else contextlib.nullcontext()
        with (
            self.inflight.hold(
                min(request.content_length or settings.max_body_bytes, settings.max_body_bytes)
            ) as held,
            admitted,
        ):
            ctx.body = await read_body(
                request, settings.max_body_bytes, settings.client_body_timeout
            )
            held.resize(len(ctx.body))
            model = self._parse(ctx)
            held.resize(len(ctx.body))
            ctx.routed = True
            return await self._route(model, ctx)

    def _parse(self, ctx: _Context) -> ModelPool:
        """The model the body names, within the key's scope; the body as the replicas get it
        (the engines' name for the model, the tenant's cache salt)."""
        try:
            payload = json.loads(ctx.body)
        except (ValueError, UnicodeDecodeError) as exc:
            raise RouterError(400, f"The body is not valid JSON: {exc}") from None
        except RecursionError:
            raise RouterError(400, "The body is not valid JSON: nested too deeply.") from None
        if not isinstance(payload, dict):
            raise RouterError(400, "The body must be a JSON object.")
        ctx.payload = payload
        name = payload.get("model")
        if not isinstance(name, str) or not name:
            raise RouterError(400, "`model` is required and must be a string.", "model")
        model, ctx.adapter = self.pool.resolve(name, ctx.key.scope if ctx.key else EVERYTHING)
        changes: dict[str, Any] = {}
        served = ctx.adapter.name if ctx.adapter else model.route.served_name or model.name
        if served != name:
            # An alias, a namespace-qualified id or a plain name of one: the engines know the
            # served name (a static fleet's engines serve its ids as they are).
            changes["model"] = served
        salted = BY_PATH[ctx.request.path].salted
        if ctx.key is not None and salted and "cache_salt" not in payload:
            # Prefix-cache hits are observable (time to first token, cached_tokens): without
            # a salt per tenant, one key could tell which prompts another has sent.
            changes["cache_salt"] = self._cache_salt(tenant_of(ctx.key))
        if changes:
            ctx.payload = {**payload, **changes}
            ctx.body = json.dumps(ctx.payload).encode()
        ctx.model = model.name
        return model

    def _cache_salt(self, tenant: str) -> str:
        return hmac.new(self._salt_secret, tenant.encode(), hashlib.sha256).hexdigest()

    def _finish(self, ctx: _Context, status: int) -> None:
        """Account for an answer (or a client that left first): metrics, the key's token
        budget, the request's log line."""
        elapsed = asyncio.get_running_loop().time() - ctx.arrival
        m = self.metrics
        m.child(m.requests, ctx.model, str(status)).inc()
        if ctx.model:
            m.child(m.duration, ctx.model).observe(elapsed)
            if ctx.routed and ctx.first_byte is None:
                m.child(m.first_byte, ctx.model).observe(elapsed)
        if ctx.key is not None and ctx.key.tokens_per_minute is not None:
            tokens = ctx.tokens
            if not tokens and ctx.client_gone and ctx.attempts:
                tokens = len(ctx.body) // 4  # a replica had the prompt before the client left
            self.access.charge_tokens(ctx.key, tokens)
        if self.log_requests and log.isEnabledFor(logging.INFO):
            fields: dict[str, Any] = {
                "id": ctx.request_id,
                "model": ctx.model or None,
                "status": status,
                "duration_s": round(elapsed, 4),
            }
            if ctx.routed:
                fields.update(
                    replica=ctx.replica,
                    attempts=ctx.attempts,
                    held_s=round(ctx.held, 4),
                    stream_error=ctx.stream_error,
                    key=ctx.key.name if ctx.key else None,
                )
            log.info("request", extra=fields)

    # -- replicas ----------------------------------------------------------------------------

    async def _route(self, model: ModelPool, ctx: _Context) -> Answer:
        loop = asyncio.get_running_loop()
        settings = self.settings
        deadline = ctx.arrival + settings.request_timeout
        retry_until = ctx.arrival + settings.retry_window
        tried: set[str] = set()
        failure: _Failure | None = None
        # The strategy orders the replicas once; failover walks that order, and only asks
        # again once it is used up (so round robin does not skip a turn per retry).
        plan: list[Replica] = []
        loads = 0
        while True:
            now = time.monotonic()
            plan = [r for r in plan if r.url not in tried and r.available(now)]
            if plan:
                replica = plan.pop(0)
            elif ordered := self.pool.order(
                model, ctx.payload, ctx.request.headers, ctx.predicted, ctx.adapter
            ):
                plan = [r for r in ordered if r.url not in tried] or ordered
                replica = plan.pop(0)
            elif ctx.adapter is not None and model.has_available():
                # No replica holds the adapter: one loads it (at most twice per request, in
                # case the one that loaded it goes before it takes this request).
                if loads == 2:
                    raise RouterError(
                        503,
                        f"No replica of `{model.name}` keeps the adapter `{ctx.adapter.name}`.",
                        headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
                    )
                loads += 1
                await self.pool.load_adapter(model, ctx.adapter)
                continue
            else:
                held_from = loop.time()
                try:
                    await self.pool.wait_for_replica(model, deadline, len(ctx.body))
                except HoldRejected as exc:
                    ctx.held += loop.time() - held_from
                    if failure is not None and exc.reason == "timeout":
                        return failure.response()
                    why = "is full" if exc.reason == "full" else "timed out"
                    raise RouterError(
                        503,
                        f"No replica of `{model.name}` is ready and the wait for one {why}.",
                        headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
                    ) from None
                ctx.held += loop.time() - held_from
                if model.removed:
                    raise RouterError(404, f"The model `{model.name}` does not exist.", "model")
                continue
            if ctx.attempts:
                self.metrics.child(self.metrics.retries, model.name).inc()
            ctx.attempts += 1
            tried.add(replica.url)
            ctx.replica = replica.url
            result = await self._attempt(self.pool.acquire(model, replica), ctx, deadline)
            if not isinstance(result, _Failure):
                return result
            failure = result
            now = loop.time()
            if ctx.attempts >= settings.max_attempts or now >= min(retry_until, deadline):
                return failure.response()

    async def _attempt(self, lease: Lease, ctx: _Context, deadline: float) -> Answer | _Failure:
        """One try on one replica. A _Failure means nothing reached the client, and that the
        replica could not serve (it has been backed off): another replica may."""
        loop = asyncio.get_running_loop()
        settings = self.settings
        headers = {**replica_headers(settings, lease.replica), "X-Request-Id": ctx.request_id}
        upstream: UpstreamResponse | None = None
        outcome = "error"
        events = EventSplitter(settings.max_event_bytes)
        try:
            # Until the first byte (a non-streamed answer's headers come when it is done, a
            # stream's first token right after them): a hung replica is left for another.
            first_deadline = min(deadline, loop.time() + settings.first_byte_timeout)
            try:
                async with asyncio.timeout_at(first_deadline) as phase:
                    upstream = await self.upstream.post(
                        lease.replica.url + ctx.request.path, ctx.body, headers
                    )
                    outcome = str(upstream.status)
                    if upstream.status == 401:
                        # The router's key was refused, never the client's (checked here): a
                        # replica still on a rotated key. Backed off; another may take it.
                        lease.failed()
                        log.warning(
                            "a replica refused the router's engine key",
                            extra={"model": lease.model.name, "replica": lease.replica.url},
                        )
                        body = error_json(502, "The replica refused the router's key for it.")
                        return _Failure(502, body, "application/json")
                    content_type = upstream.headers.get("Content-Type", "application/json")
                    if upstream.status == 404 and ctx.adapter is not None:
                        # The replica lost the adapter (it restarted since it was listed):
                        # another holder, or a new load, takes the request.
                        replica = lease.replica
                        replica.adapters = replica.adapters - {ctx.adapter.name}
                        data = await read_bounded(upstream, settings.max_event_bytes)
                        return _Failure(404, data, content_type)
                    if not content_type.startswith("text/event-stream"):
                        phase.reschedule(deadline)  # the answer has begun
                        data = await read_bounded(upstream, settings.max_answer_bytes)
                        if await self._judge(lease, upstream.status):
                            return _Failure(upstream.status, data, content_type)
                        if ctx.wants_usage():
                            self._account(ctx, answer_usage(data), 0)
                        return web.Response(
                            status=upstream.status,
                            body=data,
                            headers={"Content-Type": content_type},
                        )
                    if await self._judge(lease, upstream.status):
                        data = await read_bounded(upstream, settings.max_event_bytes)
                        return _Failure(upstream.status, data, content_type)
                    first, error = await _read_until_first_token(upstream, events)
                    if error and await self._judge(lease, error):
                        return _Failure(error, _event_data(first), "application/json")
            except (TooLarge, EventTooLarge) as exc:
                # A replica that sends more than the router will hold misbehaves.
                outcome = "error"  # no complete answer came
                lease.failed()
                body = error_json(502, f"The replica's answer was refused: {exc}.")
                return _Failure(502, body, "application/json")
            except (aiohttp.ClientError, TimeoutError) as exc:
                outcome = "error"
                lease.failed()
                timed_out = isinstance(exc, TimeoutError)
                status = 504 if timed_out else 502
                what = "did not answer in time." if timed_out else f"failed: {_describe(exc)}."
                if timed_out and upstream is None and first_deadline <= loop.time() < deadline:
                    what = first_byte_timeout_hint(settings.first_byte_timeout, ctx.payload)
                body = error_json(status, f"The replica {what}")
                return _Failure(status, body, "application/json")
            return await self._relay(lease, ctx, upstream, first, events, deadline)
        finally:
            lease.release(outcome)
            if upstream is not None:
                # A fully read answer returns its connection to the pool; anything else drops
                # it, which is how the replica learns that the request was abandoned.
                if upstream.content.at_eof():
                    upstream.release()
                else:
                    upstream.close()

    def _account(self, ctx: _Context, usage: dict[str, Any] | None, events: int) -> None:
        """What a successful answer's usage says: the tokens to charge (an estimate from the
        prompt's size and the events relayed where it has none), and how the cached tokens
        it reports compare with kv-aware's prediction."""
        ctx.tokens = total_tokens(usage) or len(ctx.body) // 4 + events
        predicted = ctx.predicted.get(ctx.replica or "")
        reported = cached_tokens(usage)
        if predicted is not None and reported is not None:
            self.metrics.record_prediction(ctx.model, predicted, reported)

    @staticmethod
    async def _judge(lease: Lease, status: int) -> bool:
        """Record what an answer says of the replica (see `outcomes`); True when the
        request should move to another replica."""
        verdict = classify(status)
        if verdict is Verdict.UNAVAILABLE:
            lease.failed()
            return True
        if verdict is Verdict.SUSPECT:
            await lease.check_broken()
        else:
            lease.succeeded()
        return False

    async def _relay(
        self,
        lease: Lease,
        ctx: _Context,
        upstream: UpstreamResponse,
        first: bytes,
        events: EventSplitter,
        deadline: float,
    ) -> Answer:
        """Forward a stream event by event: only whole events go out, so that an error event
        after a broken upstream is never glued to half of another."""
        loop = asyncio.get_running_loop()
        headers = {
            "Content-Type": upstream.headers.get("Content-Type", "text/event-stream"),
            "Cache-Control": "no-cache",
            "X-Request-Id": ctx.request_id,
        }
        request = ctx.request
        out: _Stream | FrontStream
        if isinstance(request, FastRequest):
            out = FrontStream(request.connection, upstream.status, headers)
        else:
            out = _Stream(status=upstream.status, headers=headers)
        try:
            await out.prepare(request)
        except ConnectionResetError:
            ctx.client_gone = True
            return out
        ctx.first_byte = loop.time()
        self.metrics.child(self.metrics.first_byte, lease.model.name).observe(
            ctx.first_byte - ctx.arrival
        )
        count_tokens = ctx.wants_usage()
        count = 0
        tail = b""
        block = first
        try:
            async with asyncio.timeout_at(deadline):
                while True:
                    if block:
                        if count_tokens:
                            count += block.count(b"data: ")
                            tail = (tail[-8192:] + block[-8192:])[-8192:]
                        await _write(out, block)
                    chunk = await upstream.content.readany()
                    if not chunk:
                        break
                    block = events.feed(chunk)
            if rest := events.rest():
                await _write(out, rest)
            lease.succeeded()
        except (aiohttp.ClientError, TimeoutError, EventTooLarge) as exc:
            lease.failed()
            ctx.stream_error = True
            if isinstance(exc, EventTooLarge):
                message = f"The replica's stream was refused: {exc}."
            elif isinstance(exc, TimeoutError):
                message = "The replica did not finish in time."
            else:
                message = f"The replica failed mid-stream: {_describe(exc)}"
            with contextlib.suppress(_ClientGone):
                await _write(out, error_event(message))
        except _ClientGone:
            ctx.client_gone = True
            return out
        finally:
            # Also when the client leaves (its handler is cancelled): what was relayed counts.
            if count_tokens:
                self._account(ctx, stream_usage(tail), count)
        with contextlib.suppress(ConnectionResetError):
            await out.write_eof()
        return out


class _Stream(web.StreamResponse):
    """A relayed stream whose headers leave with its first event (which is already in hand
    when the response is prepared): one write and one wake-up of the client instead of two.
    `_send_headers_immediately` is aiohttp's own switch for it (its `Response` sets it)."""

    _send_headers_immediately = False


async def _read_until_first_token(
    upstream: UpstreamResponse, events: EventSplitter
) -> tuple[bytes, int]:
    """Read a stream up to and including its first event that commits it (see `sse.First`):
    the whole events read so far (the rest stays in `events`), and the error code when that
    event is an error. A stream that ends first raises, as a broken connection would; an
    event over the cap raises EventTooLarge."""
    held: list[bytes] = []
    size = 0
    while True:
        chunk = await upstream.content.readany()
        if not chunk:
            raise aiohttp.ServerDisconnectedError("the stream ended before its first token")
        block = events.feed(chunk)
        if not block:
            continue
        held.append(block)
        size += len(block)
        at = 0
        while (cut := block.find(SSE_END, at)) >= 0:
            kind, code = first_kind(block[at:cut])
            at = cut + len(SSE_END)
            if kind is not First.PREAMBLE:
                return b"".join(held), code if kind is First.ERROR else 0
        if size > MAX_PREAMBLE_BYTES:
            return b"".join(held), 0  # not a stream of ours; let the client have it


def _event_data(data: bytes) -> bytes:
    """The JSON of the last whole event in `data` (an error event's envelope)."""
    last = data[: data.rfind(SSE_END)].rsplit(SSE_END, 1)[-1]
    lines = [line[5:].lstrip(b" ") for line in last.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(lines)


async def _write(out: web.StreamResponse | FrontStream, data: bytes) -> None:
    try:
        await out.write(data)
    except ConnectionResetError:
        raise _ClientGone from None


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _salt_secret(settings: RouterSettings) -> bytes:
    """The key of the cache salts. Router replicas that share it give a tenant the same salt,
    and so share its cache: the one configured, else one derived from the fleet's root (which
    every router replica of a fleet has), else a random one for this process alone."""
    if settings.cache_salt_secret:
        return settings.cache_salt_secret
    if settings.engine_key_root:
        # Apart from the engine keys, HMACs of `namespace/name/uid` under the same root.
        return hmac.new(settings.engine_key_root, b"router cache salt", hashlib.sha256).digest()
    return os.urandom(32)


def _request_id(given: str | None) -> str:
    if given and len(given) <= 128 and given.isprintable():
        return given
    return os.urandom(16).hex()  # a random UUID's worth, without building one
