"""Discovery parsing: the static fleet file, LLMDeployments and EndpointSlices, and the join."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from fleetllm.operator.render import LABEL_MODEL
from fleetllm.router.discovery import (
    SERVICE_NAME_LABEL,
    Fleet,
    ReplicaRef,
    StaticDiscovery,
    build_fleet,
    parse_deployment,
    parse_endpoint_slice,
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
) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {SERVICE_NAME_LABEL: service, LABEL_MODEL: "m"},
        },
        "addressType": "IPv4",
        "ports": ports if ports is not None else [{"name": "http", "port": 8000}],
        "endpoints": endpoints,
    }


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
    assert (info.namespace, info.service) == ("ml", "llama")
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


def test_slices_of_other_services_are_ignored() -> None:
    obj = _slice("s", "svc", [])
    del obj["metadata"]["labels"][LABEL_MODEL]
    assert parse_endpoint_slice(obj) is None


def _deployment(name: str, model: str, namespace: str = "ml", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "fleetllm.io/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"model": {"name": model, "source": "builtin://smollm2-135m"}, **spec},
    }


def test_deployment_routing_and_replicas() -> None:
    info = parse_deployment(
        _deployment("llama", "llama-3", replicas=0, routing={"strategy": "round-robin"})
    )
    assert info is not None
    assert (info.namespace, info.name, info.model, info.replicas) == ("ml", "llama", "llama-3", 0)
    assert info.routing.strategy == "round-robin"
    defaults = parse_deployment(_deployment("x", "y"))
    assert defaults is not None and defaults.routing.strategy == "prefix"
    assert defaults.replicas is None
    broken = parse_deployment(_deployment("x", "y", routing={"strategy": "random"}))
    assert broken is not None and broken.routing.strategy == "prefix"
    assert parse_deployment({"metadata": {"name": "x"}, "spec": {}}) is None


def test_build_fleet_joins_slices_to_their_deployment_by_service_name() -> None:
    deployments = {
        k: parse_deployment(obj)
        for k, obj in {
            ("ml", "llama"): _deployment("llama", "llama-3", replicas=2),
            ("ml", "cold"): _deployment("cold", "cold-model", replicas=0),
        }.items()
    }
    slices = {
        ("ml", "a"): parse_endpoint_slice(
            _slice("a", "llama", [{"addresses": ["10.0.0.1"], "conditions": {"ready": True}}])
        ),
        ("ml", "b"): parse_endpoint_slice(
            _slice("b", "llama", [{"addresses": ["10.0.0.2"], "conditions": {"ready": True}}])
        ),
        # Same service name in another namespace: not this deployment's.
        ("other", "c"): parse_endpoint_slice(
            _slice(
                "c",
                "llama",
                [{"addresses": ["10.9.0.1"], "conditions": {"ready": True}}],
                namespace="other",
            )
        ),
    }
    fleet = build_fleet(deployments, slices)  # type: ignore[arg-type]
    assert sorted(fleet) == ["cold-model", "llama-3"]
    assert {r.url for r in fleet["llama-3"].replicas} == {
        "http://10.0.0.1:8000",
        "http://10.0.0.2:8000",
    }
    assert fleet["llama-3"].owner == ("ml", "llama")
    assert fleet["cold-model"].replicas == () and fleet["cold-model"].desired_replicas == 0


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
