"""LLMDeployment status from the plan outcome and the engine Deployment. Pure, no I/O.

The reconciler's part of the status (`ReconciledStatus`); the builtin autoscaler writes the
rest (`ScaleRecord`), which is only read here. Conditions follow the Kubernetes conventions: one
entry per type, CamelCase reasons, and a lastTransitionTime that moves only when the status
itself changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fleetllm.api.contract import endpoint, selector_string
from fleetllm.api.deployment import LLMDeployment
from fleetllm.api.status import Condition, ReconciledStatus
from fleetllm.planner.plan import Plan


@dataclass(frozen=True)
class Refusal:
    """Why nothing was applied: an invalid spec or a plan the planner refused."""

    reason: str
    message: str


@dataclass(frozen=True)
class Transition:
    """A condition that changed, for an Event."""

    type: str
    status: str
    reason: str
    message: str

    @property
    def warning(self) -> bool:
        bad = {("Planned", "False"), ("Degraded", "True")}
        return (self.type, self.status) in bad or (
            self.type == "Ready" and self.status == "False" and self.reason != "ScaledToZero"
        )


def _deployment_counts(deployment: dict[str, Any] | None) -> tuple[int, int, bool, str | None]:
    """(replicas, ready, settled, failure message) of a live Deployment."""
    if deployment is None:
        return 0, 0, False, None
    status = deployment.get("status") or {}
    wanted = (deployment.get("spec") or {}).get("replicas", 1)
    replicas = status.get("replicas", 0)
    ready = status.get("readyReplicas", 0)
    generation = (deployment.get("metadata") or {}).get("generation", 0)
    settled = (
        status.get("observedGeneration", 0) >= generation
        and status.get("updatedReplicas", 0) >= wanted
        and replicas == wanted
        and status.get("availableReplicas", 0) >= wanted
    )
    failure = None
    for cond in status.get("conditions") or []:
        if cond.get("type") == "Progressing" and cond.get("status") == "False":
            failure = f"{cond.get('reason', 'NotProgressing')}: {cond.get('message', '')}"
        if cond.get("type") == "ReplicaFailure" and cond.get("status") == "True":
            failure = f"{cond.get('reason', 'ReplicaFailure')}: {cond.get('message', '')}"
    return replicas, ready, settled, failure


def _plan_summary(plan: Plan) -> str:
    s = plan.status
    where = f"{s.gpu_count} x {s.gpu_type}" if s.gpu_count else "cpu"
    return (
        f"{plan.arch.name} on {where} ({s.backend} on {s.device}): weights {s.weights_gib} GiB "
        f"+ KV cache {s.kv_cache_gib} GiB per device; {s.max_concurrent_tokens} tokens = "
        f"{s.max_concurrent_sequences} sequences of {s.max_model_len}"
    )


def conflict_message(conflicts: list[str]) -> str:
    return (
        f"{', '.join(conflicts)}: the name is taken by an object this LLMDeployment does not "
        "own; it is left untouched and nothing is applied until it is deleted or renamed "
        "(or the LLMDeployment is)"
    )


def rejected_message(rejected: list[str]) -> str:
    return (
        f"the API server refuses {'; '.join(rejected)}. Fix the spec fields passed through "
        "to it (pod.*, engine.env, engine.image); what runs keeps running until then"
    )


def build_status(
    cr: LLMDeployment | None,
    name: str,
    namespace: str,
    generation: int | None,
    outcome: Plan | Refusal,
    deployment: dict[str, Any] | None,
    old_status: dict[str, Any] | None,
    now: str,
    conflicts: list[str] | None = None,
    unavailable: str | None = None,
    rejected: list[str] | None = None,
) -> tuple[dict[str, Any], list[Transition]]:
    """The reconciler's part of the new status (as the API stores it) and the conditions that
    changed; `old_status` is the whole status as stored. `conflicts` names children ("Service
    NAME") whose names are taken by objects not owned by this LLMDeployment: nothing was
    applied. `unavailable` says why spec.scaling.mode's autoscaler could not be created.
    `rejected`: children the API server refused as invalid ("KIND NAME: its message")."""
    desired = cr.spec.desired_replicas() if cr is not None else 0
    conflict = conflict_message(conflicts) if conflicts else None
    refused = rejected_message(rejected) if rejected else None
    replicas, ready, settled, failure = _deployment_counts(deployment)
    planned = isinstance(outcome, Plan)

    conds: list[tuple[str, str, str, str]] = []
    if isinstance(outcome, Plan):
        conds.append(("Planned", "True", "Planned", _plan_summary(outcome)))
    else:
        conds.append(("Planned", "False", outcome.reason, outcome.message))

    if not planned:
        conds.append(("Progressing", "False", "PlanRefused", "the spec is not applied"))
    elif conflict is not None:
        conds.append(("Progressing", "False", "Conflict", conflict))
    elif refused is not None:
        conds.append(("Progressing", "False", "Rejected", refused))
    elif deployment is None:
        conds.append(("Progressing", "True", "Creating", "creating the engine Deployment"))
    elif settled:
        conds.append(
            ("Progressing", "False", "RolloutComplete", f"{replicas} replicas run the current spec")
        )
    else:
        conds.append(
            (
                "Progressing",
                "True",
                "RollingOut",
                f"{ready}/{desired} replicas ready, rollout in progress",
            )
        )

    if planned and desired == 0:
        conds.append(("Ready", "False", "ScaledToZero", "no replicas are wanted"))
    elif ready > 0:
        conds.append(("Ready", "True", "Serving", f"{ready}/{desired} replicas ready"))
    elif not planned and deployment is None:
        conds.append(("Ready", "False", "PlanRefused", "nothing is deployed"))
    else:
        conds.append(("Ready", "False", "NoReplicaReady", f"0/{desired} replicas ready"))

    if conflict is not None:
        conds.append(("Degraded", "True", "Conflict", conflict))
    elif refused is not None:
        conds.append(("Degraded", "True", "Rejected", refused))
    elif failure is not None:
        conds.append(("Degraded", "True", "RolloutFailing", failure))
    elif unavailable is not None:
        conds.append(("Degraded", "True", "AutoscalerUnavailable", unavailable))
    elif not planned and deployment is not None:
        conds.append(
            (
                "Degraded",
                "True",
                "PlanRefused",
                "serving the last planned spec; the current spec is refused",
            )
        )
    else:
        conds.append(("Degraded", "False", "AsExpected", ""))

    if planned and desired == 0:
        why = "spec.replicas is 0"
        scaled = (old_status or {}).get("lastScaleReason")
        autoscaled = cr is not None and cr.spec.autoscaled_by_builtin
        if autoscaled and scaled and (old_status or {}).get("lastScaleChange") == "to-zero":
            why = f"the autoscaler scaled {scaled}"
        conds.append(("ScaledToZero", "True", "ScaledToZero", why))
    else:
        conds.append(("ScaledToZero", "False", "ReplicasWanted", f"{desired} replicas wanted"))

    old = {c.get("type"): c for c in (old_status or {}).get("conditions") or []}
    conditions: list[Condition] = []
    transitions: list[Transition] = []
    for ctype, cstatus, reason, message in conds:
        previous = old.get(ctype)
        unchanged = previous is not None and previous.get("status") == cstatus
        conditions.append(
            Condition(
                type=ctype,  # type: ignore[arg-type]
                status=cstatus,  # type: ignore[arg-type]
                reason=reason,
                message=message,
                last_transition_time=previous["lastTransitionTime"]
                if unchanged and previous.get("lastTransitionTime")
                else now,
                observed_generation=generation,
            )
        )
        if (
            previous is None
            or previous.get("status") != cstatus
            or (previous.get("reason") != reason)
        ):
            transitions.append(Transition(ctype, cstatus, reason, message))

    status = ReconciledStatus(
        observed_generation=generation,
        conditions=conditions,
        replicas=replicas,
        ready_replicas=ready,
        desired_replicas=desired,
        selector=selector_string(name),
        plan=outcome.status if isinstance(outcome, Plan) else None,
        endpoint=endpoint(name, namespace),
    )
    return status.model_dump(by_alias=True, exclude_none=True, mode="json"), transitions
