"""LoRA in the rendered objects: spec.lora gives the engine pods their slots, their load API and
the shared model cache; spec.adapters changes no child at all (so adding or removing an
adapter restarts nothing), and each hf:// or s3:// adapter's pull Job is a valid Job that is
no endpoint of the model."""

from __future__ import annotations

from typing import Any

import kubeschemas
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetllm.api.contract import selector_labels
from fleetllm.api.deployment import LLMDeployment
from fleetllm.api.lora import AdapterSpec
from fleetllm.operator.render import render
from fleetllm.operator.render_lora import LABEL_ADAPTER, pull_job_name, render_pull_job
from fleetllm.planner.lora import RUNTIME_LORA_ENV
from fleetllm.planner.placement import IN_CLUSTER, MODEL_CACHE_MOUNT
from fleetllm.planner.plan import plan
from fleetllm.planner.settings import ModelCache, OperatorConfig

CACHE = OperatorConfig(model_cache=ModelCache("fleet-models"))
UID = "0b7c6f5e-1d2a-4c3b-9e8f-7a6b5c4d3e2f"


def llmdeployment(spec: dict[str, Any]) -> LLMDeployment:
    model = {"name": "base", "source": "pvc://models/smol", "architecture": "SmolLM2-135M"}
    base = {"model": model, "gpu": {"type": "cpu"}}
    return LLMDeployment.model_validate(
        {
            "apiVersion": "fleetllm.io/v1alpha1",
            "kind": "LLMDeployment",
            "metadata": {"name": "smol", "namespace": "team", "uid": UID},
            "spec": {**base, **spec},
        }
    )


def engine_deployment(cr: LLMDeployment, config: OperatorConfig) -> dict[str, Any]:
    (deployment,) = [
        o for o in render(cr, plan(cr.spec, config), config) if o["kind"] == "Deployment"
    ]
    return deployment


ADAPTERS = st.lists(
    st.builds(
        lambda name, source: {"name": name, "source": source},
        st.from_regex(r"\Aad[a-z0-9]{0,8}\Z"),
        st.sampled_from(
            ["hf://org/lora", "s3://bucket/lora", "pvc://models/lora", "pvc://other/x", "file:///x"]
        ),
    ),
    max_size=5,
    unique_by=lambda a: a["name"],
)


@settings(max_examples=60, deadline=None)
@given(adapters=ADAPTERS, backend=st.sampled_from(["builtin", "vllm"]))
def test_adapters_change_no_rendered_child(adapters: list[dict[str, str]], backend: str) -> None:
    engine = {"backend": backend}
    for config in (OperatorConfig(), CACHE):
        without = llmdeployment({"engine": engine, "lora": {"maxLoras": 2}})
        with_adapters = llmdeployment(
            {"engine": engine, "lora": {"maxLoras": 2}, "adapters": adapters}
        )
        assert render(with_adapters, plan(with_adapters.spec, config), config) == render(
            without, plan(without.spec, config), config
        )


@pytest.mark.parametrize("backend", ["builtin", "vllm"])
def test_lora_gives_the_engines_slots_load_api_and_the_shared_cache(backend: str) -> None:
    cr = llmdeployment({"engine": {"backend": backend}, "lora": {"maxLoraRank": 32}})
    pod = engine_deployment(cr, CACHE)["spec"]["template"]["spec"]
    (engine,) = pod["containers"]
    assert engine["args"][engine["args"].index("--max-lora-rank") + 1] == "32"
    assert {"name": RUNTIME_LORA_ENV, "value": "true"} in engine["env"]
    assert {"name": "models", "mountPath": MODEL_CACHE_MOUNT, "readOnly": True} in engine[
        "volumeMounts"
    ]
    claims = [
        v["persistentVolumeClaim"]["claimName"]
        for v in pod["volumes"]
        if "persistentVolumeClaim" in v
    ]
    assert sorted(claims) == ["fleet-models", "models"]
    # Without LoRA: no load API, and a pvc:// model needs no cache.
    plain = engine_deployment(llmdeployment({"engine": {"backend": backend}}), CACHE)
    (plain_engine,) = plain["spec"]["template"]["spec"]["containers"]
    assert RUNTIME_LORA_ENV not in {v["name"] for v in plain_engine["env"]}
    assert "models" not in {v["name"] for v in plain["spec"]["template"]["spec"]["volumes"]}


@pytest.mark.parametrize("version", ["1.30", "1.37"])
@pytest.mark.parametrize("read_only", [False, True])
def test_an_adapters_pull_job_is_valid_and_no_endpoint_of_the_model(
    version: str, read_only: bool
) -> None:
    config = OperatorConfig(model_cache=ModelCache("fleet-models", read_only=read_only))
    adapter = AdapterSpec(name="sql", source="hf://org/sql-lora", revision="v2")
    cr = llmdeployment({"lora": {}, "adapters": [adapter.model_dump(by_alias=True)]})
    path = IN_CLUSTER.adapter_path(adapter.model_source(), plan(cr.spec).source, "fleet-models")
    assert path == f"{MODEL_CACHE_MOUNT}/hf/org/sql-lora/v2"
    job = render_pull_job(cr, adapter, path, config)
    kubeschemas.validate(job, version)
    assert job["metadata"]["name"] == pull_job_name("smol", adapter, path)
    assert len(job["metadata"]["name"]) <= 63
    assert job["metadata"]["ownerReferences"][0]["uid"] == UID
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert labels[LABEL_ADAPTER] == "sql"
    engine = selector_labels("smol")
    assert not engine.items() <= labels.items(), "the Service would send it requests"
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["args"][:2] == ["hf://org/sql-lora@v2", path]
    assert ("--read-only" in container["args"]) is read_only
    # The pull runs code of its own over downloaded files: no API token for it either.
    assert job["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    claim = job["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]
    assert claim["claimName"] == "fleet-models"
    # Another revision is another pull.
    other = AdapterSpec(name="sql", source="hf://org/sql-lora", revision="v3")
    assert pull_job_name("smol", other, path) != job["metadata"]["name"]


@pytest.mark.parametrize(
    ("source", "cache", "where"),
    [
        ("pvc://models/adapters/sql", None, "/models/adapters/sql"),
        ("pvc://fleet-models/sql", "fleet-models", f"{MODEL_CACHE_MOUNT}/sql"),
        ("s3://bucket/sql", "fleet-models", f"{MODEL_CACHE_MOUNT}/s3/bucket/sql"),
        ("pvc://elsewhere/sql", "fleet-models", "do not mount the claim elsewhere"),
        ("hf://org/sql", None, "has none"),
        ("file:///sql", "fleet-models", "served only by `fleetllm up`"),
    ],
)
def test_an_adapter_is_placed_on_a_volume_every_replica_mounts(
    source: str, cache: str | None, where: str
) -> None:
    model = plan(llmdeployment({}).spec).source
    adapter = AdapterSpec(name="sql", source=source).model_source()
    if where.startswith("/"):
        assert IN_CLUSTER.adapter_path(adapter, model, cache) == where
    else:
        with pytest.raises(ValueError, match=where):
            IN_CLUSTER.adapter_path(adapter, model, cache)
