"""kopf wiring: which events trigger a reconcile, retries, settings, and `operator run`.

All decisions live in the reconciler; handlers here only say *when* to reconcile:
- the LLMDeployment is created, changed, or found on start (resume);
- one of its children changes or disappears (drift, deletion, Deployment status);
- it is in conflict (a child's name is taken by an object it does not own): retried every
  `conflict_recheck_seconds`, since the foreign object's removal raises no event here;
- every `resync_interval` seconds, whatever happened (a missed event, an unwatched child
  such as the NetworkPolicy or the key Secret changed, an outage that outlived a watch).
Every path retries transient API failures without limit, with a capped backoff (retry.py).
One kopf timer steps the autoscaler (scaler.py) of each LLMDeployment the builtin
autoscaler drives, every `autoscale_interval` seconds, on the peering leader only; after each
reconcile of one it does not drive, the autoscaler stands down (its status fields go).
Another steps the adapter loader (adapter_loader.py) of each LLMDeployment with spec.lora, every
`adapter_interval` seconds, also on the leader only.
kopf puts its finalizer on those LLMDeployments (and only on those), so that the timer stops
before the object goes; nothing else needs cleanup beyond the garbage collection that
ownerReferences give.

kopf and the reconciler share one login: kopf's login handler returns the KubeClient's
credentials (see fleetllm.kube), and children are watched with a server-side label selector.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import kopf

from fleetllm.api.contract import LABEL_INSTANCE, LABEL_MANAGED_BY, MANAGER
from fleetllm.api.deployment import GROUP, KIND, PLURAL, VERSION
from fleetllm.kube.client import KubeClient
from fleetllm.kube.errors import ApiError
from fleetllm.kube.login import LoginError, load_credentials
from fleetllm.operator.adapter_loader import AdapterLoader, reported
from fleetllm.operator.engine_http import EngineHttp
from fleetllm.operator.reconciler import CHILD_RESOURCES, Reconciler
from fleetllm.operator.retry import Backoff, Sleep, reconcile_until_done
from fleetllm.operator.scaler import Scaler, driven_by_builtin
from fleetllm.planner.settings import DEFAULT_CONFIG, OperatorConfig

logger = logging.getLogger("fleetllm.operator")

# None: kopf retries a failed handler for as long as it fails (each wait capped below).
HANDLER_RETRIES = None
MAX_BACKOFF_SECONDS = 60.0
RESYNC_SECONDS = 300.0
CONFLICT_RECHECK_SECONDS = 30.0
AUTOSCALE_INTERVAL_SECONDS = 5.0
ADAPTER_INTERVAL_SECONDS = 10.0
COMPONENT = "fleetllm-operator"
CHILD_SELECTOR = f"{LABEL_MANAGED_BY}={MANAGER}"


@dataclass
class OperatorState:
    """Shared by every handler through kopf's memo (kopf copies the memo per object, so the
    reconciler is made once, up front)."""

    client: KubeClient
    reconciler: Reconciler
    scaler: Scaler
    adapters: AdapterLoader
    conflict_recheck_seconds: float = CONFLICT_RECHECK_SECONDS
    backoff: Backoff = field(default_factory=lambda: Backoff(max_seconds=MAX_BACKOFF_SECONDS))
    sleep: Sleep = asyncio.sleep
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    stopping: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when the operator shuts down (an object: kopf's per-object memo copies share it)."""

    @classmethod
    def create(
        cls,
        client: KubeClient,
        config: OperatorConfig = DEFAULT_CONFIG,
        conflict_recheck_seconds: float = CONFLICT_RECHECK_SECONDS,
        engine_key_root: str = "",
    ) -> OperatorState:
        async def post_event(body: dict[str, Any], type_: str, reason: str, message: str) -> None:
            try:
                await client.create_event(
                    body,
                    type="Warning" if type_ == "Warning" else "Normal",
                    reason=reason,
                    message=message,
                    component=COMPONENT,
                )
            except (ApiError, aiohttp.ClientError, TimeoutError) as exc:
                # An Event is a courtesy; losing one must not fail the reconcile.
                logger.warning("could not post an Event", extra={"error": str(exc)})

        engines = EngineHttp()
        return cls(
            client=client,
            reconciler=Reconciler(
                client, emit=post_event, config=config, engine_key_root=engine_key_root
            ),
            scaler=Scaler(client, emit=post_event, http=engines),
            adapters=AdapterLoader(
                client,
                emit=post_event,
                config=config,
                engine_key_root=engine_key_root,
                http=engines,
            ),
            conflict_recheck_seconds=conflict_recheck_seconds,
        )


async def _reconcile_or_retry(
    memo: OperatorState, body: Mapping[str, Any], namespace: str, name: str, retry: int
) -> None:
    try:
        await memo.reconciler.reconcile(namespace, name)
        await memo.scaler.stand_down(body)
    except ApiError as exc:
        if exc.retryable:
            raise kopf.TemporaryError(str(exc), delay=memo.backoff.delay(retry)) from exc
        raise kopf.PermanentError(str(exc)) from exc
    except (TimeoutError, aiohttp.ClientError) as exc:
        delay = memo.backoff.delay(retry)
        raise kopf.TemporaryError(f"API unreachable: {exc}", delay=delay) from exc
    except LoginError as exc:
        raise kopf.TemporaryError(str(exc), delay=memo.backoff.delay(retry)) from exc


