"""The operator's adapter loader against the emulated API server, with engines played by the
test (vLLM's adapter API: /v1/models, /v1/load_lora_adapter, /v1/unload_lora_adapter) and the
Job controller played by the test: adapters are loaded on every ready replica with the model's
engine key, pulled by Jobs into the shared model cache first when they come from a hub, loaded
again on a replica that restarted, unloaded when spec.adapters drops them, and reported one by
one in status.adapters, Failed with the reason when a pull fails or an engine refuses one
(which is then not asked again at once). All the while the engine Deployment is never written
again: adding or removing an adapter restarts nothing."""

from __future__ import annotations

import base64
from typing import Any

import kmock
import pytest
from kubeapi import CR_RESOURCE, KMOCK_WARNINGS, NAMESPACE, EmulatedApiServer
from operator_testkit import DEPLOYMENTS, Controllers, Load, merge_patch, smollm2_cr

from fleetllm.operator.adapter_loader import FIELD_MANAGER
from fleetllm.planner.placement import MODEL_CACHE_MOUNT
from fleetllm.planner.settings import ModelCache, OperatorConfig

pytestmark = [pytest.mark.asyncio, KMOCK_WARNINGS]

CRS = f"/apis/fleetllm.io/v1alpha1/namespaces/{NAMESPACE}/llmdeployments"
JOBS = "batch/v1/jobs"
CACHE = "fleet-models"
CONFIG = OperatorConfig(model_cache=ModelCache(CACHE))
TICK = 0.2
SQL = {"name": "sql", "source": f"pvc://{CACHE}/adapters/sql"}
CHAT = {"name": "chat", "source": "hf://org/chat-lora", "revision": "v1"}
BAD = {"name": "bad", "source": f"pvc://{CACHE}/adapters/bad"}
GONE = {"name": "gone", "source": "s3://bucket/gone"}
REFUSAL = "LoRA rank 64 is greater than max_lora_rank 16."


async def _patch(api: EmulatedApiServer, name: str, spec: dict[str, Any]) -> None:
    await merge_patch(api, f"{CRS}/{name}", {"spec": spec})


def _adapters(api: EmulatedApiServer) -> dict[str, dict[str, Any]]:
    cr = api.get(CR_RESOURCE, "smol") or {}
    return {a["name"]: a for a in (cr.get("status") or {}).get("adapters") or []}


def _state(api: EmulatedApiServer, name: str) -> tuple[str, int] | None:
    entry = _adapters(api).get(name)
    return None if entry is None else (entry["state"], entry.get("loadedReplicas", 0))


def _jobs(api: EmulatedApiServer) -> dict[str, dict[str, Any]]:
    return {
        j["metadata"]["labels"]["fleetllm.io/adapter"]: j
        for j in api.list(JOBS)
        if j["metadata"].get("namespace") == NAMESPACE
    }


async def _finish_job(api: EmulatedApiServer, job: dict[str, Any], said: str | None) -> None:
    """The Job controller: the pull succeeded, or failed with `said` as its last words."""
    name = job["metadata"]["name"]
    path = f"/apis/batch/v1/namespaces/{NAMESPACE}/jobs/{name}/status"
    if said is None:
        status: dict[str, Any] = {"succeeded": 1}
    else:
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": f"{name}-x1",
                "labels": {**job["spec"]["template"]["metadata"]["labels"], "job-name": name},
            },
            "spec": {"containers": [{"name": "model-pull", "image": "ghcr.io/fleetllm/x:1"}]},
        }
        async with api.post(f"/api/v1/namespaces/{NAMESPACE}/pods", json=pod) as response:
            assert response.status == 201, await response.text()
        terminated = {"exitCode": 1, "message": f"pulling\n{said}\n", "reason": "Error"}
        pod_status = {
            "status": {
                "phase": "Failed",
                "containerStatuses": [
                    {
                        "name": "model-pull",
                        "image": "ghcr.io/fleetllm/x:1",
                        "imageID": "",
                        "ready": False,
                        "restartCount": 0,
                        "state": {"terminated": terminated},
                    }
                ],
            }
        }
        pod_path = f"/api/v1/namespaces/{NAMESPACE}/pods/{name}-x1/status"
        await merge_patch(api, pod_path, pod_status)
        failed = {
            "type": "Failed",
            "status": "True",
            "reason": "BackoffLimitExceeded",
            "message": "Job has reached the specified backoff limit",
        }
        status = {"failed": 3, "conditions": [failed]}
    await merge_patch(api, path, {"status": status})


def _deployment_writes(api: EmulatedApiServer) -> int:
    return sum(1 for r in api.writes() if r.resource == kmock.resource(DEPLOYMENTS))


