"""vLLM on a CPU: planned like on a GPU, with the KV cache in bytes (what the plan reports)
instead of a share of device memory, and what does not apply said, not dropped."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import kubeschemas
import pytest
from examples import VLLM_BUILTIN

from fleetllm.api.deployment import LLMDeploymentSpec
from fleetllm.api.manifests import load_llmdeployments
from fleetllm.images import VLLM_CPU_IMAGE, VLLM_IMAGE
from fleetllm.operator.render import render
from fleetllm.planner.checks import claims_to_check
from fleetllm.planner.errors import PlanError
from fleetllm.planner.placement import LocalPlacement
from fleetllm.planner.plan import plan
from fleetllm.planner.settings import ModelCache, OperatorConfig
from fleetllm.planner.summary import plan_summary
from fleetllm.planner.timing import download_seconds

CONVERTED = "/cache/models/SmolLM2-135M-Instruct.Q4_1-0123456789ab"
CACHED = OperatorConfig(model_cache=ModelCache(claim_name="models"))
HERE = LocalPlacement(Path("/cache/pulled"), {"smollm2-135m": CONVERTED})


def _spec(source: str = "builtin://smollm2-135m", **fields: Any) -> LLMDeploymentSpec:
    return LLMDeploymentSpec.model_validate(
        {
            "model": {"name": "smol", "source": source},
            "gpu": {"type": "cpu"},
            "engine": {"backend": "vllm", "dtype": "bfloat16"},
            "maxModelLen": 2048,
            "pod": {"resources": {"limits": {"memory": "4Gi"}}},
            **fields,
        }
    )


def _flags(args: tuple[str, ...]) -> dict[str, str]:
    return {a: b for a, b in itertools.pairwise(args) if a.startswith("--")}


def test_vllm_on_a_cpu_gets_the_planned_kv_cache_in_bytes() -> None:
    planned = plan(_spec(), placement=HERE)
    flags = _flags(planned.args)
    status = planned.status
    assert planned.command == ("vllm", "serve") and planned.args[0] == CONVERTED
    kv = int(flags["--kv-cache-memory-bytes"])
    # Exactly the planned capacity, in whole blocks: what status.plan reports.
    assert kv == status.max_concurrent_tokens * status.kv_bytes_per_token
    assert kv // status.kv_bytes_per_token // status.block_size == status.num_kv_blocks
    assert "--gpu-memory-utilization" not in flags
    # vLLM's CPU attention takes only multiples of 32 tokens a block (it refuses 16 at start).
    assert flags["--block-size"] == str(status.block_size) == "128"
    assert flags["--dtype"] == "bfloat16" and flags["--max-model-len"] == "2048"
    assert status.image == VLLM_CPU_IMAGE
    # What does not apply is said, with what the engine does instead.
    (note,) = planned.notes
    assert "gpu-memory-utilization 0.90 is not passed" in note and str(kv) in note
    assert f"  note           {note}\n" in plan_summary(_cr(), planned)


def _cr() -> Any:
    (cr,) = load_llmdeployments(VLLM_BUILTIN)
    return cr


def test_vllm_runs_more_processes_than_the_builtin_engine_so_its_kv_cache_is_smaller() -> None:
    vllm = plan(_spec(), placement=HERE).status
    builtin = plan(_spec(engine={"backend": "builtin", "dtype": "bfloat16"}), placement=HERE)
    assert vllm.overhead_gib > builtin.status.overhead_gib
    assert vllm.kv_cache_gib < builtin.status.kv_cache_gib


def test_a_gpu_keeps_its_share_of_device_memory() -> None:
    spec = _spec("hf://Qwen/Qwen2.5-7B-Instruct", gpu={"type": "L4"}, pod={})
    planned = plan(spec)
    assert _flags(planned.args)["--gpu-memory-utilization"] == "0.90"
    assert "--kv-cache-memory-bytes" not in planned.args
    assert planned.notes == () and planned.status.image == VLLM_IMAGE


def test_marlin_kernels_are_not_asked_for_on_a_cpu() -> None:
    spec = _spec("hf://Qwen/Qwen2.5-7B-Instruct-AWQ", quantization={"weights": "awq"}, pod={
        "resources": {"limits": {"memory": "16Gi"}}
    })  # fmt: skip
    assert _flags(plan(spec).args)["--quantization"] == "awq"


def test_the_built_in_model_is_converted_into_the_model_cache_in_a_cluster() -> None:
    # vLLM cannot read its GGUF file: in a pod it loads the folder an init container converts
    # it into, in the model cache like downloaded weights.
    pod = plan(_cr().spec)
    folder = "/var/lib/fleetllm/models/builtin/smollm2-135m"
    assert pod.model_path == folder == pod.args[0] and pod.fills_cache
    assert download_seconds(pod) > 0
    assert claims_to_check(_cr().spec, CACHED) == ["models"]
    # The builtin engine loads it by its name, from its own image: nothing to fill.
    builtin = _spec(engine={"backend": "builtin", "dtype": "bfloat16"})
    assert not plan(builtin).fills_cache and plan(builtin).model_path == "smollm2-135m"
    assert claims_to_check(builtin, CACHED) == []
    # Here it needs the folder the local fleet converts it into.
    assert plan(_spec(), placement=HERE).model_path == CONVERTED
    with pytest.raises(PlanError, match="no converted folder of it on this machine") as refused:
        plan(_spec(), placement=LocalPlacement(Path("/cache/pulled")))
    assert refused.value.reason == "UnsupportedSource"


def test_vllm_on_a_cpu_renders_for_a_cluster_with_the_cpu_image() -> None:
    cr = _cr()
    spec = cr.spec.model_copy(
        update={
            "model": cr.spec.model.model_copy(
                update={"source": "hf://HuggingFaceTB/SmolLM2-135M-Instruct"}
            )
        }
    )
    meta = cr.metadata.model_copy(
        update={"uid": "0b7c6f5e-1d2a-4c3b-9e8f-7a6b5c4d3e2f", "namespace": "default"}
    )
    cr = cr.model_copy(update={"spec": spec, "metadata": meta})
    objects = render(cr, plan(spec))
    for obj in objects:
        kubeschemas.validate(obj, "1.30")
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    (engine,) = deployment["spec"]["template"]["spec"]["containers"]
    assert engine["image"] == VLLM_CPU_IMAGE
    assert "--kv-cache-memory-bytes" in engine["args"]
    assert "nvidia.com/gpu" not in engine["resources"]["limits"]
