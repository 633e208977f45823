"""A model routed kv-aware, end to end through the control plane: the planner gives both
backends vLLM's --kv-events-config (vLLM its hash algorithm too, and no PYTHONHASHSEED), the
pod and Service open the events and replay ports to the router alone, discovery finds them on
the EndpointSlices, and a local replica publishes on Unix sockets of its own instead."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kubeschemas
import pytest
import yaml

from fleetllm.api.contract import KV_EVENTS_PORT, KV_REPLAY_PORT
from fleetllm.api.manifests import parse_llmdeployment
from fleetllm.kv_events import parse_kv_events_config
from fleetllm.local.deployments import load_fleet
from fleetllm.local.launch import kv_events_endpoint, replica_argv
from fleetllm.operator.render import render
from fleetllm.planner.errors import PlanError
from fleetllm.planner.plan import plan
from fleetllm.planner.settings import OperatorConfig
from fleetllm.planner.vllm_args import read_vllm_args
from fleetllm.router.discovery import KVEventsEndpoint, parse_endpoint_slice, parse_static_fleet


def _cr(backend: str = "builtin", strategy: str = "kv-aware", **engine: Any) -> Any:
    gpu = "cpu" if backend == "builtin" else "L4"
    doc = yaml.safe_load(
        f"""\
apiVersion: fleetllm.io/v1alpha1
kind: LLMDeployment
metadata: {{name: smol, namespace: team-a, uid: u-1}}
spec:
  model: {{name: smollm2-135m, source: "hf://HuggingFaceTB/SmolLM2-135M"}}
  engine: {{backend: {backend}}}
  gpu: {{type: {gpu}}}
  maxModelLen: 2048
  routing: {{strategy: {strategy}}}