async def test_adapters_reach_every_replica_and_come_and_go_without_a_restart(
    api: EmulatedApiServer, start_operator: Any, controllers: Any, eventually: Any
) -> None:
    await start_operator(config=CONFIG, adapter_interval=TICK)
    cluster: Controllers = controllers("smol", Load())
    cluster.refuse[f"{MODEL_CACHE_MOUNT}/adapters/bad"] = REFUSAL
    body = smollm2_cr(2)
    body["spec"] |= {"lora": {}, "adapters": [SQL]}
    async with api.post(CRS, json=body) as response:
        assert response.status == 201, await response.text()

    sql_path = f"{MODEL_CACHE_MOUNT}/adapters/sql"
    await eventually(lambda: _state(api, "sql") == ("Ready", 2), "sql on both replicas")
    assert _adapters(api)["sql"]["path"] == sql_path
    assert [e.adapters for e in cluster.engines.values()] == [{"sql": sql_path}] * 2
    # With the model's own engine key (the reconciler's Secret; no fleet root here).
    secret = api.get("v1/secrets", "smol-engine-key", NAMESPACE)
    key = base64.b64decode(secret["data"]["api-key"]).decode()
    assert {k for e in cluster.engines.values() for k in e.keys} == {f"Bearer {key}"}
    deployment = api.get(DEPLOYMENTS, "smol-engine", NAMESPACE)
    writes = _deployment_writes(api)
    assert writes >= 1, "the Deployment was applied once"

    # A hub adapter: pulled by a Job into the model cache first, then loaded everywhere.
    await _patch(api, "smol", {"adapters": [SQL, CHAT]})
    jobs = await eventually(lambda: "chat" in (j := _jobs(api)) and j, "the pull Job")
    chat_path = f"{MODEL_CACHE_MOUNT}/hf/org/chat-lora/v1"
    assert jobs["chat"]["spec"]["template"]["spec"]["containers"][0]["args"][:2] == [
        "hf://org/chat-lora@v1",
        chat_path,
    ]
    await eventually(lambda: _state(api, "chat") == ("Pending", 0), "pending while it pulls")
    assert _adapters(api)["chat"]["reason"] == "Pulling"
    assert all("chat" not in e.adapters for e in cluster.engines.values())
    await _finish_job(api, jobs["chat"], None)
    await eventually(lambda: _state(api, "chat") == ("Ready", 2), "chat on both replicas")
    assert _adapters(api)["chat"]["path"] == chat_path

    # A replica restarts: it comes back without adapters, and gets them again.
    first = sorted(cluster.engines)[0]
    await cluster.restart(first)
    await eventually(
        lambda: len(cluster.engines) == 2 and first not in cluster.engines, "a new replica"
    )
    await eventually(
        lambda: all(set(e.adapters) == {"sql", "chat"} for e in cluster.engines.values()),
        "the new replica holds both adapters",
    )

    # Removed: unloaded everywhere, and gone from the status.
    await _patch(api, "smol", {"adapters": [CHAT]})
    await eventually(
        lambda: all(set(e.adapters) == {"chat"} for e in cluster.engines.values()), "sql unloaded"
    )
    await eventually(lambda: set(_adapters(api)) == {"chat"}, "the status follows")

    # An adapter every engine refuses: Failed with the engine's reason, asked once.
    await _patch(api, "smol", {"adapters": [CHAT, BAD]})
    await eventually(lambda: _state(api, "bad") == ("Failed", 0), "bad failed")
    assert _adapters(api)["bad"]["reason"] == "LoadRefused"
    assert _adapters(api)["bad"]["message"] == REFUSAL
    listed = sum(e.listings for e in cluster.engines.values())
    await eventually(
        lambda: sum(e.listings for e in cluster.engines.values()) >= listed + 10,
        "five more steps over both replicas",
    )
    assert sum(1 for e in cluster.engines.values() for n, _ in e.loads if n == "bad") == 1
    events = [e for e in api.list("v1/events") if e.get("reason") == "AdapterFailed"]
    assert any(REFUSAL in e["message"] for e in events)
    assert _state(api, "chat") == ("Ready", 2), "the others are served on"

    # A pull that fails: Failed with the pull's own last words.
    await _patch(api, "smol", {"adapters": [CHAT, GONE]})
    jobs = await eventually(lambda: "gone" in (j := _jobs(api)) and j, "the pull Job of gone")
    said = "fleetllm: model pull: s3://bucket/gone has no *.safetensors weights at its top level"
    await _finish_job(api, jobs["gone"], said)
    await eventually(lambda: _state(api, "gone") == ("Failed", 0), "gone failed")
    assert _adapters(api)["gone"]["reason"] == "PullFailed"
    assert said in _adapters(api)["gone"]["message"]

    # None of this touched the engine Deployment.
    assert _deployment_writes(api) == writes
    assert api.get(DEPLOYMENTS, "smol-engine", NAMESPACE)["spec"] == deployment["spec"]
    writers = {
        r.params.get("fieldManager")
        for r in api.writes()
        if r.subresource == "status" and "adapters" in ((r.data or {}).get("status") or {})
    }
    assert writers == {FIELD_MANAGER}

    # No LoRA any more: the status and the pull Jobs go.
    await _patch(api, "smol", {"lora": None, "adapters": None})
    await eventually(lambda: not _adapters(api) and not _jobs(api), "stood down")
    assert "adapters" not in (api.get(CR_RESOURCE, "smol") or {}).get("status", {})
