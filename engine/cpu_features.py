"""What the host CPU computes natively, read from the flags Linux reports (no torch needed).

bfloat16 pays off on a CPU only when its matrix units take bfloat16 operands directly
(AVX512-BF16, AMX-BF16); elsewhere oneDNN converts every operand to float32 and back, which
runs several times slower than float32 itself.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
# oneDNN's instruction-set cap (ONEDNN_MAX_CPU_ISA, which torch's matmuls obey) at any of these
# keeps its kernels off the bfloat16 units even where the CPU has them.
ISA_CAPS_WITHOUT_BF16 = frozenset(
    {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"}
)
REPORTED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")


@functools.cache
def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The first CPU's feature flags (empty where the kernel does not report them)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def native_bf16(flags: frozenset[str] | None = None, isa_cap: str | None = None) -> bool:
    """Whether bfloat16 matmuls run on bfloat16 units: the CPU has them and oneDNN's ISA cap
    (default: the environment's) does not keep its kernels off them."""
    if isa_cap is None:
        isa_cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "")
    if isa_cap.upper() in ISA_CAPS_WITHOUT_BF16:
        return False
    return bool((cpu_flags() if flags is None else flags) & NATIVE_BF16_FLAGS)


def describe(flags: frozenset[str] | None = None) -> str:
    """The flags that matter for matmul speed, for logs and benchmark reports."""
    flags = cpu_flags() if flags is None else flags
    shown = [f for f in REPORTED_FLAGS if f in flags]
    return " ".join(shown) if shown else "none of " + " ".join(REPORTED_FLAGS)
