"""The operator running against the emulated API server (tests/kubeapi.py), logged in through
a kubeconfig as in production."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import selectors
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import kopf
import pytest
import pytest_asyncio
from kubeapi import NAMESPACE, EmulatedApiServer, emulated_api
from kubeapi import eventually as eventually_
from kubelogin import kubeconfig_for
from operator_testkit import Controllers, Load, assert_one_writer_per_status_field

from fleetllm.api.deployment import KIND
from fleetllm.kube.client import KubeClient
from fleetllm.kube.login import Credentials, load_credentials
from fleetllm.operator.handlers import OperatorState, build_registry, make_settings
from fleetllm.planner.settings import DEFAULT_CONFIG, OperatorConfig


@pytest_asyncio.fixture()
async def api() -> AsyncIterator[EmulatedApiServer]:
    async with emulated_api() as server:
        yield server


class _CycleCounter(logging.Handler):
    """Counts kopf's finished handling cycles per LLMDeployment: the moment after which kopf
    has written all it will write for an event (its own annotations included)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.finished: collections.Counter[str] = collections.Counter()

    def emit(self, record: logging.LogRecord) -> None:
        ref = getattr(record, "k8s_ref", None) or {}
        if ref.get("kind") == KIND and record.getMessage().startswith("Handling cycle is finished"):
            self.finished[ref.get("name", "")] += 1


class _FastSelector(selectors.DefaultSelector):
    """Waits `rate` times shorter than asked: the other half of `FastClockLoop`."""

    def __init__(self, rate: float) -> None:
        super().__init__()
        self.rate = rate

    def select(self, timeout: float | None = None) -> list[Any]:
        return super().select(None if timeout is None else timeout / self.rate)


class FastClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock runs `rate` times faster than the wall's: every sleep,
    timer, backoff and timeout in it (kopf's, aiohttp's, the operator's) passes that much
    sooner, while sockets work as ever. Minutes of an outage play in seconds."""

    def __init__(self, rate: float) -> None:
        super().__init__(_FastSelector(rate))
        self.rate = rate

    def time(self) -> float:
        return time.monotonic() * self.rate


class RunningOperator:
    """The operator in its own thread and event loop, as in production (one process).

    By default it serves NAMESPACE standalone (or, with a `priority`, as a member of the
    KopfPeering "fleetllm" there), without kopf's cluster scanning (which these tests do not
    need). With `settings`, it runs with those (say, the production ones), on `namespaces`,
    or cluster-wide when that is None. With a `clock_rate`, its event loop's clock runs that
    many times faster than the wall's (see FastClockLoop)."""

    def __init__(
        self,
        load: Callable[[], Credentials],
        conflict_recheck_seconds: float,
        *,
        user_agent: str = "fleetllm-operator",
        priority: int | None = None,
        autoscale_interval: float = 5.0,
        resync_interval: float = 300.0,
        adapter_interval: float = 10.0,
        settings: kopf.OperatorSettings | None = None,
        namespaces: list[str] | None = [NAMESPACE],  # noqa: B006 - never mutated
        clock_rate: float = 1.0,
        config: OperatorConfig = DEFAULT_CONFIG,
    ) -> None:
        client = KubeClient(load, user_agent=user_agent)
        self.state = OperatorState.create(
            client, config, conflict_recheck_seconds=conflict_recheck_seconds
        )
        self.priority = priority
        """None: standalone; else a peering member ("fleetllm") with this priority."""
        self.autoscale_interval = autoscale_interval
        self.resync_interval = resync_interval
        self.adapter_interval = adapter_interval
        self.settings = settings
        self.namespaces = namespaces
        self.clock_rate = clock_rate
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name="operator", daemon=True)
        self._cycles = _CycleCounter()
        self.failure: BaseException | None = None

    def _main(self) -> None:
        settings = self.settings
        if settings is None:
            settings = make_settings(standalone=self.priority is None, priority=self.priority)
            settings.scanning.disabled = True  # kmock cannot list namespaces
        settings.watching.reconnect_backoff = 0.05
        settings.queueing.exit_timeout = 0.1
        # An operator that stops on its own is a failure to report, never a process to kill
        # (kopf's last resort when it does not exit in time).
        settings.process.ultimate_exiting_timeout = None
        rate = self.clock_rate
        try:
            with asyncio.Runner(loop_factory=lambda: FastClockLoop(rate)) as runner:
                runner.run(
                    kopf.operator(
                        registry=build_registry(
                            self.autoscale_interval, self.resync_interval, self.adapter_interval
                        ),
                        settings=settings,
                        memo=self.state,
                        clusterwide=self.namespaces is None,
                        namespaces=self.namespaces or [],
                        standalone=settings.peering.standalone,
                        stop_flag=self._stop,
                        ready_flag=self._ready,
                    )
                )
        except BaseException as exc:
            self.failure = exc

    async def start(self) -> None:
        kopf_objects = logging.getLogger("kopf.objects")
        kopf_objects.addHandler(self._cycles)
        kopf_objects.setLevel(logging.DEBUG)
        self._thread.start()
        started = await asyncio.to_thread(self._ready.wait, 30)
        assert started and self.failure is None, f"operator did not start: {self.failure!r}"

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.to_thread(self._thread.join, 30)
        logging.getLogger("kopf.objects").removeHandler(self._cycles)
        assert not self._thread.is_alive(), "operator did not stop"

    def reconciles(self, name: str) -> int:
        return self.state.reconciler.counts[NAMESPACE, name]

    def handled_cycles(self, name: str) -> int:
        return self._cycles.finished[name]


@pytest_asyncio.fixture()
async def start_operator(
    api: EmulatedApiServer, tmp_path: Path
) -> AsyncIterator[Callable[..., Any]]:
    """`await start_operator()` runs an operator logged in through a kubeconfig of `api`;
    `kubeconfig=PATH` gives another one."""
    running: list[RunningOperator] = []
    default = tmp_path / "kubeconfig"
    default.write_text(kubeconfig_for(str(api.url).rstrip("/")))

    async def start(
        kubeconfig: Path = default, conflict_recheck_seconds: float = 0.5, **kwargs: Any
    ) -> RunningOperator:
        """kwargs: user_agent, priority (a peering member), autoscale_interval,
        resync_interval, adapter_interval, settings, namespaces, clock_rate, config (see
        RunningOperator)."""
        load = functools.partial(load_credentials, kubeconfig=kubeconfig)
        operator = RunningOperator(load, conflict_recheck_seconds, **kwargs)
        running.append(operator)
        await operator.start()
        return operator

    yield start
    for operator in running:
        with contextlib.suppress(AssertionError):
            await operator.stop()
    # Whatever a test did, every status field it saw written had its one writer.
    assert_one_writer_per_status_field(api)


@pytest.fixture()
def eventually() -> Callable[..., Any]:
    """`await eventually(check, what)`: wait until `check()` returns something truthy (the
    operator works asynchronously); fail the test, naming `what`, if it never does."""
    return eventually_


@pytest_asyncio.fixture()
async def controllers(api: EmulatedApiServer) -> AsyncIterator[Any]:
    """`controllers(name, load)` plays the Deployment and ReplicaSet controllers and the
    kubelet for one LLMDeployment (operator_testkit.Controllers)."""
    started: list[tuple[Controllers, asyncio.Task[None]]] = []

    def start(
        name: str, load: Load, ready_after: float = 0.0, namespace: str = NAMESPACE
    ) -> Controllers:
        c = Controllers(api, name, load, ready_after, namespace)
        started.append((c, asyncio.create_task(c.run())))
        return c

    yield start
    for c, task in started:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await c.stop()
