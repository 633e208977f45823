"""How the CPU kernels are built and loaded: flags, names, a failed build, a prebuilt one."""

from __future__ import annotations

import logging

from fleetllm.engine import cpu_kernels


def test_flags_follow_the_cpu():
    v3 = frozenset({"avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm", "sse4_2"})
    assert "-march=x86-64-v3" in cpu_kernels.compile_flags("x86_64", v3)
    assert not any(
        f.startswith("-march") for f in cpu_kernels.compile_flags("x86_64", v3 - {"avx2"})
    )
    assert not any(f.startswith("-march") for f in cpu_kernels.compile_flags("aarch64", v3))
    # A different flag set is a different build, never the other one's binary.
    assert cpu_kernels.kernel_name(["-O3"]) != cpu_kernels.kernel_name(["-O3", "-mavx2"])


def test_every_source_file_is_part_of_the_build_name(monkeypatch, tmp_path):
    """A change to any source or header is a new build, never the old binary."""
    names = {cpu_kernels.kernel_name(["-O3"])}
    files = [*cpu_kernels.SOURCES, *cpu_kernels.HEADERS]
    for path in files:
        edited = tmp_path / path.name
        edited.write_bytes(path.read_bytes() + b"\n// edited\n")
        swap = {path: edited}
        monkeypatch.setattr(
            cpu_kernels, "SOURCES", tuple(swap.get(p, p) for p in cpu_kernels.SOURCES)
        )
        monkeypatch.setattr(
            cpu_kernels, "HEADERS", tuple(swap.get(p, p) for p in cpu_kernels.HEADERS)
        )
        names.add(cpu_kernels.kernel_name(["-O3"]))
        monkeypatch.undo()
    assert len(names) == len(files) + 1


def test_a_build_that_cannot_happen_leaves_the_reference(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("FLEETLLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "no-such-compiler")
    cpu_kernels.load_kernel.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="fleetllm.engine.cpu_kernels"):
            assert cpu_kernels.load_kernel() is None
    finally:
        cpu_kernels.load_kernel.cache_clear()
    assert "no C++ compiler ('no-such-compiler')" in caplog.records[0].reason
    assert not any(tmp_path.iterdir())


def test_a_built_kernel_is_loaded_without_a_compiler(kernel, monkeypatch):
    """What an image does: the kernel built in it, no compiler at run time."""
    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.setenv("PATH", "")
    cpu_kernels.load_kernel.cache_clear()
    try:
        module = cpu_kernels.load_kernel()
    finally:
        cpu_kernels.load_kernel.cache_clear()
    assert module is not None
    for name in ("paged_decode", "add_rms_norm", "rotary_qk", "silu_and_mul"):
        assert hasattr(module, name)
