"""Discovery parsing: the static fleet file, LLMDeployments, Services and EndpointSlices, and
the join."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from fleetllm.api.contract import LABEL_MODEL
from fleetllm.router.discovery import (
    SERVICE_NAME_LABEL,
    Fleet,
    ReplicaRef,
    StaticDiscovery,
    build_fleet,
    parse_deployment,
    parse_endpoint_slice,
    parse_service,
    parse_static_fleet,
)


def test_static_fleet_short_and_long_forms() -> None:
    fleet = parse_static_fleet(
        {
            "models": {
                "chat": ["http://127.0.0.1:8001/", "http://127.0.0.1:8002"],
                "code": {
                    "replicas": [{"url": "http://10.0.0.1:8000", "draining": True}],
                    "routing": {"strategy": "least-load", "loadFactor": 2},
                },
                "cold": [],
            }
        }
    )
    assert fleet["chat"].replicas == (
        ReplicaRef("http://127.0.0.1:8001"),
        ReplicaRef("http://127.0.0.1:8002"),
    )
    assert fleet["chat"].routing is None
    assert fleet["code"].replicas == (ReplicaRef("http://10.0.0.1:8000", draining=True),)
    assert fleet["code"].routing is not None
    assert fleet["code"].routing.strategy == "least-load"
    assert fleet["code"].routing.load_factor == 2
    assert fleet["cold"].replicas == ()
    assert parse_static_fleet(None) == {}


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        (["x"], "expected a mapping"),
        ({"models": ["a"]}, "must map model names"),
        ({"models": {"a": "http://x:1"}}, "expected a list of URLs or a mapping"),
        ({"models": {"a": ["ftp://x:1"]}}, "is not an http"),
        ({"models": {"a": ["http://x:1/v1"]}}, "must not have a path"),
        ({"models": {"a": ["http://x:99999"]}}, "invalid port"),
        ({"models": {"a": [5]}}, "must be a string"),
        ({"models": {"a": {"replicas": [], "extra": 1}}}, "unknown fields"),
        ({"models": {"a": {"routing": {"strategy": "random"}}}}, "routing"),
        ({"models": {"a": {"replicas": [{"url": "http://x:1", "draining": "yes"}]}}}, "draining"),
    ],
)
def test_bad_static_fleets_are_refused_with_the_place(doc: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_static_fleet(doc)


@pytest.mark.parametrize(
    "url",
    ["http://user:hunter2@x:1", "http://user@x:1", "https://:hunter2@x:1", "http://a@b@x:1"],
)
def test_replica_urls_with_credentials_are_refused_without_echoing_them(url: str) -> None:
    for replica in (url, {"url": url}):
        with pytest.raises(ValueError, match="must not carry credentials") as excinfo:
            parse_static_fleet({"models": {"a": [replica]}})
        assert "hunter2" not in str(excinfo.value) and url not in str(excinfo.value)


def _slice(
    name: str,
    service: str,
    endpoints: list[dict[str, Any]],
    ports: list[dict[str, Any]] | None = None,
    namespace: str = "ml",
    service_uid: str | None = None,
) -> dict[str, Any]:
    """A slice as the EndpointSlice controller writes it: the Service's labels, the
    service-name label, and the Service as controller."""
    meta: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "labels": {SERVICE_NAME_LABEL: service, LABEL_MODEL: "m"},
    }
    meta["ownerReferences"] = [
        {
            "apiVersion": "v1",
            "kind": "Service",
            "name": service,
            "uid": service_uid or f"svc-{namespace}-{service}",
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    return {
        "metadata": meta,
        "addressType": "IPv4",
        "ports": ports if ports is not None else [{"name": "http", "port": 8000}],
        "endpoints": endpoints,
    }


def _ready(address: str) -> list[dict[str, Any]]:
    return [{"addresses": [address], "conditions": {"ready": True}}]


def test_endpoint_slice_ready_terminating_and_not_ready() -> None:
    info = parse_endpoint_slice(
        _slice(
            "llama-abc",
            "llama",
            [
                {"addresses": ["10.0.0.1"], "conditions": {"ready": True}},
                {"addresses": ["10.0.0.2"], "conditions": {}},  # unset ready means ready
                {"addresses": ["10.0.0.3"], "conditions": {"ready": False, "terminating": True}},
                {"addresses": ["10.0.0.4"], "conditions": {"ready": False}},  # still starting
                {"addresses": [], "conditions": {"ready": True}},
            ],
        )
    )
    assert info is not None
    assert (info.namespace, info.service, info.owner_uid) == ("ml", "llama", "svc-ml-llama")
    assert info.replicas == (
        ReplicaRef("http://10.0.0.1:8000"),
        ReplicaRef("http://10.0.0.2:8000"),
        ReplicaRef("http://10.0.0.3:8000", draining=True),
    )


def test_endpoint_slice_ports_and_ipv6() -> None:
    info = parse_endpoint_slice(
        _slice(
            "s",
            "svc",
            [{"addresses": ["fd00::5"], "conditions": {"ready": True}}],
            ports=[{"name": "metrics", "port": 9000}, {"name": "http", "port": 8080}],
        )
    )
    assert info is not None and info.replicas == (ReplicaRef("http://[fd00::5]:8080"),)
    no_port = parse_endpoint_slice(
        _slice("s", "svc", [{"addresses": ["10.0.0.1"]}], ports=[{"name": "http"}])
    )
    assert no_port is not None and no_port.replicas == ()


def test_endpoint_slice_owner_must_be_a_service_controller() -> None:
    obj = _slice("s", "svc", [])
    del obj["metadata"]["labels"][SERVICE_NAME_LABEL]
    assert parse_endpoint_slice(obj) is None
    for ref in (
        {"controller": False},  # an owner, not the controller
        {"kind": "Deployment"},
        {"apiVersion": "example.com/v1"},  # a Service of another API group
    ):
        obj = _slice("s", "svc", [])
        obj["metadata"]["ownerReferences"][0].update(ref)
        info = parse_endpoint_slice(obj)
        assert info is not None and info.owner_uid is None, ref


def _deployment(
    name: str, model: str, namespace: str = "ml", uid: str | None = None, **spec: Any
) -> dict[str, Any]:
    return {
        "apiVersion": "fleetllm.io/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {"name": name, "namespace": namespace, "uid": uid or f"ld-{namespace}-{name}"},
        "spec": {"model": {"name": model, "source": "builtin://smollm2-135m"}, **spec},
    }


def _service(
    name: str, namespace: str = "ml", owner_uid: str | None = None, uid: str | None = None
) -> dict[str, Any]:
    """A Service as the operator renders it: controlled by its LLMDeployment."""
    refs = [
        {
            "apiVersion": "fleetllm.io/v1alpha1",
            "kind": "LLMDeployment",
            "name": name,
            "uid": owner_uid or f"ld-{namespace}-{name}",
            "controller": True,
        }
    ]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": uid or f"svc-{namespace}-{name}",
            "ownerReferences": refs,
        },
    }


def test_deployment_routing_and_replicas() -> None:
    info = parse_deployment(
        _deployment("llama", "llama-3", replicas=0, routing={"strategy": "round-robin"})
    )
    assert info is not None
    assert (info.namespace, info.name, info.model, info.replicas) == ("ml", "llama", "llama-3", 0)
    assert info.uid == "ld-ml-llama"
    assert info.routing.strategy == "round-robin"
    defaults = parse_deployment(_deployment("x", "y"))
    assert defaults is not None and defaults.routing.strategy == "prefix"
    assert defaults.replicas is None
    broken = parse_deployment(_deployment("x", "y", routing={"strategy": "random"}))
    assert broken is not None and broken.routing.strategy == "prefix"
    assert parse_deployment({"metadata": {"name": "x", "uid": "u"}, "spec": {}}) is None


def _fleet(
    deployments: list[dict[str, Any]],
    services: list[dict[str, Any]],
    slices: list[dict[str, Any]],
    *,
    qualified: bool = False,
) -> dict[str, Any]:
    def key(obj: dict[str, Any]) -> tuple[str, str]:
        return (obj["metadata"]["namespace"], obj["metadata"]["name"])

    return build_fleet(
        {key(o): parse_deployment(o) for o in deployments},  # type: ignore[misc]
        {key(o): parse_service(o) for o in services},  # type: ignore[misc]
        {key(o): parse_endpoint_slice(o) for o in slices},  # type: ignore[misc]
        qualified=qualified,
    )


def test_build_fleet_follows_only_the_operators_service_and_its_slices() -> None:
    fleet = _fleet(
        [
            _deployment("llama", "llama-3", replicas=2),
            _deployment("cold", "cold-model", replicas=0),
            _deployment("impostor", "victim"),
        ],
        [
            _service("llama"),
            # A Service with the LLMDeployment's name but not controlled by it.
            _service("impostor", owner_uid="someone-else"),
        ],
        [
            _slice("a", "llama", _ready("10.0.0.1")),
            _slice("b", "llama", _ready("10.0.0.2")),
            # Same Service name in another namespace: not this deployment's.
            _slice("c", "llama", _ready("10.9.0.1"), namespace="other"),
            # Claims the Service's name by label, but another Service controls it.
            _slice("d", "llama", _ready("10.6.6.6"), service_uid="forged"),
            _slice("e", "impostor", _ready("10.6.6.7")),
        ],
    )
    assert sorted(fleet) == ["cold-model", "llama-3", "victim"]
    assert {r.url for r in fleet["llama-3"].replicas} == {
        "http://10.0.0.1:8000",
        "http://10.0.0.2:8000",
    }
    assert fleet["llama-3"].owner == ("ml", "llama")
    assert fleet["llama-3"].aliases == ("ml/llama-3",)
    assert fleet["cold-model"].replicas == () and fleet["cold-model"].desired_replicas == 0
    assert fleet["victim"].replicas == ()


def test_all_namespaces_keys_models_by_namespace_and_aliases_no_plain_name() -> None:
    deployments = [
        _deployment("chat", "llama", namespace="team-a"),
        _deployment("chat", "llama", namespace="team-b"),
        _deployment("code", "coder", namespace="team-b"),
        _deployment("home", "shared", namespace="serving"),
        _deployment("home", "shared", namespace="team-a"),
    ]
    services = [_service(d["metadata"]["name"], d["metadata"]["namespace"]) for d in deployments]
    slices = [
        _slice("a", "chat", _ready("10.0.0.1"), namespace="team-a"),
        _slice("b", "chat", _ready("10.0.0.2"), namespace="team-b"),
        _slice("c", "home", _ready("10.0.0.3"), namespace="serving"),
    ]
    fleet = _fleet(deployments, services, slices, qualified=True)
    assert sorted(fleet) == [
        "serving/shared",
        "team-a/llama",
        "team-a/shared",
        "team-b/coder",
        "team-b/llama",
    ]
    # No namespace's replicas leak into another's model of the same name.
    assert [r.url for r in fleet["team-a/llama"].replicas] == ["http://10.0.0.1:8000"]
    assert [r.url for r in fleet["team-b/llama"].replicas] == ["http://10.0.0.2:8000"]
    assert fleet["team-b/llama"].served_name == "llama"
    # Plain names are resolved per key scope (tests/unit/router/test_router_scopes.py), never
    # by an alias that prefers one namespace.
    assert all(route.aliases == () for route in fleet.values())


def test_each_replica_names_the_llmdeployment_whose_key_it_requires() -> None:
    # Two LLMDeployments of one namespace serving one model share its replicas, but each
    # replica keeps its own LLMDeployment (and so its own key).
    deployments = [_deployment("a", "llama", uid="uid-a"), _deployment("b", "llama", uid="uid-b")]
    services = [_service("a", owner_uid="uid-a"), _service("b", owner_uid="uid-b")]
    slices = [_slice("sa", "a", _ready("10.0.0.1")), _slice("sb", "b", _ready("10.0.0.2"))]
    fleet = _fleet(deployments, services, slices)
    assert {r.url: r.engine for r in fleet["llama"].replicas} == {
        "http://10.0.0.1:8000": ("ml", "a", "uid-a"),
        "http://10.0.0.2:8000": ("ml", "b", "uid-b"),
    }
    # A static fleet's replicas name none: they get --upstream-api-key.
    static = parse_static_fleet({"models": {"m": ["http://127.0.0.1:8001"]}})
    assert static["m"].replicas[0].engine is None


@pytest.mark.asyncio
async def test_static_file_is_reloaded_on_change_and_a_bad_edit_keeps_the_last_fleet(
    tmp_path: Path,
) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text("models:\n  a: [http://127.0.0.1:1]\n")
    seen: list[Fleet] = []
    discovery = StaticDiscovery(path, poll_interval=0.01)
    task = asyncio.create_task(discovery.run(seen.append))

    async def until(count: int) -> None:
        async with asyncio.timeout(10):
            while len(seen) < count:
                await asyncio.sleep(0.01)

    await until(1)
    assert list(seen[0]) == ["a"]
    path.write_text("models: [oops")
    path.write_text("models:\n  a: [ftp://nope]\n")
    # Let the poller see the broken versions; then a good one.
    await asyncio.sleep(0.1)
    assert len(seen) == 1
    path.write_text("models:\n  a: []\n  b: [http://127.0.0.1:2]\n")
    await until(2)
    assert sorted(seen[1]) == ["a", "b"]
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


@pytest.mark.asyncio
async def test_static_demand_calls_back_with_the_model_name() -> None:
    asked: list[str] = []

    async def on_demand(model: str) -> None:
        asked.append(model)

    discovery = StaticDiscovery(None, on_demand=on_demand)
    fleet = parse_static_fleet({"models": {"cold": []}})
    await discovery.signal_demand(fleet["cold"])
    assert asked == ["cold"]
