"""The engine's C++ kernels for CPUs (`csrc/`): built on first use, loaded once.

One extension module holds them all: decode and prefill attention over the paged KV cache
(`cpu_attention.py`), the fused elementwise steps of a layer (`layer_ops.py`) and float32
linear layers on a few rows (`cpu_linear.py`). It is
compiled on first use with the machine's C++ compiler, through torch's extension builder, and
kept under the fleetllm cache (`<cache>/kernels/<name>/`); the name carries a hash of the
sources, the flags and the torch version, so a stale build is never loaded. Where no compiler
is found or the build fails, the engine runs on torch's own ops, with a warning that says why:
the kernels make the engine faster, never required.
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
from fleetllm.engine.model_files import cache_root

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = tuple(
    CSRC / name
    for name in (
        "cpu_bindings.cpp",
        "cpu_paged_attention.cpp",
        "cpu_paged_prefill.cpp",
        "cpu_layer_ops.cpp",
        "cpu_few_rows_linear.cpp",
    )
)
HEADERS = (CSRC / "cpu_kernels.h", CSRC / "cpu_attention_common.h")
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
    parts = [path.read_bytes() for path in (*SOURCES, *HEADERS)]
    parts += [" ".join(cflags).encode(), torch.__version__.encode(), python.encode()]
    digest = hashlib.sha256(b"\0".join(parts)).hexdigest()
    return f"fleetllm_cpu_kernels_{digest[:16]}"


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
    except Exception as exc:  # any failure leaves torch's ops in place, never the engine down
        log.warning(
            "CPU kernels unavailable; attention and the layers' elementwise steps run on torch ops",
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
        "building the CPU kernels (once per machine, about a minute)",
        extra={"directory": str(build_dir), "flags": " ".join(cflags)},
    )
    start = time.monotonic()
    module = cpp_extension.load(
        name,
        sources=[str(path) for path in SOURCES],
        extra_cflags=cflags,
        extra_ldflags=list(LDFLAGS),
        build_directory=str(build_dir),
        verbose=False,
    )
    log.info("CPU kernels built", extra={"seconds": round(time.monotonic() - start, 1)})
    return module


def _put_ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH; the `ninja` package installs one next to the
    interpreter, which is not on PATH when the virtual environment is not activated."""
    if shutil.which("ninja") is not None:
        return
    import ninja  # type: ignore[import-untyped]

    os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
