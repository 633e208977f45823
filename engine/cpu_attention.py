"""Decode attention on the CPU with a C++ kernel (`csrc/cpu_paged_attention.cpp`).

The torch reference gathers every decode's blocks into a dense tensor padded to the longest
context and runs SDPA over all of it; on a CPU that is most of a decode step's attention time.
The kernel reads each sequence's own tokens straight from its blocks, once, in float32
arithmetic, on torch's threads (figures in docs/engine.md, "On a CPU").

The kernel is compiled on first use with the machine's C++ compiler, through torch's extension
builder, and kept under the fleetllm cache (`<cache>/kernels/<name>/`); the name carries a hash
of the source, the flags and the torch version, so a stale build is never loaded. Where no
compiler is found or the build fails, decode attention stays on the torch reference, with a
warning that says why: the kernel makes the engine faster, never required.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

from fleetllm.engine import cpu_features
from fleetllm.engine.attention import AttentionMetadata, TorchPagedAttention
from fleetllm.engine.kv_cache import KVCache
from fleetllm.engine.model_files import cache_root

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "cpu_paged_attention.cpp"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# x86-64-v3 (AVX2, FMA, F16C, ...) is what every x86 CPU of the last decade has, so one build
# serves them all, an image's included; older CPUs get a baseline build.
X86_64_V3_FLAGS = frozenset({"avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"})
# -ffast-math lets the compiler vectorize the reductions and exp (through libmvec); it is given
# to the compiler only, so it does not change the floating-point mode of the whole process.
BASE_CFLAGS = ("-O3", "-ffast-math", "-fopenmp")
LDFLAGS = ("-fopenmp",)  # the parallel loops are OpenMP regions on torch's own runtime


def compile_flags(machine: str | None = None, flags: frozenset[str] | None = None) -> list[str]:
    machine = platform.machine() if machine is None else machine
    flags = cpu_features.cpu_flags() if flags is None else flags
    isa = ["-march=x86-64-v3"] if machine == "x86_64" and flags >= X86_64_V3_FLAGS else []
    return [*BASE_CFLAGS, *isa]


def kernel_name(cflags: list[str]) -> str:
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    parts = [SOURCE.read_bytes(), " ".join(cflags).encode(), torch.__version__.encode()]
    identity = b"\0".join([*parts, python.encode()])
    return f"fleetllm_cpu_attention_{hashlib.sha256(identity).hexdigest()[:16]}"


@functools.cache
def load_kernel() -> ModuleType | None:
    """The compiled kernel module, built first if this machine has no build of it yet; None
    (and a warning) where it cannot be built."""
    cflags = compile_flags()
    name = kernel_name(cflags)
    build_dir = cache_root() / "kernels" / name
    built = build_dir / f"{name}.so"
    try:
        if built.is_file():
            return _import(name, built)
        return _build(name, cflags, build_dir)
    except Exception as exc:  # any failure leaves the reference in place, never the engine down
        log.warning(
            "CPU attention kernel unavailable; decode attention runs on the torch reference",
            extra={"reason": f"{type(exc).__name__}: {str(exc)[-800:]}"},
        )
        return None


def _import(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(name: str, cflags: list[str], build_dir: Path) -> ModuleType:
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler ({compiler!r}) on PATH")
    _put_ninja_on_path()
    build_dir.mkdir(parents=True, exist_ok=True)
    log.info(
        "building the CPU attention kernel (once per machine, about a minute)",
        extra={"directory": str(build_dir), "flags": " ".join(cflags)},
    )
    start = time.monotonic()
    module = cpp_extension.load(
        name,
        sources=[str(SOURCE)],
        extra_cflags=cflags,
        extra_ldflags=list(LDFLAGS),
        build_directory=str(build_dir),
        verbose=False,
    )
    log.info("CPU attention kernel built", extra={"seconds": round(time.monotonic() - start, 1)})
    return module


def _put_ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH; the `ninja` package installs one next to the
    interpreter, which is not on PATH when the virtual environment is not activated."""
    if shutil.which("ninja") is not None:
        return
    import ninja  # type: ignore[import-untyped]

    os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"


def supported(dtype: torch.dtype, device: torch.device, kv_cache_dtype: str) -> bool:
    """Whether the kernel can serve this engine: a CPU, a cache in the model's dtype."""
    return device.type == "cpu" and kv_cache_dtype == "auto" and dtype in DTYPES


class CpuPagedAttention(TorchPagedAttention):
    """The reference with decodes run by the CPU kernel (prefill stays on SDPA, which is
    efficient for many query rows)."""

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, kernel: ModuleType
    ) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self.kernel = kernel

    def decode(
        self,
        q: torch.Tensor,
        k_cache: KVCache,
        v_cache: KVCache,
        md: AttentionMetadata,
        out: torch.Tensor,
    ) -> None:
        n = md.num_decodes
        assert md.decode_tables is not None and md.decode_context_lens is not None
        self.kernel.paged_decode(
            q[:n].contiguous(),
            k_cache,
            v_cache,
            md.decode_tables,
            md.decode_context_lens,
            md.block_size,
            self.scale,
            out[:n],
        )
