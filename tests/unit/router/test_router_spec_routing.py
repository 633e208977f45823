"""An LLMDeployment's spec.routing reaches the router's choice of replica through Kubernetes
discovery (strategy, loadFactor, sessionHeader; changed in place when the spec changes), and a
model at zero replicas is asked for one only while spec.replicas is below one."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from fleetllm.api.deployment import LLMDEPLOYMENTS
from fleetllm.router.config import RouterSettings
from fleetllm.router.discovery import (
    KubernetesDiscovery,
    ModelRoute,
    build_fleet,
    parse_deployment,
    parse_endpoint_slice,
    parse_service,
)
from fleetllm.router.metrics import RouterMetrics
from fleetllm.router.pool import ModelPool, ReplicaPool

NS = "ml"
ADDRESSES = ["10.0.0.1", "10.0.0.2", "10.0.0.3"]


def _objects(name: str, model: str, spec: dict[str, Any]) -> tuple[dict[str, Any], ...]:
    """An LLMDeployment, the Service the operator renders for it and that Service's slice."""
    deployment = {
        "apiVersion": "fleetllm.io/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {"name": name, "namespace": NS, "uid": f"ld-{name}"},
        "spec": {"model": {"name": model, "source": "builtin://smollm2-135m"}, **spec},
    }
    owner = {"apiVersion": "fleetllm.io/v1alpha1", "kind": "LLMDeployment", "controller": True}
    service = {
        "metadata": {
            "name": name,
            "namespace": NS,
            "uid": f"svc-{name}",
            "ownerReferences": [{**owner, "name": name, "uid": f"ld-{name}"}],
        }
    }
    endpoint_slice = {
        "metadata": {
            "name": f"{name}-x",
            "namespace": NS,
            "labels": {"kubernetes.io/service-name": name},
            "ownerReferences": [
                {"apiVersion": "v1", "kind": "Service", "name": name, "uid": f"svc-{name}"}
                | {"controller": True}
            ],
        },
        "ports": [{"name": "http", "port": 8000}],
        "endpoints": [{"addresses": [a], "conditions": {"ready": True}} for a in ADDRESSES],
    }
    return deployment, service, endpoint_slice


def _fleet(*models: tuple[str, str, dict[str, Any]]) -> dict[str, ModelRoute]:
    found = [_objects(*m) for m in models]
    return build_fleet(
        {(NS, d["metadata"]["name"]): parse_deployment(d) for d, _, _ in found},  # type: ignore[misc]
        {(NS, s["metadata"]["name"]): parse_service(s) for _, s, _ in found},  # type: ignore[misc]
        {(NS, e["metadata"]["name"]): parse_endpoint_slice(e) for _, _, e in found},  # type: ignore[misc]
        qualified=False,
    )


def _first(pool: ReplicaPool, model: ModelPool, headers: dict[str, str], prompt: str = "") -> str:
    return pool.order(model, {"prompt": prompt}, headers)[0].url


def test_spec_routing_decides_each_models_replica_choice() -> None:
    # The router's own defaults differ from every model's spec, so only the spec can explain
    # what happens.
    settings = RouterSettings(strategy="prefix", load_factor=1.25, session_header="x-other")
    pool = ReplicaPool(settings, RouterMetrics(), discovery=None)  # type: ignore[arg-type]
    pool.apply_fleet(
        _fleet(
            ("chat", "chat", {"routing": {"strategy": "session", "sessionHeader": "x-user"}}),
            ("batch", "batch", {"routing": {"strategy": "round-robin"}}),
            ("code", "code", {"routing": {"strategy": "prefix", "loadFactor": 3}}),
        )
    )
    chat, batch, code = (pool.resolve(m)[0] for m in ("chat", "batch", "code"))

    # session, keyed by the spec's header: each user sticks to one replica, users spread.
    for user in ("ada", "bob", "eve"):
        picks = {_first(pool, chat, {"x-user": user}, prompt=str(i)) for i in range(8)}
        assert len(picks) == 1, user
    users = {_first(pool, chat, {"x-user": f"user-{i}"}) for i in range(40)}
    assert len(users) == len(ADDRESSES)
    # The router's default header keys nothing for this model.
    assert chat.session_header == "x-user"

    # round-robin: one replica after another.
    firsts = [_first(pool, batch, {}) for _ in range(6)]
    assert Counter(firsts) == Counter({f"http://{a}:8000": 2 for a in ADDRESSES})
    assert firsts[:3] != firsts[1:4]

    # prefix with the spec's load factor: one prompt, one replica, until its load passes
    # 3 x the mean (the router's 1.25 would move it at once).
    assert code.load_factor == 3
    home = _first(pool, code, {}, prompt="You are a helpful assistant.")
    code.replicas[home].replica.in_flight = 2
    assert _first(pool, code, {}, prompt="You are a helpful assistant.") == home

    # A changed spec reconfigures the model in place.
    pool.apply_fleet(
        _fleet(
            ("chat", "chat", {"routing": {"strategy": "round-robin"}}),
            ("batch", "batch", {"routing": {"strategy": "session"}}),
            ("code", "code", {}),
        )
    )
    assert pool.resolve("chat")[0] is chat and chat.strategy == "round-robin"
    assert (batch.strategy, batch.session_header) == ("session", "x-session-id")
    # Without spec.routing, the CRD's defaults (what the API server stores) apply: at a load
    # factor of 1.25 the same prompt now leaves its busy replica.
    assert (code.strategy, code.load_factor) == ("prefix", 1.25)
    assert _first(pool, code, {}, prompt="You are a helpful assistant.") != home


class _ScaleRecorder:
    def __init__(self) -> None:
        self.scaled: list[tuple[str, int, str]] = []

    async def patch_scale(self, resource: Any, name: str, replicas: int, namespace: str) -> None:
        assert resource is LLMDEPLOYMENTS
        self.scaled.append((name, replicas, namespace))


@pytest.mark.asyncio
async def test_a_model_is_asked_for_a_replica_only_while_its_spec_wants_none() -> None:
    client = _ScaleRecorder()
    discovery = KubernetesDiscovery(client, NS)  # type: ignore[arg-type]
    fleet = _fleet(
        ("cold", "cold", {"replicas": 0, "scaling": {"minReplicas": 0, "maxReplicas": 2}}),
        ("starting", "starting", {"replicas": 2}),
    )
    await discovery.signal_demand(fleet["cold"])
    # Replicas wanted but not ready yet (loading): nothing to ask for.
    await discovery.signal_demand(fleet["starting"])
    assert client.scaled == [("cold", 1, NS)]
