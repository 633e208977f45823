"""spec.lora in the planner: the adapter slots' memory against a count made projection by
projection, their place in the budget, the flags of both backends, and the refusal of slots
that leave no room, whose every suggestion plans."""

from __future__ import annotations

import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetllm.api.catalog import GPU_TYPES, MODELS, ModelArch
from fleetllm.api.deployment import LLMDeploymentSpec
from fleetllm.planner.errors import PlanError
from fleetllm.planner.lora import RUNTIME_LORA_ENV, lora_env, slot_bytes
from fleetllm.planner.lora_fit import RANKS
from fleetllm.planner.memory import DTYPE_BYTES, estimate
from fleetllm.planner.plan import plan
from fleetllm.planner.vllm_args import read_vllm_args

LLAMA = MODELS["Llama-3.1-8B"]
SMOL = MODELS["SmolLM2-135M"]


def by_hand(arch: ModelArch, rank: int, tensor: int) -> int:
    """Parameters of one slot on one rank, projection by projection: A (rank x inputs) and B
    (outputs x rank); column-parallel projections keep A whole and split B, row-parallel ones
    split A and keep B whole."""
    q, kv, mlp, hidden = (
        arch.num_heads * arch.head_dim,
        arch.num_kv_heads * arch.head_dim,
        arch.intermediate_size or 0,
        arch.hidden_size,
    )
    column = [(hidden, q), (hidden, kv), (hidden, kv), (hidden, mlp), (hidden, mlp)]
    row = [(q, hidden), (mlp, hidden)]
    per_layer = sum(rank * inputs + outputs // tensor * rank for inputs, outputs in column)
    per_layer += sum(rank * (inputs // tensor) + outputs * rank for inputs, outputs in row)
    return arch.num_layers * per_layer


@pytest.mark.parametrize("tensor", [1, 2, 4, 8])
@pytest.mark.parametrize("rank", [8, 64])
def test_a_slot_is_a_and_b_of_every_adapted_projection(tensor: int, rank: int) -> None:
    assert slot_bytes(LLAMA, rank, tensor=tensor, dtype_bytes=2) == 2 * by_hand(LLAMA, rank, tensor)
    assert slot_bytes(SMOL, rank, tensor=1, dtype_bytes=4) == 4 * by_hand(SMOL, rank, 1)
    # A pipeline stage holds the slots of its own layers.
    halves = slot_bytes(LLAMA, rank, tensor=tensor, pipeline=2, dtype_bytes=2)
    assert halves * 2 == slot_bytes(LLAMA, rank, tensor=tensor, dtype_bytes=2)


def spec(**fields: Any) -> LLMDeploymentSpec:
    body: dict[str, Any] = {
        "model": {"name": "llama", "source": "hf://meta-llama/Llama-3.1-8B-Instruct"},
        "gpu": {"type": "L40S"},
        "maxModelLen": 8192,
    }
    body.update(fields)
    return LLMDeploymentSpec.model_validate(body)


@pytest.mark.parametrize("backend", ["builtin", "vllm"])
def test_the_slots_come_out_of_the_kv_cache(backend: str) -> None:
    engine = {"backend": backend}
    base = plan(spec(engine=engine))
    lora = {"maxLoras": 6, "maxLoraRank": 32}
    planned = plan(spec(engine=engine, lora=lora))
    slots = 6 * slot_bytes(LLAMA, 32, tensor=1, dtype_bytes=2)
    assert planned.estimate.lora_bytes == slots
    assert base.estimate.lora_bytes == 0 and base.status.lora_gib is None
    assert planned.status.lora_gib == round(slots / 2**30, 2)
    kv = planned.estimate.kv_bytes_per_token
    assert planned.estimate.kv_budget_bytes == base.estimate.kv_budget_bytes - slots
    assert planned.status.max_concurrent_tokens * kv <= planned.estimate.kv_budget_bytes
    assert planned.status.max_concurrent_tokens < base.status.max_concurrent_tokens


def test_on_a_cpu_the_adapters_kept_loaded_count_too() -> None:
    body = {"model": {"name": "smol", "source": "builtin://smollm2-135m"}, "gpu": {"type": "cpu"}}
    lora = {"maxLoras": 2, "maxLoraRank": 8, "maxCpuLoras": 5}
    planned = plan(LLMDeploymentSpec.model_validate({**body, "lora": lora}))
    dtype = DTYPE_BYTES[planned.status.dtype]
    assert planned.estimate.lora_bytes == 7 * slot_bytes(SMOL, 8, tensor=1, dtype_bytes=dtype)


@pytest.mark.parametrize("backend", ["builtin", "vllm"])
def test_both_backends_get_vllms_flags(backend: str) -> None:
    lora = {"maxLoras": 3, "maxLoraRank": 64}
    args = list(plan(spec(engine={"backend": backend}, lora=lora)).args)
    at = args.index("--enable-lora")
    assert args[at : at + 7] == [
        "--enable-lora",
        "--max-loras",
        "3",
        "--max-lora-rank",
        "64",
        "--max-cpu-loras",
        "3",
    ]
    assert "--enable-lora" not in plan(spec(engine={"backend": backend})).args
    assert lora_env(None) == {} and lora_env(spec(lora=lora).lora) == {RUNTIME_LORA_ENV: "true"}


def test_vllm_reads_the_lora_flags_as_planned() -> None:
    planned = plan(spec(engine={"backend": "vllm"}, lora={"maxLoras": 2, "maxCpuLoras": 9}))
    read = {g.option.dest: g.values for g in read_vllm_args(planned.args)}
    assert read["enable_lora"] == ()
    assert (read["max_loras"], read["max_lora_rank"], read["max_cpu_loras"]) == (
        ("2",),
        ("16",),
        ("9",),
    )


@pytest.mark.parametrize(
    ("backend", "extra"),
    [
        ("vllm", ["--max_loras", "8"]),
        ("vllm", ["--no-enable-lora"]),
        ("vllm", ["--lora-modules", "sql=/models/sql"]),
        ("builtin", ["--enable-lora"]),
        ("builtin", ["--max-lora-rank=64"]),
    ],
)
def test_extra_args_may_not_set_what_spec_lora_and_adapters_own(
    backend: str, extra: list[str]
) -> None:
    with pytest.raises(PlanError) as caught:
        plan(spec(engine={"backend": backend, "extraArgs": extra}))
    assert caught.value.reason == "InvalidEngineArgs"
    assert re.search(r"use (lora|adapters)", caught.value.message), caught.value.message


def test_slots_that_leave_no_room_are_refused_with_what_fits() -> None:
    # 8 slots of rank 512 on Llama-3.1-8B: 21 GiB, on a 24 GiB L4 that holds the model alone.
    lora = {"maxLoras": 8, "maxLoraRank": 512}
    plan(spec(gpu={"type": "L4"}))
    with pytest.raises(PlanError) as caught:
        plan(spec(gpu={"type": "L4"}, lora=lora))
    refusal = caught.value
    assert refusal.reason == "LoraDoesNotFit"
    assert "the LoRA slots (8 of rank 512" in refusal.message
    assert any(s.startswith("lora.maxLoras: ") for s in refusal.suggestions)
    assert any(s.startswith("lora.maxLoraRank: ") for s in refusal.suggestions)
    for suggestion in refusal.suggestions:
        plan(applied(spec(gpu={"type": "L4"}, lora=lora), suggestion))


def applied(given: LLMDeploymentSpec, suggestion: str) -> LLMDeploymentSpec:
    """The spec with one suggestion (`field: value[ or less]`) taken."""
    field, _, value = suggestion.partition(": ")
    number = int(value.split()[0])
    body = given.model_dump(by_alias=True, exclude_none=True)
    if field.startswith("lora."):
        body["lora"][field.removeprefix("lora.")] = number
    else:
        body[field] = number
    return LLMDeploymentSpec.model_validate(body)


@settings(max_examples=150, deadline=None)
@given(
    model=st.sampled_from([LLAMA, MODELS["Llama-3.2-1B"], MODELS["Qwen2.5-7B"]]),
    gpu=st.sampled_from(["L4", "A10G", "L40S", "A100-40GB", "cpu"]),
    backend=st.sampled_from(["builtin", "vllm"]),
    max_loras=st.integers(1, 48),
    rank=st.sampled_from(RANKS),
    extra_cpu=st.none() | st.integers(0, 32),
    context=st.sampled_from([2048, 8192, 32768]),
)
def test_lora_plans_fit_their_budget_or_are_refused_with_suggestions_that_fit(
    model: ModelArch,
    gpu: str,
    backend: str,
    max_loras: int,
    rank: int,
    extra_cpu: int | None,
    context: int,
) -> None:
    lora: dict[str, Any] = {"maxLoras": max_loras, "maxLoraRank": rank}
    if extra_cpu is not None:
        lora["maxCpuLoras"] = max_loras + extra_cpu
    given_spec = spec(
        model={"name": "m", "source": "s3://b/m", "architecture": model.name},
        gpu={"type": gpu},
        engine={"backend": backend},
        maxModelLen=min(context, model.max_position),
        lora=lora,
    )
    try:
        planned = plan(given_spec)
    except PlanError as refusal:
        if refusal.reason != "LoraDoesNotFit":
            return  # the model itself does not fit: the planner's other tests
        for suggestion in refusal.suggestions:
            plan(applied(given_spec, suggestion))
        return
    est = planned.estimate
    on_gpu = GPU_TYPES[gpu].is_gpu
    slots = max_loras + (0 if on_gpu else max_loras + (extra_cpu or 0))
    dtype = DTYPE_BYTES[planned.status.dtype]
    assert est.lora_bytes == slots * slot_bytes(model, rank, tensor=1, dtype_bytes=dtype)
    used = est.weights_bytes + est.overhead_bytes + est.lora_bytes
    assert used + est.capacity_tokens * est.kv_bytes_per_token <= est.budget_bytes
    assert est.capacity_tokens >= planned.status.max_model_len
    # Without the slots there is at least as much KV cache.
    kwargs = {"dtype": planned.status.dtype, "backend": backend, "memory_bytes": est.memory_bytes}
    assert estimate(model, planned.gpu, **kwargs).capacity_tokens >= est.capacity_tokens
