"""The operator's autoscaler: one step for one LLMDeployment the builtin autoscaler drives
(`LLMDeploymentSpec.autoscaled_by_builtin`).

A kopf timer (handlers.py) calls `Scaler.step` per LLMDeployment; under kopf peering only the
leading operator runs timers. A step reads the scale subresource and the engine pods, scrapes
the ready ones' /metrics (fleetllm.scrape), runs the control law (fleetllm.autoscale) and, when
the count changes, writes it:

1. before a scale-down, each ready pod gets `controller.kubernetes.io/pod-deletion-cost` = the
   requests in it, so the ReplicaSet removes the ones with the fewest first. A removed pod's
   endpoint turns terminating, which the router's discovery reads as draining (no new
   requests), and its preStop hook lets what it holds finish;
2. spec.replicas through the scale subresource, guarded by the resourceVersion read, so a
   count the router or a user wrote meanwhile is never overwritten;
3. the status' `ScaleRecord` (lastScaleTime, lastScaleReason, lastScaleChange), and an Event.
Those status fields are the autoscaler's alone, under its own field manager: the reconciler
then carries spec.replicas to the Deployment and writes the rest of the status
(desiredReplicas, the conditions). When an LLMDeployment stops being autoscaled, `stand_down`
removes the ScaleRecord (it would describe an autoscaler no longer at work).

A count the law did not write that rises from zero is the router's demand (it scales a model
from zero through the same subresource when it holds requests): the law is told, so it holds
off scale-to-zero, and never fights it.
"""

from __future__ import annotations

import datetime
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from fleetllm.api.contract import ENGINE_PORT, PORT_NAME, selector_string
from fleetllm.api.deployment import LLMDEPLOYMENTS, LLMDeployment
from fleetllm.api.manifests import parse_llmdeployment
from fleetllm.api.status import SCALE_RECORD_FIELDS, ScaleChange, ScaleRecord
from fleetllm.autoscale.law import Autoscaler
from fleetllm.autoscale.settings import LawSettings
from fleetllm.autoscale.step import Decision, Observation
from fleetllm.kube.client import KubeClient
from fleetllm.kube.errors import ApiError
from fleetllm.kube.resources import PODS
from fleetllm.operator.engine_http import EngineHttp
from fleetllm.scrape import scrape_all

logger = logging.getLogger("fleetllm.operator")

FIELD_MANAGER = "fleetllm-autoscaler"
POD_DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
EVENT_REASONS: dict[ScaleChange, str] = {
    "up": "ScaledUp",
    "down": "ScaledDown",
    "to-zero": "ScaledToZero",
    "from-zero": "ScaledFromZero",
    "bounds": "ScaledToBounds",
}
# (body of the LLMDeployment, event type, reason, message)
EventSink = Callable[[dict[str, Any], str, str, str], Awaitable[None]]


def utcnow() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class _Tracked:
    uid: str | None
    law: Autoscaler
    replicas: int | None = None
    """spec.replicas after the last step (as read, or as written)."""
    demand_time: float | None = None


def driven_by_builtin(body: Mapping[str, Any]) -> LLMDeployment | None:
    """The LLMDeployment in `body` if the builtin autoscaler drives it; None for another mode,
    no scaling, or a spec the reconciler reports as invalid."""
    meta = body.get("metadata") or {}
    where = f"LLMDeployment {meta.get('namespace') or 'default'}/{meta.get('name') or ''}"
    try:
        cr = parse_llmdeployment(dict(body), where)
    except ValueError:
        return None
    return cr if cr.spec.autoscaled_by_builtin else None


def ready_pods(pods: list[dict[str, Any]]) -> dict[str, str]:
    """Pod name -> base URL of the engine pods that serve: Ready, with an IP, not going."""
    found: dict[str, str] = {}
    for pod in pods:
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        ip = status.get("podIP")
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in status.get("conditions") or []
        )
        if not ready or not ip or meta.get("deletionTimestamp"):
            continue
        host = f"[{ip}]" if ":" in ip else ip
        found[meta["name"]] = f"http://{host}:{_engine_port(pod)}"
    return dict(sorted(found.items()))


def _engine_port(pod: dict[str, Any]) -> int:
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == PORT_NAME and isinstance(port.get("containerPort"), int):
                return int(port["containerPort"])
    return ENGINE_PORT


def deletion_costs(in_flight: dict[str, float | None]) -> dict[str, int]:
    """Pod name -> pod-deletion-cost: the requests it holds, so that the ReplicaSet removes
    the least busy first; a pod whose load is unknown goes last."""
    top = 2**31 - 1
    return {
        pod: top if load is None else min(top, math.ceil(load)) for pod, load in in_flight.items()
    }


