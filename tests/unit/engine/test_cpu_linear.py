"""Prepacked half-precision linear layers compute what nn.Linear computes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fleetllm.engine.cpu_linear import PackedLinear, pack_linear_layers, packing_supported

HALF = [d for d in (torch.bfloat16, torch.float16) if packing_supported(d, torch.device("cpu"))]


def test_only_half_precision_on_the_cpu_is_packed() -> None:
    assert not packing_supported(torch.float32, torch.device("cpu"))
    assert not packing_supported(torch.bfloat16, torch.device("meta"))


@pytest.mark.skipif(not HALF, reason="this CPU's oneDNN has no half-precision matmul")
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_matches_linear(dtype: torch.dtype, rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    linear = nn.Linear(96, 160, bias=bias).to(dtype)
    packed = PackedLinear(linear, batch_hint=64)
    x = torch.randn(rows, 96, dtype=dtype)
    with torch.inference_mode():
        expected = linear(x)
        got = packed(x)
    assert got.dtype == dtype and got.shape == (rows, 160)
    torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2)


@pytest.mark.skipif(not HALF, reason="this CPU's oneDNN has no half-precision matmul")
def test_pack_linear_layers_replaces_every_linear() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 4))).to(HALF[0])
    x = torch.randn(3, 8, dtype=HALF[0])
    with torch.inference_mode():
        before = model(x)
    assert pack_linear_layers(model, batch_hint=4) == 2
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    with torch.inference_mode():
        torch.testing.assert_close(model(x), before, rtol=1e-2, atol=1e-2)
