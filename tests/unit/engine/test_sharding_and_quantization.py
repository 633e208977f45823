"""Tensor-parallel splits and refusals, weight and KV quantization numerics, without a model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fleetllm.cli import main
from fleetllm.engine import kv_cache
from fleetllm.engine.config import EngineConfig, ModelConfig
from fleetllm.engine.parallel import TensorParallel, check_tensor_parallel
from fleetllm.engine.quantization import (
    QuantizedLinear,
    check_quantization,
    quantize_matrix,
    scale_dtype,
)
from fleetllm.engine.sizing import INT8_GROUP, kv_bytes_per_token

SMOLLM2_CONFIG: dict[str, object] = {
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
}
SMOLLM2 = ModelConfig.from_dict(SMOLLM2_CONFIG)


def test_tensor_parallel_sizes_that_do_not_divide_are_refused_clearly() -> None:
    check_tensor_parallel(SMOLLM2, 1)
    check_tensor_parallel(SMOLLM2, 3)
    with pytest.raises(ValueError) as caught:
        check_tensor_parallel(SMOLLM2, 2)
    assert str(caught.value) == (
        "tensor_parallel_size=2 does not divide the model's attention heads (9) and KV heads "
        "(3); sizes that divide them all: 3"
    )
    odd_mlp = ModelConfig.from_dict({**SMOLLM2_CONFIG, "intermediate_size": 1537})
    with pytest.raises(ValueError, match=r"intermediate size \(1537\); no size above 1"):
        check_tensor_parallel(odd_mlp, 3)
    with pytest.raises(ValueError, match="must be >= 1"):
        check_tensor_parallel(SMOLLM2, 0)


@pytest.mark.parametrize(("vocab", "size"), [(256, 2), (250, 3), (49152, 3), (7, 4)])
def test_vocab_shards_cover_the_vocabulary_once_in_equal_row_counts(vocab: int, size: int) -> None:
    splits = [TensorParallel(rank, size).vocab_split(vocab) for rank in range(size)]
    rows = {r for _, _, r in splits}
    assert len(rows) == 1  # equal shards gather evenly
    covered = [i for start, end, _ in splits for i in range(start, end)]
    assert covered == list(range(vocab))
    assert all(end - start <= r for start, end, r in splits)


def test_engine_options_are_validated_by_name() -> None:
    for field, value, words in [
        ("tensor_parallel_size", 0, "tensor_parallel_size must be >= 1"),
        ("quantization", "awq", "quantization 'awq' is not supported; use int8, fp8"),
        ("kv_cache_dtype", "fp16", "kv_cache_dtype 'fp16' is not supported"),
        ("speculative_config", '{"method": "eagle"}', "method 'eagle' is not supported"),
    ]:
        with pytest.raises(ValueError) as caught:
            EngineConfig(model="m", **{field: value}).validate()
        assert words in str(caught.value)
    config = EngineConfig(model="m", quantization="none", speculative_config="{}")
    config.validate()
    assert config.quantization is None and config.speculative_config is None


def test_fp8_is_refused_without_a_gpu_that_has_it() -> None:
    cpu = torch.device("cpu")
    check_quantization("int8", cpu)
    with pytest.raises(ValueError, match=r"fp8 support .* use quantization='int8' here"):
        check_quantization("fp8", cpu)
    kv_cache.check_kv_cache_dtype("int8", cpu)
    with pytest.raises(ValueError, match="use kv_cache_dtype='int8' here"):
        kv_cache.check_kv_cache_dtype("fp8", cpu)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_error_is_half_a_step_of_each_groups_own_range(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    # Rows of very different size, and inside a row groups of very different size too.
    w = torch.randn(64, 96) * torch.logspace(-2, 1, 64)[:, None]
    w[:, :INT8_GROUP] *= 0.1
    w[:, -INT8_GROUP:] += 1.0  # a group far from zero: its offset carries it
    w[5] = 0.0
    w = w.to(dtype)
    m = quantize_matrix(w, "int8")
    assert m.values.dtype == torch.int8 and m.group == INT8_GROUP
    assert m.scale.shape == m.offset.shape == (96 // INT8_GROUP, 64)
    assert m.scale.dtype == m.offset.dtype == scale_dtype(dtype) != torch.float32
    back = m.dequantize(torch.float32).t()
    grouped = w.float().view(64, -1, INT8_GROUP)
    step = (grouped.amax(-1) - grouped.amin(-1)) / 255
    err = (back - w.float()).abs().view(64, -1, INT8_GROUP).amax(-1)
    # Half a step of the group's own range, plus what 16-bit scales and offsets round off.
    rounding = 2.0 ** -(8 if dtype == torch.bfloat16 else 10)
    middle = (grouped.amax(-1) + grouped.amin(-1)).abs() / 2
    assert (err <= step * (0.5 + rounding) + middle * rounding + 1e-7).all()
    assert (back[5] == 0).all()
    # With one scale per row, the small group would round to half of the row's step.
    row_half_step = w.float().abs().amax(-1) / 127 / 2
    assert (err[:, 0] <= row_half_step / 4).all()


def test_int8_represents_4_bit_blocks_of_32_exactly() -> None:
    """A GGUF Q4_1-style matrix (per block of 32: a minimum plus 0..15 steps) comes back
    to 16-bit rounding of its scale: nothing of the 8 bits is lost to a wider range."""
    torch.manual_seed(0)
    blocks = torch.randint(0, 16, (8, 4, INT8_GROUP)).float()
    blocks[..., 0], blocks[..., 1] = 0, 15  # each block spans its whole range
    step, low = torch.rand(8, 4, 1) * 0.01, torch.randn(8, 4, 1) * 0.05
    w = (low + blocks * step).view(8, -1)
    back = quantize_matrix(w, "int8").dequantize(torch.float32).t()
    assert torch.allclose(back, w, atol=float(step.max()) * 0.02)


def test_a_row_that_32_does_not_divide_is_one_group() -> None:
    m = quantize_matrix(torch.randn(4, 70), "int8")
    assert m.group == 70 and m.scale.shape == (1, 4)


def test_fp8_error_is_bounded_by_the_row_scale() -> None:
    torch.manual_seed(0)
    w = torch.randn(64, 48) * torch.logspace(-2, 1, 64)[:, None]
    w[5] = 0.0
    m = quantize_matrix(w, "fp8")
    assert m.values.dtype == torch.float8_e4m3fn and m.offset is None
    assert m.scale.shape == (1, 64)
    back = m.dequantize(torch.float32).t()
    row_max = w.abs().amax(dim=1, keepdim=True)
    assert ((back - w).abs() <= row_max / 8 + 1e-6).all()  # e4m3: 3 mantissa bits
    assert (back[5] == 0).all()


@pytest.mark.parametrize(
    ("method", "dtype"),
    [("int8", torch.float32), ("int8", torch.bfloat16), ("fp8", torch.float32)],
)
def test_quantized_linear_equals_the_dequantized_matmul(method: str, dtype: torch.dtype) -> None:
    """fp8 runs on GPUs only in the engine; its arithmetic is the same here."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 40, bias=True)
    m = quantize_matrix(linear.weight.to(dtype), method)
    module = QuantizedLinear(m, torch.nn.Parameter(linear.bias.detach().to(dtype)))
    x = torch.randn(3, 5, 64, dtype=dtype)
    reference = torch.nn.functional.linear(
        x.float(), m.dequantize(torch.float32).t(), linear.bias.detach()
    )
    got = module(x)
    assert got.shape == (3, 5, 40) and got.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 0.05
    assert torch.allclose(got.float(), reference, atol=tol, rtol=tol)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_quantized_kv_cache_reads_back_what_was_written(kind: str) -> None:
    torch.manual_seed(0)
    bs, heads, dim = 4, 2, 16
    cache = kv_cache.allocate(5 * bs, heads, dim, kind, torch.float32, torch.device("cpu"))
    plain = kv_cache.allocate(5 * bs, heads, dim, "auto", torch.float32, torch.device("cpu"))
    for c in (cache, plain):
        kv_cache.zero(c, slice(0, 5 * bs))
    slots = torch.tensor([4, 5, 6, 13, 19])
    x = torch.randn(5, heads, dim) * torch.tensor([0.01, 3.0])[None, :, None]
    kv_cache.write(cache, slots, x)
    kv_cache.write(plain, slots, x)
    got = kv_cache.select_slots(cache, slots, torch.float32)
    # Each (token, head) has its own scale: a small head keeps its precision.
    bound = 1 / 254 if kind == "int8" else 1 / 8  # half a step / 3 mantissa bits
    rel = (got - x).abs().amax(dim=-1) / x.abs().amax(dim=-1)
    assert (rel <= bound + 1e-6).all()
    blocks = torch.tensor([1, 3, 4, 0])
    gathered = kv_cache.gather_blocks(cache, blocks, 2, bs, torch.float32)
    expected = kv_cache.gather_blocks(plain, blocks, 2, bs, torch.float32)
    assert gathered.shape == expected.shape == (2, 2 * bs, heads, dim)
    row_max = expected.abs().amax(dim=-1, keepdim=True)
    assert ((gathered - expected).abs() <= bound * row_max + 1e-6).all()
    assert (gathered[1, bs:] == 0).all()  # the zeroed null block reads as zeros
    # One byte per value plus a float32 scale per token and head, for K and for V: the
    # cache (K here, V alike) allocates what the sizing formula counts.
    per_token = kv_bytes_per_token(
        num_layers=1, num_kv_heads=heads, head_dim=dim, kv_cache_dtype=kind, dtype_bytes=4
    )
    assert per_token == 2 * heads * (dim + 4)
    assert 2 * kv_cache.nbytes(cache) == 5 * bs * per_token


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["-tp", "2"], "tensor_parallel_size=2 does not divide the model's attention heads (9)"),
        (["-tp", "0"], "tensor_parallel_size must be >= 1, got 0"),
        (["-tp", "4096"], "sizes that divide them all: 3"),
        (["--quantization", "fp8"], "quantization='fp8' needs a CUDA GPU with fp8 support"),
        (["--kv-cache-dtype", "fp8"], "use kv_cache_dtype='int8' here"),
        (["--speculative-config", "{bad"], "speculative_config is not valid JSON"),
        (
            ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": NaN}'],
            "num_speculative_tokens must be an integer >= 1, got nan",
        ),
    ],
)
def test_serve_refuses_bad_engine_options_before_binding(
    smollm2_dir: Path, flags: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each refusal is one message and exit status 2, before a port is bound or a weight read."""
    argv = ["engine", "serve", "--model", str(smollm2_dir), "--port", "0", *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("fleetllm: error: ") and words in err
    assert "Traceback" not in err
