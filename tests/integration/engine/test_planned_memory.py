"""The engine's sizing formulas (weights and KV per token, per rank) are exactly what it
allocates, and the planner's figures are those formulas: each rank's shard is loaded here as a
worker would load it, and measured."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tinymodels import arch_of, build_hf_model

from fleetllm.api.catalog import MODELS, ModelArch
from fleetllm.engine import sizing
from fleetllm.engine.config import ModelConfig
from fleetllm.engine.cpu_linear import packing_supported
from fleetllm.engine.model_runner import ModelRunner
from fleetllm.engine.parallel import TensorParallel
from fleetllm.engine.quantization import weight_bytes
from fleetllm.engine.worker import WorkerSpec, load_shard
from fleetllm.planner.memory import builtin_kv_bytes_per_token, builtin_weight_bytes

BLOCKS, BLOCK_SIZE = 3, 16


def measure(
    model_dir: Path, rank: int, size: int, dtype: str, weights: str, kv: str
) -> tuple[int, int]:
    """(weight bytes, KV bytes per token) of one rank, as the engine allocates them."""
    spec = WorkerSpec(
        model_dir=str(model_dir),
        dtype=getattr(torch, dtype),
        device="cpu",
        max_positions=64,
        batch_hint=1,
        block_size=BLOCK_SIZE,
        quantization=None if weights == "none" else weights,
        kv_cache_dtype=kv,
    )
    cpu = torch.device("cpu")
    model = load_shard(spec, TensorParallel(rank, size), cpu)
    runner = ModelRunner(model, model.config, BLOCKS, BLOCK_SIZE, spec.dtype, cpu, 64, kv)
    slots = (BLOCKS + 1) * BLOCK_SIZE  # with the null block
    assert runner.kv_cache_bytes % slots == 0
    return weight_bytes(model), runner.kv_cache_bytes // slots


def engine_formulas(
    model_dir: Path, size: int, dtype: str, weights: str, kv: str
) -> tuple[int, int]:
    """(weight bytes, KV bytes per token) of one rank by `fleetllm.engine.sizing`, from the
    checkpoint's own config as the engine reads it."""
    cfg = ModelConfig.from_pretrained(model_dir)
    arch = arch_of(model_dir)
    dtype_bytes = getattr(torch, dtype).itemsize
    quantization = None if weights == "none" else weights
    # The engine packs where the rule says so and oneDNN runs the dtype on this CPU.
    packed = sizing.packs_linears("cpu", quantization) and packing_supported(
        getattr(torch, dtype), torch.device("cpu")
    )
    weights_bytes = sizing.weight_bytes_per_rank(
        arch, tensor=size, dtype_bytes=dtype_bytes, quantization=quantization, packed=packed
    )
    kv_bytes = sizing.kv_bytes_per_token(
        num_layers=cfg.num_layers,
        num_kv_heads=cfg.num_kv_heads // size,
        head_dim=cfg.head_dim,
        kv_cache_dtype=kv,
        dtype_bytes=dtype_bytes,
    )
    return weights_bytes, kv_bytes


def planned_here(arch: ModelArch, size: int, dtype: str, weights: str) -> int:
    """The planner's weight bytes of a rank, where this CPU's oneDNN runs `dtype`. The planner
    takes a CPU node's oneDNN to run it (reordered linears: a copy of a tied head, and in
    float32 the plain weights kept beside); on a CPU where it does not, the engine keeps plain
    linears alone, as the formula without packing counts them."""
    if weights == "none" and not packing_supported(getattr(torch, dtype), torch.device("cpu")):
        return sizing.weight_bytes_per_rank(
            arch,
            tensor=size,
            dtype_bytes=getattr(torch, dtype).itemsize,
            quantization=None,
            packed=False,
        )
    return builtin_weight_bytes(arch, tensor=size, weights=weights, dtype=dtype, device="cpu")


@pytest.mark.parametrize(
    ("size", "dtype", "weights", "kv"),
    [
        (1, "float32", "none", "auto"),
        (1, "float32", "int8", "int8"),
        (3, "bfloat16", "none", "auto"),
        (3, "bfloat16", "int8", "int8"),
    ],
)
def test_smollm2_rank_figures_equal_the_planners(
    smollm2_dir: Path, size: int, dtype: str, weights: str, kv: str
) -> None:
    arch = MODELS["SmolLM2-135M"]
    # The vocabulary divides by 3, so every rank holds the same: rank 0 stands for all.
    got_weights, got_kv = measure(smollm2_dir, 0, size, dtype, weights, kv)
    assert (got_weights, got_kv) == engine_formulas(smollm2_dir, size, dtype, weights, kv)
    assert got_weights == planned_here(arch, size, dtype, weights)
    assert got_kv == builtin_kv_bytes_per_token(arch, tensor=size, kv_cache=kv, dtype=dtype)


def test_padded_vocabulary_shards_equal_the_planners(tmp_path: Path) -> None:
    """250 vocabulary rows over 3 ranks: 84 each, the last rank's 2 padding rows included;
    an untied head and biases on q/k/v."""
    config = {
        "vocab_size": 250,
        "hidden_size": 96,
        "intermediate_size": 132,
        "num_attention_heads": 6,
        "num_key_value_heads": 3,
        "tie_word_embeddings": False,
    }
    build_hf_model("qwen2", config).save_pretrained(tmp_path, safe_serialization=True)
    arch = arch_of(tmp_path)
    assert arch.qkv_bias and not arch.tied_embeddings
    for weights in ("none", "int8"):
        planned = planned_here(arch, 3, "float32", weights)
        formulas = engine_formulas(tmp_path, 3, "float32", weights, "auto")
        for rank in range(3):
            got = measure(tmp_path, rank, 3, "float32", weights, "auto")
            assert got == formulas, (weights, rank)
            assert got[0] == planned, (weights, rank)
