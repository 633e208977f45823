"""spec.lora and spec.adapters in `fleetllm up`: adapters' file:// paths read from the
manifest's folder, hf:// and s3:// ones pulled into the local cache, claims refused with
what to do instead; the replicas' environment opens the load API; the router is told where
each adapter is, or why a replica refused it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from deployment_manifests import smollm2

from fleetllm.local.deployments import PULLED, FleetError, load_fleet
from fleetllm.local.launch import replica_env
from fleetllm.local.lora import adapter_routes
from fleetllm.planner.lora import RUNTIME_LORA_ENV
from fleetllm.router.lora import AdapterRoute


def _manifest(path: Path, adapters: list[dict[str, Any]], **spec: Any) -> Path:
    doc = smollm2(served_name="smol", lora={"maxLoras": 2}, adapters=adapters, **spec)
    path.write_text(json.dumps(doc))
    return path


def test_adapters_are_placed_where_the_replicas_read_them(tmp_path: Path) -> None:
    (tmp_path / "adapters" / "sql").mkdir(parents=True)
    deploy = tmp_path / "deploy"
    deploy.mkdir()
    adapters = [
        {"name": "sql", "source": "file://../adapters/sql"},
        {"name": "chat", "source": "hf://org/chat-lora", "revision": "v2"},
        {"name": "ops", "source": "s3://bucket/ops"},
    ]
    cache = tmp_path / "cache"
    (model,) = load_fleet([_manifest(deploy / "smol.yaml", adapters)], cache=cache)
    assert model.adapters == {
        "sql": str(tmp_path / "adapters" / "sql"),
        "chat": str(cache / PULLED / "hf" / "org" / "chat-lora" / "v2"),
        "ops": str(cache / PULLED / "s3" / "bucket" / "ops"),
    }
    assert model.cr.spec.adapters[0].source == f"file://{tmp_path / 'adapters' / 'sql'}"
    env = replica_env(model, {}, None)
    assert env[RUNTIME_LORA_ENV] == "true"
    assert "--enable-lora" in model.plan.args


def test_adapters_a_machine_cannot_read_are_refused_with_the_rest(tmp_path: Path) -> None:
    adapters = [
        {"name": "claim", "source": "pvc://adapters/claim"},
        {"name": "gone", "source": "file://nowhere"},
    ]
    with pytest.raises(FleetError) as caught:
        load_fleet([_manifest(tmp_path / "smol.yaml", adapters[:1])], cache=tmp_path)
    assert "adapter claim: pvc://adapters/claim is a claim of a cluster" in str(caught.value)
    with pytest.raises(FleetError, match=r"adapter gone 'file://nowhere': .*nowhere does not"):
        load_fleet([_manifest(tmp_path / "smol.yaml", adapters[1:])], cache=tmp_path)


def test_without_lora_the_replicas_get_no_load_api(tmp_path: Path) -> None:
    path = _manifest(tmp_path / "smol.yaml", [])
    doc = json.loads(path.read_text())
    del doc["spec"]["lora"]
    path.write_text(json.dumps(doc))
    (model,) = load_fleet([path], cache=tmp_path)
    assert RUNTIME_LORA_ENV not in replica_env(model, {}, None)
    assert model.adapters == {} and "--enable-lora" not in model.plan.args


def test_the_router_is_told_where_each_adapter_is_or_why_it_failed() -> None:
    adapters = {"sql": "/a/sql", "bad": "/a/bad"}
    assert adapter_routes(adapters, {"bad": "rank 64 over 16"}) == (
        AdapterRoute("sql", "/a/sql"),
        AdapterRoute("bad", None, "rank 64 over 16"),
    )