def _owner_name(body: dict[str, Any]) -> str | None:
    meta = body.get("metadata") or {}
    for ref in meta.get("ownerReferences") or []:
        if ref.get("kind") == KIND and ref.get("apiVersion", "").startswith(f"{GROUP}/"):
            return str(ref.get("name"))
    return (meta.get("labels") or {}).get(LABEL_INSTANCE)


def _builtin_scaling(body: Mapping[str, Any], **_: Any) -> bool:
    """Whether the operator's own autoscaler scales it (the timer's filter)."""
    return driven_by_builtin(body) is not None


def _has_adapters(body: Mapping[str, Any], **_: Any) -> bool:
    """Whether the adapter loader has work there (the timer's filter)."""
    return reported(body)


def build_registry(
    autoscale_interval: float = AUTOSCALE_INTERVAL_SECONDS,
    resync_interval: float = RESYNC_SECONDS,
    adapter_interval: float = ADAPTER_INTERVAL_SECONDS,
) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()

    @kopf.on.login(registry=registry)
    async def login(memo: OperatorState, **_: Any) -> kopf.ConnectionInfo:
        # kopf asks at start, when its credentials expire, and after a 401: load them again.
        credentials = await memo.client.credentials(refresh=True)
        return credentials.connection_info()

    @kopf.on.startup(registry=registry)
    async def start_rechecks(memo: OperatorState, **_: Any) -> None:
        memo.tasks.append(asyncio.create_task(_recheck_conflicts(memo)))

    @kopf.on.cleanup(registry=registry)
    async def close(memo: OperatorState, **_: Any) -> None:
        memo.stopping.set()
        for task in memo.tasks:
            task.cancel()
        await asyncio.gather(*memo.tasks, return_exceptions=True)
        await memo.scaler.close()
        await memo.adapters.close()
        await memo.client.close()

    @kopf.on.resume(GROUP, VERSION, PLURAL, registry=registry, retries=HANDLER_RETRIES)
    @kopf.on.create(GROUP, VERSION, PLURAL, registry=registry, retries=HANDLER_RETRIES)
    @kopf.on.update(GROUP, VERSION, PLURAL, registry=registry, retries=HANDLER_RETRIES)
    async def llmdeployment_changed(
        body: kopf.Body, name: str, namespace: str, memo: OperatorState, retry: int, **_: Any
    ) -> None:
        await _reconcile_or_retry(memo, body, namespace, name, retry)

    @kopf.timer(
        GROUP,
        VERSION,
        PLURAL,
        registry=registry,
        id="autoscale",
        interval=autoscale_interval,
        when=_builtin_scaling,
    )
    async def autoscale(body: kopf.Body, memo: OperatorState, **_: Any) -> None:
        if memo.stopping.is_set():
            return
        try:
            await memo.scaler.step(dict(body))
        except (TimeoutError, ApiError, LoginError, aiohttp.ClientError) as exc:
            if memo.stopping.is_set():
                return  # the operator is shutting down under this step
            # The next tick tries again; a failed step changes nothing.
            meta = body.get("metadata") or {}
            logger.warning(
                "autoscaler step failed",
                extra={
                    "llmdeployment": f"{meta.get('namespace')}/{meta.get('name')}",
                    "error": str(exc),
                },
            )

    @kopf.timer(
        GROUP,
        VERSION,
        PLURAL,
        registry=registry,
        id="adapters",
        interval=adapter_interval,
        when=_has_adapters,
    )
    async def load_adapters(body: kopf.Body, memo: OperatorState, **_: Any) -> None:
        if memo.stopping.is_set():
            return
        try:
            await memo.adapters.step(dict(body))
        except (TimeoutError, ApiError, LoginError, aiohttp.ClientError) as exc:
            if memo.stopping.is_set():
                return
            # The next tick looks again from what is there then.
            meta = body.get("metadata") or {}
            logger.warning(
                "adapter step failed",
                extra={
                    "llmdeployment": f"{meta.get('namespace')}/{meta.get('name')}",
                    "error": str(exc),
                },
            )

    _without_finalizer(registry, "adapters")

    @kopf.timer(
        GROUP,
        VERSION,
        PLURAL,
        registry=registry,
        id="resync",
        interval=resync_interval,
        initial_delay=resync_interval,
    )
    async def resync(name: str, namespace: str, memo: OperatorState, **_: Any) -> None:
        # A timer runs on the peering leader only, like every handler: one writer.
        if not memo.stopping.is_set():
            await reconcile_until_done(memo.reconciler, namespace, name, memo.backoff, memo.sleep)

    _without_finalizer(registry, "resync")

    for kind, resource in CHILD_RESOURCES.items():
        group, _, version = resource.api_version.rpartition("/")

        @kopf.on.event(
            group,
            version,
            resource.plural,
            registry=registry,
            id=f"child-{kind.lower()}",
            labels={LABEL_MANAGED_BY: MANAGER},
        )
        async def child_changed(
            body: dict[str, Any],
            type: str | None,
            namespace: str,
            memo: OperatorState,
            **_: Any,
        ) -> None:
            # type is None for the initial listing: resume handlers cover that case.
            owner = _owner_name(body)
            if type is None or owner is None:
                return
            # Watch handlers get no retries from kopf: retry here, for as long as it takes.
            await reconcile_until_done(memo.reconciler, namespace, owner, memo.backoff, memo.sleep)

    return registry


