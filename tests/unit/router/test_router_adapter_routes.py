"""Adapters in the router's view of the fleet: what each discovery source says of them (the
static file's paths; an LLMDeployment's spec.adapters with where the operator put each one or
why it failed), how a client's `model` names one (plain, `NAMESPACE/ADAPTER`, within its key's
scope, never guessing between namespaces), and prefix affinity keyed by adapter."""

from __future__ import annotations

from typing import Any

import pytest

from fleetllm.router.config import RouterSettings
from fleetllm.router.discovery import ModelRoute, ReplicaRef, parse_static_fleet
from fleetllm.router.errors import RouterError
from fleetllm.router.lora import AdapterRoute, adapters_of, parse_static_adapters
from fleetllm.router.metrics import RouterMetrics
from fleetllm.router.pool import ReplicaPool
from fleetllm.router.scopes import EVERYTHING, Scope


def test_an_llmdeployment_publishes_its_specs_adapters_with_the_operators_report() -> None:
    obj: dict[str, Any] = {
        "spec": {
            "adapters": [
                {"name": "sql", "source": "hf://org/sql"},
                {"name": "chat", "source": "s3://b/chat"},
                {"name": "bad", "source": "pvc://x/bad"},
                {"name": "new", "source": "hf://org/new"},
            ]
        },
        "status": {
            "adapters": [
                {"name": "sql", "state": "Ready", "path": "/m/sql", "reason": "Loaded"},
                {"name": "chat", "state": "Pending", "reason": "Pulling", "path": None},
                {"name": "bad", "state": "Failed", "reason": "LoadRefused", "message": "rank"},
                {"name": "gone", "state": "Ready", "path": "/m/gone"},
            ]
        },
    }
    assert adapters_of(obj) == (
        AdapterRoute("sql", "/m/sql"),
        AdapterRoute("chat"),
        AdapterRoute("bad", None, "rank"),
        AdapterRoute("new"),
    )
    assert adapters_of({"spec": {}}) == ()


def test_a_static_fleet_names_each_adapters_path() -> None:
    fleet = parse_static_fleet(
        {"models": {"base": {"replicas": ["http://r:1"], "adapters": {"sql": "/a/sql"}}}}
    )
    assert fleet["base"].adapters == (AdapterRoute("sql", "/a/sql"),)
    for bad in ({"sql": ""}, {"a/b": "/x"}, ["sql"]):
        with pytest.raises(ValueError, match="adapters"):
            parse_static_adapters(bad, "fleet: models.base.adapters")


def _pool(fleet: dict[str, ModelRoute]) -> ReplicaPool:
    pool = ReplicaPool(RouterSettings(), RouterMetrics(), discovery=None)  # type: ignore[arg-type]
    pool.apply_fleet(fleet)
    return pool


def _route(namespace: str, model: str, *adapters: str) -> ModelRoute:
    return ModelRoute(
        f"{namespace}/{model}",
        owner=(namespace, model),
        served_name=model,
        adapters=tuple(AdapterRoute(a, f"/m/{a}") for a in adapters),
    )


def test_adapters_resolve_as_models_do_across_namespaces_and_scopes() -> None:
    pool = _pool(
        {
            "team-a/llama": _route("team-a", "llama", "sql", "chat"),
            "team-b/llama": _route("team-b", "llama", "sql"),
        }
    )

    def target(name: str, scope: Scope = EVERYTHING) -> tuple[str, str | None]:
        model, adapter = pool.resolve(name, scope)
        return model.name, adapter.name if adapter else None

    assert target("team-a/sql") == ("team-a/llama", "sql")
    assert target("team-b/sql") == ("team-b/llama", "sql")
    assert target("chat") == ("team-a/llama", "chat")
    # Two namespaces have it: refused with the ids to use.
    with pytest.raises(RouterError, match=r"team-a/sql, team-b/sql"):
        pool.resolve("sql")
    assert target("sql", Scope(namespaces=("team-b",))) == ("team-b/llama", "sql")
    # Out of scope reads as missing.
    with pytest.raises(RouterError, match="does not exist"):
        pool.resolve("team-a/chat", Scope(namespaces=("team-b",)))
    with pytest.raises(RouterError, match="does not exist"):
        pool.resolve("chat", Scope(models=("llama",)))
    assert target("chat", Scope(models=("chat",))) == ("team-a/llama", "chat")


def test_one_namespace_gives_plain_ids_with_the_qualified_one_as_alias() -> None:
    route = ModelRoute(
        "llama",
        owner=("team-a", "chat"),
        served_name="llama",
        aliases=("team-a/llama",),
        adapters=(AdapterRoute("sql", "/m/sql"),),
    )
    pool = _pool({"llama": route})
    assert pool.resolve("sql")[1] == AdapterRoute("sql", "/m/sql")
    assert pool.resolve("team-a/sql")[1] == AdapterRoute("sql", "/m/sql")
    # A model's own name wins over an adapter of another model named alike.
    other = ModelRoute("sql", adapters=())
    pool = _pool({"llama": route, "sql": other})
    assert pool.resolve("sql") == (pool.models["sql"], None)


def test_prefix_affinity_is_keyed_by_adapter() -> None:
    urls = [f"http://r{i}:8000" for i in range(6)]
    adapters = tuple(AdapterRoute(f"a{i}", f"/m/a{i}") for i in range(8))
    pool = _pool({"m": ModelRoute("m", tuple(ReplicaRef(u) for u in urls), adapters=adapters)})
    model = pool.models["m"]
    for pooled in model.replicas.values():
        pooled.replica.adapters = frozenset(a.name for a in adapters)
    payload = {"model": "x", "prompt": "You are a helpful assistant. " * 4}

    def first(adapter: AdapterRoute | None) -> str:
        return pool.order(model, payload, {}, adapter=adapter)[0].url

    # The same prompt for the same adapter lands on the same replica every time...
    assert all(first(adapters[0]) == first(adapters[0]) for _ in range(5))
    # ...and the adapters spread over the replicas instead of sharing the base's one.
    chosen = {first(a) for a in adapters}
    assert len(chosen) >= 3, chosen
    # Only replicas holding the adapter are candidates.
    held = urls[2]
    for url, pooled in model.replicas.items():
        pooled.replica.adapters = frozenset({"a0"}) if url == held else frozenset()
    assert [r.url for r in pool.order(model, payload, {}, adapter=adapters[0])] == [held]
    assert pool.order(model, payload, {}, adapter=adapters[1]) == []
