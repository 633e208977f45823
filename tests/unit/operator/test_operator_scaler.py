"""The autoscaler's pure helpers: which pods serve, and the order they go in."""

from __future__ import annotations

from typing import Any

from fleetllm.api.contract import ENGINE_PORT
from fleetllm.operator.scaler import deletion_costs, ready_pods


def pod(name: str, ip: str | None, ready: bool = True, **extra: Any) -> dict[str, Any]:
    status: dict[str, Any] = {"conditions": [{"type": "Ready", "status": str(ready)}]}
    if ip is not None:
        status["podIP"] = ip
    body: dict[str, Any] = {"metadata": {"name": name}, "status": status, "spec": {}}
    for key, value in extra.items():
        body[key] = value
    return body


def test_ready_pods_and_their_engine_urls() -> None:
    with_port = pod("b", "10.0.0.2")
    with_port["spec"] = {
        "containers": [
            {"name": "sidecar", "ports": [{"name": "metrics", "containerPort": 9090}]},
            {"name": "engine", "ports": [{"name": "http", "containerPort": 8123}]},
        ]
    }
    going = pod("d", "10.0.0.4")
    going["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    pods = [
        pod("c", "fd00::7"),
        with_port,
        pod("a", "10.0.0.1"),
        pod("starting", "10.0.0.3", ready=False),
        pod("unscheduled", None),
        going,
    ]
    assert ready_pods(pods) == {
        "a": f"http://10.0.0.1:{ENGINE_PORT}",
        "b": "http://10.0.0.2:8123",
        "c": f"http://[fd00::7]:{ENGINE_PORT}",
    }


def test_the_least_busy_go_first_and_an_unread_one_last() -> None:
    costs = deletion_costs({"a": 3.0, "b": 0.0, "c": None, "d": 1.5})
    assert sorted(costs, key=costs.__getitem__) == ["b", "d", "a", "c"]
    assert costs["c"] == 2**31 - 1 and costs["d"] == 2
