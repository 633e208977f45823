"""Status and conditions from the plan outcome and the engine Deployment."""

from __future__ import annotations

from typing import Any

from fleetllm.api.manifests import parse_llmdeployment
from fleetllm.api.status import ReconciledStatus, field_names
from fleetllm.operator.status import Refusal, build_status
from fleetllm.planner.plan import plan

CR = parse_llmdeployment(
    {
        "apiVersion": "fleetllm.io/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {"name": "smol", "namespace": "ml", "generation": 4},
        "spec": {
            "model": {"name": "smollm2-135m", "source": "builtin://smollm2-135m"},
            "gpu": {"type": "cpu"},
            "replicas": 3,
            "scaling": {"minReplicas": 1, "maxReplicas": 2},
        },
    }
)
PLAN = plan(CR.spec)


def _deployment(
    replicas: int = 2,
    ready: int = 2,
    generation: int = 1,
    observed: int = 1,
    conditions: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    return {
        "metadata": {"generation": generation},
        "spec": {"replicas": replicas},
        "status": {
            "observedGeneration": observed,
            "replicas": replicas,
            "updatedReplicas": replicas,
            "readyReplicas": ready,
            "availableReplicas": ready,
            "conditions": conditions or [],
        },
    }


def _conds(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def test_a_serving_deployment() -> None:
    status, transitions = build_status(CR, "smol", "ml", 4, PLAN, _deployment(), None, "T1")
    assert _conds(status) == {
        "Planned": ("True", "Planned"),
        "Progressing": ("False", "RolloutComplete"),
        "Ready": ("True", "Serving"),
        "Degraded": ("False", "AsExpected"),
        "ScaledToZero": ("False", "ReplicasWanted"),
    }
    # spec.replicas 3 is kept within scaling.maxReplicas 2.
    assert status["desiredReplicas"] == 2
    assert (status["replicas"], status["readyReplicas"]) == (2, 2)
    assert status["observedGeneration"] == 4
    assert all(c["observedGeneration"] == 4 for c in status["conditions"])
    assert status["endpoint"] == "http://smol.ml.svc:8000"
    assert status["plan"]["maxModelLen"] == 8192
    assert status["selector"] == (
        "app.kubernetes.io/component=engine,"
        "app.kubernetes.io/instance=smol,app.kubernetes.io/name=fleetllm"
    )
    assert {t.type for t in transitions} == set(_conds(status))  # all new


def test_transition_times_move_only_when_a_status_changes() -> None:
    first, _ = build_status(CR, "smol", "ml", 4, PLAN, _deployment(ready=0), None, "T1")
    second, transitions = build_status(CR, "smol", "ml", 4, PLAN, _deployment(ready=1), first, "T2")
    times = {c["type"]: c["lastTransitionTime"] for c in second["conditions"]}
    assert times["Ready"] == "T2"
    assert times["Planned"] == "T1"
    assert [(t.type, t.status, t.warning) for t in transitions] == [("Ready", "True", False)]
    third, transitions = build_status(CR, "smol", "ml", 4, PLAN, _deployment(ready=1), second, "T3")
    assert third == second
    assert transitions == []


def test_a_rollout_in_progress_and_a_failing_one() -> None:
    rolling, _ = build_status(
        CR, "smol", "ml", 4, PLAN, _deployment(ready=1, generation=2, observed=1), None, "T"
    )
    assert _conds(rolling)["Progressing"] == ("True", "RollingOut")
    failing, transitions = build_status(
        CR,
        "smol",
        "ml",
        4,
        PLAN,
        _deployment(
            ready=0,
            conditions=[
                {
                    "type": "Progressing",
                    "status": "False",
                    "reason": "ProgressDeadlineExceeded",
                    "message": "ReplicaSet has timed out",
                }
            ],
        ),
        None,
        "T",
    )
    assert _conds(failing)["Degraded"] == ("True", "RolloutFailing")
    assert _conds(failing)["Ready"] == ("False", "NoReplicaReady")
    warnings = {t.type for t in transitions if t.warning}
    assert warnings == {"Degraded", "Ready"}


def test_scaled_to_zero() -> None:
    cr = CR.model_copy(update={"spec": CR.spec.model_copy(update={"replicas": 0, "scaling": None})})
    status, _ = build_status(cr, "smol", "ml", 4, plan(cr.spec), _deployment(0, 0), None, "T")
    assert _conds(status)["ScaledToZero"] == ("True", "ScaledToZero")
    assert _conds(status)["Ready"] == ("False", "ScaledToZero")


def test_a_refused_plan_keeps_reporting_what_runs() -> None:
    refusal = Refusal("KVCacheTooSmall", "does not fit")
    nothing, _ = build_status(CR, "smol", "ml", 5, refusal, None, None, "T")
    assert _conds(nothing)["Planned"] == ("False", "KVCacheTooSmall")
    assert _conds(nothing)["Ready"] == ("False", "PlanRefused")
    assert "plan" not in nothing
    running, _ = build_status(CR, "smol", "ml", 5, refusal, _deployment(), None, "T")
    assert _conds(running)["Ready"] == ("True", "Serving")
    assert _conds(running)["Degraded"] == ("True", "PlanRefused")
    assert _conds(running)["Progressing"] == ("False", "PlanRefused")


def test_a_conflict_is_reported_and_outranks_a_failing_rollout() -> None:
    failing = _deployment(
        conditions=[{"type": "Progressing", "status": "False", "reason": "Deadline"}]
    )
    serving, _ = build_status(CR, "smol", "ml", 4, PLAN, failing, None, "T1")
    status, transitions = build_status(
        CR, "smol", "ml", 4, PLAN, failing, serving, "T2", conflicts=["Service smol"]
    )
    assert _conds(status) == {
        "Planned": ("True", "Planned"),
        "Progressing": ("False", "Conflict"),
        "Ready": ("True", "Serving"),  # what runs keeps running
        "Degraded": ("True", "Conflict"),
        "ScaledToZero": ("False", "ReplicasWanted"),
    }
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert degraded["message"].startswith("Service smol: the name is taken")
    conflict = [t for t in transitions if t.reason == "Conflict"]
    assert {t.type for t in conflict} == {"Progressing", "Degraded"}
    assert any(t.warning for t in conflict)


def test_a_child_the_api_server_refuses_is_reported_with_its_message() -> None:
    rejected = ["Deployment smol-engine: spec.template.spec.affinity: Invalid value"]
    status, transitions = build_status(
        CR, "smol", "ml", 4, PLAN, _deployment(), None, "T1", rejected=rejected
    )
    conds = _conds(status)
    assert conds["Degraded"] == ("True", "Rejected")
    assert conds["Progressing"] == ("False", "Rejected")
    assert conds["Ready"] == ("True", "Serving")  # what ran before keeps serving
    message = next(c["message"] for c in status["conditions"] if c["type"] == "Degraded")
    assert "Deployment smol-engine: spec.template.spec.affinity: Invalid value" in message
    assert any(t.type == "Degraded" and t.warning for t in transitions)


TO_ZERO = ("to-zero", "1 -> 0: no requests for 300s (scaleToZeroAfterSeconds 300)")
ZERO = {"minReplicas": 0, "maxReplicas": 2, "scaleToZeroAfterSeconds": 300}


def _at_zero(
    scaling: dict[str, Any] | None, record: tuple[str, str]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The status built at spec.replicas 0 after the autoscaler recorded (change, reason),
    and the stored status it was built from."""
    spec: dict[str, Any] = {**CR.spec.model_dump(by_alias=True, exclude_none=True), "replicas": 0}
    spec.pop("scaling")
    if scaling is not None:
        spec["scaling"] = scaling
    cr = parse_llmdeployment({**CR.model_dump(by_alias=True, exclude_none=True), "spec": spec})
    stored = {
        "lastScaleTime": "T0",
        "lastScaleChange": record[0],
        "lastScaleReason": record[1],
    }
    status, _ = build_status(cr, "smol", "ml", 4, plan(cr.spec), _deployment(0, 0), stored, "T")
    return status, stored


def test_the_reconcilers_status_leaves_the_autoscalers_fields_alone() -> None:
    status, stored = _at_zero(ZERO, TO_ZERO)
    assert not set(stored) & set(status)
    assert set(status) <= field_names(ReconciledStatus)


def _scaled_to_zero_message(status: dict[str, Any]) -> str:
    return next(c["message"] for c in status["conditions"] if c["type"] == "ScaledToZero")


def test_scaled_to_zero_says_the_autoscaler_did_it_from_its_record() -> None:
    assert _scaled_to_zero_message(_at_zero(ZERO, TO_ZERO)[0]) == (
        "the autoscaler scaled 1 -> 0: no requests for 300s (scaleToZeroAfterSeconds 300)"
    )
    # Its last change was another one (a user scaled to zero since), or it no longer drives
    # the LLMDeployment: spec.replicas says it.
    down = ("down", "2 -> 1: KV cache 0.10 (target 0.80) on 2/2 ready replicas: need 0.25 for 2")
    for scaling, record in ((ZERO, down), (None, TO_ZERO)):
        message = _scaled_to_zero_message(_at_zero(scaling, record)[0])
        assert message == "spec.replicas is 0", (scaling, record)
