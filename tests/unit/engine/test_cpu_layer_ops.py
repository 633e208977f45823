"""The CPU kernels of a layer's elementwise steps (RMSNorm with the residual add, rotary
embedding, SiLU-and-mul) against the torch reference, on any batch, and their input checks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetllm.engine import cpu_kernels
from fleetllm.engine.layer_ops import CpuLayerOps, TorchLayerOps

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# float32: the sum of squares and exp differ from torch's in the order and the last bit;
# bfloat16 and float16: one rounding of the result may land on the other side.
ULPS = {torch.float32: 4e-6, torch.bfloat16: 2**-7, torch.float16: 2**-10}
REFERENCE = TorchLayerOps()


@pytest.fixture(scope="module")
def ops() -> CpuLayerOps:
    kernel = cpu_kernels.load_kernel()
    assert kernel is not None, "the kernels did not build: see the warning logged above"
    return CpuLayerOps(kernel)


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, roundings: int = 1) -> bool:
    """Within `roundings` roundings of the model dtype, at the scale of the values (about
    1)."""
    got, want = got.double(), want.double()
    return bool(((got - want).abs() <= roundings * ULPS[dtype] * (want.abs() + 1)).all())


def padded(rows: int, width: int, pad: int, dtype: torch.dtype, gen: torch.Generator):
    """[rows, width] random rows inside a [rows, width + pad] buffer whose padding is NaN: a
    kernel that reads or writes past a row's width shows."""
    buffer = torch.full((rows, width + pad), float("nan"), dtype=dtype)
    buffer[:, :width] = torch.randn(rows, width, generator=gen).to(dtype)
    return buffer, buffer[:, :width]


shapes = st.fixed_dictionaries(
    {
        "rows": st.integers(1, 70),
        "dtype": st.sampled_from(DTYPES),
        "seed": st.integers(0, 2**16),
        "pad": st.sampled_from([0, 1, 7]),
    }
)


@settings(max_examples=40, deadline=None)
@given(shape=shapes, width=st.integers(1, 600), first_layer=st.booleans())
def test_rms_norm_matches_the_reference(ops, shape, width, first_layer):
    dtype, gen = shape["dtype"], torch.Generator().manual_seed(shape["seed"])
    buffer, x = padded(shape["rows"], width, shape["pad"], dtype, gen)
    residual = None if first_layer else torch.randn(shape["rows"], width, generator=gen).to(dtype)
    weight = torch.randn(width, generator=gen).to(dtype)
    want, want_residual = REFERENCE.rms_norm(
        x.clone(), None if residual is None else residual.clone(), weight, 1e-5
    )
    before = x.clone()
    got, got_residual = ops.rms_norm(x, residual, weight, 1e-5)
    # Two roundings in the model dtype: the normalised value, then its product with the
    # weight; each may land on the other side (float16, 43 rows of 536, seed 14707: 2 ulps).
    assert close(got, want, dtype, roundings=2)
    # The stream after the add: exact, one rounding of the same sum.
    assert torch.equal(got_residual, want_residual)
    if first_layer:
        assert torch.equal(got_residual, before)  # the input is the stream, untouched
    assert buffer[:, width:].isnan().all()


@settings(max_examples=40, deadline=None)
@given(
    shape=shapes,
    kv_heads=st.integers(1, 3),
    group=st.integers(1, 4),
    half_dim=st.integers(1, 40),
    max_positions=st.integers(1, 300),
)
def test_rotary_matches_the_reference(ops, shape, kv_heads, group, half_dim, max_positions):
    dtype, gen = shape["dtype"], torch.Generator().manual_seed(shape["seed"])
    heads, dim = kv_heads * group, 2 * half_dim
    buffer, qkv = padded(shape["rows"], (heads + 2 * kv_heads) * dim, shape["pad"], dtype, gen)
    angles = torch.rand(max_positions, half_dim, generator=gen) * 100
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    positions = torch.randint(0, max_positions, (shape["rows"],), generator=gen)
    want = REFERENCE.rotary(
        qkv.clone(), REFERENCE.rope_context(cos, sin, positions, dtype), heads, kv_heads, dim
    )
    got = ops.rotary(qkv, ops.rope_context(cos, sin, positions, dtype), heads, kv_heads, dim)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        assert close(g, w, dtype)
    assert torch.equal(got[2], want[2])  # values pass through untouched
    assert buffer[:, qkv.shape[1] :].isnan().all()


