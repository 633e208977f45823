"""The engine on its own thread, served to asyncio callers.

`LLMEngine` is not thread-safe, so exactly one thread owns it: it loads the model, then loops
over `step()`. The event loop hands it add/abort commands through a locked list (applied
between steps) and gets outputs back with `loop.call_soon_threadsafe`. When there is nothing to
do the thread sleeps on a condition variable, so an idle server burns no CPU. Each step's
outputs reach their `RequestStream` as one batch. Requests run with DELTA outputs, so every
step costs what it generated, not what its requests generated so far; a consumer that falls
behind gets the deltas it missed merged into one.

Failure isolation: a request the engine refuses, or one that fails inside a step, fails its own
stream only (`RequestFailedError`, or the engine's `ValueError` for invalid input) and the
thread goes on. Only an exception that escapes `step()` (an engine fault) stops the thread and
fails every stream with `EngineDeadError`. The thread records when its current step began, so a
watchdog can tell a step that hangs (`step_running_for`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fleetllm.engine.engine import LLMEngine
from fleetllm.engine.engine_stats import EngineStats
from fleetllm.engine.kv_publisher import KVEventPublisher
from fleetllm.engine.lora_adapter import LoRAAdapter
from fleetllm.engine.request import RequestFailedError, RequestOutput, merge_deltas
from fleetllm.engine.sampling_params import RequestOutputKind, SamplingParams

log = logging.getLogger(__name__)

HEALTH_CHECK_INTERVAL_S = 1.0


class EngineDeadError(RuntimeError):
    """The engine thread failed; nothing more will be generated."""


class EngineNotReadyError(RuntimeError):
    """The model is still loading, or the engine is shutting down."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue has no room for the submission."""


@dataclass
class EngineRequest:
    """One engine request: a single choice (n=1) of a single prompt, with DELTA outputs."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    cache_salt: str | None = None
    lora: LoRAAdapter | None = None


class RequestStream:
    """The outputs of a group of engine requests: the n choices of one or more prompts.

    Iterate `updates()` for batches of `(index, delta)`: what each request generated since
    the previous batch. `final()` waits for the end and returns each request's whole output.
    `abort()` stops whatever has not finished (idempotent, safe after completion).
    """

    def __init__(self, owner: AsyncEngine, requests: list[EngineRequest]) -> None:
        self._owner = owner
        self.requests = requests
        # Each request's latest delta: its metrics, finish reason and cached-token count.
        self.last: list[RequestOutput | None] = [None] * len(requests)
        self.num_output_tokens = [0] * len(requests)
        self._pending: dict[int, list[RequestOutput]] = {}  # deltas not yet consumed
        self._event = asyncio.Event()
        self._error: BaseException | None = None
        self._unfinished = len(requests)
        self._aborted = False

    @property
    def finished(self) -> bool:
        return self._unfinished == 0

    def abort(self) -> None:
        if self._unfinished and not self._aborted:
            self._aborted = True
            self._owner._abort(self)

    async def updates(self) -> AsyncIterator[list[tuple[int, RequestOutput]]]:
        while True:
            if self._pending:
                pending, self._pending = self._pending, {}
                yield [(index, merge_deltas(deltas)) for index, deltas in pending.items()]
                continue
            if self._error is not None:
                raise self._error
            if self._unfinished == 0:
                return
            self._event.clear()
            await self._event.wait()

    async def final(self) -> list[RequestOutput]:
        """Every request's whole output (its deltas merged), in request order."""
        deltas: list[list[RequestOutput]] = [[] for _ in self.requests]
        async for batch in self.updates():
            for index, delta in batch:
                deltas[index].append(delta)
        return [merge_deltas(d) for d in deltas if d]

    # -- called on the event loop by the owner --------------------------------------------

    def _update(self, index: int, output: RequestOutput) -> None:
        self._pending.setdefault(index, []).append(output)
        self.last[index] = output
        self.num_output_tokens[index] += len(output.outputs[0].token_ids)
        if output.finished:
            self._unfinished -= 1
        self._event.set()

    def _fail(self, exc: BaseException) -> None:
        if self._error is None:
            self._error = exc
        self._event.set()


