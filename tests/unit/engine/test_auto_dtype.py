"""dtype="auto": the fastest dtype the device computes natively, from a capability probe."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fleetllm.engine import cpu_features
from fleetllm.engine.config import ModelConfig, resolve_dtype

CPU = torch.device("cpu")
AVX2_ONLY = frozenset({"fpu", "sse4_2", "avx", "avx2", "fma"})
AVX512_NO_BF16 = AVX2_ONLY | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
ZEN4 = AVX512_NO_BF16 | {"avx512_bf16"}
SAPPHIRE_RAPIDS = AVX512_NO_BF16 | {"amx_tile", "amx_bf16", "amx_int8"}


def model(torch_dtype: str | None) -> ModelConfig:
    return ModelConfig.from_dict(
        {
            "model_type": "llama",
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_hidden_layers": 2,
            "vocab_size": 256,
            "intermediate_size": 128,
            "torch_dtype": torch_dtype,
        }
    )


@pytest.fixture
def flags(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)

    def use(value: frozenset[str]) -> None:
        monkeypatch.setattr(cpu_features, "cpu_flags", lambda: value)

    return use


@pytest.mark.parametrize("checkpoint", ["bfloat16", "float16", "float32", None])
@pytest.mark.parametrize(
    ("cpu", "want"),
    [
        (AVX2_ONLY, torch.float32),
        (AVX512_NO_BF16, torch.float32),  # oneDNN emulates bf16 there: slower than float32
        (ZEN4, torch.bfloat16),
        (SAPPHIRE_RAPIDS, torch.bfloat16),
        (frozenset(), torch.float32),  # flags unknown: the safe choice
    ],
)
def test_auto_on_the_cpu_follows_native_bf16(flags, cpu, want, checkpoint) -> None:
    flags(cpu)
    dtype, why = resolve_dtype("auto", model(checkpoint), CPU)
    assert dtype == want
    assert ("natively" in why) == (want == torch.bfloat16)


@pytest.mark.parametrize(
    ("cap", "want"),
    [
        ("AVX2", torch.float32),
        ("avx512_core", torch.float32),  # oneDNN reads the value in any case
        ("AVX512_CORE_BF16", torch.bfloat16),
        ("AVX512_CORE_AMX", torch.bfloat16),
        ("", torch.bfloat16),
    ],
)
def test_auto_follows_onednns_instruction_set_cap(monkeypatch, flags, cap, want) -> None:
    """Capped below its bfloat16 instructions, oneDNN runs bfloat16 as an older CPU would."""
    flags(ZEN4)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    dtype, why = resolve_dtype("auto", model("bfloat16"), CPU)
    assert dtype == want
    assert ("keeps oneDNN off bfloat16" in why) == (want == torch.float32)


@pytest.mark.parametrize("cpu", [AVX2_ONLY, ZEN4])
@pytest.mark.parametrize("name", ["float32", "bfloat16", "float16"])
def test_explicit_dtypes_stay_as_given(flags, cpu, name: str) -> None:
    flags(cpu)
    assert resolve_dtype(name, model("bfloat16"), CPU) == (getattr(torch, name), "as configured")


def test_unknown_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="int4"):
        resolve_dtype("int4", model(None), CPU)


@pytest.mark.parametrize(
    ("checkpoint", "has_bf16", "want"),
    [
        ("bfloat16", True, torch.bfloat16),
        ("float32", True, torch.bfloat16),
        ("float16", True, torch.float16),
        ("bfloat16", False, torch.float16),
        ("float32", False, torch.float16),
    ],
)
def test_auto_on_a_gpu_takes_the_checkpoint_dtype(
    monkeypatch: pytest.MonkeyPatch, flags, checkpoint: str, has_bf16: bool, want
) -> None:
    flags(AVX2_ONLY)  # the host CPU plays no part
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: has_bf16)
    assert resolve_dtype("auto", model(checkpoint), torch.device("cuda"))[0] == want


def test_flags_are_read_from_cpuinfo(tmp_path: Path) -> None:
    x86 = tmp_path / "x86"
    x86.write_text(
        "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu avx2 avx512f avx512_bf16\n\n"
        "processor\t: 1\nflags\t\t: fpu avx2 avx512f avx512_bf16\n"
    )
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n")
    assert cpu_features.cpu_flags(x86) == {"fpu", "avx2", "avx512f", "avx512_bf16"}
    assert cpu_features.native_bf16(cpu_features.cpu_flags(x86))
    assert cpu_features.cpu_flags(arm) == {"fp", "asimd", "bf16", "i8mm"}
    assert not cpu_features.native_bf16(cpu_features.cpu_flags(arm))
    assert cpu_features.cpu_flags(tmp_path / "missing") == frozenset()
    assert cpu_features.describe(frozenset({"avx2", "sse"})) == "avx2"