@settings(max_examples=40, deadline=None)
@given(shape=shapes, width=st.integers(1, 700))
def test_silu_and_mul_matches_the_reference(ops, shape, width):
    dtype, gen = shape["dtype"], torch.Generator().manual_seed(shape["seed"])
    gate_up = (torch.randn(shape["rows"], 2 * width, generator=gen) * 4).to(dtype)
    got = ops.silu_and_mul(gate_up)
    assert got.shape == (shape["rows"], width)
    assert close(got, REFERENCE.silu_and_mul(gate_up), dtype)


def test_inputs_that_would_read_outside_their_tensors_are_errors(ops):
    kernel = ops.kernel
    x, residual, weight = torch.randn(4, 8), torch.randn(4, 8), torch.randn(8)
    qkv, positions = torch.randn(4, (2 + 2 * 1) * 4), torch.tensor([0, 1, 2, 3])
    cos, sin = torch.randn(4, 4), torch.randn(4, 4)
    norm_cases = {
        "weight of another width": ((x, residual, torch.randn(9), 1e-5), "weight must be"),
        "residual of another shape": ((x, torch.randn(3, 8), weight, 1e-5), "residual must be"),
        "residual of another dtype": ((x, residual.double(), weight, 1e-5), "residual must be"),
        "residual is x": ((x, x, weight, 1e-5), "different tensors"),
        "strided rows": ((torch.randn(8, 4).t(), None, torch.randn(8), 1e-5), "contiguous rows"),
        "three dimensions": ((torch.randn(2, 2, 8), None, weight, 1e-5), "contiguous rows"),
        "integer x": ((x.long(), None, weight.long(), 1e-5), "float32, bfloat16 or float16"),
        "non-finite eps": ((x, None, weight, float("nan")), "eps must be"),
        "negative eps": ((x, None, weight, -1.0), "eps must be"),
    }
    for name, (args, message) in norm_cases.items():
        with pytest.raises(RuntimeError, match=message):
            kernel.add_rms_norm(*args)
        assert name
    rotary_cases = {
        "position past the tables": ((qkv, torch.tensor([0, 1, 2, 4]), cos, sin), "outside"),
        "negative position": ((qkv, torch.tensor([0, -1, 2, 3]), cos, sin), "outside"),
        "positions of another batch": ((qkv, positions[:3], cos, sin), "positions must be"),
        "int32 positions": ((qkv, positions.int(), cos, sin), "positions must be"),
        "tables of another head size": ((qkv, positions, cos[:, :2], sin[:, :2]), "cos and sin"),
        "bfloat16 tables": ((qkv, positions, cos.bfloat16(), sin.bfloat16()), "cos and sin"),
        "tables of different lengths": ((qkv, positions, cos, sin[:2]), "cos and sin"),
        "qkv of another width": ((torch.randn(4, 15), positions, cos, sin), "qkv's width"),
    }
    for name, (args, message) in rotary_cases.items():
        with pytest.raises(RuntimeError, match=message):
            kernel.rotary_qk(*args, 2, 1, 4)
        assert name
    with pytest.raises(RuntimeError, match="dim a positive even"):
        kernel.rotary_qk(torch.randn(4, 12), positions, cos[:, :3], sin[:, :3], 2, 1, 3)
    with pytest.raises(RuntimeError, match="gate_up must be"):
        kernel.silu_and_mul(torch.randn(4, 7))
    with pytest.raises(RuntimeError, match="gate_up must be"):
        kernel.silu_and_mul(torch.randn(8, 4).t())
