"""kopf wiring: which events trigger a reconcile, retries, settings, and `operator run`.

All decisions live in the reconciler; handlers here only say *when* to reconcile:
- the LLMDeployment is created, changed, or found on start (resume);
- one of its children changes or disappears (drift, deletion, Deployment status).
There are no timers or daemons: kopf would put a finalizer on every LLMDeployment for them,
and nothing here needs cleanup beyond the garbage collection that ownerReferences give.
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import kopf

from fleetllm.operator.api import GROUP, KIND, PLURAL, VERSION
from fleetllm.operator.config import DEFAULT_CONFIG, OperatorConfig
from fleetllm.operator.kube import RESOURCES, ApiError, KubeClient
from fleetllm.operator.reconciler import Reconciler
from fleetllm.operator.render import LABEL_INSTANCE, LABEL_MANAGED_BY, MANAGER

logger = logging.getLogger("fleetllm.operator")

HANDLER_RETRIES = 10
CHILD_RETRIES = 5
MAX_BACKOFF_SECONDS = 60.0
CHILD_KINDS = ("ConfigMap", "Service", "Deployment", "PodDisruptionBudget")


def default_login() -> kopf.ConnectionInfo:
    """The pod's service account in a cluster, else the kubeconfig."""
    settings = kopf.OperatorSettings()
    try:
        info = kopf.login_with_service_account(settings=settings) or kopf.login_with_kubeconfig(
            settings=settings
        )
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"cannot read Kubernetes credentials: {exc}") from None
    if info is None:
        raise ValueError(
            "no Kubernetes credentials: not in a cluster and no kubeconfig found "
            "(set KUBECONFIG or run in a pod with a service account)"
        )
    return info


@dataclass
class OperatorState:
    """Shared by every handler through kopf's memo (kopf copies the memo per object, so the
    reconciler is made once, up front)."""

    login: Callable[[], kopf.ConnectionInfo]
    reconciler: Reconciler

    @classmethod
    def create(
        cls, login: Callable[[], kopf.ConnectionInfo], config: OperatorConfig = DEFAULT_CONFIG
    ) -> OperatorState:
        reconciler = Reconciler(KubeClient(login), emit=_post_event, config=config)
        return cls(login=login, reconciler=reconciler)


def _post_event(body: dict[str, Any], type_: str, reason: str, message: str) -> None:
    kopf.event(body, type=type_, reason=reason, message=message[:1024])  # type: ignore[arg-type]


def _backoff(retry: int) -> float:
    return min(MAX_BACKOFF_SECONDS, 2.0**retry)


async def _reconcile_or_retry(memo: OperatorState, namespace: str, name: str, retry: int) -> None:
    try:
        await memo.reconciler.reconcile(namespace, name)
    except ApiError as exc:
        if exc.retryable:
            raise kopf.TemporaryError(str(exc), delay=_backoff(retry)) from exc
        raise kopf.PermanentError(str(exc)) from exc
    except (TimeoutError, aiohttp.ClientError) as exc:
        raise kopf.TemporaryError(f"API unreachable: {exc}", delay=_backoff(retry)) from exc


def _owner_name(body: dict[str, Any]) -> str | None:
    meta = body.get("metadata") or {}
    for ref in meta.get("ownerReferences") or []:
        if ref.get("kind") == KIND and ref.get("apiVersion", "").startswith(f"{GROUP}/"):
            return str(ref.get("name"))
    return (meta.get("labels") or {}).get(LABEL_INSTANCE)


def build_registry() -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()

    @kopf.on.login(registry=registry)
    def login(memo: OperatorState, **_: Any) -> kopf.ConnectionInfo:
        return memo.login()

    @kopf.on.cleanup(registry=registry)
    async def close(memo: OperatorState, **_: Any) -> None:
        await memo.reconciler.client.close()

    @kopf.on.resume(GROUP, VERSION, PLURAL, registry=registry, retries=HANDLER_RETRIES)
    @kopf.on.create(GROUP, VERSION, PLURAL, registry=registry, retries=HANDLER_RETRIES)
    @kopf.on.update(GROUP, VERSION, PLURAL, registry=registry, retries=HANDLER_RETRIES)
    async def llmdeployment_changed(
        name: str, namespace: str, memo: OperatorState, retry: int, **_: Any
    ) -> None:
        await _reconcile_or_retry(memo, namespace, name, retry)

    for kind in CHILD_KINDS:
        resource = RESOURCES[kind]
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
            # Watch handlers get no retries from kopf; retry here, bounded.
            for retry in range(CHILD_RETRIES):
                try:
                    await memo.reconciler.reconcile(namespace, owner)
                    return
                except (TimeoutError, ApiError, aiohttp.ClientError) as exc:
                    final = retry == CHILD_RETRIES - 1 or (
                        isinstance(exc, ApiError) and not exc.retryable
                    )
                    logger.warning(
                        "reconcile after a child change failed",
                        extra={
                            "llmdeployment": f"{namespace}/{owner}",
                            "error": str(exc),
                            "retry": retry,
                            "giving_up": final,
                        },
                    )
                    if final:
                        return
                    await asyncio.sleep(_backoff(retry))

    return registry


def make_settings(
    *, standalone: bool, peering: str | None = None, priority: int | None = None
) -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    # Progress and the last handled spec go into fleetllm.io annotations, never into status,
    # whose schema belongs to the CRD.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    # Kubernetes Events for warnings and errors only; the reconciler posts its own transitions.
    settings.posting.level = logging.WARNING
    settings.posting.reporting_component = "fleetllm-operator"
    settings.posting.reporting_instance = socket.gethostname()
    settings.networking.request_timeout = 60
    settings.networking.connect_timeout = 10
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.execution.max_workers = 4
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
) -> int:
    kopf.configure(
        verbose=verbose, log_format=kopf.LogFormat.JSON if log_json else kopf.LogFormat.FULL
    )
    default_login()  # fail fast, with a clear message, when there are no credentials at all
    settings = make_settings(standalone=standalone, peering=peering, priority=priority)
    kopf.run(
        registry=build_registry(),
        settings=settings,
        memo=OperatorState.create(default_login, config),
        clusterwide=clusterwide,
        namespaces=namespaces,
        standalone=standalone,
        liveness_endpoint=liveness,
    )
    return 0
