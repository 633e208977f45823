"""Level-triggered reconciliation of one LLMDeployment: read it, plan, render, apply what
differs, and write the status when it changed.

Every call starts from what is in the cluster now, whatever triggered it (the LLMDeployment
changed, a child changed or vanished, a periodic resync, an operator restart), so calls are
idempotent: when nothing differs, nothing is written.

The operator never takes over an object it does not own: when a child's name is taken by an
object without this LLMDeployment as its controller, nothing is applied, the object is left
untouched, and the status says so (reason `Conflict`).
"""

from __future__ import annotations

import asyncio
import collections
import datetime
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fleetllm.api.contract import ANNOTATION_APPLIED, child_names
from fleetllm.api.deployment import API_VERSION, KIND, LLMDEPLOYMENTS, LLMDeployment
from fleetllm.api.manifests import parse_llmdeployment
from fleetllm.api.status import ADAPTER_RECORD_FIELDS, SCALE_RECORD_FIELDS
from fleetllm.kube.client import KubeClient
from fleetllm.kube.errors import ApiError
from fleetllm.kube.resources import (
    CONFIGMAPS,
    DEPLOYMENTS,
    HORIZONTALPODAUTOSCALERS,
    NETWORKPOLICIES,
    PERSISTENTVOLUMECLAIMS,
    PODDISRUPTIONBUDGETS,
    SECRETS,
    SERVICES,
    Resource,
)
from fleetllm.operator.admission import new_key_secret, review
from fleetllm.operator.render import render
from fleetllm.operator.status import Refusal, Transition, build_status
from fleetllm.planner.checks import claims_to_check
from fleetllm.planner.errors import PlanError
from fleetllm.planner.plan import Plan, plan
from fleetllm.planner.settings import DEFAULT_CONFIG, OperatorConfig
from fleetllm.policy.check import secret_refusal

logger = logging.getLogger("fleetllm.operator")

CONFLICT_ATTEMPTS = 3
CHILD_RESOURCES: dict[str, Resource] = {
    "ConfigMap": CONFIGMAPS,
    "Service": SERVICES,
    "Deployment": DEPLOYMENTS,
    "PodDisruptionBudget": PODDISRUPTIONBUDGETS,
}
# The object that scales the LLMDeployment instead of the operator's own autoscaler
# (spec.scaling.mode hpa | keda), named after it. Not watched: KEDA may not be installed.
SCALEDOBJECTS = Resource("keda.sh/v1alpha1", "scaledobjects", "ScaledObject")
AUTOSCALER_RESOURCES: dict[str, Resource] = {
    "HorizontalPodAutoscaler": HORIZONTALPODAUTOSCALERS,
    "ScaledObject": SCALEDOBJECTS,
}
AUTOSCALER_KINDS = {"hpa": "HorizontalPodAutoscaler", "keda": "ScaledObject"}
# The API server's answers to an object it will never accept as written (BadRequest, Invalid).
INVALID_STATUSES = (400, 422)
# Children not watched (a change to them raises no event): the periodic resync repairs them.
# The key Secret: without a root, made once and never rewritten; with one, rewritten whenever
# it is not the derived key (a root rotation, a hand edit).
UNWATCHED_RESOURCES: dict[str, Resource] = {"NetworkPolicy": NETWORKPOLICIES, "Secret": SECRETS}
RESOURCES: dict[str, Resource] = {
    **CHILD_RESOURCES,
    **UNWATCHED_RESOURCES,
    **AUTOSCALER_RESOURCES,
}
# Read only: whether the replicas can share a model's claim.
READ_RESOURCES: dict[str, Resource] = {"PersistentVolumeClaim": PERSISTENTVOLUMECLAIMS}

OTHER_WRITERS_FIELDS = SCALE_RECORD_FIELDS | ADAPTER_RECORD_FIELDS
"""Status keys the reconciler neither writes nor removes."""

# (body of the LLMDeployment, event type, reason, message)
EventSink = Callable[[dict[str, Any], str, str, str], Awaitable[None]]


def utcnow() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def is_subset(desired: Any, live: Any) -> bool:
    """Whether every value in `desired` is in `live`; lists must match item by item. Fields
    only `live` has (server defaults, other managers' fields) do not count as differences."""
    if isinstance(desired, dict):
        return isinstance(live, dict) and all(
            key in live and is_subset(value, live[key]) for key, value in desired.items()
        )
    if isinstance(desired, list):
        return (
            isinstance(live, list)
            and len(desired) == len(live)
            and all(is_subset(d, v) for d, v in zip(desired, live, strict=True))
        )
    return bool(desired == live)


def controlled_by(live: dict[str, Any], uid: str | None) -> bool:
    """Whether the object's controller is the LLMDeployment with this uid."""
    refs = (live.get("metadata") or {}).get("ownerReferences") or []
    return uid is not None and any(ref.get("controller") and ref.get("uid") == uid for ref in refs)


