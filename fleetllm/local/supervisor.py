"""The local fleet's supervisor: the replicas of every model as guarded child processes, their
readiness, restarts with backoff, drain before stop, and the router's view of them.

Each replica has one task that owns its process from start to stop, so that nothing else
ever signals a process: scale-down and shutdown only ask a replica to retire, and the task
drains it (the router stops choosing it, its open requests finish), stops it, and removes it.
The router runs in this process and event loop; `LocalDiscovery` hands it the ready replicas
directly, and its demand signal (requests for a model at zero replicas) comes back here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from fleetllm.autoscale.step import scale_summary
from fleetllm.local.discovery import LocalDiscovery
from fleetllm.local.launch import (
    CorePool,
    GPUPool,
    LocalModel,
    kv_events_endpoint,
    replica_argv,
    replica_env,
    spec_env,
)
from fleetllm.local.lora import adapter_routes, load_adapters
from fleetllm.local.policy import (
    Candidate,
    State,
    failures_after_exit,
    restart_delay,
    to_retire,
)
from fleetllm.local.process import GuardedProcess, describe_exit, free_port
from fleetllm.local.status import ModelView, ReplicaView
from fleetllm.router.discovery import KVEventsEndpoint, ModelRoute, ReplicaRef

log = logging.getLogger("fleetllm.local")

STARTING_POLL_S = 0.25
READY_POLL_S = 1.0
HEALTH_TIMEOUT_S = 5.0
LIVENESS_FAILURES = 10
"""Polls of /health in a row that a ready replica may fail before it is restarted."""
STOP_MARGIN_S = 5.0
"""Time a stopping engine gets past its own drain time before its tree is killed."""
LOG_TAIL_LINES = 5


@dataclass(eq=False)
class Replica:
    key: int
    name: str
    log_path: Path
    state: State = State.PENDING
    since: float = field(default_factory=time.monotonic)
    url: str | None = None
    process: GuardedProcess | None = None
    devices: tuple[str, ...] | None = None
    cores: tuple[int, ...] | None = None
    kv_events: KVEventsEndpoint | None = None
    failures: int = 0
    restarts: int = 0
    ready_since: float | None = None
    retire: asyncio.Event = field(default_factory=asyncio.Event)

    def set_state(self, state: State) -> None:
        self.state = state
        self.since = time.monotonic()


@dataclass
class Load:
    """What the autoscaler last read of a model's replicas, for the status view."""

    kv_usage: float | None = None
    waiting: float | None = None
    queue_p90_s: float | None = None


@dataclass(eq=False)
class ModelFleet:
    """The replicas of one model."""

    model: LocalModel
    desired: int
    replicas: dict[int, Replica] = field(default_factory=dict)
    next_key: int = 0
    prepared: bool = False
    model_dir: str | None = None  # where the model was prepared (the router's tokenizer)
    preparing: tuple[int, int, str] | None = None
    last_scale: str | None = None
    load: Load = field(default_factory=Load)
    demand_time: float | None = None
    """When the router last held requests for want of a ready replica."""
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    """Set to make the autoscaler step at once."""
    refused: dict[str, str] = field(default_factory=dict)
    """Adapters a replica refused to load: name -> the engine's reason."""

    @property
    def name(self) -> str:
        return self.model.name

    def ready_urls(self) -> list[str]:
        return [r.url for r in self.replicas.values() if r.state is State.READY and r.url]

    def route(self) -> ModelRoute:
        refs = tuple(
            ReplicaRef(r.url, draining=r.state is State.DRAINING, kv_events=r.kv_events)
            for r in self.replicas.values()
            if r.url and r.state in (State.READY, State.DRAINING)
        )
        adapters = adapter_routes(self.model.adapters, self.refused)
        routing = self.model.cr.spec.routing
        return ModelRoute(
            self.name,
            refs,
            routing,
            None,
            self.desired,
            tokenizer=self.model_dir,
            adapters=adapters,
        )


@dataclass(frozen=True)
class SupervisorSettings:
    log_dir: Path
    endpoint: str
    """The router's OpenAI base URL, shown per model."""
    grace_s: float = 30.0
    """At shutdown, how long open requests get to finish (a scale-down drains a replica for
    its model's engine.drainSeconds)."""