@dataclass(eq=False)
class Scaler:
    """The control law's state per LLMDeployment and the I/O around it."""

    client: KubeClient
    emit: EventSink
    _: KW_ONLY
    settings: LawSettings | None = None
    scrape_timeout: float = 2.0
    clock: Callable[[], float] = time.monotonic
    wall_clock: Callable[[], str] = utcnow
    http: EngineHttp = field(default_factory=EngineHttp)
    _tracked: dict[tuple[str, str], _Tracked] = field(default_factory=dict, init=False)
    decisions: list[tuple[str, str, Decision]] = field(default_factory=list, init=False)
    """(namespace, name, decision) of every change written, for tests and logs."""

    async def close(self) -> None:
        await self.http.close()

    def forget(self, namespace: str, name: str) -> None:
        self._tracked.pop((namespace, name), None)

    async def step(self, body: dict[str, Any]) -> Decision | None:
        """One step of the law for the LLMDeployment `body` (as kopf last saw it); the
        decision, or None when it has no builtin scaling or is gone."""
        meta = body.get("metadata") or {}
        namespace, name = meta.get("namespace") or "default", meta.get("name") or ""
        cr = driven_by_builtin(body)
        if cr is None:
            self.forget(namespace, name)
            return None
        scaling = cr.spec.scaling
        assert scaling is not None  # the builtin autoscaler drives only what scaling bounds
        tracked = self._tracked.get((namespace, name))
        if tracked is None or tracked.uid != meta.get("uid"):
            tracked = _Tracked(uid=meta.get("uid"), law=Autoscaler(self.settings))
            self._tracked[namespace, name] = tracked

        scale = await self.client.get_scale(LLMDEPLOYMENTS, name, namespace)
        if scale is None:
            self.forget(namespace, name)
            return None
        replicas = int((scale.get("spec") or {}).get("replicas") or 0)
        version = (scale.get("metadata") or {}).get("resourceVersion")
        now = self.clock()
        if tracked.replicas == 0 and replicas > 0:
            tracked.demand_time = now  # raised from zero by someone else: the router's demand
        tracked.replicas = replicas

        listing = await self.client.list(PODS, namespace, label_selector=selector_string(name))
        urls = ready_pods(listing.items)
        scraped = await scrape_all(self.http.session(), urls.values(), self.scrape_timeout)
        samples = {pod: scraped.get(url) for pod, url in urls.items()}
        plan = (body.get("status") or {}).get("plan") or {}
        capacity = plan.get("maxNumSeqs")
        decision = tracked.law.decide(
            scaling,
            Observation(
                time=now,
                replicas=replicas,
                ready_replicas=len(urls),
                samples=samples,
                replica_capacity=capacity if isinstance(capacity, int) else None,
                demand_time=tracked.demand_time,
            ),
        )
        if decision.replicas == replicas:
            return decision

        if decision.change == "down":
            await self._set_deletion_costs(namespace, listing.items, urls, samples)
        try:
            await self.client.patch_scale(
                LLMDEPLOYMENTS,
                name,
                decision.replicas,
                namespace,
                resource_version=version,
                field_manager=FIELD_MANAGER,
            )
        except ApiError as exc:
            if not exc.conflict:
                raise
            # Changed since it was read (the router, a user): look again next step.
            logger.info(
                "scale changed under the autoscaler; next step decides again",
                extra={"llmdeployment": f"{namespace}/{name}"},
            )
            return decision
        tracked.replicas = decision.replicas
        await self._record(body, namespace, name, decision)
        return decision

    async def _set_deletion_costs(
        self,
        namespace: str,
        pods: list[dict[str, Any]],
        urls: dict[str, str],
        samples: dict[str, Any],
    ) -> None:
        in_flight: dict[str, float | None] = {}
        for pod in urls:
            sample = samples.get(pod)
            known = sample is not None and sample.complete
            in_flight[pod] = (sample.running + sample.waiting) if known else None
        current = {
            (p.get("metadata") or {}).get("name"): (
                (p.get("metadata") or {}).get("annotations") or {}
            ).get(POD_DELETION_COST)
            for p in pods
        }
        for pod, cost in deletion_costs(in_flight).items():
            if current.get(pod) == str(cost):
                continue
            try:
                await self.client.patch(
                    PODS,
                    pod,
                    {"metadata": {"annotations": {POD_DELETION_COST: str(cost)}}},
                    namespace,
                    field_manager=FIELD_MANAGER,
                )
            except ApiError as exc:
                if not exc.not_found:
                    raise  # a pod gone since the list is one less to choose from

    async def stand_down(self, body: Mapping[str, Any]) -> None:
        """For an LLMDeployment the builtin autoscaler does not drive (any more): forget its
        history and remove the ScaleRecord from its status."""
        meta = body.get("metadata") or {}
        namespace, name = meta.get("namespace") or "default", meta.get("name") or ""
        if driven_by_builtin(body) is not None:
            return
        self.forget(namespace, name)
        recorded = SCALE_RECORD_FIELDS & set(body.get("status") or {})
        if recorded:
            await self._patch_status(namespace, name, dict.fromkeys(sorted(recorded)))

    async def _record(
        self,
        body: dict[str, Any],
        namespace: str,
        name: str,
        decision: Decision,
    ) -> None:
        assert decision.change != "none"
        self.decisions.append((namespace, name, decision))
        logger.info(
            "scaled",
            extra={
                "llmdeployment": f"{namespace}/{name}",
                "from": decision.previous,
                "to": decision.replicas,
                "change": decision.change,
                "reason": decision.reason,
            },
        )
        record = ScaleRecord(
            last_scale_time=self.wall_clock(),
            last_scale_reason=decision.summary[:4096],
            last_scale_change=decision.change,
        )
        await self._patch_status(namespace, name, record.model_dump(by_alias=True, mode="json"))
        reason = EVENT_REASONS[decision.change]
        await self.emit(body, "Normal", reason, decision.summary)

    async def _patch_status(self, namespace: str, name: str, fields: dict[str, Any]) -> None:
        try:
            await self.client.patch_status(
                LLMDEPLOYMENTS, name, fields, namespace, field_manager=FIELD_MANAGER
            )
        except ApiError as exc:
            if not exc.not_found:
                raise