def needs_apply(desired: dict[str, Any], live: dict[str, Any] | None) -> bool:
    """Apply when the child is missing, was made from another rendering, or drifted."""
    if live is None:
        return True
    live_meta = live.get("metadata") or {}
    want_meta = desired["metadata"]
    # The key Secret carries no hash of its rendering (that would be a hash of the key): its
    # data alone is compared.
    applied = (want_meta.get("annotations") or {}).get(ANNOTATION_APPLIED)
    if applied is not None and (live_meta.get("annotations") or {}).get(ANNOTATION_APPLIED) != (
        applied
    ):
        return True
    if not is_subset(want_meta.get("labels", {}), live_meta.get("labels") or {}):
        return True
    owner_uids = {ref.get("uid") for ref in live_meta.get("ownerReferences") or []}
    if any(ref["uid"] not in owner_uids for ref in want_meta.get("ownerReferences", [])):
        return True
    body = {k: v for k, v in desired.items() if k not in ("apiVersion", "kind", "metadata")}
    return not is_subset(body, live)


@dataclass
class Outcome:
    """What one reconcile did."""

    planned: bool
    applied: list[str] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    unavailable: str | None = None
    """Why the spec.scaling.mode's autoscaler could not be created."""
    rejected: list[str] = field(default_factory=list)
    """Children the API server refused as invalid ("KIND NAME: its message"): the spec passes
    something through that Kubernetes does not accept (pod.*, engine.env valueFrom)."""
    status_written: bool = False