"""
    )
    doc["spec"]["engine"].update(engine)
    return parse_llmdeployment(doc)


def _flag(args: tuple[str, ...], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


@pytest.mark.parametrize("backend", ["builtin", "vllm"])
def test_both_backends_publish_on_the_contract_ports(backend: str) -> None:
    planned = plan(_cr(backend).spec)
    config = parse_kv_events_config(_flag(planned.args, "--kv-events-config") or "")
    assert config.enabled
    assert config.endpoint == f"tcp://*:{KV_EVENTS_PORT}"
    assert config.replay_endpoint == f"tcp://*:{KV_REPLAY_PORT}"
    if backend == "vllm":
        # vLLM reads the same flag, and hashes as the router reproduces it.
        assert _flag(planned.args, "--prefix-caching-hash-algo") == "sha256"
        assert "--enable-prompt-tokens-details" in planned.args
        read = {g.option.dest: g.values for g in read_vllm_args(planned.args)}
        assert parse_kv_events_config(read["kv_events_config"][0]) == config
    # Another strategy: no events, no ports.
    other = plan(_cr(backend, strategy="prefix").spec)
    assert "--kv-events-config" not in other.args
    assert "--prefix-caching-hash-algo" not in other.args


def test_a_seeded_vllm_cannot_be_routed_by_its_events() -> None:
    seeded = _cr("vllm", env=[{"name": "PYTHONHASHSEED", "value": "0"}])
    with pytest.raises(PlanError, match="PYTHONHASHSEED") as refused:
        plan(seeded.spec)
    assert refused.value.reason == "UnsupportedRouting"
    plan(_cr("vllm", strategy="prefix", env=[{"name": "PYTHONHASHSEED", "value": "0"}]).spec)


def test_the_pod_and_service_open_the_event_ports_to_the_router_alone() -> None:
    config = OperatorConfig(fleet_namespace="fleet-system", fleet_instance="prod")
    cr = _cr()
    objects = {o["kind"]: o for o in render(cr, plan(cr.spec, config), config)}
    for obj in objects.values():
        kubeschemas.validate(obj, "1.30")
    container = objects["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {
        "http": 8000,
        "kv-events": KV_EVENTS_PORT,
        "kv-replay": KV_REPLAY_PORT,
    }
    ports = {p["name"]: p["port"] for p in objects["Service"]["spec"]["ports"]}
    assert ports == {"http": 8000, "kv-events": KV_EVENTS_PORT, "kv-replay": KV_REPLAY_PORT}
    http, events = objects["NetworkPolicy"]["spec"]["ingress"]
    assert http["ports"] == [{"port": "http", "protocol": "TCP"}]
    assert [p["port"] for p in events["ports"]] == ["kv-events", "kv-replay"]
    (peer,) = events["from"]
    assert peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "router"
    # Without kv-aware routing nothing of it is rendered.
    plain = _cr(strategy="prefix")
    plain_objects = {o["kind"]: o for o in render(plain, plan(plain.spec, config), config)}
    assert len(plain_objects["Service"]["spec"]["ports"]) == 1
    assert len(plain_objects["NetworkPolicy"]["spec"]["ingress"]) == 1


def test_discovery_finds_each_replicas_event_sockets_on_its_endpoint_slice() -> None:
    def endpoint_slice(ports: list[dict[str, Any]]) -> Any:
        return parse_endpoint_slice(
            {
                "metadata": {
                    "name": "smol-x",
                    "namespace": "team-a",
                    "labels": {"kubernetes.io/service-name": "smol"},
                },
                "ports": ports,
                "endpoints": [{"addresses": ["10.1.2.3"], "conditions": {"ready": True}}],
            }
        )

    ports = [
        {"name": "kv-replay", "port": KV_REPLAY_PORT},
        {"name": "http", "port": 8000},
        {"name": "kv-events", "port": KV_EVENTS_PORT},
    ]
    (ref,) = endpoint_slice(ports).replicas
    assert ref.url == "http://10.1.2.3:8000"
    assert ref.kv_events == KVEventsEndpoint(
        f"tcp://10.1.2.3:{KV_EVENTS_PORT}", f"tcp://10.1.2.3:{KV_REPLAY_PORT}"
    )
    # Both ports or none: events without their replay cannot be checked.
    (ref,) = endpoint_slice(ports[1:]).replicas
    assert ref.kv_events is None


def test_the_static_fleet_names_event_sockets_and_a_tokenizer() -> None:
    fleet = parse_static_fleet(
        {
            "models": {
                "m": {
                    "tokenizer": "/models/m",
                    "replicas": [
                        {
                            "url": "http://127.0.0.1:9000",
                            "kvEvents": {
                                "endpoint": "ipc:///tmp/x/events",
                                "replayEndpoint": "tcp://127.0.0.1:5558",
                            },
                        }
                    ],
                }
            }
        }
    )
    route = fleet["m"]
    assert route.tokenizer == "/models/m"
    assert route.replicas[0].kv_events == KVEventsEndpoint(
        "ipc:///tmp/x/events", "tcp://127.0.0.1:5558"
    )
    for bad in (
        {"endpoint": "ipc:///x"},
        {"endpoint": "http://x", "replayEndpoint": "ipc:///y"},
        {"endpoint": 5, "replayEndpoint": "ipc:///y"},
        ["ipc:///x"],
    ):
        doc = {"models": {"m": [{"url": "http://127.0.0.1:9000", "kvEvents": bad}]}}
        with pytest.raises(ValueError, match="kvEvents"):
            parse_static_fleet(doc)
    with pytest.raises(ValueError, match="tokenizer"):
        parse_static_fleet({"models": {"m": {"tokenizer": 3, "replicas": []}}})


def test_a_local_replica_publishes_on_sockets_of_its_own(tmp_path: Path) -> None:
    manifest = tmp_path / "kv.yaml"
    manifest.write_text(
        """\
apiVersion: fleetllm.io/v1alpha1
kind: LLMDeployment
metadata: {name: smol}
spec:
  model: {name: smol, source: builtin://smollm2-135m}
  gpu: {type: cpu}
  routing: {strategy: kv-aware}
"""
    )
    (model,) = load_fleet([manifest], cache=tmp_path / "cache")
    events = kv_events_endpoint(model, tmp_path, 4321)
    assert events == KVEventsEndpoint(
        f"ipc://{tmp_path}/4321-events", f"ipc://{tmp_path}/4321-replay"
    )
    argv = replica_argv(model, 4321, threads=1, events=events)
    config = json.loads(argv[argv.index("--kv-events-config") + 1])
    assert config["endpoint"] == events.events
    assert config["replay_endpoint"] == events.replay
    assert config["enable_kv_cache_events"] is True
    with pytest.raises(ValueError, match="KV events"):
        replica_argv(model, 4321, threads=1)
    (plain,) = load_fleet([])
    assert kv_events_endpoint(plain, tmp_path, 4321) is None
