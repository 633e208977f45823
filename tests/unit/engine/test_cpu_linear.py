"""Prepacked linear layers compute what nn.Linear computes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fleetllm.engine.cpu_linear import PackedLinear, pack_linear_layers, packing_supported

HALF = [d for d in (torch.bfloat16, torch.float16) if packing_supported(d, torch.device("cpu"))]
PACKED = [*HALF, torch.float32] if packing_supported(torch.float32, torch.device("cpu")) else HALF
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def test_what_is_packed(monkeypatch) -> None:
    assert not packing_supported(torch.bfloat16, torch.device("meta"))
    assert not packing_supported(torch.float64, torch.device("cpu"))
    for machine, packed in (("x86_64", True), ("aarch64", False)):
        monkeypatch.setattr("platform.machine", lambda machine=machine: machine)
        assert packing_supported(torch.float32, torch.device("cpu")) == (
            packed and torch.backends.mkldnn.is_available()
        )


@pytest.mark.parametrize("dtype", PACKED)
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
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)


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