@dataclass(eq=False)
class Reconciler:
    client: KubeClient
    emit: EventSink
    clock: Callable[[], str] = utcnow
    config: OperatorConfig = DEFAULT_CONFIG
    engine_key_root: str = ""
    # Child events and LLMDeployment events for one object arrive on different watch
    # streams; one reconcile at a time per object keeps their reads and writes ordered.
    _locks: dict[tuple[str, str], asyncio.Lock] = field(
        default_factory=lambda: collections.defaultdict(asyncio.Lock), init=False
    )
    counts: collections.Counter[tuple[str, str]] = field(
        default_factory=collections.Counter, init=False
    )
    # LLMDeployments whose children's names are taken by objects they do not own; a
    # foreign object's removal raises no event here, so these are retried on a timer.
    conflicted: set[tuple[str, str]] = field(default_factory=set, init=False)

    async def reconcile(self, namespace: str, name: str) -> Outcome | None:
        """Bring one LLMDeployment's children and status in line; None if it is gone."""
        async with self._locks[namespace, name]:
            try:
                for attempt in range(1, CONFLICT_ATTEMPTS + 1):
                    try:
                        return await self._reconcile_once(namespace, name)
                    except ApiError as exc:
                        # The object changed under us: start again from what is there now.
                        if not exc.conflict or attempt == CONFLICT_ATTEMPTS:
                            raise
                        logger.info(
                            "conflict, retrying",
                            extra={"llmdeployment": f"{namespace}/{name}", "attempt": attempt},
                        )
                raise AssertionError("unreachable")
            finally:
                self.counts[namespace, name] += 1

    async def _reconcile_once(self, namespace: str, name: str) -> Outcome | None:
        body = await self.client.get(LLMDEPLOYMENTS, name, namespace)
        if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
            self.conflicted.discard((namespace, name))
            return None  # garbage collection removes the children through ownerReferences
        meta = body.get("metadata") or {}
        generation = meta.get("generation")

        cr: LLMDeployment | None = None
        outcome: Plan | Refusal
        try:
            cr = parse_llmdeployment(body, f"{KIND} {namespace}/{name}")
            claims = await self._claim_access_modes(namespace, cr)
            outcome = plan(cr.spec, self.config, claims)
            outcome = await self._admit(namespace, cr, outcome)
        except PlanError as exc:
            outcome = Refusal(exc.reason, exc.message)
        except ValueError as exc:
            outcome = Refusal("InvalidSpec", str(exc))

        result = Outcome(planned=isinstance(outcome, Plan))
        uid = meta.get("uid")
        live: dict[str, dict[str, Any] | None] = {}
        autoscaler = None
        if cr is not None and cr.spec.scaling is not None and not cr.spec.autoscaled_by_builtin:
            autoscaler = AUTOSCALER_KINDS[cr.spec.scaling.mode]
        names = child_names(name)
        if autoscaler is not None:
            names[autoscaler] = name
        for kind, child in names.items():
            live[kind] = await self.client.get(RESOURCES[kind], child, namespace)
            if live[kind] is not None and not controlled_by(live[kind], uid):
                result.conflicts.append(f"{kind} {child}")
                live[kind] = None  # not ours: never read as our state, never written
        if isinstance(outcome, Plan) and cr is not None and not result.conflicts:
            # The key first: the engine pods read it at start.
            desired_objects = []
            if self.engine_key_root or live["Secret"] is None:
                desired_objects.append(new_key_secret(cr, self.engine_key_root))
            for desired in desired_objects + render(cr, outcome, self.config):
                desired["metadata"].setdefault("namespace", namespace)
                kind, child = desired["kind"], desired["metadata"]["name"]
                if needs_apply(desired, live[kind]):
                    verb = "Created" if live[kind] is None else "Updated"
                    try:
                        live[kind] = await self.client.apply(RESOURCES[kind], desired)
                    except ApiError as exc:
                        if exc.status in INVALID_STATUSES:
                            # Retrying cannot help: the status says what to fix in the spec.
                            result.rejected.append(f"{kind} {child}: {exc.message}")
                            continue
                        if kind != "ScaledObject" or not exc.not_found:
                            raise
                        result.unavailable = (
                            "spec.scaling.mode keda: the cluster has no ScaledObject kind "
                            "(install KEDA, or use mode builtin or hpa)"
                        )
                        continue
                    result.applied.append(f"{verb} {kind} {child}")
            await self._remove_other_autoscalers(body, uid, autoscaler, result)
        # A refused plan or a conflict applies nothing; what runs keeps running and is reported.
        if result.conflicts:
            self.conflicted.add((namespace, name))
        else:
            self.conflicted.discard((namespace, name))

        old_status = body.get("status") or {}
        # The ScaleRecord is the autoscaler's, the AdapterRecord the adapter loader's: each
        # compared, written and removed by its writer alone.
        owned = {k: v for k, v in old_status.items() if k not in OTHER_WRITERS_FIELDS}
        status, transitions = build_status(
            cr,
            name,
            namespace,
            generation,
            outcome,
            live["Deployment"],
            old_status,
            self.clock(),
            conflicts=result.conflicts,
            unavailable=result.unavailable,
            rejected=result.rejected,
        )
        if status != owned:
            removed = {key: None for key in owned if key not in status}
            await self.client.patch_status(
                LLMDEPLOYMENTS,
                name,
                {**status, **removed},
                namespace,
                resource_version=meta.get("resourceVersion"),
            )
            result.status_written = True

        await self._report(body, namespace, name, result, transitions)
        return result

    async def _remove_other_autoscalers(
        self, body: dict[str, Any], uid: str | None, keep: str | None, result: Outcome
    ) -> None:
        """Delete the HPA or ScaledObject this LLMDeployment made for a mode it no longer has
        (another autoscaler would fight the one it has now). The Event goes out at once: a
        retried reconcile finds nothing left to delete."""
        meta = body.get("metadata") or {}
        namespace, name = meta.get("namespace") or "default", meta.get("name") or ""
        for kind, resource in AUTOSCALER_RESOURCES.items():
            if kind == keep:
                continue
            live = await self.client.get(resource, name, namespace)
            if live is not None and controlled_by(live, uid):
                await self.client.delete(resource, name, namespace)
                result.deleted.append(f"{kind} {name}")
                ref = {**body, "apiVersion": body.get("apiVersion", API_VERSION), "kind": KIND}
                await self.emit(ref, "Normal", "Deleted", f"{kind} {name}")

    async def _admit(self, namespace: str, cr: LLMDeployment, planned: Plan) -> Plan | Refusal:
        """The plan, or a refusal naming each field the admin's policy refuses."""
        report = review(cr, planned, self.config)
        for ref in report.secrets:
            try:
                secret = await self.client.get(SECRETS, ref.name, namespace)
            except ApiError as exc:
                if exc.status != 403:
                    raise
                secret = None  # unreadable counts as unlabelled: never a way around the rule
            labels = None if secret is None else (secret.get("metadata") or {}).get("labels") or {}
            violation = secret_refusal(ref, labels, self.config.policy)
            if violation is not None:
                report.violations.append(violation)
        if report.violations:
            return Refusal("PolicyViolation", report.message)
        return planned

    async def _claim_access_modes(self, namespace: str, cr: LLMDeployment) -> dict[str, list[str]]:
        """The access modes of the model's claims that exist (the planner refuses those the
        replicas cannot share)."""
        modes: dict[str, list[str]] = {}
        for claim in claims_to_check(cr.spec, self.config):
            try:
                live = await self.client.get(PERSISTENTVOLUMECLAIMS, claim, namespace)
            except ApiError as exc:
                if exc.status != 403:
                    raise
                logger.warning(
                    "cannot read the model's claim; not checking its access modes",
                    extra={"claim": f"{namespace}/{claim}", "error": str(exc)},
                )
                continue
            if live is not None:
                modes[claim] = list((live.get("spec") or {}).get("accessModes") or [])
        return modes

    async def _report(
        self,
        body: dict[str, Any],
        namespace: str,
        name: str,
        result: Outcome,
        transitions: list[Transition],
    ) -> None:
        ref = {**body, "apiVersion": body.get("apiVersion", API_VERSION), "kind": KIND}
        for change in result.applied:
            verb, kind, child = change.split(" ", 2)
            await self.emit(ref, "Normal", verb, f"{kind} {child}")
        for t in transitions:
            message = f"{t.type} is {t.status}" + (f": {t.message}" if t.message else "")
            await self.emit(ref, "Warning" if t.warning else "Normal", t.reason, message)
        if result.applied or result.deleted or result.status_written:
            logger.info(
                "reconciled",
                extra={
                    "llmdeployment": f"{namespace}/{name}",
                    "planned": result.planned,
                    "applied": result.applied,
                    "deleted": result.deleted,
                    "conflicts": result.conflicts,
                    "rejected": result.rejected,
                    "status_written": result.status_written,
                },
            )