# Called on the engine thread after each iteration with the outputs of the requests aborted
# and stepped in it, and the stats after it.
StepObserver = Callable[[list[RequestOutput], EngineStats], None]


class AsyncEngine:
    def __init__(
        self,
        factory: Callable[[], LLMEngine],
        *,
        max_waiting_requests: int | None = None,
        on_step: StepObserver | None = None,
        kv_events: KVEventPublisher | None = None,
    ) -> None:
        self._factory = factory
        self.max_waiting_requests = max_waiting_requests
        self.on_step = on_step
        self.kv_events = kv_events
        """Where the KV-cache events of each iteration go, if anywhere."""
        self.on_overload: Callable[[], None] | None = None
        """Called for each submission refused because the waiting queue is full (a metric)."""
        self._cond = threading.Condition()
        self._commands: list[tuple[str, RequestStream]] = []  # guarded by _cond
        self._stopping = False  # guarded by _cond
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, tuple[RequestStream, int]] = {}  # event loop only
        self.engine: LLMEngine | None = None  # set once loaded; read-only outside the thread
        self.stats: EngineStats | None = None  # the latest snapshot, replaced whole
        self.error: BaseException | None = None
        self.ready = asyncio.Event()
        self._step_started: float | None = None  # monotonic; set by the thread around a step

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    @property
    def thread_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def started(self) -> bool:
        return self._thread is not None

    @property
    def is_ready(self) -> bool:
        return self.ready.is_set() and self.error is None and not self._stopping

    @property
    def dead(self) -> bool:
        return self.error is not None

    def step_running_for(self) -> float:
        """Seconds the engine thread has spent in its current step (0 between steps)."""
        started = self._step_started
        return 0.0 if started is None else time.monotonic() - started

    async def wait_loaded(self) -> None:
        """Wait until the model is loaded; raise what loading raised, if it failed."""
        await self.ready.wait()
        if self.error is not None:
            raise self.error

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        # A thread still loading the model cannot be interrupted; it is a daemon thread and
        # ends with the process.
        if self._thread is not None and self.engine is not None:
            self._thread.join(timeout)

    def abort_all(self) -> None:
        """Abort every request; unlike a client's abort, each stream gets its final output
        (finish_reason "abort"), so responses still end properly."""
        streams = {s for s, _ in self._streams.values()}
        with self._cond:
            self._commands += [("abort", s) for s in streams]
            self._cond.notify()

    # -- requests (event loop) ------------------------------------------------------------------

    def submit(self, requests: list[EngineRequest]) -> RequestStream:
        """Queue requests in the engine; their outputs arrive on the returned stream."""
        if any(r.params.output_kind is not RequestOutputKind.DELTA for r in requests):
            raise ValueError("requests submitted to the async engine must use DELTA outputs")
        if self.error is not None:
            raise EngineDeadError(f"the engine has failed: {self.error}")
        if not self.ready.is_set() or self._stopping:
            raise EngineNotReadyError("the engine is not accepting requests")
        stream = RequestStream(self, requests)
        with self._cond:
            bound = self.max_waiting_requests
            if bound is not None:
                # The whole submission must fit: n choices of many prompts all wait at once.
                pending = sum(len(s.requests) for kind, s in self._commands if kind == "add")
                waiting = (self.stats.num_waiting if self.stats else 0) + pending
                if waiting + len(requests) > bound:
                    if self.on_overload is not None:
                        self.on_overload()
                    raise EngineOverloadedError(
                        f"the server is overloaded: {waiting} requests are waiting and this "
                        f"one adds {len(requests)} (the bound is {bound}); retry later"
                    )
            self._commands.append(("add", stream))
            self._cond.notify()
        for index, req in enumerate(requests):
            self._streams[req.request_id] = (stream, index)
        return stream

    def _abort(self, stream: RequestStream) -> None:
        for req in stream.requests:
            self._streams.pop(req.request_id, None)
        with self._cond:
            self._commands.append(("abort", stream))
            self._cond.notify()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            entry = self._streams.get(out.request_id)
            if entry is None:  # aborted while the step ran, or its stream already failed
                continue
            stream, index = entry
            if out.error is not None:
                # One choice failing fails the response; its other choices are aborted.
                self._streams.pop(out.request_id)
                stream._fail(RequestFailedError(out.error))
                stream.abort()
                continue
            stream._update(index, out)
            if out.finished:
                del self._streams[out.request_id]

    def _reject(self, stream: RequestStream, exc: BaseException) -> None:
        for req in stream.requests:
            self._streams.pop(req.request_id, None)
        stream._fail(exc)

    def _on_loaded(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.ready.set()

    def _on_dead(self, exc: BaseException) -> None:
        self.error = exc
        self.ready.set()
        dead = EngineDeadError(f"the engine has failed: {exc}")
        streams = {s for s, _ in self._streams.values()}
        self._streams.clear()
        for stream in streams:
            stream._fail(dead)

    # -- the engine thread ---------------------------------------------------------------------

    def _call(self, fn: Callable[..., object], *args: object) -> None:
        assert self._loop is not None
        # The loop may have closed already: the process is exiting.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(fn, *args)

    def _run(self) -> None:
        try:
            engine = self._factory()
            self.stats = engine.stats()
        except BaseException as exc:
            log.exception("the engine failed to load")
            self._call(self._on_dead, exc)
            return
        self._publish_kv_events(engine)
        if self.kv_events is not None:
            engine.after_schedule = lambda: self._publish_kv_events(engine)
        self._call(self._on_loaded, engine)
        try:
            self._loop_forever(engine)
        except BaseException as exc:
            log.exception("the engine loop failed")
            self._call(self._on_dead, exc)
        finally:
            engine.shutdown()

    def _loop_forever(self, engine: LLMEngine) -> None:
        while True:
            with self._cond:
                while not (self._commands or self._stopping or engine.has_unfinished_requests()):
                    # Wake now and then while idle: a tensor-parallel rank may die between
                    # steps, and the engine must then fail (and /health say so) at once.
                    self._cond.wait(HEALTH_CHECK_INTERVAL_S)
                    engine.check_health()
                if self._stopping:
                    return
                commands, self._commands = self._commands, []
            aborted: list[RequestOutput] = []
            for kind, stream in commands:
                if kind == "add":
                    self._add(engine, stream)
                    continue
                for req in stream.requests:
                    out = engine.abort_request(req.request_id)
                    if out is not None:
                        aborted.append(out)
            stepped: list[RequestOutput] = []
            if engine.has_unfinished_requests():
                self._step_started = time.monotonic()
                try:
                    stepped = engine.step()
                finally:
                    self._step_started = None
            # Events and stats first: a caller that sees its request finish then reads fresh
            # counters, and a router can know the request's blocks before its next turn.
            self._publish_kv_events(engine)
            self.stats = stats = engine.stats()
            outputs = aborted + stepped
            if self.on_step is not None:
                self.on_step(outputs, stats)
            if outputs:
                # Outputs of requests whose client left are dropped in _deliver.
                self._call(self._deliver, outputs)

    def _publish_kv_events(self, engine: LLMEngine) -> None:
        if self.kv_events is not None and (events := engine.kv.take_events()):
            self.kv_events.publish(events)

    def _add(self, engine: LLMEngine, stream: RequestStream) -> None:
        """Queue a stream's requests, all or none. `add_request` changes nothing when it
        raises, so a refused submission leaves the engine as it was."""
        added: list[str] = []
        try:
            for req in stream.requests:
                engine.add_request(
                    req.request_id,
                    req.prompt_token_ids,
                    req.params,
                    req.arrival_time,
                    cache_salt=req.cache_salt,
                    lora=req.lora,
                )
                added.append(req.request_id)
        except Exception as exc:
            for request_id in added:
                engine.abort_request(request_id)
            if not isinstance(exc, ValueError):  # invalid input is the caller's; this is ours
                log.error("the engine could not queue a request", exc_info=exc)
                exc = RequestFailedError(f"the engine could not queue this request: {exc!r}")
            self._call(self._reject, stream, exc)
