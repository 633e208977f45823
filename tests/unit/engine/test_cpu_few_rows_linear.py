"""The float32 few-rows linear kernel against a float64 reference, on any shape, and its input
checks; and the packed layers that run few rows on it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from fleetllm.engine.cpu_linear import (
    FEW_ROWS,
    PackedLinear,
    packing_supported,
    use_few_rows_kernel,
)


def followed_by_nan(rows: int, width: int, gen: torch.Generator) -> torch.Tensor:
    """A contiguous [rows, width] of random values whose memory is followed by a row of NaN:
    a kernel that reads past the tensor's end shows."""
    buffer = torch.full((rows + 1, width), float("nan"))
    buffer[:rows] = torch.randn(rows, width, generator=gen)
    return buffer[:rows]


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 2 * FEW_ROWS + 1),
    inputs=st.integers(1, 700),
    outputs=st.integers(1, 300),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_few_rows_match_a_float64_reference(kernel, rows, inputs, outputs, bias, seed):
    gen = torch.Generator().manual_seed(seed)
    x = followed_by_nan(rows, inputs, gen)
    weight = followed_by_nan(outputs, inputs, gen)
    b = followed_by_nan(1, outputs, gen)[0] if bias else None
    got = kernel.few_rows_linear(x, weight, b)
    assert got.shape == (rows, outputs) and got.dtype == torch.float32
    want = x.double() @ weight.double().T
    scale = x.double().abs() @ weight.double().abs().T  # what rounding errors scale with
    if b is not None:
        want += b.double()
        scale += b.double().abs()
    assert bool(((got.double() - want).abs() <= 1e-5 * scale + 1e-6).all())


def test_no_rows_give_no_rows(kernel):
    assert kernel.few_rows_linear(torch.empty(0, 8), torch.randn(3, 8), None).shape == (0, 3)


def test_inputs_the_kernel_cannot_read_are_errors(kernel):
    x, weight, bias = torch.randn(2, 8), torch.randn(5, 8), torch.randn(5)
    cases = {
        "bfloat16 x": ((x.bfloat16(), weight, None), "float32"),
        "float64 weight": ((x, weight.double(), None), "float32"),
        "three dimensions": ((x[None], weight, None), "2-D"),
        "strided x": ((torch.randn(8, 2).t(), weight, None), "contiguous"),
        "strided weight": ((x, torch.randn(8, 5).t(), None), "contiguous"),
        "x of another width": ((torch.randn(2, 7), weight, None), "columns"),
        "bias of another size": ((x, weight, torch.randn(4)), "bias must be"),
        "float64 bias": ((x, weight, bias.double()), "bias must be"),
        "bias of two dimensions": ((x, weight, bias[None]), "bias must be"),
    }
    for name, (args, message) in cases.items():
        with pytest.raises(RuntimeError, match=message):
            kernel.few_rows_linear(*args)
        assert name


@pytest.mark.skipif(
    not packing_supported(torch.float32, torch.device("cpu")),
    reason="oneDNN does not run float32 matmuls on this CPU",
)
@pytest.mark.parametrize("bias", [False, True])
def test_packed_float32_layers_run_few_rows_on_the_kernel(kernel, monkeypatch, bias):
    torch.manual_seed(0)
    linear = nn.Linear(96, 160, bias=bias)
    model = nn.Sequential(PackedLinear(linear, batch_hint=64))
    layer = model[0]
    assert layer.weight is linear.weight  # the plain weight is kept, not copied
    assert use_few_rows_kernel(model, kernel) == 1
    calls: list[int] = []

    def counted(x: torch.Tensor, weight: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        calls.append(x.shape[0])
        return kernel.few_rows_linear(x, weight, b)

    monkeypatch.setattr(layer, "few_rows", counted)
    for rows in range(1, FEW_ROWS + 3):
        x = torch.randn(rows, 96)
        with torch.inference_mode():
            torch.testing.assert_close(layer(x), linear(x), rtol=1e-5, atol=1e-5)
    assert calls == list(range(1, FEW_ROWS + 1))  # more rows run on oneDNN