class Supervisor:
    def __init__(
        self,
        models: Sequence[LocalModel],
        settings: SupervisorSettings,
        *,
        gpus: GPUPool,
        cores: CorePool,
        in_flight: Callable[[str, str], int] = lambda model, url: 0,
    ) -> None:
        self.settings = settings
        self.fleets = {m.name: ModelFleet(m, m.initial_replicas) for m in models}
        self.gpus = gpus
        self.cores = cores
        self.in_flight = in_flight
        self.discovery = LocalDiscovery(self.demand)
        self.stopping = False
        self.failure: str | None = None
        self.failed = asyncio.Event()
        self.session: aiohttp.ClientSession | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._preparing: list[GuardedProcess] = []
        # KV-event sockets: a private folder, its path short (Unix socket paths are bounded).
        self.sockets = Path(tempfile.mkdtemp(prefix="fleetllm-kv-"))

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        self.settings.log_dir.mkdir(parents=True, exist_ok=True)
        self.session = aiohttp.ClientSession()
        self.publish()
        for fleet in self.fleets.values():
            self.spawn(self._prepare(fleet))

    async def shutdown(self, grace_s: float) -> None:
        """Drain and stop every replica; whatever still runs after `grace_s` is killed."""
        self.stopping = True
        for process in self._preparing:
            process.kill()
        replicas = [r for f in self.fleets.values() for r in f.replicas.values()]
        for replica in replicas:
            replica.retire.set()
        tasks = [t for t in self._tasks if not t.done()]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=grace_s)
            if pending:
                log.warning(
                    "grace period over: killing what is left",
                    extra={"replicas": [r.name for r in replicas if r.process]},
                )
                for replica in replicas:
                    if replica.process is not None:
                        replica.process.kill()
                await asyncio.wait(pending, timeout=STOP_MARGIN_S)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.session is not None:
            await self.session.close()
        shutil.rmtree(self.sockets, ignore_errors=True)

    def fail(self, message: str) -> None:
        """Something the fleet cannot go on without: stop, and exit non-zero."""
        if self.failure is None:
            self.failure = message
            log.error("the fleet cannot run", extra={"reason": message})
        self.stopping = True  # nothing more starts
        self.failed.set()

    def spawn(self, coro: Any) -> asyncio.Task[Any]:
        """Run `coro` until the supervisor shuts down; its failure stops the fleet."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            log.error("supervisor task failed", exc_info=exc)
            self.fail(f"internal error: {exc!r}")

    # -- scaling ---------------------------------------------------------------------------

    def set_desired(self, name: str, desired: int, reason: str) -> None:
        """Ask for `desired` replicas of model `name` (kept within its bounds)."""
        fleet = self.fleets[name]
        model = fleet.model
        desired = min(max(desired, model.min_replicas), model.max_replicas)
        if desired != fleet.desired:
            log.info(
                "scale",
                extra={
                    "model": name,
                    "replicas_from": fleet.desired,
                    "to": desired,
                    "reason": reason,
                },
            )
            fleet.last_scale = scale_summary(fleet.desired, desired, reason)
            fleet.desired = desired
        self.reconcile(fleet)

    def demand(self, name: str) -> None:
        """The router holds requests for a model without a ready replica: the autoscaler
        weighs that at once (from zero it asks for one replica). A model without
        `spec.scaling` gets one replica, as `kubectl scale` would give it in a cluster."""
        fleet = self.fleets.get(name)
        if fleet is None or self.stopping:
            return
        fleet.demand_time = time.monotonic()
        fleet.wake.set()
        if fleet.model.cr.spec.scaling is None and fleet.desired == 0:
            self.set_desired(name, 1, "the router holds requests for it")

    def reconcile(self, fleet: ModelFleet) -> None:
        if self.stopping or not fleet.prepared:
            return
        candidates = [
            Candidate(r.key, r.state, self.in_flight(fleet.name, r.url) if r.url else 0)
            for r in fleet.replicas.values()
            if not r.retire.is_set()
        ]
        for key in to_retire(candidates, fleet.desired):
            fleet.replicas[key].retire.set()
        for _ in range(fleet.desired - len(candidates)):
            key = fleet.next_key
            fleet.next_key += 1
            name = f"{fleet.model.cr.metadata.name}-{key}"
            replica = Replica(key, name, self.settings.log_dir / f"{name}.log")
            fleet.replicas[key] = replica
            self.spawn(self._lifecycle(fleet, replica))

    # -- the router's view -----------------------------------------------------------------

    def publish(self) -> None:
        self.discovery.update({f.name: f.route() for f in self.fleets.values()})

    # -- preparing a model -----------------------------------------------------------------

    async def _prepare(self, fleet: ModelFleet) -> None:
        """Pull (hf://, s3://) and convert (GGUF, builtin engine) the weights once, and pull
        the hf:// and s3:// adapters, with progress, before any replica starts."""
        model = fleet.model
        # A built-in model is converted once: the builtin engine loads it, vLLM its folder.
        resolve = model.backend == "builtin" or model.plan.source.scheme == "builtin"
        work = [(model.cr.spec.model.source, model.plan.model_path, resolve)]
        if not resolve and not model.plan.source.downloaded:
            work = []
        work += [
            (a.model_source().uri, model.adapters[a.name], False)
            for a in model.cr.spec.adapters
            if a.model_source().downloaded
        ]
        for source, path, convert in work:
            argv = [sys.executable, "-m", "fleetllm.local.prepare", source, path]
            process = await GuardedProcess.start(
                [*argv, "--resolve"] if convert else argv,
                # As the pod's pull container, with the spec's variables (credentials).
                spec_env(model, os.environ),
                self.settings.log_dir / f"{model.cr.metadata.name}-prepare.log",
                capture_stdout=True,
            )
            self._preparing.append(process)
            error: str | None = None
            try:
                assert process.stdout is not None
                async for line in process.stdout:
                    try:
                        record = json.loads(line)
                    except ValueError:
                        continue
                    if "total" in record:
                        fleet.preparing = (record["done"], record["total"], record["unit"])
                    error = record.get("error", error)
                    fleet.model_dir = record.get("path", fleet.model_dir)
                code = await process.wait()
            finally:
                fleet.preparing = None
                self._preparing.remove(process)
            if self.stopping:
                return
            if code != 0:
                self.fail(f"model {fleet.name}: {error or describe_exit(code)}")
                return
        fleet.model_dir = fleet.model_dir or model.plan.model_path
        fleet.prepared = True
        self.reconcile(fleet)

    # -- one replica, start to stop --------------------------------------------------------

    async def _lifecycle(self, fleet: ModelFleet, replica: Replica) -> None:
        try:
            while not replica.retire.is_set():
                if not await self._take_devices(fleet, replica):
                    break
                code = await self._run_once(fleet, replica)
                self._give_back(replica)
                if code is None or replica.retire.is_set():
                    break
                served = None
                if replica.ready_since is not None:
                    served = time.monotonic() - replica.ready_since
                replica.failures = failures_after_exit(replica.failures, served)
                delay = restart_delay(replica.failures)
                replica.restarts += 1
                replica.set_state(State.BACKOFF)
                self.publish()
                log.warning(
                    "replica exited; restarting",
                    extra={
                        "model": fleet.name,
                        "replica": replica.name,
                        "exit": describe_exit(code),
                        "restart_in_s": delay,
                        "log": str(replica.log_path),
                        "log_tail": _tail(replica.log_path),
                    },
                )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(replica.retire.wait(), delay)
        finally:
            if replica.process is not None and replica.process.returncode is None:
                replica.process.kill()
            self._give_back(replica)
            fleet.replicas.pop(replica.key, None)
            self.publish()
            self.reconcile(fleet)

    async def _take_devices(self, fleet: ModelFleet, replica: Replica) -> bool:
        """GPUs for a GPU replica, waiting while none are free; False when retired first."""
        count = fleet.model.devices_per_replica
        if not count:
            return True
        replica.set_state(State.PENDING)
        announced = False
        while not replica.retire.is_set():
            devices = self.gpus.take(count)
            if devices is not None:
                replica.devices = devices
                return True
            if not announced:
                log.warning(
                    "replica waits for a free GPU",
                    extra={"model": fleet.name, "replica": replica.name, "gpus": count},
                )
                announced = True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(replica.retire.wait(), READY_POLL_S)
        return False

    def _give_back(self, replica: Replica) -> None:
        """The GPUs and the cores a stopped replica held."""
        if replica.devices is not None:
            self.gpus.give_back(replica.devices)
            replica.devices = None
        if replica.cores is not None:
            self.cores.give_back(replica.cores)
            replica.cores = None

    async def _run_once(self, fleet: ModelFleet, replica: Replica) -> int | None:
        """Start the replica and serve until it exits (its status) or is retired (None)."""
        model = fleet.model
        port = free_port()
        if not model.plan.gpu.is_gpu:
            replica.cores = self.cores.take()
        replica.kv_events = kv_events_endpoint(model, self.sockets, port)
        argv = replica_argv(
            model,
            port,
            threads=len(replica.cores) if replica.cores else None,
            events=replica.kv_events,
        )
        env = replica_env(model, os.environ, replica.devices, replica.cores or ())
        replica.url = f"http://127.0.0.1:{port}"
        replica.ready_since = None
        replica.set_state(State.STARTING)
        process = await GuardedProcess.start(argv, env, replica.log_path)
        replica.process = process
        log.info(
            "replica starting",
            extra={
                "model": fleet.name,
                "replica": replica.name,
                "url": replica.url,
                "pid": process.pid,
            },
        )
        exited = asyncio.create_task(process.wait())
        retired = asyncio.create_task(replica.retire.wait())
        watch: asyncio.Task[bool] | None = None
        try:
            watch = asyncio.create_task(self._until_ready(replica.url, model.startup_seconds))
            await asyncio.wait({exited, retired, watch}, return_when=asyncio.FIRST_COMPLETED)
            if exited.done():
                return exited.result()
            if retired.done():
                await self._stop(fleet, replica, exited, drain=False)
                return None
            if not watch.result():
                log.warning(
                    "replica not ready in time; restarting",
                    extra={"replica": replica.name, "startup_s": model.startup_seconds},
                )
                process.kill()
                return await exited

            if model.adapters:  # before its first request: ready replicas hold them all
                assert self.session is not None
                fleet.refused |= await load_adapters(
                    self.session, fleet.name, replica.name, replica.url, model.adapters
                )
            replica.set_state(State.READY)
            replica.ready_since = time.monotonic()
            self.publish()
            log.info("replica ready", extra={"model": fleet.name, "replica": replica.name})
            watch = asyncio.create_task(self._until_unhealthy(replica.url))
            await asyncio.wait({exited, retired, watch}, return_when=asyncio.FIRST_COMPLETED)
            if exited.done():
                return exited.result()
            if retired.done():
                await self._stop(fleet, replica, exited, drain=True)
                return None
            log.warning(
                "replica stopped answering /health; restarting",
                extra={"replica": replica.name, "failed_polls": LIVENESS_FAILURES},
            )
            process.kill()
            return await exited
        finally:
            for task in (retired, watch):
                if task is not None:
                    task.cancel()
            if not exited.done():
                # Cancelled (the supervisor is going away): the tree goes with it.
                process.kill()
                exited.cancel()
            replica.process = None

    def drain_time(self, fleet: ModelFleet) -> float:
        """How long a replica of `fleet` that is told to stop may take: its model's
        engine.drainSeconds, at shutdown at most the grace period."""
        drain_s = float(fleet.model.cr.spec.engine.drain_seconds)
        return min(drain_s, self.settings.grace_s) if self.stopping else drain_s

    async def _stop(
        self,
        fleet: ModelFleet,
        replica: Replica,
        exited: asyncio.Task[int],
        *,
        drain: bool,
    ) -> None:
        """Drain (the router stops choosing the replica; its open requests finish), then ask
        the engine to stop, and kill the tree if it is not gone in time."""
        assert replica.process is not None and replica.url is not None
        drain_s = self.drain_time(fleet)
        if drain:
            replica.set_state(State.DRAINING)
            self.publish()
            log.info("replica draining", extra={"model": fleet.name, "replica": replica.name})
            deadline = time.monotonic() + drain_s
            while (
                self.in_flight(fleet.name, replica.url) > 0
                and time.monotonic() < deadline
                and not exited.done()
            ):
                await asyncio.sleep(0.05)
        replica.set_state(State.STOPPING)
        self.publish()
        replica.process.terminate()
        await asyncio.wait({exited}, timeout=drain_s + STOP_MARGIN_S)
        if not exited.done():
            log.warning("replica did not stop in time; killing it", extra={"replica": replica.name})
            replica.process.kill()
            await exited
        log.info(
            "replica stopped",
            extra={
                "model": fleet.name,
                "replica": replica.name,
                "exit": describe_exit(exited.result()),
            },
        )

    async def _healthy(self, url: str) -> bool:
        assert self.session is not None
        try:
            async with self.session.get(
                url + "/health", timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)
            ) as response:
                await response.read()
                return response.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def _until_ready(self, url: str, limit_s: float) -> bool:
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            if await self._healthy(url):
                return True
            await asyncio.sleep(STARTING_POLL_S)
        return False

    async def _until_unhealthy(self, url: str) -> bool:
        failed = 0
        while failed < LIVENESS_FAILURES:
            await asyncio.sleep(READY_POLL_S)
            failed = 0 if await self._healthy(url) else failed + 1
        return True

    # -- status ----------------------------------------------------------------------------

    def views(self) -> list[ModelView]:
        now = time.monotonic()
        return [
            ModelView(
                name=f.name,
                endpoint=self.settings.endpoint,
                desired=f.desired,
                replicas=tuple(
                    ReplicaView(r.name, r.state, r.url, r.restarts, now - r.since)
                    for r in f.replicas.values()
                ),
                kv_usage=f.load.kv_usage,
                waiting=f.load.waiting,
                queue_p90_s=f.load.queue_p90_s,
                last_scale=f.last_scale,
                preparing=f.preparing,
                notes=f.model.plan.notes,
            )
            for f in self.fleets.values()
        ]


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> list[str]:
    """The last lines of a replica's log (engine logs hold no prompts by default)."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 8192))
            text = f.read().decode(errors="replace")
    except OSError:
        return []
    return text.splitlines()[-lines:]