def _without_finalizer(registry: kopf.OperatorRegistry, handler_id: str) -> None:
    """kopf gives every object a timer covers a finalizer, so that the timer stops before the
    object goes. The resync needs none (a tick on a vanished object finds nothing to do), and a
    finalizer on every LLMDeployment would block its deletion whenever the operator is down;
    kopf.timer offers no switch, so the registered handler is replaced by one without."""
    spawning = registry._spawning
    for i, handler in enumerate(spawning._handlers):
        if handler.id == handler_id:
            spawning._handlers[i] = dataclasses.replace(handler, requires_finalizer=False)


async def _recheck_conflicts(memo: OperatorState) -> None:
    while True:
        await asyncio.sleep(memo.conflict_recheck_seconds)
        for namespace, name in sorted(memo.reconciler.conflicted):
            try:
                await memo.reconciler.reconcile(namespace, name)
            except (TimeoutError, ApiError, LoginError, aiohttp.ClientError) as exc:
                logger.warning(
                    "reconcile of a conflicted LLMDeployment failed",
                    extra={"llmdeployment": f"{namespace}/{name}", "error": str(exc)},
                )


def exact_namespaces(namespaces: list[str]) -> bool:
    """Whether the namespaces are plain names (no kopf glob patterns or negations)."""
    return bool(namespaces) and not any(set(ns) & set("*?[]!,") for ns in namespaces)


def make_settings(
    *,
    standalone: bool,
    peering: str | None = None,
    priority: int | None = None,
    namespaces: list[str] | None = None,
) -> kopf.OperatorSettings:
    """kopf's settings; `namespaces` are those served (None or empty: all of them)."""
    settings = kopf.OperatorSettings()
    # Progress and the last handled spec go into fleetllm.io annotations, never into status,
    # whose schema belongs to the CRD.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    # Kubernetes Events for warnings and errors only; the reconciler posts its own transitions.
    settings.posting.level = logging.WARNING
    settings.posting.reporting_component = COMPONENT
    settings.posting.reporting_instance = socket.gethostname()
    settings.networking.request_timeout = 60
    settings.networking.connect_timeout = 10
    # kopf's own requests (its watches, lists and annotation patches) give up after eight
    # tries, about a minute, by default: a watch that gives up stops the whole operator. An
    # API outage (a control-plane upgrade) is waited out instead, each wait capped.
    settings.networking.error_backoffs = Backoff(max_seconds=MAX_BACKOFF_SECONDS)
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    # Children are watched for the operator's own objects only, filtered by the API server.
    for resource in CHILD_RESOURCES.values():
        group, _, version = resource.api_version.rpartition("/")
        settings.watching.label_selectors[group, version, resource.plural] = CHILD_SELECTOR
    settings.execution.max_workers = 4
    # Served namespaces given by name leave nothing to discover: kopf then neither lists and
    # watches every namespace nor watches CRDs, which a namespace-scoped install may not read
    # (the LLMDeployment CRD must exist when the operator starts, as Helm's crds/ ensure).
    settings.scanning.disabled = exact_namespaces(namespaces or [])
    settings.peering.standalone = standalone
    if not standalone:
        settings.peering.mandatory = True
        settings.peering.name = peering or "fleetllm"
        # Replicas need distinct priorities: with equal ones kopf pauses all of them.
        settings.peering.priority = (
            priority if priority is not None else random.randint(1, 2**31 - 1)
        )
    return settings


def run(
    *,
    namespaces: list[str],
    clusterwide: bool,
    standalone: bool,
    peering: str,
    priority: int | None,
    liveness: str | None,
    log_json: bool,
    verbose: bool,
    config: OperatorConfig = DEFAULT_CONFIG,
    autoscale_interval: float = AUTOSCALE_INTERVAL_SECONDS,
    resync_interval: float = RESYNC_SECONDS,
    engine_key_root: str = "",
) -> int:
    kopf.configure(
        verbose=verbose, log_format=kopf.LogFormat.JSON if log_json else kopf.LogFormat.FULL
    )
    load_credentials()  # fail fast, with a clear message, when there are no credentials at all
    settings = make_settings(
        standalone=standalone,
        peering=peering,
        priority=priority,
        namespaces=[] if clusterwide else namespaces,
    )
    client = KubeClient(load_credentials, user_agent=COMPONENT)
    kopf.run(
        registry=build_registry(autoscale_interval, resync_interval),
        settings=settings,
        memo=OperatorState.create(client, config, engine_key_root=engine_key_root),
        clusterwide=clusterwide,
        namespaces=namespaces,
        standalone=standalone,
        liveness_endpoint=liveness,
    )
    return 0
