"""The sizing formulas against what the engine's allocation code makes: a layer's KV cache
in every storage type, and quantized matrices' scales."""

from __future__ import annotations

import pytest
import torch

from fleetllm.engine import kv_cache, sizing
from fleetllm.engine.config import EngineConfig
from fleetllm.engine.quantization import quantize_matrix
from fleetllm.planner.extra_args import parse_serve_args
from fleetllm.planner.memory import TUNING


@pytest.mark.parametrize("kv", ["auto", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_layers_kv_cache_takes_what_the_formula_counts(kv: str, dtype: torch.dtype) -> None:
    slots, heads, dim = 48, 3, 64
    k = kv_cache.allocate(slots, heads, dim, kv, dtype, torch.device("cpu"))
    per_token = sizing.kv_bytes_per_token(
        num_layers=1,
        num_kv_heads=heads,
        head_dim=dim,
        kv_cache_dtype=kv,
        dtype_bytes=dtype.itemsize,
    )
    # K and V of one layer.
    assert 2 * kv_cache.nbytes(k) == slots * per_token


@pytest.mark.parametrize("method", ["int8", "fp8"])
@pytest.mark.parametrize("columns", [96, 100])
def test_a_quantized_matrix_takes_what_the_formula_counts(method: str, columns: int) -> None:
    rows = 8
    m = quantize_matrix(torch.randn(rows, columns, dtype=torch.bfloat16), method)
    got = sum(t.nbytes for t in (m.values, m.scale, m.offset) if t is not None)
    # int8: a scale and an offset per group of a row; fp8: a scale per row.
    scales = rows * 2 * (columns // sizing.int8_group(columns)) if method == "int8" else rows
    assert m.values.element_size() == 1
    assert got == rows * columns + scales * sizing.WEIGHT_SCALE_BYTES


def test_a_steps_token_budget_is_the_devices_unless_given() -> None:
    assert parse_serve_args(["--model", "m"])["max_num_batched_tokens"] is None
    assert EngineConfig(model="m").step_token_budget == sizing.CPU_MAX_NUM_BATCHED_TOKENS == 512
    assert EngineConfig(model="m", device="cuda").step_token_budget == 2048
    assert EngineConfig(model="m", max_num_batched_tokens=96).step_token_budget == 96
    # What the planner gives its CPU replicas is the same fact.
    assert TUNING["cpu"].max_num_batched_tokens == sizing.CPU_MAX_NUM_BATCHED_TOKENS
