"""The placement decides where a replica's engine loads the weights from: the planned
arguments already name that place, in a pod and on this machine alike."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fleetllm.api.deployment import LLMDeploymentSpec
from fleetllm.api.source import ModelSource
from fleetllm.planner.errors import PlanError
from fleetllm.planner.placement import IN_CLUSTER, LocalPlacement
from fleetllm.planner.plan import plan

PULLED = Path("/home/me/.cache/fleetllm/pulled")


@pytest.mark.parametrize(
    ("source", "in_cluster", "here"),
    [
        ("builtin://smollm2-135m", "smollm2-135m", "smollm2-135m"),
        (
            "hf://Qwen/Qwen2.5-7B-Instruct@v1",
            "/var/lib/fleetllm/models/hf/Qwen/Qwen2.5-7B-Instruct/v1",
            f"{PULLED}/hf/Qwen/Qwen2.5-7B-Instruct/v1",
        ),
        (
            "s3://bucket/models/llama",
            "/var/lib/fleetllm/models/s3/bucket/models/llama",
            f"{PULLED}/s3/bucket/models/llama",
        ),
        ("file:///srv/llama", "/srv/llama", "/srv/llama"),
    ],
)
def test_each_placement_names_one_folder_per_source(
    source: str, in_cluster: str, here: str
) -> None:
    parsed = ModelSource.parse(source)
    assert IN_CLUSTER.model_path(parsed) == in_cluster
    assert LocalPlacement(PULLED).model_path(parsed) == here


def test_a_claim_is_mounted_in_the_pod() -> None:
    assert IN_CLUSTER.model_path(ModelSource.parse("pvc://weights/llama/8b")) == "/models/llama/8b"
    assert IN_CLUSTER.model_path(ModelSource.parse("pvc://weights")) == "/models"


def _spec(source: str, **fields: Any) -> LLMDeploymentSpec:
    return LLMDeploymentSpec.model_validate(
        {"model": {"name": "m", "source": source}, "gpu": {"type": "L4"}, **fields}
    )


def test_the_planned_arguments_name_the_placements_folder() -> None:
    source = "hf://Qwen/Qwen2.5-7B-Instruct"
    for backend in ("builtin", "vllm"):
        spec = _spec(source, engine={"backend": backend}, maxModelLen=8192)
        pod = plan(spec)
        local = plan(spec, placement=LocalPlacement(PULLED))
        local_path = f"{PULLED}/hf/Qwen/Qwen2.5-7B-Instruct/main"
        assert local.model_path == local_path
        assert pod.model_path == "/var/lib/fleetllm/models/hf/Qwen/Qwen2.5-7B-Instruct/main"
        for planned in (pod, local):
            args = list(planned.args)
            loaded = args[args.index("--model") + 1] if backend == "builtin" else args[0]
            assert loaded == planned.model_path
        # Only the path differs; the rest of the plan is the same.
        assert [a for a in pod.args if a != pod.model_path] == [
            a for a in local.args if a != local.model_path
        ]
        assert pod.status.num_kv_blocks == local.status.num_kv_blocks


def test_a_local_path_is_served_only_on_this_machine() -> None:
    spec = _spec("file:///srv/llama-3.1-8b", engine={"backend": "builtin"}, maxModelLen=8192)
    with pytest.raises(PlanError, match="a path on one machine") as refused:
        plan(spec)
    assert refused.value.reason == "UnsupportedSource"
    local = plan(spec, placement=LocalPlacement(PULLED))
    assert local.model_path == "/srv/llama-3.1-8b"
    assert local.node_selector == {}
