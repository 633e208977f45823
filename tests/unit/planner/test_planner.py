"""The capacity planner against figures computed by hand, and its invariants."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetllm.api.catalog import GPU_TYPES, MODELS, GPUType, ModelArch, find_model
from fleetllm.api.deployment import LLMDeploymentSpec
from fleetllm.planner.errors import PlanError
from fleetllm.planner.memory import estimate
from fleetllm.planner.plan import plan

MIB = 2**20
GIB = 2**30


def spec(**fields: Any) -> LLMDeploymentSpec:
    body: dict[str, Any] = {
        "model": {"name": "m", "source": "hf://meta-llama/Llama-3.1-8B"},
        "gpu": {"type": "H100-80GB"},
    }
    body.update(fields)
    return LLMDeploymentSpec.model_validate(body)


def refusal(**fields: Any) -> PlanError:
    with pytest.raises(PlanError) as caught:
        plan(spec(**fields))
    return caught.value


# Llama-3.1-8B: 32 layers, hidden 4096, 32 heads, 8 KV heads of 128, MLP 14336, vocab 128256.
LLAMA_8B_PARAMS = 8_030_261_248  # the published count


def test_catalog_parameter_counts_match_the_published_ones() -> None:
    assert MODELS["Llama-3.1-8B"].parameter_count() == LLAMA_8B_PARAMS
    assert MODELS["Llama-3.1-70B"].parameter_count() == 70_553_706_496
    assert MODELS["SmolLM2-135M"].parameter_count() == 134_515_008
    assert MODELS["Qwen2.5-7B"].parameter_count() == 7_615_616_512
    assert MODELS["Mistral-7B"].parameter_count() == 7_248_023_552


def test_models_are_found_by_whole_name_only() -> None:
    assert find_model("Qwen/Qwen2.5-72B-Instruct").name == "Qwen2.5-72B"
    assert find_model("Qwen/Qwen2.5-7B-Instruct").name == "Qwen2.5-7B"
    assert find_model("hugging-quants/Meta-Llama-3.1-8B-Instruct-AWQ-INT4").name == "Llama-3.1-8B"
    assert find_model("meta-llama/Llama-3.1-80B") is None


def test_llama_8b_fp16_on_h100_is_accepted_with_hand_computed_capacity() -> None:
    memory = 81559 * MIB  # H100 80GB HBM3 as the driver reports
    budget = memory * 92 // 100  # 80 GB class: 92% utilization
    weights = LLAMA_8B_PARAMS * 2  # bf16
    activations = 8192 * (4 * 4096 + 2 * 14336) * 2  # 8192 batched tokens, bf16
    logits = 512 * 128256 * 4  # 512 sequences, fp32 logits
    runtime = 3 * GIB // 4
    kv_per_token = 2 * 32 * 8 * 128 * 2  # K and V, layers, KV heads, head dim, bf16
    capacity = (budget - weights - activations - logits - runtime) // kv_per_token // 16 * 16

    result = plan(spec())
    s = result.status
    assert s.kv_bytes_per_token == kv_per_token == 131_072
    assert s.max_concurrent_tokens == capacity
    assert s.max_concurrent_sequences == capacity // 131_072 == 3
    assert s.max_model_len == 131_072
    assert s.weights_gib == round(weights / GIB, 2) == 14.96
    assert s.kv_cache_gib == round(capacity * kv_per_token / GIB, 2)
    assert s.num_kv_blocks == capacity // 16
    assert s.gpu_count == 1
    args = s.engine_args
    assert args[args.index("--num-kv-blocks") + 1] == str(capacity // 16)
    assert args[args.index("--max-model-len") + 1] == "131072"


def test_llama_8b_fp16_on_l4_is_refused_with_a_tensor_parallel_suggestion() -> None:
    memory = 23034 * MIB
    budget = memory * 90 // 100  # 24 GB class: 90%
    weights = LLAMA_8B_PARAMS * 2
    activations = 2048 * (4 * 4096 + 2 * 14336) * 2  # 2048 batched tokens
    logits = 256 * 128256 * 4
    runtime = 3 * GIB // 4
    capacity = (budget - weights - activations - logits - runtime) // 131_072 // 16 * 16
    assert capacity < 131_072

    error = refusal(gpu={"type": "L4"}, engine={"backend": "vllm"})
    assert error.reason == "KVCacheTooSmall"
    assert f"holds {capacity} tokens" in error.message
    assert "parallelism.tensor: 2 (2 x L4)" in error.suggestions
    # A margin below the capacity, so that an engine that measures a little less still starts.
    suggested = capacity * 9 // 10 // 256 * 256
    assert f"maxModelLen: {suggested} or less" in error.suggestions
    assert capacity * 0.85 < suggested <= capacity * 0.9
    accepted = plan(spec(gpu={"type": "L4"}, engine={"backend": "vllm"}, maxModelLen=suggested))
    assert accepted.status.max_concurrent_tokens >= suggested / 0.9
    # The suggestion is true: two L4s hold a full sequence.
    fixed = plan(spec(gpu={"type": "L4"}, engine={"backend": "vllm"}, parallelism={"tensor": 2}))
    assert fixed.status.max_concurrent_sequences >= 1
    # With a shorter context, 4-bit AWQ weights on one L4 fit.
    awq = plan(
        spec(
            gpu={"type": "L4"},
            engine={"backend": "vllm"},
            maxModelLen=32768,
            quantization={"weights": "awq"},
        )
    )
    assert awq.status.max_concurrent_sequences >= 1
    assert "--quantization" in awq.status.engine_args

    # The builtin engine splits a model over tensor-parallel ranks too, and the suggestion
    # holds for it as well.
    builtin = refusal(gpu={"type": "L4"})
    assert "parallelism.tensor: 2 (2 x L4)" in builtin.suggestions
    split = plan(spec(gpu={"type": "L4"}, parallelism={"tensor": 2}))
    assert split.status.max_concurrent_sequences >= 1
    assert split.args[split.args.index("--tensor-parallel-size") + 1] == "2"


def test_llama_70b_fp16_needs_four_h100s() -> None:
    params = 70_553_706_496
    memory = 81559 * MIB
    budget = memory * 92 // 100
    kv_heads_per_gpu = {2: 4, 4: 2}
    for tensor, fits in ((2, False), (4, True)):
        weights = math.ceil(params * 2 / tensor)
        activations = 8192 * (4 * 8192 + 2 * math.ceil(28672 / tensor)) * 2
        logits = 512 * 128256 * 4
        runtime = 3 * GIB // 4 + GIB // 4  # plus communication buffers
        kv_per_token = 2 * 80 * kv_heads_per_gpu[tensor] * 128 * 2
        capacity = (budget - weights - activations - logits - runtime) // kv_per_token // 16 * 16
        assert (capacity >= 131_072) is fits
        fields = {
            "model": {"name": "m", "source": "hf://meta-llama/Llama-3.1-70B-Instruct"},
            "engine": {"backend": "vllm"},
            "parallelism": {"tensor": tensor},
        }
        if fits:
            s = plan(spec(**fields)).status
            assert s.max_concurrent_tokens == capacity
            assert s.kv_bytes_per_token == kv_per_token == 81_920
            assert s.gpu_count == 4
            assert "--tensor-parallel-size" in s.engine_args
        else:
            error = refusal(**fields)
            assert error.reason == "KVCacheTooSmall"
            assert f"holds {capacity} tokens" in error.message
            assert "parallelism.tensor: 4 (4 x H100-80GB)" in error.suggestions


def test_llama_70b_on_one_h100_does_not_even_hold_the_weights() -> None:
    error = refusal(
        model={"name": "m", "source": "hf://meta-llama/Llama-3.1-70B"}, engine={"backend": "vllm"}
    )
    assert error.reason == "WeightsDoNotFit"
    assert "131.42 GiB per device" in error.message  # 70.55e9 x 2 bytes


def test_tensor_parallelism_must_divide_the_heads() -> None:
    error = refusal(engine={"backend": "vllm"}, parallelism={"tensor": 3})
    assert error.reason == "ParallelismMismatch"
    assert "32 attention heads, not divisible by tensor parallelism 3" in error.message
    assert "parallelism.tensor: 2" in error.suggestions


@pytest.mark.parametrize(
    ("fields", "reason", "words"),
    [
        ({"gpu": {"type": "V100"}}, "UnknownGPUType", "'V100' is not in the catalog"),
        (
            {"model": {"name": "m", "source": "hf://acme/secret-model"}},
            "UnknownModel",
            "set model.architecture",
        ),
        (
            {"model": {"name": "m", "source": "builtin://gpt-2"}},
            "UnknownModel",
            "not a built-in model",
        ),
        (
            {
                "gpu": {"type": "A100-80GB"},
                "engine": {"backend": "vllm"},
                "quantization": {"weights": "fp8"},
            },
            "UnsupportedQuantization",
            "fp8 needs an Ada, Hopper or Blackwell GPU",
        ),
        (
            {
                "gpu": {"type": "A10G"},
                "engine": {"backend": "vllm"},
                "quantization": {"kvCache": "fp8"},
            },
            "UnsupportedQuantization",
            "A10G is Ampere",
        ),
        (
            {"engine": {"backend": "vllm"}, "quantization": {"kvCache": "int8"}},
            "UnsupportedQuantization",
            "no int8 KV cache",
        ),
        (
            {"quantization": {"weights": "awq"}},
            "UnsupportedQuantization",
            "serves no awq checkpoints",
        ),
        ({"parallelism": {"pipeline": 2}}, "UnsupportedParallelism", "no pipeline parallelism"),
        (
            {"parallelism": {"tensor": 3}},
            "ParallelismMismatch",
            "Llama-3.1-8B's attention heads (32), KV heads (8) and intermediate size (14336) "
            "are not divisible by tensor parallelism 3",
        ),
        (
            {
                "gpu": {"type": "cpu"},
                "engine": {"backend": "vllm", "extraArgs": ["--kv_cache_memory_bytes=1000000"]},
            },
            "InvalidEngineArgs",
            "--kv-cache-memory-bytes, which the planner owns on a CPU",
        ),
        (
            {
                "gpu": {"type": "cpu"},
                "engine": {
                    "backend": "vllm",
                    "env": [{"name": "VLLM_CPU_KVCACHE_SPACE", "value": "4"}],
                },
            },
            "InvalidEngineEnv",
            "would override the planned --kv-cache-memory-bytes",
        ),
        (
            {"engine": {"backend": "vllm"}, "parallelism": {"tensor": 8, "pipeline": 2}},
            "UnsupportedParallelism",
            "at most 8",
        ),
        ({"maxModelLen": 200_000}, "MaxModelLenTooLong", "131072 tokens"),
        (
            {"gpu": {"type": "T4"}, "engine": {"dtype": "bfloat16"}, "maxModelLen": 4096},
            "UnsupportedDtype",
            "T4 (Turing) has no bfloat16",
        ),
        (
            {"gpu": {"type": "A10G", "nodeSelectorProfile": "gke"}},
            "NoNodeLabelForGPU",
            "gke node-selector profile has no label for gpu.type A10G",
        ),
        (
            {"engine": {"extraArgs": ["--max-model-len=4096"]}},
            "InvalidEngineArgs",
            "use maxModelLen",
        ),
        (
            {"engine": {"extraArgs": ["--max-num-seqs", "8"]}},
            "InvalidEngineArgs",
            "use engine.maxNumSeqs",
        ),
    ],
)
def test_refusals_name_the_reason(fields: dict[str, Any], reason: str, words: str) -> None:
    error = refusal(**fields)
    assert error.reason == reason
    assert words in error.message


@pytest.mark.parametrize("backend", ["builtin", "vllm"])
def test_engine_max_num_seqs_caps_the_planned_sequences(backend: str) -> None:
    gpu = {"gpu": {"type": "H100-80GB"}} if backend == "vllm" else {"gpu": {"type": "cpu"}}
    model = {"name": "m", "source": "builtin://smollm2-135m"} if backend == "builtin" else None
    base = {**gpu, "engine": {"backend": backend}, **({"model": model} if model else {})}
    planned = plan(spec(**base)).status
    assert planned.max_num_seqs > 4
    capped = plan(spec(**{**base, "engine": {"backend": backend, "maxNumSeqs": 4}})).status
    assert capped.max_num_seqs == 4
    args = capped.engine_args
    assert args[args.index("--max-num-seqs") + 1] == "4"
    assert capped.max_num_batched_tokens == planned.max_num_batched_tokens
    # A bound above the plan changes nothing: the plan is what the cache holds.
    loose = {"backend": backend, "maxNumSeqs": planned.max_num_seqs + 100}
    assert plan(spec(**{**base, "engine": loose})).status == planned
    with pytest.raises(ValueError, match="maxNumSeqs"):
        spec(**{**base, "engine": {"backend": backend, "maxNumSeqs": 0}})


def test_fp8_is_planned_on_ada_and_hopper() -> None:
    for gpu in ("L4", "H100-80GB"):
        s = plan(
            spec(
                gpu={"type": gpu},
                engine={"backend": "vllm"},
                maxModelLen=8192,
                quantization={"weights": "fp8", "kvCache": "fp8"},
            )
        ).status
        assert s.kv_cache_dtype == "fp8"
        assert s.kv_bytes_per_token == 2 * 32 * 8 * 128 * 1
        assert s.engine_args[s.engine_args.index("--quantization") + 1] == "fp8"
        assert s.engine_args[s.engine_args.index("--kv-cache-dtype") + 1] == "fp8"


def test_cpu_replicas_size_the_kv_cache_from_the_pod_memory_limit() -> None:
    small = spec(model={"name": "s", "source": "builtin://smollm2-135m"}, gpu={"type": "cpu"})
    large = spec(
        model={"name": "s", "source": "builtin://smollm2-135m"},
        gpu={"type": "cpu"},
        pod={"resources": {"limits": {"memory": "8Gi"}}},
    )
    small_plan, large_plan = plan(small), plan(large)
    assert small_plan.status.dtype == "float32"
    assert small_plan.status.kv_bytes_per_token == 2 * 30 * 3 * 64 * 4
    assert large_plan.status.device_memory_gib == 8.0
    assert large_plan.status.num_kv_blocks > small_plan.status.num_kv_blocks
    args = small_plan.args
    assert args[args.index("--model") + 1] == "smollm2-135m"


def test_inline_config_sizes_a_model_outside_the_catalog() -> None:
    config = {
        "numLayers": 32,
        "hiddenSize": 4096,
        "numHeads": 32,
        "numKVHeads": 8,
        "vocabSize": 128256,
        "maxPositionEmbeddings": 131072,
        "intermediateSize": 14336,
    }
    s = plan(spec(model={"name": "m", "source": "s3://bucket/llama", "config": config})).status
    assert s.weights_gib == plan(spec()).status.weights_gib
    assert s.max_concurrent_tokens == plan(spec()).status.max_concurrent_tokens


def test_vllm_arguments() -> None:
    s = plan(
        spec(
            model={"name": "llama", "source": "hf://meta-llama/Llama-3.1-8B@abc123"},
            engine={"backend": "vllm"},
            maxModelLen=16384,
        )
    ).status
    args = s.engine_args
    # `vllm serve MODEL`: the weights are pulled into the model cache first, then loaded
    # from there (no hub access from vLLM).
    assert s.backend == "vllm" and s.device == "cuda"
    assert args[0] == "/var/lib/fleetllm/models/hf/meta-llama/Llama-3.1-8B/abc123"
    assert "--model" not in args and "--revision" not in args
    for flag, value in [
        ("--shutdown-timeout", "60"),
        ("--served-model-name", "llama"),
        ("--tensor-parallel-size", "1"),
        ("--pipeline-parallel-size", "1"),
        ("--gpu-memory-utilization", "0.92"),
        ("--max-num-seqs", str(s.max_num_seqs)),
        ("--max-num-batched-tokens", str(s.max_num_batched_tokens)),
    ]:
        assert args[args.index(flag) + 1] == value, flag
    assert "--enable-prefix-caching" in args
    assert s.max_num_batched_tokens >= s.max_num_seqs


# -- properties -----------------------------------------------------------------------------

archs = st.builds(
    lambda layers, kv, group, head_dim, inter_mult, vocab, tied: ModelArch(
        name="random",
        num_layers=layers,
        hidden_size=kv * group * head_dim,
        num_heads=kv * group,
        num_kv_heads=kv,
        head_dim=head_dim,
        vocab_size=vocab,
        max_position=131072,
        intermediate_size=kv * group * head_dim * inter_mult,
        tied_embeddings=tied,
    ),
    st.integers(1, 96),
    st.sampled_from([1, 2, 4, 8]),
    st.sampled_from([1, 2, 4, 8]),
    st.sampled_from([64, 128]),
    st.integers(2, 5),
    st.integers(1000, 200_000),
    st.booleans(),
) | st.sampled_from(list(MODELS.values()))
gpus = st.sampled_from([g for g in GPU_TYPES.values() if g.is_gpu])


@settings(max_examples=300, deadline=None)
@given(
    arch=archs,
    gpu=gpus,
    tensor=st.sampled_from([1, 2, 4, 8]),
    weights=st.sampled_from(["none", "int8", "awq"]),
    kv_cache=st.sampled_from(["auto", "fp8"]),
    memory=st.integers(1 * GIB, 200 * GIB),
    extra=st.integers(0, 100 * GIB),
)
def test_more_memory_never_lowers_capacity(
    arch: ModelArch, gpu: GPUType, tensor: int, weights: str, kv_cache: str, memory: int, extra: int
) -> None:
    kwargs = {"tensor": tensor, "weights": weights, "kv_cache": kv_cache}
    smaller = estimate(arch, gpu, memory_bytes=memory, **kwargs)
    larger = estimate(arch, gpu, memory_bytes=memory + extra, **kwargs)
    assert larger.capacity_tokens >= smaller.capacity_tokens


@settings(max_examples=300, deadline=None)
@given(
    model=st.sampled_from(list(MODELS.values())),
    gpu=gpus,
    tensor=st.sampled_from([1, 2, 4, 8]),
    weights=st.sampled_from(["none", "int8", "awq"]),
    kv_cache=st.sampled_from(["auto", "fp8"]),
    context=st.integers(16, 1 << 17),
)
def test_refused_for_size_exactly_when_capacity_is_below_one_sequence(
    model: ModelArch, gpu: GPUType, tensor: int, weights: str, kv_cache: str, context: int
) -> None:
    context = min(context, model.max_position)
    body = spec(
        model={"name": "m", "source": "s3://b/m", "architecture": model.name},
        gpu={"type": gpu.name},
        engine={"backend": "vllm"},
        maxModelLen=context,
        parallelism={"tensor": tensor},
        quantization={"weights": weights, "kvCache": kv_cache},
    )
    try:
        result = plan(body)
    except PlanError as exc:
        if exc.reason not in ("WeightsDoNotFit", "KVCacheTooSmall"):
            return  # refused for a reason unrelated to size (e.g. fp8 on Ampere)
        est = estimate(model, gpu, tensor=tensor, weights=weights, kv_cache=kv_cache)
        assert est.capacity_tokens < context
    else:
        assert result.status.max_concurrent_tokens >= context
        assert result.status.max_concurrent_sequences >= 1
        assert 1 <= result.status.max_num_seqs <= result.status.max_num_batched_tokens


def test_builtin_tensor_parallel_and_int8_are_planned_and_rendered_as_engine_flags() -> None:
    smol = {"name": "s", "source": "builtin://smollm2-135m"}
    base = plan(spec(model=smol, gpu={"type": "cpu"}, maxModelLen=8192)).status
    split = plan(
        spec(
            model=smol,
            gpu={"type": "cpu"},
            maxModelLen=8192,
            parallelism={"tensor": 3},
            quantization={"weights": "int8", "kvCache": "int8"},
            speculative={"numSpeculativeTokens": 4, "promptLookupMax": 3},
        )
    ).status
    args = split.engine_args
    flag = {name: args[args.index(name) + 1] for name in args if name.startswith("--")}
    assert flag["--tensor-parallel-size"] == "3"
    assert flag["--quantization"] == "int8"
    assert flag["--kv-cache-dtype"] == "int8"
    assert json.loads(flag["--speculative-config"]) == {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_max": 3,
        "prompt_lookup_min": 1,
    }
    # The three ranks share the pod's memory: the figures add up over them. An int8 token
    # keeps one byte per value and a float32 scale per KV head: (64 + 4) x 3 heads x 2 x 30.
    assert split.kv_bytes_per_token == 2 * 30 * 3 * (64 + 4)
    assert base.kv_bytes_per_token == 2 * 30 * 3 * 64 * 4
    assert split.weights_gib < base.weights_gib / 3.5
    assert split.kv_cache_dtype == "int8" and split.weights == "int8"
    # Defaults leave the flags out: the engine's own defaults are the same.
    assert "--tensor-parallel-size" not in base.engine_args
    assert "--quantization" not in base.engine_args
    assert "--speculative-config" not in base.engine_args


def test_builtin_tensor_parallel_on_gpus_is_sized_per_device() -> None:
    one = plan(spec(gpu={"type": "L4"}, maxModelLen=32768)).estimate
    two = plan(spec(gpu={"type": "L4"}, maxModelLen=32768, parallelism={"tensor": 2})).estimate
    assert two.kv_bytes_per_token == one.kv_bytes_per_token // 2  # 4 of the 8 KV heads each
    # Half of every projection and of the vocabulary; the norms on both.
    assert one.weights_bytes / 2 < two.weights_bytes < one.weights_bytes / 2 * 1.001
    assert two.capacity_tokens > 2 * one.capacity_tokens


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        (
            {"parallelism": {"tensor": 2}, "gpu": {"type": "cpu"},
             "model": {"name": "s", "source": "builtin://smollm2-135m"}},
            "SmolLM2-135M's attention heads (9) and KV heads (3) are not divisible by tensor "
            "parallelism 2 (the builtin engine splits them evenly over its ranks)",
        ),
        (
            {"parallelism": {"tensor": 8}, "model": {"name": "q", "source": "hf://Qwen/Qwen2.5-7B"}},
            "Qwen2.5-7B's attention heads (28) and KV heads (4) are not divisible by tensor "
            "parallelism 8",
        ),
        ({"quantization": {"weights": "gptq"}}, "serves no gptq checkpoints"),
        (
            {"gpu": {"type": "cpu"}, "quantization": {"weights": "fp8"}},
            "fp8 needs an Ada, Hopper or Blackwell GPU",
        ),
    ],
)  # fmt: skip
def test_what_the_builtin_engine_cannot_split_or_load_is_refused(
    fields: dict[str, Any], words: str
) -> None:
    error = refusal(**fields)
    assert words in error.message


def test_speculative_lookup_bounds_are_checked() -> None:
    with pytest.raises(ValueError, match="promptLookupMin 4 exceeds promptLookupMax 2"):
        spec(speculative={"numSpeculativeTokens": 2, "promptLookupMax": 2, "promptLookupMin": 4})


def test_the_builtin_engines_waiting_queue_is_bounded_and_vllms_has_no_such_flag() -> None:
    builtin = plan(
        spec(model={"name": "smol", "source": "builtin://smollm2-135m"}, gpu={"type": "cpu"})
    )
    args = list(builtin.args)
    seqs = int(args[args.index("--max-num-seqs") + 1])
    bound = int(args[args.index("--max-waiting-requests") + 1])
    assert bound >= seqs and bound >= 16
    vllm = plan(spec(engine={"backend": "vllm"}))
    assert "--max-waiting-requests" not in vllm.args
